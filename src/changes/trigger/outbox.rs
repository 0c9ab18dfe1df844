//! The change feed (trigger): the outbox `post_changes` (migration 0002):
//! what the triggers write, read back by snapshot, pruned past
//! CHANGE_RETENTION.
//!
//! Why snapshots and not "every id above the last one seen": an id is handed
//! out when the row is written, before its transaction commits, so a
//! transaction that began first may commit last, with a lower id than
//! changes already seen. A snapshot (`pg_current_snapshot()`) names the
//! transactions that were done when it was taken. Each catch-up reads, in
//! one repeatable-read transaction, its own snapshot S and every change
//! whose transaction was not done at the previous one (still running, or
//! begun since): exactly the changes that became visible between the two,
//! each once, in whatever order they committed. Then S becomes the
//! previous one.

use std::time::Duration;

use sqlx::{postgres::PgRow, PgPool, Postgres, Row, Transaction};

use crate::{posts::Timestamp, telemetry::metrics};

/// The channel the outbox's trigger notifies, once per statement.
pub const CHANNEL: &str = "postcache_changes";

/// Changes read per page of a catch-up (each page one statement, under the
/// statement timeout; all pages in one snapshot).
pub const PAGE: i64 = 1000;

/// Outbox rows deleted per statement when pruning.
const PRUNE_BATCH: i64 = 10_000;

/// What changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Insert,
    Update,
    Delete,
    /// The table was truncated: every post.
    Truncate,
    /// `postcache invalidate <id>`.
    Invalidate,
    /// `postcache invalidate --all`.
    InvalidateAll,
}

impl Op {
    fn parse(op: &str) -> Option<Self> {
        Some(match op {
            "insert" => Op::Insert,
            "update" => Op::Update,
            "delete" => Op::Delete,
            "truncate" => Op::Truncate,
            "invalidate" => Op::Invalidate,
            "invalidate_all" => Op::InvalidateAll,
            _ => return None,
        })
    }

    /// As written in the outbox, and in the metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Insert => "insert",
            Op::Update => "update",
            Op::Delete => "delete",
            Op::Truncate => "truncate",
            Op::Invalidate => "invalidate",
            Op::InvalidateAll => "invalidate_all",
        }
    }
}

/// One change read from the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub id: i64,
    /// `None`: every post.
    pub post_id: Option<i64>,
    pub op: Op,
    /// When it was written (any timestamp PostgreSQL holds).
    pub changed_at: Timestamp,
}

impl Change {
    /// A row of the outbox; `None` (logged, counted) for one that cannot be
    /// read: it is skipped, never a panic that stops the feed.
    fn read(row: &PgRow) -> Option<Self> {
        let read = || -> Result<Self, String> {
            let id = row.try_get("id").map_err(|e| e.to_string())?;
            let op: String = row.try_get("op").map_err(|e| e.to_string())?;
            Ok(Change {
                id,
                post_id: row.try_get("post_id").map_err(|e| e.to_string())?,
                op: Op::parse(&op).ok_or_else(|| format!("unknown op {op:?}"))?,
                changed_at: row.try_get("changed_at").map_err(|e| e.to_string())?,
            })
        };
        match read() {
            Ok(change) => Some(change),
            Err(error) => {
                metrics::change_skipped("undecodable");
                let id = row.try_get::<i64, _>("id").ok();
                tracing::warn!(id, error, "an outbox row that cannot be read was skipped");
                None
            }
        }
    }
}

/// The snapshot of the database now, as text (`xmin:xmax:xip,…`).
pub async fn snapshot(pool: &PgPool) -> sqlx::Result<String> {
    sqlx::query_scalar("select pg_current_snapshot()::text")
        .fetch_one(pool)
        .await
}

/// Whether `snapshot` can be a past snapshot of this database: it reads as
/// one, and names no transaction later than the database has seen (a
/// position left in Redis by another cluster, say a restored copy, whose
/// xids ran higher, would hide every change until ours caught up).
pub async fn is_past_snapshot(pool: &PgPool, snapshot: &str) -> bool {
    sqlx::query_scalar::<_, bool>(
        "select pg_snapshot_xmax($1::pg_snapshot) <= pg_snapshot_xmax(pg_current_snapshot())",
    )
    .bind(snapshot)
    .fetch_one(pool)
    .await
    .unwrap_or(false)
}

