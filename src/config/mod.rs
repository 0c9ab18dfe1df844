//! Settings: the command line and the environment.
//!
//! Every setting is both a `--kebab-case` flag and an `UPPER_SNAKE` environment
//! variable; durations are written `250ms`, `5s`, `2m`.

use std::{net::SocketAddr, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};

mod check;
mod parse;

use parse::{parse_beta, parse_jitter, parse_on_off, parse_optional_addr, parse_url_list};
pub use parse::{
    parse_duration, OptionalAddr, UrlList, MAX_COUNT, MAX_DURATION, MAX_ENTRY_BYTES_LIMIT,
};

pub use crate::{read_path::Strategy, telemetry::LogFormat};

/// postcache: serves posts from Redis in front of PostgreSQL, one load per key for the whole fleet.
#[derive(Debug, Parser)]
#[command(name = "postcache", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// Log format: `text` for people, `json` for machines. RUST_LOG filters.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create the database if it does not exist, then apply the embedded migrations.
    Migrate(DatabaseSettings),
    /// Write posts with ids 1..=N (deterministic for a given seed; safe to rerun).
    Seed(SeedArgs),
    /// Serve HTTP (applies pending migrations first unless --no-migrate).
    Serve(Box<ServeArgs>),
    /// Invalidate posts fleet-wide, the same way a change in PostgreSQL does
    /// (for operators, and for writes made with the triggers off).
    Invalidate(Box<InvalidateArgs>),
    /// Show what Redis holds for a post: its entry (found, not found, failed,
    /// backoff copy), ages and TTLs, the fail-safe copy, the lock and its
    /// holder, the ready channel's subscribers.
    Inspect(Box<InspectArgs>),
    /// Ask a running instance's /livez (ADMIN_ADDR where set, else
    /// LISTEN_ADDR): exit 0 on a 200, 1 otherwise (a container's HEALTHCHECK).
    Healthcheck(HealthcheckArgs),
    /// The replication slots of postcache fleets (CHANGE_FEED=replication):
    /// list them with the WAL each holds, or drop one a retired fleet left.
    #[command(subcommand)]
    Slot(SlotCommand),
}

#[derive(Debug, Subcommand)]
pub enum SlotCommand {
    /// Every postcache slot on the server: its database, whether a decoder
    /// reads it, and the WAL it holds back; this fleet's (DATABASE_URL,
    /// KEY_PREFIX) is marked.
    List(SlotListArgs),
    /// Drops a slot: this fleet's (DATABASE_URL, KEY_PREFIX), or the one
    /// named. A slot a decoder reads is refused unless --force, which ends
    /// that decoder's session first (a fleet still running makes its slot
    /// again, as after a gap).
    Drop(SlotDropArgs),
}

/// The fleet a slot command is about: its slot is named after the
/// database and the key prefix.
#[derive(Debug, Clone, Args)]
pub struct SlotFleet {
    #[command(flatten)]
    pub database: DatabaseSettings,

    /// The fleet's key prefix, which names its slot with the database.
    #[arg(long, env = "KEY_PREFIX", default_value = "")]
    pub key_prefix: String,
}

#[derive(Debug, Clone, Args)]
pub struct SlotListArgs {
    #[command(flatten)]
    pub fleet: SlotFleet,

    /// Print JSON instead of words.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct SlotDropArgs {
    #[command(flatten)]
    pub fleet: SlotFleet,

    /// The slot to drop (a `postcache_` slot); default: this fleet's.
    pub name: Option<String>,

    /// Drop it even while a decoder reads it (its session is ended first).
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Clone, Args)]
pub struct HealthcheckArgs {
    /// The instance's listen address (asked when ADMIN_ADDR is empty; an
    /// unspecified address is asked on loopback).
    #[arg(long, env = "LISTEN_ADDR", default_value = "127.0.0.1:8080")]
    pub listen_addr: SocketAddr,

    /// The instance's admin address, asked where set.
    #[arg(long, env = "ADMIN_ADDR", default_value = "", value_parser = parse_optional_addr)]
    pub admin_addr: OptionalAddr,

    /// The path asked: `/livez` (the process answers) or `/readyz` (it
    /// takes reads).
    #[arg(long, default_value = "/livez", value_parser = ["/livez", "/readyz", "/healthz"])]
    pub path: String,

    /// Longest the check waits for the answer.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub timeout: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    #[command(flatten)]
    pub cache: CacheSettings,

    /// The id of the post.
    #[arg(value_parser = parse_post_id)]
    pub id: i64,

    /// Print JSON instead of words.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct InvalidateArgs {
    #[command(flatten)]
    pub database: DatabaseSettings,

    #[command(flatten)]
    pub cache: CacheSettings,

    /// The ids of the posts to invalidate.
    #[arg(value_parser = parse_post_id, required_unless_present = "all", conflicts_with = "all")]
    pub ids: Vec<i64>,

