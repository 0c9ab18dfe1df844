//! The Redis side: what Redis holds for one item, read at once (`postcache
//! inspect`).

use bytes::Bytes;
use fred::prelude::*;

use super::{commands::BreakerRule, RedisCommands, RedisError};
use crate::cache::{is_claim, ItemKeys, CLAIM_PREFIX};

/// What Redis holds under one item's names, read at once (`postcache
/// inspect`). TTLs are PTTL's replies: -2 absent, -1 no expiry.
#[derive(Debug, Clone, Default)]
pub struct ItemSnapshot {
    pub value: Option<Bytes>,
    pub value_ttl: i64,
    /// The lock holder's token.
    pub lock: Option<String>,
    pub lock_ttl: i64,
    /// The lock is a leader's claim in the value key (see
    /// `cache/entry.rs`): `value` is then empty, `lock` its token.
    pub lock_in_value: bool,
    /// The last change applied to the item, while its fence lives.
    pub fence: Option<String>,
    pub fence_ttl: i64,
    /// Subscribers of the ready channel on the node serving its slot.
    pub subscribers: i64,
}

/// What Redis holds for one item: its keys and their TTLs in one
/// pipeline (they share a slot), then its channel's subscribers.
pub async fn snapshot(redis: &RedisCommands, keys: &ItemKeys) -> Result<ItemSnapshot, RedisError> {
    let replies: Vec<Value> = redis
        .on_node(&keys.value, BreakerRule::Bypassed, |c| async move {
            let pipeline = c.pipeline();
            for key in [&keys.value, &keys.lock, &keys.fence] {
                let () = pipeline.get(key).await?;
                let () = pipeline.pttl(key).await?;
            }
            pipeline.all().await
        })
        .await?;
    let sharded = redis.sharded();
    let numsub: Vec<Value> = redis
        .on_node(&keys.channel, BreakerRule::Bypassed, |c| async move {
            if sharded {
                c.pubsub_shardnumsub(&keys.channel).await
            } else {
                c.pubsub_numsub(&keys.channel).await
            }
        })
        .await?;
    let mut replies = replies.into_iter();
    let mut next = || replies.next().unwrap_or(Value::Null);
    let bytes = |v: Value| v.as_bytes().map(Bytes::copy_from_slice);
    let ttl = |v: Value| v.as_i64().unwrap_or(-2);
    let (value, value_ttl) = (bytes(next()), ttl(next()));
    let (lock, lock_ttl) = (next().into_string(), ttl(next()));
    let claim = value
        .as_ref()
        .filter(|raw| is_claim(raw))
        .map(|raw| String::from_utf8_lossy(&raw[CLAIM_PREFIX.len()..]).into_owned());
    let lock_in_value = claim.is_some();
    let (value, value_ttl, lock, lock_ttl) = match claim {
        Some(token) => (None, -2, Some(token), value_ttl),
        None => (value, value_ttl, lock, lock_ttl),
    };
    Ok(ItemSnapshot {
        value,
        value_ttl,
        lock,
        lock_ttl,
        lock_in_value,
        fence: next().into_string(),
        fence_ttl: ttl(next()),
        // [channel, count]
        subscribers: numsub.get(1).and_then(Value::as_i64).unwrap_or(0),
    })
}
