//! What the read path loads from: a [`Source`], the change a load must
//! include ([`Since`]), and how a load fails ([`LoadError`], [`Busy`]).

use std::{fmt::Display, future::Future, hash::Hash};

use bytes::Bytes;

/// Why a load failed; logged by the read path, never shown to clients.
pub type LoadError = anyhow::Error;

/// A load refused for want of capacity (every connection to the source
/// taken, none free in time): the key did not fail, this instance was
/// busy. A [`Source`] returns it inside its [`LoadError`]; nothing is then
/// stored for the key (no failure marker), the leader lets go of its lock
/// at once for another instance to take, and the request is answered 503
/// with Retry-After.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no connection to the source was free in time")]
pub struct Busy;

/// The last change to an item a load must see: the change fence its
/// leader's claim read (the commit LSN of the change, with the change feed
/// in replication mode). A source with read replicas reads the item only
/// from one that has replayed that far; one without ignores it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Since(pub u64);

impl Since {
    /// No change within the fence's lifetime: any replica in rotation will do.
    pub const ANY: Since = Since(0);
    /// Only the primary will do (a fence that is no LSN; the load lab's
    /// baselines, which claim nothing).
    pub const PRIMARY: Since = Since(u64::MAX);

    /// What a fence read by a claim asks for: nothing when there is none.
    pub fn of_fence(fence: &str) -> Self {
        if fence.is_empty() {
            return Since::ANY;
        }
        fence.parse().map(Since).unwrap_or(Since::PRIMARY)
    }
}

/// What one load read: the item's body (`None`: it does not exist), and a
/// WAL position its rows are no newer than: the server's, read after the
/// rows' snapshot (0: not known). A process keeps from serving an older
/// version of an item than one it served by it (see `floor.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    pub body: Option<Bytes>,
    pub upto: u64,
}

/// What one statement of many keys read: the bodies of the keys that
/// exist, and a position no row of the statement is newer than (as
/// [`Loaded::upto`]; the keys not found were absent as of it too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedMany<K> {
    pub found: Vec<(K, Bytes)>,
    pub upto: u64,
}

/// What the read path loads on a miss.
pub trait Source: Send + Sync + 'static {
    /// What identifies an item; its `Display` form goes inside the hash tag.
    type Key: Clone + Eq + Hash + Display + Send + Sync + 'static;

    /// The item's response body, `None` when it does not exist, read so as
    /// to include `since`, with the position it is no newer than.
    fn load(
        &self,
        key: &Self::Key,
        since: Since,
    ) -> impl Future<Output = Result<Loaded, LoadError>> + Send;

    /// Whether loads may read a copy that lags the primary (read
    /// replicas), so that a leader must learn the item's last change (its
    /// fence) before it loads. `false` (the default): every load reads the
    /// primary, and a claim reads no fence.
    fn reads_copies(&self) -> bool {
        false
    }

    /// The item's number in the existence guard (see existence.rs); `None`
    /// (the default) keeps the item out of it: its misses always load.
    fn ordinal(_key: &Self::Key) -> Option<u64> {
        None
    }

    /// Every item's ordinal, for the existence guard's build: `None` (the
    /// default) when the source has no guard.
    fn ordinals(
        &self,
    ) -> impl Future<Output = Result<Option<roaring::RoaringTreemap>, LoadError>> + Send {
        async { Ok(None) }
    }

    /// Every item changed at `since` (a change too large to fence item by
    /// item, or a gap in the feed: [`Since::PRIMARY`] when its LSN is not
    /// known), the fleet's cutoff raised to `cutoff` (unix ms) for it:
    /// every load must include it for the fence's lifetime, as if each item
    /// were fenced with it. Returns the keys read lately, at or after the
    /// cutoff, from a copy that had not replayed it, for the caller to fence
    /// with the change (`None`: not known; the caller raises the cutoff
    /// again). The default: none.
    fn all_changed(&self, _since: Since, _cutoff: u64) -> Option<Vec<Self::Key>> {
        Some(Vec::new())
    }

    /// The bodies of those of `keys` that exist, in one statement (the
    /// keys are distinct; see `batch.rs`), each read so as to include its
    /// [`Since`].
    fn load_many(
        &self,
        keys: &[(Self::Key, Since)],
    ) -> impl Future<Output = Result<LoadedMany<Self::Key>, LoadError>> + Send;
}
