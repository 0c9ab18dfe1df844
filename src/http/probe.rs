//! HTTP: what `/readyz` reports of PostgreSQL and Redis, probed at most once
//! a second, on a PostgreSQL connection of its own.
//!
//! A flood of `/readyz` must not take the connections that loads need: each
//! request used to run `select 1` on the load pool. Now the first request
//! after a second has passed probes (the others wait for that probe, or use
//! the last one while it is under a second old), on a pool of one connection
//! named `postcache-readiness`, never the loads'. The breaker's state is
//! read live: it costs nothing.

use std::{
    sync::{Mutex, PoisonError},
    time::{Duration, Instant},
};

use sqlx::PgPool;

use crate::redis::RedisCommands;

/// How long a probe's result is reused.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Longest each probe (PostgreSQL, Redis) may take before it says down.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// What the last probe saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub postgres: bool,
    pub redis: bool,
}

/// The probe of one process.
pub struct Probe {
    /// One connection, not the loads'.
    db: PgPool,
    redis: RedisCommands,
    last: Mutex<Option<(Instant, Seen)>>,
    /// Held by the request that probes: the others wait for its result.
    probing: tokio::sync::Mutex<()>,
}

impl Probe {
    pub fn new(db: PgPool, redis: RedisCommands) -> Self {
        Self {
            db,
            redis,
            last: Mutex::new(None),
            probing: tokio::sync::Mutex::new(()),
        }
    }

    /// What PostgreSQL and Redis answer: the last probe if under
    /// [`PROBE_EVERY`] old, else a new one (one at a time).
    pub async fn seen(&self) -> Seen {
        if let Some(seen) = self.recent() {
            return seen;
        }
        // A request dropped while it waits or probes lets go of the lock.
        let _probing = self.probing.lock().await;
        // Probed by another request while this one waited.
        if let Some(seen) = self.recent() {
            return seen;
        }
        let seen = self.probe().await;
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some((Instant::now(), seen));
        seen
    }

    /// Closes the probe's connection (at shutdown).
    pub async fn close(&self) {
        self.db.close().await;
    }

    fn recent(&self) -> Option<Seen> {
        let last = *self.last.lock().unwrap_or_else(PoisonError::into_inner);
        last.filter(|(at, _)| at.elapsed() < PROBE_EVERY)
            .map(|(_, seen)| seen)
    }

    async fn probe(&self) -> Seen {
        let postgres =
            tokio::time::timeout(PROBE_TIMEOUT, sqlx::query("select 1").execute(&self.db));
        let redis = tokio::time::timeout(PROBE_TIMEOUT, self.redis.ping());
        let (postgres, redis) = tokio::join!(postgres, redis);
        Seen {
            postgres: matches!(postgres, Ok(Ok(_))),
            redis: matches!(redis, Ok(Ok(()))),
        }
    }
}
