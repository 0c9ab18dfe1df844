//! The read path: cache lookup, in-process flight, fleet-wide leader election,
//! pub/sub wake-up, and freshness (stale-while-revalidate, early refresh,
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
//!   waiter.rs, until WAIT_TIMEOUT:
//!     SET lock token NX PX LOCK_TTL ──won──► leader.rs: GET again (someone may
//!        │lost                               have just finished), load (the
//!        ▼                                   watchdog extends the lock), finish
//!     SUBSCRIBE ready (once) ─► GET again ─► PTTL lock ─► wait for:
//!        message ─► answer                 lock expiry ─► loop (maybe lead)
//! ```
//!
//! Every Redis failure fails open: the flight loads straight from the source
//! (`Bypass`), still one load per key per process at a time.
//!
//! Files by role: `memory.rs` (the in-process memory tier and its fencing
//! against evictions), `freshness.rs` (pure verdicts and the store policy),
//! `leader.rs` (with the guard that lets go of a leader's lock when it
//! vanishes), `waiter.rs`, `refresh.rs`, `local.rs` (in-process flights),
//! `panics.rs` (a flight that panics answers 503, logged once with its key),
//! `subscriber/` (the shared subscriber), `redis.rs` (the commands),
//! `scripts.rs` (the Lua scripts, loaded on every connection), `apply.rs`
//! (changes applied to the cache: fences, tombstones, the cutoff), `nodes.rs`
//! (which client and breaker serve a key: one of each per node on a cluster),
//! `breaker.rs`, and `strategy.rs`: the load lab's strategies, the one place
//! that reads CACHE_STRATEGY.

pub mod apply;
mod breaker;
mod freshness;
mod leader;
mod local;
mod memory;
mod nodes;
mod panics;
mod redis;
mod refresh;
mod scripts;
mod settings;
mod strategy;
mod subscriber;
mod waiter;

use std::{
    collections::HashSet,
    fmt::Display,
    future::Future,
    hash::Hash,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

pub use freshness::StoreFor;
pub use nodes::Nodes;
pub use redis::{ChangeKind, ItemSnapshot, RedisCommands, RedisError};
pub use settings::Settings;
pub use strategy::Strategy;
pub use subscriber::Subscriber;
pub use waiter::Wake;
#[cfg(feature = "testkit")]
pub use waiter::{Hook, Hooks};

use freshness::{judge, Verdict};
use local::{Flights, Role, Unshared};
use memory::MemoryTier;

use crate::{
    cache::{now_millis, Entry, Keys, Status},
    telemetry::metrics,
};

/// Why a load failed; logged by the read path, never shown to clients.
pub type LoadError = anyhow::Error;

/// What the read path loads on a miss.
pub trait Source: Send + Sync + 'static {
    /// What identifies an item; its `Display` form goes inside the hash tag.
    type Key: Clone + Eq + Hash + Display + Send + Sync + 'static;

    /// The item's response body, `None` when it does not exist.
    fn load(
        &self,
        key: &Self::Key,
    ) -> impl Future<Output = Result<Option<Bytes>, LoadError>> + Send;
}

/// How an answer was produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// A fresh entry found in this process's memory tier.
    Memory,
    /// A fresh entry found by the first GET.
    Hit,
    /// A stale entry: inside the grace window (refreshing in the background)
    /// or a fail-safe copy after a failed load.
    Stale,
    /// Loaded by this request's own flight, as leader.
    Miss,
    /// Served by the load of another request of this process.
    CoalescedLocal,
    /// Served by the load of another instance (message or re-check).
    CoalescedRemote,
    /// Redis was skipped (failed, breaker open, or strategy `none`).
    Bypass,
    /// Loaded from the source and not cached: the item is larger than
    /// MAX_ENTRY_BYTES (a too-large marker is cached in its place).
    TooLarge,
}

/// A found or not-found entry and how it was served. Never a failure: a
/// failed entry becomes [`ReadError::Unavailable`] in [`Answer::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    entry: Entry,
    pub served: Served,
}

