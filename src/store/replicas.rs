//! The store: loads from PostgreSQL read replicas (DATABASE_REPLICA_URLS),
//! never a stale set from their lag.
//!
//! The trap (Facebook's memcache paper, §5): a row changes on the primary,
//! the change feed invalidates its key, the next miss reads a replica that
//! has not replayed the change, and the old row is cached for CACHE_TTL
//! with nothing left to invalidate it. The rule that avoids it:
//!
//! - A key whose leader's claim read a change fence (the commit LSN of its
//!   last change, which the feed in replication mode sets for every change,
//!   cached or not, for the fence's lifetime) is read only from a replica
//!   that has replayed that LSN. The replay position comes with the rows in
//!   one round trip, read before the rows' snapshot is taken
//!   (`postcache_read_posts`, migration 0005), and is checked per key: a
//!   key the replica turns out to be behind on is read from the primary.
//!   Going to the primary rather than waiting for the replica: measured,
//!   a wait costs the request the replica's whole delay, a primary read
//!   one indexed lookup.
//! - A key with no fence changed longer ago than the fence's lifetime; a
//!   replica in the rotation has replayed everything older than
//!   REPLICA_MAX_LAG + [`PROBE_FRESH`], which start keeps below that lifetime
//!   ([`check_replica_lag`]: refused otherwise), so any replica in the rotation
//!   will do.
//! - A change to every post (a transaction past the feed's bound on rows,
//!   TRUNCATE, a gap) raises the cutoff instead of fencing keys: every load
//!   then must include its LSN for the fence's lifetime, and the keys read
//!   from a replica behind it in the milliseconds before this instance
//!   learnt of it are fenced after the fact (see `replica_floor.rs`).
//! - Replicas are read only while the change feed is up in replication
//!   mode: other modes' fences are no LSNs, and with the feed down no fence
//!   is set.
//!
//! Every second a probe reads the primary's WAL insert position and each
//! replica's replay position (each on a connection of its own, not the
//! loads'). A replica's lag in seconds is the age of the newest primary
//! position it has replayed (0 when it has replayed the current one); it is
//! in the rotation while its last probe succeeded under [`PROBE_FRESH`] ago,
//! its lag is within REPLICA_MAX_LAG, and fewer than [`REPLICA_FAILURES`]
//! loads in a row failed on it (its breaker; a probe that succeeds closes
//! it; the probe is at the end of this file). Loads spread over the
//! replicas in rotation in turn, fail over to the next, and then to the
//! primary.
//!
//! A standby promoted to primary is read as a primary: its position is then
//! its WAL insert position, which is past everything it replayed, so the
//! position never goes backwards for a server we read. Once promoted it
//! follows the old primary no more, its lag grows with the old primary's
//! commits, and it leaves the rotation by itself.

use std::{
    collections::{HashSet, VecDeque},
    sync::{
        atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering},
        Mutex, MutexGuard, PoisonError,
    },
    time::{Duration, Instant},
};

use sqlx::PgPool;

use super::{
    replica_floor::{Floor, Suspects},
    wal::wal_position,
};
use crate::{cache::now_millis, posts::Post, read_path::Since, telemetry::metrics};

/// How often the probe runs.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);
/// A replica whose last successful probe is older than this leaves the
/// rotation (its lag is no longer known).
pub const PROBE_FRESH: Duration = Duration::from_secs(3);
/// Loads failing in a row on a replica that open its breaker.
pub const REPLICA_FAILURES: u32 = 3;

/// Refuses a REPLICA_MAX_LAG the change fences cannot cover. A key
/// changed longer ago than its fence lives (`fence`) is read from any
/// replica in the rotation, so every replica in it must have replayed
/// everything that old: at most REPLICA_MAX_LAG + [`PROBE_FRESH`] behind.
pub fn check_replica_lag(max_lag: Duration, fence: Duration) -> anyhow::Result<()> {
    anyhow::ensure!(
        max_lag + PROBE_FRESH < fence,
        "REPLICA_MAX_LAG ({}) + {} must be below the change fence's lifetime, 2 × (LOCK_TTL + LOAD_TIMEOUT) = {}",
        humantime::format_duration(max_lag),
        humantime::format_duration(PROBE_FRESH),
        humantime::format_duration(fence)
    );
    Ok(())
}

/// What a probe saw of a replica.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Seen {
    pub reachable: bool,
    pub lag_seconds: Option<f64>,
    pub lag_bytes: Option<u64>,
}

