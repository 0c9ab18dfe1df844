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
//!
//! Here the election, the slot and the gap; the connection's settings and
//! refusals in `connection.rs`; reading and applying the changes in
//! `decode.rs`.

mod batch;
mod connection;
mod decode;
pub mod fanout;
mod liveness;
pub mod pgoutput;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use pgwire_replication::ReplicationClient;
use rand::Rng;
use sqlx::{Connection as _, PgPool};

use connection::{refusal, session_options, Refusal};
pub use connection::{replication_config, PUBLICATION};

use crate::{
    config::DatabaseSettings,
    read_path::{ReadPath, Since},
    store::PostStore,
    telemetry::metrics,
};
use fanout::{Beats, Entry, BEAT_STALE};

/// A transaction that changes this many posts or more is one raise of the
/// cutoff, not one application per post.
pub const BULK: usize = 10_000;
/// How often a standby looks at whether the decoder's beats stopped.
const STANDBY_EVERY: Duration = Duration::from_millis(500);
/// Pauses after a failed attempt to hold the slot.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(3);
/// How often PostgreSQL is asked whether it takes connections again while
/// it is down, starting up or shutting down: the slot is asked for again
/// within this (and half more, jittered) of its return, not a grown pause
/// later (found: each attempt spent a second in the pool's acquire, the
/// pauses grew to 3 s, and the slot was taken up to 4 s after the server's
/// return while the fleet served what Redis held). A refused connection
/// costs the server nothing; one during recovery, a backend that says so
/// and ends.
const UNAVAILABLE_RETRY: Duration = Duration::from_millis(250);

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

/// Warns of the other fleets' postcache slots on this database that no
/// decoder reads (KEY_PREFIXes retired, or their fleets stopped): each
/// holds WAL nobody confirms, until PostgreSQL invalidates it or the disk
/// fills. Said once, at start; `postcache slot drop NAME` drops one.
pub(super) async fn warn_of_idle_slots(pool: &sqlx::PgPool, ours: &str) {
    let idle = sqlx::query_as::<_, (String, Option<i64>)>(
        "select slot_name::text,
                pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint
         from pg_replication_slots
         where slot_name like 'postcache\\_%' and slot_name <> $1
           and database = current_database() and not active
         order by slot_name",
    )
    .bind(ours)
    .fetch_all(pool)
    .await;
    match idle {
        Ok(idle) => {
            for (slot, held) in idle {
                tracing::warn!(
                    slot,
                    held_bytes = held,
                    "another KEY_PREFIX's replication slot on this database is read by no decoder and holds WAL; if its fleet is retired, drop it: postcache slot drop {slot}"
                );
            }
        }
        Err(error) => tracing::debug!(%error, "could not look for other fleets' slots"),
    }
}

/// Why the fleet lost track of changes (the `why` of the gap metric).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GapWhy {
    /// No slot, and the fleet never decoded (its change stream is empty):
    /// its first start. A gap all the same (what was cached under the key
    /// prefix before is of no feed), said at info level.
    FirstSlot,
    /// No slot (dropped by hand, or lost with Redis' stream).
    SlotMissing,
    /// The slot lost WAL past `max_slot_wal_keep_size`.
    SlotInvalidated,
}

