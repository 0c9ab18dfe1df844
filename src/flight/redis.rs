//! The Redis commands of the read path, each bounded by REDIS_TIMEOUT and
//! guarded by the circuit breaker.

use std::{
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use fred::{
    error::ErrorKind,
    prelude::*,
    types::{Expiration, SetOptions},
};
use tokio_util::task::AbortOnDropHandle;

use super::{
    breaker::{Breaker, State},
    freshness::StoreFor,
    nodes::{self, Node, Nodes},
    scripts::Scripts,
};
use crate::{
    cache::{now_millis, Entry, ItemKeys},
    telemetry::metrics,
};

/// The first pause before a step of upkeep (a finish, a release, a script
/// load) is retried; it doubles up to the second.
pub(super) const RETRY_FIRST: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_millis(100);

/// Runs `attempt` until it succeeds or `give_up` has passed, pausing with
/// backoff in between; the last error if it never succeeded.
pub(super) async fn with_backoff<T, F, Fut>(
    give_up: Instant,
    mut attempt: F,
) -> Result<T, RedisError>
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

/// Why a Redis step failed; every such failure makes the read fail open.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("redis command timed out after {0:?}")]
    Timeout(Duration),
    #[error("redis circuit breaker open")]
    CircuitOpen,
    #[error("redis command failed: {0}")]
    Command(#[from] fred::error::Error),
}

/// What PTTL says of a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockTtl {
    /// No such key: released or expired.
    Absent,
    /// The key has no expiry (set from outside the protocol).
    NoExpiry,
    /// It expires after this long.
    Expires(Duration),
}

/// What the leader's finish did.
#[derive(Debug)]
pub struct Finished {
    /// Whether the lock still held our token (and was deleted).
    pub released: bool,
    /// What was published: the entry, or on failure the backoff copy.
    pub published: Entry,
}

/// The command clients plus the bound applied to each command.
#[derive(Clone)]
pub struct RedisCommands {
    /// Where each key's commands go (see `nodes.rs`).
    nodes: Arc<Nodes>,
    timeout: Duration,
    /// A Redis Cluster: publish with SPUBLISH (sharded pub/sub).
    sharded: bool,
    scripts: Scripts,
}

fn ms(d: Duration) -> i64 {
    if d.is_zero() {
        0
    } else {
        d.as_millis().max(1) as i64
    }
}

/// Whether a fred error says Redis cannot serve: unreachable, or an error
/// reply that means "not now" (loading, a read-only replica, a master down,
/// a busy script, a cluster down or mid-resharding). Other error replies
/// prove Redis up.
fn is_outage(e: &fred::error::Error) -> bool {
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

/// The `kind` label of a failed command in the metrics.
fn error_label(e: &fred::error::Error) -> &'static str {
    match e.kind() {
        // The client's own bound (the same REDIS_TIMEOUT) fired first.
        ErrorKind::Timeout => "timeout",
        _ if is_outage(e) => "connection",
        _ => "reply",
    }
}

impl RedisCommands {
    /// The commands of a single Redis.
    pub fn new(client: Client, timeout: Duration) -> Self {
        Self::with_nodes(Arc::new(Nodes::single(client)), timeout)
    }

    pub fn with_nodes(nodes: Arc<Nodes>, timeout: Duration) -> Self {
        Self {
            sharded: nodes.default_client().is_clustered(),
            nodes,
            timeout,
            scripts: Scripts::new(),
        }
    }

    /// Starts the connections' upkeep (see [`nodes::keep`]): the scripts
    /// loaded on every new connection and, on a cluster, the nodes following
    /// the topology while the returned handle lives.
    #[must_use = "dropping the handle stops following the cluster's topology"]
    pub fn upkeep(&self) -> Option<AbortOnDropHandle<()>> {
        nodes::keep(&self.nodes, self.scripts.clone(), self.timeout)
    }

    /// Whether every circuit breaker in use lets commands through.
    pub fn breaker_closed(&self) -> bool {
        self.nodes.state() == State::Closed
    }

    /// Puts the breakers' state in the metrics (before they are rendered).
    pub fn report_breakers(&self) {
        self.nodes.report();
    }

    /// Runs one command of `node`'s client under its breaker and
    /// REDIS_TIMEOUT.
    async fn bounded<T>(
        &self,
        node: &Node,
        fut: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        let result = guarded(&node.breaker, self.timeout, fut).await;
        self.notice(&result);
        result
    }

    /// Has the topology re-read when a node says a key is not its own.
    fn notice<T>(&self, result: &Result<T, RedisError>) {
        if let Err(RedisError::Command(e)) = result {
            if e.details().starts_with("MOVED") || e.details().starts_with("ASK") {
                self.nodes.moved();
            }
        }
    }

