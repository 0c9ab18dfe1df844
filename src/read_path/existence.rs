//! The protocol: the existence guard. An exact set of the items that exist
//! (a roaring bitmap of their ordinals: about 2 bytes per id where ids are
//! dense), built from the source at start and kept current by the change
//! feed, so that a miss (nothing in the memory tier nor in Redis) for an
//! item outside it is answered "not found" without a load: ids that cannot
//! exist never reach the source. (Checked past the look in Redis, so that
//! hits pay nothing for it: measured, a check before it cost hits in Redis
//! 2%.)
//!
//! It never says "missing" for an item whose insert the feed has applied
//! here: every change to an item admits it (a change may be its insert),
//! including the changes applied while the set was being read (kept aside,
//! then merged). Nor for an item this process has served found (from
//! Redis or a load): the news of its insert may come after the row was
//! read here. A deletion does not take an item out of the set: the news of
//! a deletion may come after the item was inserted again and served found
//! here (`examples/coherence` found such reads answered 404 by the guard
//! after a 200), and a deleted item costs one load, whose absence Redis
//! then keeps (NEGATIVE_TTL). The set holds the items that existed at its
//! build or since, until it is built again.
//!
//! It stands aside (every miss may load) until built, while the change feed
//! is down or off (changes may be missed), and after a change to every item
//! (a TRUNCATE, a gap, `invalidate --all`) until built again.

use std::sync::{PoisonError, RwLock};

use roaring::RoaringTreemap;

/// What the guard knows.
enum State {
    /// Nothing: every miss may load (and a build is wanted).
    Aside,
    /// The set is being read; the items changed meanwhile are kept here.
    Building { build: u64, changed: Vec<u64> },
    /// The items that exist.
    Ready(RoaringTreemap),
}

/// The existence guard of one process (see the module's comment).
pub struct ExistenceSet {
    state: RwLock<State>,
    /// Names each build, so that one begun before a stand-aside cannot land.
    builds: std::sync::atomic::AtomicU64,
}

impl Default for ExistenceSet {
    fn default() -> Self {
        Self {
            state: RwLock::new(State::Aside),
            builds: Default::default(),
        }
    }
}

impl ExistenceSet {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether item `ordinal` cannot exist: the guard is built and it is
    /// not in the set. False whenever the guard stands aside.
    pub fn says_missing(&self, ordinal: u64) -> bool {
        matches!(&*self.read(), State::Ready(set) if !set.contains(ordinal))
    }

    /// Item `ordinal` changed (maybe inserted): it may exist.
    pub fn admit(&self, ordinal: u64) {
        match &mut *self.write() {
            State::Ready(set) => {
                set.insert(ordinal);
            }
            State::Building { changed, .. } => changed.push(ordinal),
            State::Aside => {}
        }
    }

    /// Item `ordinal` was served found here (from Redis or a load): it
    /// exists, whatever the feed has said so far.
    pub fn seen_found(&self, ordinal: u64) {
        if self.says_missing(ordinal) {
            self.admit(ordinal);
        }
    }

    /// Stops answering (a change to every item, or the feed down): every
    /// miss may load until built again.
    pub fn stand_aside(&self) {
        self.builds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *self.write() = State::Aside;
    }

    /// Whether a build is wanted (the guard stands aside).
    pub fn wants_build(&self) -> bool {
        matches!(&*self.read(), State::Aside)
    }

    /// Begins a build: changes from now on are kept for it. Call before
    /// the source's set is read. `None` when one runs or it is built.
    pub fn begin_build(&self) -> Option<u64> {
        let mut state = self.write();
        if !matches!(&*state, State::Aside) {
            return None;
        }
        let build = self.builds.load(std::sync::atomic::Ordering::Relaxed);
        *state = State::Building {
            build,
            changed: Vec::new(),
        };
        Some(build)
    }

    /// Ends build `build` with the items the source holds: they and the
    /// items changed meanwhile are the set. False (nothing kept) when the
    /// guard stood aside since.
    pub fn finish_build(&self, build: u64, mut set: RoaringTreemap) -> bool {
        let mut state = self.write();
        match &*state {
            State::Building { build: b, changed } if *b == build => {
                set.extend(changed.iter().copied());
                *state = State::Ready(set);
                true
            }
            _ => false,
        }
    }

    /// A build that failed: stand aside (another is tried later).
    pub fn abandon_build(&self, build: u64) {
        let mut state = self.write();
        if matches!(&*state, State::Building { build: b, .. } if *b == build) {
            *state = State::Aside;
        }
    }

    /// The items in the set and its bytes in memory (serialised size, which
    /// is close to it), when built.
    pub fn usage(&self) -> Option<(u64, u64)> {
        match &*self.read() {
            State::Ready(set) => Some((set.len(), set.serialized_size() as u64)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn built(ids: &[u64]) -> ExistenceSet {
        let guard = ExistenceSet::default();
        let build = guard.begin_build().unwrap();
        assert!(guard.finish_build(build, ids.iter().copied().collect()));
        guard
    }

    #[test]
    fn it_stands_aside_until_built() {
        let guard = ExistenceSet::default();
        assert!(!guard.says_missing(5));
        assert!(guard.wants_build());
        let guard = built(&[1, 2, 3]);
        assert!(guard.says_missing(5));
        assert!(!guard.says_missing(2));
        assert!(!guard.wants_build());
    }

    #[test]
    fn changes_during_a_build_are_kept() {
        let guard = ExistenceSet::default();
        let build = guard.begin_build().unwrap();
        guard.admit(9);
        assert!(!guard.says_missing(9), "aside while building");
        assert!(guard.finish_build(build, [1].into_iter().collect()));
        assert!(!guard.says_missing(9), "inserted during the build");
        assert!(guard.says_missing(8));
    }

    #[test]
    fn changes_and_items_seen_found_admit_and_nothing_removes() {
        let guard = built(&[1]);
        guard.admit(7);
        assert!(!guard.says_missing(7));
        // Inserted, and read here before the feed's news of it.
        guard.seen_found(9);
        assert!(!guard.says_missing(9));
        assert!(guard.says_missing(8));
    }

    #[test]
    fn a_build_begun_before_a_stand_aside_does_not_land() {
        let guard = ExistenceSet::default();
        let build = guard.begin_build().unwrap();
        guard.stand_aside();
        assert!(!guard.finish_build(build, [1].into_iter().collect()));
        assert!(guard.wants_build());
        assert!(!guard.says_missing(99));
        let guard = built(&[1]);
        guard.stand_aside();
        assert!(
            !guard.says_missing(99),
            "aside after a change to every item"
        );
    }
}