impl Answer {
    /// The answer for `entry`, served as `served` — or as `Stale` when it is
    /// a fail-safe copy re-served after a failed load, whoever loaded it.
    pub fn new(entry: Entry, served: Served) -> Result<Self, ReadError> {
        let served = match entry.status() {
            // A marker is never an answer: its readers load the item (a
            // bug that let one through would answer 503, not a wrong 404).
            Status::Failed | Status::TooLarge => return Err(ReadError::Unavailable),
            _ if entry.is_backoff() => Served::Stale,
            _ => served,
        };
        Ok(Self { entry, served })
    }

    /// The entry: found or not found.
    pub fn entry(&self) -> &Entry {
        &self.entry
    }

    /// As seen by a request that joined another request's flight.
    fn joined(self) -> Self {
        let served = match self.served {
            Served::Miss | Served::CoalescedRemote => Served::CoalescedLocal,
            other => other,
        };
        Self { served, ..self }
    }
}

/// Why a read produced no entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// The load failed (here, at the remote leader, or within FAILURE_TTL of
    /// a failure) and no stale copy was at hand.
    #[error("the backend failed")]
    Unavailable,
    /// WAIT_TIMEOUT passed while waiting for another's load.
    #[error("timed out waiting for the load")]
    Timeout,
}

/// What one flight ended with, as its owner sees it; shared by its joiners.
type Outcome = Result<Answer, ReadError>;

/// The read path of one process.
pub struct ReadPath<S: Source> {
    source: S,
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
            source,
            keys,
            redis,
            subscriber,
            flights: Flights::new(tasks.clone()),
            refreshing: Arc::default(),
            tasks,
            settings,
            reads_in_progress: AtomicUsize::new(0),
            cutoff: AtomicU64::new(0),
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
    /// (it is down: the tier is emptied).
    pub fn serve_from_memory(&self, serving: bool) {
        self.memory.serve(serving);
    }

