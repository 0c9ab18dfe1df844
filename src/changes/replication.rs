//! CHANGE_FEED=replication: the changes to `posts` read from PostgreSQL's
//! logical replication, by one decoder for the whole fleet.
//!
//! ```text
//!  every instance: a candidate ──(no beat for BEAT_STALE)──► START_REPLICATION on the slot
//!      refused: the slot is active (another instance holds it) ─► stand by
//!      the slot is missing or invalidated ─► mark the gap, make the slot
//!      held: a gap marked ─► raise the cutoff, clear the mark
//!            for each transaction, at its commit
//!          apply every post changed to Redis (fence = the commit LSN)
//!          ─► XADD the stream (fanout.rs) ─► confirm the commit LSN to PostgreSQL
//! ```
//!
//! - Election: PostgreSQL lets one connection at a time stream a slot, so
//!   the instance whose START_REPLICATION is accepted is the decoder. The
//!   others try again only once its beats stop (its process died, or it
//!   lost its connection), within a few seconds.
//! - Nothing is lost: the decoder confirms an LSN only once everything up
//!   to it is in Redis (applied and appended to the stream), so after a
//!   crash the next decoder is sent again what was not confirmed; applying
//!   is idempotent. A change that cannot be applied (Redis down) ends the
//!   session, and the next one starts from the confirmed LSN.
//! - Bounded: a transaction is read message by message and only the ids of
//!   the posts it changed are kept; past BULK posts (or for a TRUNCATE, or
//!   a message that cannot be read) it becomes one raise of the cutoff, for
//!   which no id is kept.
//! - A gap: when the slot is missing (dropped by hand, first start) or
//!   invalidated (`max_slot_wal_keep_size`), the changes made meanwhile are
//!   unknown: the gap is marked in Redis, the slot made again, and the
//!   instance that holds it next raises the cutoff before it applies
//!   anything, then clears the mark; nothing read before is served as if
//!   nothing happened, even when the instance that made the slot dies
//!   before the raise.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use futures::{stream, FutureExt, StreamExt};
use pgwire_replication::{
    Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent, SslMode, TlsConfig,
};
use rand::Rng;
use sqlx::PgPool;

use super::{
    fanout::{self, Beats, Entry, BEAT_EVERY, BEAT_STALE},
    pgoutput::{self, Layouts, Message},
};
use crate::{
    config::DatabaseSettings,
    flight::{ChangeKind, ReadPath},
    posts::PostStore,
    telemetry::metrics,
};

/// The publication of `posts` (migration 0004).
pub const PUBLICATION: &str = "postcache_posts";
/// A transaction that changes this many posts or more is one raise of the
/// cutoff, not one application per post.
pub const BULK: usize = 10_000;
/// Changes applied to Redis at once, one script each (a Redis Cluster).
const APPLYING: usize = 64;
/// Changes applied by one script on a single Redis.
const APPLIED_TOGETHER: usize = 100;
/// Events buffered between the replication connection and the decoder.
const BUFFERED: usize = 256;
/// How often a standby looks at whether the decoder's beats stopped.
const STANDBY_EVERY: Duration = Duration::from_millis(500);
/// Pauses after a failed attempt to hold the slot.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(3);

/// The slot of a fleet: named after its database and KEY_PREFIX (slot names
/// are at most 63 characters of `a-z`, `0-9` and `_`).
pub fn slot_name(database: &str, key_prefix: &str) -> String {
    let readable: String = database
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(30)
        .collect();
    let hash = xxhash_rust::xxh3::xxh3_64(format!("{database}\0{key_prefix}").as_bytes());
    format!("postcache_{readable}_{hash:016x}")
}

