//! Test support: PostgreSQL at a test's hands: a table lock that holds
//! every load back, the loads it blocks, and the slots a world leaves.

use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};

/// Drops the replication slots of database `name` (a database with a slot
/// cannot be dropped, and a slot left behind keeps WAL forever): their
/// walsenders are ended first, and waited for.
pub async fn drop_slots(conn: &mut PgConnection, name: &str) {
    for _ in 0..50 {
        let _ = sqlx::query(
            "select pg_terminate_backend(active_pid) from pg_replication_slots
             where database = $1 and active_pid is not null",
        )
        .bind(name)
        .execute(&mut *conn)
        .await;
        let _ = sqlx::query(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots
             where database = $1 and not active",
        )
        .bind(name)
        .execute(&mut *conn)
        .await;
        let left: i64 =
            sqlx::query_scalar("select count(*) from pg_replication_slots where database = $1")
                .bind(name)
                .fetch_one(&mut *conn)
                .await
                .unwrap_or(1);
        if left == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Holds `LOCK TABLE posts IN ACCESS EXCLUSIVE MODE` until released: every
/// load of a post blocks meanwhile.
pub struct TableLock {
    tx: Option<sqlx::Transaction<'static, sqlx::Postgres>>,
}

impl TableLock {
    /// `env` is the test's world ([`super::TestEnv`]) or its admin pool.
    pub async fn take(env: &impl AsRef<PgPool>) -> Self {
        let mut tx = env.as_ref().begin().await.unwrap();
        sqlx::query("lock table posts in access exclusive mode")
            .execute(&mut *tx)
            .await
            .unwrap();
        Self { tx: Some(tx) }
    }

    /// Runs `sql` in the transaction holding the lock (to change the table
    /// under it); it takes effect at [`TableLock::commit`].
    pub async fn execute(&mut self, sql: &str) {
        let tx = self.tx.as_mut().expect("held until commit or release");
        sqlx::query(sql).execute(&mut **tx).await.unwrap();
    }

    /// Commits what was done under the lock, releasing it.
    pub async fn commit(mut self) -> Instant {
        self.tx.take().unwrap().commit().await.unwrap();
        Instant::now()
    }

    pub async fn release(mut self) -> Instant {
        self.tx.take().unwrap().rollback().await.unwrap();
        Instant::now()
    }
}

/// Backends of the service currently blocked on a lock (a leader held back by [`TableLock`]).
pub async fn blocked_loads(env: &impl AsRef<PgPool>) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_stat_activity
         where datname = current_database() and wait_event_type = 'Lock'
           and application_name = 'postcache'",
    )
    .fetch_one(env.as_ref())
    .await
    .unwrap()
}
