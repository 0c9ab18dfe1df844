//! The protocol (the read path): cache lookup, in-process flight, fleet-wide
//! leader election, pub/sub wake-up, and freshness (stale-while-revalidate, early refresh,
//! fail-safe). Generic over what it loads: it knows nothing of posts.
//!
//! ```text
//! get(key) ── memory tier (memory.rs) ──fresh──► Memory hit (maybe an early refresh)
//!    │ not there
//!    ▼
//! GET value ── judge ──Fresh──► Hit (maybe an early refresh: refresh.rs)
//!                            │ Backoff ─► Stale   StaleInGrace ─► Stale + one refresh
//!                            │ Failed ──► 503 at once
//!                            │ Miss               │ redis error or breaker open
//!                            ▼                    ▼
//!        in-process flight (local.rs: one per key; joiners never touch Redis)
//!                            │
//!   waiter.rs (machine.rs's transitions), until WAIT_TIMEOUT:
//!     claim: SET lock NX PX ──won──► leader.rs: the claim's value (someone may
//!        │lost   (+ value, fence)    have just finished), load (batch.rs; the
//!        ▼                           watchdog extends the lock), finish
//!     SUBSCRIBE ready (once) ─► GET again ─► PTTL lock ─► wait for:
//!        message ─► answer                 lock expiry ─► loop (maybe lead)
//! ```
//!
//! Every Redis failure fails open: the flight loads straight from the source
//! (`Bypass`), still one load per key per process at a time.
//!
//! The protocol's files: `answer.rs` (what a read answers), `freshness.rs`
//! (pure verdicts and the store policy), `machine.rs` (one flight's
//! coordination as a state machine with pure transitions, and [`WaitEnd`],
//! how a wait ends), `waiter.rs` (the flight that drives it against
//! Redis), `leader.rs` (the leader's work, with the guard that lets
//! go of its lock when it vanishes), `load.rs` (loads from the source),
//! `batch.rs` (loads queued while statements run share the next one),
//! `many.rs` (many keys read at once: a batch read),
//! `local.rs` (in-process flights), `memory.rs` (the memory tier and its
//! fencing against evictions), `refresh.rs`, `apply.rs` (changes applied to
//! the cache: fences, tombstones, the cutoff), `panics.rs` (a flight that
//! panics answers 503, logged once with its key), `settings.rs`,
//! `source.rs` (what the read path loads from: [`Source`]), and
//! `strategy.rs`: the load lab's strategies, the one place that reads
//! CACHE_STRATEGY. The Redis side (commands, nodes, breakers, scripts,
//! subscriber) is the `redis` module.

mod answer;
pub mod apply;
mod batch;
mod freshness;
pub mod guard;
mod leader;
mod load;
mod local;
mod machine;
mod many;
mod memory;
mod panics;
mod progress;
mod refresh;
mod settings;
mod source;
mod strategy;
mod waiter;
mod warm;
mod won;

