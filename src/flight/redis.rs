//! The Redis commands of the read path, each bounded by REDIS_TIMEOUT and
//! guarded by the circuit breaker.

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use fred::{
    error::ErrorKind,
    prelude::*,
    types::{scripts::Script, Expiration, SetOptions},
};

use super::breaker::Breaker;
use crate::{
    cache::{DecodeError, Entry},
    telemetry::metrics,
};

/// The leader's finish, in one round trip.
///
/// On success: store the entry (unless its TTL is 0) and, for a found entry,
/// its fail-safe copy; on failure: store as backoff marker, for FAILURE_TTL,
/// the last good copy (the value itself if it is a found entry, else the
/// fail-safe copy) with its BACKOFF flag set, or else the failed entry.
/// Then publish what was stored on the ready channel, and release the lock
/// only if it still holds this leader's token: a leader whose lock expired and
/// was taken over must not delete the new leader's lock.
///
/// KEYS[1] value, KEYS[2] lock, KEYS[3] fail-safe copy.
/// ARGV[1] entry, ARGV[2] value TTL ms (0: do not store), ARGV[3] token,
/// ARGV[4] channel, ARGV[5] fail-safe copy TTL ms (0: none), ARGV[6] FAILURE_TTL ms,
/// ARGV[7] the publish command: PUBLISH, or SPUBLISH on a Redis Cluster (the
/// channel shares the keys' hash tag, so it lives on the same shard).
/// Returns {receivers, released, published payload}.
///
/// Envelope offsets used here (see `cache/entry.rs`): byte 2 is the status
/// (0 found, 2 failed), byte 3 the flags (1 = BACKOFF).
const FINISH_LUA: &str = r#"
local entry = ARGV[1]
local payload = entry
if string.byte(entry, 2) == 2 then
  local copy = redis.call('GET', KEYS[1])
  if not copy or string.byte(copy, 2) ~= 0 then
    copy = redis.call('GET', KEYS[3])
  end
  if copy and string.byte(copy, 1) == 1 and string.byte(copy, 2) == 0 then
    payload = string.sub(copy, 1, 2) .. '\1' .. string.sub(copy, 4)
  end
  if tonumber(ARGV[6]) > 0 then
    redis.call('SET', KEYS[1], payload, 'PX', ARGV[6])
  end
else
  if tonumber(ARGV[2]) > 0 then
    redis.call('SET', KEYS[1], entry, 'PX', ARGV[2])
  end
  if tonumber(ARGV[5]) > 0 and string.byte(entry, 2) == 0 then
    redis.call('SET', KEYS[3], entry, 'PX', ARGV[5])
  end
end
local receivers = redis.call(ARGV[7], ARGV[4], payload)
local released = 0
if redis.call('GET', KEYS[2]) == ARGV[3] then
  redis.call('DEL', KEYS[2])
  released = 1
end
return {receivers, released, payload}
"#;

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

/// What a GET of a value key found.
#[derive(Debug)]
pub enum Lookup {
    Entry(Entry),
    Absent,
    /// Bytes that are not an entry: treated as a miss and overwritten.
    Garbage(DecodeError),
}

/// What the leader's finish did.
#[derive(Debug)]
pub struct Finished {
    /// Whether the lock still held our token (and was deleted).
    pub released: bool,
    /// What was published: the entry, or on failure the backoff copy.
    pub published: Entry,
}

/// Lifetimes the finish script stores with.
#[derive(Debug, Clone, Copy)]
pub struct StoreFor {
    /// The value key (0: do not store).
    pub value: Duration,
    /// The fail-safe copy (0: none).
    pub fail_safe: Duration,
    /// The backoff marker after a failure (0: none).
    pub failure: Duration,
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

/// Whether a fred error says Redis is unreachable (as opposed to an error
/// reply, which proves Redis is up).
fn is_outage(e: &fred::error::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::IO
            | ErrorKind::Timeout
            | ErrorKind::Canceled
            | ErrorKind::Backpressure
            | ErrorKind::Tls
            | ErrorKind::Routing
            | ErrorKind::Cluster
    )
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
            finish: Script::from_lua(FINISH_LUA),
            release: Script::from_lua(RELEASE_LUA),
            extend: Script::from_lua(EXTEND_LUA),
        }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn breaker(&self) -> &Arc<Breaker> {
        &self.breaker
    }

    /// Runs one command under the breaker and REDIS_TIMEOUT.
    pub(crate) async fn bounded<T>(
        &self,
        fut: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        guarded(&self.breaker, self.timeout, fut).await
    }

    /// GET a value key and decode it.
    pub async fn lookup(&self, key: &str) -> Result<Lookup, RedisError> {
        let raw: Option<Bytes> = self.bounded(self.client.get(key)).await?;
        Ok(match raw {
            None => Lookup::Absent,
            Some(raw) => match Entry::decode(raw) {
                Ok(entry) => Lookup::Entry(entry),
                Err(e) => {
                    metrics::garbage("entry");
                    Lookup::Garbage(e)
                }
            },
        })
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

    /// PTTL of a key: `None` when it does not exist, `Some(None)` when it has no expiry.
    pub async fn pttl(&self, key: &str) -> Result<Option<Option<Duration>>, RedisError> {
        let ms: i64 = self.bounded(self.client.pttl(key)).await?;
        Ok(match ms {
            -2 => None,
            ms if ms < 0 => Some(None),
            ms => Some(Some(Duration::from_millis(ms as u64))),
        })
    }

    /// The leader's finish (see [`FINISH_LUA`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn finish(
        &self,
        value_key: &str,
        lock_key: &str,
        fail_safe_key: &str,
        channel: &str,
        token: &str,
        entry: &Entry,
        store: StoreFor,
    ) -> Result<Finished, RedisError> {
        let args: Vec<Value> = vec![
            Value::Bytes(entry.raw().clone()),
            Value::Integer(ms(store.value)),
            Value::from(token),
            Value::from(channel),
            Value::Integer(ms(store.fail_safe)),
            Value::Integer(ms(store.failure)),
            Value::from(if self.sharded { "SPUBLISH" } else { "PUBLISH" }),
        ];
        let (_receivers, released, payload): (i64, i64, Bytes) = self
            .bounded(self.finish.evalsha_with_reload(
                &self.client,
                vec![value_key, lock_key, fail_safe_key],
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
            .bounded(
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
            .bounded(self.extend.evalsha_with_reload(
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
    if !breaker.allow() {
        metrics::redis_error("circuit_open");
        return Err(RedisError::CircuitOpen);
    }
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(value)) => {
            breaker.record_success();
            Ok(value)
        }
        Ok(Err(e)) => {
            if is_outage(&e) {
                breaker.record_failure();
                metrics::redis_error("connection");
            } else {
                // An error reply: Redis is up.
                breaker.record_success();
                metrics::redis_error("reply");
            }
            Err(e.into())
        }
        Err(_) => {
            breaker.record_failure();
            metrics::redis_error("timeout");
            Err(RedisError::Timeout(timeout))
        }
    }
}
