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

use std::{fmt::Display, sync::atomic::Ordering, time::Duration};

use super::{ReadPath, Settings, Source};
use crate::{
    cache::{now_millis, Entry, Keys, Status},
    redis::{ApplyFor, ApplyMany, ChangeKind, RaiseCutoff, RedisCommands, RedisError},
};

impl<S: Source> ReadPath<S> {
    /// Applies change `change` (an increasing id) to `key`; false when it
    /// was applied already.
    pub async fn invalidate(
        &self,
        key: &S::Key,
        change: i64,
        kind: ChangeKind,
    ) -> Result<bool, RedisError> {
        let applied =
            apply_change(&self.redis, &self.keys, &self.settings, key, change, kind).await;
        // After Redis (see memory.rs), whether this process applied the
        // change, another did, or Redis failed.
        self.memory.evict(key);
        // A change may be an insert; a deletion leaves the guard as it is
        // (see guard.rs).
        if let (Some(ordinal), ChangeKind::Changed) = (S::ordinal(key), kind) {
            self.guard.admit(ordinal);
        }
        applied
    }

    /// Applies change `change` to `key` in Redis only (the change feed's
    /// decoder: every instance's memory tier forgets the item when it reads
    /// the change from the fleet's stream); false when it was applied
    /// already. `change` is the commit LSN: the key is fenced whether or not
    /// anything is cached (see `store/replicas/mod.rs`).
    pub async fn invalidate_in_redis(
        &self,
        key: &S::Key,
        change: i64,
        kind: ChangeKind,
    ) -> Result<bool, RedisError> {
        let (tombstone, lifetimes) = apply_with(&self.settings);
        let keys = self.keys.item(key);
        let apply = ApplyMany {
            items: &[(&keys, change, kind)],
            tombstone: &tombstone,
            lifetimes: ApplyFor {
                always_fence: true,
                ..lifetimes
            },
        };
        Ok(self.redis.eval(&apply).await? == 1)
    }

    /// Applies several changes to Redis in one round trip where Redis allows
    /// it (a single server; see [`RedisCommands::applies_together`]); the
    /// decoder's, fenced as [`ReadPath::invalidate_in_redis`].
    pub async fn invalidate_many_in_redis(
        &self,
        changes: &[(S::Key, i64, ChangeKind)],
    ) -> Result<u64, RedisError> {
        let s = &self.settings;
        let (tombstone, lifetimes) = apply_with(s);
        let keys: Vec<_> = changes
            .iter()
            .map(|(key, ..)| self.keys.item(key))
            .collect();
        let items: Vec<_> = keys
            .iter()
            .zip(changes)
            .map(|(keys, (_, change, kind))| (keys, *change, *kind))
            .collect();
        let apply = ApplyMany {
            items: &items,
            tombstone: &tombstone,
            lifetimes: ApplyFor {
                always_fence: true,
                ..lifetimes
            },
        };
        self.redis.eval(&apply).await
    }

    /// This process's memory tier forgets `key` (Redis has its change),
    /// and the existence guard admits it (the change may be its insert).
    pub fn forget(&self, key: &S::Key) {
        self.memory.evict(key);
        if let Some(ordinal) = S::ordinal(key) {
            self.guard.admit(ordinal);
        }
    }

    /// As [`ReadPath::forget`], for an item deleted: the existence guard
    /// keeps it (the news may come after the item was inserted again and
    /// served here: see guard.rs).
    pub fn forget_deleted(&self, key: &S::Key) {
        self.memory.evict(key);
    }

    /// Every item changed at `since`, the cutoff raised to `cutoff` for it
    /// (see [`Source::all_changed`]); the decoder's instance tells it before
    /// it raises the cutoff.
    pub fn all_changed(&self, since: super::Since, cutoff: u64) -> Option<Vec<S::Key>> {
        self.loader.source().all_changed(since, cutoff)
    }

    /// This process's memory tier forgets everything, and the existence
    /// guard stands aside until built again.
    pub fn forget_all(&self) {
        self.memory.clear();
        self.guard.stand_aside();
    }

    /// The cutoff in force in this process, unix milliseconds (0: none).
    pub fn cutoff(&self) -> u64 {
        self.cutoff.load(Ordering::Relaxed)
    }

    /// Invalidates everything read before now, for change `change`: the
    /// fleet's cutoff in Redis is raised to now (by this process's clock),
    /// unless that change raised it already, and this process's follows.
    /// Returns the cutoff in force.
    pub async fn invalidate_all(&self, change: i64) -> Result<u64, RedisError> {
        let cutoff = raise_cutoff(&self.redis, &self.keys, change).await;
        self.memory.clear();
        self.guard.stand_aside();
        let cutoff = cutoff?;
        self.cutoff.fetch_max(cutoff, Ordering::Relaxed);
        Ok(cutoff)
    }

    /// Invalidates everything read before now, for no change in
    /// particular (a gap in the feed, or a doubt): the fleet's cutoff in
    /// Redis is raised to now, and this process's follows and forgets.
    /// Returns the cutoff in force.
    pub async fn invalidate_all_now(&self) -> Result<u64, RedisError> {
        let (cutoff, applied) = (self.keys.cutoff(), self.keys.cutoffs_applied());
        let raise = RaiseCutoff {
            cutoff: &cutoff,
            applied: &applied,
            to: now_millis(),
            change: None,
            remember: Duration::from_secs(1),
        };
        let cutoff = self.redis.eval(&raise).await;
        self.forget_all();
        let cutoff = cutoff?;
        self.cutoff.fetch_max(cutoff, Ordering::Relaxed);
        Ok(cutoff)
    }

    /// Takes the fleet's cutoff from Redis (another instance or the
    /// `invalidate --all` command may have raised it). Returns it.
    pub async fn follow_cutoff(&self) -> Result<u64, RedisError> {
        let cutoff = self.redis.cutoff(&self.keys.cutoff()).await?;
        Ok(self.cutoff.fetch_max(cutoff, Ordering::Relaxed).max(cutoff))
    }
}

/// Applies change `change` to the keys of item `id` (the read path's
/// [`ReadPath::invalidate`], and `postcache invalidate`); false when it was
/// applied already.
pub async fn apply_change(
    redis: &RedisCommands,
    keys: &Keys,
    settings: &Settings,
    id: impl Display,
    change: i64,
    kind: ChangeKind,
) -> Result<bool, RedisError> {
    let (tombstone, lifetimes) = apply_with(settings);
    let keys = keys.item(id);
    let apply = ApplyMany {
        items: &[(&keys, change, kind)],
        tombstone: &tombstone,
        lifetimes,
    };
    Ok(redis.eval(&apply).await? == 1)
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
    let (cutoff, applied) = (keys.cutoff(), keys.cutoffs_applied());
    let raise = RaiseCutoff {
        cutoff: &cutoff,
        applied: &applied,
        to: now_millis(),
        change: Some(change),
        remember: CUTOFFS_REMEMBERED,
    };
    redis.eval(&raise).await
}