/// The replication connection's settings, from DATABASE_URL.
pub fn replication_config(database_url: &str, slot: &str) -> anyhow::Result<ReplicationConfig> {
    let url = url::Url::parse(database_url).context("invalid DATABASE_URL")?;
    let query: HashMap<String, String> = url.query_pairs().into_owned().collect();
    let decode = |s: &str| {
        percent_decode(s).with_context(|| format!("invalid percent-encoding in DATABASE_URL: {s}"))
    };
    let host = match query.get("host") {
        Some(host) => host.clone(),
        None => url
            .host_str()
            .unwrap_or("localhost")
            .trim_matches(['[', ']'])
            .to_owned(),
    };
    let user = decode(url.username())?;
    let user = if user.is_empty() {
        query
            .get("user")
            .cloned()
            .unwrap_or_else(|| "postgres".into())
    } else {
        user
    };
    let password = decode(url.password().unwrap_or(""))?;
    let database = decode(url.path().trim_start_matches('/'))?;
    let database = if database.is_empty() {
        user.clone()
    } else {
        database
    };
    let mode = match query.get("sslmode").map(String::as_str) {
        Some("disable") => SslMode::Disable,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        // sqlx's default, as libpq's.
        _ => SslMode::Prefer,
    };
    let tls = TlsConfig {
        mode,
        ca_pem_path: query.get("sslrootcert").map(Into::into),
        client_cert_pem_path: query.get("sslcert").map(Into::into),
        client_key_pem_path: query.get("sslkey").map(Into::into),
        ..TlsConfig::default()
    };
    let mut config = ReplicationConfig::new(host, user, password, database, slot, PUBLICATION)
        .with_tls(tls)
        .with_buffer_size(BUFFERED)
        .with_status_interval(Duration::from_millis(200))
        .with_wakeup_interval(Duration::from_secs(5))
        .with_application_name("postcache-decoder");
    if let Some(port) = url.port() {
        config = config.with_port(port);
    }
    Ok(config)
}

fn percent_decode(s: &str) -> anyhow::Result<String> {
    Ok(percent_encoding::percent_decode_str(s)
        .decode_utf8()?
        .into_owned())
}

/// Why the slot could not be streamed.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// Another session streams it: stand by.
    Held,
    /// It does not exist.
    Missing,
    /// It lost WAL it needs (`max_slot_wal_keep_size`).
    Invalidated,
    /// Anything else (PostgreSQL down, no privilege, no publication).
    Other,
}

fn refusal(error: &pgwire_replication::PgWireError) -> Refusal {
    let text = error.to_string();
    if text.contains("55006") || text.contains("is active for PID") {
        Refusal::Held
    } else if text.contains("42704") || text.contains("does not exist") && text.contains("slot") {
        Refusal::Missing
    } else if text.contains("can no longer get changes") || text.contains("has been invalidated") {
        Refusal::Invalidated
    } else {
        Refusal::Other
    }
}

/// Why the fleet lost track of changes (the `why` of the gap metric).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GapWhy {
    /// No slot (first start, or dropped by hand).
    SlotMissing,
    /// The slot lost WAL past `max_slot_wal_keep_size`.
    SlotInvalidated,
}

impl GapWhy {
    fn as_str(self) -> &'static str {
        match self {
            Self::SlotMissing => "slot_missing",
            Self::SlotInvalidated => "slot_invalidated",
        }
    }

    /// The marker's value; anything else (written by hand) counts as missing.
    fn parse(s: &str) -> Self {
        if s == Self::SlotInvalidated.as_str() {
            Self::SlotInvalidated
        } else {
            Self::SlotMissing
        }
    }
}

/// The decoder's side of one instance: a candidate for the slot.
pub(super) struct Candidate {
    pub read_path: Arc<ReadPath<PostStore>>,
    pub database: DatabaseSettings,
    /// For making, dropping and measuring the slot (one connection).
    pub pool: PgPool,
    pub slot: String,
    pub stream_key: String,
    pub beats: Arc<Beats>,
}

/// What the decoder keeps of the relations it was told of.
#[derive(Default)]
struct Relations(HashMap<u32, pgoutput::Relation>);

impl Layouts for Relations {
    fn id_column(&self, relation: u32) -> Option<usize> {
        self.0.get(&relation).and_then(|r| r.id_column)
    }
}

/// One transaction being read.
struct Pending {
    posts: HashMap<i64, ChangeKind>,
    /// Every post: the bound was passed, a TRUNCATE, or something that
    /// could not be read.
    all: bool,
    commit_time_micros: i64,
}

