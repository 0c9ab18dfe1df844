//! The cache: the cache entry envelope, also used as the `ready` message.
//!
//! A small binary header in front of the response body bytes, so that a hit
//! is served by slicing the stored bytes (no JSON parsing, no re-serialising):
//!
//! ```text
//! offset  size  field
//! 0       1     version (3)
//! 1       1     status: 0 found, 1 not found, 2 failed (messages and failure markers),
//!               3 too large (a marker: the item is over MAX_ENTRY_BYTES, load it yourself)
//! 2       1     flags: bit 0 BACKOFF, a stale copy re-served after a failed load;
//!               bit 1 INVALIDATED, a copy a change made untrustworthy;
//!               bit 2 CHANGED, made stale by a change with
//!               STALE_WHILE_REVALIDATE on: never fresh again
//! 3       8     stored_at, unix milliseconds, big endian
//! 11      8     fresh_until, unix milliseconds: the logical freshness deadline
//! 19      4     load time of the load that produced it, microseconds
//! 23      8     ETag: xxh3-64 of the body
//! 31      8     backoff_until, unix milliseconds: the end of a BACKOFF copy's
//!               backoff (0 otherwise)
//! 39      8     upto: a WAL position the load's rows are no newer than (the
//!               server's, read after the rows' snapshot; 0: not known), by
//!               which a process keeps from serving an older version of an
//!               item than one it served (`read_path/floor.rs`)
//! 47      ..    body (found only)
//! ```
//!
//! One value key holds an item's entry for its whole life, the fail-safe
//! window included: past freshness (and the stale-while-revalidate window)
//! it is no longer served to readers, but it stays, the body stored once,
//! as the copy a failed load falls back on. A change marks it INVALIDATED
//! in place for the same reason (`redis/scripts/apply.lua`), and a failed
//! load re-serves it flagged BACKOFF until backoff_until
//! (`redis/scripts/finish/finish.lua`). The scripts are given the constants below,
//! so the layout is written down once.
//!
//! Version 1 had no backoff_until and kept the fail-safe copy under a key of
//! its own; version 2 had no upto. During a rolling upgrade an instance
//! reads the other version's entries and messages as absent (a miss) and
//! replaces them: neither serves the other's entries, and a message it
//! cannot read makes a waiter look again, so neither waits on the other
//! past one look.
//!
//! While a leader loads an item nobody had stored (the key absent), the
//! value key holds its claim instead of an entry: [`CLAIM_PREFIX`] and the
//! leader's token, taken with `SET NX GET` (a memcache lease), so that the
//! lock, the value and the claim's lifetime are one key. Its first byte is
//! no version: readers take it for a miss and wait for its holder.
//!
//! Anything that does not decode is treated by callers as absent (a miss),
//! never as an error to the client.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};

/// The only envelope version this build writes and reads (byte 0).
pub const VERSION: u8 = 3;
/// Offset of the status byte.
pub const STATUS_AT: usize = 1;
/// Offset of the flags byte.
pub const FLAGS_AT: usize = 2;
/// Status byte values.
pub const STATUS_FOUND: u8 = 0;
pub const STATUS_NOT_FOUND: u8 = 1;
pub const STATUS_FAILED: u8 = 2;
pub const STATUS_TOO_LARGE: u8 = 3;
/// Offset of stored_at and of fresh_until (u64, big endian).
pub const STORED_AT: usize = 3;
pub const FRESH_UNTIL_AT: usize = 11;
/// Offset of the load time (u32 microseconds, big endian).
pub const LOAD_AT: usize = 19;
/// Offset of the ETag (u64).
pub const ETAG_AT: usize = 23;
/// Offset of backoff_until (u64, big endian).
pub const BACKOFF_UNTIL_AT: usize = 31;
/// Offset of upto (u64, big endian).
pub const UPTO_AT: usize = 39;
/// Bytes before the body.
pub const HEADER_LEN: usize = 47;
/// Flag: a stale copy stored after a failed load, served until
/// backoff_until (the backoff), without triggering refreshes.
pub const FLAG_BACKOFF: u8 = 1;
/// Flag: a change was applied after this entry was read. Never served to
/// readers; kept as the fail-safe copy (a deleted item's is a not-found
/// entry, so that its old body never comes back).
pub const FLAG_INVALIDATED: u8 = 2;
/// Flag: a change was applied after this entry was read, with
/// STALE_WHILE_REVALIDATE on: never fresh again, whatever a reader's clock
/// says of its fresh_until (the applier's clock, set to when it applied the
/// change); served stale in the grace window counted from then.
pub const FLAG_CHANGED: u8 = 4;

