//! The Redis commands of the read path, each bounded by REDIS_TIMEOUT and
//! guarded by the circuit breaker.

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use fred::{
    error::ErrorKind,
    prelude::*,
    types::{scripts::Script, Expiration, SetOptions},
};

use super::{breaker::Breaker, freshness::StoreFor};
use crate::{
    cache::{entry, now_millis, Entry, ItemKeys},
    telemetry::metrics,
};

/// The leader's finish, in one round trip, fenced by the lock.
///
/// Fencing: the finish writes only while the lock still holds this leader's
/// token, or when the lock is gone and nothing newer is stored. A leader
/// whose lock expired or was lost and taken over must not store its older
/// row (or its failure) over the new leader's value: it publishes what is
/// stored instead (or nothing, when nothing is).
///
/// On success: store the entry (unless its TTL is 0) and, for a found entry,
/// its fail-safe copy; a not-found entry deletes the fail-safe copy, so that
/// a deleted item never comes back from it. On failure: an entry still
/// fresh is left as it is (a failed refresh never degrades it); otherwise
/// store as the backoff, for FAILURE_TTL, the last good copy (the value if it
/// is a found entry, else the fail-safe copy, unless a not-found is stored)
/// with its BACKOFF flag set, or else the failure marker. Then publish what
/// is stored on the ready channel, and release the lock if it is ours.
///
/// Which TTLs is decided in Rust (`freshness::store_for`); which copy, here,
/// because only Redis knows what is stored at the moment of the finish.
///
/// KEYS[1] value, KEYS[2] lock, KEYS[3] fail-safe copy.
/// ARGV[1] entry, ARGV[2] value TTL ms (0: do not store), ARGV[3] token,
/// ARGV[4] channel, ARGV[5] fail-safe copy TTL ms (0: none), ARGV[6] FAILURE_TTL ms,
/// ARGV[7] the publish command: PUBLISH, or SPUBLISH on a Redis Cluster (the
/// channel shares the keys' hash tag, so it lives on the same shard),
/// ARGV[8] now, unix ms.
/// Returns {released, payload}: what was published, or the entry itself.
///
/// The `$…` placeholders are the envelope's layout, filled in from the
/// constants of `cache/entry.rs` by [`finish_lua`] (Lua strings count from 1).
const FINISH_LUA: &str = include_str!("finish.lua");

/// [`FINISH_LUA`] with the envelope's layout filled in.
fn finish_lua() -> String {
    // Lua's string.byte counts from 1.
    let at = |offset: usize| (offset + 1).to_string();
    FINISH_LUA
        .replace("$VERSION_AT", &at(0))
        .replace("$VERSION", &entry::VERSION.to_string())
        .replace("$HEADER", &entry::HEADER_LEN.to_string())
        .replace("$STATUS", &at(entry::STATUS_AT))
        .replace("$FLAGS", &at(entry::FLAGS_AT))
        .replace("$STORED_AT", &at(entry::STORED_AT))
        .replace("$FRESH_UNTIL", &at(entry::FRESH_UNTIL_AT))
        .replace("$FOUND", &entry::STATUS_FOUND.to_string())
        .replace("$NOT_FOUND", &entry::STATUS_NOT_FOUND.to_string())
        .replace("$FAILED", &entry::STATUS_FAILED.to_string())
        .replace("$BACKOFF", &entry::FLAG_BACKOFF.to_string())
}

/// Releases a lock only if it still holds the given token.
/// KEYS[1] lock; ARGV[1] token. Returns 1 when released.
const RELEASE_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

/// Extends a lock only if it still holds the given token (the watchdog).
/// KEYS[1] lock; ARGV[1] token, ARGV[2] TTL ms. Returns 1 when extended.
const EXTEND_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#;

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

