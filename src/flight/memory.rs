//! The protocol: the memory tier, fresh entries kept in this process in
//! front of Redis, so that a hit costs no round trip.
//!
//! Coherence rests on three rules:
//! - An entry is served only while fresh (its freshness, and the cutoff, as
//!   for Redis: `freshness::judge`), and never longer than L1_TTL after it
//!   was kept: a bound for when no change feed evicts it.
//! - Every change applied by this process's feed evicts the item here
//!   (`apply.rs`), and a change feed down turns the tier off and empties it:
//!   it serves again once the feed is up and caught up.
//! - A fill can lose a race with an eviction: a request reads the old value
//!   from Redis, the change is applied and evicted here, then the request
//!   keeps what it read. So a fill carries a [`Ticket`] taken before its
//!   data was read, and an eviction bumps the generation of the item's
//!   stripe before it removes: a fill that sees the generation moved after
//!   it inserted removes what it inserted.
//!
//! Bounded by bytes (L1_MAX_BYTES): an entry weighs its envelope plus a fixed
//! overhead, and the envelope is copied into an allocation of its own when
//! kept, so that it never holds on to a larger buffer it was read into. An
//! entry larger than a shard's share of the budget (see [`shards`]) is not
//! kept. The
//! cache itself is quick_cache's (CLOCK-Pro, sharded); with 2 threads over a
//! Zipf(1.1) key set a lookup took 170–400 ns against moka's 720–740 ns.

use std::{
    collections::hash_map::DefaultHasher,
    hash::{Hash, Hasher},
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::Duration,
};

use quick_cache::{sync::Cache, OptionsBuilder, Weighter};

use crate::cache::{Entry, Status};

/// What an entry weighs beyond its envelope: the key, the entry's fields,
/// and the slot in the table (an upper estimate).
pub const ENTRY_OVERHEAD: u64 = 160;
/// The budget of a shard, about (see [`shards`]).
const SHARD_BYTES: u64 = 4 << 20;
/// Generations kept for evictions: a fill is refused after an eviction of
/// any item of its stripe (rarely another's: a refused fill is only a miss).
const STRIPES: usize = 256;

/// An entry kept, with the instant (unix milliseconds) it stops being served.
#[derive(Clone)]
struct Kept {
    entry: Entry,
    until: u64,
}

#[derive(Clone)]
struct ByBytes;

impl<K> Weighter<K, Kept> for ByBytes {
    fn weight(&self, _key: &K, kept: &Kept) -> u64 {
        kept.entry.raw().len() as u64 + ENTRY_OVERHEAD
    }
}

/// The generation of an item's stripe before its data was read.
pub(super) struct Ticket {
    stripe: usize,
    generation: u64,
}

/// The memory tier of one process.
pub(super) struct MemoryTier<K> {
    /// `None`: off (L1_MAX_BYTES=0, or a strategy that bypasses it).
    cache: Option<Cache<K, Kept, ByBytes>>,
    /// L1_TTL.
    ttl: Duration,
    generations: Box<[AtomicU64]>,
    /// Off while the change feed is down (see the module docs).
    serving: AtomicBool,
}

impl<K: Eq + Hash + Clone> MemoryTier<K> {
    /// A tier of `max_bytes` (0: off) keeping entries at most `ttl`.
    pub fn new(max_bytes: u64, ttl: Duration) -> Self {
        let cache = (max_bytes > 0 && !ttl.is_zero()).then(|| {
            let shards = shards(max_bytes);
            let options = OptionsBuilder::new()
                .shards(shards)
                // quick_cache sizes its tables from an estimate of the
                // count: posts of about a kilobyte.
                .estimated_items_capacity((max_bytes / 1024).clamp(32, 1 << 22) as usize)
                // Whole shards: their budgets add up to no more than this.
                .weight_capacity(max_bytes - max_bytes % shards as u64)
                .build()
                .expect("every option is set");
            Cache::with_options(options, ByBytes, Default::default(), Default::default())
        });
        Self {
            cache,
            ttl,
            generations: (0..STRIPES).map(|_| AtomicU64::new(0)).collect(),
            serving: AtomicBool::new(true),
        }
    }

    pub fn is_on(&self) -> bool {
        self.cache.is_some()
    }

    /// The entry kept for `key`, while it may be served at `now`; whether it
    /// is fresh is for the caller to judge (the cutoff may have moved).
    pub fn get(&self, key: &K, now: u64) -> Option<Entry> {
        let cache = self.cache.as_ref()?;
        if !self.serving.load(Ordering::Relaxed) {
            return None;
        }
        let kept = cache.get(key)?;
        if now >= kept.until {
            cache.remove(key);
            return None;
        }
        Some(kept.entry)
    }

