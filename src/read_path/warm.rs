//! The protocol: which keys this process has lately seen stored in Redis,
//! to choose a request's first look.
//!
//! A first look that claims (`SET NX GET`, see `first_look.rs`) saves a cold
//! miss's leader a round trip, but a hit pays for it: Redis runs a `SET`
//! per look where a batch of plain lookups is one `MGET`, and the instance
//! builds and routes a command per look (a batch of first looks at one hot
//! post in Redis ran at 0.6× the `MGET`'s requests/s, `load/compare
//! hit-ab`). So a key this process has seen stored is looked up plainly
//! (`GET`, batched), and only a key it has not seen lately is claimed at
//! the first look. The record is a hint, never a fact: a key seen stored
//! and gone since costs one more round trip (its flight claims as it did
//! before), and a key whose slot another key took is claimed at its first
//! look, which finds its entry as a `GET` would.
//!
//! A fixed table of hashes, one per slot (direct-mapped, 2^16 slots, 512
//! KiB): no lock, and nothing written on a look unless the slot changes.

use std::{
    hash::{BuildHasher, Hash, RandomState},
    sync::atomic::{AtomicU64, Ordering},
};

/// Slots in the table (a power of two).
const SLOTS: usize = 1 << 16;

/// Keys seen stored in Redis lately (see the module's comment).
pub(super) struct Warm {
    slots: Box<[AtomicU64]>,
    hasher: RandomState,
}

impl Default for Warm {
    fn default() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            hasher: RandomState::new(),
        }
    }
}

impl Warm {
    /// `key`'s slot and its mark there (never 0, which is an empty slot).
    fn slot<K: Hash>(&self, key: &K) -> (&AtomicU64, u64) {
        let hash = self.hasher.hash_one(key);
        (&self.slots[hash as usize & (SLOTS - 1)], hash | 1)
    }

    /// Whether `key` was seen stored lately.
    pub fn holds<K: Hash>(&self, key: &K) -> bool {
        let (slot, mark) = self.slot(key);
        slot.load(Ordering::Relaxed) == mark
    }

    /// `key` was seen stored.
    pub fn mark<K: Hash>(&self, key: &K) {
        let (slot, mark) = self.slot(key);
        if slot.load(Ordering::Relaxed) != mark {
            slot.store(mark, Ordering::Relaxed);
        }
    }

    /// `key` was looked for and not found.
    pub fn forget<K: Hash>(&self, key: &K) {
        let (slot, mark) = self.slot(key);
        let _ = slot.compare_exchange(mark, 0, Ordering::Relaxed, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_held_once_marked_until_forgotten_or_its_slot_is_taken() {
        let warm = Warm::default();
        assert!(!warm.holds(&7u64));
        warm.mark(&7u64);
        assert!(warm.holds(&7u64));
        assert!(!warm.holds(&8u64));
        // Forgetting another key leaves it alone.
        warm.forget(&8u64);
        assert!(warm.holds(&7u64));
        warm.forget(&7u64);
        assert!(!warm.holds(&7u64));
        // A key whose slot another takes is no longer held: a hint lost.
        warm.mark(&7u64);
        let (slot, _) = warm.slot(&7u64);
        let other = (0u64..)
            .find(|k| *k != 7 && std::ptr::eq(warm.slot(k).0, slot))
            .unwrap();
        warm.mark(&other);
        assert!(warm.holds(&other));
        assert!(!warm.holds(&7u64));
    }
}
