//! The protocol: never back in time. A process never serves an older
//! version of an item than one it served (answers marked stale aside: they
//! say so).
//!
//! Every tier can hold an older version than one this process just served:
//! a read past the cache (`PostCache-Max-Staleness`, `PostCache-Min-LSN`)
//! or a load while Redis was bypassed read the primary, while the memory
//! tier, Redis and a late message from another instance's leader still
//! held the version before a change the feed had not applied (seen: 28
//! plain reads over 1.5 s answered the old title after a read past the
//! cache answered the new one, with the decoder stopped).
//!
//! So each item whose served version may be newer than what the cache
//! reflects keeps a floor here: that version's ETag and a WAL position its
//! rows are no newer than (its `upto`, read by its load after the rows'
//! snapshot). An answer is admitted when:
//!
//! - it is that version (the same ETag); or
//! - it was looked up after this process's change feed had applied every
//!   change up to the floor's position (the cache then reflects every change
//!   the floor's version did: a change applied invalidates every entry
//!   read before it, and fences every load that read before it); or
//! - this process loaded it, in a read that began after the floor was set
//!   (on the primary, a later snapshot; on a replica, one that has
//!   replayed past the floor's position: the leader asks for it).
//!
//! Anything else is a miss: the read loads the item from the primary
//! instead. No clock of another host is read: positions are WAL positions,
//! and instants are this process's.
//!
//! A floor lapses once the feed's position passes it (replication mode), at
//! once for most: only answers whose position is ahead of the feed's set
//! one. Without a position (trigger mode, CHANGE_FEED=off, the feed lost)
//! only reads past the cache and loads that bypassed Redis set floors, and a
//! floor lapses when the cache gives its version back. The memory tier never
//! holds a version other than an item's floor: setting a floor evicts it,
//! and it keeps nothing else while the floor stands; so a memory hit, which
//! checks nothing, is admitted too.
//!
//! A stale copy (a fail-safe copy re-served after a failed load, a copy
//! within the stale-while-revalidate window) is not judged by the feed's
//! position: a change marks such a copy, it does not remove it. So the
//! versions served that the cache's last good copy may be older than (read
//! past the cache, loaded while Redis was bypassed, ahead of the feed) are
//! kept after their floors lapse, and a stale copy must be that version or
//! loaded here after it, or it is a miss too (a 503 where no load succeeds:
//! never an older version instead).
//!
//! Bounded: past [`MAX_FLOORS`] the lowest eighth is dropped. With a
//! position (replication), their highest position becomes a floor of every
//! item (the feed passes it soon; meanwhile a lookup is admitted only once
//! it has, a load only if it began after). Without one the dropped floors
//! are forgotten: the one condition under which this process may go back in
//! time (more than MAX_FLOORS items read past the cache, or while Redis was
//! bypassed, before the cache gave them back, in trigger or off mode). The
//! versions kept for stale copies are bounded the same way, the oldest
//! quarter dropped: a stale copy of one of those may then be older than a
//! version served before it.

use std::{
    collections::HashMap,
    hash::Hash,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Mutex, PoisonError,
    },
    time::Instant,
};

use crate::cache::Entry;

/// Most floors kept at once.
pub const MAX_FLOORS: usize = 65_536;

/// One item's floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Floor {
    /// The version served.
    etag: u64,
    /// A WAL position its rows are no newer than.
    upto: u64,
    /// When it was set (a load that began later read a later snapshot).
    set: Instant,
}

/// A version served that the cache's last good copy may be older than,
/// kept past its floor for judging stale copies (see [`Floors::admits_stale`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Served {
    etag: u64,
    /// When it was first served.
    set: Instant,
}

#[derive(Debug)]
struct Book<K> {
    items: HashMap<K, Floor>,
    /// Versions served that may be newer than the last good copy in Redis
    /// (read past the cache, loaded while Redis was bypassed, or ahead of
    /// the feed), kept after their floors lapse: a stale copy is not judged
    /// by the feed's position (a fail-safe copy is served on purpose after
    /// a change invalidated it). Bounded by MAX_FLOORS, oldest dropped.
    served: HashMap<K, Served>,
    /// Every item's floor once floors were dropped for room (replication
    /// mode): their highest position, and when (no ETag: only a lookup past
    /// it or a later load is admitted).
    all: Option<(u64, Instant)>,
}

