//! The Redis side: changes applied to items' keys (the change feed,
//! `postcache invalidate`), several in one round trip.
//!
//! Idempotent: a change already in the item's set of applied changes is
//! skipped, applied by this instance or another, in whatever order the
//! changes arrive. Sets the fence to the change, a value no fence had
//! before, and records the change as applied (both for the fence's
//! lifetime, while there is a value or a leader to fence). A fence that is
//! a WAL position (the replication feed's, and `postcache invalidate`'s)
//! never falls: a change applied after a later one leaves the later fence.
//! The value is
//! changed in place, its body kept as the fail-safe copy (see
//! `cache/entry.rs`): a delete puts the item's tombstone (a not-found
//! entry, invalidated) in place of a copy; any other change marks a found
//! entry INVALIDATED, or with stale-while-revalidate marks it stale (fresh
//! until now: served stale for the grace window), and deletes a not-found
//! entry (the item exists again) or a marker.
//!
//! One item anywhere (its keys share a slot); several only on a single
//! Redis (the change feed's decoder: their keys are in different slots).

use std::time::Duration;

use bytes::Bytes;
use fred::prelude::*;

use super::lua::{layout, ms, table, with_layout, Call, ScriptName};
use crate::cache::{now_millis, Entry, ItemKeys};

layout! {
    /// Each item's KEYS, in turn.
    Keys {
        value,
        lock,
        fence,
        /// The changes applied to the item (a set).
        applied,
    }
}

layout! {
    /// The ARGV every item shares, first.
    Shared {
        /// How long the fence outlives the change, ms.
        fence_ms,
        /// The not-found entry, invalidated, that a delete puts in place of
        /// a copy of the item.
        tombstone,
        /// Its TTL, ms (0: none: the copy is deleted).
        tombstone_copy_ms,
        /// The stale-while-revalidate window, ms (0: off).
        grace_ms,
        /// Now, unix ms, as 8 big-endian bytes (compared with an entry's
        /// own bytes).
        now,
        /// 1: fence every change, with nothing to fence too (the change's
        /// LSN, for loads from read replicas); 0: only where there is.
        always_fence,
        /// The fence every item is given, a WAL position (`postcache
        /// invalidate`); 0: each item its own change.
        fence_at,
    }
}

layout! {
    /// Each item's own ARGV, in turn, after the shared ones.
    Item {
        /// The change's id.
        change,
        /// `delete` or `change`.
        kind,
    }
}

const APPLY_LUA: &str = include_str!("apply.lua");

/// `apply.lua`'s `apply_one`, then the loop that calls it for each item
/// with its K and A tables. Returns how many were applied (the others
/// were already).
pub(super) fn lua() -> String {
    let (k, shared, item) = (
        Keys::<()>::NAMES.len(),
        Shared::<()>::NAMES.len(),
        Item::<()>::NAMES.len(),
    );
    let keys = table("KEYS", Keys::<()>::NAMES, |i| format!("i*{k}+{}", i + 1));
    let own = table("ARGV", Item::<()>::NAMES, |i| {
        format!("{}+i*{item}", shared + i + 1)
    });
    let common = table("ARGV", Shared::<()>::NAMES, |i| (i + 1).to_string());
    // One table of both: {change = ARGV[7+i*2], …, fence_ms = ARGV[1], …}.
    let args = format!(
        "{}, {}",
        own.trim_end_matches('}'),
        common.trim_start_matches('{')
    );
    format!(
        r#"{body}
local applied = 0
for i = 0, (#KEYS / {k}) - 1 do
  applied = applied + apply_one({keys}, {args})
end
return applied
"#,
        body = with_layout(APPLY_LUA),
    )
}

/// How a change is applied to an item's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// The item is gone: a tombstone in place of its copy.
    Deleted,
    /// Anything else: what is stored is no longer to be trusted.
    Changed,
    /// Deleted, then written again, applied as one change: applied as a
    /// delete (its copy gives way to the tombstone, never served as stale),
    /// and the item exists (the existence guard admits it).
    Recreated,
}

