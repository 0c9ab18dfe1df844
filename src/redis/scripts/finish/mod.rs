//! The Redis side: the leader's finish, in one round trip, fenced by the lock and by the
//! change fence.
//!
//! Change fence: a change applied to the item after the leader looked at
//! its fence (before its read) means the row it read may be older than the
//! change. Such a finish stores nothing and publishes [`RETRY`]: its
//! waiters, and the leader's own flight, elect a leader again, who reads
//! the new row (a stale set, in the words of Facebook's memcache paper,
//! never lands).
//!
//! Lock fencing: the finish writes only while the lock still holds this
//! leader's token, or when the lock is gone and nothing newer is stored. A
//! leader whose lock expired or was lost and taken over must not store its
//! older row (or its failure) over the new leader's value: it publishes what
//! is stored instead (or nothing, when nothing is).
//!
//! On success: store the entry in the value key, which keeps it past its
//! freshness as the fail-safe copy (see `cache/entry.rs`); a not-found
//! entry that replaces a copy of the item (it existed) is kept as long as
//! a copy, as the item's tombstone, so that a deleted item never comes back
//! from it. On failure: an entry still fresh is left as it is (a failed
//! refresh never degrades it); otherwise the value, if it is a copy (found,
//! or a tombstone; never one read before the cutoff), is stored again
//! flagged BACKOFF until FAILURE_TTL from now, or else the failure marker
//! for FAILURE_TTL. Then publish what is stored on the ready channel, and
//! release the lock if it is ours.
//!
//! Which TTLs is decided in Rust (`read_path::freshness::store_for`); which copy, here,
//! because only Redis knows what is stored at the moment of the finish.
//!
//! The `$…` placeholders are the envelope's layout, filled in from the
//! constants of `cache/entry.rs` by `with_layout` (Lua strings count from 1).

use std::time::Duration;

use bytes::Bytes;
use fred::prelude::*;

use super::{
    lock::RETRY,
    lua::{for_each_item, layout, ms, prologue, with_layout, Call, ScriptName},
};
use crate::cache::{now_millis, Entry, ItemKeys};

layout! {
    /// The finish's KEYS.
    Keys { value, lock, fence }
}

layout! {
    /// The finish's ARGV.
    Argv {
        /// The entry loaded.
        entry,
        /// Its TTL as the value, ms (0: do not store).
        value_ms,
        /// The leader's token.
        token,
        /// The ready channel.
        channel,
        /// A not-found entry's TTL when it replaces a copy of the item, ms
        /// (0: as `value_ms`).
        tombstone_ms,
        /// FAILURE_TTL, ms: the backoff after a failure.
        failure_ms,
        /// PUBLISH, or SPUBLISH on a Redis Cluster (the channel shares the
        /// keys' hash tag, so it lives on the same shard).
        publish,
        /// Now, unix ms.
        now,
        /// The fence the leader saw before its read ("" for none).
        fence,
        /// The cutoff in force, unix ms (0: none).
        cutoff,
        /// [`RETRY`], published when fenced.
        retry,
    }
}

const FINISH_LUA: &str = include_str!("finish.lua");

/// The script: the prologue naming KEYS and ARGV, `finish.lua`, then its call.
pub(super) fn lua() -> String {
    prologue(Keys::<()>::NAMES, Argv::<()>::NAMES)
        + &with_layout(FINISH_LUA)
        + "return finish_one(K, A)\n"
}

/// `finish.lua`, then the loop that calls `finish_one` for each item sent:
/// the replies in the items' order.
pub(super) fn many_lua() -> String {
    for_each_item(
        &with_layout(FINISH_LUA),
        "finish_one",
        Keys::<()>::NAMES,
        Argv::<()>::NAMES,
    )
}

/// Lifetimes the finish stores with (0: do not store that key), decided by
/// the read path's store policy (`read_path::freshness::store_for`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreFor {
    /// The value key (a found entry: freshness, then its life as the
    /// fail-safe copy).
    pub value: Duration,
    /// A not-found entry that replaces a copy of the item: its tombstone.
    pub tombstone: Duration,
    /// The backoff after a failure: the failure marker, or the last good copy
    /// flagged BACKOFF.
    pub failure: Duration,
}