/// The floors of one process.
#[derive(Debug)]
pub(super) struct Floors<K> {
    /// The change feed's position as this process read it: every change up
    /// to it applied to Redis and forgotten by the memory tier (0: none
    /// known).
    position: AtomicU64,
    /// Whether any floor stands: an answer then takes the lock.
    any: AtomicBool,
    /// Whether any served version is kept (stale copies take the lock).
    any_served: AtomicBool,
    /// A std mutex: held for a lookup or an insert, never across an await.
    book: Mutex<Book<K>>,
    /// Off: a deliberate defect of the test kit's, for the coherence
    /// checker to find (no floor is ever set).
    off: bool,
}

impl<K> Default for Floors<K> {
    fn default() -> Self {
        Self {
            position: AtomicU64::new(0),
            any: AtomicBool::new(false),
            any_served: AtomicBool::new(false),
            book: Mutex::new(Book {
                items: HashMap::new(),
                served: HashMap::new(),
                all: None,
            }),
            off: false,
        }
    }
}

impl<K> Floors<K> {
    /// Floors that are never set (the test kit's deliberate defect).
    #[cfg(feature = "testkit")]
    pub fn off() -> Self {
        Self {
            off: true,
            ..Self::default()
        }
    }
}

impl<K: Eq + Hash + Clone> Floors<K> {
    /// The feed's position now: read it before a lookup, for
    /// [`Floors::admits`].
    pub fn position(&self) -> u64 {
        self.position.load(Ordering::SeqCst)
    }

    /// The feed has applied every change up to `position` (0: it knows no
    /// position any more: Redis may have lost what it applied). Floors at or
    /// below it lapse.
    pub fn advance(&self, position: u64) {
        self.position.store(position, Ordering::SeqCst);
        if position == 0 || !self.any.load(Ordering::SeqCst) {
            return;
        }
        let mut book = self.lock();
        book.items.retain(|_, floor| floor.upto > position);
        if book.all.is_some_and(|(upto, _)| upto <= position) {
            book.all = None;
        }
        self.any.store(
            !book.items.is_empty() || book.all.is_some(),
            Ordering::SeqCst,
        );
    }

    /// Whether `entry`, looked up at feed position `looked_at` (or loaded
    /// here: see [`Entry::loaded_here`]), may be served for `key`.
    pub fn admits(&self, key: &K, entry: &Entry, looked_at: u64) -> bool {
        if !self.any.load(Ordering::SeqCst) {
            return true;
        }
        let mut book = self.lock();
        let loaded_after = |set: Instant| entry.loaded_here().is_some_and(|began| began >= set);
        if let Some((upto, set)) = book.all {
            if looked_at < upto && !loaded_after(set) {
                return false;
            }
        }
        let Some(floor) = book.items.get(key).copied() else {
            return true;
        };
        if entry.etag() == floor.etag {
            // Without a position, a floor lapses once the cache gives its
            // version back: it holds it (or later) from now on.
            if self.position() == 0 && entry.loaded_here().is_none() {
                book.items.remove(key);
            }
            return true;
        }
        (looked_at != 0 && looked_at >= floor.upto) || loaded_after(floor.set)
    }

    /// `entry` was served for `key`: what this process serves of it from
    /// now on must be as new. `forced`: set even without a feed position (a
    /// read past the cache, a load that bypassed Redis). Returns whether a
    /// floor stands for it now (the memory tier then keeps only its
    /// version).
    pub fn raise(&self, key: &K, entry: &Entry, forced: bool) -> bool {
        let upto = entry.upto();
        let position = self.position();
        if self.off || upto == 0 {
            return false;
        }
        if forced || (position != 0 && upto > position) {
            self.keep_served(key, entry);
        } else {
            self.supersede_served(key, entry);
        }
        if (position == 0 && !forced) || (position != 0 && upto <= position) {
            return false;
        }
        let mut book = self.lock();
        if book.items.len() >= MAX_FLOORS && !book.items.contains_key(key) {
            Self::make_room(&mut book, position != 0);
        }
        let now = Instant::now();
        let floor = book.items.entry(key.clone()).or_insert(Floor {
            etag: entry.etag(),
            upto,
            set: now,
        });
        if floor.etag != entry.etag() {
            // A newer version (it was admitted): its floor replaces the
            // older one, no lower.
            *floor = Floor {
                etag: entry.etag(),
                upto: floor.upto.max(upto),
                set: now,
            };
        } else {
            floor.upto = floor.upto.max(upto);
        }
        self.any.store(true, Ordering::SeqCst);
        true
    }

