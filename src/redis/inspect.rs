//! The Redis side: what Redis holds for one item, read at once (`postcache
//! inspect`).

use bytes::Bytes;
use fred::prelude::*;

use super::{RedisCommands, RedisError};
use crate::cache::ItemKeys;

/// What Redis holds under one item's names, read at once (`postcache
/// inspect`). TTLs are PTTL's replies: -2 absent, -1 no expiry.
#[derive(Debug, Clone, Default)]
pub struct ItemSnapshot {
    pub value: Option<Bytes>,
    pub value_ttl: i64,
    /// The lock holder's token.
    pub lock: Option<String>,
    pub lock_ttl: i64,
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
        .unrefused(&keys.value, |c| async move {
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
        .unrefused(&keys.channel, |c| async move {
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
    Ok(ItemSnapshot {
        value: bytes(next()),
        value_ttl: ttl(next()),
        lock: next().into_string(),
        lock_ttl: ttl(next()),
        fence: next().into_string(),
        fence_ttl: ttl(next()),
        // [channel, count]
        subscribers: numsub.get(1).and_then(Value::as_i64).unwrap_or(0),
    })
}