/// A replica as `/readyz` reports it.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct ReplicaReport {
    /// host:port/database.
    pub name: String,
    /// `up` (in the rotation), `lagging` (past REPLICA_MAX_LAG, or its lag
    /// unmeasured), `down` (unreachable, or not probed lately),
    /// `circuit_open` (its loads failed).
    #[schema(value_type = String, pattern = "^(up|lagging|down|circuit_open)$")]
    pub state: &'static str,
    /// Seconds of the primary's commits it has not replayed.
    pub lag_seconds: Option<f64>,
    /// Bytes of WAL between the primary's position and its replay.
    pub lag_bytes: Option<u64>,
}

/// One replica: its pools and what its probe and loads saw.
pub struct Replica {
    /// host:port/database, for logs, metrics and `/readyz`.
    name: String,
    /// The loads' connections.
    pool: PgPool,
    /// The probe's one connection.
    probe: PgPool,
    /// The highest replay position seen (probe or load), bytes from 0/0.
    replayed: AtomicU64,
    /// Loads failed in a row (the breaker: open at [`REPLICA_FAILURES`]).
    failures: AtomicU32,
    /// Set by the probe: reachable and within REPLICA_MAX_LAG.
    healthy: AtomicBool,
    /// Milliseconds since the set's epoch of the last successful probe.
    probed_at: AtomicU64,
    /// What the last probe saw, for `/readyz`.
    seen: Mutex<Seen>,
}

/// The read replicas of one process.
pub struct Replicas {
    replicas: Vec<Replica>,
    /// One connection to the primary, for its WAL position.
    primary: PgPool,
    max_lag: Duration,
    /// Longest a load spends on the replicas, all of them together (half
    /// of LOAD_TIMEOUT): past it the load goes on to the primary. A replica
    /// whose network stalls (no answer, not even the statement timeout's)
    /// costs a load at most this, not its whole LOAD_TIMEOUT, until the
    /// probe takes it out of the rotation; and however many stall, the
    /// primary keeps the other half.
    read_timeout: Duration,
    epoch: Instant,
    /// Where the next load starts its turn.
    next: AtomicUsize,
    /// The change feed is up in replication mode (fences are LSNs).
    feed_up: AtomicBool,
    /// The primary's WAL insert positions, oldest first.
    history: Mutex<VecDeque<(Instant, u64)>>,
    /// What every load must include after a change to every post, and the
    /// keys served lately (see `replica_floor.rs`).
    floor: Mutex<Floor>,
}

/// Where a load's keys were read.
pub(super) struct Routed {
    /// Posts read from a replica that had replayed their keys' changes.
    pub found: Vec<Post>,
    /// Keys to read from the primary.
    pub primary: Vec<i64>,
    /// A position no post read from a replica is newer than (0: none read).
    pub upto: u64,
}

/// Posts read at a position (see [`read_positioned`]).
#[derive(Debug)]
pub(super) struct Positioned {
    /// Every commit up to here is in the posts (a standby's replay
    /// position before the read), or, from a primary, its WAL insert
    /// position before the read (which may name commits not visible yet).
    pub before: u64,
    /// No post is newer than this: the same position, read after the read.
    pub after: u64,
    pub posts: Vec<Post>,
}

/// A row of `postcache_read_posts`: the first carries only the replay
/// position; `after_lsn` is read once the function has returned.
#[derive(sqlx::FromRow)]
struct Row {
    replay_lsn: i64,
    after_lsn: i64,
    #[sqlx(flatten)]
    post: crate::posts::PostColumns,
}

/// The posts `ids` with the position the server had replayed (a standby)
/// or written (a primary) before their snapshot was taken, and the same
/// position after, in one round trip (`postcache_read_posts`, migration
/// 0005, whose rows are all made before the outer select reads the
/// position again).
pub(super) async fn read_positioned(pool: &PgPool, ids: &[i64]) -> Result<Positioned, sqlx::Error> {
    let rows = sqlx::query_as::<_, Row>(
        "select replay_lsn,
                (case when pg_is_in_recovery()
                      then coalesce(pg_last_wal_replay_lsn(), '0/0'::pg_lsn)
                      else pg_current_wal_insert_lsn() end - '0/0'::pg_lsn)::bigint as after_lsn,
                post_id as id, post_title as title, post_body as body,
                post_author as author, post_created_at as created_at,
                post_updated_at as updated_at
         from postcache_read_posts($1)",
    )
    .bind(ids)
    .fetch_all(pool)
    .await?;
    let (replayed, after) = rows
        .first()
        .map(|row| (row.replay_lsn, row.after_lsn))
        .ok_or_else(|| sqlx::Error::Protocol("no replay position".into()))?;
    let after = rows.iter().map(|row| row.after_lsn).max().unwrap_or(after);
    let posts = rows.into_iter().filter_map(|row| row.post.post()).collect();
    Ok(Positioned {
        before: u64::try_from(replayed).unwrap_or(0),
        after: u64::try_from(after).unwrap_or(0),
        posts,
    })
}

