//! The read path: cache lookup, in-process flight, fleet-wide leader election,
//! pub/sub wake-up, and freshness (stale-while-revalidate, early refresh,
//! fail-safe). Generic over what it loads: it knows nothing of posts.
//!
//! ```text
//! get(key) ── GET value ──fresh──► Hit (maybe an early refresh in the background)
//!                │ stale in grace / backoff copy ──► Stale (grace: one background refresh)
//!                │ failure marker ──► 503 at once
//!                │ miss / garbage            │ redis error or breaker open
//!                ▼                           ▼
//!        in-process flight (one per key; joiners never touch Redis for it)
//!                │
//!   loop until WAIT_TIMEOUT:
//!     SET lock token NX PX LOCK_TTL ──won──► lead: GET again (someone may have
//!        │lost                               just finished), load (watchdog
//!        ▼                                   extends the lock), finish script
//!     SUBSCRIBE ready (shared, once) ─► GET again ─► PTTL lock ─► wait for:
//!        message ─► outcome                 lock expiry ─► loop (maybe lead)
//! ```
//!
//! Every Redis failure fails open: the flight loads straight from the source
//! (`Bypass`), still one load per key per process at a time.

mod breaker;
mod local;
mod redis;
mod subscriber;

use std::{
    collections::HashSet,
    fmt::Display,
    future::Future,
    hash::Hash,
    pin::Pin,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use rand::Rng;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::{
    cache::{now_millis, Entry, Jitter, Keys, Status},
    config::Strategy,
    telemetry::metrics,
};
pub use breaker::{Breaker, State as BreakerState, BREAKER_COOLDOWN, BREAKER_FAILURES};
pub use local::{Abandoned, Flights, Role};
pub use redis::{Finished, Lookup, RedisCommands, RedisError, StoreFor};
pub use subscriber::{Notice, Subscriber, Subscription};

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
}

impl Served {
    /// The `X-Cache` header value.
    pub fn header(self) -> &'static str {
        match self {
            Served::Hit => "hit",
            Served::Stale => "stale",
            Served::Miss => "miss",
            Served::CoalescedLocal | Served::CoalescedRemote => "coalesced",
            Served::Bypass => "bypass",
        }
    }

    /// The `outcome` label of the request metrics.
    pub fn label(self, status: Status) -> &'static str {
        match (self, status) {
            (Served::Hit, Status::NotFound) => "negative_hit",
            (Served::Hit, _) => "hit",
            (Served::Stale, _) => "stale",
            (Served::Miss, _) => "miss",
            (Served::CoalescedLocal, _) => "coalesced_local",
            (Served::CoalescedRemote, _) => "coalesced_remote",
            (Served::Bypass, _) => "bypass",
        }
    }
}

/// A found or not-found entry and how it was served.
#[derive(Debug, Clone)]
pub struct Answer {
    pub entry: Entry,
    pub served: Served,
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

/// The lifetimes and bounds the read path works with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub strategy: Strategy,
    /// Freshness of a found entry.
    pub cache_ttl: Duration,
    /// Lifetime of a not-found entry.
    pub negative_ttl: Duration,
    pub jitter: Jitter,
    /// Lifetime of the leader lock (extended by the watchdog while loading).
    pub lock_ttl: Duration,
    /// Longest a flight waits for another's load.
    pub wait_timeout: Duration,
    /// How often `poll` waiters re-read the value.
    pub poll_interval: Duration,
    /// Grace window after freshness during which a stale entry is served
    /// while one background refresh runs (0 = off).
    pub stale_while_revalidate: Duration,
    /// XFetch β: a fresh hit refreshes early with probability
    /// exp(−remaining / (β·load time)) (0 = off).
    pub early_refresh_beta: f64,
    /// How long past freshness a fail-safe copy is kept for failures (0 = off).
    pub max_stale: Duration,
    /// How long a failure is remembered (the backoff), fleet-wide (0 = off).
    pub failure_ttl: Duration,
    /// Test support: observation points inside the protocol.
    pub hooks: Hooks,
}

/// An async callback run at a point of the protocol, given the value key.
pub type Hook = Arc<dyn Fn(String) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Observation points for tests and benchmarks that must act or measure at
/// an exact step of the protocol. Empty in production.
#[derive(Clone, Default)]
pub struct Hooks {
    /// Runs after a waiter's subscription is confirmed, before its re-check.
    pub before_recheck: Option<Hook>,
    /// Called the moment a wait ends, with what ended it.
    pub wait_ended: Option<Arc<dyn Fn(&'static str) + Send + Sync>>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("before_recheck", &self.before_recheck.is_some())
            .field("wait_ended", &self.wait_ended.is_some())
            .finish()
    }
}