/// The command client plus the bound applied to each command.
#[derive(Clone)]
pub struct RedisCommands {
    client: Client,
    timeout: Duration,
    /// A Redis Cluster: publish with SPUBLISH (sharded pub/sub).
    sharded: bool,
    breaker: Arc<Breaker>,
    finish: Script,
    release: Script,
    extend: Script,
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

impl RedisCommands {
    pub fn new(client: Client, timeout: Duration) -> Self {
        Self::with_breaker(client, timeout, Arc::default())
    }

    pub fn with_breaker(client: Client, timeout: Duration, breaker: Arc<Breaker>) -> Self {
        Self {
            sharded: client.is_clustered(),
            client,
            timeout,
            breaker,
            finish: Script::from_lua(finish_lua()),
            release: Script::from_lua(RELEASE_LUA),
            extend: Script::from_lua(EXTEND_LUA),
        }
    }

    /// Whether the circuit breaker lets commands through.
    pub fn breaker_closed(&self) -> bool {
        self.breaker.state() == super::breaker::State::Closed
    }

    /// Runs one command under the breaker and REDIS_TIMEOUT.
    async fn bounded<T>(
        &self,
        fut: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        guarded(&self.breaker, self.timeout, fut).await
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
                metrics::redis_error(if is_outage(&e) { "connection" } else { "reply" });
                Err(e.into())
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
        let raw: Option<Bytes> = self.bounded(self.client.get(key)).await?;
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
        self.bounded(
            self.client
                .set::<(), _, _>(key, entry.raw().clone(), Some(px), None, false),
        )
        .await
    }

    /// `SET lock token NX PX ttl`: true when this caller now holds the lock.
    pub async fn try_lock(
        &self,
        key: &str,
        token: &str,
        ttl: Duration,
    ) -> Result<bool, RedisError> {
        let px = Expiration::PX(ms(ttl).max(1));
        let reply: Option<String> = self
            .bounded(
                self.client
                    .set(key, token, Some(px), Some(SetOptions::NX), false),
            )
            .await?;
        metrics::lock_election(reply.is_some());
        Ok(reply.is_some())
    }

    /// PTTL of a lock.
    pub async fn pttl(&self, key: &str) -> Result<LockTtl, RedisError> {
        let ms: i64 = self.bounded(self.client.pttl(key)).await?;
        Ok(match ms {
            -2 => LockTtl::Absent,
            ms if ms < 0 => LockTtl::NoExpiry,
            ms => LockTtl::Expires(Duration::from_millis(ms as u64)),
        })
    }

    /// The leader's finish (see [`FINISH_LUA`]).
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
            .unrefused(self.finish.evalsha_with_reload(
                &self.client,
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
            .unrefused(
                self.release
                    .evalsha_with_reload(&self.client, vec![lock_key], vec![token]),
            )
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
            .unrefused(self.extend.evalsha_with_reload(
                &self.client,
                vec![lock_key],
                vec![Value::from(token), Value::Integer(ms(ttl).max(1))],
            ))
            .await?;
        Ok(extended == 1)
    }

    /// PING, for readiness (bypasses the breaker: readiness must see the truth).
    pub async fn ping(&self) -> Result<(), RedisError> {
        match tokio::time::timeout(self.timeout, self.client.ping::<()>(None)).await {
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
                metrics::redis_error("connection");
            } else {
                // An error reply: Redis is up.
                permit.succeeded();
                metrics::redis_error("reply");
            }
            Err(e.into())
        }
        Err(_) => {
            permit.failed();
            metrics::redis_error("timeout");
            Err(RedisError::Timeout(timeout))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every placeholder of the finish script is filled from `cache/entry.rs`.
    #[test]
    fn the_finish_script_reads_the_envelope_layout_from_its_constants() {
        let lua = finish_lua();
        assert!(!lua.contains('$'), "{lua}");
        let status_byte = format!("string.byte(s, {})", entry::STATUS_AT + 1);
        assert!(lua.contains(&status_byte), "{lua}");
        assert!(lua.contains(&format!("== {}", entry::VERSION)));
    }
}
