//! The leader's part: the one request in the fleet that holds the lock for a
//! key loads it, keeps the lock alive while it loads, and finishes in one
//! round trip (store, publish, release). Its hold on the lock is a guard
//! ([`Held`]): a leader that vanishes without finishing lets go at once.

use std::time::{Duration, Instant};

use rand::Rng;
use tokio_util::task::TaskTracker;

use super::{
    freshness::{judge, store_for, Lifetimes, StoreFor, Verdict},
    redis::{with_backoff, RETRY_FIRST},
    Answer, Outcome, ReadPath, RedisCommands, RedisError, Served, Source,
};
use crate::cache::{now_millis, Entry, ItemKeys, Status};
use crate::telemetry::metrics;

/// A finish to retry in the background, with what it was first sent with.
struct Finish {
    keys: ItemKeys,
    held: Held,
    entry: Entry,
    store: StoreFor,
    fence: String,
    cutoff: u64,
}

/// A leader's hold on a key's lock, from its election to its finish.
///
/// Dropped while still held (the leader's task panicked, or was dropped at
/// shutdown, at any await) it lets go at once, in the background: the lock
/// released if it still holds the token, and `retry` published, so that the
/// waiters elsewhere elect a new leader now instead of sleeping until
/// LOCK_TTL. Pingora's `WritePermit` marks its lock dangling on drop the
/// same way. A finish or a release takes the lock over with
/// [`Held::handed_over`].
pub(super) struct Held {
    redis: RedisCommands,
    tasks: TaskTracker,
    lock: String,
    channel: String,
    token: String,
    lock_ttl: Duration,
    /// Still ours to let go of.
    held: bool,
}

impl Held {
    fn new<S: Source>(path: &ReadPath<S>, keys: &ItemKeys, token: &str) -> Self {
        Self {
            redis: path.redis.clone(),
            tasks: path.tasks.clone(),
            lock: keys.lock.clone(),
            channel: keys.channel.clone(),
            token: token.to_owned(),
            lock_ttl: path.settings.lock_ttl,
            held: true,
        }
    }

    fn token(&self) -> &str {
        &self.token
    }

    /// A finish or a release has dealt with the lock (or given up on it,
    /// leaving it to expire): nothing left to do on drop.
    fn handed_over(mut self) {
        self.held = false;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        metrics::lock_abandoned();
        tracing::warn!(
            lock = self.lock,
            "leader gone without finishing; letting go of its lock"
        );
        // Outside a runtime (it is gone): the lock expires by itself.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let redis = self.redis.clone();
        let (lock, channel, token) = (
            std::mem::take(&mut self.lock),
            std::mem::take(&mut self.channel),
            std::mem::take(&mut self.token),
        );
        let give_up = Instant::now() + self.lock_ttl;
        self.tasks.spawn_on(
            async move {
                let abandon = || redis.abandon(&lock, &channel, &token);
                match with_backoff(give_up, abandon).await {
                    Ok(true) => tracing::info!(lock, "lock let go; its waiters elect again"),
                    Ok(false) => {}
                    Err(error) => {
                        tracing::warn!(%error, lock, "could not let go of the lock; it expires by itself")
                    }
                }
            },
            &runtime,
        );
    }
}

/// A lock attempt until Redis answers it (see [`ReadPath::try_lock`]).
struct Attempt<'a, S: Source> {
    path: &'a ReadPath<S>,
    lock: &'a str,
    token: &'a str,
    answered: bool,
}

impl<S: Source> Drop for Attempt<'_, S> {
    fn drop(&mut self) {
        if !self.answered {
            self.path
                .release_in_background(self.lock.to_owned(), self.token.to_owned());
        }
    }
}