    /// Runs one command of lock hygiene (finish, release, extend) under
    /// REDIS_TIMEOUT but not the breaker: a leader must be able to finish and
    /// let go of its lock whatever other commands of this process met (in a
    /// cluster, another shard may be down).
    async fn unrefused<T>(
        &self,
        fut: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                metrics::redis_error(error_label(&e));
                let error = Err(e.into());
                self.notice(&error);
                error
            }
            Err(_) => {
                metrics::redis_error("timeout");
                Err(RedisError::Timeout(self.timeout))
            }
        }
    }

    /// GET a value key and decode it. Bytes that are not an entry count as
    /// absent: the next store overwrites them.
    pub async fn lookup(&self, key: &str) -> Result<Option<Entry>, RedisError> {
        let node = self.nodes.for_key(key);
        let raw: Option<Bytes> = self.bounded(&node, node.client.get(key)).await?;
        Ok(raw.and_then(|raw| match Entry::decode(raw) {
            Ok(entry) => Some(entry),
            Err(error) => {
                metrics::garbage("entry");
                tracing::warn!(%error, key, "undecodable cache entry, treated as a miss");
                None
            }
        }))
    }

    /// SET a value with a TTL (the strategies without a lock).
    pub async fn store(&self, key: &str, entry: &Entry, ttl: Duration) -> Result<(), RedisError> {
        let px = Expiration::PX(ms(ttl).max(1));
        let node = self.nodes.for_key(key);
        let set = node
            .client
            .set::<(), _, _>(key, entry.raw().clone(), Some(px), None, false);
        self.bounded(&node, set).await
    }

    /// `SET lock token NX PX ttl`: true when this caller now holds the lock.
    pub async fn try_lock(
        &self,
        key: &str,
        token: &str,
        ttl: Duration,
    ) -> Result<bool, RedisError> {
        let px = Expiration::PX(ms(ttl).max(1));
        let node = self.nodes.for_key(key);
        let set = node
            .client
            .set(key, token, Some(px), Some(SetOptions::NX), false);
        let reply: Option<String> = self.bounded(&node, set).await?;
        metrics::lock_election(reply.is_some());
        Ok(reply.is_some())
    }

    /// PTTL of a lock.
    pub async fn pttl(&self, key: &str) -> Result<LockTtl, RedisError> {
        let node = self.nodes.for_key(key);
        let ms: i64 = self.bounded(&node, node.client.pttl(key)).await?;
        Ok(match ms {
            -2 => LockTtl::Absent,
            ms if ms < 0 => LockTtl::NoExpiry,
            ms => LockTtl::Expires(Duration::from_millis(ms as u64)),
        })
    }

    /// The leader's finish (see `finish.lua` and `scripts.rs`).
    pub async fn finish(
        &self,
        keys: &ItemKeys,
        token: &str,
        entry: &Entry,
        store: StoreFor,
    ) -> Result<Finished, RedisError> {
        let args: Vec<Value> = vec![
            Value::Bytes(entry.raw().clone()),
            Value::Integer(ms(store.value)),
            Value::from(token),
            Value::from(keys.channel.as_str()),
            Value::Integer(ms(store.fail_safe)),
            Value::Integer(ms(store.failure)),
            Value::from(if self.sharded { "SPUBLISH" } else { "PUBLISH" }),
            Value::Integer(now_millis() as i64),
        ];
        let (released, payload): (i64, Bytes) = self
            .unrefused(self.scripts.finish.evalsha_with_reload(
                &self.nodes.for_key(&keys.value).client,
                vec![
                    keys.value.as_str(),
                    keys.lock.as_str(),
                    keys.fail_safe.as_str(),
                ],
                args,
            ))
            .await?;
        let published = Entry::decode(payload).unwrap_or_else(|_| entry.clone());
        Ok(Finished {
            released: released == 1,
            published,
        })
    }

    /// Releases a lock if it still holds `token`.
    pub async fn release(&self, lock_key: &str, token: &str) -> Result<bool, RedisError> {
        let released: i64 = self
            .unrefused(self.scripts.release.evalsha_with_reload(
                &self.nodes.for_key(lock_key).client,
                vec![lock_key],
                vec![token],
            ))
            .await?;
        Ok(released == 1)
    }

    /// Extends a lock to `ttl` if it still holds `token`.
    pub async fn extend(
        &self,
        lock_key: &str,
        token: &str,
        ttl: Duration,
    ) -> Result<bool, RedisError> {
        let extended: i64 = self
            .unrefused(self.scripts.extend.evalsha_with_reload(
                &self.nodes.for_key(lock_key).client,
                vec![lock_key],
                vec![Value::from(token), Value::Integer(ms(ttl).max(1))],
            ))
            .await?;
        Ok(extended == 1)
    }

    /// PING, for readiness (bypasses the breaker: readiness must see the truth).
    pub async fn ping(&self) -> Result<(), RedisError> {
        let ping = self.nodes.default_client().ping::<()>(None);
        match tokio::time::timeout(self.timeout, ping).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(RedisError::Timeout(self.timeout)),
        }
    }
}

/// Runs `fut` if the breaker allows, bounded by `timeout`, and tells the
/// breaker how it went.
pub(crate) async fn guarded<T>(
    breaker: &Breaker,
    timeout: Duration,
    fut: impl Future<Output = Result<T, fred::error::Error>>,
) -> Result<T, RedisError> {
    let Some(permit) = breaker.permit() else {
        metrics::redis_error("circuit_open");
        return Err(RedisError::CircuitOpen);
    };
    match tokio::time::timeout(timeout, fut).await {
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