impl Pending {
    fn new(commit_time_micros: i64) -> Self {
        Self {
            posts: HashMap::new(),
            all: false,
            commit_time_micros,
        }
    }

    fn note(&mut self, id: Option<i64>, kind: ChangeKind) {
        if self.all {
            return;
        }
        let Some(id) = id else {
            // A row whose id is null or not sent: which post is unknown.
            self.every_post();
            return;
        };
        self.posts.insert(id, kind);
        if self.posts.len() >= BULK {
            self.every_post();
        }
    }

    fn every_post(&mut self) {
        self.all = true;
        self.posts = HashMap::new();
    }
}

/// Posts gathered from several transactions before they are applied.
const BATCH_MAX: usize = 1_000;
/// Under a write load, how often a batch is applied: the longest a
/// committed transaction waits for others to be applied with.
const LINGER: Duration = Duration::from_millis(5);

/// Committed transactions read but not applied yet: the later change of
/// each post (applying it once, with its LSN, fences every leader that read
/// before either).
#[derive(Default)]
struct Batch {
    posts: HashMap<i64, (ChangeKind, u64)>,
    /// The end of the last transaction in it.
    last: Option<Lsn>,
    first_commit_micros: i64,
    /// Until when it waits for more commits: set when its first
    /// transaction came less than LINGER after the last batch went.
    until: Option<Instant>,
    /// Where the server said it had sent everything, after its last
    /// transaction.
    read_to: Lsn,
    /// When the last batch was applied.
    flushed: Option<Instant>,
}

impl Batch {
    /// Whether it may wait for more commits before it is applied: only
    /// while commits come faster than one per LINGER (its first came less
    /// than LINGER after the last batch went), so that a lone commit goes
    /// at once, and a write load is applied once per LINGER.
    fn lingers(&self) -> bool {
        self.until.is_some_and(|until| Instant::now() < until)
    }

    /// Whether a commit just added makes it go: it does not linger, or it
    /// is past its time by another LINGER (commits kept coming while it was
    /// read: applied at least that often).
    fn due(&self) -> bool {
        self.posts.len() >= BATCH_MAX || self.until.is_none_or(|until| until.elapsed() >= LINGER)
    }

    fn add(&mut self, tx: Pending, lsn: Lsn, progress: &mut Progress) {
        if self.last.is_none() {
            self.first_commit_micros = tx.commit_time_micros;
            self.until = self
                .flushed
                .map(|at| at + LINGER)
                .filter(|until| Instant::now() < *until);
        }
        for (id, kind) in tx.posts {
            // Applied with this later change, or kept with it.
            progress.retry.remove(&id);
            self.posts.insert(id, (kind, lsn.0));
        }
        self.last = Some(lsn);
    }
}

/// Most changes kept for a retry; past it, one raise of the cutoff.
const RETRY_LIST_MAX: usize = 10_000;

/// How far the decoder has got.
#[derive(Default)]
struct Progress {
    /// Everything the server sent up to here is read (applied, or waiting
    /// in `retry`).
    applied: Lsn,
    /// The last position before the oldest change that waits: confirmed
    /// while something waits.
    held_at: Option<Lsn>,
    /// Changes that could not be applied yet: the later of each post's,
    /// with its commit LSN.
    retry: HashMap<i64, (ChangeKind, u64)>,
}

impl Progress {
    fn read_to(&mut self, lsn: Lsn) {
        self.applied = self.applied.max(lsn);
        if self.retry.is_empty() {
            self.held_at = None;
        }
    }

    fn keep(&mut self, id: i64, kind: ChangeKind, lsn: u64) {
        if self.held_at.is_none() {
            self.held_at = Some(self.applied);
        }
        match self.retry.get(&id) {
            Some((_, kept)) if *kept > lsn => {}
            _ => {
                self.retry.insert(id, (kind, lsn));
            }
        }
    }

