//! The protocol: the leader's part. The one request in the fleet that
//! holds the lock for a key loads it, keeps the lock alive while it loads,
//! and finishes in one round trip (store, publish, release: the finish
//! script). A [`Leader`] is that work: double-check, load under a watchdog,
//! finish; its hold on the lock is a guard ([`Held`]), so a leader that
//! vanishes without finishing lets go at once.
//!
//! A leader for requests answers them with the row it read as soon as it
//! is read, and finishes in the background (see [`Leader::finish`]): the
//! finish's round trip is not on their path. Its waiters elsewhere are
//! woken by the finish's publish as before, and a finish that is fenced
//! stores nothing and sends them to elect again, as before.

use std::time::{Duration, Instant};

use rand::Rng;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::{
    answer::{Answer, Outcome, ReadError, Served},
    context::Context,
    freshness::{store_for, Lifetimes, Verdict},
    letgo::{abandon, Attempt},
    machine::Led,
    memory::Ticket,
    source::{Busy, Since, Source},
};
use crate::{
    cache::{now_millis, Entry, ItemKeys, Status},
    redis::{
        with_backoff, Before, Finish, Finished, LockOp, OnLock, RedisCommands, RedisError,
        StoreFor, ValueClaim, RETRY_FIRST,
    },
    telemetry::metrics,
};

/// A random token naming one leader's hold on a lock: only its holder may
/// extend or release it.
pub(super) fn lock_token() -> String {
    format!("{:032x}", rand::rng().random::<u128>())
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
    fn new<S: Source>(ctx: &Context<S>, keys: &ItemKeys, token: &str) -> Self {
        Self {
            redis: ctx.redis.clone(),
            tasks: ctx.tasks.clone(),
            lock: keys.lock.clone(),
            channel: keys.channel.clone(),
            token: token.to_owned(),
            lock_ttl: ctx.settings.lock_ttl,
            held: true,
        }
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
        let (lock, channel, token) = (
            std::mem::take(&mut self.lock),
            std::mem::take(&mut self.channel),
            std::mem::take(&mut self.token),
        );
        abandon(
            &self.redis,
            &self.tasks,
            self.lock_ttl,
            lock,
            channel,
            token,
            &runtime,
        );
    }
}

/// The leader of one key's load in the fleet, holding its lock.
pub(super) struct Leader<'a, S: Source> {
    ctx: &'a Context<S>,
    key: &'a S::Key,
    keys: &'a ItemKeys,
    token: &'a str,
    held: Held,
}

impl<'a, S: Source> Leader<'a, S> {
    /// Just elected: holds `keys.lock` with `token`.
    pub fn elected(
        ctx: &'a Context<S>,
        key: &'a S::Key,
        keys: &'a ItemKeys,
        token: &'a str,
    ) -> Self {
        Self {
            held: Held::new(ctx, keys, token),
            ctx,
            key,
            keys,
            token,
        }
    }

    /// Leads the load: double-check, load, finish. `before` is what its
    /// claim read with the lock.
    ///
    /// `seen` (a background refresh): the stored_at of the entry being
    /// replaced, which the double-check must not take for a newer one.
    /// `answer_early`: the leader of requests, which may answer them before
    /// its finish (see [`Leader::finish`]); a refresh has no one to answer.
    pub async fn lead(self, before: Before, seen: Option<u64>, answer_early: bool) -> Led {
        let fence = match self.double_check(before, seen) {
            Ok(fence) => fence,
            Err(done) => return self.release(done).await,
        };
        // Taken before the read: a change applied here after it moves it.
        let early = answer_early.then(|| self.ctx.memory.ticket(self.key));
        // The load's span says what it reads: one row of the source
        // (PostgreSQL's, shared with the other keys of its statement).
        let span = tracing::debug_span!(
            "load",
            db.system.name = "postgresql",
            db.operation.name = "SELECT",
            since = Since::of_fence(&fence).0,
            load_ms = tracing::field::Empty,
        );
        match self.load(Since::of_fence(&fence)).instrument(span).await {
            Ok(loaded) => {
                // The flight's span says it too (the load's recorded its own).
                let load_ms = loaded.load_time().as_secs_f64() * 1e3;
                tracing::Span::current().record("load_ms", load_ms);
                self.finish(loaded, fence, early).await
            }
            Err(Busy) => self.let_go().await,
        }
    }

