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
//! On success: store the entry (unless its TTL is 0) and, for a found entry,
//! its fail-safe copy; a not-found entry turns an existing fail-safe copy
//! into the item's tombstone (or deletes it, MAX_STALE off), so that a
//! deleted item never comes back from it. On failure: an entry still fresh
//! is left as it is (a failed refresh never degrades it); otherwise store as
//! the backoff, for FAILURE_TTL, the last good copy (the value if it is a
//! found entry, else the fail-safe copy, found or tombstone; never one read
//! before the cutoff) with its BACKOFF flag set, or else the failure marker.
//! Then publish what is stored on the ready channel, and release the lock if
//! it is ours.
//!
//! Which TTLs is decided in Rust (`flight::freshness::store_for`); which copy, here,
//! because only Redis knows what is stored at the moment of the finish.
//!
//! The `$…` placeholders are the envelope's layout, filled in from the
//! constants of `cache/entry.rs` by `with_layout` (Lua strings count from 1).

use std::time::Duration;

use bytes::Bytes;
use fred::{prelude::*, types::scripts::Script};

use super::{for_each_item, layout, prologue, with_layout, Call, Scripts, RETRY};
use crate::cache::{now_millis, Entry, ItemKeys};

layout! {
    /// The finish's KEYS.
    Keys { value, lock, fail_safe, fence }
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
        /// The fail-safe copy's TTL, ms (0: none).
        fail_safe_ms,
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
/// the read path's store policy (`flight::freshness::store_for`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreFor {
    /// The value key.
    pub value: Duration,
    /// The fail-safe copy.
    pub fail_safe: Duration,
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

    fn script<'s>(&self, scripts: &'s Scripts) -> &'s Script {
        &scripts.finish
    }

    fn keys(&self) -> Vec<&str> {
        let k = self.keys;
        Keys {
            value: k.value.as_str(),
            lock: &k.lock,
            fail_safe: &k.fail_safe,
            fence: &k.fence,
        }
        .into_vec()
    }

    fn args(&self) -> Vec<Value> {
        Argv {
            entry: Value::Bytes(self.entry.raw().clone()),
            value_ms: Value::Integer(super::ms(self.store.value)),
            token: Value::from(self.token),
            channel: Value::from(self.keys.channel.as_str()),
            fail_safe_ms: Value::Integer(super::ms(self.store.fail_safe)),
            failure_ms: Value::Integer(super::ms(self.store.failure)),
            publish: Value::from(if self.sharded { "SPUBLISH" } else { "PUBLISH" }),
            now: Value::Integer(now_millis() as i64),
            fence: Value::from(self.fence),
            cutoff: Value::Integer(self.cutoff as i64),
            retry: Value::Bytes(Bytes::from_static(RETRY)),
        }
        .into_vec()
    }

    /// `{released, payload, fenced}`: 1 or 0, what was published (or the
    /// entry itself when nothing was), 1 or 0.
    fn reply(&self, value: Value) -> Option<Finished> {
        let Value::Array(reply) = value else {
            return None;
        };
        let [released, payload, fenced] = <[Value; 3]>::try_from(reply).ok()?;
        let released = released.as_i64()? == 1;
        let published = match fenced.as_i64()? {
            1 => None,
            // Bytes that are not an entry were never stored by a finish:
            // what we sent stands for them.
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

    fn script<'s>(&self, scripts: &'s Scripts) -> &'s Script {
        &scripts.finish_many
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
mod contract {
    use std::time::Duration;

    use fred::prelude::*;

    use super::*;
    use crate::{
        cache::{Keys as Names, Status},
        redis::scripts::contract::{clean, heard, names_read, redis, run},
    };

    const MINUTE: Duration = Duration::from_secs(60);

    fn store() -> StoreFor {
        StoreFor {
            value: MINUTE,
            fail_safe: 2 * MINUTE,
            failure: Duration::from_secs(5),
        }
    }

    fn finish<'a>(keys: &'a ItemKeys, entry: &'a Entry, fence: &'a str) -> Finish<'a> {
        Finish {
            keys,
            token: "ours",
            entry,
            store: store(),
            fence,
            cutoff: 0,
            sharded: false,
        }
    }

    fn found(body: &str) -> Entry {
        Entry::new(Status::Found, body.as_bytes(), MINUTE, Duration::ZERO)
    }

    async fn put(client: &Client, key: &str, value: impl Into<Value> + Send) {
        let _: () = client.set(key, value, None, None, false).await.unwrap();
    }

    async fn get(client: &Client, key: &str) -> Option<Entry> {
        let raw: Option<Bytes> = client.get(key).await.unwrap();
        raw.map(|raw| Entry::decode(raw).unwrap())
    }

    /// Runs `call`, and what its finish published on the channel.
    async fn run_heard(client: &Client, call: &Finish<'_>) -> (Finished, Option<Bytes>) {
        let mut reply = None;
        let message = heard(client, &call.keys.channel, async {
            reply = Some(run(client, call).await);
        })
        .await;
        (reply.expect("ran"), message)
    }

    #[test]
    fn the_script_reads_exactly_the_names_the_call_sends() {
        let lua = lua();
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect();
        assert_eq!(names_read(&lua, 'K'), names(Keys::<()>::NAMES));
        assert_eq!(names_read(&lua, 'A'), names(Argv::<()>::NAMES));
    }

    #[tokio::test]
    async fn the_holder_stores_publishes_and_releases() {
        let (client, prefix) = redis().await;
        let keys = Names::new(&prefix, "post").item(1);
        let entry = found("new");
        put(&client, &keys.lock, "ours").await;

        let (reply, message) = run_heard(&client, &finish(&keys, &entry, "")).await;

        assert_eq!(
            reply,
            Finished {
                released: true,
                published: Some(entry.clone())
            }
        );
        assert_eq!(message.as_ref(), Some(entry.raw()));
        assert_eq!(get(&client, &keys.value).await.as_ref(), Some(&entry));
        assert_eq!(get(&client, &keys.fail_safe).await.as_ref(), Some(&entry));
        let lock: Option<String> = client.get(&keys.lock).await.unwrap();
        assert_eq!(lock, None);
        clean(&client, &prefix).await;
    }

    #[tokio::test]
    async fn many_finishes_in_one_call_each_do_what_their_own_would() {
        let (client, prefix) = redis().await;
        let names = Names::new(&prefix, "post");
        let (held, fenced, lost) = (names.item(11), names.item(12), names.item(13));
        let (new, old, stored) = (found("new"), found("before the change"), found("theirs"));
        put(&client, &held.lock, "ours").await;
        put(&client, &fenced.lock, "ours").await;
        put(&client, &fenced.fence, "7").await;
        put(&client, &lost.lock, "theirs").await;
        put(&client, &lost.value, stored.raw().clone()).await;
        let finishes = [
            finish(&held, &new, ""),
            finish(&fenced, &old, "6"),
            finish(&lost, &new, ""),
        ];
        let keys: Vec<Vec<String>> = finishes
            .iter()
            .map(|f| f.keys().into_iter().map(str::to_owned).collect())
            .collect();
        let args: Vec<Vec<Value>> = finishes.iter().map(Finish::args).collect();
        let items: Vec<(&[String], &[Value])> = keys
            .iter()
            .zip(&args)
            .map(|(k, a)| (k.as_slice(), a.as_slice()))
            .collect();

        let replies = run(&client, &FinishMany { items: &items }).await;

        let replies: Vec<Finished> = finishes
            .iter()
            .zip(replies)
            .map(|(f, reply)| f.reply(reply).expect("a finish's reply"))
            .collect();
        assert_eq!(
            replies,
            [
                Finished {
                    released: true,
                    published: Some(new.clone())
                },
                Finished {
                    released: true,
                    published: None
                },
                Finished {
                    released: false,
                    published: Some(stored.clone())
                },
            ]
        );
        assert_eq!(get(&client, &held.value).await.as_ref(), Some(&new));
        assert_eq!(get(&client, &fenced.value).await, None);
        assert_eq!(get(&client, &lost.value).await.as_ref(), Some(&stored));
        let lock: Option<String> = client.get(&lost.lock).await.unwrap();
        assert_eq!(lock.as_deref(), Some("theirs"));
        clean(&client, &prefix).await;
    }

    #[tokio::test]
    async fn a_changed_fence_stores_nothing_and_publishes_retry() {
        let (client, prefix) = redis().await;
        let keys = Names::new(&prefix, "post").item(2);
        let entry = found("read before the change");
        put(&client, &keys.lock, "ours").await;
        put(&client, &keys.fence, "7").await;

        let (reply, message) = run_heard(&client, &finish(&keys, &entry, "6")).await;

        assert_eq!(
            reply,
            Finished {
                released: true,
                published: None
            }
        );
        assert_eq!(message.as_deref(), Some(RETRY));
        assert_eq!(get(&client, &keys.value).await, None);

        // Fenced without holding the lock: the holder's lock stays.
        put(&client, &keys.lock, "theirs").await;
        let reply = run(&client, &finish(&keys, &entry, "6")).await;
        assert_eq!(
            reply,
            Finished {
                released: false,
                published: None
            }
        );
        let lock: Option<String> = client.get(&keys.lock).await.unwrap();
        assert_eq!(lock.as_deref(), Some("theirs"));
        clean(&client, &prefix).await;
    }

    #[tokio::test]
    async fn a_lost_lock_publishes_what_is_stored_or_nothing() {
        let (client, prefix) = redis().await;
        let keys = Names::new(&prefix, "post").item(3);
        let ours = found("older");
        let theirs = found("newer");
        put(&client, &keys.lock, "theirs").await;

        // Nothing stored: nothing written, our entry stands for the reply.
        let reply = run(&client, &finish(&keys, &ours, "")).await;
        assert_eq!(
            reply,
            Finished {
                released: false,
                published: Some(ours.clone())
            }
        );
        assert_eq!(get(&client, &keys.value).await, None);

        // Another leader's value stored: it is what we publish.
        put(&client, &keys.value, theirs.raw().clone()).await;
        let reply = run(&client, &finish(&keys, &ours, "")).await;
        assert_eq!(reply.published.as_ref(), Some(&theirs));
        assert_eq!(get(&client, &keys.value).await.as_ref(), Some(&theirs));
        clean(&client, &prefix).await;
    }

    #[tokio::test]
    async fn a_failure_keeps_a_fresh_entry_else_serves_a_backoff_copy_else_a_marker() {
        let (client, prefix) = redis().await;
        let keys = Names::new(&prefix, "post").item(4);
        let failed = Entry::new(Status::Failed, &[], Duration::ZERO, Duration::ZERO);

        // Still fresh: left as it is, and published.
        let fresh = found("fresh");
        put(&client, &keys.value, fresh.raw().clone()).await;
        let reply = run(&client, &finish(&keys, &failed, "")).await;
        assert_eq!(reply.published.as_ref(), Some(&fresh));

        // Past freshness: the found value comes back flagged as backoff.
        let now = now_millis();
        let past = Entry::stamped(
            Status::Found,
            b"past",
            now - 2_000,
            now - 1_000,
            Duration::ZERO,
        );
        put(&client, &keys.value, past.raw().clone()).await;
        let published = run(&client, &finish(&keys, &failed, ""))
            .await
            .published
            .unwrap();
        assert!(published.is_backoff());
        assert_eq!(published.body(), past.body());
        assert_eq!(get(&client, &keys.value).await.as_ref(), Some(&published));

        // No value: the fail-safe copy (here a deleted post's tombstone)
        // comes back flagged as backoff, unless it was read before the cutoff.
        let _: i64 = client.del(&keys.value).await.unwrap();
        let tombstone = Entry::stamped(
            Status::NotFound,
            &[],
            now - 2_000,
            now - 1_000,
            Duration::ZERO,
        );
        put(&client, &keys.fail_safe, tombstone.raw().clone()).await;
        let published = run(&client, &finish(&keys, &failed, ""))
            .await
            .published
            .unwrap();
        assert!(published.is_backoff());
        assert_eq!(published.status(), Status::NotFound);
        let _: i64 = client.del(&keys.value).await.unwrap();
        let after_cutoff = Finish {
            cutoff: now,
            ..finish(&keys, &failed, "")
        };
        let published = run(&client, &after_cutoff).await.published.unwrap();
        assert_eq!(published.status(), Status::Failed, "read before the cutoff");

        // No good copy at all: the failure marker, stored for FAILURE_TTL.
        let _: i64 = client
            .del(vec![keys.value.as_str(), &keys.fail_safe])
            .await
            .unwrap();
        let published = run(&client, &finish(&keys, &failed, ""))
            .await
            .published
            .unwrap();
        assert_eq!(published.status(), Status::Failed);
        let ttl: i64 = client.pttl(&keys.value).await.unwrap();
        assert!(ttl > 0 && ttl <= 5_000, "{ttl}");
        clean(&client, &prefix).await;
    }
}
