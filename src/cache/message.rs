//! Ready messages: what a leader's finish publishes on an item's channel.
//!
//! A message is the entry stored (or the one found stored), framed with the
//! item's change fence as it was when the finish published it, atomically
//! with the store:
//!
//! ```text
//! 0xFE  fence (ASCII digits, empty for none)  '\n'  entry
//! ```
//!
//! A waiter that looked at the value and found nothing to serve judges a
//! message by that fence, not by a clock: a message published under the
//! fence its look read saw no change applied between the two, so it is as
//! new as anything the look could have found; one under another fence was
//! published before a change the look saw (or after one it did not), and
//! the waiter looks again instead. (Before, the entry's store time was
//! compared with the look's, two hosts' clocks: an instance whose clock was
//! ahead could have its message, published before a change, taken for one
//! published after the look.)
//!
//! A fence lives FENCE_TTL after its change (see `read_path/settings.rs`):
//! a message delivered later than that after it was published, with a
//! change in between whose fence had expired by the look, would be taken
//! for a new one. Unframed payloads (an older instance's, or bytes from
//! outside) are entries of unknown order: looked up again, never served.

use bytes::{BufMut, Bytes, BytesMut};

/// The first byte of a framed message: never the first byte of an entry
/// (its version) or of a claim (a NUL).
pub const FRAMED: u8 = 0xFE;

/// A message taken apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The item's fence when it was published (empty: none); `None` for a
    /// payload that is not framed.
    pub fence: Option<Bytes>,
    /// The entry's bytes (not yet decoded).
    pub entry: Bytes,
}

impl Message {
    /// Takes a payload apart; one that is not framed is all entry.
    pub fn parse(payload: Bytes) -> Self {
        if payload.first() == Some(&FRAMED) {
            if let Some(end) = payload.iter().position(|&b| b == b'\n') {
                return Self {
                    fence: Some(payload.slice(1..end)),
                    entry: payload.slice(end + 1..),
                };
            }
        }
        Self {
            fence: None,
            entry: payload,
        }
    }

    /// Whether a waiter whose look read `looked` (the fence's bytes, empty
    /// for none) may serve this message's entry.
    pub fn published_under(&self, looked: &[u8]) -> bool {
        self.fence.as_deref() == Some(looked)
    }
}

/// The framed message of `entry` under `fence` (what finish.lua publishes).
pub fn framed(fence: &[u8], entry: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(2 + fence.len() + entry.len());
    out.put_u8(FRAMED);
    out.put_slice(fence);
    out.put_u8(b'\n');
    out.put_slice(entry);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_framed_message_parses_back() {
        for fence in [&b""[..], b"123456789"] {
            let message = Message::parse(framed(fence, b"\x03entry\nwith a newline"));
            assert_eq!(message.fence.as_deref(), Some(fence));
            assert_eq!(&message.entry[..], b"\x03entry\nwith a newline");
            assert!(message.published_under(fence));
            assert!(!message.published_under(b"7"));
        }
    }

    #[test]
    fn an_unframed_payload_is_all_entry_and_never_trusted() {
        for payload in [&b""[..], b"\x03entry", b"\xFEno newline", b"retry"] {
            let message = Message::parse(Bytes::copy_from_slice(payload));
            assert_eq!(message.fence, None);
            assert_eq!(&message.entry[..], payload);
            assert!(!message.published_under(b""));
        }
    }
}
