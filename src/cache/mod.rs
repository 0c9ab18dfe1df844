//! What postcache stores in Redis: key names, the entry envelope, TTLs,
//! and the ready messages it publishes.

pub(crate) mod entry;
mod keys;
pub mod message;
mod ttl;

pub use entry::{claim_of, is_claim, now_millis, DecodeError, Entry, Status, CLAIM_PREFIX};
pub use keys::{ItemKeys, Keys};
pub use ttl::Jitter;
