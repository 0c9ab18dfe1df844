//! The Redis commands of the read path, each bounded by REDIS_TIMEOUT.

use std::{future::Future, time::Duration};

use bytes::Bytes;
use fred::{
    prelude::*,
    types::{scripts::Script, Expiration, SetOptions},
};

use crate::cache::{DecodeError, Entry};

/// The leader's finish, in one round trip: store the entry (unless its TTL is
/// 0), publish it on the ready channel, and release the lock only if it still
/// holds this leader's token. A leader whose lock expired and was taken over
/// must not delete the new leader's lock, hence the compare-and-delete.
///
/// KEYS[1] value, KEYS[2] lock; ARGV[1] entry, ARGV[2] TTL in ms (0: do not
/// store), ARGV[3] token, ARGV[4] channel. Returns {receivers, released}.
const FINISH_LUA: &str = r#"
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
local receivers = redis.call('PUBLISH', ARGV[4], ARGV[1])
local released = 0
if redis.call('GET', KEYS[2]) == ARGV[3] then
  redis.call('DEL', KEYS[2])
  released = 1
end
return {receivers, released}
"#;

/// Releases a lock only if it still holds the given token.
///
/// KEYS[1] lock; ARGV[1] token. Returns 1 when released.
const RELEASE_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

/// Why a Redis step failed; every such failure makes the read fail open.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("redis command timed out after {0:?}")]
    Timeout(Duration),
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

impl Lookup {
    /// The entry, if one decoded.
    pub fn entry(self) -> Option<Entry> {
        match self {
            Lookup::Entry(e) => Some(e),
            Lookup::Absent | Lookup::Garbage(_) => None,
        }
    }
}

/// The command client plus the bound applied to each command.
#[derive(Clone)]
pub struct RedisCommands {
    client: Client,
    timeout: Duration,
    finish: Script,
    release: Script,
}

impl RedisCommands {
    pub fn new(client: Client, timeout: Duration) -> Self {
        Self {
            client,
            timeout,
            finish: Script::from_lua(FINISH_LUA),
            release: Script::from_lua(RELEASE_LUA),
        }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    async fn bounded<T>(
        &self,
        fut: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(RedisError::Timeout(self.timeout)),
        }
    }

    /// GET a value key and decode it.
    pub async fn lookup(&self, key: &str) -> Result<Lookup, RedisError> {
        let raw: Option<Bytes> = self.bounded(self.client.get(key)).await?;
        Ok(match raw {
            None => Lookup::Absent,
            Some(raw) => match Entry::decode(raw) {
                Ok(entry) => Lookup::Entry(entry),
                Err(e) => Lookup::Garbage(e),
            },
        })
    }

    /// SET a value with a TTL (the strategies without a lock).
    pub async fn store(&self, key: &str, entry: &Entry, ttl: Duration) -> Result<(), RedisError> {
        let px = Expiration::PX(ttl.as_millis().max(1) as i64);
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
        let px = Expiration::PX(ttl.as_millis().max(1) as i64);
        let reply: Option<String> = self
            .bounded(
                self.client
                    .set(key, token, Some(px), Some(SetOptions::NX), false),
            )
            .await?;
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

    /// The leader's finish (see [`FINISH_LUA`]); returns whether the lock was still ours.
    pub async fn finish(
        &self,
        value_key: &str,
        lock_key: &str,
        channel: &str,
        token: &str,
        entry: &Entry,
        store_for: Option<Duration>,
    ) -> Result<bool, RedisError> {
        let ttl_ms = store_for.map_or(0, |ttl| ttl.as_millis().max(1) as i64);
        let args: Vec<Value> = vec![
            Value::Bytes(entry.raw().clone()),
            Value::Integer(ttl_ms),
            Value::from(token),
            Value::from(channel),
        ];
        let (_receivers, released): (i64, i64) = self
            .bounded(
                self.finish
                    .evalsha_with_reload(&self.client, vec![value_key, lock_key], args),
            )
            .await?;
        Ok(released == 1)
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

    /// PING, for readiness.
    pub async fn ping(&self) -> Result<(), RedisError> {
        self.bounded(self.client.ping::<()>(None)).await
    }
}