    /// Invalidate every post: everything read before now is stale (no key
    /// is scanned).
    #[arg(long)]
    pub all: bool,
}

fn parse_post_id(s: &str) -> Result<i64, String> {
    crate::posts::PostId::parse(s)
        .map(|id| id.get())
        .map_err(|e| e.to_string())
}

#[derive(Debug, Clone, Args)]
pub struct DatabaseSettings {
    /// PostgreSQL connection URL (`sslmode=` in the URL selects TLS).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postcache",
        hide_env_values = true
    )]
    pub database_url: String,

    /// Most connections the service keeps to PostgreSQL.
    #[arg(long, env = "DB_MAX_CONNECTIONS", default_value_t = 16)]
    pub db_max_connections: u32,

    /// Longest a request waits for a free PostgreSQL connection before 503.
    #[arg(long, env = "DB_ACQUIRE_TIMEOUT", default_value = "1s", value_parser = parse_duration)]
    pub db_acquire_timeout: Duration,

    /// PostgreSQL `statement_timeout` for the service's queries; must stay below LOCK_TTL.
    #[arg(long, env = "DB_STATEMENT_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub db_statement_timeout: Duration,

    /// TCP keepalive of every PostgreSQL session, set on the server's side
    /// (`tcp_keepalives_idle`, whole seconds; probes a third of it apart,
    /// three of them): a client gone without a word is found within about
    /// twice this (0: the server's own setting).
    #[arg(long, env = "DB_TCP_KEEPALIVE", default_value = "5s", value_parser = parse_duration)]
    pub db_tcp_keepalive: Duration,

    /// TCP_USER_TIMEOUT of every PostgreSQL session, on the server's side
    /// (`tcp_user_timeout`): data unacknowledged this long ends the
    /// session (0: the server's own setting).
    #[arg(long, env = "DB_TCP_USER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub db_tcp_user_timeout: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct SeedArgs {
    #[command(flatten)]
    pub database: DatabaseSettings,

    /// Number of posts to write (ids 1..=N).
    #[arg(long, env = "SEED_POSTS")]
    pub posts: u64,

    /// Seed of the generator: the same seed writes the same posts.
    #[arg(long, env = "SEED_SEED", default_value_t = 42)]
    pub seed: u64,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub database: DatabaseSettings,

    #[command(flatten)]
    pub cache: CacheSettings,

    /// HTTP listen address; port 0 picks a free port (the chosen address is logged).
    #[arg(long, env = "LISTEN_ADDR", default_value = "127.0.0.1:8080")]
    pub listen_addr: SocketAddr,

    /// A second listen address serving only `/livez`, `/readyz` and
    /// `/metrics` (probes and monitoring off the public port, never shed);
    /// empty: off.
    #[arg(long, env = "ADMIN_ADDR", default_value = "", value_parser = parse_optional_addr)]
    pub admin_addr: OptionalAddr,

    /// Do not apply pending migrations at start.
    #[arg(long, env = "NO_MIGRATE")]
    pub no_migrate: bool,

    /// Most requests handled at once; past it, a fast 503 (load shedding).
    #[arg(long, env = "MAX_IN_FLIGHT", default_value_t = 16_384)]
    pub max_in_flight: usize,

    /// Longest any request may take before a 503 (a backstop over every other bound).
    #[arg(long, env = "REQUEST_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub request_timeout: Duration,

    /// A connection whose request headers are not complete this long after
    /// it opened, or after the first byte of a request on a kept-alive
    /// connection, is closed.
    #[arg(long, env = "HEADER_READ_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub header_read_timeout: Duration,

    /// A kept-alive connection with no request in flight this long is closed.
    #[arg(long, env = "IDLE_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub idle_timeout: Duration,

    /// Connections of a pool of their own for what reads that need
    /// PostgreSQL's word run there (`PostCache-Max-Staleness` the feed
    /// cannot vouch for, a `PostCache-Min-LSN` it has not reached): the
    /// rounds that ask the primary's position, once for every such read
    /// waiting, and the rows read past the cache. Past them a read is shed
    /// (503, `Retry-After`); the loads' pool is never used.
    #[arg(long, env = "PAST_READ_CONNECTIONS", default_value_t = 2)]
    pub past_read_connections: u32,

    /// After SIGTERM (or Ctrl-C), how long `/readyz` answers 503
    /// `draining` while requests are still served, before the listener
    /// stops accepting and drains: time for a load balancer or Kubernetes
    /// to take the instance out of rotation (5s there; at most 10m). 0: the
    /// listener stops at once.
    #[arg(long, env = "SHUTDOWN_DELAY", default_value = "0s", value_parser = parse_duration)]
    pub shutdown_delay: Duration,

    /// How changes to `posts` in PostgreSQL, by any writer, invalidate the
    /// cache fleet-wide within milliseconds: `replication` (logical
    /// replication, one decoder per fleet; writers untouched), `trigger`
    /// (the outbox trigger; `on` is its alias), `off` (the TTLs alone), or
    /// `auto`: replication where the server's `wal_level` is `logical`,
    /// else trigger.
    #[arg(long, env = "CHANGE_FEED", value_enum, default_value_t = ChangeFeed::Auto)]
    pub change_feed: ChangeFeed,

    /// How long the change outbox (`post_changes`) keeps a change.
    #[arg(long, env = "CHANGE_RETENTION", default_value = "1h", value_parser = parse_duration)]
    pub change_retention: Duration,

    /// Most connections open at once; past it, a new connection is answered
    /// 503 and closed. About 20 KiB each: the default bounds them to about
    /// 200 MiB (lowered at start to what the file-descriptor limit allows).
    #[arg(long, env = "MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,

    /// How long the change feed's decoder may go unheard before it is taken
    /// for dead (replication): PostgreSQL ends the decoder's session past it
    /// (its `wal_sender_timeout`), the decoder gives up the slot when the
    /// server has not heard from it for half of it (or has sent what never
    /// arrived), and the other instances then take the slot. The longest a
    /// silent connection (a dead NAT entry, a host gone without a reset)
    /// keeps the fleet blind.
    #[arg(long, env = "REPLICATION_TIMEOUT", default_value = "4s", value_parser = parse_duration)]
    pub replication_timeout: Duration,

    /// How long the change feed's decoder waits for a Redis replica to
    /// acknowledge the changes it applied (WAIT), where Redis has replicas:
    /// a change not acknowledged is applied again until it is, so that a
    /// failover to a replica that missed it undoes nothing (0: not waited
    /// for).
    #[arg(long, env = "REDIS_REPLICA_WAIT", default_value = "200ms", value_parser = parse_duration)]
    pub redis_replica_wait: Duration,

    /// Read replicas for loads, comma-separated PostgreSQL URLs (empty:
    /// every load reads DATABASE_URL). A key is read from a replica only
    /// once it has replayed the key's last change; needs CHANGE_FEED
    /// replication (otherwise every load reads the primary).
    #[arg(
        long,
        env = "DATABASE_REPLICA_URLS",
        default_value = "",
        hide_env_values = true,
        value_parser = parse_url_list
    )]
    pub database_replica_urls: UrlList,

    /// A replica whose replay trails the primary's commits by more than
    /// this leaves the rotation; must stay below the change fence's
    /// lifetime (2 × (LOCK_TTL + LOAD_TIMEOUT)) by 3s.
    #[arg(long, env = "REPLICA_MAX_LAG", default_value = "5s", value_parser = parse_duration)]
    pub replica_max_lag: Duration,
}