/// What one in-process flight ended with; shared by all its joiners.
#[derive(Debug, Clone)]
enum Outcome {
    /// This process's leader loaded it (or, after a failure, re-served the
    /// fail-safe copy).
    Loaded(Entry),
    /// Another's load: the ready message or a re-check of the cache.
    Shared(Entry),
    /// Loaded from the source with Redis skipped.
    Bypassed(Entry),
    /// The load failed (here or remotely) and no copy was at hand.
    Failed,
    /// WAIT_TIMEOUT passed.
    TimedOut,
}

/// What an entry read from Redis means for a read at `now`.
enum Verdict {
    /// Serve it: fresh, or a backoff copy (stale, after a failure).
    Serve(Entry),
    /// A failure marker: the last load failed within FAILURE_TTL.
    Failed,
    /// Stale and not a backoff copy: serve only inside the grace window.
    Stale(Entry),
}

fn judge(entry: Entry, now: u64) -> Verdict {
    match entry.status() {
        Status::Failed => Verdict::Failed,
        _ if entry.is_fresh(now) || entry.is_backoff() => Verdict::Serve(entry),
        _ => Verdict::Stale(entry),
    }
}

/// XFetch (Vattani, Chierichetti, Lowenstein, VLDB 2015): refresh early when
/// `now − Δ·β·ln(u) ≥ expiry`, u uniform in (0, 1], Δ the last load's duration.
/// With r = expiry − now, this fires with probability exp(−r / (Δ·β)).
pub fn xfetch_fires(
    now_ms: u64,
    fresh_until_ms: u64,
    load_time: Duration,
    beta: f64,
    u: f64,
) -> bool {
    if beta <= 0.0 {
        return false;
    }
    let gap_ms = -(load_time.as_secs_f64() * 1e3 * beta * u.ln());
    now_ms as f64 + gap_ms >= fresh_until_ms as f64
}

/// The read path of one process.
pub struct ReadPath<S: Source> {
    source: S,
    keys: Keys,
    redis: RedisCommands,
    subscriber: Arc<Subscriber>,
    flights: Flights<S::Key, Outcome>,
    /// Keys with a background refresh running in this process. A std mutex:
    /// held only to insert or remove.
    refreshing: Mutex<HashSet<S::Key>>,
    /// Flights and background refreshes: shutdown waits for them.
    tasks: TaskTracker,
    settings: Settings,
    /// Reads in progress (every `get` not yet answered): lets tests and
    /// operators see how many requests a stampede holds.
    reads_in_progress: AtomicUsize,
}

/// Counts a read as in progress until dropped.
struct InProgress<'a>(&'a AtomicUsize);