/// A leader's finish: `fence` is what it saw before its read, `cutoff` the
/// one in force.
pub struct Finish<'a> {
    pub keys: &'a ItemKeys,
    pub token: &'a str,
    pub entry: &'a Entry,
    pub store: StoreFor,
    pub fence: &'a str,
    pub cutoff: u64,
    /// A Redis Cluster: publish with SPUBLISH (sharded pub/sub).
    pub sharded: bool,
}

/// What the finish did.
#[derive(Debug, PartialEq, Eq)]
pub struct Finished {
    /// Whether the lock still held our token (and was deleted).
    pub released: bool,
    /// What was published: the entry, or on failure the backoff copy, or
    /// what another leader stored (our lock was lost); `None` when fenced
    /// (a change was applied since the leader's read: nothing stored,
    /// [`RETRY`] published).
    pub published: Option<Entry>,
}

impl Call for Finish<'_> {
    type Reply = Finished;
    fn name(&self) -> &'static str {
        "finish"
    }

    fn script(&self) -> ScriptName {
        ScriptName::Finish
    }

    fn keys(&self) -> Vec<&str> {
        let k = self.keys;
        Keys {
            value: k.value.as_str(),
            lock: &k.lock,
            fence: &k.fence,
        }
        .into_vec()
    }

    fn args(&self) -> Vec<Value> {
        Argv {
            entry: Value::Bytes(self.entry.raw().clone()),
            value_ms: Value::Integer(ms(self.store.value)),
            token: Value::from(self.token),
            channel: Value::from(self.keys.channel.as_str()),
            tombstone_ms: Value::Integer(ms(self.store.tombstone)),
            failure_ms: Value::Integer(ms(self.store.failure)),
            publish: Value::from(if self.sharded { "SPUBLISH" } else { "PUBLISH" }),
            now: Value::Integer(now_millis() as i64),
            fence: Value::from(self.fence),
            cutoff: Value::Integer(self.cutoff as i64),
            retry: Value::Bytes(Bytes::from_static(RETRY)),
        }
        .into_vec()
    }

    /// `{released, payload, fenced}`: 1 or 0, what was published (empty
    /// when it is the entry sent, or when nothing was), 1 or 0.
    fn reply(&self, value: Value) -> Option<Finished> {
        let Value::Array(reply) = value else {
            return None;
        };
        let [released, payload, fenced] = <[Value; 3]>::try_from(reply).ok()?;
        let released = released.as_i64()? == 1;
        let published = match fenced.as_i64()? {
            1 => None,
            // Empty (the entry sent, not sent back), or bytes that are not
            // an entry, which no finish ever stored: what we sent.
            _ => Some(Entry::decode(payload.into_bytes()?).unwrap_or_else(|_| self.entry.clone())),
        };
        Some(Finished {
            released,
            published,
        })
    }
}

/// Finishes of many items in one call (their keys on one Redis; not a
/// cluster, where different items' keys are in different slots): each
/// item's KEYS and ARGV as its [`Finish`] made them.
pub struct FinishMany<'a> {
    pub items: &'a [(&'a [String], &'a [Value])],
}

impl Call for FinishMany<'_> {
    /// Each item's reply, unparsed (its [`Finish`] parses it), in order.
    type Reply = Vec<Value>;

    fn name(&self) -> &'static str {
        "finish"
    }

    fn script(&self) -> ScriptName {
        ScriptName::FinishMany
    }

    fn keys(&self) -> Vec<&str> {
        self.items
            .iter()
            .flat_map(|(keys, _)| keys.iter().map(String::as_str))
            .collect()
    }

    fn args(&self) -> Vec<Value> {
        self.items
            .iter()
            .flat_map(|(_, args)| args.iter().cloned())
            .collect()
    }

    fn reply(&self, value: Value) -> Option<Vec<Value>> {
        let Value::Array(replies) = value else {
            return None;
        };
        (replies.len() == self.items.len()).then_some(replies)
    }
}

/// The finish on a real Redis, through every reply it gives.
#[cfg(test)]
mod contract;