/// How a leader's turn ended.
pub(super) enum Led {
    /// With an outcome for its flight.
    Done(Outcome),
    /// Fenced: a change to the item was applied while it loaded, so what it
    /// read (given here) may predate the change. Nothing was stored, and its
    /// waiters were told to elect a leader again; so should its own flight.
    Fenced(Entry),
}

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
    ) -> Led {
        let held = Held::new(self, keys, token);
        // Double-check, and the change fence. The previous leader may have
        // finished between our first GET and our SET NX (its lock gone, its
        // value in place): do not load twice. The fence is read before the
        // row: a change applied after this point makes our finish store
        // nothing (see FINISH_LUA).
        let mut fence = String::new();
        match self.redis.before_load(keys).await {
            Ok(before) => {
                fence = before.fence;
                let verdict = judge(before.entry, now_millis(), Duration::ZERO, self.cutoff());
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
                    match self.redis.release(&keys.lock, token).await {
                        Ok(_) => held.handed_over(),
                        // Dropped while held: let go in the background.
                        Err(error) => {
                            tracing::warn!(%error, "failed to release an unused lock; retrying")
                        }
                    }
                    return Led::Done(done);
                }
            }
            Err(error) => {
                tracing::warn!(%error, "redis failed after taking the lock; loading anyway")
            }
        }
        let loaded = self.load_under_watchdog(key, &keys.lock, token).await;
        #[cfg(feature = "testkit")]
        if let Some(hook) = &self.settings.hooks.after_load {
            hook(keys.value.clone()).await;
        }
        // Over MAX_ENTRY_BYTES: a marker is stored and published in its
        // place (waiters elsewhere load it themselves), and this flight,
        // with the requests that joined it here, is answered with the body.
        let (entry, too_large) = self.to_store(loaded);
        let answer = |published: Entry, ours: &Entry, too_large: Option<Entry>| match too_large {
            Some(body) => Answer::new(body, Served::TooLarge),
            // A marker another leader stored (our lock had expired): we
            // hold the row, serve it.
            None if published.status() == Status::TooLarge => {
                Answer::new(ours.clone(), self.served_uncached(ours))
            }
            None => Answer::new(published, Served::Miss),
        };
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
        let cutoff = self.cutoff();
        match self
            .redis
            .finish(keys, token, &entry, store, &fence, cutoff)
            .await
        {
            Ok(finished) => {
                held.handed_over();
                if !finished.released {
                    // Our lock expired during the load and someone else took
                    // it: the finish left their lock alone (token check).
                    tracing::warn!(
                        lock = keys.lock,
                        "lock expired during the load and was not ours to release"
                    );
                }
                let Some(published) = finished.published else {
                    metrics::fenced();
                    tracing::debug!(%key, "a change was applied during the load: fenced");
                    return Led::Fenced(too_large.unwrap_or(entry));
                };
                // Read before a cutoff raised meanwhile (`invalidate --all`,
                // a truncate): stale already, as a change would have made it.
                if published.read_at() < self.cutoff() {
                    metrics::fenced();
                    tracing::debug!(%key, "the cutoff was raised during the load: fenced");
                    return Led::Fenced(too_large.unwrap_or(entry));
                }
                if entry.status() == Status::Failed && published.status() == Status::Found {
                    tracing::warn!(%key, "load failed; serving the stored copy");
                }
                Led::Done(answer(published, &entry, too_large))
            }
            Err(error) => {
                // This flight is answered at once; the waiters elsewhere are
                // answered when a retry gets through.
                tracing::warn!(%error, "finish failed; retrying in the background");
                let retry = Finish {
                    keys: keys.clone(),
                    held,
                    entry: entry.clone(),
                    store,
                    fence,
                    cutoff,
                };
                self.finish_in_background(retry);
                Led::Done(answer(entry.clone(), &entry, too_large))
            }
        }
    }

    /// Tries to take `keys.lock` with `token` (SET NX PX LOCK_TTL).
    ///
    /// An attempt that ends without an answer (a timeout, a dropped
    /// connection, or its future dropped) may still run later, when Redis
    /// catches up or the client replays it after a reconnect, leaving a lock
    /// nobody holds until LOCK_TTL and its waiters to WAIT_TIMEOUT: the
    /// [`Attempt`] guard then queues a token-checked release behind it.
    pub(super) async fn try_lock(&self, keys: &ItemKeys, token: &str) -> Result<bool, RedisError> {
        let mut attempt = Attempt {
            path: self,
            lock: &keys.lock,
            token,
            answered: false,
        };
        let result = self
            .redis
            .try_lock(&keys.lock, token, self.settings.lock_ttl)
            .await;
        // An answer, or a refusal by the breaker: nothing went out.
        attempt.answered = matches!(result, Ok(_) | Err(RedisError::CircuitOpen));
        result
    }

    /// Retries a failed finish (store, publish, release) with backoff until
    /// it gets through, or until LOCK_TTL has passed: by then the lock has
    /// expired and the waiters have woken to look for themselves. A finish
    /// that timed out may still have run: running it again is harmless (the
    /// fencing lets the same entry be stored and published twice).
    fn finish_in_background(&self, f: Finish) {
        let redis = self.redis.clone();
        let give_up = Instant::now() + self.settings.lock_ttl;
        self.tasks.spawn(async move {
            // The first attempt has just failed.
            tokio::time::sleep(RETRY_FIRST).await;
            let token = f.held.token();
            let finish = || redis.finish(&f.keys, token, &f.entry, f.store, &f.fence, f.cutoff);
            match with_backoff(give_up, finish).await {
                Ok(_) => tracing::info!(lock = f.keys.lock, "finished on a retry"),
                Err(error) => {
                    tracing::warn!(%error, lock = f.keys.lock, "gave up finishing; the lock expires by itself")
                }
            }
            f.held.handed_over();
        });
    }

    /// Releases `lock` if it holds `token`, in the background, retried with
    /// backoff for up to LOCK_TTL; never refused by the breaker.
    fn release_in_background(&self, lock: String, token: String) {
        let redis = self.redis.clone();
        let give_up = Instant::now() + self.settings.lock_ttl;
        self.tasks.spawn(async move {
            let release = || redis.release(&lock, &token);
            if let Ok(true) = with_backoff(give_up, release).await {
                tracing::info!(lock, "released a lock taken after its attempt gave up");
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