/// One page of a catch-up.
pub struct Page {
    /// The changes read (rows that cannot be read are skipped).
    pub changes: Vec<Change>,
    /// It holds PAGE rows: there may be more.
    pub full: bool,
    /// The id of its last row, read or skipped.
    pub last: Option<i64>,
}

/// One catch-up: a read-only repeatable-read transaction, so that every
/// page and the snapshot agree.
pub struct CatchUp {
    tx: Transaction<'static, Postgres>,
    /// The snapshot of this catch-up: the next one starts from it.
    pub snapshot: String,
}

impl CatchUp {
    pub async fn begin(pool: &PgPool) -> sqlx::Result<Self> {
        let mut tx = pool
            .begin_with("begin isolation level repeatable read read only")
            .await?;
        let snapshot = sqlx::query_scalar("select pg_current_snapshot()::text")
            .fetch_one(&mut *tx)
            .await?;
        Ok(Self { tx, snapshot })
    }

    /// One page of the changes not visible in `previous`, those after id
    /// `after`, in id order.
    pub async fn page(&mut self, previous: &str, after: i64) -> sqlx::Result<Page> {
        let rows = sqlx::query(
            // A range scan of the xid index from the previous snapshot's
            // xmin (a condition with OR over the in-progress list could use
            // no index, and walk the whole outbox).
            "select id, post_id, op, changed_at from post_changes
             where xid >= pg_snapshot_xmin($1::pg_snapshot)
               and not pg_visible_in_snapshot(xid, $1::pg_snapshot)
               and id > $2
             order by id
             limit $3",
        )
        .bind(previous)
        .bind(after)
        .bind(PAGE)
        .fetch_all(&mut *self.tx)
        .await?;
        Ok(Page {
            full: rows.len() as i64 == PAGE,
            // Past the rows skipped too: the next page starts after them.
            last: rows.last().and_then(|row| row.try_get("id").ok()),
            changes: rows.iter().filter_map(Change::read).collect(),
        })
    }

    /// Ends it (read only: nothing to keep or undo).
    pub async fn end(self) -> sqlx::Result<()> {
        self.tx.commit().await
    }
}

/// Deletes changes written longer than `retention` ago whose transaction
/// was done at `applied` (a snapshot this instance has caught up to: a
/// transaction open longer than the retention is not pruned before it is
/// read); how many.
pub async fn prune(pool: &PgPool, retention: Duration, applied: &str) -> sqlx::Result<u64> {
    let mut pruned = 0;
    loop {
        // skip locked: instances pruning at once split the work.
        let done = sqlx::query(
            "delete from post_changes where id in (
                 select id from post_changes
                 where changed_at < now() - make_interval(secs => $1)
                   and pg_visible_in_snapshot(xid, $3::pg_snapshot)
                 limit $2 for update skip locked)",
        )
        .bind(retention.as_secs_f64())
        .bind(PRUNE_BATCH)
        .bind(applied)
        .execute(pool)
        .await?
        .rows_affected();
        pruned += done;
        if done < PRUNE_BATCH as u64 {
            return Ok(pruned);
        }
    }
}

/// Appends changes to the outbox by hand (`postcache invalidate`, and each
/// batch of `postcache seed`): one per id, or one for every post when `ids`
/// is empty. Their ids, in order.
pub async fn record<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    ids: &[i64],
) -> sqlx::Result<Vec<(i64, Option<i64>)>> {
    if ids.is_empty() {
        let id: i64 = sqlx::query_scalar(
            "insert into post_changes (post_id, op) values (null, 'invalidate_all') returning id",
        )
        .fetch_one(executor)
        .await?;
        return Ok(vec![(id, None)]);
    }
    let rows = sqlx::query(
        "insert into post_changes (post_id, op)
         select unnest($1::bigint[]), 'invalidate' returning id, post_id",
    )
    .bind(ids)
    .fetch_all(executor)
    .await?;
    Ok(rows
        .into_iter()
        .map(|row| (row.get("id"), row.get("post_id")))
        .collect())
}