use std::{
    collections::HashSet,
    future::Future,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio_util::task::TaskTracker;
use tracing::Instrument;

pub use answer::{Answer, ReadError, Served};
pub use machine::WaitEnd;
pub use progress::Progress;
pub use settings::{fence_ttl, Settings};
pub use source::{Busy, LoadError, Since, Source};
pub use strategy::Strategy;
pub use waiter::Wake;
#[cfg(feature = "testkit")]
pub use waiter::{Hook, Hooks};

use answer::Outcome;
use freshness::{judge, Verdict};
use load::Loader;
use local::{Flights, Role, Unshared};
use memory::MemoryTier;
use waiter::Flight;
use won::{Won, WonClaims};

use crate::{
    cache::{now_millis, Keys},
    redis::{RedisCommands, RedisError, Subscriber},
};

/// What a first look in Redis says beside its verdict.
#[derive(Debug, Clone, Copy)]
struct Looked {
    /// Redis is worth trying again (for the lock) when there is nothing to
    /// serve: not known down.
    redis_up: bool,
    /// No entry was found in the value key (nothing, a leader's claim, or
    /// bytes that are not an entry): a flight claims the value key itself.
    absent: bool,
}

/// The read path of one process.
pub struct ReadPath<S: Source> {
    loader: Loader<S>,
    keys: Keys,
    redis: RedisCommands,
    subscriber: Arc<Subscriber>,
    flights: Flights<S::Key, Outcome>,
    /// Keys with a background refresh running in this process (see refresh.rs).
    /// A std mutex: held only to insert or remove.
    refreshing: Arc<Mutex<HashSet<S::Key>>>,
    /// Flights and background refreshes: shutdown waits for them.
    tasks: TaskTracker,
    settings: Settings,
    /// Reads in progress (every read not yet answered): lets tests and
    /// operators see how many requests a stampede holds.
    reads_in_progress: AtomicUsize,
    /// The cutoff in force here, unix milliseconds: every entry read before
    /// it is invalid (`invalidate --all`; see `apply.rs`). Only ever raised.
    cutoff: AtomicU64,
    /// Fresh entries kept in this process (memory.rs).
    memory: MemoryTier<S::Key>,
    /// The items that exist (guard.rs).
    guard: guard::Guard,
    /// Claims won at first looks, for the keys' flights (won.rs).
    won: Arc<WonClaims<S::Key>>,
    /// Keys seen stored in Redis lately: looked up, not claimed (warm.rs).
    warm: warm::Warm,
}

impl<S: Source> ReadPath<S> {
    pub fn new(
        source: S,
        keys: Keys,
        redis: RedisCommands,
        subscriber: Arc<Subscriber>,
        settings: Settings,
    ) -> Arc<Self> {
        panics::install_hook();
        let tasks = TaskTracker::new();
        let memory_bytes = if strategy::uses_memory(settings.strategy) {
            settings.memory_bytes
        } else {
            0
        };
        Arc::new(Self {
            memory: MemoryTier::new(memory_bytes, settings.memory_ttl),
            loader: Loader::new(source, &settings),
            keys,
            redis,
            subscriber,
            flights: Flights::new(tasks.clone()),
            refreshing: Arc::default(),
            tasks,
            settings,
            reads_in_progress: AtomicUsize::new(0),
            cutoff: AtomicU64::new(0),
            guard: guard::Guard::default(),
            won: Arc::default(),
            warm: warm::Warm::default(),
        })
    }

    pub fn redis(&self) -> &RedisCommands {
        &self.redis
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    pub fn subscriber(&self) -> &Arc<Subscriber> {
        &self.subscriber
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Serves from the memory tier (the change feed is up, or off), or not
    /// (it is down: the tier is emptied, and the existence guard stands
    /// aside until built again once the feed is back).
    pub fn serve_from_memory(&self, serving: bool) {
        self.memory.serve(serving);
        if !serving {
            self.guard.stand_aside();
        }
    }

    /// The existence guard (guard.rs).
    pub fn guard(&self) -> &guard::Guard {
        &self.guard
    }

    /// Builds the existence guard from the source if it stands aside;
    /// whether it is built now. Call only while the change feed is up.
    pub async fn build_guard(&self) -> Result<bool, LoadError> {
        let Some(build) = self.guard.begin_build() else {
            return Ok(false);
        };
        match self.loader.ordinals().await {
            Ok(Some(set)) => Ok(self.guard.finish_build(build, set)),
            Ok(None) => {
                self.guard.abandon_build(build);
                Ok(false)
            }
            Err(error) => {
                self.guard.abandon_build(build);
                Err(error)
            }
        }
    }

    /// Whether the existence guard says `key` cannot exist.
    fn guard_says_missing(&self, key: &S::Key) -> bool {
        S::ordinal(key).is_some_and(|ordinal| self.guard.says_missing(ordinal))
    }

    /// The guard's answer for `key`: not found, when it cannot exist.
    fn guarded(&self, key: &S::Key) -> Option<Result<Answer, ReadError>> {
        if !self.guard_says_missing(key) {
            return None;
        }
        let entry = crate::cache::Entry::new(
            crate::cache::Status::NotFound,
            &[],
            self.settings.negative_ttl,
            Duration::ZERO,
        );
        Some(Answer::new(entry, Served::Guard))
    }

    /// Whether the memory tier is on and serving, with its bytes and entries.
    pub fn memory_usage(&self) -> (bool, u64, usize) {
        let (bytes, entries) = self.memory.usage();
        (self.memory.is_serving(), bytes, entries)
    }

    /// Evictions of `key`'s stripe of the memory tier (changes applied
    /// here to it, or to another key of its stripe): a test waits for it
    /// to move to know a change has reached this process.
    #[cfg(feature = "testkit")]
    pub fn evictions(&self, key: &S::Key) -> u64 {
        self.memory.ticket(key).generation
    }

    /// Reads not yet answered.
    pub fn reads_in_progress(&self) -> usize {
        self.reads_in_progress.load(Ordering::Relaxed)
    }

    /// Waits, at most `limit`, for flights and background refreshes to end,
    /// so that a leader shut down still publishes and releases its lock.
    pub async fn drain(&self, limit: Duration) -> bool {
        self.tasks.close();
        tokio::time::timeout(limit, self.tasks.wait()).await.is_ok()
    }

    /// The fleet-wide read (strategies `pubsub` and `poll`): look up, judge,
    /// and on a miss hand off to this process's flight for the key.
    async fn get(self: &Arc<Self>, key: S::Key) -> Result<Answer, ReadError> {
        let span = tracing::Span::current();
        let now = now_millis();
        if let Some(answer) = self.from_memory(&key, now) {
            span.record("role", "memory_hit");
            return answer;
        }
        self.get_from_redis(key, now).await
    }

    /// The rest of [`ReadPath::get`]: Redis, then this process's flight.
    ///
    /// What it awaits is boxed, so that its own future stays small: a request
    /// waiting for a flight keeps it (inside its request's future) for the
    /// whole wait, while the GET's future (about 500 bytes) is freed as soon
    /// as the GET is answered.
    ///
    /// The first look claims the item if nobody has stored it (one command
    /// for the miss and its election: see [`leader::look_up_or_claim`]),
    /// except for an item this process has seen stored lately (a hit is
    /// likely, and plain lookups are batched into one `MGET`: warm.rs),
    /// where loads may read a replica (their leader reads the change fence
    /// with its claim, which a lookup has no use for), and where the
    /// existence guard says the item cannot exist (its miss is answered
    /// without a load: a claim would only be let go again).
    async fn get_from_redis(self: &Arc<Self>, key: S::Key, now: u64) -> Result<Answer, ReadError> {
        let grace = self.settings.stale_while_revalidate;
        let ticket = self.memory.ticket(&key);
        let warm = self.warm.holds(&key);
        let plain = warm || self.loader.source().reads_copies() || self.guard_says_missing(&key);
        let (verdict, looked, won) = if plain {
            let (verdict, looked) = Box::pin(self.look_up(&key, now, grace)).await;
            if warm && looked.absent {
                self.warm.forget(&key);
            }
            (verdict, looked, None)
        } else {
            Box::pin(self.look_up_or_claim(&key, now, grace)).await
        };
        self.after_look_up(key, now, verdict, looked, ticket, won)
            .await
    }

    /// The first look that claims (see [`ReadPath::get_from_redis`]), its
    /// verdict, and the claim when won.
    async fn look_up_or_claim(
        self: &Arc<Self>,
        key: &S::Key,
        now: u64,
        grace: Duration,
    ) -> (Verdict, Looked, Option<Box<Won<S>>>) {
        let keys = self.keys.item(key);
        match leader::look_up_or_claim(self, key, &keys).await {
            Ok((_, Some(won))) => {
                let looked = Looked {
                    redis_up: true,
                    absent: true,
                };
                (Verdict::Miss, looked, Some(won))
            }
            Ok((entry, None)) => {
                let (verdict, looked) = self.judge_look_up(Ok(entry), now, grace);
                (verdict, looked, None)
            }
            Err(error) => {
                let (verdict, looked) = self.judge_look_up(Err(error), now, grace);
                (verdict, looked, None)
            }
        }
    }

    /// What follows the first look in Redis (`verdict`, and what the look
    /// says of Redis and of the key): serve it, or this process's flight.
    /// `ticket` was taken before the look (see memory.rs). The memory tier
    /// keeps nothing older than what is served (see memory.rs), and a post
    /// served found is known to the existence guard (see guard.rs).
    async fn after_look_up(
        self: &Arc<Self>,
        key: S::Key,
        now: u64,
        verdict: Verdict,
        looked: Looked,
        ticket: memory::Ticket,
        won: Option<Box<Won<S>>>,
    ) -> Result<Answer, ReadError> {
        let answer = self
            .answer_after_look_up(key.clone(), now, verdict, looked, ticket, won)
            .await;
        if let Ok(answer) = &answer {
            // What this process serves from now on is no older.
            self.memory.supersede(&key, answer.entry());
            if matches!(
                answer.served,
                Served::Hit
                    | Served::Stale
                    | Served::Miss
                    | Served::CoalescedLocal
                    | Served::CoalescedRemote
            ) {
                self.warm.mark(&key);
            }
            if let Some(ordinal) = S::ordinal(&key) {
                if answer.entry().status() == crate::cache::Status::Found {
                    self.guard.seen_found(ordinal);
                }
            }
        }
        answer
    }

    async fn answer_after_look_up(
        self: &Arc<Self>,
        key: S::Key,
        now: u64,
        verdict: Verdict,
        looked: Looked,
        ticket: memory::Ticket,
        won: Option<Box<Won<S>>>,
    ) -> Result<Answer, ReadError> {
        let span = tracing::Span::current();
        match verdict {
            Verdict::Fresh(entry) => {
                span.record("role", "hit");
                // A flight of this key still running read before this
                // (see local.rs): later requests must not get its answer.
                self.flights.detach(&key);
                self.memory.fill(&key, &entry, &ticket, now_millis());
                self.maybe_refresh_early(&key, &entry, now);
                return Answer::new(entry, Served::Hit);
            }
            Verdict::Backoff(entry) => {
                span.record("role", "fail_safe");
                return Answer::new(entry, Served::Stale);
            }
            Verdict::StaleInGrace(entry) => {
                span.record("role", "stale_while_revalidate");
                self.refresh_in_background(key, Some(entry.stored_at()));
                return Answer::new(entry, Served::Stale);
            }
            Verdict::Failed => {
                span.record("role", "failure_backoff");
                return Err(ReadError::Unavailable);
            }
            Verdict::TooLarge => {
                // Hit-for-pass: one load per key in this process, no lock.
                return Box::pin(
                    self.in_flight(key, |this, key| async move { this.loader.pass(&key).await }),
                )
                .await;
            }
            Verdict::Miss => {
                // Checked here, past the look in Redis, so that hits pay
                // nothing for it.
                if let Some(answer) = self.guarded(&key) {
                    span.record("role", "guard");
                    return answer;
                }
            }
        }
        // Boxed: a hit in Redis never makes it.
        Box::pin(self.in_flight(key, move |this, key| async move {
            // The claim this request's first look won, if it did: the
            // flight's election takes it (won.rs). Dropped untaken (this
            // request joined a flight already running, or the flight ends
            // without electing), it is let go.
            let _won = won;
            if !looked.redis_up {
                return this.loader.bypass(&key).await;
            }
            // Taken before anything of the flight is read (see memory.rs).
            let ticket = this.memory.ticket(&key);
            let outcome = Flight::new(&this, &key, looked.absent).run().await;
            if let Ok(answer) = &outcome {
                this.keep_in_memory(&key, answer, &ticket);
            }
            outcome
        }))
        .await
    }

    /// A fresh answer from the memory tier, without awaiting anything: the
    /// HTTP layer answers it before routing. `None` for anything else (the
    /// full read then runs as usual).
    pub fn memory_hit(self: &Arc<Self>, key: &S::Key, now: u64) -> Option<Answer> {
        // Off (0 bytes) for the strategies that bypass it.
        if !self.memory.is_on() {
            return None;
        }
        self.from_memory(key, now)?.ok()
    }

    /// A fresh entry of the memory tier (an early refresh started as for a
    /// hit in Redis: the tier keeps no entry past its freshness).
    fn from_memory(self: &Arc<Self>, key: &S::Key, now: u64) -> Option<Result<Answer, ReadError>> {
        let entry = self.memory.get(key, S::ordinal(key), now)?;
        match judge(Some(entry), now, Duration::ZERO, self.cutoff()) {
            Verdict::Fresh(entry) => {
                self.maybe_refresh_early(key, &entry, now);
                Some(Answer::new(entry, Served::Memory))
            }
            // Read before a cutoff raised since.
            _ => None,
        }
    }

    /// Keeps what a flight or a refresh read from Redis, from a ready
    /// message or from the source as leader; not a bypass (Redis is failing,
    /// and with it the change feed's applications) nor a stale copy.
    fn keep_in_memory(&self, key: &S::Key, answer: &Answer, ticket: &memory::Ticket) {
        if matches!(
            answer.served,
            Served::Miss | Served::CoalescedRemote | Served::Hit
        ) {
            self.memory.fill(key, answer.entry(), ticket, now_millis());
        }
    }

    /// The first GET and its verdict, with what it says of Redis and the key.
    async fn look_up(&self, key: &S::Key, now: u64, grace: Duration) -> (Verdict, Looked) {
        let looked = self.redis.lookup(&self.keys.value(key)).await;
        self.judge_look_up(looked, now, grace)
    }

    /// A first look's verdict (see [`ReadPath::look_up`]).
    fn judge_look_up(
        &self,
        looked: Result<Option<crate::cache::Entry>, RedisError>,
        now: u64,
        grace: Duration,
    ) -> (Verdict, Looked) {
        let (redis_up, absent) = (true, true);
        match looked {
            Ok(entry) => {
                let absent = entry.is_none();
                let verdict = judge(entry, now, grace, self.cutoff());
                (verdict, Looked { redis_up, absent })
            }
            // Redis known down: straight to the source (still one load per
            // key in this process, through the flight).
            Err(error @ RedisError::CircuitOpen) => {
                tracing::debug!(%error, "failing open");
                let redis_up = false;
                (Verdict::Miss, Looked { redis_up, absent })
            }
            // One failed GET does not prove Redis down: the flight still tries
            // the lock, and fails open if that fails too (by then the breaker
            // counts the failures and opens).
            Err(error) => {
                tracing::warn!(%error, "redis lookup failed");
                (Verdict::Miss, Looked { redis_up, absent })
            }
        }
    }

    /// Runs `fly` once per key in this process: the first caller owns the
    /// flight, later ones join it and share its outcome.
    async fn in_flight<F, Fut>(self: &Arc<Self>, key: S::Key, fly: F) -> Result<Answer, ReadError>
    where
        F: FnOnce(Arc<Self>, S::Key) -> Fut,
        Fut: Future<Output = Outcome> + Send + 'static,
    {
        let this = self.clone();
        let (role, outcome) = self
            .flights
            .run(key.clone(), self.settings.wait_timeout, move || {
                // The request's own span is at debug level: this one names the key.
                let span = tracing::info_span!(
                    "flight",
                    key = %key,
                    role = tracing::field::Empty,
                    load_ms = tracing::field::Empty
                );
                let named = key.clone();
                // Boxed where it is made: the run's state machine is large
                // (every step's future), and the wrappers below and the spawn
                // would each copy it; they copy a pointer instead.
                let flight = Box::pin(fly(this, key));
                // A panic answers 503; a leader's lock is let go as it unwinds.
                async move { panics::caught(flight, &named, || Err(ReadError::Unavailable)).await }
                    .instrument(span)
            })
            .await;
        let outcome = outcome.unwrap_or_else(|error| {
            Err(match error {
                // A flight whose task panicked ended without an outcome.
                Unshared::Abandoned => ReadError::Unavailable,
                Unshared::TimedOut => ReadError::Timeout,
            })
        });
        let span = tracing::Span::current();
        if let Ok(answer) = &outcome {
            tracing::debug!(?role, served = ?answer.served, stored_at = answer.entry().stored_at(), "flight answered");
        }
        match role {
            Role::Owner => {
                span.record("role", "flight_owner");
                outcome
            }
            Role::Joiner => {
                span.record("role", "flight_joiner");
                outcome.map(Answer::joined)
            }
        }
    }
}
