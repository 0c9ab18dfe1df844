//! The protocol: the read path's settings (built from the serve settings by
//! `startup::read_path_settings`).

use std::time::Duration;

#[cfg(feature = "testkit")]
use super::Hooks;
use super::{Strategy, Wake};
use crate::cache::Jitter;

/// The lifetimes and bounds the read path works with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The load-lab strategy (read only by `strategy.rs`).
    pub strategy: Strategy,
    /// How waiters learn that the leader is done.
    pub wake: Wake,
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
