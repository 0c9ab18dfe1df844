//! The cache entry envelope, also used as the `ready` message.
//!
//! A small binary header in front of the response body bytes, so that a hit
//! is served by slicing the stored bytes (no JSON parsing, no re-serialising):
//!
//! ```text
//! offset  size  field
//! 0       1     version (1)
//! 1       1     status: 0 found, 1 not found, 2 failed (messages and failure markers)
//! 2       8     stored_at, unix milliseconds, big endian
//! 10      8     fresh_until, unix milliseconds: the logical freshness deadline
//! 18      4     load time of the load that produced it, microseconds
//! 22      ..    body (found only)
//! ```
//!
//! Anything that does not decode is treated by callers as absent (a miss),
//! never as an error to the client.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};

/// The only envelope version this build writes and reads.
const VERSION: u8 = 1;
/// Bytes before the body.
const HEADER_LEN: usize = 22;

/// What a load found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The item exists; the body is its JSON.
    Found,
    /// The item does not exist (negative caching).
    NotFound,
    /// The load failed; only in `ready` messages and failure markers.
    Failed,
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
    stored_at: u64,
    fresh_until: u64,
    load_micros: u32,
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
        let load_micros = u32::try_from(load_time.as_micros()).unwrap_or(u32::MAX);
        let body = if status == Status::Found { body } else { &[] };
        let mut buf = BytesMut::with_capacity(HEADER_LEN + body.len());
        buf.put_u8(VERSION);
        buf.put_u8(match status {
            Status::Found => 0,
            Status::NotFound => 1,
            Status::Failed => 2,
        });
        buf.put_u64(stored_at);
        buf.put_u64(fresh_until);
        buf.put_u32(load_micros);
        buf.put_slice(body);
        Self {
            status,
            stored_at,
            fresh_until,
            load_micros,
            raw: buf.freeze(),
        }
    }

    /// Reads an envelope; never panics, whatever the bytes.
    pub fn decode(raw: Bytes) -> Result<Self, DecodeError> {
        if raw.len() < HEADER_LEN {
            return Err(DecodeError::Truncated(raw.len()));
        }
        if raw[0] != VERSION {
            return Err(DecodeError::Version(raw[0]));
        }
        let status = match raw[1] {
            0 => Status::Found,
            1 => Status::NotFound,
            2 => Status::Failed,
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
        load.copy_from_slice(&raw[18..22]);
        Ok(Self {
            status,
            stored_at: u64_at(2),
            fresh_until: u64_at(10),
            load_micros: u32::from_be_bytes(load),
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