impl ChangeKind {
    /// The one change applied for this change of an item and a `later` one.
    /// A delete among them is applied as a delete: a change keeps the copy
    /// servable as stale with STALE_WHILE_REVALIDATE on, a delete replaces
    /// it with the tombstone, which readers never get. (Found: a post
    /// deleted and inserted again, both applied as one update, had its body
    /// from before the delete served as stale, 3 to 7 times in a 30 s run
    /// of the checker.) Whether the item exists is the later change's say.
    pub fn then(self, later: Self) -> Self {
        match (self, later) {
            (Self::Changed, Self::Changed) => Self::Changed,
            (_, Self::Deleted) => Self::Deleted,
            _ => Self::Recreated,
        }
    }

    /// Whether its copy gives way to a tombstone (see `apply.lua`).
    pub fn deletes(self) -> bool {
        matches!(self, Self::Deleted | Self::Recreated)
    }
}

/// The lifetimes the application of a change writes with.
#[derive(Debug, Clone, Copy)]
pub struct ApplyFor {
    /// How long the fence outlives the change.
    pub fence: Duration,
    /// The tombstone in place of a copy (0: none, the copy deleted).
    pub tombstone_copy: Duration,
    /// The stale-while-revalidate window (0: off).
    pub grace: Duration,
    /// Fence every change, where nothing is cached too: the replication
    /// feed's changes are commit LSNs, which a load from a read replica
    /// must find replayed for the fence's lifetime.
    pub always_fence: bool,
    /// Fence with this WAL position rather than each change's id (0: the
    /// change's id): `postcache invalidate`, whose changes are outbox ids,
    /// fences with a position a load must include, as the decoder does.
    pub fence_at: u64,
}

/// Changes to apply, each to its item's keys; how many were applied.
pub struct ApplyMany<'a> {
    pub items: &'a [(&'a ItemKeys, i64, ChangeKind)],
    pub tombstone: &'a Entry,
    pub lifetimes: ApplyFor,
}

impl Call for ApplyMany<'_> {
    type Reply = u64;
    fn name(&self) -> &'static str {
        "apply"
    }

    fn script(&self) -> ScriptName {
        ScriptName::ApplyMany
    }

    fn keys(&self) -> Vec<&str> {
        let mut keys = Vec::with_capacity(self.items.len() * Keys::<()>::NAMES.len());
        for (k, ..) in self.items {
            keys.extend(
                Keys {
                    value: k.value.as_str(),
                    lock: &k.lock,
                    fence: &k.fence,
                    applied: &k.applied,
                }
                .into_vec(),
            );
        }
        keys
    }

    fn args(&self) -> Vec<Value> {
        let l = self.lifetimes;
        let mut args = Shared {
            fence_ms: Value::Integer(ms(l.fence).max(1)),
            tombstone: Value::Bytes(self.tombstone.raw().clone()),
            tombstone_copy_ms: Value::Integer(ms(l.tombstone_copy)),
            grace_ms: Value::Integer(ms(l.grace)),
            now: Value::Bytes(Bytes::copy_from_slice(&now_millis().to_be_bytes())),
            always_fence: Value::Integer(i64::from(l.always_fence)),
            fence_at: Value::Integer(i64::try_from(l.fence_at).unwrap_or(i64::MAX)),
        }
        .into_vec();
        args.reserve(self.items.len() * Item::<()>::NAMES.len());
        for (_, change, kind) in self.items {
            args.extend(
                Item {
                    change: Value::Integer(*change),
                    kind: Value::from(if kind.deletes() { "delete" } else { "change" }),
                }
                .into_vec(),
            );
        }
        args
    }

    fn reply(&self, value: Value) -> Option<u64> {
        u64::try_from(value.as_i64()?)
            .ok()
            .filter(|n| *n <= self.items.len() as u64)
    }
}

/// The script on a real Redis, through every reply it gives.
#[cfg(test)]
mod contract {
    use super::*;
    use crate::{
        cache::{Keys as Names, Status},
        redis::scripts::contract::{assert_reads, clean, put_for, redis, run},
    };

    const MINUTE: Duration = Duration::from_secs(60);

    fn lifetimes(grace: Duration) -> ApplyFor {
        ApplyFor {
            fence: MINUTE,
            tombstone_copy: MINUTE,
            grace,
            always_fence: false,
            fence_at: 0,
        }
    }

