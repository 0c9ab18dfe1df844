//! The load lab's baselines: the designs postcache is measured against
//! (`load/compare`), each a reader of its own that the read path puts in
//! front of itself when CACHE_STRATEGY names one. The product's path knows
//! nothing of them: `none` reads the source every time, `naive` is
//! cache-aside without any coalescing, `local` is cache-aside with one load
//! per key per process. `pubsub` (the default) and `poll` are the product
//! itself, differing only in how waiters wake (a setting of its own).

use std::{sync::Arc, time::Duration};

use super::{
    answer::{Answer, Outcome, Served},
    context::Context,
    freshness::{judge, Verdict},
    local::LocalFlights,
    refresh::Refreshes,
    settings::Strategy,
    source::{Since, Source},
};
use crate::{
    cache::{now_millis, Status},
    redis::RedisError,
};

/// A baseline of the load lab (see the module's comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Baseline {
    None,
    Naive,
    Local,
}

/// The reader of a baseline, over the read path's context.
pub(super) struct Lab<S: Source> {
    baseline: Baseline,
    ctx: Arc<Context<S>>,
    /// `local`'s in-process flights (the product's are the read path's own).
    flights: LocalFlights<S::Key, Outcome>,
    /// The read path's background refreshes: a memory hit of `local` may
    /// refresh early, as the read path's own memory hits do.
    refreshes: Arc<Refreshes<S>>,
}

impl<S: Source> Lab<S> {
    /// The reader of `strategy`, `None` for the product's strategies.
    pub fn new(
        strategy: Strategy,
        ctx: &Arc<Context<S>>,
        refreshes: &Arc<Refreshes<S>>,
    ) -> Option<Self> {
        let baseline = match strategy {
            Strategy::Pubsub | Strategy::Poll => return None,
            Strategy::None => Baseline::None,
            Strategy::Naive => Baseline::Naive,
            Strategy::Local => Baseline::Local,
        };
        Some(Self {
            baseline,
            ctx: ctx.clone(),
            flights: LocalFlights::new(ctx.tasks.clone()),
            refreshes: refreshes.clone(),
        })
    }

    /// Reads one item as the baseline does.
    pub async fn read(self: &Arc<Self>, key: S::Key) -> Outcome {
        match self.baseline {
            // Every request reads the source.
            Baseline::None => {
                tracing::Span::current().record("role", "direct");
                Answer::new(
                    self.ctx.loader.entry(&key, Since::PRIMARY).await?,
                    Served::Bypass,
                )
            }
            // Cache-aside, every miss loads.
            Baseline::Naive => match self.look_up(&key).await {
                Ok(answer) => answer,
                Err(redis_up) => {
                    tracing::Span::current().record("role", "naive");
                    self.cache_aside(&key, redis_up).await
                }
            },
            // Cache-aside, one load per key per process.
            Baseline::Local => {
                let ctx = &self.ctx;
                let now = now_millis();
                if let Some(entry) = ctx.memory.get(&key, S::ordinal(&key), now) {
                    if let Verdict::Fresh(entry) =
                        judge(Some(entry), now, Duration::ZERO, ctx.cutoff())
                    {
                        self.refreshes.maybe_early(ctx, &key, &entry, now);
                        return Answer::new(entry, Served::Memory);
                    }
                }
                let ticket = ctx.memory.ticket(&key);
                match self.look_up(&key).await {
                    Ok(answer) => {
                        if let Ok(answer) = &answer {
                            ctx.keep_in_memory(&key, answer, &ticket);
                        }
                        answer
                    }
                    Err(redis_up) => {
                        let patience = ctx.settings.wait_timeout;
                        self.flights
                            .answer(self, key, patience, move |this, key| async move {
                                let answer = this.cache_aside(&key, redis_up).await;
                                if let Ok(answer) = &answer {
                                    this.ctx.keep_in_memory(&key, answer, &ticket);
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
    /// copy is served; anything else is a miss, `Err(redis_up)` (Redis not
    /// known down: only an open breaker says it is).
    async fn look_up(&self, key: &S::Key) -> Result<Outcome, bool> {
        let ctx = &self.ctx;
        let now = now_millis();
        let entry = match ctx.redis.lookup(&ctx.keys.value(key)).await {
            Ok(entry) => entry,
            Err(error @ RedisError::CircuitOpen) => {
                tracing::debug!(%error, "failing open");
                return Err(false);
            }
            Err(error) => {
                tracing::warn!(%error, "redis lookup failed");
                return Err(true);
            }
        };
        match judge(entry, now, Duration::ZERO, ctx.cutoff()) {
            Verdict::Fresh(entry) => Ok(Answer::new(entry, Served::Hit)),
            Verdict::Backoff(entry) => Ok(Answer::new(entry, Served::Stale)),
            Verdict::StaleInGrace(_) | Verdict::Failed | Verdict::TooLarge | Verdict::Miss => {
                Err(true)
            }
        }
    }

    /// Load, then SET the value for its freshness: no lock, no waiting.
    async fn cache_aside(&self, key: &S::Key, redis_up: bool) -> Outcome {
        let ctx = &self.ctx;
        if !redis_up {
            return ctx.loader.bypass(key).await;
        }
        let entry = ctx.loader.entry(key, Since::PRIMARY).await?;
        if ctx.loader.too_large(&entry) {
            return Answer::new(entry, Served::TooLarge);
        }
        if entry.status() != Status::Failed {
            let ttl = Duration::from_millis(entry.fresh_until().saturating_sub(entry.stored_at()));
            if let Err(error) = ctx.redis.store(&ctx.keys.value(key), &entry, ttl).await {
                tracing::warn!(%error, "failed to store the entry");
            }
        }
        Answer::new(entry, Served::Miss)
    }
}