    /// A change to `key` committed at WAL position `change` is applied to
    /// the Redis primary but not yet acknowledged by a replica (see
    /// `redis/replicas.rs`): a failover may give back the entry it
    /// invalidated. Until the feed's position passes it (every change up
    /// to it acknowledged), an answer for `key` is admitted only if this
    /// process loaded it after now (or it is the version of a floor that
    /// stood: served here already). Replication mode only: without a
    /// position a pin would never lapse.
    pub fn pin(&self, key: &K, change: u64) {
        if self.off || change == 0 {
            return;
        }
        let mut book = self.lock();
        if book.items.len() >= MAX_FLOORS && !book.items.contains_key(key) {
            Self::make_room(&mut book, true);
        }
        let floor = book.items.entry(key.clone()).or_insert(Floor {
            // No version's: only a load after now is admitted.
            etag: 0,
            upto: change,
            set: Instant::now(),
        });
        floor.upto = floor.upto.max(change);
        self.any.store(true, Ordering::SeqCst);
    }

    /// Keeps the version `entry` of `key` as served, for the stale copies.
    fn keep_served(&self, key: &K, entry: &Entry) {
        let mut book = self.lock();
        if book.served.len() >= MAX_FLOORS && !book.served.contains_key(key) {
            // The oldest quarter goes.
            let mut sets: Vec<Instant> = book.served.values().map(|s| s.set).collect();
            let cut = sets.len() / 4;
            let (_, &mut bound, _) = sets.select_nth_unstable(cut);
            book.served.retain(|_, s| s.set > bound);
        }
        let now = Instant::now();
        let served = book.served.entry(key.clone()).or_insert(Served {
            etag: entry.etag(),
            set: now,
        });
        if served.etag != entry.etag() {
            *served = Served {
                etag: entry.etag(),
                set: now,
            };
        }
        self.any_served.store(true, Ordering::SeqCst);
    }

    /// `entry`, an answer admitted for `key` and not ahead of the feed,
    /// is no older than the version kept served for it: it takes its place
    /// (else a stale copy of `entry`, which this process served, would be
    /// refused for being another version than an older one).
    fn supersede_served(&self, key: &K, entry: &Entry) {
        if !self.any_served.load(Ordering::SeqCst) {
            return;
        }
        let mut book = self.lock();
        if let Some(served) = book.served.get_mut(key) {
            if served.etag != entry.etag() {
                *served = Served {
                    etag: entry.etag(),
                    set: Instant::now(),
                };
            }
        }
    }

    /// Whether a stale copy (a fail-safe copy, a copy within the
    /// stale-while-revalidate window) may be served for `key`: never one
    /// older than a version served here since the cache's last good copy
    /// may have been stored. The feed's position says nothing of such a
    /// copy: it must be the version served, or loaded here after it.
    pub fn admits_stale(&self, key: &K, entry: &Entry) -> bool {
        if !self.admits(key, entry, 0) {
            return false;
        }
        if !self.any_served.load(Ordering::SeqCst) {
            return true;
        }
        let book = self.lock();
        book.served.get(key).is_none_or(|served| {
            served.etag == entry.etag()
                || entry.loaded_here().is_some_and(|began| began >= served.set)
        })
    }

    /// Whether the memory tier may keep `entry` for `key`: only an item's
    /// floor version while it has one.
    pub fn allows_fill(&self, key: &K, entry: &Entry) -> bool {
        if !self.any.load(Ordering::SeqCst) {
            return true;
        }
        let book = self.lock();
        if book.all.is_some() && entry.loaded_here().is_none() {
            return false;
        }
        book.items
            .get(key)
            .is_none_or(|floor| floor.etag == entry.etag())
    }

    /// The position a load of `key` must read at least (0: none): a
    /// replica must have replayed it.
    pub fn upto(&self, key: &K) -> u64 {
        if !self.any.load(Ordering::SeqCst) {
            return 0;
        }
        let book = self.lock();
        let own = book.items.get(key).map_or(0, |floor| floor.upto);
        own.max(book.all.map_or(0, |(upto, _)| upto))
    }