    /// Whether the memory tier is on and serving, with its bytes and entries.
    pub fn memory_usage(&self) -> (bool, u64, usize) {
        let (bytes, entries) = self.memory.usage();
        (self.memory.is_serving(), bytes, entries)
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
    async fn get_from_redis(self: &Arc<Self>, key: S::Key, now: u64) -> Result<Answer, ReadError> {
        let span = tracing::Span::current();
        let grace = self.settings.stale_while_revalidate;
        let ticket = self.memory.ticket(&key);
        let (verdict, redis_up) = Box::pin(self.look_up(&key, now, grace)).await;
        match verdict {
            Verdict::Fresh(entry) => {
                span.record("role", "hit");
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
                    self.in_flight(key, |this, key| async move { this.pass(&key).await }),
                )
                .await;
            }
            Verdict::Miss => {}
        }
        // Boxed: a hit in Redis never makes it.
        Box::pin(self.in_flight(key, move |this, key| async move {
            if !redis_up {
                return this.bypass(&key).await;
            }
            // Taken before anything of the flight is read (see memory.rs).
            let ticket = this.memory.ticket(&key);
            let outcome = this.coordinate(&key).await;
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
    pub fn memory_hit(self: &Arc<Self>, key: &S::Key) -> Option<Answer> {
        // Off (0 bytes) for the strategies that bypass it.
        if !self.memory.is_on() {
            return None;
        }
        self.from_memory(key, now_millis())?.ok()
    }

    /// A fresh entry of the memory tier (an early refresh started as for a
    /// hit in Redis: the tier keeps no entry past its freshness).
    fn from_memory(self: &Arc<Self>, key: &S::Key, now: u64) -> Option<Result<Answer, ReadError>> {
        let entry = self.memory.get(key, now)?;
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
            self.memory.fill(key, &answer.entry, ticket, now_millis());
        }
    }

    /// The first GET and its verdict, with whether Redis is worth trying
    /// again (for the lock) when there is nothing to serve.
    async fn look_up(&self, key: &S::Key, now: u64, grace: Duration) -> (Verdict, bool) {
        match self.redis.lookup(&self.keys.value(key)).await {
            Ok(entry) => (judge(entry, now, grace, self.cutoff()), true),
            // Redis known down: straight to the source (still one load per
            // key in this process, through the flight).
            Err(error @ RedisError::CircuitOpen) => {
                tracing::debug!(%error, "failing open");
                (Verdict::Miss, false)
            }
            // One failed GET does not prove Redis down: the flight still tries
            // the lock, and fails open if that fails too (by then the breaker
            // counts the failures and opens).
            Err(error) => {
                tracing::warn!(%error, "redis lookup failed");
                (Verdict::Miss, true)
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
                let flight = fly(this, key);
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

    /// Loads with Redis skipped (it failed, or its breaker is open).
    async fn bypass(&self, key: &S::Key) -> Outcome {
        tracing::Span::current().record("role", "bypass");
        Answer::new(self.load_entry(key).await, Served::Bypass)
    }

    /// Loads an item a too-large marker names, straight from the source:
    /// nothing is stored (the marker stays until a change or its expiry).
    async fn pass(&self, key: &S::Key) -> Outcome {
        tracing::Span::current().record("role", "pass");
        let entry = self.load_entry(key).await;
        let served = self.served_uncached(&entry);
        Answer::new(entry, served)
    }

    /// How a loaded entry that is not stored is served: too large, or (it
    /// shrank, or is gone) a plain bypass.
    fn served_uncached(&self, entry: &Entry) -> Served {
        if self.too_large(entry) {
            Served::TooLarge
        } else {
            Served::Bypass
        }
    }

    /// Whether `entry`'s body is over MAX_ENTRY_BYTES.
    fn too_large(&self, entry: &Entry) -> bool {
        entry.status() == Status::Found && entry.body().len() > self.settings.max_entry_bytes
    }

    /// What a leader stores and publishes for what it loaded: the entry
    /// itself, or, for a body over MAX_ENTRY_BYTES, a too-large marker
    /// (fresh as long as the entry) with the entry kept aside to answer
    /// this flight.
    fn to_store(&self, loaded: Entry) -> (Entry, Option<Entry>) {
        if !self.too_large(&loaded) {
            return (loaded, None);
        }
        metrics::too_large();
        let marker = Entry::stamped(
            Status::TooLarge,
            &[],
            loaded.stored_at(),
            loaded.fresh_until(),
            loaded.load_time(),
        );
        (marker, Some(loaded))
    }

    async fn fail_open(&self, key: &S::Key, error: RedisError) -> Outcome {
        tracing::warn!(%error, "redis failed; failing open to the source");
        self.bypass(key).await
    }

    /// Loads and builds the entry, fresh for the (jittered) CACHE_TTL or
    /// NEGATIVE_TTL; a failed load gives a `Failed` entry.
    async fn load_entry(&self, key: &S::Key) -> Entry {
        let started = Instant::now();
        let loaded = tokio::time::timeout(self.settings.load_timeout, self.source.load(key))
            .await
            .unwrap_or_else(|_| {
                Err(anyhow::anyhow!(
                    "no answer within LOAD_TIMEOUT ({:?})",
                    self.settings.load_timeout
                ))
            });
        let took = started.elapsed();
        let took_ms = took.as_secs_f64() * 1e3;
        tracing::Span::current().record("load_ms", took_ms);
        let jitter = self.settings.jitter;
        match loaded {
            Ok(Some(body)) => {
                metrics::db_load("found", took);
                tracing::debug!(%key, took_ms, "loaded");
                let ttl = jitter.apply(self.settings.cache_ttl);
                Entry::new(Status::Found, &body, ttl, took)
            }
            Ok(None) => {
                metrics::db_load("not_found", took);
                tracing::debug!(%key, took_ms, "loaded: not found");
                let ttl = jitter.apply(self.settings.negative_ttl);
                Entry::new(Status::NotFound, &[], ttl, took)
            }
            Err(error) => {
                metrics::db_load("failed", took);
                tracing::warn!(error = format!("{error:#}"), %key, "load failed");
                Entry::new(Status::Failed, &[], Duration::ZERO, took)
            }
        }
    }
}