    async fn get(client: &Client, key: &str) -> Option<Entry> {
        let raw: Option<Bytes> = client.get(key).await.unwrap();
        raw.map(|raw| Entry::decode(raw).unwrap())
    }

    #[test]
    fn the_script_reads_exactly_the_names_the_call_sends() {
        assert_reads(&lua(), 'K', &[Keys::<()>::NAMES]);
        assert_reads(&lua(), 'A', &[Shared::<()>::NAMES, Item::<()>::NAMES]);
    }

    #[tokio::test]
    async fn changes_fence_and_keep_the_body_as_the_fail_safe_copy_once() {
        let (client, prefix) = redis().await;
        let names = Names::new(&prefix, "post");
        let (changed, deleted, negative, idle) =
            (names.item(1), names.item(2), names.item(3), names.item(4));
        let found = Entry::new(Status::Found, b"old", MINUTE, Duration::ZERO);
        let tombstone = Entry::new(Status::NotFound, &[], MINUTE, Duration::ZERO);
        for keys in [&changed, &deleted] {
            put_for(&client, &keys.value, &found, 600_000).await;
        }
        put_for(&client, &negative.value, &tombstone, 600_000).await;
        let items = [
            (&changed, 10, ChangeKind::Changed),
            (&deleted, 11, ChangeKind::Deleted),
            (&negative, 12, ChangeKind::Changed),
            // Nothing stored and no leader: nothing to fence.
            (&idle, 13, ChangeKind::Changed),
        ];
        let apply = ApplyMany {
            items: &items,
            tombstone: &tombstone,
            lifetimes: lifetimes(Duration::ZERO),
        };

        assert_eq!(run(&client, &apply).await, 4);

        // Changed: never served again, the body kept as the fail-safe copy
        // for as long as it had left.
        assert_eq!(
            get(&client, &changed.value).await,
            Some(found.as_invalidated())
        );
        let ttl: i64 = client.pttl(&changed.value).await.unwrap();
        assert!(ttl > 590_000, "{ttl}");
        let fence: Option<String> = client.get(&changed.fence).await.unwrap();
        assert_eq!(fence.as_deref(), Some("10"));
        // Deleted: the tombstone in place of the copy, invalidated too: one
        // served could land over a newer value (the post inserted again,
        // and loaded, since).
        assert_eq!(
            get(&client, &deleted.value).await,
            Some(tombstone.as_invalidated())
        );
        let ttl: i64 = client.pttl(&deleted.value).await.unwrap();
        assert!(ttl > 0 && ttl <= 60_000, "{ttl}");
        // A negative entry goes: the item exists again.
        assert_eq!(get(&client, &negative.value).await, None);
        let fence: Option<String> = client.get(&idle.fence).await.unwrap();
        assert_eq!(fence, None);

        // Seen again (another instance, a replay): skipped, but the
        // unfenced item's change is applied again (nothing remembered it).
        assert_eq!(run(&client, &apply).await, 1);
        clean(&client, &prefix).await;
    }

    #[tokio::test]
    async fn a_change_takes_a_leaders_claim_away_and_fences_it() {
        let (client, prefix) = redis().await;
        let keys = Names::new(&prefix, "post").item(6);
        let tombstone = Entry::new(Status::NotFound, &[], MINUTE, Duration::ZERO);
        for (change, kind) in [(20, ChangeKind::Changed), (21, ChangeKind::Deleted)] {
            // A leader loading a post nobody had stored: its claim is the
            // value (see cache/entry.rs).
            let _: () = client
                .set(&keys.value, "\0claim:leader", None, None, false)
                .await
                .unwrap();
            let items = [(&keys, change, kind)];
            let apply = ApplyMany {
                items: &items,
                tombstone: &tombstone,
                lifetimes: lifetimes(Duration::ZERO),
            };
            assert_eq!(run(&client, &apply).await, 1);
            // Gone, so that the next reader claims anew and loads after the
            // change; fenced, so that the leader's finish stores nothing.
            let value: Option<Bytes> = client.get(&keys.value).await.unwrap();
            assert_eq!(value, None, "{kind:?}");
            let fence: Option<String> = client.get(&keys.fence).await.unwrap();
            assert_eq!(fence, Some(change.to_string()));
        }
        clean(&client, &prefix).await;
    }

