//! The change feed: changes made to `posts` in PostgreSQL, by any writer,
//! invalidate the cache fleet-wide within milliseconds. Two ways to learn
//! of them (CHANGE_FEED; `auto` picks the first where the server allows it):
//!
//! ```text
//! replication: writer ─► posts ─WAL─► the slot ─► one decoder per fleet (replication/)
//!                 ─► apply to Redis ─► XADD the fleet's stream ─► every instance forgets
//!                    (replication/fanout.rs) its memory tier's copy
//! trigger:     writer ─► posts ─trigger─► post_changes (outbox) ─NOTIFY─► every instance:
//!                 catch up from the outbox (by snapshot) ─► apply each change to Redis
//! ```
//!
//! - `replication` ([`replication`], its fan-out `replication/fanout.rs`): writers are untouched (no
//!   trigger, no NOTIFY, no privilege on anything of ours); PostgreSQL
//!   streams the slot to one instance, which applies each committed
//!   transaction to Redis (its commit LSN is the change's fence) and then
//!   confirms it, so the database does the same work for one instance or a
//!   hundred. Needs `wal_level = logical`.
//! - `trigger` (`trigger/`, its outbox `trigger/outbox.rs`): statement triggers on `posts` append
//!   every change to the outbox in the writer's own transaction, which
//!   notifies `postcache_changes`; each instance LISTENs and catches up from
//!   the outbox past the snapshot of its last catch-up, so nothing is missed
//!   while its connection is down. The outbox is pruned past
//!   CHANGE_RETENTION. Writers pay for it (an insert per statement, and
//!   NOTIFY serialises commits): the mode for a server without logical
//!   decoding.
//! - Apply: idempotent (`read_path/apply.rs`: fence, delete / mark stale /
//!   tombstone). While the feed is down, `/readyz` says `"change_feed":
//!   "down"` and `postcache_change_feed_up` is 0: the instance still serves,
//!   without its memory tier, and freshness falls back to the TTLs.
//! - The cutoff of `invalidate --all` is followed from Redis every second,
//!   with the feed or without it.

pub mod replication;
mod status;
mod trigger;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context;
use fred::interfaces::ClientLike;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;

pub use replication::{fanout, pgoutput};
pub use status::{FeedState, FeedStatus, Mode, Report};
pub use trigger::outbox::{self, Change, Op};

use crate::{
    config::{ChangeFeed, DatabaseSettings},
    read_path::ReadPath,
    store,
    store::PostStore,
    telemetry::metrics,
};

/// Longest a starting instance waits for its feed to be up before it
/// serves anyway, with the feed down (a first attempt that fails ends the
/// wait at once: PostgreSQL or Redis unreachable).
const STARTUP_WAIT: Duration = Duration::from_secs(3);
/// How often the cutoff of `invalidate --all` is read from Redis.
const CUTOFF_EVERY: Duration = Duration::from_secs(1);
/// Longest a shutdown waits for the feed's connections to close.
const CLOSE_LIMIT: Duration = Duration::from_secs(2);
/// How often a replication-mode instance judges its feed, and reads the
/// slot's lag from PostgreSQL while no decoder says it.
const JUDGE_EVERY: Duration = Duration::from_millis(100);
const SLOT_LAG_EVERY: Duration = Duration::from_secs(5);
/// Pauses while the mode cannot be told (PostgreSQL unreachable), and
/// between restarts of a feed task that ended.
const RETRY: Duration = Duration::from_secs(1);

/// How long the feed keeps and waits for things.
#[derive(Debug, Clone, Copy)]
pub struct FeedTimeouts {
    /// CHANGE_RETENTION: how long the outbox keeps a change (trigger).
    pub retention: Duration,
    /// REPLICATION_TIMEOUT: how long the decoder may go unheard
    /// (replication: see `replication/liveness.rs`).
    pub replication: Duration,
    /// REDIS_REPLICA_WAIT: how long the decoder waits for a Redis replica
    /// to acknowledge what it applied (see `redis/replicas.rs`; 0: not
    /// waited for).
    pub redis_replica: Duration,
}

/// The feed of one process, and the cutoff's follower; both stop when it
/// is stopped or dropped.
pub struct Feed {
    status: FeedStatus,
    pool: Option<PgPool>,
    _tasks: Vec<AbortOnDropHandle<()>>,
}