/// Whether and how the service follows changes made in PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ChangeFeed {
    /// `replication` where `wal_level` is `logical`, else `trigger`.
    Auto,
    /// Logical replication: one decoder per fleet, fanned out through Redis.
    Replication,
    /// The outbox trigger (`post_changes`), followed by every instance.
    #[value(alias = "on")]
    Trigger,
    /// The TTLs alone.
    Off,
}

#[derive(Debug, Clone, Args)]
pub struct CacheSettings {
    /// Redis URL (`rediss://` for TLS).
    #[arg(
        long,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true
    )]
    pub redis_url: String,

    /// Prepended to every Redis key and channel.
    #[arg(long, env = "KEY_PREFIX", default_value = "")]
    pub key_prefix: String,

    /// Lifetime of a cached post.
    #[arg(long, env = "CACHE_TTL", default_value = "60s", value_parser = parse_duration)]
    pub cache_ttl: Duration,

    /// Every TTL is multiplied by a uniform random factor in [1-j, 1+j].
    #[arg(long, env = "TTL_JITTER", default_value_t = 0.1, value_parser = parse_jitter)]
    pub ttl_jitter: f64,

    /// Lifetime of a "post not found" entry.
    #[arg(long, env = "NEGATIVE_TTL", default_value = "10s", value_parser = parse_duration)]
    pub negative_ttl: Duration,

    /// Leader lock lifetime; larger than the database statement timeout.
    #[arg(long, env = "LOCK_TTL", default_value = "5s", value_parser = parse_duration)]
    pub lock_ttl: Duration,

    /// Client-side bound on every load (pool acquire and query), for a
    /// connection that stops answering; default DB_STATEMENT_TIMEOUT + 500ms.
    #[arg(long, env = "LOAD_TIMEOUT", value_parser = parse_duration)]
    pub load_timeout: Option<Duration>,

    /// Longest a waiter waits for another's load before 504.
    #[arg(long, env = "WAIT_TIMEOUT", default_value = "3s", value_parser = parse_duration)]
    pub wait_timeout: Duration,

    /// Longest a read asking for a position (PostCache-Min-LSN) waits for this instance's change feed to pass it before it reads past the cache; 0: never waits.
    #[arg(long, env = "MIN_LSN_WAIT", default_value = "100ms", value_parser = parse_duration)]
    pub min_lsn_wait: Duration,

    /// Bound on every single Redis command; past it the request fails open to PostgreSQL.
    #[arg(long, env = "REDIS_TIMEOUT", default_value = "250ms", value_parser = parse_duration)]
    pub redis_timeout: Duration,

    /// TCP keepalive of every Redis connection (idle time before the first
    /// probe; 0: off): a connection whose peer is gone without a word is
    /// found and made again.
    #[arg(long, env = "REDIS_TCP_KEEPALIVE", default_value = "5s", value_parser = parse_duration)]
    pub redis_tcp_keepalive: Duration,

    /// TCP_USER_TIMEOUT of every Redis connection: data unacknowledged this
    /// long ends the connection (0: the system's default).
    #[arg(long, env = "REDIS_TCP_USER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub redis_tcp_user_timeout: Duration,

    /// Read path: none, naive, local, poll, pubsub.
    #[arg(long, env = "CACHE_STRATEGY", value_enum, default_value_t = Strategy::Pubsub)]
    pub cache_strategy: Strategy,

    /// How often `poll` waiters re-read the value.
    #[arg(long, env = "POLL_INTERVAL", default_value = "100ms", value_parser = parse_duration)]
    pub poll_interval: Duration,

    /// Grace window after CACHE_TTL in which a stale post is served at once while
    /// one background refresh runs for the whole fleet (0 = off).
    #[arg(long, env = "STALE_WHILE_REVALIDATE", default_value = "0s", value_parser = parse_duration)]
    pub stale_while_revalidate: Duration,

    /// XFetch β for probabilistic early refresh of fresh hits (0 = off; 1 is the usual value).
    #[arg(long, env = "EARLY_REFRESH_BETA", default_value_t = 0.0, value_parser = parse_beta)]
    pub early_refresh_beta: f64,

    /// How long past freshness a fail-safe copy is kept, served when a load fails (0 = off).
    #[arg(long, env = "MAX_STALE", default_value = "1h", value_parser = parse_duration)]
    pub max_stale: Duration,

    /// Byte budget of the in-process memory tier in front of Redis (0 = off).
    #[arg(long, env = "L1_MAX_BYTES", default_value_t = 64 << 20)]
    pub l1_max_bytes: u64,

    /// Longest an entry is served from the memory tier: the bound on a
    /// change not seen by this instance (CHANGE_FEED=off, `invalidate` by
    /// hand); an entry never outlives its freshness either.
    #[arg(long, env = "L1_TTL", default_value = "30s", value_parser = parse_duration)]
    pub l1_ttl: Duration,

    /// A post whose JSON is larger than this many bytes is never cached:
    /// it is served from PostgreSQL (`X-Cache: bypass`, `X-Cache-Bypass:
    /// too-large`), and a small marker is cached in its place so that every
    /// instance loads it at once instead of waiting for a lock.
    #[arg(long, env = "MAX_ENTRY_BYTES", default_value_t = 1 << 20)]
    pub max_entry_bytes: usize,

    /// How long a failed load is remembered fleet-wide: no retry of the database
    /// for the key meanwhile (503 at once, or the fail-safe copy) (0 = off).
    #[arg(long, env = "FAILURE_TTL", default_value = "2s", value_parser = parse_duration)]
    pub failure_ttl: Duration,

    /// Most keys one load statement reads (`where id = any($1)`): misses
    /// that queue while LOAD_STATEMENTS statements run go together in the
    /// next one (1: a statement per key).
    #[arg(long, env = "LOAD_BATCH_MAX", default_value_t = 256)]
    pub load_batch_max: usize,

    /// The existence guard (`on` or `off`): ids that cannot exist are
    /// answered 404 without a load once Redis has nothing for them, from an
    /// exact set of the ids kept current by the change feed (it stands
    /// aside while the feed is off or down).
    #[arg(long, env = "EXISTENCE_GUARD", default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pub existence_guard: bool,

    /// Most load statements in flight at once per instance (default 2; at
    /// most DB_MAX_CONNECTIONS). Below it a miss's statement starts at
    /// once; past it, misses queue for the next statement.
    #[arg(long, env = "LOAD_STATEMENTS")]
    pub load_statements: Option<usize>,
}

impl CacheSettings {
    /// The TCP settings of Redis connections.
    pub fn redis_tcp(&self) -> crate::redis::Tcp {
        crate::redis::Tcp {
            keepalive: self.redis_tcp_keepalive,
            user_timeout: self.redis_tcp_user_timeout,
        }
    }
}

#[cfg(test)]
mod tests;
