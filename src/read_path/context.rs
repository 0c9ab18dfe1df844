//! The protocol: what the read path's roles share. A flight and its
//! leader, a background refresh, a claim won at a first look and the load
//! lab's reader are each handed this context, never the
//! [`ReadPath`](super::ReadPath) itself: they reach the source, Redis, the settings,
//! the memory tier and the cutoff through it, and nothing of the read
//! path's own bookkeeping (its flights, refreshes, existence guard, warm
//! keys).

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use tokio_util::task::TaskTracker;

use super::{
    answer::{Answer, Served},
    floor::Floors,
    load::Loader,
    memory::{MemoryTier, Ticket},
    settings::Settings,
    source::Source,
    won::WonClaims,
};
use crate::{
    cache::{now_millis, Keys},
    redis::{RedisCommands, Subscriber},
};

/// See the module's comment. Shared behind an `Arc`: the tasks a role
/// leaves behind (a finish, a let-go, a refresh) keep it.
pub(super) struct Context<S: Source> {
    pub loader: Loader<S>,
    pub keys: Keys,
    pub redis: RedisCommands,
    pub subscriber: Arc<Subscriber>,
    pub settings: Settings,
    /// Flights and background work: shutdown waits for them.
    pub tasks: TaskTracker,
    /// Fresh entries kept in this process (memory.rs).
    pub memory: MemoryTier<S::Key>,
    /// Claims won at first looks, for the keys' flights (won.rs).
    pub won: Arc<WonClaims<S::Key>>,
    /// What this process must serve no older than (floor.rs).
    pub floors: Floors<S::Key>,
    /// The cutoff in force here, unix milliseconds: every entry read before
    /// it is invalid (`invalidate --all`; see `apply.rs`). Only ever raised.
    cutoff: AtomicU64,
}

impl<S: Source> Context<S> {
    pub fn new(
        loader: Loader<S>,
        keys: Keys,
        redis: RedisCommands,
        subscriber: Arc<Subscriber>,
        settings: Settings,
        memory: MemoryTier<S::Key>,
    ) -> Self {
        #[cfg(feature = "testkit")]
        let floors = if settings.hooks.no_floors {
            Floors::off()
        } else {
            Floors::default()
        };
        #[cfg(not(feature = "testkit"))]
        let floors = Floors::default();
        Self {
            loader,
            keys,
            redis,
            subscriber,
            settings,
            tasks: TaskTracker::new(),
            memory,
            won: Arc::default(),
            floors,
            cutoff: AtomicU64::new(0),
        }
    }

    /// The verdict on `entry` at `now` (see `freshness::judge`), but for a
    /// copy another instance re-served after its load failed: while this
    /// instance's own loads succeed (within FAILURE_TTL), that failure may
    /// be that instance's alone (its connection to PostgreSQL lost, the
    /// rest of the fleet fine), and its copy, older than the last change
    /// perhaps, is no answer here: this instance loads the item itself.
    /// Once its loads fail too, it serves the copy as the fleet's fail-safe.
    pub fn judge(
        &self,
        entry: Option<crate::cache::Entry>,
        now: u64,
        grace: std::time::Duration,
    ) -> super::freshness::Verdict {
        use super::freshness::{judge, Verdict};
        #[cfg(feature = "testkit")]
        let entry = match self.settings.hooks.changed_unflagged {
            true => entry.map(|entry| entry.unflagged_changed()),
            false => entry,
        };
        match judge(entry, now, grace, self.cutoff()) {
            Verdict::Backoff(_) if self.loader.answered_within(self.settings.failure_ttl) => {
                Verdict::Miss
            }
            verdict => verdict,
        }
    }

    /// The cutoff in force here (unix ms).
    pub fn cutoff(&self) -> u64 {
        self.cutoff.load(Ordering::Relaxed)
    }

    /// Raises the cutoff to `to` if it is higher; the cutoff now in force.
    pub fn raise_cutoff(&self, to: u64) -> u64 {
        self.cutoff.fetch_max(to, Ordering::Relaxed).max(to)
    }

    /// Keeps what a flight or a refresh read from Redis, from a ready
    /// message or from the source as leader; not a bypass (Redis is failing,
    /// and with it the change feed's applications) nor a stale copy.
    /// `ticket` was taken before anything was read (see memory.rs).
    pub fn keep_in_memory(&self, key: &S::Key, answer: &Answer, ticket: &Ticket) {
        if matches!(
            answer.served,
            Served::Miss | Served::CoalescedRemote | Served::Hit
        ) {
            self.fill_memory(key, answer.entry(), ticket);
        }
    }

    /// Keeps `entry` in the memory tier unless the item's floor is another
    /// version (floor.rs).
    pub fn fill_memory(&self, key: &S::Key, entry: &crate::cache::Entry, ticket: &Ticket) {
        if self.floors.allows_fill(key, entry) {
            self.memory.fill(key, entry, ticket, now_millis());
        }
    }
}
