//! The Redis side: how a command fails, what a failure says of the server,
//! and the retries and the breaker around commands.

use std::{
    future::Future,
    time::{Duration, Instant},
};

use fred::error::ErrorKind;

use super::breaker::Breaker;
use crate::telemetry::metrics;

/// Why a Redis step failed; every such failure makes the read fail open.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("redis command timed out after {0:?}")]
    Timeout(Duration),
    #[error("redis circuit breaker open")]
    CircuitOpen,
    #[error("redis command failed: {0}")]
    Command(#[from] fred::error::Error),
    /// A script answered with something it never returns (a script of
    /// another version loaded under the same name, or a bug).
    #[error("the {0} script gave an unexpected reply")]
    Reply(&'static str),
    /// A batched read's task ended without answering (the runtime shutting
    /// down).
    #[error("a batched redis read was abandoned")]
    Abandoned,
}

/// The first pause before a step of upkeep (a finish, a release, a script
/// load) is retried; it doubles up to the second.
pub const RETRY_FIRST: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_millis(100);

/// Runs `attempt` until it succeeds or `give_up` has passed, pausing with
/// backoff in between; the last error if it never succeeded.
pub async fn with_backoff<T, F, Fut>(give_up: Instant, mut attempt: F) -> Result<T, RedisError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, RedisError>>,
{
    let mut backoff = RETRY_FIRST;
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(error) if Instant::now() >= give_up => return Err(error),
            Err(_) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RETRY_MAX);
            }
        }
    }
}

/// Whether a fred error says Redis cannot serve: unreachable, or an error
/// reply that means "not now" (loading, a read-only replica, a master down,
/// a busy script, a cluster down or mid-resharding). Other error replies
/// prove Redis up.
pub fn is_outage(e: &fred::error::Error) -> bool {
    if is_redirect(e) {
        return false;
    }
    /// Error reply prefixes of a Redis that is up but not serving.
    const NOT_SERVING: [&str; 6] = [
        "LOADING",
        "READONLY",
        "MASTERDOWN",
        "BUSY",
        "CLUSTERDOWN",
        "TRYAGAIN",
    ];
    let unreachable = matches!(
        e.kind(),
        ErrorKind::IO
            | ErrorKind::Timeout
            | ErrorKind::Canceled
            | ErrorKind::Backpressure
            | ErrorKind::Tls
            | ErrorKind::Routing
            | ErrorKind::Cluster
    );
    let details = e.details().trim_start();
    unreachable || NOT_SERVING.iter().any(|p| details.starts_with(p))
}

/// A MOVED or ASK reply: the key's slot is served by another node (a
/// resharding, a failover), which proves this node up.
fn is_redirect(e: &fred::error::Error) -> bool {
    is_moved(e) || e.details().trim_start().starts_with("ASK ")
}

pub fn is_moved(e: &fred::error::Error) -> bool {
    e.details().trim_start().starts_with("MOVED ")
}

/// The `kind` label of a failed command in the metrics.
pub fn error_label(e: &fred::error::Error) -> &'static str {
    match e.kind() {
        // The client's own bound (the same REDIS_TIMEOUT) fired first.
        ErrorKind::Timeout => "timeout",
        _ if is_outage(e) => "connection",
        _ => "reply",
    }
}

/// Runs `fut` if the breaker allows, bounded by `timeout`, and tells the
/// breaker how it went.
pub async fn guarded<T>(
    breaker: &Breaker,
    timeout: Duration,
    fut: impl Future<Output = Result<T, fred::error::Error>>,
) -> Result<T, RedisError> {
    let Some(permit) = breaker.permit() else {
        metrics::redis_error("circuit_open");
        return Err(RedisError::CircuitOpen);
    };
    let started = std::time::Instant::now();
    let answered = tokio::time::timeout(timeout, fut).await;
    metrics::redis_latency(started.elapsed());
    match answered {
        Ok(Ok(value)) => {
            permit.succeeded();
            Ok(value)
        }
        Ok(Err(e)) => {
            if is_outage(&e) {
                permit.failed();
            } else {
                // An error reply: Redis is up.
                permit.succeeded();
            }
            metrics::redis_error(error_label(&e));
            Err(e.into())
        }
        Err(_) => {
            permit.failed();
            metrics::redis_error("timeout");
            Err(RedisError::Timeout(timeout))
        }
    }
}
