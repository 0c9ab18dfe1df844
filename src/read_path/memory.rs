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
//! In front of the shared table, each thread keeps a few hot entries of its
//! own ([`Front`]): a hit found there takes no lock and touches no reference
//! count another core writes. A copy there is valid while its stripe's front
//! generation is the one read before the copy was taken from the table.
//! Every change to what the table holds for a key, once done, bumps it (an
//! eviction, a clear, a fill, a fill undone), and so does an answer served
//! from elsewhere that the table has no entry to compare with (a front may
//! hold an older copy than it): a copy is never served after any of them.
//! The fronts have generations of their own, so that a fill, which bumps
//! them, refuses no other fill.
//!
//! Bounded by bytes (L1_MAX_BYTES): an entry weighs its envelope plus a fixed
//! overhead, and the envelope is copied into an allocation of its own when
//! kept, so that it never holds on to a larger buffer it was read into. An
//! entry larger than a shard's share of the budget (see [`shards`]) is not
//! kept. The
//! cache itself is quick_cache's (CLOCK-Pro, sharded); with 2 threads over a
//! Zipf(1.1) key set a lookup took 170–400 ns against moka's 720–740 ns.

use std::{
    cell::RefCell,
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

/// Entries in each thread's front (a power of two).
const FRONT_SLOTS: usize = 64;
/// The largest envelope copied into a front.
const FRONT_MAX_BYTES: usize = 16 << 10;

/// Tells the tiers of one process apart in the fronts (the tests run
/// several instances in one process).
static TIERS: AtomicU64 = AtomicU64::new(1);

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
    pub(super) generation: u64,
}