    /// What may be confirmed to the server: everything before the oldest
    /// change that waits.
    fn confirmable(&self) -> Lsn {
        match self.held_at {
            Some(at) if !self.retry.is_empty() => at,
            _ => self.applied,
        }
    }
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

fn since_commit(commit_time_micros: i64) -> Duration {
    let now = crate::cache::now_millis() as i64 * 1000;
    Duration::from_micros((now - (commit_time_micros + PG_EPOCH_MICROS)).max(0) as u64)
}

impl Candidate {
    /// Stands by, and holds the slot whenever no other instance does, until
    /// aborted.
    pub async fn run(self) {
        let mut backoff = RETRY_FIRST;
        loop {
            // Stand by while another instance's beats come.
            while self.beats.fresh() {
                tokio::time::sleep(STANDBY_EVERY).await;
            }
            let error = match self.hold().await {
                Ok(()) => {
                    backoff = RETRY_FIRST;
                    continue;
                }
                Err(error) => error,
            };
            let mut retry = || {
                let pause = backoff;
                backoff = (backoff * 2).min(RETRY_MAX);
                pause
            };
            let pause = match error
                .downcast_ref::<pgwire_replication::PgWireError>()
                .map(refusal)
            {
                Some(Refusal::Held) => {
                    tracing::debug!("the slot is held by another instance; standing by");
                    // Its beats should be here soon; try again if not.
                    BEAT_STALE
                }
                // What changes while no slot is there is unknown: the gap
                // is marked in Redis before the slot is made, and closed by
                // whichever instance holds the slot next (see `hold`), so
                // that one that dies in between leaves it to the next.
                Some(Refusal::Missing) => match self.mark_gap(GapWhy::SlotMissing).await {
                    Ok(()) => match self.make_slot().await {
                        Ok(()) => Duration::ZERO,
                        Err(error) => {
                            tracing::warn!(
                                error = format!("{error:#}"),
                                slot = self.slot,
                                "could not make the replication slot"
                            );
                            retry()
                        }
                    },
                    Err(error) => {
                        tracing::warn!(error = format!("{error:#}"), "could not mark the change feed's gap in Redis; the slot is made once it can be");
                        retry()
                    }
                },
                Some(Refusal::Invalidated) => {
                    tracing::error!(slot = self.slot, "the replication slot was invalidated (it lost WAL past max_slot_wal_keep_size); making it again and invalidating everything cached");
                    match self.mark_gap(GapWhy::SlotInvalidated).await {
                        Ok(()) => {
                            if let Err(error) = self.drop_slot().await {
                                tracing::warn!(
                                    error = format!("{error:#}"),
                                    "could not drop the invalidated slot"
                                );
                            }
                            Duration::ZERO
                        }
                        Err(error) => {
                            tracing::warn!(error = format!("{error:#}"), "could not mark the change feed's gap in Redis; the slot is made again once it can be");
                            retry()
                        }
                    }
                }
                _ => {
                    tracing::warn!(
                        error = format!("{error:#}"),
                        slot = self.slot,
                        "change feed decoder stopped; trying again"
                    );
                    retry()
                }
            };
            // Jittered, so that standbys do not all try at once.
            let jitter = rand::rng().random_range(0.0..0.5);
            tokio::time::sleep(pause.mul_f64(1.0 + jitter)).await;
        }
    }

    /// Marks a gap (see `Keys::feed_gap`); a gap marked already keeps its
    /// reason.
    async fn mark_gap(&self, why: GapWhy) -> anyhow::Result<()> {
        let key = self.read_path.keys().feed_gap();
        self.read_path.redis().mark_gap(&key, why.as_str()).await?;
        Ok(())
    }

    /// Closes a gap marked in Redis, with the slot held: every post read
    /// before now is stale fleet-wide (what changed while no slot was there
    /// is unknown; what changes from now on is in the slot).
    async fn close_gap(&self) -> anyhow::Result<()> {
        let redis = self.read_path.redis();
        let key = self.read_path.keys().feed_gap();
        let Some(why) = redis.gap(&key).await? else {
            return Ok(());
        };
        let why = GapWhy::parse(&why);
        let cutoff = self.all_posts(0).await?;
        redis.close_gap(&key).await?;
        metrics::feed_gap(why.as_str());
        tracing::warn!(
            why = why.as_str(),
            cutoff,
            slot = self.slot,
            "change feed gap: the slot was made again; every post read before now is stale fleet-wide"
        );
        Ok(())
    }