impl GapWhy {
    fn as_str(self) -> &'static str {
        match self {
            Self::FirstSlot => "first_slot",
            Self::SlotMissing => "slot_missing",
            Self::SlotInvalidated => "slot_invalidated",
        }
    }

    /// The marker's value; anything else (written by hand) counts as missing.
    fn parse(s: &str) -> Self {
        if s == Self::SlotInvalidated.as_str() {
            Self::SlotInvalidated
        } else if s == Self::FirstSlot.as_str() {
            Self::FirstSlot
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
    /// For the decoder's checks that a batch's commits are visible and its
    /// probes of the primary (connections of their own: see `decode.rs`,
    /// `until_visible`, and `liveness.rs`).
    pub visibility: PgPool,
    pub slot: String,
    pub stream_key: String,
    pub beats: Arc<Beats>,
    /// REPLICATION_TIMEOUT.
    pub timeout: Duration,
    /// REDIS_REPLICA_WAIT: how long a Redis replica is waited for after
    /// each application (0: not waited for; see `redis/replicas.rs`).
    pub replica_wait: Duration,
}

/// A standby ends the walsender of a slot whose beats stopped only if it
/// started at least this long ago (on the server's clock): the holder that
/// just took the slot has not beaten yet.
const TAKEOVER_GRACE: Duration = Duration::from_secs(4);
/// A standby judges the decoder by the beats only while it reads the
/// stream: within this of its last read (an XREAD blocks up to a second).
const STREAM_CURRENT: Duration = Duration::from_secs(2);

impl Candidate {
    /// Stands by, and holds the slot whenever no other instance does, until
    /// aborted.
    pub async fn run(self) {
        let mut backoff = RETRY_FIRST;
        // When this instance last decoded: the beats are its own for
        // BEAT_STALE after that.
        let mut held: Option<Instant> = None;
        // Whether this outage of PostgreSQL was logged (once, then quietly).
        let mut unavailable_told = false;
        // Bounded (a connection gone silent must not hold the candidate
        // before its first session); the sessions make the slot otherwise.
        let _ =
            tokio::time::timeout(self.timeout, warn_of_idle_slots(&self.pool, &self.slot)).await;
        let _ = tokio::time::timeout(self.timeout, self.make_slot_if_missing()).await;
        loop {
            // Stand by while another instance's beats come; not this one's
            // own: an instance that lost the slot (its connection cut,
            // PostgreSQL restarted, the slot dropped) tries again at once,
            // instead of waiting out the beats it wrote itself.
            let own_beats = held.is_some_and(|at| at.elapsed() < BEAT_STALE);
            while !own_beats && self.beats.fresh() {
                tokio::time::sleep(STANDBY_EVERY).await;
            }
            let mut decoded = false;
            let result = self.hold(&mut decoded).await;
            if decoded {
                held = Some(Instant::now());
                unavailable_told = false;
                // A session that held the slot starts the pauses anew: a
                // loss after a long run is not a repeated failure (the
                // pauses had grown to their 3 s bound over a run's losses,
                // and each cost that much staleness).
                backoff = RETRY_FIRST;
            }
            let error = match result {
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
                    if self.take_over().await {
                        Duration::ZERO
                    } else if held.is_some_and(|at| at.elapsed() < BEAT_STALE) {
                        // Most likely this instance's own session, whose
                        // walsender has not ended yet: soon again, not a
                        // BEAT_STALE later (found: a decoder whose session
                        // ended on a paused Redis stood by 2 s behind its
                        // own walsender, and a change waited 3.2 s).
                        tracing::debug!("the slot is still held, likely by this instance's last session; trying again");
                        retry()
                    } else {
                        tracing::debug!("the slot is held by another instance; standing by");
                        // Its beats should be here soon; try again if not.
                        BEAT_STALE
                    }
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
                Some(Refusal::Unavailable) => {
                    if !std::mem::replace(&mut unavailable_told, true) {
                        tracing::warn!(
                            error = format!("{error:#}"),
                            slot = self.slot,
                            "the change feed's session ended, or PostgreSQL is unavailable (down, starting or shutting down); asking again every {UNAVAILABLE_RETRY:?}"
                        );
                    }
                    self.until_reachable().await;
                    Duration::ZERO
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

    /// Waits until PostgreSQL takes a connection again, asking every
    /// UNAVAILABLE_RETRY (jittered) on a connection of its own: not through
    /// the pool, whose acquire spends its whole timeout (a second) on a
    /// server that refuses, so that the slot is asked for again within
    /// moments of the server's return.
    async fn until_reachable(&self) {
        let options = self.pool.connect_options();
        loop {
            let jitter = rand::rng().random_range(0.0..0.5);
            tokio::time::sleep(UNAVAILABLE_RETRY.mul_f64(1.0 + jitter)).await;
            let attempt =
                tokio::time::timeout(self.timeout, sqlx::PgConnection::connect_with(&options))
                    .await;
            match attempt {
                Ok(Ok(connection)) => {
                    // Its Terminate, bounded: the server just answered.
                    let _ = tokio::time::timeout(self.timeout, connection.close()).await;
                    return;
                }
                Ok(Err(error)) => {
                    tracing::debug!(%error, "PostgreSQL still unavailable to the decoder")
                }
                Err(_) => {
                    tracing::debug!("PostgreSQL still unavailable to the decoder (no answer)")
                }
            }
        }
    }

    /// Ends the walsender that holds the slot while no beat comes (its
    /// decoder died, stopped, or went silent, and PostgreSQL has not noticed
    /// yet): whether it did. Only while this instance reads the stream (the
    /// beats it misses are missing), not within BEAT_STALE of its taking
    /// the stream up again (the beats it forgot then are not missing), and
    /// only a walsender older than
    /// TAKEOVER_GRACE. Needs the right to signal it: the same role as the
    /// holder's, or `pg_signal_backend`; without it the walsender ends at
    /// its `wal_sender_timeout` (REPLICATION_TIMEOUT, which the decoder
    /// sets for its own session).
    async fn take_over(&self) -> bool {
        if self.beats.fresh()
            || !self.beats.stream_read_within(STREAM_CURRENT)
            || !self.beats.judge_decoder()
        {
            return false;
        }
        let ended = sqlx::query_scalar::<_, bool>(
            "select pg_terminate_backend(a.pid)
             from pg_replication_slots s join pg_stat_activity a on a.pid = s.active_pid
             where s.slot_name = $1
               and a.backend_start < now() - make_interval(secs => $2)",
        )
        .bind(&self.slot)
        .bind(TAKEOVER_GRACE.as_secs_f64())
        .fetch_optional(&self.pool)
        .await;
        match ended {
            Ok(Some(true)) => {
                metrics::decoder_taken_over();
                tracing::warn!(
                    slot = self.slot,
                    "no beat from the decoder that holds the slot: its walsender ended, this instance takes the slot"
                );
                true
            }
            Ok(_) => false,
            Err(error) => {
                static TOLD: std::sync::Once = std::sync::Once::new();
                TOLD.call_once(|| {
                    tracing::warn!(
                        %error,
                        slot = self.slot,
                        "could not end the walsender of a decoder that stopped beating (it needs the holder's role or pg_signal_backend); waiting for its wal_sender_timeout"
                    );
                });
                false
            }
        }
    }

    /// Where the slot says its consumer confirmed up to (0: not known).
    async fn confirmed(&self) -> u64 {
        sqlx::query_scalar::<_, Option<i64>>(
            "select (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint
             from pg_replication_slots where slot_name = $1",
        )
        .bind(&self.slot)
        .fetch_optional(&self.pool)
        .await
        .ok()
        .flatten()
        .flatten()
        .map_or(0, |lsn| u64::try_from(lsn).unwrap_or(0))
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
        // Every change the gap may hold committed before now: a read replica
        // that has replayed this far has them all (unread: the primary only).
        let floor = crate::store::wal_position(&self.pool)
            .await
            .map_or(Since::PRIMARY, Since);
        let cutoff = self.all_posts(None, floor).await?;
        redis.close_gap(&key).await?;
        metrics::feed_gap(why.as_str());
        if why == GapWhy::FirstSlot {
            tracing::info!(
                why = why.as_str(),
                cutoff,
                slot = self.slot,
                "change feed: the fleet's first slot is made; it holds every change from now on"
            );
        } else {
            tracing::warn!(
                why = why.as_str(),
                cutoff,
                slot = self.slot,
                "change feed gap: the slot was made again; every post read before now is stale fleet-wide"
            );
        }
        Ok(())
    }

    /// Makes the slot before the first session asks for it, when there is
    /// none: a fleet's first start is then no error (the replication
    /// client logs a session refused for want of its slot as one). The gap
    /// is marked first, as for a slot found missing (see `run`); the
    /// fleet's first slot when its change stream is empty. A slot that
    /// cannot be looked for is left to the sessions.
    async fn make_slot_if_missing(&self) {
        let exists = sqlx::query_scalar::<_, bool>(
            "select exists (select 1 from pg_replication_slots where slot_name = $1)",
        )
        .bind(&self.slot)
        .fetch_one(&self.pool)
        .await;
        if !matches!(exists, Ok(false)) {
            return;
        }
        let why = match self
            .read_path
            .redis()
            .stream_tail(&self.stream_key, 1)
            .await
        {
            Ok(tail) if tail.is_empty() => GapWhy::FirstSlot,
            _ => GapWhy::SlotMissing,
        };
        if let Err(error) = self.mark_gap(why).await {
            tracing::debug!(
                error = format!("{error:#}"),
                "could not mark the first slot's gap in Redis; left to the sessions"
            );
            return;
        }
        if let Err(error) = self.make_slot().await {
            tracing::debug!(
                error = format!("{error:#}"),
                "could not make the slot; left to the sessions"
            );
        }
    }

    /// Where a new session starts: past everything the fleet's stream says
    /// was applied and announced (its last beat), or the slot's own
    /// position (0) when the stream says nothing.
    ///
    /// PostgreSQL saves a slot's confirmed position at checkpoints: after a
    /// crash it sends again what came after the last save, minutes of
    /// changes. Applied again out of their time, old changes do harm: a
    /// deletion's tombstone over a post inserted again since, its id taken
    /// from the existence guards, a fence set back to an older position
    /// (examples/coherence found the first two: 404s for posts that
    /// existed, 7 s stale). START_REPLICATION starts at the later of the
    /// slot's position and the one asked for. A position past the
    /// server's WAL (a database restored from an older backup) is ignored.
    async fn resume_at(&self) -> u64 {
        let announced = match fanout::last_beat(self.read_path.redis(), &self.stream_key).await {
            Ok(Some(lsn)) => lsn,
            Ok(None) => return 0,
            Err(error) => {
                tracing::debug!(%error, "could not read the last beat; starting at the slot's position");
                return 0;
            }
        };
        match crate::store::wal_position(&self.pool).await {
            Ok(wal) if announced <= wal => announced,
            Ok(wal) => {
                tracing::warn!(
                    announced,
                    wal,
                    "the change stream is past the server's WAL (a restored database?): starting at the slot's position"
                );
                0
            }
            Err(_) => 0,
        }
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

    /// Holds the slot and decodes until the session ends (an error);
    /// `decoded` says whether it held it.
    async fn hold(&self, decoded: &mut bool) -> anyhow::Result<()> {
        let id = rand::rng().random_range(1..u64::MAX);
        let name = format!("postcache-decoder-{id:016x}");
        let resume = self.resume_at().await;
        let config = replication_config(&self.database.database_url, &self.slot)?
            .with_start_lsn(pgwire_replication::Lsn(resume))
            .with_application_name(name.as_str())
            .with_options(session_options(&self.database, self.timeout));
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
        *decoded = true;
        let _held = scopeguard(|| metrics::decoder_held(false));
        // The session's prober (liveness.rs), on the decoder's own
        // connections, for as long as it holds the slot.
        let (probes, probed) = tokio::sync::watch::channel(None);
        let nudge = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let prober = liveness::Prober {
            pool: self.visibility.clone(),
            session: name,
            timeout: self.timeout / 4,
            nudge: nudge.clone(),
            probes,
        };
        let _prober = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(prober.run()));
        let now = Instant::now();
        let mut session = liveness::Session {
            id,
            probes: probed,
            nudge,
            judge: liveness::Judge::new(self.timeout, now),
            judged: now,
        };
        // Everything before where the stream starts was applied.
        let start = pgwire_replication::Lsn(resume.max(self.confirmed().await));
        // Before any change is applied: the raise covers what the slot
        // does not have, and the changes it has are applied after it.
        let result = match self.close_gap().await {
            Ok(()) => self.decode(&mut client, &mut session, start).await,
            Err(error) => Err(error.context("could not close the change feed's gap")),
        };
        client.abort();
        result
    }

    /// Raises the cutoff, for `change` (a commit LSN) or for a gap (none),
    /// and says so on the stream; the cutoff in force. `floor`: what every
    /// load from a read replica must include from now on.
    async fn all_posts(&self, change: Option<u64>, floor: Since) -> anyhow::Result<u64> {
        let redis = self.read_path.redis();
        // Before the cutoff: from now on this instance's loads from replicas
        // must have replayed it; what they read before is stale by the
        // cutoff (no key to fence: see store/replica_floor.rs).
        self.read_path.all_changed(floor, u64::MAX);
        let cutoff = match change.and_then(|lsn| i64::try_from(lsn).ok()) {
            Some(change) => self.read_path.invalidate_all(change).await?,
            None => self.read_path.invalidate_all_now().await?,
        };
        // A raise is not applied again (see `redis/replicas.rs`): a failover
        // to a replica that missed it undoes it. Said, not held back: the
        // feed would stop while a replica does not answer.
        if !self.replica_wait.is_zero() {
            let key = [self.read_path.keys().cutoff()];
            if !matches!(redis.replicated(&key, self.replica_wait).await, Ok(true)) {
                metrics::changes_unreplicated(1);
                tracing::warn!(
                    "no Redis replica acknowledged the raise of the cutoff: a failover to one would undo it"
                );
            }
        }
        // The followers take `lsn` as their floor (0: the primary only).
        let lsn = if floor == Since::PRIMARY { 0 } else { floor.0 };
        fanout::append(redis, &self.stream_key, &Entry::All { lsn, cutoff }).await?;
        Ok(cutoff)
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
}