impl Replicas {
    /// `replicas`: (name, the loads' pool, the probe's pool) each;
    /// `primary`: a connection of the probe's to the primary; `fence_ttl`:
    /// how long a change's fence lives.
    pub fn new(
        replicas: Vec<(String, PgPool, PgPool)>,
        primary: PgPool,
        max_lag: Duration,
        fence_ttl: Duration,
        load_timeout: Duration,
    ) -> Self {
        Self {
            replicas: replicas
                .into_iter()
                .map(|(name, pool, probe)| Replica {
                    name,
                    pool,
                    probe,
                    replayed: AtomicU64::new(0),
                    failures: AtomicU32::new(0),
                    healthy: AtomicBool::new(false),
                    probed_at: AtomicU64::new(0),
                    seen: Mutex::new(Seen::default()),
                })
                .collect(),
            primary,
            max_lag,
            read_timeout: load_timeout / 2,
            epoch: Instant::now(),
            next: AtomicUsize::new(0),
            feed_up: AtomicBool::new(false),
            history: Mutex::new(VecDeque::new()),
            floor: Mutex::new(Floor::new(fence_ttl)),
        }
    }

    /// Every post changed at `since`, the fleet's cutoff raised to `cutoff`
    /// for it: see [`Floor::all_changed`].
    pub fn all_changed(&self, since: Since, cutoff: u64) -> Suspects {
        self.lock_floor().all_changed(since, cutoff, now_millis())
    }

    fn lock_floor(&self) -> MutexGuard<'_, Floor> {
        self.floor.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the change feed is up in replication mode (see the module).
    pub fn set_feed_up(&self, up: bool) {
        self.feed_up.store(up, Ordering::Relaxed);
    }