    /// Makes the slot, unless another instance made it first.
    async fn make_slot(&self) -> anyhow::Result<()> {
        let made = sqlx::query(
            "select pg_create_logical_replication_slot($1, 'pgoutput')
             where not exists (select 1 from pg_replication_slots where slot_name = $1)",
        )
        .bind(&self.slot)
        .execute(&self.pool)
        .await;
        match made {
            Ok(made) if made.rows_affected() == 1 => {
                tracing::info!(slot = self.slot, "replication slot made");
                Ok(())
            }
            Ok(_) => Ok(()),
            // Made by another instance meanwhile.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42710") => Ok(()),
            Err(error) => Err(error.into()),
        }
    }

    async fn drop_slot(&self) -> anyhow::Result<()> {
        sqlx::query(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots
             where slot_name = $1 and not active",
        )
        .bind(&self.slot)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Holds the slot and decodes until the session ends (an error).
    async fn hold(&self) -> anyhow::Result<()> {
        let config = replication_config(&self.database.database_url, &self.slot)?;
        let mut client = ReplicationClient::connect(config).await?;
        let limit = self.database.db_acquire_timeout + self.database.db_statement_timeout;
        match tokio::time::timeout(limit, client.wait_started()).await {
            Ok(started) => started?,
            Err(_) => anyhow::bail!("START_REPLICATION: no answer within {limit:?}"),
        }
        tracing::info!(
            slot = self.slot,
            "holding the replication slot: this instance decodes the fleet's changes"
        );
        metrics::decoder_held(true);
        let _held = scopeguard(|| metrics::decoder_held(false));
        // Before any change is applied: the raise covers what the slot
        // does not have, and the changes it has are applied after it.
        let result = match self.close_gap().await {
            Ok(()) => self.decode(&mut client).await,
            Err(error) => Err(error.context("could not close the change feed's gap")),
        };
        client.abort();
        result
    }

    /// Raises the cutoff for change `lsn` and says so on the stream; the
    /// cutoff in force.
    async fn all_posts(&self, lsn: u64) -> anyhow::Result<u64> {
        let redis = self.read_path.redis();
        let change = (lsn > 0).then_some(lsn as i64);
        let cutoff = match change {
            Some(change) => self.read_path.invalidate_all(change).await?,
            None => {
                let keys = self.read_path.keys();
                let cutoff = redis
                    .raise_cutoff(
                        &keys.cutoff(),
                        &keys.cutoffs_applied(),
                        crate::cache::now_millis(),
                        None,
                        Duration::from_secs(1),
                    )
                    .await?;
                self.read_path.forget_all();
                cutoff
            }
        };
        fanout::append(redis, &self.stream_key, &Entry::All { lsn }).await?;
        Ok(cutoff)
    }

    async fn decode(&self, client: &mut ReplicationClient) -> anyhow::Result<()> {
        let mut relations = Relations::default();
        let mut pending: Option<Pending> = None;
        let mut batch = Batch::default();
        let mut progress = Progress::default();
        let mut server_end = Lsn(0);
        // The server sends a keepalive once it has sent everything up to
        // its end: only then do the beats say this decoder keeps up.
        let mut caught_up = false;
        let mut beat = tokio::time::interval(BEAT_EVERY);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // What is here already is read before anything is applied, so
            // that a burst of commits costs one round of applications and
            // one stream entry; once nothing more is here, the batch goes.
            let event = match client.recv().now_or_never() {
                Some(event) => event?,
                // A batch lingers a little for more commits: under a write
                // load that turns a round of applications, a stream entry
                // and every instance's read per commit into one per batch.
                // It sleeps the linger out rather than wake for each event,
                // then reads what came meanwhile at once: a wake-up per
                // batch, not one per commit.
                None if batch.lingers() => {
                    if let Some(until) = batch.until {
                        tokio::time::sleep_until(until.into()).await;
                    }
                    continue;
                }
                None => {
                    self.flush(&mut batch, &mut progress).await?;
                    client.update_applied_lsn(progress.confirmable());
                    tokio::select! {
                        event = client.recv() => event?,
                        _ = beat.tick() => {
                            self.retry(&mut progress).await?;
                            if caught_up && pending.is_none() && progress.retry.is_empty() {
                                let behind = server_end.0.saturating_sub(progress.applied.0);
                                let entry = Entry::Beat { lsn: progress.applied.0, behind };
                                fanout::append(self.read_path.redis(), &self.stream_key, &entry).await?;
                                metrics::feed_lag_bytes(behind);
                            }
                            client.update_applied_lsn(progress.confirmable());
                            continue;
                        }
                    }
                }
            };
            let Some(event) = event else {
                anyhow::bail!("the replication stream ended");
            };
            match event {
                ReplicationEvent::Begin {
                    commit_time_micros, ..
                } => pending = Some(Pending::new(commit_time_micros)),
                ReplicationEvent::XLogData { data, wal_end, .. } => {
                    server_end = server_end.max(wal_end);
                    let Some(tx) = pending.as_mut() else {
                        continue;
                    };
                    read_message(&data, &mut relations, tx);
                }
                ReplicationEvent::Commit { end_lsn, .. } => {
                    let Some(tx) = pending.take() else {
                        continue;
                    };
                    server_end = server_end.max(end_lsn);
                    if tx.all {
                        self.flush(&mut batch, &mut progress).await?;
                        self.all_posts(end_lsn.0).await?;
                        metrics::change_applied("all", since_commit(tx.commit_time_micros));
                        // Every post: what waited is covered.
                        progress.retry.clear();
                        progress.read_to(end_lsn);
                        client.update_applied_lsn(progress.confirmable());
                        continue;
                    }
                    batch.add(tx, end_lsn, &mut progress);
                    if batch.due() {
                        self.flush(&mut batch, &mut progress).await?;
                        client.update_applied_lsn(progress.confirmable());
                    }
                }
                ReplicationEvent::KeepAlive { wal_end, .. } => {
                    tracing::trace!(%wal_end, "keepalive");
                    server_end = server_end.max(wal_end);
                    caught_up = true;
                    if pending.is_none() {
                        // Nothing of ours is open: everything the server
                        // sent is read, once the batch is applied (the
                        // server sends one whenever it waits for WAL: the
                        // batch lingers on).
                        if batch.last.is_some() {
                            batch.read_to = batch.read_to.max(wal_end);
                        } else {
                            progress.read_to(wal_end);
                            client.update_applied_lsn(progress.confirmable());
                        }
                    }
                }
                ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
            }
        }
    }