    #[tokio::test]
    async fn the_replication_feed_fences_every_change_and_never_moves_a_fence_back() {
        let (client, prefix) = redis().await;
        let names = Names::new(&prefix, "post");
        let idle = names.item(5);
        let tombstone = Entry::new(Status::NotFound, &[], MINUTE, Duration::ZERO);
        let apply = |change: i64| {
            let (client, idle, tombstone) = (&client, &idle, &tombstone);
            async move {
                let items = [(idle, change, ChangeKind::Changed)];
                let apply = ApplyMany {
                    items: &items,
                    tombstone,
                    lifetimes: ApplyFor {
                        always_fence: true,
                        ..lifetimes(Duration::ZERO)
                    },
                };
                run(client, &apply).await
            }
        };
        // Nothing stored and no leader: fenced all the same, for a load
        // from a replica that must have replayed the change.
        assert_eq!(apply(700).await, 1);
        let fence: Option<String> = client.get(&idle.fence).await.unwrap();
        assert_eq!(fence.as_deref(), Some("700"));
        let ttl: i64 = client.pttl(&idle.fence).await.unwrap();
        assert!(ttl > 0 && ttl <= 60_000, "{ttl}");
        assert_eq!(apply(900).await, 1);
        // A decoder taking over replays from the slot's confirmed position:
        // the earlier change, remembered as applied, does not move the
        // fence back.
        assert_eq!(apply(700).await, 0);
        let fence: Option<String> = client.get(&idle.fence).await.unwrap();
        assert_eq!(fence.as_deref(), Some("900"));
        // An earlier change applied late (the posts read from a replica
        // behind a change to every post are fenced with that change, after
        // the decoder has applied later ones): applied, but the later fence
        // stays, so that no load may read a replica behind it.
        assert_eq!(apply(800).await, 1);
        let fence: Option<String> = client.get(&idle.fence).await.unwrap();
        assert_eq!(fence.as_deref(), Some("900"));
        let applied: bool = client.sismember(&idle.applied, 800).await.unwrap();
        assert!(applied, "remembered as applied");
        clean(&client, &prefix).await;
    }

    #[tokio::test]
    async fn with_a_grace_window_a_change_marks_the_value_stale_and_a_backoff_copy_invalidated() {
        let (client, prefix) = redis().await;
        let names = Names::new(&prefix, "post");
        let (keys, backoff_keys) = (names.item(4), names.item(5));
        let found = Entry::new(Status::Found, b"body", MINUTE, Duration::ZERO);
        let backoff = found.as_backoff(now_millis() + 60_000);
        let tombstone = Entry::new(Status::NotFound, &[], MINUTE, Duration::ZERO);
        put_for(&client, &keys.value, &found, 600_000).await;
        put_for(&client, &backoff_keys.value, &backoff, 600_000).await;
        let items = [
            (&keys, 20, ChangeKind::Changed),
            (&backoff_keys, 21, ChangeKind::Changed),
        ];
        let apply = ApplyMany {
            items: &items,
            tombstone: &tombstone,
            lifetimes: lifetimes(Duration::from_secs(5)),
        };

        assert_eq!(run(&client, &apply).await, 2);

        let stale = get(&client, &keys.value).await.expect("kept");
        assert_eq!(stale.body(), found.body());
        assert!(stale.fresh_until() <= now_millis());
        assert!(
            stale.is_changed(),
            "never fresh again, on any reader's clock"
        );
        assert!(!stale.is_invalidated(), "served stale in the grace window");
        // Kept as the fail-safe copy past the grace window.
        let ttl: i64 = client.pttl(&keys.value).await.unwrap();
        assert!(ttl > 590_000, "{ttl}");
        // A backoff copy is not refreshed in the grace window: it is
        // invalidated, so that the next read loads.
        let copy = get(&client, &backoff_keys.value).await.expect("kept");
        assert!(copy.is_invalidated() && !copy.is_backoff());
        assert_eq!(copy.body(), found.body());
        clean(&client, &prefix).await;
    }
}
