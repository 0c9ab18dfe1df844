//! PostgreSQL: the pool, database creation and the embedded migrations.

use std::{str::FromStr, time::Duration};

use anyhow::Context;
use sqlx::{
    migrate::{MigrateDatabase, Migrator},
    postgres::{PgConnectOptions, PgPoolOptions},
    PgPool, Postgres,
};

use crate::config::DatabaseSettings;

/// The migrations in `migrations/`, compiled into the binary.
pub static MIGRATOR: Migrator = sqlx::migrate!();

/// Creates the database named in the URL if it does not exist yet.
///
/// Several instances may start at once: losing the race to create it is fine.
pub async fn ensure_database(url: &str) -> anyhow::Result<()> {
    if Postgres::database_exists(url)
        .await
        .context("failed to reach PostgreSQL")?
    {
        return Ok(());
    }
    match Postgres::create_database(url).await {
        Ok(()) => Ok(()),
        // 42P04 duplicate_database: another instance created it meanwhile.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => Ok(()),
        Err(e) => Err(e).context("failed to create the database"),
    }
}

/// Creates the database if needed and applies pending migrations.
pub async fn migrate(settings: &DatabaseSettings) -> anyhow::Result<()> {
    settings.validate()?;
    ensure_database(&settings.database_url).await?;
    let pool = connect(settings).await?;
    MIGRATOR
        .run(&pool)
        .await
        .context("failed to apply migrations")?;
    pool.close().await;
    Ok(())
}

/// How often PostgreSQL checks that the client of a running query is still
/// there: the query of a killed leader is cancelled instead of running on.
const CLIENT_CHECK_INTERVAL: &str = "1000";

/// A pool of the change feed (not the loads'), of `connections`, named
/// `postcache-feed` in `pg_stat_activity`, with the same statement timeout.
pub fn connect_feed(settings: &DatabaseSettings, connections: u32) -> anyhow::Result<PgPool> {
    let options = connect_options(settings)?.application_name("postcache-feed");
    Ok(PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(settings.db_acquire_timeout)
        .connect_lazy_with(options))
}

/// The pool of reads past the cache and of the rounds that ask the
/// primary's position for them (see `past.rs`): `connections`, named
/// `postcache-past`, never the loads'. A read waits at most
/// PAST_ACQUIRE_TIMEOUT (or DB_ACQUIRE_TIMEOUT, if shorter) for one.
pub fn connect_past(settings: &DatabaseSettings, connections: u32) -> anyhow::Result<PgPool> {
    let options = connect_options(settings)?.application_name("postcache-past");
    Ok(loads_pool(
        connections,
        settings
            .db_acquire_timeout
            .min(super::past::PAST_ACQUIRE_TIMEOUT),
    )
    .connect_lazy_with(options))
}

/// The pool of the readiness probe (not the loads'): one connection, named
/// `postcache-readiness`, given up on after `timeout`.
pub fn connect_probe(settings: &DatabaseSettings, timeout: Duration) -> anyhow::Result<PgPool> {
    let options = connect_options(settings)?.application_name("postcache-readiness");
    Ok(PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(timeout)
        .connect_lazy_with(options))
}

/// Longest a load waits for a replica's connection before it goes on to
/// the next replica or the primary.
const REPLICA_ACQUIRE_TIMEOUT: Duration = Duration::from_millis(250);

/// A read replica's pools (DATABASE_REPLICA_URLS): the loads', of
/// DB_MAX_CONNECTIONS like the primary's, and the probe's one connection
/// (named `postcache-replica-probe`), given up on after `timeout`. Its
/// name for logs and metrics: host:port/database, never the password.
pub fn connect_replica(
    settings: &DatabaseSettings,
    url: &str,
    timeout: Duration,
) -> anyhow::Result<(String, PgPool, PgPool)> {
    let options = url_options(settings, url).context("invalid URL in DATABASE_REPLICA_URLS")?;
    let name = format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("")
    );
    // Short: a replica that cannot be reached costs a load this long
    // before it fails over (the probe takes it out within a second).
    let pool = loads_pool(
        settings.db_max_connections,
        settings.db_acquire_timeout.min(REPLICA_ACQUIRE_TIMEOUT),
    )
    .connect_lazy_with(options.clone());
    let probe = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(timeout)
        .connect_lazy_with(options.application_name("postcache-replica-probe"));
    Ok((name, pool, probe))
}