/// Everything a feed needs, whichever the mode.
#[derive(Clone)]
struct Setup {
    database: DatabaseSettings,
    retention: Duration,
    key_prefix: String,
    read_path: Arc<ReadPath<PostStore>>,
    pool: PgPool,
    state: Arc<watch::Sender<Option<FeedState>>>,
    report: Arc<Mutex<Report>>,
    /// Kept across restarts of the feed's tasks: reads wait on it.
    beats: Arc<fanout::Beats>,
    /// REPLICATION_TIMEOUT.
    replication_timeout: Duration,
    /// REDIS_REPLICA_WAIT.
    redis_replica_wait: Duration,
}

impl Feed {
    /// Starts following and returns once the feed is up or its first
    /// attempt failed, or after STARTUP_WAIT; `beats` learns the feed's
    /// position (the read path asks it: see `read_path/asked.rs`).
    pub async fn start(
        mode: ChangeFeed,
        database: &DatabaseSettings,
        timeouts: FeedTimeouts,
        key_prefix: &str,
        read_path: Arc<ReadPath<PostStore>>,
        beats: Arc<fanout::Beats>,
    ) -> anyhow::Result<Self> {
        // A cutoff raised before this process started holds from its
        // first request.
        if let Err(error) = read_path.follow_cutoff().await {
            tracing::warn!(%error, "could not read the cutoff of invalidate --all; following it in the background");
        }
        let mut tasks = vec![AbortOnDropHandle::new(tokio::spawn(follow_cutoff(
            read_path.clone(),
        )))];
        let report = Arc::new(Mutex::new(Report::default()));
        if mode == ChangeFeed::Off {
            tracing::info!(
                mode = "off",
                "change feed off: freshness from the TTLs alone"
            );
            report.lock().unwrap().mode = Some(Mode::Off);
            let (_, state) = watch::channel(Some(FeedState::Off));
            return Ok(Self {
                status: FeedStatus {
                    state,
                    report,
                    beats,
                },
                pool: None,
                _tasks: tasks,
            });
        }
        // The memory tier serves once the feed is up.
        read_path.serve_from_memory(false);
        // Catch-ups, pruning, the slot's upkeep: one connection.
        let pool = store::connect_feed(database, 1).context("invalid DATABASE_URL")?;
        let (sender, mut state) = watch::channel(None);
        let setup = Setup {
            database: database.clone(),
            retention: timeouts.retention,
            replication_timeout: timeouts.replication,
            redis_replica_wait: timeouts.redis_replica,
            key_prefix: key_prefix.to_owned(),
            read_path,
            pool: pool.clone(),
            state: Arc::new(sender),
            report: report.clone(),
            beats: beats.clone(),
        };
        tasks.push(AbortOnDropHandle::new(tokio::spawn(setup.run(mode))));
        let first = tokio::time::timeout(STARTUP_WAIT, state.wait_for(Option::is_some))
            .await
            .ok()
            .and_then(|seen| seen.ok().and_then(|s| *s));
        if first != Some(FeedState::Up) {
            tracing::warn!(
                "change feed not up at start; serving, with freshness from the TTLs until it is"
            );
        }
        Ok(Self {
            status: FeedStatus {
                state,
                report,
                beats,
            },
            pool: Some(pool),
            _tasks: tasks,
        })
    }

    /// The feed's own pool (catch-ups, the slot's upkeep), when it has one.
    pub fn pool(&self) -> Option<&PgPool> {
        self.pool.as_ref()
    }

    pub fn status(&self) -> FeedStatus {
        self.status.clone()
    }

    /// Stops following and closes the feed's connections (bounded).
    pub async fn stop(self) {
        let Self { pool, _tasks, .. } = self;
        drop(_tasks);
        if let Some(pool) = pool {
            if tokio::time::timeout(CLOSE_LIMIT, pool.close())
                .await
                .is_err()
            {
                tracing::warn!("change feed connections did not close in time");
            }
        }
    }
}

/// The server's `wal_level`.
async fn wal_level(pool: &PgPool) -> sqlx::Result<String> {
    sqlx::query_scalar("select current_setting('wal_level')")
        .fetch_one(pool)
        .await
}

impl Setup {
    fn set(&self, state: FeedState) {
        metrics::feed_up(state == FeedState::Up);
        self.read_path.serve_from_memory(state == FeedState::Up);
        self.state.send_replace(Some(state));
    }