    /// The ticket a fill of `key` must carry: take it before reading.
    pub fn ticket(&self, key: &K) -> Ticket {
        let stripe = stripe(key);
        Ticket {
            stripe,
            generation: self.generations[stripe].load(Ordering::SeqCst),
        }
    }

    /// Keeps `entry` for `key` if it is a fresh found or not-found entry and
    /// nothing of its stripe was evicted since `ticket`.
    pub fn fill(&self, key: &K, entry: &Entry, ticket: &Ticket, now: u64) {
        let Some(cache) = &self.cache else {
            return;
        };
        let keepable =
            matches!(entry.status(), Status::Found | Status::NotFound) && !entry.is_backoff();
        if !keepable || !entry.is_fresh(now) || !self.serving.load(Ordering::SeqCst) {
            return;
        }
        let generation = &self.generations[ticket.stripe];
        if generation.load(Ordering::SeqCst) != ticket.generation {
            return;
        }
        // Never an older entry over a newer one: a flight detached from
        // its key (see local.rs) may end after a newer answer was kept.
        // (Two fills of one key at the same instant may still cross; the
        // ticket above refuses either if a change came between.)
        if cache
            .peek(key)
            .is_some_and(|kept| kept.entry.stored_at() > entry.stored_at())
        {
            return;
        }
        let ttl = u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX);
        let until = entry.fresh_until().min(now.saturating_add(ttl));
        cache.insert(
            key.clone(),
            Kept {
                entry: entry.detached(),
                until,
            },
        );
        // An eviction between the check above and the insert: undo.
        if generation.load(Ordering::SeqCst) != ticket.generation {
            cache.remove(key);
        }
    }

    /// `entry` was served for `key` from elsewhere (Redis, a load, a
    /// message): a kept entry older than it goes, and the fills begun
    /// before now with it (they may be older still), so that the tier never
    /// takes this process back to an older version than one it served.
    pub fn supersede(&self, key: &K, entry: &Entry) {
        let Some(cache) = &self.cache else {
            return;
        };
        if cache
            .peek(key)
            .is_some_and(|kept| kept.entry.stored_at() < entry.stored_at())
        {
            self.evict(key);
        }
    }

    /// Forgets `key`, and refuses the fills of it begun before now.
    pub fn evict(&self, key: &K) {
        self.generations[stripe(key)].fetch_add(1, Ordering::SeqCst);
        if let Some(cache) = &self.cache {
            cache.remove(key);
        }
    }

    /// Forgets everything, and refuses every fill begun before now.
    pub fn clear(&self) {
        for generation in self.generations.iter() {
            generation.fetch_add(1, Ordering::SeqCst);
        }
        if let Some(cache) = &self.cache {
            cache.clear();
        }
    }

    /// Serves (the change feed is up, or off) or not (it is down: emptied).
    pub fn serve(&self, serving: bool) {
        let was = self.serving.swap(serving, Ordering::SeqCst);
        if was && !serving {
            self.clear();
        }
    }

    pub fn is_serving(&self) -> bool {
        self.is_on() && self.serving.load(Ordering::Relaxed)
    }

    /// Bytes kept (by the weight above) and entries.
    pub fn usage(&self) -> (u64, usize) {
        self.cache
            .as_ref()
            .map_or((0, 0), |c| (c.weight(), c.len()))
    }
}

/// The cache's shards (each locked on its own, each with its share of the
/// budget): about one per 4 MiB, at most four per core, a power of two. An
/// entry larger than its shard's share is not kept.
fn shards(max_bytes: u64) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let wanted = (max_bytes / SHARD_BYTES).clamp(1, 4 * cores as u64);
    // The largest power of two not above it.
    1 << (63 - wanted.leading_zeros())
}