    /// No connection to the source was free: nothing is stored (the key did
    /// not fail), and the lock is let go at once with `retry` published, so
    /// that a waiter elsewhere, with capacity, leads now.
    async fn let_go(self) -> Led {
        let abandon = OnLock {
            lock: &self.keys.lock,
            token: self.token,
            op: LockOp::Abandon {
                channel: &self.keys.channel,
                sharded: self.ctx.redis.sharded(),
            },
        };
        match self.ctx.redis.eval(&abandon).await {
            Ok(_) => self.held.handed_over(),
            // Dropped while held: let go in the background.
            Err(error) => tracing::warn!(%error, "failed to let go of the lock; retrying"),
        }
        Led::Done(Err(ReadError::Busy))
    }

    /// The previous leader may have finished between our first GET and our
    /// claim (its lock gone, its value in place): do not load twice. The
    /// claim read the change fence too, before the row: a change applied
    /// after it makes our finish store nothing (see the finish script).
    /// `Ok(fence)` to load; `Err(outcome)` when someone finished already.
    fn double_check(&self, before: Before, seen: Option<u64>) -> Result<String, Outcome> {
        let verdict = self.ctx.judge(before.entry, now_millis(), Duration::ZERO);
        // A refresh must not settle for the very entry it replaces.
        let replaced = matches!(&verdict,
            Verdict::Fresh(e) | Verdict::Backoff(e)
                if seen.is_some_and(|seen| e.stored_at() <= seen));
        match verdict.settle(Served::CoalescedRemote) {
            Some(done) if !replaced => Err(done),
            _ => Ok(before.fence),
        }
    }

    /// Lets go of a lock not used, and answers with `done`. `retry` is
    /// published with it: a waiter elsewhere may be sleeping on this lock's
    /// expiry, and what settled this leader (another's backoff copy, which
    /// this process trusts while it has no loads of its own to go by) may
    /// not settle that waiter, which must elect again now, not at
    /// WAIT_TIMEOUT.
    async fn release(self, done: Outcome) -> Led {
        let release = OnLock {
            lock: &self.keys.lock,
            token: self.token,
            op: LockOp::Abandon {
                channel: &self.keys.channel,
                sharded: self.ctx.redis.sharded(),
            },
        };
        match self.ctx.redis.eval(&release).await {
            Ok(_) => self.held.handed_over(),
            // Dropped while held: let go in the background.
            Err(error) => tracing::warn!(%error, "failed to release an unused lock; retrying"),
        }
        Led::Done(done)
    }

    /// Loads while a watchdog extends the lock every third of LOCK_TTL, so a
    /// slow but live leader is not taken over; a dead one stops extending and
    /// its lock expires after LOCK_TTL.
    ///
    /// `since`: the change the claim's fence names, which the row read
    /// must include (a replica that has not replayed it is not read).
    async fn load(&self, since: Since) -> Result<Entry, Busy> {
        let ctx = self.ctx;
        // No older than what this process served (floor.rs): a replica
        // must have replayed that far too.
        let since = since.max(Since(ctx.floors.upto(self.key)));
        let load = ctx.loader.entry(self.key, since);
        tokio::pin!(load);
        let lock_ttl = ctx.settings.lock_ttl;
        let period = (lock_ttl / 3).max(Duration::from_millis(10));
        let mut tick = tokio::time::interval_at((Instant::now() + period).into(), period);
        let mut extending = true;
        let extend = OnLock {
            lock: &self.keys.lock,
            token: self.token,
            op: LockOp::Extend(lock_ttl),
        };
        let loaded = loop {
            tokio::select! {
                done = &mut load => break done,
                _ = tick.tick(), if extending => {
                    match ctx.redis.eval(&extend).await {
                        Ok(true) => tracing::debug!(lock = extend.lock, "lock extended"),
                        Ok(false) => {
                            tracing::warn!(lock = extend.lock, "lock lost during the load; no longer extending");
                            extending = false;
                        }
                        Err(error) => tracing::debug!(%error, "lock extension failed"),
                    }
                }
            }
        };
        #[cfg(feature = "testkit")]
        if let Some(hook) = &ctx.settings.hooks.after_load {
            hook(self.keys.value.clone()).await;
        }
        loaded
    }