    /// Floors standing.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().items.len()
    }

    /// Drops the lowest eighth of the floors; with a position, their
    /// highest becomes every item's floor.
    fn make_room(book: &mut Book<K>, positioned: bool) {
        let mut uptos: Vec<u64> = book.items.values().map(|floor| floor.upto).collect();
        let cut = uptos.len() / 8;
        let (_, &mut bound, _) = uptos.select_nth_unstable(cut);
        book.items.retain(|_, floor| floor.upto > bound);
        if positioned {
            let all = book.all.map_or(bound, |(upto, _)| upto.max(bound));
            book.all = Some((all, Instant::now()));
        } else {
            tracing::warn!(
                kept = book.items.len(),
                "too many items read past the cache without a change feed position: the oldest floors are forgotten"
            );
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Book<K>> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::cache::Status;

    fn looked_up(body: &str) -> Entry {
        Entry::new(
            Status::Found,
            body.as_bytes(),
            Duration::from_secs(60),
            Duration::ZERO,
        )
    }

    fn loaded(body: &str, began: Instant, upto: u64) -> Entry {
        Entry::from_load(
            Status::Found,
            body.as_bytes(),
            Duration::from_secs(60),
            Duration::ZERO,
            began,
            upto,
        )
    }

    #[test]
    fn with_no_floor_everything_is_admitted() {
        let floors = Floors::<i64>::default();
        assert!(floors.admits(&1, &looked_up("v1"), 0));
        assert!(floors.allows_fill(&1, &looked_up("v1")));
        assert_eq!(floors.upto(&1), 0);
    }

    #[test]
    fn after_a_newer_version_an_older_one_from_the_cache_is_a_miss_until_the_feed_passes_it() {
        let floors = Floors::<i64>::default();
        floors.advance(100);
        let v2 = loaded("v2", Instant::now(), 500);
        assert!(floors.raise(&1, &v2, true));
        // The cache, looked up before the feed passed 500: v1 is refused,
        // v2 itself admitted; other items untouched.
        assert!(!floors.admits(&1, &looked_up("v1"), 100));
        assert!(floors.admits(&1, &looked_up("v2"), 100));
        assert!(floors.admits(&2, &looked_up("v1"), 100));
        assert!(!floors.allows_fill(&1, &looked_up("v1")));
        assert!(floors.allows_fill(&1, &looked_up("v2")));
        assert_eq!(floors.upto(&1), 500);
        // Looked up once the feed had passed 500: the cache has the change.
        assert!(floors.admits(&1, &looked_up("v3"), 500));
        floors.advance(500);
        assert_eq!(floors.len(), 0);
        assert!(floors.admits(&1, &looked_up("v1"), 500));
    }

    #[test]
    fn a_load_that_began_after_the_floor_is_admitted_one_that_began_before_is_not() {
        crate::cache::entry::process_epoch();
        let floors = Floors::<i64>::default();
        floors.advance(100);
        let before = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        floors.raise(&1, &loaded("v2", Instant::now(), 500), true);
        std::thread::sleep(Duration::from_millis(2));
        assert!(!floors.admits(&1, &loaded("v1", before, 400), 100));
        assert!(floors.admits(&1, &loaded("v3", Instant::now(), 600), 100));
    }

    #[test]
    fn a_change_not_yet_on_a_replica_refuses_the_cache_until_the_feed_passes_it() {
        crate::cache::entry::process_epoch();
        let floors = Floors::<i64>::default();
        floors.advance(100);
        let before = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        floors.pin(&1, 300);
        std::thread::sleep(Duration::from_millis(2));
        // A failover may give back the entry the change invalidated: what
        // Redis answers is refused, whatever version; a load of this
        // process's after the pin is admitted, one before it is not.
        assert!(!floors.admits(&1, &looked_up("v1"), 100));
        assert!(!floors.admits(&1, &loaded("v1", before, 200), 100));
        assert!(floors.admits(&1, &loaded("v2", Instant::now(), 350), 100));
        assert!(!floors.allows_fill(&1, &looked_up("v1")));
        assert!(floors.admits(&2, &looked_up("v1"), 100));
        // A later pin never lowers it.
        floors.pin(&1, 200);
        assert_eq!(floors.upto(&1), 300);
        // Acknowledged: the feed's position passes it.
        floors.advance(300);
        assert!(floors.admits(&1, &looked_up("v1"), 300));
        // Pinned while no position is known (the stream taken up again
        // after a failover): refused until one passes it.
        let unpositioned = Floors::<i64>::default();
        unpositioned.pin(&1, 300);
        assert!(!unpositioned.admits(&1, &looked_up("v1"), 0));
        unpositioned.advance(300);
        assert!(unpositioned.admits(&1, &looked_up("v1"), 300));
    }

    #[test]
    fn answers_the_feed_has_passed_set_no_floor() {
        let floors = Floors::<i64>::default();
        floors.advance(1000);
        assert!(!floors.raise(&1, &loaded("v1", Instant::now(), 900), false));
        assert!(!floors.raise(&1, &looked_up("v1"), true), "upto unknown");
        assert_eq!(floors.len(), 0);
        // Ahead of the feed: a floor, forced or not.
        assert!(floors.raise(&1, &loaded("v2", Instant::now(), 1200), false));
    }

    #[test]
    fn without_a_position_only_forced_floors_stand_and_lapse_when_the_cache_gives_them_back() {
        let floors = Floors::<i64>::default();
        assert!(!floors.raise(&1, &loaded("v2", Instant::now(), 500), false));
        assert!(floors.raise(&1, &loaded("v2", Instant::now(), 500), true));
        assert!(!floors.admits(&1, &looked_up("v1"), 0));
        assert!(floors.admits(&1, &looked_up("v2"), 0));
        assert_eq!(floors.len(), 0, "the cache gave the version back");
        assert!(floors.admits(&1, &looked_up("v1"), 0));
    }

    #[test]
    fn a_newer_version_replaces_the_floor_never_lower() {
        let floors = Floors::<i64>::default();
        floors.advance(100);
        floors.raise(&1, &loaded("v2", Instant::now(), 500), true);
        floors.raise(&1, &loaded("v3", Instant::now(), 400), true);
        assert_eq!(floors.upto(&1), 500);
        assert!(!floors.admits(&1, &looked_up("v2"), 100));
        assert!(floors.admits(&1, &looked_up("v3"), 100));
    }

    #[test]
    fn a_stale_copy_older_than_a_version_served_is_refused_after_the_floor_lapses() {
        crate::cache::entry::process_epoch();
        let floors = Floors::<i64>::default();
        floors.advance(100);
        let served = loaded("v2", Instant::now(), 500);
        floors.raise(&1, &served, true);
        floors.advance(600);
        assert_eq!(floors.len(), 0, "the floor lapsed");
        // A fresh copy looked up after the feed passed it: admitted.
        assert!(floors.admits(&1, &looked_up("v3"), 600));
        // A stale copy of an older version: never, the position says
        // nothing of it; the version served, or a later load, is.
        assert!(!floors.admits_stale(&1, &looked_up("v1")));
        assert!(floors.admits_stale(&1, &looked_up("v2")));
        std::thread::sleep(Duration::from_millis(2));
        assert!(floors.admits_stale(&1, &loaded("v3", Instant::now(), 700)));
        // Other items, and answers behind the feed, keep nothing.
        assert!(floors.admits_stale(&2, &looked_up("v1")));
        floors.raise(&3, &loaded("old", Instant::now(), 50), false);
        assert!(floors.admits_stale(&3, &looked_up("older")));
    }

    #[test]
    fn a_version_served_after_the_feed_passed_one_kept_is_the_one_stale_copies_are_held_to() {
        crate::cache::entry::process_epoch();
        let floors = Floors::<i64>::default();
        floors.advance(100);
        // v2 loaded ahead of the feed, then the feed passes a delete: the
        // tombstone, looked up and served, is what a stale copy may be.
        floors.raise(&1, &loaded("v2", Instant::now(), 500), false);
        floors.advance(900);
        let tombstone = loaded("gone", Instant::now() - Duration::from_secs(1), 800);
        assert!(floors.admits(&1, &tombstone, 900));
        assert!(!floors.raise(&1, &tombstone, false));
        assert!(floors.admits_stale(&1, &tombstone));
        assert!(
            !floors.admits_stale(&1, &looked_up("v2")),
            "older than served"
        );
    }

    #[test]
    fn past_the_bound_the_lowest_floors_become_every_items_floor() {
        let floors = Floors::<i64>::default();
        floors.advance(1);
        for id in 0..MAX_FLOORS as i64 {
            floors.raise(&id, &loaded("v", Instant::now(), 10 + id as u64), true);
        }
        assert_eq!(floors.len(), MAX_FLOORS);
        floors.raise(&-1, &loaded("v", Instant::now(), 1 << 40), true);
        assert!(floors.len() < MAX_FLOORS);
        // An item never floored is held to the dropped floors' highest.
        assert!(floors.upto(&-2) > 10);
        assert!(!floors.admits(&-2, &looked_up("old"), 1));
        assert!(floors.admits(&-2, &looked_up("old"), 1 << 30));
        floors.advance(1 << 41);
        assert_eq!(floors.upto(&-2), 0);
        assert_eq!(floors.len(), 0);
    }
}
