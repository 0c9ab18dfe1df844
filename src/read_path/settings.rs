//! The protocol: the read path's settings (built from the serve settings by
//! `startup::read_path_settings`): its lifetimes and bounds, how waiters
//! wake, the load lab's strategy (CACHE_STRATEGY, which startup turns into
//! the other settings it implies), and the test hooks.

use std::time::Duration;

#[cfg(feature = "testkit")]
use super::machine::WaitEnd;
use crate::cache::Jitter;

/// The lifetimes and bounds the read path works with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The load lab's strategy: read only where the read path is made,
    /// which puts a lab reader (`lab.rs`) in front for the baselines. What
    /// else a strategy implies is a setting of its own, chosen at startup
    /// ([`Strategy::wake`], [`Strategy::uses_memory`],
    /// [`Strategy::batches_loads`]).
    pub strategy: Strategy,
    /// How waiters learn that the leader is done.
    pub wake: Wake,
    /// Whether loads queued while statements run share the next statement
    /// (`batch.rs`); the baselines make a statement per request.
    pub batch_loads: bool,
    /// Freshness of a found entry.
    pub cache_ttl: Duration,
    /// Lifetime of a not-found entry.
    pub negative_ttl: Duration,
    pub jitter: Jitter,
    /// Lifetime of the leader lock (extended by the watchdog while loading).
    pub lock_ttl: Duration,
    /// Longest a flight waits for another's load, and a request for the
    /// flight of another request of this process.
    pub wait_timeout: Duration,
    /// Longest a load may take, whatever the connection does.
    pub load_timeout: Duration,
    /// Most keys one load statement reads, and most load statements in
    /// flight at once (see `batch.rs`).
    pub load_batch_max: usize,
    pub load_statements: usize,
    /// Longest a load waits for its statement to start before its instance
    /// is busy (DB_ACQUIRE_TIMEOUT).
    pub load_queue_timeout: Duration,
    /// Bound on each Redis command.
    pub redis_timeout: Duration,
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
    /// Largest body cached; a larger one is served uncached (a too-large
    /// marker is stored in its place).
    pub max_entry_bytes: usize,
    /// The memory tier's byte budget (0 = off) and L1_TTL.
    pub memory_bytes: u64,
    pub memory_ttl: Duration,
    /// Longest a read that asks for a position waits for the change feed
    /// to pass it before it is read past the cache (asked.rs).
    pub min_lsn_wait: Duration,
    /// Observation points for tests and benchmarks.
    #[cfg(feature = "testkit")]
    pub hooks: Hooks,
}

impl Settings {
    /// How long a change's fence outlives it: longer than any leader that
    /// may have read the row before the change can take to finish (its
    /// load, bounded by LOAD_TIMEOUT, then finish retries for LOCK_TTL),
    /// twice over.
    pub fn fence_ttl(&self) -> Duration {
        fence_ttl(self.lock_ttl, self.load_timeout)
    }
}

/// [`Settings::fence_ttl`] from LOCK_TTL and LOAD_TIMEOUT.
pub fn fence_ttl(lock_ttl: Duration, load_timeout: Duration) -> Duration {
    2 * (lock_ttl + load_timeout)
}

/// How a read finds its way from Redis to PostgreSQL (CACHE_STRATEGY):
/// the product (`pubsub`, `poll`) or a baseline it is measured against
/// (`load/compare`).
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

impl Strategy {
    /// How the waiters of a strategy learn that the leader is done.
    pub fn wake(self, poll_interval: Duration) -> Wake {
        match self {
            Self::Poll => Wake::Poll(poll_interval),
            // The baselines have no waiters; pub/sub is the product.
            Self::Pubsub | Self::None | Self::Naive | Self::Local => Wake::Message,
        }
    }

    /// Whether a strategy reads through the memory tier: the baselines that
    /// measure Redis alone (`none`, `naive`) do not.
    pub fn uses_memory(self) -> bool {
        match self {
            Self::Pubsub | Self::Poll | Self::Local => true,
            Self::None | Self::Naive => false,
        }
    }

    /// Whether a strategy's loads are batched (`batch.rs`): the protocol's
    /// are; the baselines make a statement per request, as the designs they
    /// stand for do.
    pub fn batches_loads(self) -> bool {
        match self {
            Self::Pubsub | Self::Poll => true,
            Self::None | Self::Naive | Self::Local => false,
        }
    }
}

/// How a waiter learns that the leader is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The leader's ready message on the item's channel (pub/sub, the default).
    Message,
    /// A re-read of the value every interval (the load lab's `poll`).
    Poll(Duration),
}

/// Observation points for tests and benchmarks that must act or measure at
/// an exact step of the protocol (the `testkit` feature only).
#[cfg(feature = "testkit")]
#[derive(Clone, Default)]
pub struct Hooks {
    /// Runs after a waiter's subscription is confirmed, before its re-check.
    pub before_recheck: Option<Hook>,
    /// Called the moment a wait ends, with what ended it.
    pub wait_ended: Option<std::sync::Arc<dyn Fn(WaitEnd) + Send + Sync>>,
    /// Runs after a leader's load, before its finish.
    pub after_load: Option<Hook>,
    /// A deliberate defect, for the coherence checker to find: the
    /// replication decoder loses each change (post id, commit LSN) this
    /// says to, neither applied to Redis nor put on the stream, and goes on
    /// as if it had applied it.
    pub lose_change: Option<std::sync::Arc<dyn Fn(i64, u64) -> bool + Send + Sync>>,
    /// A deliberate defect, for the coherence checker to find: no floors
    /// (floor.rs), so a process may serve an older version than it served.
    pub no_floors: bool,
    /// A deliberate defect, for the coherence checker to find: the decoder
    /// beats "nothing behind" without proving it (liveness.rs), as it did
    /// before: blind to a connection that went silent.
    pub blind_decoder: bool,
    /// A deliberate defect, for the coherence checker to find: an entry a
    /// change made stale with STALE_WHILE_REVALIDATE on is judged by its
    /// freshness deadline alone (the applier's clock) against this
    /// process's clock, its CHANGED flag ignored, as before the flag.
    pub changed_unflagged: bool,
}

/// An async callback run at a point of the protocol, given the value key.
#[cfg(feature = "testkit")]
pub type Hook = std::sync::Arc<
    dyn Fn(String) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync,
>;

#[cfg(feature = "testkit")]
impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("before_recheck", &self.before_recheck.is_some())
            .field("wait_ended", &self.wait_ended.is_some())
            .field("after_load", &self.after_load.is_some())
            .field("lose_change", &self.lose_change.is_some())
            .field("no_floors", &self.no_floors)
            .field("blind_decoder", &self.blind_decoder)
            .field("changed_unflagged", &self.changed_unflagged)
            .finish()
    }
}