    /// Applies the committed transactions read so far to Redis, then
    /// appends them to the stream as one entry. What fails (a node down)
    /// waits in the retry list, and holds the confirmed LSN back until it
    /// is applied: after a crash the server sends it again. An error ends
    /// the session unconfirmed.
    async fn flush(&self, batch: &mut Batch, progress: &mut Progress) -> anyhow::Result<()> {
        batch.until = None;
        let Some(last) = batch.last.take() else {
            return Ok(());
        };
        batch.flushed = Some(Instant::now());
        let lag = since_commit(batch.first_commit_micros);
        let changes: Vec<(i64, ChangeKind, u64)> = batch
            .posts
            .drain()
            .map(|(id, (kind, lsn))| (id, kind, lsn))
            .collect();
        self.apply(changes, last, lag, progress).await?;
        progress.read_to(last.max(std::mem::take(&mut batch.read_to)));
        Ok(())
    }

    /// Applies changes, appends those applied to the stream, and keeps the
    /// others for a retry (past RETRY_LIST_MAX, one raise of the cutoff instead).
    async fn apply(
        &self,
        changes: Vec<(i64, ChangeKind, u64)>,
        lsn: Lsn,
        lag: Duration,
        progress: &mut Progress,
    ) -> anyhow::Result<()> {
        if changes.is_empty() {
            return Ok(());
        }
        let results: Vec<((i64, ChangeKind, u64), bool)> = if self
            .read_path
            .redis()
            .applies_together()
        {
            // One script per chunk: far fewer round trips and script
            // calls than one per post.
            let chunks: Vec<Vec<(i64, ChangeKind, u64)>> = changes
                .chunks(APPLIED_TOGETHER)
                .map(<[_]>::to_vec)
                .collect();
            stream::iter(chunks)
                    .map(|chunk| {
                        let read_path = self.read_path.clone();
                        async move {
                            let items: Vec<(i64, i64, ChangeKind)> = chunk
                                .iter()
                                .map(|(id, kind, lsn)| (*id, *lsn as i64, *kind))
                                .collect();
                            let done = read_path.invalidate_many_in_redis(&items).await;
                            if let Err(error) = &done {
                                tracing::debug!(%error, posts = chunk.len(), "changes not applied; retrying");
                            }
                            let ok = done.is_ok();
                            chunk.into_iter().map(move |change| (change, ok)).collect::<Vec<_>>()
                        }
                    })
                    .buffer_unordered(4)
                    .flat_map(stream::iter)
                    .collect()
                    .await
        } else {
            stream::iter(changes)
                .map(|change| {
                    let read_path = self.read_path.clone();
                    async move {
                        let (id, kind, lsn) = change;
                        let done = read_path.invalidate_in_redis(&id, lsn as i64, kind).await;
                        if let Err(error) = &done {
                            tracing::debug!(%error, id, "change not applied; retrying");
                        }
                        (change, done.is_ok())
                    }
                })
                .buffer_unordered(APPLYING)
                .collect()
                .await
        };
        let mut ids = Vec::with_capacity(results.len());
        for ((id, kind, at), done) in results {
            if done {
                metrics::change_applied(
                    match kind {
                        ChangeKind::Deleted => "delete",
                        ChangeKind::Changed => "update",
                    },
                    lag,
                );
                ids.push(id);
            } else {
                progress.keep(id, kind, at);
            }
        }
        if progress.retry.len() > RETRY_LIST_MAX {
            tracing::warn!(
                waiting = progress.retry.len(),
                "too many changes wait for Redis: every post is invalidated instead"
            );
            self.all_posts(lsn.0).await?;
            progress.retry.clear();
        }
        if !ids.is_empty() {
            fanout::append(
                self.read_path.redis(),
                &self.stream_key,
                &Entry::Posts { lsn: lsn.0, ids },
            )
            .await?;
        }
        Ok(())
    }

