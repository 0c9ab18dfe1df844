//! The protocol: what a read answers, and how the answer was produced.

use crate::cache::{Entry, Status};

/// How an answer was produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// A fresh entry found in this process's memory tier.
    Memory,
    /// A fresh entry found by the first GET.
    Hit,
    /// A stale entry: inside the grace window (refreshing in the background)
    /// or a fail-safe copy after a failed load.
    Stale,
    /// Loaded by this request's own flight, as leader.
    Miss,
    /// Served by the load of another request of this process.
    CoalescedLocal,
    /// Served by the load of another instance (message or re-check).
    CoalescedRemote,
    /// Redis was skipped (failed, breaker open, or strategy `none`).
    Bypass,
    /// Loaded from the source and not cached: the item is larger than
    /// MAX_ENTRY_BYTES (a too-large marker is cached in its place).
    TooLarge,
    /// Not found, known to be missing by the existence guard: no load, and
    /// nothing cached (see existence.rs).
    KnownMissing,
}

/// A found or not-found entry and how it was served. Never a failure: a
/// failed entry becomes [`ReadError::Unavailable`] in [`Answer::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    entry: Entry,
    pub served: Served,
}

impl Answer {
    /// The answer for `entry`, served as `served` — or as `Stale` when it is
    /// a fail-safe copy re-served after a failed load, whoever loaded it.
    pub fn new(entry: Entry, served: Served) -> Result<Self, ReadError> {
        let served = match entry.status() {
            // A marker is never an answer: its readers load the item (a
            // bug that let one through would answer 503, not a wrong 404).
            Status::Failed | Status::TooLarge => return Err(ReadError::Unavailable),
            _ if entry.is_backoff() => Served::Stale,
            _ => served,
        };
        Ok(Self { entry, served })
    }

    /// The entry: found or not found.
    pub fn entry(&self) -> &Entry {
        &self.entry
    }

    /// As seen by a request that joined another request's flight.
    pub(super) fn joined(self) -> Self {
        let served = match self.served {
            Served::Miss | Served::CoalescedRemote => Served::CoalescedLocal,
            other => other,
        };
        Self { served, ..self }
    }
}

/// Why a read produced no entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// The load failed (here, at the remote leader, or within FAILURE_TTL of
    /// a failure) and no stale copy was at hand.
    #[error("the backend failed")]
    Unavailable,
    /// WAIT_TIMEOUT passed while waiting for another's load.
    #[error("timed out waiting for the load")]
    Timeout,
    /// No connection to the source was free in time (see [`super::Busy`]).
    #[error("the source is busy")]
    Busy,
}

/// What one flight ended with, as its owner sees it; shared by its joiners.
pub(super) type Outcome = Result<Answer, ReadError>;

impl From<super::Busy> for ReadError {
    fn from(_: super::Busy) -> Self {
        ReadError::Busy
    }
}
