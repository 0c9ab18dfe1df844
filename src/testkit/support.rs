//! Test support: what every other part of the testkit uses. Bounded
//! waits, the addresses of the tests' PostgreSQL and Redis, free ports,
//! tracing, and settings for tests that hold a load back.

use std::{
    net::TcpListener,
    process::Child,
    sync::Once,
    time::{Duration, Instant},
};

/// Settings for tests that hold a load back: generous bounds, so only the
/// behaviour under test decides the outcome.
pub const PATIENT: &[&str] = &[
    "--redis-timeout",
    "2s",
    "--wait-timeout",
    "20s",
    "--lock-ttl",
    "25s",
    "--db-statement-timeout",
    "20s",
];

/// Flags of an instance that follows the change feed in replication mode,
/// with lifetimes far past any test's bounds: a change lost would be served
/// for ten minutes, not expire within the test.
pub const REPLICATION_LONG_LIVED: [&str; 6] = [
    "--change-feed",
    "replication",
    "--cache-ttl",
    "600s",
    "--l1-ttl",
    "600s",
];

/// The number given after flag `name` on this program's command line, or
/// `default` (for the examples' few settings).
pub fn numeric_arg(name: &str, default: u64) -> u64 {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .map_or(default, |v| v.parse().expect("a number"))
}

/// The usual bound of a wait for something that takes milliseconds.
pub const A_WHILE: Duration = Duration::from_secs(30);

/// Waits until `done` holds, looking every 5 ms; fails the test, naming
/// `what`, once `within` has passed. No test waits without a bound.
pub async fn wait_until(what: &str, within: Duration, done: impl AsyncFnMut() -> bool) {
    assert!(
        eventually(within, done).await,
        "timed out after {within:?} waiting for {what}"
    );
}

/// Whether `done` came to hold within `within` (looking every 5 ms).
pub async fn eventually(within: Duration, mut done: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if done().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// For a test that needs a tool or a setting this machine may lack: in CI
/// (`CI=true`) its absence fails the test; elsewhere the test is skipped
/// with a note. Returns whether to go on.
pub fn available(what: &str, present: bool) -> bool {
    if present {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{what} is required in CI"
    );
    eprintln!("{what} unavailable here: test skipped");
    false
}

/// The PostgreSQL server the tests use (override with TEST_DATABASE_URL).
pub fn server_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// The port of the PostgreSQL server the tests use.
pub fn postgres_port() -> u16 {
    server_url()
        .rsplit(':')
        .next()
        .and_then(|port| port.trim_end_matches('/').parse().ok())
        .expect("a port in TEST_DATABASE_URL")
}

/// The Redis server the tests use (override with TEST_REDIS_URL).
pub fn redis_url() -> String {
    std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

static TRACING: Once = Once::new();

/// Logs are silent unless TEST_LOG is set.
pub fn init_tracing() {
    crate::startup::install_tls_provider();
    TRACING.call_once(|| {
        if std::env::var_os("TEST_LOG").is_some() {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_env("TEST_LOG")
                        .unwrap_or_else(|_| "debug,sqlx=warn,fred=info".into()),
                )
                .with_test_writer()
                .init();
        }
    });
}

/// A local port with nothing listening on it (yet).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills a child process and reaps it.
pub(crate) fn kill(child: Option<Child>) {
    if let Some(mut child) = child {
        let _ = child.kill();
        let _ = child.wait();
    }
}
