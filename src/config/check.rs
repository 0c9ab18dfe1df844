//! Settings: what clap cannot express across settings. Each group's
//! `validate`, so that a bad setting, or settings that contradict each
//! other, are refused at start with their names.

use std::time::Duration;

use super::{
    parse::{MAX_COUNT, MAX_DURATION, MAX_ENTRY_BYTES_LIMIT},
    CacheSettings, DatabaseSettings, ServeArgs,
};

/// The longest TCP keepalive or user timeout (PostgreSQL's and the
/// kernel's integers hold it).
const MAX_TCP_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// The shortest REPLICATION_TIMEOUT: the decoder's status goes out every
/// 200 ms, and PostgreSQL must hear several within it.
const MIN_REPLICATION_TIMEOUT: Duration = Duration::from_secs(1);

/// The longest REDIS_REPLICA_WAIT: while a replica does not answer, the
/// decoder waits this long after each batch it applies.
const MAX_REDIS_REPLICA_WAIT: Duration = Duration::from_secs(5);

/// The longest SHUTDOWN_DELAY: a load balancer's notice takes seconds, and
/// an orchestrator's grace period is rarely more than minutes.
const MAX_SHUTDOWN_DELAY: Duration = Duration::from_secs(600);

/// LOAD_TIMEOUT's margin over DB_STATEMENT_TIMEOUT when it is not set.
const LOAD_TIMEOUT_MARGIN: Duration = Duration::from_millis(500);

/// LOAD_STATEMENTS unless set.
const DEFAULT_LOAD_STATEMENTS: usize = 2;

/// The largest LOAD_BATCH_MAX: one statement's array of ids stays small.
const MAX_LOAD_BATCH: usize = 10_000;

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
        at_most_a_year("DB_STATEMENT_TIMEOUT", self.db_statement_timeout)?;
        // PostgreSQL takes them as integers (seconds, milliseconds).
        anyhow::ensure!(
            self.db_tcp_keepalive <= MAX_TCP_TIMEOUT,
            "DB_TCP_KEEPALIVE must be at most {}",
            humantime::format_duration(MAX_TCP_TIMEOUT)
        );
        anyhow::ensure!(
            self.db_tcp_user_timeout <= MAX_TCP_TIMEOUT,
            "DB_TCP_USER_TIMEOUT must be at most {}",
            humantime::format_duration(MAX_TCP_TIMEOUT)
        );
        Ok(())
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
            ("MIN_LSN_WAIT", self.min_lsn_wait),
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
        for (name, d) in [
            ("REDIS_TCP_KEEPALIVE", self.redis_tcp_keepalive),
            ("REDIS_TCP_USER_TIMEOUT", self.redis_tcp_user_timeout),
        ] {
            anyhow::ensure!(
                d <= MAX_TCP_TIMEOUT,
                "{name} must be at most {}",
                humantime::format_duration(MAX_TCP_TIMEOUT)
            );
        }
        anyhow::ensure!(self.max_entry_bytes > 0, "MAX_ENTRY_BYTES must be positive");
        anyhow::ensure!(
            (1..=MAX_LOAD_BATCH).contains(&self.load_batch_max),
            "LOAD_BATCH_MAX must be between 1 and {MAX_LOAD_BATCH}"
        );
        anyhow::ensure!(
            self.load_statements != Some(0),
            "LOAD_STATEMENTS must be positive"
        );
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

    /// LOAD_STATEMENTS, or 2 (at most DB_MAX_CONNECTIONS): under a storm
    /// of misses, few statements of many keys cost PostgreSQL far less than
    /// many of few (measured by `load/compare cold-storm`), and two keep
    /// one slow statement from holding every load up.
    pub fn load_statements(&self, database: &DatabaseSettings) -> usize {
        self.load_statements
            .unwrap_or(DEFAULT_LOAD_STATEMENTS.min(database.db_max_connections as usize))
    }
}

impl ServeArgs {
    /// LOAD_TIMEOUT as resolved (see [`CacheSettings::load_timeout`]).
    pub fn load_timeout(&self) -> Duration {
        self.cache.load_timeout(&self.database)
    }

    /// How long a change's fence lives (as the read path's settings say).
    pub fn fence_ttl(&self) -> Duration {
        crate::read_path::fence_ttl(self.cache.lock_ttl, self.load_timeout())
    }

    /// Checks the relations between settings that clap cannot express, but
    /// for REPLICA_MAX_LAG against the change fences (`Application::build`
    /// checks it, with the store).
    pub fn validate(&self) -> anyhow::Result<()> {
        let c = &self.cache;
        self.database.validate()?;
        c.validate()?;
        for (name, d) in [
            ("REQUEST_TIMEOUT", self.request_timeout),
            ("HEADER_READ_TIMEOUT", self.header_read_timeout),
            ("IDLE_TIMEOUT", self.idle_timeout),
            ("CHANGE_RETENTION", self.change_retention),
            ("REPLICA_MAX_LAG", self.replica_max_lag),
            ("REPLICATION_TIMEOUT", self.replication_timeout),
        ] {
            at_most_a_year(name, d)?;
        }
        anyhow::ensure!(
            self.past_read_connections > 0,
            "PAST_READ_CONNECTIONS must be positive"
        );
        anyhow::ensure!(
            self.past_read_connections as usize <= MAX_COUNT,
            "PAST_READ_CONNECTIONS must be at most {MAX_COUNT}"
        );
        anyhow::ensure!(
            self.shutdown_delay <= MAX_SHUTDOWN_DELAY,
            "SHUTDOWN_DELAY ({}) must be at most {}: the process only waits out the load balancer's notice",
            humantime::format_duration(self.shutdown_delay),
            humantime::format_duration(MAX_SHUTDOWN_DELAY)
        );
        anyhow::ensure!(
            self.redis_replica_wait <= MAX_REDIS_REPLICA_WAIT,
            "REDIS_REPLICA_WAIT ({}) must be at most {}: the decoder waits this long after each batch while a replica does not answer",
            humantime::format_duration(self.redis_replica_wait),
            humantime::format_duration(MAX_REDIS_REPLICA_WAIT)
        );
        anyhow::ensure!(
            self.replication_timeout >= MIN_REPLICATION_TIMEOUT,
            "REPLICATION_TIMEOUT ({}) must be at least {}",
            humantime::format_duration(self.replication_timeout),
            humantime::format_duration(MIN_REPLICATION_TIMEOUT)
        );
        if !self.database_replica_urls.0.is_empty() {
            // REPLICA_MAX_LAG against the change fence's lifetime is not
            // checked here but by `Application::build`, with the store's
            // `check_replica_lag` (it depends on the store's probe).
            anyhow::ensure!(
                !matches!(self.change_feed, super::ChangeFeed::Trigger | super::ChangeFeed::Off),
                "DATABASE_REPLICA_URLS needs CHANGE_FEED=replication (or auto): only its fences say which change a replica must have replayed"
            );
        }
        if let Some(statements) = c.load_statements {
            anyhow::ensure!(
                statements <= self.database.db_max_connections as usize,
                "LOAD_STATEMENTS ({statements}) must be at most DB_MAX_CONNECTIONS ({})",
                self.database.db_max_connections
            );
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