/// The memory tier of one process.
pub(super) struct MemoryTier<K> {
    /// This tier, in the fronts.
    id: u64,
    /// `None`: off (L1_MAX_BYTES=0, or a strategy that bypasses it).
    cache: Option<Cache<K, Kept, ByBytes>>,
    /// L1_TTL.
    ttl: Duration,
    generations: Box<[AtomicU64]>,
    /// The fronts' generations, per stripe (see the module docs).
    front_generations: Box<[AtomicU64]>,
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
            id: TIERS.fetch_add(1, Ordering::Relaxed),
            cache,
            ttl,
            generations: (0..STRIPES).map(|_| AtomicU64::new(0)).collect(),
            front_generations: (0..STRIPES).map(|_| AtomicU64::new(0)).collect(),
            serving: AtomicBool::new(true),
        }
    }

    pub fn is_on(&self) -> bool {
        self.cache.is_some()
    }

    /// The entry kept for `key`, while it may be served at `now`; whether it
    /// is fresh is for the caller to judge (the cutoff may have moved).
    /// `ordinal` names the key in this thread's front (`Source::ordinal`);
    /// `None` keeps it out of the front.
    pub fn get(&self, key: &K, ordinal: Option<u64>, now: u64) -> Option<Entry> {
        let cache = self.cache.as_ref()?;
        if !self.serving.load(Ordering::Relaxed) {
            return None;
        }
        // Read before the table: a change after this read bumps it.
        let generation = self.front_generations[stripe(key)].load(Ordering::SeqCst);
        let front = ordinal.map(|ordinal| Front {
            tier: self.id,
            ordinal,
            generation,
        });
        if let Some(entry) = front.as_ref().and_then(|front| front.get(now)) {
            return Some(entry);
        }
        let kept = cache.get(key)?;
        if now >= kept.until {
            cache.remove(key);
            return None;
        }
        if let Some(front) = front {
            front.offer(&kept);
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

    /// Whether no item of `ticket`'s stripe was evicted since it was taken:
    /// no change to its key was applied by this process meanwhile (rarely,
    /// a change to another key of the stripe says no as well).
    pub fn unchanged_since(&self, ticket: &Ticket) -> bool {
        self.generations[ticket.stripe].load(Ordering::SeqCst) == ticket.generation
    }

    /// Keeps `entry` for `key` if it is a fresh found or not-found entry and
    /// nothing of its stripe was evicted since `ticket`.
    pub fn fill(&self, key: &K, entry: &Entry, ticket: &Ticket, now: u64) {
        let Some(cache) = &self.cache else {
            return;
        };
        let keepable = matches!(entry.status(), Status::Found | Status::NotFound)
            && !entry.is_backoff()
            && !entry.is_invalidated();
        if !keepable || !entry.is_fresh(now) || !self.serving.load(Ordering::SeqCst) {
            return;
        }
        if !self.unchanged_since(ticket) {
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
        if !self.unchanged_since(ticket) {
            cache.remove(key);
        }
        // The fronts let go of what they copied before: the entry this one
        // replaced, or an older one the table had already dropped.
        self.front_generations[ticket.stripe].fetch_add(1, Ordering::SeqCst);
    }

    /// `entry` was served for `key` from elsewhere (Redis, a load, a
    /// message): a kept entry older than it goes, and the fills begun
    /// before now with it (they may be older still), so that the tier never
    /// takes this process back to an older version than one it served.
    pub fn supersede(&self, key: &K, entry: &Entry) {
        let Some(cache) = &self.cache else {
            return;
        };
        match cache.peek(key) {
            Some(kept) if kept.entry.stored_at() < entry.stored_at() => self.evict(key),
            Some(_) => {}
            // A front may still hold a copy the table has dropped (for room).
            None => {
                self.front_generations[stripe(key)].fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// Keeps nothing of `key` but the version `etag` (its floor: see
    /// floor.rs), and refuses the fills of it begun before now.
    pub fn keep_only(&self, key: &K, etag: u64) {
        let Some(cache) = &self.cache else {
            return;
        };
        match cache.peek(key) {
            Some(kept) if kept.entry.etag() == etag => {}
            // A front may still hold a copy the table has dropped.
            _ => self.evict(key),
        }
    }

    /// Forgets `key`, and refuses the fills of it begun before now (the
    /// fills' generation is bumped before the removal, the fronts' after it).
    pub fn evict(&self, key: &K) {
        let stripe = stripe(key);
        self.generations[stripe].fetch_add(1, Ordering::SeqCst);
        if let Some(cache) = &self.cache {
            cache.remove(key);
        }
        self.front_generations[stripe].fetch_add(1, Ordering::SeqCst);
    }

    /// Forgets everything, and refuses every fill begun before now (the
    /// generations bumped as [`MemoryTier::evict`] bumps them).
    pub fn clear(&self) {
        for generation in self.generations.iter() {
            generation.fetch_add(1, Ordering::SeqCst);
        }
        if let Some(cache) = &self.cache {
            cache.clear();
        }
        for generation in self.front_generations.iter() {
            generation.fetch_add(1, Ordering::SeqCst);
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
    let mut hasher = StripeHasher(0);
    key.hash(&mut hasher);
    (hasher.finish() >> 32) as usize % STRIPES
}

/// A multiply-rotate hash (the Fx hash of rustc) for the stripes: every hit
/// hashes its key once, and SipHash's resistance to chosen keys buys
/// nothing here (a stripe shared by many keys only refuses more fills).
struct StripeHasher(u64);

impl Hasher for StripeHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_i64(&mut self, n: i64) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Every this many hits of a copy, one goes to the table instead: the
/// table's CLOCK-Pro keeps what is looked up, and an entry hot in the
/// fronts must not look cold to it.
const FRONT_TOUCH_EVERY: u32 = 32;

/// One thread's copy of a kept entry, in an allocation of its own.
struct Copied {
    tier: u64,
    ordinal: u64,
    generation: u64,
    until: u64,
    entry: Entry,
    /// Hits since the table last saw this key from this thread.
    hits: u32,
}

/// A slot of a thread's front: the copy it holds, and the key that last
/// missed it. A key is copied in on its second miss in a row at the slot,
/// so that keys that take turns at a slot (a working set larger than the
/// front) cost a write of a number, not a copy each.
#[derive(Default)]
struct FrontSlot {
    copied: Option<Copied>,
    candidate: Option<(u64, u64)>,
}

thread_local! {
    static FRONT: RefCell<Box<[FrontSlot]>> =
        RefCell::new((0..FRONT_SLOTS).map(|_| FrontSlot::default()).collect());
}

/// A look at this thread's front for one key of one tier, at the stripe
/// generation read before the table.
struct Front {
    tier: u64,
    ordinal: u64,
    generation: u64,
}

impl Front {
    fn slot(&self) -> usize {
        let mixed = (self.ordinal ^ self.tier.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (mixed >> 32) as usize % FRONT_SLOTS
    }

    /// The copy of this key, while its generation holds and L1_TTL has not
    /// run out (`None` one hit in FRONT_TOUCH_EVERY, for the table).
    fn get(&self, now: u64) -> Option<Entry> {
        FRONT
            .try_with(|front| {
                let mut front = front.borrow_mut();
                let copied = front[self.slot()].copied.as_mut()?;
                let valid = copied.tier == self.tier
                    && copied.ordinal == self.ordinal
                    && copied.generation == self.generation
                    && now < copied.until;
                if !valid {
                    return None;
                }
                copied.hits += 1;
                if copied.hits >= FRONT_TOUCH_EVERY {
                    copied.hits = 0;
                    return None;
                }
                Some(copied.entry.clone())
            })
            .ok()
            .flatten()
    }

    /// Copies `kept` in on this key's second miss in a row at its slot.
    fn offer(self, kept: &Kept) {
        if kept.entry.raw().len() > FRONT_MAX_BYTES {
            return;
        }
        let _ = FRONT.try_with(|front| {
            let mut front = front.borrow_mut();
            let slot = &mut front[self.slot()];
            let key = (self.tier, self.ordinal);
            let mine = slot.copied.as_ref().filter(|c| (c.tier, c.ordinal) == key);
            // Still valid: the table was only touched (FRONT_TOUCH_EVERY).
            if mine.is_some_and(|c| c.generation == self.generation && c.until == kept.until) {
                return;
            }
            if mine.is_none() && slot.candidate != Some(key) {
                slot.candidate = Some(key);
                return;
            }
            slot.copied = Some(Copied {
                tier: self.tier,
                ordinal: self.ordinal,
                generation: self.generation,
                until: kept.until,
                entry: kept.entry.detached(),
                hits: 0,
            });
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::now_millis;

    fn found(body: &[u8], fresh_for: Duration) -> Entry {
        Entry::new(Status::Found, body, fresh_for, Duration::ZERO)
    }

    impl MemoryTier<i32> {
        /// A lookup as the read path makes it (the key its own ordinal).
        fn get_now(&self, key: &i32, now: u64) -> Option<Entry> {
            self.get(key, u64::try_from(*key).ok(), now)
        }
    }

    /// Looked up often enough to be copied into this thread's front, then
    /// changed in every way the tier lets go of an entry: the front never
    /// serves the copy after the table has let go of it.
    #[test]
    fn the_front_never_serves_what_the_table_let_go_of() {
        let tier = MemoryTier::new(1 << 20, Duration::from_secs(10));
        let now = now_millis();
        let hot = |tier: &MemoryTier<i32>, expected: &Entry| {
            for _ in 0..4 {
                assert_eq!(tier.get_now(&5, now).as_ref(), Some(expected));
            }
        };
        let v1 = Entry::stamped(Status::Found, b"v1", now - 3, now + 60_000, Duration::ZERO);
        let v2 = Entry::stamped(Status::Found, b"v2", now - 2, now + 60_000, Duration::ZERO);
        let v3 = Entry::stamped(Status::Found, b"v3", now - 1, now + 60_000, Duration::ZERO);

        tier.fill(&5, &v1, &tier.ticket(&5), now);
        hot(&tier, &v1);
        tier.evict(&5);
        assert_eq!(tier.get_now(&5, now), None, "evicted");

        tier.fill(&5, &v1, &tier.ticket(&5), now);
        hot(&tier, &v1);
        tier.fill(&5, &v2, &tier.ticket(&5), now);
        hot(&tier, &v2);
        tier.supersede(&5, &v3);
        assert_eq!(tier.get_now(&5, now), None, "superseded");

        tier.fill(&5, &v3, &tier.ticket(&5), now);
        hot(&tier, &v3);
        tier.clear();
        assert_eq!(tier.get_now(&5, now), None, "cleared");

        tier.fill(&5, &v3, &tier.ticket(&5), now);
        hot(&tier, &v3);
        tier.serve(false);
        assert_eq!(tier.get_now(&5, now), None, "not serving");
        tier.serve(true);
        assert_eq!(tier.get_now(&5, now), None, "emptied when it stopped");

        // The fills' generation moving alone (an eviction under way, before
        // its removal) leaves the copy served; the eviction's own bump of
        // the fronts' generation, after its removal, is what lets it go.
        tier.fill(&5, &v3, &tier.ticket(&5), now);
        tier.generations[stripe(&5)].fetch_add(1, Ordering::SeqCst);
        hot(&tier, &v3);
        tier.evict(&5);
        assert_eq!(tier.get_now(&5, now), None, "copied mid-eviction");

        // Dropped from the table for room (no eviction), then a newer
        // version served from elsewhere, or filled: never the older copy.
        tier.fill(&5, &v2, &tier.ticket(&5), now);
        hot(&tier, &v2);
        tier.cache.as_ref().unwrap().remove(&5);
        tier.supersede(&5, &v3);
        assert_eq!(tier.get_now(&5, now), None, "served newer from elsewhere");
        tier.fill(&5, &v2, &tier.ticket(&5), now);
        hot(&tier, &v2);
        tier.cache.as_ref().unwrap().remove(&5);
        tier.fill(&5, &v3, &tier.ticket(&5), now);
        assert_eq!(tier.get_now(&5, now), Some(v3.clone()), "filled newer");

        // Past L1_TTL, the copy goes with the table's entry.
        tier.fill(&5, &v3, &tier.ticket(&5), now);
        hot(&tier, &v3);
        assert_eq!(tier.get_now(&5, now + 10_000), None, "past L1_TTL");
    }

    /// Two tiers in one process (two instances in a test) never see each
    /// other's copies, and a key without an ordinal stays out of the front.
    #[test]
    fn fronts_are_per_tier_and_per_key() {
        let (a, b) = (
            MemoryTier::new(1 << 20, Duration::from_secs(10)),
            MemoryTier::new(1 << 20, Duration::from_secs(10)),
        );
        let now = now_millis();
        let entry = found(b"a", Duration::from_secs(60));
        a.fill(&9, &entry, &a.ticket(&9), now);
        for _ in 0..4 {
            assert_eq!(a.get_now(&9, now), Some(entry.clone()));
            assert_eq!(b.get_now(&9, now), None);
            assert_eq!(a.get(&9, None, now), Some(entry.clone()));
        }
        a.evict(&9);
        assert_eq!(a.get(&9, None, now), None);
        assert_eq!(a.get_now(&9, now), None);
    }

    #[test]
    fn a_front_copy_is_its_own_allocation() {
        let tier = MemoryTier::new(1 << 20, Duration::from_secs(10));
        let now = now_millis();
        tier.fill(
            &3,
            &found(b"body", Duration::from_secs(60)),
            &tier.ticket(&3),
            now,
        );
        let from_table = tier.get_now(&3, now).unwrap();
        tier.get_now(&3, now);
        let from_front = tier.get_now(&3, now).unwrap();
        assert_eq!(from_front, from_table);
        assert_ne!(from_front.raw().as_ptr(), from_table.raw().as_ptr());
    }

    #[test]
    fn an_entry_is_served_until_its_freshness_or_the_ttl_ends() {
        let tier = MemoryTier::new(1 << 20, Duration::from_secs(10));
        let now = now_millis();
        let short = found(b"a", Duration::from_secs(2));
        let long = found(b"b", Duration::from_secs(60));
        tier.fill(&1, &short, &tier.ticket(&1), now);
        tier.fill(&2, &long, &tier.ticket(&2), now);
        assert_eq!(tier.get_now(&1, now + 1_999), Some(short.clone()));
        assert_eq!(tier.get_now(&1, now + 2_000), None, "past its freshness");
        assert_eq!(tier.get_now(&2, now + 9_999), Some(long.clone()));
        assert_eq!(tier.get_now(&2, now + 10_000), None, "past L1_TTL");
    }

    #[test]
    fn failures_backoff_copies_and_stale_entries_are_not_kept() {
        let tier = MemoryTier::new(1 << 20, Duration::from_secs(10));
        let now = now_millis();
        let failed = Entry::new(Status::Failed, b"", Duration::from_secs(5), Duration::ZERO);
        let backoff = found(b"x", Duration::from_secs(5)).as_backoff(u64::MAX);
        let stale = Entry::stamped(Status::Found, b"x", now - 10, now - 1, Duration::ZERO);
        for (key, entry) in [(1, failed), (2, backoff), (3, stale)] {
            tier.fill(&key, &entry, &tier.ticket(&key), now);
            assert_eq!(tier.get_now(&key, now), None, "key {key}");
        }
        let missing = Entry::new(
            Status::NotFound,
            b"",
            Duration::from_secs(5),
            Duration::ZERO,
        );
        tier.fill(&4, &missing, &tier.ticket(&4), now);
        assert_eq!(
            tier.get_now(&4, now),
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
        assert_eq!(tier.get_now(&7, now), None);
        let ticket = tier.ticket(&7);
        tier.clear();
        tier.fill(&7, &entry, &ticket, now);
        assert_eq!(tier.get_now(&7, now), None);
        tier.fill(&7, &entry, &tier.ticket(&7), now);
        assert_eq!(tier.get_now(&7, now), Some(entry));
    }

    #[test]
    fn a_tier_not_serving_is_empty_and_keeps_nothing() {
        let tier = MemoryTier::new(1 << 20, Duration::from_secs(10));
        let now = now_millis();
        let entry = found(b"x", Duration::from_secs(60));
        tier.fill(&1, &entry, &tier.ticket(&1), now);
        tier.serve(false);
        assert_eq!(tier.get_now(&1, now), None);
        tier.fill(&2, &entry, &tier.ticket(&2), now);
        tier.serve(true);
        assert_eq!(
            tier.get_now(&1, now),
            None,
            "emptied when it stopped serving"
        );
        assert_eq!(
            tier.get_now(&2, now),
            None,
            "nothing kept while not serving"
        );
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
        assert_eq!(tier.get_now(&1, now), None);
        assert!(!tier.is_serving());
    }
}
