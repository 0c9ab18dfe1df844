//! Command line and environment settings.
//!
//! Every setting is both a `--kebab-case` flag and an `UPPER_SNAKE` environment
//! variable; durations are written `250ms`, `5s`, `2m`.

use std::{net::SocketAddr, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};

pub use crate::{flight::Strategy, telemetry::LogFormat};

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

    /// Bound on every single Redis command; past it the request fails open to PostgreSQL.
    #[arg(long, env = "REDIS_TIMEOUT", default_value = "250ms", value_parser = parse_duration)]
    pub redis_timeout: Duration,

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
}

/// Parses `250ms`, `5s`, `2m` (any humantime duration).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("invalid duration {s:?}: {e}"))
}

fn parse_beta(s: &str) -> Result<f64, String> {
    let b: f64 = s
        .trim()
        .parse()
        .map_err(|e| format!("invalid beta {s:?}: {e}"))?;
    if b.is_finite() && b >= 0.0 {
        Ok(b)
    } else {
        Err(format!("beta must be a finite number >= 0, got {b}"))
    }
}

fn parse_jitter(s: &str) -> Result<f64, String> {
    let j: f64 = s
        .trim()
        .parse()
        .map_err(|e| format!("invalid jitter {s:?}: {e}"))?;
    if (0.0..1.0).contains(&j) {
        Ok(j)
    } else {
        Err(format!("jitter must be in [0, 1), got {j}"))
    }
}

/// LOAD_TIMEOUT's margin over DB_STATEMENT_TIMEOUT when it is not set.
const LOAD_TIMEOUT_MARGIN: Duration = Duration::from_millis(500);

/// The longest any duration setting may be: far above any sensible TTL or
/// timeout, and far enough below the limits of the arithmetic done with
/// them (deadlines, jitter, fences, TTLs in milliseconds) that none overflows.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);
/// The largest count settings (connections, requests in flight): far above
/// what one process can hold, far below what overflows a semaphore or a sum.
pub const MAX_COUNT: usize = 10_000_000;
/// The largest MAX_ENTRY_BYTES: Redis refuses bulk strings over 512 MiB.
pub const MAX_ENTRY_BYTES_LIMIT: usize = 512 << 20;

/// Refuses a duration above [`MAX_DURATION`], naming the setting.
fn at_most_a_year(name: &str, d: Duration) -> anyhow::Result<()> {
    anyhow::ensure!(
        d <= MAX_DURATION,
        "{name} ({}) must be at most {}",
        humantime::format_duration(d),
        humantime::format_duration(MAX_DURATION)
    );
    Ok(())
}

impl DatabaseSettings {
    /// Checks what clap cannot express.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.db_max_connections > 0,
            "DB_MAX_CONNECTIONS must be positive"
        );
        anyhow::ensure!(
            self.db_max_connections as usize <= MAX_COUNT,
            "DB_MAX_CONNECTIONS must be at most {MAX_COUNT}"
        );
        anyhow::ensure!(
            !self.db_acquire_timeout.is_zero(),
            "DB_ACQUIRE_TIMEOUT must be positive"
        );
        anyhow::ensure!(
            !self.db_statement_timeout.is_zero(),
            "DB_STATEMENT_TIMEOUT must be positive"
        );
        at_most_a_year("DB_ACQUIRE_TIMEOUT", self.db_acquire_timeout)?;
        at_most_a_year("DB_STATEMENT_TIMEOUT", self.db_statement_timeout)
    }
}

impl CacheSettings {
    /// Checks what clap cannot express, for every command that uses Redis.
    pub fn validate(&self) -> anyhow::Result<()> {
        // The id's hash tag must be the first `{…}` of every key name, so
        // that one post's keys share a Redis Cluster slot.
        anyhow::ensure!(
            !self.key_prefix.contains(['{', '}']),
            "KEY_PREFIX must not contain '{{' or '}}' (they would change the Redis Cluster hash tag of every key)"
        );
        for (name, d) in [
            ("CACHE_TTL", self.cache_ttl),
            ("NEGATIVE_TTL", self.negative_ttl),
            ("LOCK_TTL", self.lock_ttl),
            ("WAIT_TIMEOUT", self.wait_timeout),
            ("REDIS_TIMEOUT", self.redis_timeout),
            ("POLL_INTERVAL", self.poll_interval),
            ("STALE_WHILE_REVALIDATE", self.stale_while_revalidate),
            ("MAX_STALE", self.max_stale),
            ("L1_TTL", self.l1_ttl),
            ("FAILURE_TTL", self.failure_ttl),
        ] {
            at_most_a_year(name, d)?;
        }
        if let Some(load_timeout) = self.load_timeout {
            at_most_a_year("LOAD_TIMEOUT", load_timeout)?;
        }
        anyhow::ensure!(self.max_entry_bytes > 0, "MAX_ENTRY_BYTES must be positive");
        anyhow::ensure!(
            self.max_entry_bytes <= MAX_ENTRY_BYTES_LIMIT,
            "MAX_ENTRY_BYTES must be at most {MAX_ENTRY_BYTES_LIMIT} (Redis's largest value)"
        );
        Ok(())
    }

