//! The protocol's seam for the load lab's strategies: CACHE_STRATEGY is
//! read here and nowhere else. `pubsub` (the default) and `poll` run the fleet-wide
//! protocol ([`ReadPath::get`]) and differ only in how waiters wake
//! ([`wake`]); `none`, `naive` and `local` are the baselines it is measured
//! against (`load/compare`). A new strategy is one arm here.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use super::{Answer, Outcome, ReadError, ReadPath, Served, Since, Source, Verdict, Wake};
use crate::{
    cache::{now_millis, Status},
    telemetry::metrics,
};

/// How a read finds its way from Redis to PostgreSQL (CACHE_STRATEGY; see
/// the load-lab issue).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Strategy {
    /// Every request reads PostgreSQL.
    None,
    /// Cache-aside without any coalescing.
    Naive,
    /// Cache-aside with an in-process flight only.
    Local,
    /// Redis lock; waiters poll the value every POLL_INTERVAL.
    Poll,
    /// Redis lock; waiters are woken by pub/sub (the default).
    Pubsub,
}

impl Wake {
    /// How the waiters of a strategy learn that the leader is done.
    pub fn of(strategy: Strategy, poll_interval: Duration) -> Self {
        match strategy {
            Strategy::Poll => Self::Poll(poll_interval),
            // The baselines have no waiters; pub/sub is the product.
            Strategy::Pubsub | Strategy::None | Strategy::Naive | Strategy::Local => Self::Message,
        }
    }
}

/// Whether a strategy reads through the memory tier: the baselines that
/// measure Redis alone (`none`, `naive`) do not.
pub(super) fn uses_memory(strategy: Strategy) -> bool {
    match strategy {
        Strategy::Pubsub | Strategy::Poll | Strategy::Local => true,
        Strategy::None | Strategy::Naive => false,
    }
}

/// Whether a strategy's loads are batched (`batch.rs`): the protocol's
/// are; the baselines make a statement per request, as the designs they
/// stand for do.
pub(super) fn batches_loads(strategy: Strategy) -> bool {
    match strategy {
        Strategy::Pubsub | Strategy::Poll => true,
        Strategy::None | Strategy::Naive | Strategy::Local => false,
    }
}

/// Counts a read as in progress until dropped (answered or cancelled).
pub(super) struct InProgress<'a>(&'a AtomicUsize);

impl<'a> InProgress<'a> {
    pub(super) fn enter(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::reads(1.0);
        Self(counter)
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        metrics::reads(-1.0);
    }
}

impl<S: Source> ReadPath<S> {
    /// Reads one item through the cache, with the configured strategy.
    pub async fn read(self: &Arc<Self>, key: S::Key) -> Result<Answer, ReadError> {
        let _in_progress = InProgress::enter(&self.reads_in_progress);
        match self.settings.strategy {
            Strategy::Pubsub | Strategy::Poll => self.get(key).await,
            // Boxed: the product's future does not grow by the baselines'.
            baseline => Box::pin(self.baseline(baseline, key)).await,
        }
    }

    /// The load lab's baselines.
    async fn baseline(self: &Arc<Self>, strategy: Strategy, key: S::Key) -> Outcome {
        match strategy {
            // Not baselines: the product.
            Strategy::Pubsub | Strategy::Poll => self.get(key).await,
            // Every request reads the source.
            Strategy::None => {
                tracing::Span::current().record("role", "direct");
                Answer::new(
                    self.loader.entry(&key, Since::PRIMARY).await?,
                    Served::Bypass,
                )
            }
            // Cache-aside, every miss loads.
            Strategy::Naive => match self.baseline_look_up(&key).await {
                Ok(answer) => answer,
                Err(redis_up) => {
                    tracing::Span::current().record("role", "naive");
                    self.cache_aside(&key, redis_up).await
                }
            },
            // Cache-aside, one load per key per process.
            Strategy::Local => {
                if let Some(answer) = self.from_memory(&key, now_millis()) {
                    return answer;
                }
                let ticket = self.memory.ticket(&key);
                match self.baseline_look_up(&key).await {
                    Ok(answer) => {
                        if let Ok(answer) = &answer {
                            self.keep_in_memory(&key, answer, &ticket);
                        }
                        answer
                    }
                    Err(redis_up) => {
                        self.in_flight(key, move |this, key| async move {
                            let answer = this.cache_aside(&key, redis_up).await;
                            if let Ok(answer) = &answer {
                                this.keep_in_memory(&key, answer, &ticket);
                            }
                            answer
                        })
                        .await
                    }
                }
            }
        }
    }

    /// A baseline's first GET: a fresh entry (no early refresh) or a backoff
    /// copy is served; anything else is a miss, `Err(redis_up)`.
    async fn baseline_look_up(&self, key: &S::Key) -> Result<Outcome, bool> {
        let (verdict, looked) = self.look_up(key, now_millis(), Duration::ZERO).await;
        match verdict {
            Verdict::Fresh(entry) => Ok(Answer::new(entry, Served::Hit)),
            Verdict::Backoff(entry) => Ok(Answer::new(entry, Served::Stale)),
            Verdict::StaleInGrace(_) | Verdict::Failed | Verdict::TooLarge | Verdict::Miss => {
                Err(looked.redis_up)
            }
        }
    }

    /// Load, then SET the value for its freshness: no lock, no waiting.
    async fn cache_aside(&self, key: &S::Key, redis_up: bool) -> Outcome {
        if !redis_up {
            return self.loader.bypass(key).await;
        }
        let entry = self.loader.entry(key, Since::PRIMARY).await?;
        if self.loader.too_large(&entry) {
            return Answer::new(entry, Served::TooLarge);
        }
        if entry.status() != Status::Failed {
            let ttl = Duration::from_millis(entry.fresh_until().saturating_sub(entry.stored_at()));
            if let Err(error) = self.redis.store(&self.keys.value(key), &entry, ttl).await {
                tracing::warn!(%error, "failed to store the entry");
            }
        }
        Answer::new(entry, Served::Miss)
    }
}
