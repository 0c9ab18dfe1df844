//! The cache: the cache entry envelope, also used as the `ready` message.
//!
//! A small binary header in front of the response body bytes, so that a hit
//! is served by slicing the stored bytes (no JSON parsing, no re-serialising):
//!
//! ```text
//! offset  size  field
//! 0       1     version (1)
//! 1       1     status: 0 found, 1 not found, 2 failed (messages and failure markers),
//!               3 too large (a marker: the item is over MAX_ENTRY_BYTES, load it yourself)
//! 2       1     flags: bit 0 BACKOFF, a stale copy re-served after a failed load
//! 3       8     stored_at, unix milliseconds, big endian
//! 11      8     fresh_until, unix milliseconds: the logical freshness deadline
//! 19      4     load time of the load that produced it, microseconds
//! 23      8     ETag: xxh3-64 of the body
//! 31      ..    body (found only)
//! ```
//!
//! The finish script (`redis/scripts/finish.lua`) reads the version and
//! status bytes and sets the flags byte of stored entries: it is given the
//! constants below, so the layout is written down once.
//!
//! Anything that does not decode is treated by callers as absent (a miss),
//! never as an error to the client.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};

/// The only envelope version this build writes and reads (byte 0).
pub const VERSION: u8 = 1;
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
/// Bytes before the body.
pub const HEADER_LEN: usize = 31;
/// Flag: a stale copy stored after a failed load, served until it expires
/// (the backoff), without triggering refreshes.
pub const FLAG_BACKOFF: u8 = 1;

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    status: Status,
    flags: u8,
    stored_at: u64,
    fresh_until: u64,
    load_micros: u32,
    etag: u64,
    raw: Bytes,
}

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

    /// Builds an entry with explicit timestamps (unix milliseconds).
    pub fn stamped(
        status: Status,
        body: &[u8],
        stored_at: u64,
        fresh_until: u64,
        load_time: Duration,
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
        buf.put_slice(body);
        Self {
            status,
            flags: 0,
            stored_at,
            fresh_until,
            load_micros,
            etag,
            raw: buf.freeze(),
        }
    }

    /// Reads an envelope; never panics, whatever the bytes (see the property test).
    pub fn decode(raw: Bytes) -> Result<Self, DecodeError> {
        if raw.len() < HEADER_LEN {
            return Err(DecodeError::Truncated(raw.len()));
        }
        if raw[0] != VERSION {
            return Err(DecodeError::Version(raw[0]));
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
            etag: u64_at(23),
            raw,
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

    /// A stale copy re-served after a failed load: serve it, do not refresh.
    pub fn is_backoff(&self) -> bool {
        self.flags & FLAG_BACKOFF != 0
    }

    /// The same entry marked as a backoff copy, as the finish script stores it.
    pub fn as_backoff(&self) -> Self {
        let mut raw = self.raw.to_vec();
        raw[FLAGS_AT] |= FLAG_BACKOFF;
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
        let d = Entry::decode(Bytes::from(raw)).unwrap();
        assert!(d.is_backoff());
        assert_eq!(e.as_backoff(), d);
        assert_eq!(d.body(), e.body());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for raw in [
            &b""[..],
            b"{\"id\":1}",
            b"\x01\x00short",
            &[2u8; 30],
            &[
                1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            ],
            &[
                1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, b'x',
            ],
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
