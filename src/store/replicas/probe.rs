//! The replicas' probe: every second the primary's WAL insert position and
//! each replica's replay position, each on a connection of its own; from
//! them each replica's lag and its place in the rotation, and what
//! `/readyz` reports.

use std::{
    sync::{atomic::Ordering, PoisonError},
    time::{Duration, Instant},
};

use super::{
    super::wal::wal_position, Replica, ReplicaReport, Replicas, Seen, PROBE_EVERY, PROBE_FRESH,
    REPLICA_FAILURES,
};
use crate::telemetry::metrics;

/// Longest each probe query may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// The primary's positions kept to measure lag in seconds.
const HISTORY: Duration = Duration::from_secs(120);

impl Replicas {
    /// Probes every [`PROBE_EVERY`], for ever (the caller aborts it).
    pub async fn probe_forever(&self) {
        let mut tick = tokio::time::interval(PROBE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.probe().await;
        }
    }

    /// The primary's position, then each replica's; their lags; the rotation.
    pub async fn probe(&self) {
        let sampled = Instant::now();
        let primary = tokio::time::timeout(PROBE_TIMEOUT, wal_position(&self.primary)).await;
        let current = match primary {
            Ok(Ok(lsn)) => {
                let mut history = self.history.lock().unwrap_or_else(PoisonError::into_inner);
                history.push_back((sampled, lsn));
                while history
                    .front()
                    .is_some_and(|(at, _)| at.elapsed() > HISTORY)
                {
                    history.pop_front();
                }
                Some(lsn)
            }
            // Measured against the positions sampled before: the lag grows
            // as if the primary went on committing.
            Ok(Err(error)) => {
                tracing::debug!(%error, "replica probe: the primary's position unread");
                None
            }
            Err(_) => None,
        };
        let probes = self.replicas.iter().map(|replica| async move {
            let replayed = tokio::time::timeout(
                PROBE_TIMEOUT,
                sqlx::query_scalar::<_, i64>(
                    "select replay_lsn from postcache_read_posts('{}') limit 1",
                )
                .fetch_one(&replica.probe),
            )
            .await;
            (replica, replayed)
        });
        for (replica, replayed) in futures::future::join_all(probes).await {
            let replayed = match replayed {
                Ok(Ok(lsn)) => Some(u64::try_from(lsn).unwrap_or(0)),
                Ok(Err(error)) => {
                    tracing::debug!(replica = %replica.name, %error, "replica probe failed");
                    None
                }
                Err(_) => None,
            };
            self.saw(replica, replayed, current);
        }
    }

    /// Records one replica's probe.
    fn saw(&self, replica: &Replica, replayed: Option<u64>, current: Option<u64>) {
        let Some(replayed) = replayed else {
            if replica.healthy.swap(false, Ordering::Relaxed) {
                tracing::warn!(replica = %replica.name, "replica unreachable: out of the rotation");
            }
            *replica.seen.lock().unwrap_or_else(PoisonError::into_inner) = Seen::default();
            metrics::replica(&replica.name, false, None, None);
            return;
        };
        replica.replayed.fetch_max(replayed, Ordering::Relaxed);
        let (lag, newest) = {
            let history = self.history.lock().unwrap_or_else(PoisonError::into_inner);
            let newest = history.back().map(|(_, lsn)| *lsn);
            let lag = match current {
                Some(current) if replayed >= current => Some(Duration::ZERO),
                _ => history
                    .iter()
                    .rev()
                    .find(|(_, lsn)| *lsn <= replayed)
                    .map(|(at, _)| at.elapsed()),
            };
            (lag, newest)
        };
        let lag_bytes = newest.map(|newest| newest.saturating_sub(replayed));
        let within = lag.is_some_and(|lag| lag <= self.max_lag);
        // A probe that succeeds closes the breaker.
        replica.failures.store(0, Ordering::Relaxed);
        replica
            .probed_at
            .store(self.millis().max(1), Ordering::Relaxed);
        let was = replica.healthy.swap(within, Ordering::Relaxed);
        if was != within {
            if within {
                tracing::info!(replica = %replica.name, lag_ms = lag.map(|l| l.as_millis() as u64), "replica in the rotation");
            } else {
                tracing::warn!(replica = %replica.name, lag_ms = lag.map(|l| l.as_millis() as u64),
                    max_lag_ms = self.max_lag.as_millis() as u64, "replica lags past REPLICA_MAX_LAG (or unmeasured): out of the rotation");
            }
        }
        let lag_seconds = lag.map(|lag| lag.as_secs_f64());
        *replica.seen.lock().unwrap_or_else(PoisonError::into_inner) = Seen {
            reachable: true,
            lag_seconds,
            lag_bytes,
        };
        metrics::replica(&replica.name, within, lag_seconds, lag_bytes);
    }

    /// Each replica as `/readyz` reports it.
    pub fn report(&self) -> Vec<ReplicaReport> {
        self.replicas
            .iter()
            .map(|replica| {
                let seen = *replica.seen.lock().unwrap_or_else(PoisonError::into_inner);
                let state = if !seen.reachable || !self.fresh(replica) {
                    "down"
                } else if replica.failures.load(Ordering::Relaxed) >= REPLICA_FAILURES {
                    "circuit_open"
                } else if !replica.healthy.load(Ordering::Relaxed) {
                    "lagging"
                } else {
                    "up"
                };
                ReplicaReport {
                    name: replica.name.clone(),
                    state,
                    lag_seconds: seen.lag_seconds,
                    lag_bytes: seen.lag_bytes,
                }
            })
            .collect()
    }

    fn fresh(&self, replica: &Replica) -> bool {
        let at = replica.probed_at.load(Ordering::Relaxed);
        at > 0 && self.millis().saturating_sub(at) <= PROBE_FRESH.as_millis() as u64
    }
}