    /// Stores and publishes what was loaded, fenced by the lock and the
    /// change fence seen before the read, and releases the lock.
    ///
    /// With `early` (taken before the read), a row read (found, not found
    /// or too large) answers this flight at once, and the finish runs in the
    /// background: the row is what the source held when it was read, during
    /// the flight's requests, so it is theirs to get even if a change lands
    /// before the finish (which then stores nothing and sends the waiters
    /// elsewhere to elect again). Not early, so that the flight reads again
    /// when fenced as before:
    /// - a failed load: the finish answers with the fail-safe copy;
    /// - a change to the item applied by this process since the read began
    ///   (the ticket moved): this process has served the new row or may,
    ///   and must not answer an older one after it;
    /// - a row read before the cutoff, or from a replica (the fence decides
    ///   whether a replica's row is current enough to serve).
    async fn finish(self, loaded: Entry, fence: String, early: Option<Ticket>) -> Led {
        let ctx = self.ctx;
        // Over MAX_ENTRY_BYTES: a marker is stored and published in its
        // place (waiters elsewhere load it themselves), and this flight,
        // with the requests that joined it here, is answered with the body.
        let (entry, too_large) = ctx.loader.to_store(loaded);
        let s = &ctx.settings;
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
        let cutoff = ctx.cutoff();
        if early.is_some_and(|ticket| self.answers_early(&entry, cutoff, &ticket)) {
            let answer = self.answer(entry.clone(), &entry, too_large);
            let finish = (self.keys.clone(), entry, store, fence, cutoff);
            finish_in_background(ctx, self.held, finish, Attempts::FirstNow);
            return Led::Done(answer);
        }
        let finish = Finish {
            keys: self.keys,
            token: self.token,
            entry: &entry,
            store,
            fence: &fence,
            cutoff,
            sharded: ctx.redis.sharded(),
        };
        match ctx
            .redis
            .finish(&finish)
            .instrument(tracing::debug_span!("finish"))
            .await
        {
            Ok(finished) => {
                let led = self.finished(finished, entry, too_large);
                self.held.handed_over();
                led
            }
            Err(error) => {
                // This flight is answered at once; the waiters elsewhere are
                // answered when a retry gets through.
                tracing::warn!(%error, "finish failed; retrying in the background");
                let cutoff = finish.cutoff;
                let answer = self.answer(entry.clone(), &entry, too_large);
                let retry = (self.keys.clone(), entry, store, fence, cutoff);
                finish_in_background(ctx, self.held, retry, Attempts::AfterFailure);
                Led::Done(answer)
            }
        }
    }

    /// Whether this flight is answered with `entry` (to be stored) before
    /// its finish: see [`Leader::finish`].
    fn answers_early(&self, entry: &Entry, cutoff: u64, ticket: &Ticket) -> bool {
        matches!(
            entry.status(),
            Status::Found | Status::NotFound | Status::TooLarge
        ) && entry.read_at() >= cutoff
            && !self.ctx.loader.source().reads_copies()
            && self.ctx.memory.unchanged_since(ticket)
    }

    /// What a finish that went through means for this flight.
    fn finished(&self, finished: Finished, entry: Entry, too_large: Option<Entry>) -> Led {
        let key = self.key;
        let Some(published) = finished.published else {
            // (A claim in the value key that a change deleted is not ours
            // to release either: not a lost lock.)
            metrics::fenced();
            tracing::debug!(%key, "a change was applied during the load: fenced");
            return Led::Fenced(too_large.unwrap_or(entry));
        };
        if !finished.released {
            // Our lock expired during the load and someone else took it:
            // the finish left their lock alone (token check).
            tracing::warn!(
                lock = self.keys.lock,
                "lock expired during the load and was not ours to release"
            );
        }
        // Read before a cutoff raised meanwhile (`invalidate --all`, a
        // truncate): stale already, as a change would have made it.
        if published.read_at() < self.ctx.cutoff() {
            metrics::fenced();
            tracing::debug!(%key, "the cutoff was raised during the load: fenced");
            return Led::Fenced(too_large.unwrap_or(entry));
        }
        // Another leader's entry, found in place of this one's claim (a
        // change deleted the claim, another leader stored since): judged as
        // any entry found, for a change may have invalidated it since too.
        // Not an answer: elect again, as after a fence.
        if published.raw() != entry.raw()
            && published.status() != Status::TooLarge
            && self
                .ctx
                .judge(Some(published.clone()), now_millis(), Duration::ZERO)
                .settle(Served::Miss)
                .is_none_or(|answer| answer.is_err())
            && entry.status() != Status::Failed
        {
            metrics::fenced();
            tracing::debug!(%key, "another leader's entry, no longer servable, in place of this claim: fenced");
            return Led::Fenced(too_large.unwrap_or(entry));
        }
        if entry.status() == Status::Failed && published.status() == Status::Found {
            tracing::warn!(%key, "load failed; serving the stored copy");
        }
        Led::Done(self.answer(published, &entry, too_large))
    }

