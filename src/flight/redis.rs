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
    cache::{entry, Entry, ItemKeys},
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
/// Which TTLs is decided in Rust (`freshness::store_for`); which copy, here,
/// because only Redis knows what is stored at the moment of the finish.
///
/// KEYS[1] value, KEYS[2] lock, KEYS[3] fail-safe copy.
/// ARGV[1] entry, ARGV[2] value TTL ms (0: do not store), ARGV[3] token,
/// ARGV[4] channel, ARGV[5] fail-safe copy TTL ms (0: none), ARGV[6] FAILURE_TTL ms,
/// ARGV[7] the publish command: PUBLISH, or SPUBLISH on a Redis Cluster (the
/// channel shares the keys' hash tag, so it lives on the same shard).
/// Returns {released, published payload}.
///
/// The `$…` placeholders are the envelope's layout, filled in from the
/// constants of `cache/entry.rs` by [`finish_lua`] (Lua strings count from 1).
const FINISH_LUA: &str = r#"
local entry = ARGV[1]
local payload = entry
if string.byte(entry, $STATUS) == $FAILED then
  local copy = redis.call('GET', KEYS[1])
  if not copy or string.byte(copy, $STATUS) ~= $FOUND then
    copy = redis.call('GET', KEYS[3])
  end
  if copy and string.byte(copy, $VERSION_AT) == $VERSION and string.byte(copy, $STATUS) == $FOUND then
    payload = string.sub(copy, 1, $FLAGS - 1) .. string.char(bit.bor(string.byte(copy, $FLAGS), $BACKOFF)) .. string.sub(copy, $FLAGS + 1)
  end
  if tonumber(ARGV[6]) > 0 then
    redis.call('SET', KEYS[1], payload, 'PX', ARGV[6])
  end
else
  if tonumber(ARGV[2]) > 0 then
    redis.call('SET', KEYS[1], entry, 'PX', ARGV[2])
  end
  if tonumber(ARGV[5]) > 0 and string.byte(entry, $STATUS) == $FOUND then
    redis.call('SET', KEYS[3], entry, 'PX', ARGV[5])
  end
end
redis.call(ARGV[7], ARGV[4], payload)
local released = 0
if redis.call('GET', KEYS[2]) == ARGV[3] then
  redis.call('DEL', KEYS[2])
  released = 1
end
return {released, payload}
"#;

/// [`FINISH_LUA`] with the envelope's layout filled in.
fn finish_lua() -> String {
    // Lua's string.byte counts from 1.
    let at = |offset: usize| (offset + 1).to_string();
    FINISH_LUA
        .replace("$VERSION_AT", &at(0))
        .replace("$VERSION", &entry::VERSION.to_string())
        .replace("$STATUS", &at(entry::STATUS_AT))
        .replace("$FLAGS", &at(entry::FLAGS_AT))
        .replace("$FOUND", &entry::STATUS_FOUND.to_string())
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
            finish: Script::from_lua(finish_lua()),
            release: Script::from_lua(RELEASE_LUA),
            extend: Script::from_lua(EXTEND_LUA),
        }
    }

    /// Runs one command under the breaker and REDIS_TIMEOUT.
    async fn bounded<T>(
        &self,
        fut: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        guarded(&self.breaker, self.timeout, fut).await
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
        ];
        let (released, payload): (i64, Bytes) = self
            .bounded(self.finish.evalsha_with_reload(
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every placeholder of the finish script is filled from `cache/entry.rs`.
    #[test]
    fn the_finish_script_reads_the_envelope_layout_from_its_constants() {
        let lua = finish_lua();
        assert!(!lua.contains('$'), "{lua}");
        let status_byte = format!("string.byte(entry, {})", entry::STATUS_AT + 1);
        assert!(lua.contains(&status_byte), "{lua}");
        assert!(lua.contains(&format!("== {}", entry::VERSION)));
    }
}
