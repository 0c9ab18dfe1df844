//! The read path: cache lookup, in-process flight, fleet-wide leader election
//! and pub/sub wake-up. Generic over what it loads: it knows nothing of posts.
//!
//! ```text
//! get(key) ── GET value ──hit──► Hit
//!                │miss / garbage            │redis error
//!                ▼                          ▼
//!        in-process flight (one per key; joiners never touch Redis for it)
//!                │
//!   loop until WAIT_TIMEOUT:
//!     SET lock token NX PX LOCK_TTL ──won──► lead: GET again (someone may have
//!        │lost                               just finished), load, finish script
//!        ▼                                   (SET value; PUBLISH; DEL lock if token)
//!     SUBSCRIBE ready (shared, once) ─► GET again ─► PTTL lock ─► wait for:
//!        message ─► outcome                 lock expiry ─► loop (maybe lead)
//! ```
//!
//! Every Redis failure fails open: the flight loads straight from the source
//! (`Bypass`), still one load per key per process at a time.

mod local;
mod redis;
mod subscriber;

use std::{
    fmt::Display,
    future::Future,
    hash::Hash,
    pin::Pin,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use rand::Rng;
use tracing::Instrument;

use crate::{
    cache::{Entry, Jitter, Keys, Status},
    config::Strategy,
};
pub use local::{Abandoned, Flights, Role};
pub use redis::{Lookup, RedisCommands, RedisError};
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

/// How an answer was produced; becomes the `X-Cache` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// From the cache entry found by the first GET.
    Hit,
    /// Loaded by this request's own flight, as leader.
    Miss,
    /// Served by another request's load, in this process or another.
    Coalesced,
    /// Redis was skipped (failed or strategy `none`): loaded from the source.
    Bypass,
}

impl Served {
    pub fn as_str(self) -> &'static str {
        match self {
            Served::Hit => "hit",
            Served::Miss => "miss",
            Served::Coalesced => "coalesced",
            Served::Bypass => "bypass",
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
    /// The load failed (here or at the remote leader).
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
    /// Lifetime of a found entry.
    pub cache_ttl: Duration,
    /// Lifetime of a not-found entry.
    pub negative_ttl: Duration,
    pub jitter: Jitter,
    /// Lifetime of the leader lock.
    pub lock_ttl: Duration,
    /// Longest a flight waits for another's load.
    pub wait_timeout: Duration,
    /// How often `poll` waiters re-read the value.
    pub poll_interval: Duration,
    /// Test support: observation points inside the protocol.
    pub hooks: Hooks,
}

/// An async callback run at a point of the protocol, given the value key.
pub type Hook = Arc<dyn Fn(String) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Observation points for tests that must act at an exact step of the
/// protocol (for instance, write a value between a waiter's subscription and
/// its re-check). Empty in production.
#[derive(Clone, Default)]
pub struct Hooks {
    /// Runs after a waiter's subscription is confirmed, before its re-check.
    pub before_recheck: Option<Hook>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("before_recheck", &self.before_recheck.is_some())
            .finish()
    }
}

/// What one in-process flight ended with; shared by all its joiners.
#[derive(Debug, Clone)]
enum Outcome {
    /// This process's leader loaded it.
    Loaded(Entry),
    /// Another's load: the ready message or a re-check of the cache.
    Shared(Entry),
    /// Loaded from the source with Redis skipped.
    Bypassed(Entry),
    /// The load failed (here or remotely).
    Failed,
    /// WAIT_TIMEOUT passed.
    TimedOut,
}

/// The read path of one process.
pub struct ReadPath<S: Source> {
    source: S,
    keys: Keys,
    redis: RedisCommands,
    subscriber: Arc<Subscriber>,
    flights: Flights<S::Key, Outcome>,
    settings: Settings,
    /// Reads in progress (every `get` not yet answered): lets tests and
    /// metrics see how many requests a stampede holds.
    reads_in_progress: AtomicUsize,
}

/// Counts a read as in progress until dropped.
struct InProgress<'a>(&'a AtomicUsize);