    /// This flight's answer, given what was published and what it loaded.
    fn answer(&self, published: Entry, ours: &Entry, too_large: Option<Entry>) -> Outcome {
        match too_large {
            Some(body) => Answer::new(body, Served::TooLarge),
            // A marker another leader stored (our lock had expired): we
            // hold the row, serve it.
            None if published.status() == Status::TooLarge => {
                Answer::new(ours.clone(), self.ctx.loader.served_uncached(ours))
            }
            None => Answer::new(published, Served::Miss),
        }
    }
}

/// Tries to take `keys.lock` with `token` (SET NX PX LOCK_TTL), reading
/// what its leader must see before the load if taken (the claim script).
///
/// An attempt that ends without an answer (a timeout, a dropped
/// connection, or its future dropped) may still run later, when Redis
/// catches up or the client replays it after a reconnect, leaving a lock
/// nobody holds until LOCK_TTL and its waiters to WAIT_TIMEOUT: the
/// [`Attempt`] guard then queues a token-checked release behind it.
pub(super) async fn claim<S: Source>(
    ctx: &Context<S>,
    keys: &ItemKeys,
    token: &str,
) -> Result<Option<Before>, RedisError> {
    let mut attempt = Attempt {
        ctx,
        lock: &keys.lock,
        channel: &keys.channel,
        token,
        answered: false,
    };
    let result = ctx.redis.claim(keys, token, ctx.settings.lock_ttl).await;
    // An answer, or a refusal by the breaker: nothing went out.
    attempt.answered = matches!(result, Ok(_) | Err(RedisError::CircuitOpen));
    result
}

/// Tries to claim the value key of an item nobody has stored with `claim`
/// (see [`RedisCommands::claim_value`]), under the same guard as [`claim`]:
/// an attempt left without an answer releases the claim behind it.
/// `keys.lock` is the value key.
pub(super) async fn claim_value<S: Source>(
    ctx: &Context<S>,
    keys: &ItemKeys,
    claim: &str,
) -> Result<ValueClaim, RedisError> {
    let mut attempt = Attempt {
        ctx,
        lock: &keys.value,
        channel: &keys.channel,
        token: claim,
        answered: false,
    };
    let with_fence = ctx.loader.source().reads_copies();
    let result = ctx
        .redis
        .claim_value(keys, claim, ctx.settings.lock_ttl, with_fence)
        .await;
    attempt.answered = matches!(result, Ok(_) | Err(RedisError::CircuitOpen));
    result
}

/// Where a finish in the background starts.
enum Attempts {
    /// Its flight was answered before the finish: the first attempt goes
    /// out now, batched with other finishes as in the foreground.
    FirstNow,
    /// The first attempt, in the foreground, has just failed.
    AfterFailure,
}

/// Finishes (store, publish, release) in the background, retried with
/// backoff until it gets through, or until LOCK_TTL has passed: by then the
/// lock has expired and the waiters have woken to look for themselves. A
/// finish that timed out may still have run: running it again is harmless
/// (the fencing lets the same entry be stored and published twice).
fn finish_in_background<S: Source>(
    ctx: &Context<S>,
    held: Held,
    (keys, entry, store, fence, cutoff): (ItemKeys, Entry, StoreFor, String, u64),
    attempts: Attempts,
) {
    let redis = ctx.redis.clone();
    let give_up = Instant::now() + ctx.settings.lock_ttl;
    // In the trace of the flight that loaded it, after its answer.
    let span = tracing::debug_span!("finish", background = true);
    let finish = async move {
        let finish = Finish {
            keys: &keys,
            token: &held.token,
            entry: &entry,
            store,
            fence: &fence,
            cutoff,
            sharded: redis.sharded(),
        };
        let first = match attempts {
            Attempts::FirstNow => Some(redis.finish(&finish).await),
            Attempts::AfterFailure => None,
        };
        let finished = match first {
            Some(Ok(finished)) => Ok(finished),
            Some(Err(_)) | None => {
                tokio::time::sleep(RETRY_FIRST).await;
                with_backoff(give_up, || redis.eval(&finish))
                    .await
                    .inspect(|_| tracing::info!(lock = keys.lock, "finished on a retry"))
            }
        };
        match finished {
            Ok(Finished {
                published: None, ..
            }) => {
                metrics::fenced();
                tracing::debug!(
                    lock = keys.lock,
                    "a change was applied during the load: fenced, nothing stored"
                );
            }
            Ok(Finished {
                released: false, ..
            }) => tracing::warn!(
                lock = keys.lock,
                "lock expired during the load and was not ours to release"
            ),
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, lock = keys.lock, "gave up finishing; the lock expires by itself")
            }
        }
        held.handed_over();
    };
    ctx.tasks.spawn(finish.instrument(span));
}