    /// Tells the mode (CHANGE_FEED=auto asks the server), then follows in
    /// it, restarting what ends (a panic included) until aborted.
    async fn run(self, asked: ChangeFeed) {
        let mut told = false;
        let mode = loop {
            match self.tell_mode(asked).await {
                Ok(mode) => break mode,
                Err(error) => {
                    let error = format!("{error:#}");
                    if told {
                        tracing::debug!(error, "change feed: cannot follow yet");
                    } else {
                        tracing::error!(error, "change feed: cannot follow; it stays down, and the service serves with freshness from the TTLs");
                        told = true;
                    }
                    self.set(FeedState::Down);
                    tokio::time::sleep(RETRY).await;
                }
            }
        };
        self.report.lock().unwrap().mode = Some(mode);
        loop {
            let task = match mode {
                Mode::Replication => tokio::spawn(self.clone().replicate()),
                Mode::Trigger => tokio::spawn(self.clone().follow_outbox()),
                Mode::Off => return,
            };
            let task = AbortOnDropHandle::new(task);
            let ended = task.await;
            self.set(FeedState::Down);
            match ended {
                Err(error) if error.is_panic() => {
                    metrics::feed_restarted();
                    tracing::error!(
                        mode = mode.as_str(),
                        "the change feed task panicked; restarting it"
                    );
                }
                _ => tracing::warn!(
                    mode = mode.as_str(),
                    "the change feed task ended; restarting it"
                ),
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    async fn tell_mode(&self, asked: ChangeFeed) -> anyhow::Result<Mode> {
        let level = wal_level(&self.pool).await?;
        let logical = level == "logical";
        let mode = match asked {
            ChangeFeed::Replication if !logical => {
                anyhow::bail!("CHANGE_FEED=replication needs wal_level = logical, and it is {level} (ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)");
            }
            ChangeFeed::Replication => {
                tracing::info!(
                    mode = "replication",
                    "change feed: logical replication, as CHANGE_FEED asks"
                );
                Mode::Replication
            }
            ChangeFeed::Auto if logical => {
                tracing::info!(
                    mode = "replication",
                    "change feed: logical replication, because wal_level is logical"
                );
                Mode::Replication
            }
            ChangeFeed::Auto => {
                tracing::info!(
                    mode = "trigger",
                    wal_level = level,
                    "change feed: the outbox trigger, because wal_level is {level}, not logical"
                );
                Mode::Trigger
            }
            ChangeFeed::Trigger => {
                tracing::info!(
                    mode = "trigger",
                    "change feed: the outbox trigger, as CHANGE_FEED asks"
                );
                Mode::Trigger
            }
            ChangeFeed::Off => Mode::Off,
        };
        capture_triggers(&self.pool, mode == Mode::Trigger).await;
        Ok(mode)
    }

    async fn follow_outbox(self) {
        let follower = trigger::Follower {
            pool: self.pool.clone(),
            database: self.database.clone(),
            read_path: self.read_path.clone(),
            retention: self.retention,
            state: self.state.clone(),
        };
        follower.run().await
    }

    /// Replication: the stream's reader, the slot's candidate, and the
    /// judge of the feed's state, until one ends.
    async fn replicate(self) {
        let keys = self.read_path.keys();
        let stream_key = keys.change_stream();
        let beats = self.beats.clone();
        let (connected, mut is_connected) = watch::channel(false);
        let client = self.read_path.redis().dedicated_client();
        let reader = fanout::Reader {
            read_path: self.read_path.clone(),
            client: client.clone(),
            key: stream_key.clone(),
            timeout: self.read_path.settings().redis_timeout,
            beats: beats.clone(),
            connected,
        };
        let database_name = url::Url::parse(&self.database.database_url)
            .ok()
            .map(|u| u.path().trim_start_matches('/').to_owned())
            .unwrap_or_default();
        let slot = replication::slot_name(&database_name, &self.key_prefix);
        // Connections of its own for the decoder's visibility checks (one
        // per batch) and its probes of the primary (liveness.rs): the
        // feed's pool is busy with catch-ups and upkeep, and neither must
        // wait behind them.
        let visibility = store::connect_feed(&self.database, 2).unwrap_or_else(|error| {
            tracing::warn!(%error, "the decoder's own connection could not be set up; sharing the feed's");
            self.pool.clone()
        });
        let candidate = replication::Candidate {
            read_path: self.read_path.clone(),
            database: self.database.clone(),
            pool: self.pool.clone(),
            visibility,
            slot: slot.clone(),
            stream_key,
            beats: beats.clone(),
            timeout: self.replication_timeout,
            replica_wait: self.redis_replica_wait,
        };
        let _connection = client.connect();
        let _reader = AbortOnDropHandle::new(tokio::spawn(reader.run()));
        let _candidate = AbortOnDropHandle::new(tokio::spawn(candidate.run()));
        let mut judge = tokio::time::interval(JUDGE_EVERY);
        let mut slot_lag_read: Option<Instant> = None;
        let started = Instant::now();
        loop {
            judge.tick().await;
            let up = *is_connected.borrow_and_update() && beats.fresh();
            let was = *self.state.borrow();
            if up && was == Some(FeedState::Down) {
                tracing::info!("change feed up again");
            } else if !up && was == Some(FeedState::Up) {
                tracing::warn!("change feed down: no decoder keeps up, or the change stream is unreadable; serving without the memory tier");
                metrics::feed_reconnected();
            }
            if was != Some(if up { FeedState::Up } else { FeedState::Down })
                && (up || was.is_some() || started.elapsed() > BEATS_AWAITED)
            {
                self.set(if up { FeedState::Up } else { FeedState::Down });
            }
            let (lag_bytes, lag_seconds) = match beats.last() {
                // How stale: from the last level beat (the decoder may beat
                // while behind: alive, decoding a large transaction).
                Some((_, behind)) if beats.fresh() => (
                    Some(behind),
                    beats
                        .staleness()
                        .unwrap_or_else(|| started.elapsed())
                        .as_secs_f64(),
                ),
                last => {
                    let since = last.map_or(started, |(at, _)| at).elapsed().as_secs_f64();
                    let due = slot_lag_read.is_none_or(|at| at.elapsed() >= SLOT_LAG_EVERY);
                    let mut bytes = self.report.lock().unwrap().lag_bytes;
                    if due {
                        slot_lag_read = Some(Instant::now());
                        bytes = replication::Candidate::slot_lag(&self.pool, &slot)
                            .await
                            .ok()
                            .flatten()
                            .map(|b| b.max(0) as u64)
                            .or(bytes);
                    }
                    (bytes, since)
                }
            };
            if let Some(bytes) = lag_bytes {
                metrics::feed_lag_bytes(bytes);
            }
            metrics::feed_lag_seconds(lag_seconds);
            let mut report = self.report.lock().unwrap();
            report.lag_bytes = lag_bytes;
            report.lag_seconds = Some(lag_seconds);
        }
    }
}

/// How long a starting instance waits for the decoder's first beat before
/// it says the feed is down.
const BEATS_AWAITED: Duration = Duration::from_secs(2);

/// Enables the capture triggers on `posts` (trigger mode), or disables them
/// (replication: writers then pay nothing). Needs the table's owner; a
/// failure is logged, never fatal.
async fn capture_triggers(pool: &PgPool, enabled: bool) {
    let wanted = if enabled { "enable" } else { "disable" };
    let out_of_step: sqlx::Result<Vec<String>> = sqlx::query_scalar(
        "select tgname::text from pg_trigger
         where tgrelid = 'posts'::regclass and tgname like 'posts_capture_%'
           and (tgenabled = 'D') = $1",
    )
    .bind(enabled)
    .fetch_all(pool)
    .await;
    let names = match out_of_step {
        Ok(names) => names,
        Err(error) => {
            tracing::warn!(%error, "could not read the capture triggers' state");
            return;
        }
    };
    for name in names {
        let sql = format!("alter table posts {wanted} trigger \"{name}\"");
        match sqlx::query(&sql).execute(pool).await {
            Ok(_) => tracing::info!(trigger = name, "capture trigger {wanted}d"),
            Err(error) => {
                tracing::warn!(%error, trigger = name, "could not {wanted} the capture trigger (the owner of posts can)")
            }
        }
    }
}

/// Reads the cutoff of `invalidate --all` from Redis every CUTOFF_EVERY.
async fn follow_cutoff(read_path: Arc<ReadPath<PostStore>>) {
    let mut every = tokio::time::interval(CUTOFF_EVERY);
    loop {
        every.tick().await;
        if let Err(error) = read_path.follow_cutoff().await {
            tracing::debug!(%error, "could not read the cutoff of invalidate --all");
        }
    }
}