    /// Tries again what waits for Redis.
    async fn retry(&self, progress: &mut Progress) -> anyhow::Result<()> {
        if progress.retry.is_empty() {
            return Ok(());
        }
        let waiting: Vec<(i64, ChangeKind, u64)> = progress
            .retry
            .drain()
            .map(|(id, (kind, lsn))| (id, kind, lsn))
            .collect();
        let newest = waiting.iter().map(|c| c.2).max().unwrap_or(0);
        self.apply(waiting, Lsn(newest), Duration::ZERO, progress)
            .await
    }

    /// How far the slot is behind the server, in bytes, when no decoder
    /// holds it (read from PostgreSQL: the decoder's beats say it
    /// otherwise); `None` when there is no slot.
    pub async fn slot_lag(pool: &PgPool, slot: &str) -> sqlx::Result<Option<i64>> {
        sqlx::query_scalar(
            "select pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
             from pg_replication_slots where slot_name = $1",
        )
        .bind(slot)
        .fetch_optional(pool)
        .await
        .map(Option::flatten)
    }
}

/// Reads one message into the transaction.
fn read_message(data: &[u8], relations: &mut Relations, tx: &mut Pending) {
    match pgoutput::decode(data, relations) {
        Ok(Message::Relation(relation)) => {
            if relation.id_column.is_none() {
                tracing::warn!(
                    relation = relation.name,
                    "a published relation has no id column: its changes invalidate every post"
                );
            }
            relations.0.insert(relation.oid, relation);
        }
        Ok(Message::Changed { id, .. }) => tx.note(id, ChangeKind::Changed),
        Ok(Message::Deleted { id, .. }) => tx.note(id, ChangeKind::Deleted),
        Ok(Message::Moved { from, to, .. }) => {
            tx.note(from, ChangeKind::Deleted);
            tx.note(to, ChangeKind::Changed);
        }
        Ok(Message::Truncated(_)) => tx.every_post(),
        Ok(Message::Other) => {}
        Err(error) => {
            metrics::change_skipped("undecodable");
            tracing::warn!(%error, "a replication message could not be read: every post is invalidated");
            tx.every_post();
        }
    }
}

/// Runs `f` when dropped.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f()
            }
        }
    }
    Guard(Some(f))
}