impl<'a> InProgress<'a> {
    fn enter(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter)
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<S: Source> ReadPath<S> {
    pub fn new(
        source: S,
        keys: Keys,
        redis: RedisCommands,
        subscriber: Arc<Subscriber>,
        settings: Settings,
    ) -> Arc<Self> {
        Arc::new(Self {
            source,
            keys,
            redis,
            subscriber,
            flights: Flights::default(),
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

    /// In-process flights in progress.
    pub fn flights_in_progress(&self) -> usize {
        self.flights.len()
    }

    /// Reads not yet answered.
    pub fn reads_in_progress(&self) -> usize {
        self.reads_in_progress.load(Ordering::Relaxed)
    }

    /// Reads one item through the cache.
    pub async fn get(self: &Arc<Self>, key: S::Key) -> Result<Answer, ReadError> {
        let _in_progress = InProgress::enter(&self.reads_in_progress);
        let span = tracing::Span::current();
        if self.settings.strategy == Strategy::None {
            span.record("role", "direct");
            return self.load(&key).await.map(|entry| Answer {
                entry,
                served: Served::Bypass,
            });
        }
        let value_key = self.keys.value(&key);
        let redis_up = match self.redis.lookup(&value_key).await {
            Ok(Lookup::Entry(entry)) if entry.status() != Status::Failed => {
                return Ok(Answer {
                    entry,
                    served: Served::Hit,
                })
            }
            Ok(Lookup::Entry(_)) | Ok(Lookup::Absent) => true,
            Ok(Lookup::Garbage(error)) => {
                tracing::warn!(%error, key = %value_key, "undecodable cache entry, treated as a miss");
                true
            }
            Err(error) => {
                tracing::warn!(%error, "redis lookup failed; failing open");
                false
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
                this.fly(key, redis_up)
                    .instrument(tracing::info_span!("flight"))
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

    /// One flight: what happens once per key per process on a miss.
    async fn fly(self: Arc<Self>, key: S::Key, redis_up: bool) -> Outcome {
        if !redis_up {
            return self.bypass(&key).await;
        }
        match self.settings.strategy {
            Strategy::None | Strategy::Naive | Strategy::Local => {
                let entry = match self.load_and_ttl(&key).await {
                    (entry, None) => entry,
                    (entry, Some(ttl)) => {
                        if let Err(error) =
                            self.redis.store(&self.keys.value(&key), &entry, ttl).await
                        {
                            tracing::warn!(%error, "failed to store the entry");
                        }
                        entry
                    }
                };
                loaded(entry)
            }
            Strategy::Poll | Strategy::Pubsub => self.coordinate(&key).await,
        }
    }

    /// Fleet-wide coordination: lead, or wait for the leader's outcome.
    async fn coordinate(&self, key: &S::Key) -> Outcome {
        let deadline = Instant::now() + self.settings.wait_timeout;
        let value_key = self.keys.value(key);
        let lock_key = self.keys.lock(key);
        let channel = self.keys.channel(key);
        let token = lock_token();
        let pubsub = self.settings.strategy == Strategy::Pubsub;
        let mut subscription: Option<Subscription> = None;
        loop {
            match self
                .redis
                .try_lock(&lock_key, &token, self.settings.lock_ttl)
                .await
            {
                Ok(true) => {
                    return self
                        .lead(key, &value_key, &lock_key, &channel, &token)
                        .await
                }
                Ok(false) => {}
                Err(error) => return self.fail_open(key, error).await,
            }
            if pubsub && subscription.is_none() {
                match self.subscriber.subscribe(&channel).await {
                    Ok(s) => subscription = Some(s),
                    Err(error) => return self.fail_open(key, error).await,
                }
            }
            if let Some(hook) = &self.settings.hooks.before_recheck {
                hook(value_key.clone()).await;
            }
            // Re-check: the leader may have finished (and published) before
            // our subscription existed, or since our last look.
            match self.redis.lookup(&value_key).await {
                Ok(Lookup::Entry(entry)) if entry.status() != Status::Failed => {
                    return Outcome::Shared(entry)
                }
                Ok(_) => {}
                Err(error) => return self.fail_open(key, error).await,
            }
            let now = Instant::now();
            if now >= deadline {
                return Outcome::TimedOut;
            }
            let Some(subscription) = subscription.as_mut() else {
                // poll: sleep one interval, then look again.
                tokio::time::sleep_until((now + self.settings.poll_interval).min(deadline).into())
                    .await;
                continue;
            };
            let lock_left = match self.redis.pttl(&lock_key).await {
                Ok(None) => continue, // released meanwhile: look and try again now
                Ok(Some(Some(left))) => left + Duration::from_millis(1),
                Ok(Some(None)) => self.settings.lock_ttl, // no expiry: set from outside
                Err(error) => return self.fail_open(key, error).await,
            };
            let wake_at = (now + lock_left).min(deadline);
            match tokio::time::timeout_at(wake_at.into(), subscription.recv()).await {
                Ok(Notice::Message(payload)) => match Entry::decode(payload) {
                    Ok(entry) => match entry.status() {
                        Status::Found | Status::NotFound => return Outcome::Shared(entry),
                        Status::Failed => return Outcome::Failed,
                    },
                    Err(error) => {
                        tracing::warn!(%error, channel, "undecodable ready message ignored");
                    }
                },
                Ok(Notice::Recheck) => {}
                // The lock's expiry (loop: re-check, maybe lead) or the deadline.
                Err(_elapsed) => {}
            }
        }
    }

    /// The leader's part: double-check, load, finish in one round trip.
    async fn lead(
        &self,
        key: &S::Key,
        value_key: &str,
        lock_key: &str,
        channel: &str,
        token: &str,
    ) -> Outcome {
        // The previous leader may have finished between our first GET and our
        // SET NX (its lock gone, its value in place): do not load twice.
        match self.redis.lookup(value_key).await {
            Ok(Lookup::Entry(entry)) if entry.status() != Status::Failed => {
                if let Err(error) = self.redis.release(lock_key, token).await {
                    tracing::warn!(%error, "failed to release an unused lock; it expires by itself");
                }
                return Outcome::Shared(entry);
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "redis failed after taking the lock; loading anyway")
            }
        }
        let (entry, ttl) = self.load_and_ttl(key).await;
        match self
            .redis
            .finish(value_key, lock_key, channel, token, &entry, ttl)
            .await
        {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                lock_key,
                "lock expired during the load and was not ours to release"
            ),
            Err(error) => {
                tracing::warn!(%error, "failed to publish the outcome; waiters fall back to the lock's expiry")
            }
        }
        loaded(entry)
    }

    async fn fail_open(&self, key: &S::Key, error: RedisError) -> Outcome {
        tracing::warn!(%error, "redis failed; failing open to the source");
        self.bypass(key).await
    }

    async fn bypass(&self, key: &S::Key) -> Outcome {
        match self.load(key).await {
            Ok(entry) => Outcome::Bypassed(entry),
            Err(_) => Outcome::Failed,
        }
    }

    /// Loads straight from the source.
    async fn load(&self, key: &S::Key) -> Result<Entry, ReadError> {
        match self.load_and_ttl(key).await.0 {
            entry if entry.status() == Status::Failed => Err(ReadError::Unavailable),
            entry => Ok(entry),
        }
    }

    /// Loads and builds the entry, with the (jittered) TTL to store it for;
    /// `None` for a failed load, which is published but not stored.
    async fn load_and_ttl(&self, key: &S::Key) -> (Entry, Option<Duration>) {
        let started = Instant::now();
        let loaded = self.source.load(key).await;
        let took = started.elapsed();
        tracing::Span::current().record("load_ms", took.as_secs_f64() * 1e3);
        match loaded {
            Ok(Some(body)) => {
                let ttl = self.settings.jitter.apply(self.settings.cache_ttl);
                (Entry::new(Status::Found, &body, ttl, took), Some(ttl))
            }
            Ok(None) => {
                let ttl = self.settings.jitter.apply(self.settings.negative_ttl);
                (Entry::new(Status::NotFound, &[], ttl, took), Some(ttl))
            }
            Err(error) => {
                tracing::warn!(error = format!("{error:#}"), %key, "load failed");
                (Entry::new(Status::Failed, &[], Duration::ZERO, took), None)
            }
        }
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
        Ok(Outcome::Loaded(entry)) | Ok(Outcome::Shared(entry)) => (entry, Served::Coalesced),
        Ok(Outcome::Bypassed(entry)) => (entry, Served::Bypass),
        Ok(Outcome::Failed) | Err(Abandoned) => return Err(ReadError::Unavailable),
        Ok(Outcome::TimedOut) => return Err(ReadError::Timeout),
    };
    tracing::Span::current().record("outcome", served.as_str());
    Ok(Answer { entry, served })
}

/// A random token naming one leader's hold on a lock.
fn lock_token() -> String {
    format!("{:032x}", rand::rng().random::<u128>())
}