/// The start of a leader's claim in a value key (see above): a NUL, never
/// an envelope's version byte, then a name for people reading the key.
pub const CLAIM_PREFIX: &str = "\0claim:";

/// Whether `raw` is a leader's claim, not an entry.
pub fn is_claim(raw: &[u8]) -> bool {
    raw.starts_with(CLAIM_PREFIX.as_bytes())
}

/// The claim of the leader holding `token`.
pub fn claim_of(token: &str) -> String {
    let mut claim = String::with_capacity(CLAIM_PREFIX.len() + token.len());
    claim.push_str(CLAIM_PREFIX);
    claim.push_str(token);
    claim
}

/// What a load found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The item exists; the body is its JSON.
    Found,
    /// The item does not exist (negative caching).
    NotFound,
    /// The load failed; only in `ready` messages and failure markers.
    Failed,
    /// The item is larger than MAX_ENTRY_BYTES: a marker stored and
    /// published in its place, without the body, so that readers load it
    /// from the source themselves, at once, without waiting for a lock
    /// (Varnish's hit-for-pass).
    TooLarge,
}

/// Why bytes could not be read as an entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("entry shorter than its header ({0} bytes)")]
    Truncated(usize),
    #[error("unknown entry version {0}")]
    Version(u8),
    #[error("unknown entry status {0}")]
    Status(u8),
    #[error("a {0:?} entry carries a body")]
    UnexpectedBody(Status),
}

/// A decoded envelope; cloning is cheap (the bytes are reference counted).
/// Two entries are equal when their envelopes are, whoever loaded them.
#[derive(Debug, Clone)]
pub struct Entry {
    status: Status,
    flags: u8,
    stored_at: u64,
    fresh_until: u64,
    load_micros: u32,
    etag: u64,
    raw: Bytes,
    /// When this process began the load that made it, in nanoseconds from
    /// [`process_epoch`] plus one (0: it came from Redis or a message, or
    /// was not loaded). Never stored. (backoff_until and upto are read from
    /// `raw` when asked: a waiting request keeps its entries in its future.)
    loaded_here: u64,
}

/// The instant this process's [`Entry::loaded_here`] counts from: the
/// first call, which the read path makes when it is made, before any load
/// begins (a load begun earlier would count as begun then).
pub fn process_epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        // Every field is read from the envelope.
        self.raw == other.raw
    }
}

impl Eq for Entry {}

