//! Subcommands: `postcache slot list` and `postcache slot drop`, the life
//! of the replication slots postcache fleets make (CHANGE_FEED=replication).
//!
//! A fleet's slot is named after its database and KEY_PREFIX
//! (`changes::replication::slot_name`) and holds back the WAL its decoder
//! has not confirmed: a fleet retired without dropping it keeps WAL until
//! PostgreSQL invalidates the slot (`max_slot_wal_keep_size`) or its disk
//! fills. `list` shows every postcache slot on the server with the WAL it
//! holds; `drop` drops one. `serve` warns at start about another fleet's
//! slot on its database that nobody reads
//! (`changes::replication::warn_of_idle_slots`).

use std::fmt;

use anyhow::{bail, Context};
use serde::Serialize;
use sqlx::PgPool;

use crate::{
    changes::replication::slot_name,
    config::{SlotDropArgs, SlotFleet, SlotListArgs},
    store,
};

/// One postcache slot, as `pg_replication_slots` says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Slot {
    pub name: String,
    pub database: String,
    /// A decoder reads it now.
    pub active: bool,
    /// The session of that decoder (`null` when none).
    pub active_pid: Option<i32>,
    /// WAL held back, in bytes (`null` when not known: never read, or on a
    /// standby).
    pub retained_bytes: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost` (PostgreSQL's
    /// `wal_status`).
    pub wal_status: Option<String>,
    /// The fleet of DATABASE_URL and KEY_PREFIX owns it.
    pub this_fleet: bool,
}

/// Every postcache slot on the server.
#[derive(Debug, Serialize)]
pub struct Slots {
    /// This fleet's slot name (whether or not it exists).
    pub this_fleet: String,
    pub slots: Vec<Slot>,
}

impl fmt::Display for Slots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.slots.is_empty() {
            return writeln!(
                f,
                "no postcache slot (this fleet's would be {})",
                self.this_fleet
            );
        }
        for slot in &self.slots {
            let held = slot
                .retained_bytes
                .map_or_else(|| "unknown".to_owned(), human_bytes);
            writeln!(
                f,
                "{}{}  database {}  {}  holds {} of WAL{}",
                slot.name,
                if slot.this_fleet { " (this fleet)" } else { "" },
                slot.database,
                match slot.active_pid {
                    Some(pid) if slot.active => format!("read by pid {pid}"),
                    _ => "not read".to_owned(),
                },
                held,
                slot.wal_status
                    .as_deref()
                    .filter(|s| *s != "reserved")
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default(),
            )?;
        }
        Ok(())
    }
}

/// `bytes` as people read it (B, KiB, MiB, GiB).
fn human_bytes(bytes: i64) -> String {
    let mut value = bytes as f64;
    for unit in ["B", "KiB", "MiB", "GiB"] {
        if value < 1024.0 || unit == "GiB" {
            return if unit == "B" {
                format!("{bytes} B")
            } else {
                format!("{value:.1} {unit}")
            };
        }
        value /= 1024.0;
    }
    unreachable!("GiB ends the loop")
}

/// This fleet's slot name, from DATABASE_URL and KEY_PREFIX.
fn this_fleet(fleet: &SlotFleet) -> anyhow::Result<String> {
    let url = url::Url::parse(&fleet.database.database_url).context("invalid DATABASE_URL")?;
    Ok(slot_name(
        url.path().trim_start_matches('/'),
        &fleet.key_prefix,
    ))
}

/// A connection to the server (the database of DATABASE_URL, which need
/// not hold the slots: `pg_replication_slots` is the server's).
async fn connect(fleet: &SlotFleet) -> anyhow::Result<PgPool> {
    fleet.database.validate()?;
    store::connect_feed(&fleet.database, 1).context("invalid DATABASE_URL")
}

const SLOTS: &str = "select slot_name as name, coalesce(database, '') as database, active,
        active_pid, pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint as retained_bytes,
        wal_status::text as wal_status, slot_name = $1 as this_fleet
     from pg_replication_slots
     where slot_name like 'postcache\\_%'";

/// Longest a `slot` command waits for PostgreSQL in all (a server gone
/// silent must not hold an operator's shell).
const LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

async fn bounded<T>(
    work: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::time::timeout(LIMIT, work)
        .await
        .map_err(|_| anyhow::anyhow!("no answer from PostgreSQL within {LIMIT:?}"))?
}

/// `postcache slot list`.
pub async fn list(args: &SlotListArgs) -> anyhow::Result<Slots> {
    bounded(list_unbounded(args)).await
}

async fn list_unbounded(args: &SlotListArgs) -> anyhow::Result<Slots> {
    let this_fleet = this_fleet(&args.fleet)?;
    let pool = connect(&args.fleet).await?;
    let slots = sqlx::query_as::<_, Slot>(&format!("{SLOTS} order by slot_name"))
        .bind(&this_fleet)
        .fetch_all(&pool)
        .await
        .context("could not read pg_replication_slots")?;
    pool.close().await;
    Ok(Slots { this_fleet, slots })
}

/// `postcache slot drop`: what was dropped, in words.
pub async fn drop(args: &SlotDropArgs) -> anyhow::Result<String> {
    bounded(drop_unbounded(args)).await
}

async fn drop_unbounded(args: &SlotDropArgs) -> anyhow::Result<String> {
    let name = match &args.name {
        Some(name) => name.clone(),
        None => this_fleet(&args.fleet)?,
    };
    if !name.starts_with("postcache_") {
        bail!("{name} is not a postcache slot (their names begin with postcache_)");
    }
    let pool = connect(&args.fleet).await?;
    let dropped = drop_on(&pool, &name, args.force).await;
    pool.close().await;
    dropped
}

async fn drop_on(pool: &PgPool, name: &str, force: bool) -> anyhow::Result<String> {
    let slot = sqlx::query_as::<_, Slot>(&format!("{SLOTS} and slot_name = $1"))
        .bind(name)
        .fetch_optional(pool)
        .await
        .context("could not read pg_replication_slots")?;
    let Some(slot) = slot else {
        bail!("no slot named {name}");
    };
    if slot.active {
        if !force {
            bail!(
                "{name} is read by a decoder (pid {}): stop that fleet first, or give --force to end its session (a fleet still running makes its slot again)",
                slot.active_pid.unwrap_or_default()
            );
        }
        // The walsender ends; its slot is released a moment later.
        sqlx::query("select pg_terminate_backend(active_pid) from pg_replication_slots where slot_name = $1 and active_pid is not null")
            .bind(name)
            .execute(pool)
            .await
            .context("could not end the decoder's session")?;
    }
    let started = std::time::Instant::now();
    loop {
        match sqlx::query("select pg_drop_replication_slot($1)")
            .bind(name)
            .execute(pool)
            .await
        {
            Ok(_) => break,
            // 55006: still active (the ended session lets go in a moment).
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some("55006")
                    && started.elapsed() < std::time::Duration::from_secs(10) =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(error) => return Err(error).context(format!("could not drop {name}")),
        }
    }
    Ok(format!(
        "dropped {name} (database {}), which held {} of WAL\n",
        slot.database,
        slot.retained_bytes
            .map_or_else(|| "an unknown amount".to_owned(), human_bytes)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_people_read_them() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(5 << 30), "5.0 GiB");
        assert_eq!(human_bytes(3 << 40), "3072.0 GiB");
    }
}
