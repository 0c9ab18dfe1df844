//! The store: the primary's WAL position, which replicas are measured
//! against (and, later, what a client's write is ordered by).

/// The primary's WAL insert position (a byte offset): a replica that has
/// replayed to it has every transaction committed before.
pub async fn wal_position(pool: &sqlx::PgPool) -> sqlx::Result<u64> {
    let lsn: i64 =
        sqlx::query_scalar("select (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
            .fetch_one(pool)
            .await?;
    Ok(u64::try_from(lsn).unwrap_or(0))
}