fn connect_options(settings: &DatabaseSettings) -> anyhow::Result<PgConnectOptions> {
    url_options(settings, &settings.database_url).context("invalid DATABASE_URL")
}

fn url_options(settings: &DatabaseSettings, url: &str) -> anyhow::Result<PgConnectOptions> {
    let timeout_ms = settings.db_statement_timeout.as_millis().max(1).to_string();
    let socket = socket_options(settings);
    Ok(PgConnectOptions::from_str(url)?
        .application_name("postcache")
        .options(
            [
                ("statement_timeout", timeout_ms.as_str()),
                ("client_connection_check_interval", CLIENT_CHECK_INTERVAL),
            ]
            .into_iter()
            .chain(socket.iter().map(|(name, value)| (*name, value.as_str()))),
        ))
}

/// The session settings that make PostgreSQL's side of a connection find a
/// peer gone without a word (DB_TCP_KEEPALIVE, DB_TCP_USER_TIMEOUT): a
/// client host that vanished, a NAT entry that died. The client library
/// (sqlx) sets no socket option of its own; the client side of a dead
/// connection is bounded by each query's timeout instead (LOAD_TIMEOUT,
/// the probes'). Empty for what is 0 (the server's setting then holds).
pub fn socket_options(settings: &DatabaseSettings) -> Vec<(&'static str, String)> {
    let mut options = Vec::new();
    let idle = settings.db_tcp_keepalive.as_secs();
    if !settings.db_tcp_keepalive.is_zero() {
        let idle = idle.max(1);
        options.push(("tcp_keepalives_idle", idle.to_string()));
        options.push(("tcp_keepalives_interval", (idle / 3).max(1).to_string()));
        options.push(("tcp_keepalives_count", "3".to_owned()));
    }
    if !settings.db_tcp_user_timeout.is_zero() {
        let ms = settings.db_tcp_user_timeout.as_millis().max(1);
        options.push(("tcp_user_timeout", ms.to_string()));
    }
    options
}

/// A lazily connecting pool whose connections carry the statement timeout.
///
/// Lazy so that the service starts (and fails open per request, with 503)
/// while PostgreSQL is down, and recovers without a restart.
pub async fn connect(settings: &DatabaseSettings) -> anyhow::Result<PgPool> {
    let options = connect_options(settings)?;
    Ok(
        loads_pool(settings.db_max_connections, settings.db_acquire_timeout)
            .connect_lazy_with(options),
    )
}

/// A connection of the loads idle this long is pinged before it is used.
pub const PING_IDLE_AFTER: Duration = Duration::from_secs(1);

/// The options of a pool that loads rows (the primary's and each
/// replica's): `connections` at most, each waited for at most `acquire`.
///
/// sqlx pings every connection it hands out by default: a round trip to
/// PostgreSQL before each statement (and it pings again when one is given
/// back, which no setting turns off). Here only a connection idle for
/// [`PING_IDLE_AFTER`] or longer is pinged (one that died while idle, in a
/// restart or behind a firewall's idle timeout, is replaced unseen); one
/// in use moments ago is used as it is, and a statement whose connection
/// turns out to be gone runs again on another (see `store::PostStore`).
fn loads_pool(connections: u32, acquire: Duration) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(acquire)
        .test_before_acquire(false)
        .before_acquire(|connection, meta| {
            Box::pin(async move {
                if meta.idle_for < PING_IDLE_AFTER {
                    return Ok(true);
                }
                // A failed ping closes it, and another is opened.
                Ok(sqlx::Connection::ping(connection).await.is_ok())
            })
        })
}