impl<'a> InProgress<'a> {
    fn enter(counter: &'a AtomicUsize) -> Self {
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

/// The names of one item's keys.
struct ItemKeys {
    value: String,
    lock: String,
    fail_safe: String,
    channel: String,
}

impl<S: Source> ReadPath<S> {
    pub fn new(
        source: S,
        keys: Keys,
        redis: RedisCommands,
        subscriber: Arc<Subscriber>,
        settings: Settings,
    ) -> Arc<Self> {
        let tasks = TaskTracker::new();
        Arc::new(Self {
            source,
            keys,
            redis,
            subscriber,
            flights: Flights::new(tasks.clone()),
            refreshing: Mutex::default(),
            tasks,
            settings,
            reads_in_progress: AtomicUsize::new(0),
        })
    }

    pub fn redis(&self) -> &RedisCommands {
        &self.redis
    }

    pub fn subscriber(&self) -> &Arc<Subscriber> {
        &self.subscriber
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// In-process flights in progress.
    pub fn flights_in_progress(&self) -> usize {
        self.flights.len()
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

    fn item_keys(&self, key: &S::Key) -> ItemKeys {
        ItemKeys {
            value: self.keys.value(key),
            lock: self.keys.lock(key),
            fail_safe: self.keys.fail_safe(key),
            channel: self.keys.channel(key),
        }
    }

    fn coordinated(&self) -> bool {
        matches!(self.settings.strategy, Strategy::Poll | Strategy::Pubsub)
    }

    /// Reads one item through the cache.
    pub async fn get(self: &Arc<Self>, key: S::Key) -> Result<Answer, ReadError> {
        let _in_progress = InProgress::enter(&self.reads_in_progress);
        let span = tracing::Span::current();
        if self.settings.strategy == Strategy::None {
            span.record("role", "direct");
            return match self.load_entry(&key).await.0 {
                entry if entry.status() == Status::Failed => Err(ReadError::Unavailable),
                entry => Ok(Answer {
                    entry,
                    served: Served::Bypass,
                }),
            };
        }
        let value_key = self.keys.value(&key);
        let now = now_millis();
        let redis_up = match self.redis.lookup(&value_key).await {
            Ok(Lookup::Entry(entry)) => match judge(entry, now) {
                Verdict::Serve(entry) if entry.is_backoff() => {
                    span.record("role", "fail_safe");
                    return Ok(Answer {
                        entry,
                        served: Served::Stale,
                    });
                }
                Verdict::Serve(entry) => {
                    span.record("role", "hit");
                    self.maybe_refresh_early(&key, &entry, now);
                    return Ok(Answer {
                        entry,
                        served: Served::Hit,
                    });
                }
                Verdict::Failed if self.coordinated() => {
                    span.record("role", "failure_backoff");
                    return Err(ReadError::Unavailable);
                }
                Verdict::Stale(entry) if self.in_grace(&entry, now) => {
                    span.record("role", "stale_while_revalidate");
                    self.refresh_in_background(key, Some(entry.stored_at()));
                    return Ok(Answer {
                        entry,
                        served: Served::Stale,
                    });
                }
                Verdict::Failed | Verdict::Stale(_) => true,
            },
            Ok(Lookup::Absent) => true,
            Ok(Lookup::Garbage(error)) => {
                tracing::warn!(%error, key = %value_key, "undecodable cache entry, treated as a miss");
                true
            }
            // Redis known down: straight to the source (still one load per
            // key in this process, through the flight).
            Err(error @ RedisError::CircuitOpen) => {
                tracing::debug!(%error, "failing open");
                false
            }
            // One failed GET does not prove Redis down: the flight still tries
            // the lock, and fails open if that fails too (by then the breaker
            // counts the failures and opens).
            Err(error) => {
                tracing::warn!(%error, "redis lookup failed");
                true
            }
        };
        if self.settings.strategy == Strategy::Naive {
            span.record("role", "naive");
            let outcome = self.clone().fly(key, redis_up).await;
            return answer(Role::Owner, Ok(outcome));
        }
        let this = self.clone();
        let (role, outcome) = self
            .flights
            .run(key.clone(), move || {
                this.fly(key, redis_up).instrument(tracing::info_span!(
                    "flight",
                    role = tracing::field::Empty,
                    load_ms = tracing::field::Empty
                ))
            })
            .await;
        span.record(
            "role",
            match role {
                Role::Owner => "flight_owner",
                Role::Joiner => "flight_joiner",
            },
        );
        answer(role, outcome)
    }

    fn in_grace(&self, entry: &Entry, now: u64) -> bool {
        let grace = self.settings.stale_while_revalidate;
        self.coordinated()
            && !grace.is_zero()
            && now < entry.fresh_until().saturating_add(grace.as_millis() as u64)
    }

    fn maybe_refresh_early(self: &Arc<Self>, key: &S::Key, entry: &Entry, now: u64) {
        let beta = self.settings.early_refresh_beta;
        if beta <= 0.0 || !self.coordinated() {
            return;
        }
        // (0, 1]: ln(0) would be −∞.
        let u = 1.0 - rand::rng().random::<f64>();
        if xfetch_fires(now, entry.fresh_until(), entry.load_time(), beta, u) {
            self.refresh_in_background(key.clone(), Some(entry.stored_at()));
        }
    }

    /// One lock-guarded refresh for the whole fleet, without waiting: the
    /// instance that wins `SET NX` reloads; the others do nothing. It runs as
    /// a task of its own, so it completes even if the request that triggered
    /// it is gone. `seen` is the stored_at of the entry that triggered it.
    fn refresh_in_background(self: &Arc<Self>, key: S::Key, seen: Option<u64>) {
        {
            let mut refreshing = self
                .refreshing
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !refreshing.insert(key.clone()) {
                return; // already refreshing in this process
            }
        }
        let this = self.clone();
        self.tasks.spawn(
            async move {
                let keys = this.item_keys(&key);
                let token = lock_token();
                match this
                    .redis
                    .try_lock(&keys.lock, &token, this.settings.lock_ttl)
                    .await
                {
                    Ok(true) => {
                        let result = match this.lead(&key, &keys, &token, seen).await {
                            Outcome::Failed => "failed",
                            _ => "refreshed",
                        };
                        metrics::refresh(result);
                    }
                    Ok(false) => metrics::refresh("lost"),
                    Err(error) => {
                        tracing::debug!(%error, "background refresh skipped");
                        metrics::refresh("failed");
                    }
                }
                this.refreshing
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&key);
            }
            .instrument(tracing::info_span!(
                "refresh",
                load_ms = tracing::field::Empty
            )),
        );
    }

    /// One flight: what happens once per key per process on a miss.
    async fn fly(self: Arc<Self>, key: S::Key, redis_up: bool) -> Outcome {
        if !redis_up {
            return self.bypass(&key).await;
        }
        match self.settings.strategy {
            Strategy::None | Strategy::Naive | Strategy::Local => {
                let (entry, ttl) = self.load_entry(&key).await;
                if let Some(ttl) = ttl {
                    if let Err(error) = self.redis.store(&self.keys.value(&key), &entry, ttl).await
                    {
                        tracing::warn!(%error, "failed to store the entry");
                    }
                }
                loaded(entry)
            }
            Strategy::Poll | Strategy::Pubsub => self.coordinate(&key).await,
        }
    }

    /// Fleet-wide coordination: lead, or wait for the leader's outcome.
    async fn coordinate(&self, key: &S::Key) -> Outcome {
        let deadline = Instant::now() + self.settings.wait_timeout;
        let keys = self.item_keys(key);
        let token = lock_token();
        let pubsub = self.settings.strategy == Strategy::Pubsub;
        let mut subscription: Option<Subscription> = None;
        let mut waiting_since: Option<Instant> = None;
        let wait_ended = |ended_by: &'static str, since: Option<Instant>| {
            if let Some(since) = since {
                metrics::wait_ended(ended_by, since.elapsed());
                if let Some(hook) = &self.settings.hooks.wait_ended {
                    hook(ended_by);
                }
            }
        };
        loop {
            match self
                .redis
                .try_lock(&keys.lock, &token, self.settings.lock_ttl)
                .await
            {
                Ok(true) => {
                    wait_ended("takeover", waiting_since);
                    tracing::Span::current().record("role", "leader");
                    return self.lead(key, &keys, &token, None).await;
                }
                Ok(false) => {}
                Err(error) => return self.fail_open(key, error).await,
            }
            let since = *waiting_since.get_or_insert_with(Instant::now);
            if pubsub && subscription.is_none() {
                match self.subscriber.subscribe(&keys.channel).await {
                    Ok(s) => subscription = Some(s),
                    Err(error) => return self.fail_open(key, error).await,
                }
                if let Some(hook) = &self.settings.hooks.before_recheck {
                    hook(keys.value.clone()).await;
                }
            }
            // Re-check: the leader may have finished (and published) before
            // our subscription existed, or since our last look.
            match self.redis.lookup(&keys.value).await {
                Ok(Lookup::Entry(entry)) => {
                    if let Some(outcome) = settled_by(entry) {
                        wait_ended(ended_by(&outcome, "recheck"), Some(since));
                        return outcome;
                    }
                }
                Ok(_) => {}
                Err(error) => return self.fail_open(key, error).await,
            }
            let now = Instant::now();
            if now >= deadline {
                wait_ended("timeout", Some(since));
                return Outcome::TimedOut;
            }
            let Some(subscription) = subscription.as_mut() else {
                // poll: sleep one interval, then look again.
                tokio::time::sleep_until((now + self.settings.poll_interval).min(deadline).into())
                    .await;
                continue;
            };
            let lock_left = match self.redis.pttl(&keys.lock).await {
                Ok(None) => continue, // released meanwhile: look and try again now
                Ok(Some(Some(left))) => left + Duration::from_millis(1),
                Ok(Some(None)) => self.settings.lock_ttl, // no expiry: set from outside
                Err(error) => return self.fail_open(key, error).await,
            };
            let wake_at = (now + lock_left).min(deadline);
            match tokio::time::timeout_at(wake_at.into(), subscription.recv()).await {
                Ok(Notice::Message(payload)) => match Entry::decode(payload) {
                    Ok(entry) => {
                        if let Some(outcome) = settled_by(entry) {
                            wait_ended(ended_by(&outcome, "message"), Some(since));
                            return outcome;
                        }
                    }
                    Err(error) => {
                        metrics::garbage("message");
                        tracing::warn!(%error, channel = keys.channel, "undecodable ready message ignored");
                    }
                },
                Ok(Notice::Recheck) => {}
                // The lock's expiry (loop: re-check, maybe lead) or the deadline.
                Err(_elapsed) => {}
            }
        }
    }

    /// The leader's part: double-check, load under the watchdog, finish in
    /// one round trip. `seen` (early refresh): the stored_at of the fresh
    /// entry being replaced, which the double-check must not accept.
    async fn lead(&self, key: &S::Key, keys: &ItemKeys, token: &str, seen: Option<u64>) -> Outcome {
        // The previous leader may have finished between our first GET and our
        // SET NX (its lock gone, its value in place): do not load twice.
        match self.redis.lookup(&keys.value).await {
            Ok(Lookup::Entry(entry)) => {
                let newer = seen.is_none_or(|seen| entry.stored_at() > seen);
                let done = match judge(entry, now_millis()) {
                    Verdict::Serve(entry) if newer => Some(Outcome::Shared(entry)),
                    Verdict::Failed => Some(Outcome::Failed),
                    _ => None,
                };
                if let Some(done) = done {
                    if let Err(error) = self.redis.release(&keys.lock, token).await {
                        tracing::warn!(%error, "failed to release an unused lock; it expires by itself");
                    }
                    return done;
                }
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "redis failed after taking the lock; loading anyway")
            }
        }
        let (entry, ttl) = self.load_under_watchdog(key, &keys.lock, token).await;
        let s = &self.settings;
        let fresh = Duration::from_millis(entry.fresh_until().saturating_sub(entry.stored_at()));
        let store = match (entry.status(), ttl) {
            (Status::Found, Some(ttl)) => StoreFor {
                value: ttl + s.stale_while_revalidate,
                fail_safe: if s.max_stale > s.stale_while_revalidate {
                    fresh + s.max_stale
                } else {
                    Duration::ZERO
                },
                failure: Duration::ZERO,
            },
            (_, Some(ttl)) => StoreFor {
                value: ttl,
                fail_safe: Duration::ZERO,
                failure: Duration::ZERO,
            },
            (_, None) => StoreFor {
                value: Duration::ZERO,
                fail_safe: Duration::ZERO,
                failure: if s.failure_ttl.is_zero() {
                    Duration::ZERO
                } else {
                    s.jitter.apply(s.failure_ttl)
                },
            },
        };
        match self
            .redis
            .finish(
                &keys.value,
                &keys.lock,
                &keys.fail_safe,
                &keys.channel,
                token,
                &entry,
                store,
            )
            .await
        {
            Ok(finished) => {
                if !finished.released {
                    tracing::warn!(
                        lock = keys.lock,
                        "lock expired during the load and was not ours to release"
                    );
                }
                if entry.status() == Status::Failed && finished.published.status() == Status::Found
                {
                    tracing::warn!(%key, "load failed; serving the fail-safe copy");
                }
                loaded(finished.published)
            }
            Err(error) => {
                tracing::warn!(%error, "failed to publish the outcome; waiters fall back to the lock's expiry");
                loaded(entry)
            }
        }
    }

    /// Loads while a watchdog extends the lock every third of LOCK_TTL, so a
    /// slow but live leader is not taken over; a dead one stops extending and
    /// its lock expires after LOCK_TTL.
    async fn load_under_watchdog(
        &self,
        key: &S::Key,
        lock: &str,
        token: &str,
    ) -> (Entry, Option<Duration>) {
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

    async fn fail_open(&self, key: &S::Key, error: RedisError) -> Outcome {
        tracing::warn!(%error, "redis failed; failing open to the source");
        self.bypass(key).await
    }

    async fn bypass(&self, key: &S::Key) -> Outcome {
        tracing::Span::current().record("role", "bypass");
        match self.load_entry(key).await.0 {
            entry if entry.status() == Status::Failed => Outcome::Failed,
            entry => Outcome::Bypassed(entry),
        }
    }

    /// Loads and builds the entry, with the (jittered) freshness to store it
    /// for; `None` for a failed load.
    async fn load_entry(&self, key: &S::Key) -> (Entry, Option<Duration>) {
        let started = Instant::now();
        let loaded = self.source.load(key).await;
        let took = started.elapsed();
        tracing::Span::current().record("load_ms", took.as_secs_f64() * 1e3);
        match loaded {
            Ok(Some(body)) => {
                metrics::db_load("found", took);
                tracing::debug!(%key, took_ms = took.as_secs_f64() * 1e3, "loaded");
                let ttl = self.settings.jitter.apply(self.settings.cache_ttl);
                (Entry::new(Status::Found, &body, ttl, took), Some(ttl))
            }
            Ok(None) => {
                metrics::db_load("not_found", took);
                tracing::debug!(%key, took_ms = took.as_secs_f64() * 1e3, "loaded: not found");
                let ttl = self.settings.jitter.apply(self.settings.negative_ttl);
                (Entry::new(Status::NotFound, &[], ttl, took), Some(ttl))
            }
            Err(error) => {
                metrics::db_load("failed", took);
                tracing::warn!(error = format!("{error:#}"), %key, "load failed");
                (Entry::new(Status::Failed, &[], Duration::ZERO, took), None)
            }
        }
    }
}

/// What a waiter makes of an entry it found (re-check) or was sent (message):
/// an answer, a failure, or nothing yet (a stale entry: keep waiting).
fn settled_by(entry: Entry) -> Option<Outcome> {
    match judge(entry, now_millis()) {
        Verdict::Serve(entry) => Some(Outcome::Shared(entry)),
        Verdict::Failed => Some(Outcome::Failed),
        Verdict::Stale(_) => None,
    }
}

/// The `ended_by` label of a wait that settled with `outcome` through `how`.
fn ended_by(outcome: &Outcome, how: &'static str) -> &'static str {
    if matches!(outcome, Outcome::Failed) {
        "failure"
    } else {
        how
    }
}

fn loaded(entry: Entry) -> Outcome {
    if entry.status() == Status::Failed {
        Outcome::Failed
    } else {
        Outcome::Loaded(entry)
    }
}

fn answer(role: Role, outcome: Result<Outcome, Abandoned>) -> Result<Answer, ReadError> {
    let (entry, served) = match outcome {
        Ok(Outcome::Loaded(entry)) if role == Role::Owner => (entry, Served::Miss),
        Ok(Outcome::Shared(entry)) if role == Role::Owner => (entry, Served::CoalescedRemote),
        Ok(Outcome::Loaded(entry)) | Ok(Outcome::Shared(entry)) => (entry, Served::CoalescedLocal),
        Ok(Outcome::Bypassed(entry)) => (entry, Served::Bypass),
        Ok(Outcome::Failed) | Err(Abandoned) => return Err(ReadError::Unavailable),
        Ok(Outcome::TimedOut) => return Err(ReadError::Timeout),
    };
    // A fail-safe copy re-served after a failed load is stale, whoever loaded.
    let served = if entry.is_backoff() {
        Served::Stale
    } else {
        served
    };
    Ok(Answer { entry, served })
}

/// A random token naming one leader's hold on a lock.
fn lock_token() -> String {
    format!("{:032x}", rand::rng().random::<u128>())
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, SeedableRng};

    use super::*;

    /// The refresh fires at the rate the formula predicts: exp(−r / (Δ·β)).
    #[test]
    fn xfetch_fires_at_the_predicted_rate() {
        let mut rng = StdRng::seed_from_u64(2015);
        let load = Duration::from_millis(20);
        let beta = 2.0; // Δ·β = 40 ms
        let fresh_until = 1_000_000;
        for remaining_ms in [0u64, 10, 40, 80, 160] {
            let trials = 20_000;
            let fired = (0..trials)
                .filter(|_| {
                    let u = 1.0 - rng.random::<f64>();
                    xfetch_fires(fresh_until - remaining_ms, fresh_until, load, beta, u)
                })
                .count();
            let rate = fired as f64 / trials as f64;
            let predicted = (-(remaining_ms as f64) / 40.0).exp();
            assert!(
                (rate - predicted).abs() < 0.015,
                "{remaining_ms} ms before expiry: fired {rate:.4}, predicted {predicted:.4}"
            );
        }
    }

    #[test]
    fn xfetch_never_fires_when_off() {
        assert!(!xfetch_fires(
            999,
            1000,
            Duration::from_secs(1),
            0.0,
            0.000_001
        ));
    }
}