fn stripe<K: Hash>(key: &K) -> usize {
    let mut hasher = DefaultHasher::new();
    key.hash(&mut hasher);
    (hasher.finish() as usize) % STRIPES
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::now_millis;

    fn found(body: &[u8], fresh_for: Duration) -> Entry {
        Entry::new(Status::Found, body, fresh_for, Duration::ZERO)
    }

    #[test]
    fn an_entry_is_served_until_its_freshness_or_the_ttl_ends() {
        let tier = MemoryTier::new(1 << 20, Duration::from_secs(10));
        let now = now_millis();
        let short = found(b"a", Duration::from_secs(2));
        let long = found(b"b", Duration::from_secs(60));
        tier.fill(&1, &short, &tier.ticket(&1), now);
        tier.fill(&2, &long, &tier.ticket(&2), now);
        assert_eq!(tier.get(&1, now + 1_999), Some(short.clone()));
        assert_eq!(tier.get(&1, now + 2_000), None, "past its freshness");
        assert_eq!(tier.get(&2, now + 9_999), Some(long.clone()));
        assert_eq!(tier.get(&2, now + 10_000), None, "past L1_TTL");
    }

    #[test]
    fn failures_backoff_copies_and_stale_entries_are_not_kept() {
        let tier = MemoryTier::new(1 << 20, Duration::from_secs(10));
        let now = now_millis();
        let failed = Entry::new(Status::Failed, b"", Duration::from_secs(5), Duration::ZERO);
        let backoff = found(b"x", Duration::from_secs(5)).as_backoff();
        let stale = Entry::stamped(Status::Found, b"x", now - 10, now - 1, Duration::ZERO);
        for (key, entry) in [(1, failed), (2, backoff), (3, stale)] {
            tier.fill(&key, &entry, &tier.ticket(&key), now);
            assert_eq!(tier.get(&key, now), None, "key {key}");
        }
        let missing = Entry::new(
            Status::NotFound,
            b"",
            Duration::from_secs(5),
            Duration::ZERO,
        );
        tier.fill(&4, &missing, &tier.ticket(&4), now);
        assert_eq!(
            tier.get(&4, now),
            Some(missing),
            "negative entries are kept"
        );
    }

    #[test]
    fn a_fill_begun_before_an_eviction_keeps_nothing() {
        let tier = MemoryTier::new(1 << 20, Duration::from_secs(10));
        let now = now_millis();
        let entry = found(b"old", Duration::from_secs(60));
        let ticket = tier.ticket(&7);
        tier.evict(&7);
        tier.fill(&7, &entry, &ticket, now);
        assert_eq!(tier.get(&7, now), None);
        let ticket = tier.ticket(&7);
        tier.clear();
        tier.fill(&7, &entry, &ticket, now);
        assert_eq!(tier.get(&7, now), None);
        tier.fill(&7, &entry, &tier.ticket(&7), now);
        assert_eq!(tier.get(&7, now), Some(entry));
    }

    #[test]
    fn a_tier_not_serving_is_empty_and_keeps_nothing() {
        let tier = MemoryTier::new(1 << 20, Duration::from_secs(10));
        let now = now_millis();
        let entry = found(b"x", Duration::from_secs(60));
        tier.fill(&1, &entry, &tier.ticket(&1), now);
        tier.serve(false);
        assert_eq!(tier.get(&1, now), None);
        tier.fill(&2, &entry, &tier.ticket(&2), now);
        tier.serve(true);
        assert_eq!(tier.get(&1, now), None, "emptied when it stopped serving");
        assert_eq!(tier.get(&2, now), None, "nothing kept while not serving");
    }

    #[test]
    fn the_byte_budget_holds_for_large_entries() {
        let budget = 1 << 20;
        let tier = MemoryTier::new(budget, Duration::from_secs(10));
        let now = now_millis();
        let body = vec![b'x'; 20_000];
        for key in 0..500 {
            let entry = found(&body, Duration::from_secs(60));
            tier.fill(&key, &entry, &tier.ticket(&key), now);
            let (bytes, _) = tier.usage();
            assert!(bytes <= budget, "{bytes} bytes kept after {key} fills");
        }
        let (bytes, entries) = tier.usage();
        assert!(
            entries > 10,
            "it keeps what fits: {entries} entries, {bytes} bytes"
        );
    }

    #[test]
    fn shards_are_powers_of_two_of_about_four_mebibytes() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(shards(1 << 20), 1);
        assert_eq!(shards(12 << 20), 2.min(4 * cores));
        assert!(shards(64 << 20).is_power_of_two());
        assert!(shards(64 << 20) <= 4 * cores);
        assert!(shards(u64::MAX).is_power_of_two());
    }

    #[test]
    fn off_keeps_nothing() {
        let tier = MemoryTier::new(0, Duration::from_secs(10));
        let now = now_millis();
        let entry = found(b"x", Duration::from_secs(60));
        tier.fill(&1, &entry, &tier.ticket(&1), now);
        assert_eq!(tier.get(&1, now), None);
        assert!(!tier.is_serving());
    }
}