    /// LOAD_TIMEOUT, or DB_STATEMENT_TIMEOUT plus a margin: the server's
    /// bound should end a slow query first, the client's a dead connection.
    pub fn load_timeout(&self, database: &DatabaseSettings) -> Duration {
        self.load_timeout
            .unwrap_or(database.db_statement_timeout + LOAD_TIMEOUT_MARGIN)
    }
}

impl ServeArgs {
    /// LOAD_TIMEOUT as resolved (see [`CacheSettings::load_timeout`]).
    pub fn load_timeout(&self) -> Duration {
        self.cache.load_timeout(&self.database)
    }

    /// Checks the relations between settings that clap cannot express.
    pub fn validate(&self) -> anyhow::Result<()> {
        let c = &self.cache;
        self.database.validate()?;
        c.validate()?;
        for (name, d) in [
            ("REQUEST_TIMEOUT", self.request_timeout),
            ("HEADER_READ_TIMEOUT", self.header_read_timeout),
            ("IDLE_TIMEOUT", self.idle_timeout),
            ("CHANGE_RETENTION", self.change_retention),
        ] {
            at_most_a_year(name, d)?;
        }
        anyhow::ensure!(
            self.max_in_flight <= MAX_COUNT,
            "MAX_IN_FLIGHT must be at most {MAX_COUNT}"
        );
        anyhow::ensure!(
            self.max_connections <= MAX_COUNT,
            "MAX_CONNECTIONS must be at most {MAX_COUNT}"
        );
        anyhow::ensure!(!c.cache_ttl.is_zero(), "CACHE_TTL must be positive");
        anyhow::ensure!(!c.negative_ttl.is_zero(), "NEGATIVE_TTL must be positive");
        anyhow::ensure!(!c.lock_ttl.is_zero(), "LOCK_TTL must be positive");
        anyhow::ensure!(!c.wait_timeout.is_zero(), "WAIT_TIMEOUT must be positive");
        anyhow::ensure!(
            !self.load_timeout().is_zero(),
            "LOAD_TIMEOUT must be positive"
        );
        anyhow::ensure!(!c.redis_timeout.is_zero(), "REDIS_TIMEOUT must be positive");
        anyhow::ensure!(!c.poll_interval.is_zero(), "POLL_INTERVAL must be positive");
        anyhow::ensure!(self.max_in_flight > 0, "MAX_IN_FLIGHT must be positive");
        anyhow::ensure!(
            !self.request_timeout.is_zero(),
            "REQUEST_TIMEOUT must be positive"
        );
        anyhow::ensure!(
            !self.header_read_timeout.is_zero(),
            "HEADER_READ_TIMEOUT must be positive"
        );
        anyhow::ensure!(
            !self.idle_timeout.is_zero(),
            "IDLE_TIMEOUT must be positive"
        );
        anyhow::ensure!(self.max_connections > 0, "MAX_CONNECTIONS must be positive");
        anyhow::ensure!(
            !self.change_retention.is_zero(),
            "CHANGE_RETENTION must be positive"
        );
        // A leader's lock must outlive its query: the watchdog extends the
        // lock of a live leader only, so a leader that dies mid-query would
        // otherwise let a second leader load while the first query still runs.
        anyhow::ensure!(
            self.database.db_statement_timeout < c.lock_ttl,
            "DB_STATEMENT_TIMEOUT ({}) must be below LOCK_TTL ({})",
            humantime::format_duration(self.database.db_statement_timeout),
            humantime::format_duration(c.lock_ttl)
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_written_as_in_the_contract() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn jitter_outside_zero_to_one_is_refused() {
        assert_eq!(parse_jitter("0.1"), Ok(0.1));
        assert!(parse_jitter("1").is_err());
        assert!(parse_jitter("-0.1").is_err());
    }

    #[test]
    fn defaults_match_the_contract() {
        let cli = Cli::try_parse_from(["postcache", "serve"]).expect("defaults parse");
        let Command::Serve(s) = cli.command else {
            panic!("serve expected")
        };
        assert_eq!(s.listen_addr.to_string(), "127.0.0.1:8080");
        assert_eq!(s.cache.cache_ttl, Duration::from_secs(60));
        assert_eq!(s.cache.lock_ttl, Duration::from_secs(5));
        assert_eq!(s.cache.wait_timeout, Duration::from_secs(3));
        assert_eq!(s.load_timeout(), Duration::from_millis(2_500));
        assert_eq!(s.cache.negative_ttl, Duration::from_secs(10));
        assert_eq!(s.cache.cache_strategy, Strategy::Pubsub);
        assert_eq!(s.cache.stale_while_revalidate, Duration::ZERO);
        assert_eq!(s.cache.max_stale, Duration::from_secs(3600));
        assert_eq!(s.cache.failure_ttl, Duration::from_secs(2));
        assert_eq!(s.header_read_timeout, Duration::from_secs(10));
        assert_eq!(s.idle_timeout, Duration::from_secs(60));
        assert_eq!(s.max_connections, 10_000);
        assert_eq!(s.change_feed, ChangeFeed::Auto);
        assert_eq!(s.change_retention, Duration::from_secs(3600));
        s.validate().expect("defaults are consistent");
    }

    #[test]
    fn change_feed_modes_parse_and_on_is_the_trigger_mode() {
        let mode = |value: &str| {
            let cli = Cli::try_parse_from(["postcache", "serve", "--change-feed", value]);
            cli.map(|cli| match cli.command {
                Command::Serve(s) => s.change_feed,
                _ => unreachable!(),
            })
        };
        assert_eq!(mode("replication").unwrap(), ChangeFeed::Replication);
        assert_eq!(mode("trigger").unwrap(), ChangeFeed::Trigger);
        assert_eq!(mode("on").unwrap(), ChangeFeed::Trigger);
        assert_eq!(mode("off").unwrap(), ChangeFeed::Off);
        assert_eq!(mode("auto").unwrap(), ChangeFeed::Auto);
        assert!(mode("sometimes").is_err());
    }

    #[test]
    fn settings_that_would_overflow_or_break_the_hash_tags_are_refused() {
        let refusal = |flags: &[&str]| {
            let argv = ["postcache", "serve"].iter().chain(flags);
            let Command::Serve(s) = Cli::try_parse_from(argv).expect("parses").command else {
                panic!("serve expected")
            };
            s.validate().map(|_| ()).map_err(|e| e.to_string())
        };
        for (flags, named) in [
            (&["--cache-ttl", "1000000000h"][..], "CACHE_TTL"),
            (&["--wait-timeout", "400days"], "WAIT_TIMEOUT"),
            (&["--max-stale", "2years"], "MAX_STALE"),
            (&["--load-timeout", "1000days"], "LOAD_TIMEOUT"),
            (&["--db-acquire-timeout", "1000days"], "DB_ACQUIRE_TIMEOUT"),
            (&["--change-retention", "1000days"], "CHANGE_RETENTION"),
            (&["--key-prefix", "app{1}:"], "KEY_PREFIX"),
            (&["--key-prefix", "}"], "KEY_PREFIX"),
            (
                &["--max-connections", "18446744073709551615"],
                "MAX_CONNECTIONS",
            ),
            (&["--max-in-flight", "100000000"], "MAX_IN_FLIGHT"),
            (&["--db-max-connections", "0"], "DB_MAX_CONNECTIONS"),
            (&["--max-entry-bytes", "0"], "MAX_ENTRY_BYTES"),
            (&["--max-entry-bytes", "1000000000"], "MAX_ENTRY_BYTES"),
        ] {
            let error = refusal(flags).expect_err(named);
            assert!(error.contains(named), "{flags:?}: {error}");
        }
        assert_eq!(
            refusal(&["--cache-ttl", "365days", "--key-prefix", "app:1:"]),
            Ok(())
        );
        for jitter in ["1.5", "NaN", "inf", "-0.5"] {
            assert!(
                Cli::try_parse_from(["postcache", "serve", "--ttl-jitter", jitter]).is_err(),
                "{jitter}"
            );
        }
    }

    #[test]
    fn invalidate_takes_ids_or_all_but_not_both() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(["postcache", "invalidate"].iter().chain(args)).map(|cli| {
                let Command::Invalidate(a) = cli.command else {
                    panic!("invalidate expected")
                };
                (a.ids, a.all)
            })
        };
        assert_eq!(parse(&["3", "7"]).unwrap(), (vec![3, 7], false));
        assert_eq!(parse(&["--all"]).unwrap(), (vec![], true));
        assert!(parse(&[]).is_err(), "nothing to invalidate");
        assert!(parse(&["3", "--all"]).is_err());
        assert!(parse(&["0"]).is_err());
        assert!(parse(&["x"]).is_err());
    }

    #[test]
    fn a_statement_timeout_not_below_the_lock_ttl_is_refused() {
        let parse = |statement: &str, lock: &str| {
            let cli = Cli::try_parse_from([
                "postcache",
                "serve",
                "--db-statement-timeout",
                statement,
                "--lock-ttl",
                lock,
            ])
            .expect("parses");
            let Command::Serve(s) = cli.command else {
                panic!("serve expected")
            };
            s.validate()
        };
        assert!(parse("4s", "5s").is_ok());
        let error = parse("5s", "5s").unwrap_err().to_string();
        assert!(
            error.contains("DB_STATEMENT_TIMEOUT (5s) must be below LOCK_TTL (5s)"),
            "{error}"
        );
        assert!(parse("10s", "5s").is_err());
    }
}
