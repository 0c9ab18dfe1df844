//! The leader's part: the one request in the fleet that holds the lock for a
//! key loads it, keeps the lock alive while it loads, and finishes in one
//! round trip (store, publish, release).

use std::time::{Duration, Instant};

use rand::Rng;

use super::{
    freshness::{judge, store_for, Lifetimes, StoreFor, Verdict},
    Answer, Outcome, ReadPath, Served, Source,
};
use crate::cache::{now_millis, Entry, ItemKeys, Status};

/// The first pause before a finish is retried; it doubles up to the second.
const FINISH_RETRY_FIRST: Duration = Duration::from_millis(20);
const FINISH_RETRY_MAX: Duration = Duration::from_millis(100);

/// A random token naming one leader's hold on a lock: only its holder may
/// extend or release it.
pub(super) fn lock_token() -> String {
    format!("{:032x}", rand::rng().random::<u128>())
}

impl<S: Source> ReadPath<S> {
    /// Leads the load of `key`, holding `keys.lock` with `token`.
    ///
    /// `seen` (a background refresh): the stored_at of the entry being
    /// replaced, which the double-check must not take for a newer one.
    pub(super) async fn lead(
        &self,
        key: &S::Key,
        keys: &ItemKeys,
        token: &str,
        seen: Option<u64>,
    ) -> Outcome {
        // Double-check. The previous leader may have finished between our
        // first GET and our SET NX (its lock gone, its value in place): do
        // not load twice.
        match self.redis.lookup(&keys.value).await {
            Ok(entry) => {
                let verdict = judge(entry, now_millis(), Duration::ZERO);
                // A refresh must not settle for the very entry it replaces.
                let replaced = matches!(&verdict,
                    Verdict::Fresh(e) | Verdict::Backoff(e)
                        if seen.is_some_and(|seen| e.stored_at() <= seen));
                let done = if replaced {
                    None
                } else {
                    verdict.settle(Served::CoalescedRemote)
                };
                if let Some(done) = done {
                    if let Err(error) = self.redis.release(&keys.lock, token).await {
                        tracing::warn!(%error, "failed to release an unused lock; it expires by itself");
                    }
                    return done;
                }
            }
            Err(error) => {
                tracing::warn!(%error, "redis failed after taking the lock; loading anyway")
            }
        }
        let entry = self.load_under_watchdog(key, &keys.lock, token).await;
        let s = &self.settings;
        let store = store_for(
            &entry,
            Lifetimes {
                stale_while_revalidate: s.stale_while_revalidate,
                max_stale: s.max_stale,
                failure_ttl: if s.failure_ttl.is_zero() {
                    Duration::ZERO
                } else {
                    s.jitter.apply(s.failure_ttl)
                },
            },
        );
        match self.redis.finish(keys, token, &entry, store).await {
            Ok(finished) => {
                if !finished.released {
                    // Our lock expired during the load and someone else took
                    // it: the finish left their lock alone (token check).
                    tracing::warn!(
                        lock = keys.lock,
                        "lock expired during the load and was not ours to release"
                    );
                }
                if entry.status() == Status::Failed && finished.published.status() == Status::Found
                {
                    tracing::warn!(%key, "load failed; serving the stored copy");
                }
                Answer::new(finished.published, Served::Miss)
            }
            Err(error) => {
                // This flight is answered at once; the waiters elsewhere are
                // answered when a retry gets through.
                tracing::warn!(%error, "finish failed; retrying in the background");
                self.finish_in_background(keys.clone(), token.to_owned(), entry.clone(), store);
                Answer::new(entry, Served::Miss)
            }
        }
    }

    /// Retries a failed finish (store, publish, release) with backoff until
    /// it gets through, or until LOCK_TTL has passed: by then the lock has
    /// expired and the waiters have woken to look for themselves. A finish
    /// that timed out may still have run: running it again is harmless (the
    /// fencing lets the same entry be stored and published twice).
    fn finish_in_background(&self, keys: ItemKeys, token: String, entry: Entry, store: StoreFor) {
        let redis = self.redis.clone();
        let give_up = Instant::now() + self.settings.lock_ttl;
        self.tasks.spawn(async move {
            let mut backoff = FINISH_RETRY_FIRST;
            loop {
                tokio::time::sleep(backoff).await;
                match redis.finish(&keys, &token, &entry, store).await {
                    Ok(_) => {
                        tracing::info!(lock = keys.lock, "finished on a retry");
                        return;
                    }
                    Err(error) if Instant::now() >= give_up => {
                        tracing::warn!(%error, lock = keys.lock, "gave up finishing; the lock expires by itself");
                        return;
                    }
                    Err(_) => backoff = (backoff * 2).min(FINISH_RETRY_MAX),
                }
            }
        });
    }

    /// After a lock attempt that failed without an answer (a timeout, a
    /// dropped connection), the SET NX may still run later, when Redis
    /// catches up or when the client replays it after a reconnect, leaving
    /// a lock nobody holds until LOCK_TTL and its waiters to WAIT_TIMEOUT.
    /// Releasing it (token-checked, never refused by the breaker) is queued
    /// behind it and retried with backoff for up to LOCK_TTL.
    pub(super) fn release_in_background(&self, lock: String, token: String) {
        let redis = self.redis.clone();
        let give_up = Instant::now() + self.settings.lock_ttl;
        self.tasks.spawn(async move {
            let mut backoff = FINISH_RETRY_FIRST;
            loop {
                match redis.release(&lock, &token).await {
                    Ok(released) => {
                        if released {
                            tracing::info!(lock, "released a lock taken after its attempt gave up");
                        }
                        return;
                    }
                    Err(_) if Instant::now() >= give_up => return,
                    Err(_) => {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(FINISH_RETRY_MAX);
                    }
                }
            }
        });
    }

    /// Loads while a watchdog extends the lock every third of LOCK_TTL, so a
    /// slow but live leader is not taken over; a dead one stops extending and
    /// its lock expires after LOCK_TTL.
    async fn load_under_watchdog(&self, key: &S::Key, lock: &str, token: &str) -> Entry {
        let load = self.load_entry(key);
        tokio::pin!(load);
        let period = (self.settings.lock_ttl / 3).max(Duration::from_millis(10));
        let mut tick = tokio::time::interval_at((Instant::now() + period).into(), period);
        let mut extending = true;
        loop {
            tokio::select! {
                done = &mut load => return done,
                _ = tick.tick(), if extending => {
                    match self.redis.extend(lock, token, self.settings.lock_ttl).await {
                        Ok(true) => tracing::debug!(lock, "lock extended"),
                        Ok(false) => {
                            tracing::warn!(lock, "lock lost during the load; no longer extending");
                            extending = false;
                        }
                        Err(error) => tracing::debug!(%error, "lock extension failed"),
                    }
                }
            }
        }
    }
}