/// Milliseconds since the Unix epoch, the clock entries are stamped with.
pub fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Entry {
    /// Builds an entry stamped now, fresh for `fresh_for`.
    pub fn new(status: Status, body: &[u8], fresh_for: Duration, load_time: Duration) -> Self {
        let stored_at = now_millis();
        let fresh_until = stored_at.saturating_add(fresh_for.as_millis() as u64);
        Self::stamped(status, body, stored_at, fresh_until, load_time)
    }

    /// Builds an entry stamped now, fresh for `fresh_for`, for what this
    /// process loaded in a read that began at `began` and whose rows are no
    /// newer than WAL position `upto` (0: not known).
    pub fn from_load(
        status: Status,
        body: &[u8],
        fresh_for: Duration,
        load_time: Duration,
        began: std::time::Instant,
        upto: u64,
    ) -> Self {
        let stored_at = now_millis();
        let fresh_until = stored_at.saturating_add(fresh_for.as_millis() as u64);
        let mut entry = Self::layout(status, body, stored_at, fresh_until, load_time, upto);
        let since = began.saturating_duration_since(process_epoch());
        entry.loaded_here = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX - 1) + 1;
        entry
    }

    /// Builds an entry with explicit timestamps (unix milliseconds).
    pub fn stamped(
        status: Status,
        body: &[u8],
        stored_at: u64,
        fresh_until: u64,
        load_time: Duration,
    ) -> Self {
        Self::layout(status, body, stored_at, fresh_until, load_time, 0)
    }

    fn layout(
        status: Status,
        body: &[u8],
        stored_at: u64,
        fresh_until: u64,
        load_time: Duration,
        upto: u64,
    ) -> Self {
        let load_micros = u32::try_from(load_time.as_micros()).unwrap_or(u32::MAX);
        let body = if status == Status::Found { body } else { &[] };
        let etag = xxhash_rust::xxh3::xxh3_64(body);
        let mut buf = BytesMut::with_capacity(HEADER_LEN + body.len());
        buf.put_u8(VERSION);
        buf.put_u8(match status {
            Status::Found => STATUS_FOUND,
            Status::NotFound => STATUS_NOT_FOUND,
            Status::Failed => STATUS_FAILED,
            Status::TooLarge => STATUS_TOO_LARGE,
        });
        buf.put_u8(0);
        buf.put_u64(stored_at);
        buf.put_u64(fresh_until);
        buf.put_u32(load_micros);
        buf.put_u64(etag);
        buf.put_u64(0);
        buf.put_u64(upto);
        buf.put_slice(body);
        Self {
            status,
            flags: 0,
            stored_at,
            fresh_until,
            load_micros,
            etag,
            raw: buf.freeze(),
            loaded_here: 0,
        }
    }

    /// Reads an envelope; never panics, whatever the bytes (see the property test).
    pub fn decode(raw: Bytes) -> Result<Self, DecodeError> {
        // The version first: an entry of another layout (a rolling
        // upgrade) says so, whatever its length.
        match raw.first() {
            Some(&VERSION) => {}
            Some(&other) => return Err(DecodeError::Version(other)),
            None => return Err(DecodeError::Truncated(0)),
        }
        if raw.len() < HEADER_LEN {
            return Err(DecodeError::Truncated(raw.len()));
        }
        let status = match raw[STATUS_AT] {
            STATUS_FOUND => Status::Found,
            STATUS_NOT_FOUND => Status::NotFound,
            STATUS_FAILED => Status::Failed,
            STATUS_TOO_LARGE => Status::TooLarge,
            other => return Err(DecodeError::Status(other)),
        };
        if status != Status::Found && raw.len() > HEADER_LEN {
            return Err(DecodeError::UnexpectedBody(status));
        }
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[at..at + 8]);
            u64::from_be_bytes(b)
        };
        let mut load = [0u8; 4];
        load.copy_from_slice(&raw[LOAD_AT..LOAD_AT + 4]);
        Ok(Self {
            status,
            flags: raw[FLAGS_AT],
            stored_at: u64_at(STORED_AT),
            fresh_until: u64_at(FRESH_UNTIL_AT),
            load_micros: u32::from_be_bytes(load),
            etag: u64_at(ETAG_AT),
            raw,
            loaded_here: 0,
        })
    }

    pub fn status(&self) -> Status {
        self.status
    }

    /// The response body (empty unless found); shares the stored bytes.
    pub fn body(&self) -> Bytes {
        self.raw.slice(HEADER_LEN..)
    }

    /// The whole envelope, as written to Redis and published.
    pub fn raw(&self) -> &Bytes {
        &self.raw
    }

    /// When it was loaded, unix milliseconds.
    pub fn stored_at(&self) -> u64 {
        self.stored_at
    }

    /// Its logical freshness deadline, unix milliseconds.
    pub fn fresh_until(&self) -> u64 {
        self.fresh_until
    }

    /// When the load that produced it began reading, unix milliseconds: what
    /// it shows is no newer than that (stored_at less the load time).
    pub fn read_at(&self) -> u64 {
        self.stored_at
            .saturating_sub(u64::from(self.load_micros).div_ceil(1000))
    }

    /// Whether it is still fresh at `now` (unix milliseconds).
    pub fn is_fresh(&self, now: u64) -> bool {
        now < self.fresh_until
    }

    /// A stale copy re-served after a failed load: serve it until
    /// [`Entry::backoff_until`], do not refresh.
    pub fn is_backoff(&self) -> bool {
        self.flags & FLAG_BACKOFF != 0
    }

    /// The end of a backoff copy's backoff, unix milliseconds (0 otherwise).
    pub fn backoff_until(&self) -> u64 {
        self.u64_at(BACKOFF_UNTIL_AT)
    }

    /// The u64 at `at` of the header (big endian).
    fn u64_at(&self, at: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.raw[at..at + 8]);
        u64::from_be_bytes(b)
    }

    /// A change was applied after it was read: kept only as the fail-safe
    /// copy, never served to readers.
    pub fn is_invalidated(&self) -> bool {
        self.flags & FLAG_INVALIDATED != 0
    }

    /// Whether a change made it stale (see [`FLAG_CHANGED`]).
    pub fn is_changed(&self) -> bool {
        self.flags & FLAG_CHANGED != 0
    }

    /// The same entry marked as a backoff copy until `until` (unix ms), as
    /// the finish script stores it: no longer invalidated, since a failed
    /// load re-serves it on purpose.
    pub fn as_backoff(&self, until: u64) -> Self {
        let mut raw = self.raw.to_vec();
        raw[FLAGS_AT] = (raw[FLAGS_AT] | FLAG_BACKOFF) & !FLAG_INVALIDATED;
        raw[BACKOFF_UNTIL_AT..BACKOFF_UNTIL_AT + 8].copy_from_slice(&until.to_be_bytes());
        Self {
            flags: raw[FLAGS_AT],
            raw: Bytes::from(raw),
            ..self.clone()
        }
    }

    /// The same entry marked invalidated, as the apply script marks it.
    pub fn as_invalidated(&self) -> Self {
        let mut raw = self.raw.to_vec();
        raw[FLAGS_AT] = (raw[FLAGS_AT] | FLAG_INVALIDATED) & !FLAG_BACKOFF;
        Self {
            flags: raw[FLAGS_AT],
            raw: Bytes::from(raw),
            ..self.clone()
        }
    }

    /// The same entry flagged CHANGED (what a change applied with
    /// STALE_WHILE_REVALIDATE on makes of it, its fresh_until aside).
    #[cfg(test)]
    pub fn as_changed(&self) -> Self {
        let mut raw = self.raw.to_vec();
        raw[FLAGS_AT] |= FLAG_CHANGED;
        Self {
            flags: raw[FLAGS_AT],
            raw: Bytes::from(raw),
            ..self.clone()
        }
    }

    /// The same entry without its CHANGED flag (the coherence checker's
    /// `changed-unflagged` defect: judged as before the flag).
    #[cfg(feature = "testkit")]
    pub fn unflagged_changed(&self) -> Self {
        let mut raw = self.raw.to_vec();
        raw[FLAGS_AT] &= !FLAG_CHANGED;
        Self {
            flags: raw[FLAGS_AT],
            raw: Bytes::from(raw),
            ..self.clone()
        }
    }

    /// The same entry in an allocation of its own: keeping it does not keep
    /// alive a larger buffer its bytes were read into.
    pub fn detached(&self) -> Self {
        Self {
            raw: Bytes::copy_from_slice(&self.raw),
            ..self.clone()
        }
    }

    /// A strong validator over the body, stable across instances and builds.
    pub fn etag(&self) -> u64 {
        self.etag
    }

    /// A WAL position the rows it was made from are no newer than (0: not
    /// known; see the layout).
    pub fn upto(&self) -> u64 {
        self.u64_at(UPTO_AT)
    }

    /// When this process began the load that made it, if it did.
    pub fn loaded_here(&self) -> Option<std::time::Instant> {
        (self.loaded_here != 0)
            .then(|| process_epoch() + std::time::Duration::from_nanos(self.loaded_here - 1))
    }

    /// How long the load that produced it took.
    pub fn load_time(&self) -> Duration {
        Duration::from_micros(u64::from(self.load_micros))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_found_entry_round_trips_with_its_body() {
        let e = Entry::new(
            Status::Found,
            br#"{"id":1}"#,
            Duration::from_secs(60),
            Duration::from_millis(3),
        );
        let d = Entry::decode(e.raw().clone()).expect("decodes");
        assert_eq!(d, e);
        assert_eq!(&d.body()[..], br#"{"id":1}"#);
        assert_eq!(d.fresh_until() - d.stored_at(), 60_000);
        assert_eq!(d.load_time(), Duration::from_millis(3));
        assert_eq!(d.read_at(), d.stored_at() - 3);
    }

    #[test]
    fn not_found_and_failed_carry_no_body() {
        for status in [Status::NotFound, Status::Failed] {
            let e = Entry::new(status, b"ignored", Duration::from_secs(1), Duration::ZERO);
            let d = Entry::decode(e.raw().clone()).expect("decodes");
            assert_eq!(d.status(), status);
            assert!(d.body().is_empty());
        }
    }

    #[test]
    fn the_etag_follows_the_body_only() {
        let a = Entry::new(
            Status::Found,
            b"one",
            Duration::from_secs(1),
            Duration::ZERO,
        );
        let b = Entry::new(
            Status::Found,
            b"one",
            Duration::from_secs(9),
            Duration::from_millis(2),
        );
        let c = Entry::new(
            Status::Found,
            b"two",
            Duration::from_secs(1),
            Duration::ZERO,
        );
        assert_eq!(a.etag(), b.etag());
        assert_ne!(a.etag(), c.etag());
    }

    #[test]
    fn the_backoff_flag_is_read_from_its_byte() {
        let e = Entry::new(Status::Found, b"x", Duration::from_secs(1), Duration::ZERO);
        assert!(!e.is_backoff());
        let mut raw = e.raw().to_vec();
        raw[FLAGS_AT] = FLAG_BACKOFF;
        raw[BACKOFF_UNTIL_AT..BACKOFF_UNTIL_AT + 8].copy_from_slice(&77u64.to_be_bytes());
        let d = Entry::decode(Bytes::from(raw)).unwrap();
        assert!(d.is_backoff() && !d.is_invalidated());
        assert_eq!(d.backoff_until(), 77);
        assert_eq!(e.as_backoff(77), d);
        assert_eq!(d.body(), e.body());
        // Invalidated, then re-served as a backoff copy: one flag at a time.
        let invalidated = e.as_invalidated();
        assert!(invalidated.is_invalidated() && !invalidated.is_backoff());
        assert_eq!(
            Entry::decode(invalidated.raw().clone()).unwrap(),
            invalidated
        );
        assert_eq!(invalidated.as_backoff(77), d);
        assert!(!d.as_invalidated().is_backoff());
    }

    /// Entries of versions 1 (the layout with the fail-safe copy in a key
    /// of its own) and 2 (no upto) are not read: a rolling upgrade never
    /// serves them.
    #[test]
    fn an_entry_of_a_previous_layout_is_not_read() {
        let e = Entry::new(Status::Found, b"x", Duration::from_secs(1), Duration::ZERO);
        let mut v1 = e.raw().to_vec();
        v1[0] = 1;
        // Version 1's header: 31 bytes, the body after it.
        v1.drain(31..47);
        assert_eq!(Entry::decode(Bytes::from(v1)), Err(DecodeError::Version(1)));
        let mut v2 = e.raw().to_vec();
        v2[0] = 2;
        v2.drain(39..47);
        assert_eq!(Entry::decode(Bytes::from(v2)), Err(DecodeError::Version(2)));
    }

    #[test]
    fn what_a_load_saw_up_to_is_stored_and_read_back() {
        process_epoch();
        let began = std::time::Instant::now();
        let e = Entry::from_load(
            Status::Found,
            b"x",
            Duration::from_secs(1),
            Duration::ZERO,
            began,
            0x1_6B37_4D84,
        );
        assert_eq!(e.upto(), 0x1_6B37_4D84);
        assert_eq!(e.loaded_here(), Some(began));
        assert_eq!(e.body().as_ref(), b"x");
        let d = Entry::decode(e.raw().clone()).unwrap();
        assert_eq!(d.upto(), 0x1_6B37_4D84);
        // Read back, it was not loaded here.
        assert_eq!(d.loaded_here(), None);
        assert_eq!(d, e);
        let not_found = Entry::from_load(
            Status::NotFound,
            b"",
            Duration::from_secs(1),
            Duration::ZERO,
            began,
            7,
        );
        assert_eq!(Entry::decode(not_found.raw().clone()).unwrap().upto(), 7);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for raw in [
            &b""[..],
            b"{\"id\":1}",
            b"\x03\x00short",
            &[3u8; 46],
            &{
                let mut bad_status = [0u8; 47];
                bad_status[..2].copy_from_slice(&[3, 9]);
                bad_status
            },
            &{
                let mut not_found_with_body = [0u8; 48];
                not_found_with_body[..2].copy_from_slice(&[3, 1]);
                not_found_with_body[47] = b'x';
                not_found_with_body
            },
        ] {
            assert!(
                Entry::decode(Bytes::copy_from_slice(raw)).is_err(),
                "{raw:?}"
            );
        }
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn any_bytes_decode_to_an_entry_or_a_clean_error(raw in proptest::collection::vec(any::<u8>(), 0..128)) {
            if let Ok(entry) = Entry::decode(Bytes::from(raw.clone())) {
                prop_assert_eq!(entry.raw().as_ref(), &raw[..]);
                prop_assert!(entry.body().len() <= raw.len());
            }
        }

        #[test]
        fn every_entry_round_trips(body in proptest::collection::vec(any::<u8>(), 0..256), ttl in 0u64..10_000_000, status in 0u8..4) {
            let status = [Status::Found, Status::NotFound, Status::Failed, Status::TooLarge][status as usize];
            let e = Entry::new(status, &body, Duration::from_millis(ttl), Duration::from_micros(ttl));
            let d = Entry::decode(e.raw().clone()).unwrap();
            prop_assert_eq!(&d, &e);
        }
    }
}