/// The instant a beat was last seen, for the lag in seconds.
pub fn seconds_since(at: Instant) -> f64 {
    at.elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_are_legal_and_differ_by_database_and_prefix() {
        let a = slot_name("postcache", "");
        let b = slot_name("postcache", "p:");
        let c = slot_name("Post-Cache.Ünï", "");
        let long = slot_name(&"x".repeat(200), "a-very-long-prefix:");
        for name in [&a, &b, &c, &long] {
            assert!(name.len() <= 63, "{name}");
            assert!(name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
        }
        assert_ne!(a, b);
        assert!(a.starts_with("postcache_postcache_"));
    }

    #[test]
    fn the_replication_connection_follows_database_url() {
        let c = replication_config(
            "postgres://us%40er:p%2Fw@db.example:6543/my%20db?sslmode=require",
            "s",
        )
        .unwrap();
        assert_eq!(
            (
                c.host.as_str(),
                c.port,
                c.user.as_str(),
                c.password.as_str()
            ),
            ("db.example", 6543, "us@er", "p/w")
        );
        assert_eq!(c.database, "my db");
        assert_eq!(c.tls.mode, SslMode::Require);

        let d = replication_config("postgres://postgres@127.0.0.1/postcache", "s").unwrap();
        assert_eq!((d.port, d.tls.mode), (5432, SslMode::Prefer));
        let socket = replication_config("postgres:///postcache?host=/run/postgresql", "s").unwrap();
        assert_eq!(socket.host, "/run/postgresql");
    }

    #[test]
    fn a_transaction_past_the_bound_keeps_no_ids() {
        let mut tx = Pending::new(0);
        for id in 0..BULK as i64 - 1 {
            tx.note(Some(id), ChangeKind::Changed);
        }
        assert!(!tx.all);
        tx.note(Some(-1), ChangeKind::Deleted);
        assert!(tx.all);
        assert!(tx.posts.is_empty() && tx.posts.capacity() == 0);
        tx.note(Some(5), ChangeKind::Changed);
        assert!(tx.posts.is_empty());
    }

    #[test]
    fn the_last_change_of_a_post_in_a_transaction_decides() {
        let mut tx = Pending::new(0);
        tx.note(Some(1), ChangeKind::Changed);
        tx.note(Some(1), ChangeKind::Deleted);
        tx.note(Some(2), ChangeKind::Deleted);
        tx.note(Some(2), ChangeKind::Changed);
        assert_eq!(tx.posts[&1], ChangeKind::Deleted);
        assert_eq!(tx.posts[&2], ChangeKind::Changed);
    }

    #[test]
    fn refusals_are_told_apart() {
        use pgwire_replication::PgWireError::Server;
        let held = Server("replication slot \"s\" is active for PID 12 (SQLSTATE 55006)".into());
        let missing = Server("replication slot \"s\" does not exist (SQLSTATE 42704)".into());
        let lost =
            Server("can no longer get changes from replication slot \"s\" (SQLSTATE 55000)".into());
        assert_eq!(refusal(&held), Refusal::Held);
        assert_eq!(refusal(&missing), Refusal::Missing);
        assert_eq!(refusal(&lost), Refusal::Invalidated);
        assert_eq!(
            refusal(&Server("connection refused".into())),
            Refusal::Other
        );
    }
}
