//! The Redis side: what the commands answer, typed, and how a value read
//! from a value key is decoded (the lookups', the claims' and the first
//! look's).

use std::time::Duration;

use bytes::Bytes;

use crate::{
    cache::{is_claim, DecodeError, Entry},
    telemetry::metrics,
};

/// What PTTL says of a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockTtl {
    /// No such key: released or expired.
    Absent,
    /// The key has no expiry (set from outside the protocol).
    NoExpiry,
    /// It expires after this long.
    Expires(Duration),
}

/// What the leader sees before it reads: the stored entry, and the item's
/// change fence (empty when none), which its finish must find unchanged.
#[derive(Debug)]
pub struct Before {
    pub entry: Option<Entry>,
    pub fence: String,
}

/// What a claim of an item's value key met (see
/// [`RedisCommands::claim_value`](crate::redis::RedisCommands::claim_value)).
#[derive(Debug, PartialEq)]
pub enum ValueClaim {
    /// The key was absent and holds our claim now; the change fence (empty
    /// when none), read in the same round trip, which the finish must find
    /// unchanged.
    Won { fence: String },
    /// Another leader's claim is there: wait for it.
    Held,
    /// Something else is stored there (an entry, a copy kept past its
    /// freshness, bytes of another layout), given as read: nothing was
    /// taken.
    Stored(Bytes),
}

/// What a request's first look at an item found (see
/// [`RedisCommands::look_up_or_claim`](crate::redis::RedisCommands::look_up_or_claim)).
#[derive(Debug)]
pub enum FirstLook {
    /// Nothing was there: the item is claimed for this request's flight.
    Claimed,
    /// What the key holds, decoded as a lookup does (`None`: a leader's
    /// claim, or bytes that are not an entry).
    Looked(Option<Entry>),
}

/// Run where a won claim's reply is read, before any later reply of the
/// node's value claims is handed out (see [`RedisCommands::look_up_or_claim`](crate::redis::RedisCommands::look_up_or_claim)).
pub type OnWon = Box<dyn FnOnce() + Send>;

/// An entry read from `key`; bytes that are not one count as absent (a
/// leader's claim too, without a word: it is one).
pub(super) fn decoded(key: &str, raw: Option<Bytes>) -> Option<Entry> {
    raw.filter(|raw| !is_claim(raw)).and_then(|raw| match Entry::decode(raw) {
        Ok(entry) => Some(entry),
        Err(error) => {
            metrics::garbage("entry");
            if let DecodeError::Version(_) = error {
                // An instance of another layout wrote it (a rolling
                // upgrade): expected, and replaced by the next store.
                tracing::debug!(%error, key, "cache entry of another layout, treated as a miss");
            } else {
                tracing::warn!(%error, key, "undecodable cache entry, treated as a miss");
            }
            None
        }
    })
}