    fn millis(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn in_rotation(&self, replica: &Replica) -> bool {
        replica.healthy.load(Ordering::Relaxed)
            && replica.failures.load(Ordering::Relaxed) < REPLICA_FAILURES
            && self
                .millis()
                .saturating_sub(replica.probed_at.load(Ordering::Relaxed))
                <= PROBE_FRESH.as_millis() as u64
    }

    /// Reads what it can of `keys` from replicas (see the module): the
    /// posts found there, and the keys left for the primary.
    pub(super) async fn read(&self, keys: &[(i64, Since)]) -> Routed {
        let floor = self.lock_floor().get();
        let mut left: Vec<(i64, Since)> = keys
            .iter()
            .map(|&(id, since)| (id, since.max(floor)))
            .collect();
        let mut found = Vec::new();
        if !self.feed_up.load(Ordering::Relaxed) {
            metrics::routed_to_primary("no_replica", left.len());
            return Routed {
                found,
                primary: left.into_iter().map(|(id, _)| id).collect(),
                upto: 0,
            };
        }
        let n = self.replicas.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut tried_any = false;
        let mut failed = false;
        let mut busy = false;
        let mut upto = 0;
        let deadline = tokio::time::Instant::now() + self.read_timeout;
        for i in 0..n {
            if left.is_empty() || tokio::time::Instant::now() >= deadline {
                break;
            }
            let replica = &self.replicas[(start + i) % n];
            if !self.in_rotation(replica) {
                continue;
            }
            tried_any = true;
            // Keys this replica is known to have replayed far enough for.
            let known = replica.replayed.load(Ordering::Relaxed);
            let ask: Vec<i64> = left
                .iter()
                .filter(|(_, since)| since.0 <= known)
                .map(|(id, _)| *id)
                .collect();
            let asked: HashSet<i64> = ask.iter().copied().collect();
            if ask.is_empty() {
                continue;
            }
            match self.read_from(replica, &ask, deadline).await {
                Ok(Positioned {
                    before: replayed,
                    after,
                    posts,
                }) => {
                    upto = upto.max(after);
                    replica.failures.store(0, Ordering::Relaxed);
                    replica.replayed.fetch_max(replayed, Ordering::Relaxed);
                    // Per key: served here only if its change was replayed,
                    // by the floor as it is now (see `replica_floor.rs`).
                    let before = left.len();
                    let mut floor = self.lock_floor();
                    let now = now_millis();
                    left.retain(|&(id, since)| {
                        !(asked.contains(&id) && floor.serve(id, since, replayed, now))
                    });
                    drop(floor);
                    let done = before - left.len();
                    let behind: HashSet<i64> = left.iter().map(|(id, _)| *id).collect();
                    found.extend(posts.into_iter().filter(|post| !behind.contains(&post.id)));
                    metrics::routed_to_replica(done);
                }
                Err(ReadFailed::Busy) => busy = true,
                Err(ReadFailed::Error(error)) => {
                    failed = true;
                    let failures = replica.failures.fetch_add(1, Ordering::Relaxed) + 1;
                    if failures == REPLICA_FAILURES {
                        tracing::warn!(replica = %replica.name, error = format!("{error:#}"),
                            "replica loads failing: out of the rotation until its probe succeeds");
                    } else {
                        tracing::debug!(replica = %replica.name, error = format!("{error:#}"),
                            "replica load failed; trying the next");
                    }
                }
            }
        }
        if !left.is_empty() {
            let reason = if failed {
                "failed"
            } else if busy {
                "busy"
            } else if tried_any {
                "behind"
            } else {
                "no_replica"
            };
            metrics::routed_to_primary(reason, left.len());
        }
        Routed {
            found,
            primary: left.into_iter().map(|(id, _)| id).collect(),
            upto,
        }
    }

    /// One round trip: the replica's replay position, then the posts; given
    /// up at `deadline`, the end of the load's time for replicas.
    async fn read_from(
        &self,
        replica: &Replica,
        ids: &[i64],
        deadline: tokio::time::Instant,
    ) -> Result<Positioned, ReadFailed> {
        let rows = read_positioned(&replica.pool, ids);
        tokio::time::timeout_at(deadline, rows)
            .await
            .map_err(|_| {
                ReadFailed::Error(anyhow::anyhow!(
                    "no answer within the load's {:?} for replicas",
                    self.read_timeout
                ))
            })?
            .map_err(|error| match error {
                sqlx::Error::PoolTimedOut
                    if replica.pool.size() >= replica.pool.options().get_max_connections() =>
                {
                    ReadFailed::Busy
                }
                error => ReadFailed::Error(error.into()),
            })
    }

    /// Reads `ids` from a replica in the rotation that has replayed `min`
    /// (a WAL position), as its replay position read with the rows shows:
    /// what it read, or `None` when no replica is known to be that far or
    /// none answered in time. For reads that ask for a position
    /// (`PostCache-Min-LSN`); nothing read here is stored.
    pub(super) async fn read_at_least(&self, ids: &[i64], min: u64) -> Option<Positioned> {
        let n = self.replicas.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + self.read_timeout;
        for i in 0..n {
            let replica = &self.replicas[(start + i) % n];
            if !self.in_rotation(replica) || replica.replayed.load(Ordering::Relaxed) < min {
                continue;
            }
            match self.read_from(replica, ids, deadline).await {
                Ok(read) => {
                    replica.failures.store(0, Ordering::Relaxed);
                    replica.replayed.fetch_max(read.before, Ordering::Relaxed);
                    if read.before >= min {
                        return Some(read);
                    }
                }
                Err(ReadFailed::Busy) => {}
                Err(ReadFailed::Error(error)) => {
                    replica.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(replica = %replica.name, error = format!("{error:#}"),
                        "replica read for a position failed; trying the next");
                }
            }
        }
        None
    }

    /// Closes every pool (at shutdown).
    pub async fn close(&self) {
        for replica in &self.replicas {
            replica.pool.close().await;
            replica.probe.close().await;
        }
        self.primary.close().await;
    }
}

enum ReadFailed {
    /// Every connection of the replica's taken: not its failure.
    Busy,
    Error(anyhow::Error),
}

// The probe: every second the primary's WAL insert position and each
// replica's replay position, each on a connection of its own; from them
// each replica's lag and its place in the rotation, and what `/readyz`
// reports.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_max_lag_the_change_fences_cannot_cover_is_refused() {
        let fence = Duration::from_secs(15);
        assert!(check_replica_lag(Duration::from_secs(5), fence).is_ok());
        let error = check_replica_lag(Duration::from_secs(12), fence).unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("REPLICA_MAX_LAG (12s) + 3s must be below"),
            "{error}"
        );
    }
}
