//! The protocol: changes applied to the cache: an item changed or deleted in the source
//! (the change feed, `postcache invalidate`), or everything at once.
//!
//! One item: one script (`redis/scripts/apply.lua`) sets the item's fence
//! to the change, so that a leader that read the row before it stores
//! nothing (see `redis/scripts/finish.rs`), and deletes the value, or marks it stale under
//! stale-while-revalidate; a delete also leaves a tombstone in place of
//! the fail-safe copy. Idempotent: a change already applied
//! (kept in a set beside the fence) is skipped, so every instance may apply
//! every change, in any order.
//!
//! The memory tier of the process that applies a change forgets the item
//! (everything, for the cutoff) once Redis has it: every instance applies
//! every change, so every instance forgets.
//!
//! Everything: a cutoff instant, kept in Redis and in each process; every
//! entry read before it is judged no longer fresh (`freshness::judge`) and
//! no fail-safe copy read before it is served. No key is scanned. The
//! cutoff is compared with the instants the loading instances read at, by
//! their clocks: keep their skew small (as for freshness itself).

use std::{fmt::Display, time::Duration};

use super::settings::Settings;
use crate::{
    cache::{now_millis, Entry, Keys, Status},
    redis::{ApplyFor, ApplyMany, ChangeKind, RaiseCutoff, RedisCommands, RedisError},
};

/// Applies change `change` to the keys of item `id` (the read path's
/// [`ReadPath::invalidate`](super::ReadPath::invalidate), and `postcache
/// invalidate`, which fences at a WAL position: `fence_at`); false when it
/// was applied already.
pub async fn apply_change(
    redis: &RedisCommands,
    keys: &Keys,
    settings: &Settings,
    id: impl Display,
    (change, fence_at): (i64, Option<u64>),
    kind: ChangeKind,
) -> Result<bool, RedisError> {
    let changes = [(id, change, kind)];
    let fence = Fence {
        always: false,
        at: fence_at.unwrap_or(0),
    };
    Ok(apply(redis, keys, settings, &changes, fence).await? == 1)
}

/// How `apply` fences (see `apply.lua`).
#[derive(Clone, Copy)]
struct Fence {
    /// Every key, whether or not anything is cached.
    always: bool,
    /// With this WAL position (0: each change's id).
    at: u64,
}

/// The tombstone a delete leaves, and the lifetimes a change writes with.
fn apply_with(s: &Settings) -> (Entry, ApplyFor) {
    let negative = s.jitter.apply(s.negative_ttl);
    let tombstone = Entry::new(Status::NotFound, &[], negative, Duration::ZERO);
    let lifetimes = ApplyFor {
        fence: s.fence_ttl(),
        tombstone_copy: if s.max_stale.is_zero() {
            Duration::ZERO
        } else {
            negative + s.max_stale
        },
        grace: s.stale_while_revalidate,
        always_fence: false,
        fence_at: 0,
    };
    (tombstone, lifetimes)
}

/// How long a change that raised the cutoff is remembered (so that seeing it
/// again does not raise it again): longer than the outbox keeps it.
const CUTOFFS_REMEMBERED: Duration = Duration::from_secs(24 * 3600);

/// Raises the fleet's cutoff in Redis to now (by this process's clock), once
/// for change `change`; the cutoff in force.
pub async fn raise_cutoff(
    redis: &RedisCommands,
    keys: &Keys,
    change: i64,
) -> Result<u64, RedisError> {
    raise(redis, keys, Some(change)).await
}

/// Applies `changes` (key, change, kind) in Redis, each key fenced whether
/// or not anything is cached (the change feed's decoder): one script call,
/// the number applied (a change applied already is skipped).
pub(super) async fn fenced<K: Display>(
    redis: &RedisCommands,
    keys: &Keys,
    settings: &Settings,
    changes: &[(K, i64, ChangeKind)],
) -> Result<u64, RedisError> {
    let fence = Fence {
        always: true,
        at: 0,
    };
    apply(redis, keys, settings, changes, fence).await
}

/// Applies `changes` in one script call, fenced as `fence` says.
async fn apply<K: Display>(
    redis: &RedisCommands,
    keys: &Keys,
    settings: &Settings,
    changes: &[(K, i64, ChangeKind)],
    fence: Fence,
) -> Result<u64, RedisError> {
    let (tombstone, lifetimes) = apply_with(settings);
    let names: Vec<_> = changes.iter().map(|(key, ..)| keys.item(key)).collect();
    let items: Vec<_> = names
        .iter()
        .zip(changes)
        .map(|(names, (_, change, kind))| (names, *change, *kind))
        .collect();
    let apply = ApplyMany {
        items: &items,
        tombstone: &tombstone,
        lifetimes: ApplyFor {
            always_fence: fence.always,
            fence_at: fence.at,
            ..lifetimes
        },
    };
    redis.eval(&apply).await
}

/// Raises the fleet's cutoff to now (by this process's clock), as for a
/// change to every post that names no change: the cutoff in force.
pub(super) async fn raise_cutoff_now(
    redis: &RedisCommands,
    keys: &Keys,
) -> Result<u64, RedisError> {
    raise(redis, keys, None).await
}

/// Raises the fleet's cutoff to now, once for `change` if it names one
/// (remembered for [`CUTOFFS_REMEMBERED`]; a raise that names none
/// remembers nothing, and its `remember` is unused).
async fn raise(redis: &RedisCommands, keys: &Keys, change: Option<i64>) -> Result<u64, RedisError> {
    let (cutoff, applied) = (keys.cutoff(), keys.cutoffs_applied());
    let raise = RaiseCutoff {
        cutoff: &cutoff,
        applied: &applied,
        to: now_millis(),
        change,
        remember: if change.is_some() {
            CUTOFFS_REMEMBERED
        } else {
            Duration::from_secs(1)
        },
    };
    redis.eval(&raise).await
}
