//! What postcache stores in Redis: key names, the entry envelope, TTLs.

pub(crate) mod entry;
mod keys;
mod ttl;

pub use entry::{claim_of, is_claim, now_millis, DecodeError, Entry, Status, CLAIM_PREFIX};
pub use keys::{ItemKeys, Keys};
pub use ttl::Jitter;
