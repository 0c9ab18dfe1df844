//! What postcache stores in Redis: key names, the entry envelope, TTLs.

pub(crate) mod entry;
mod keys;
mod ttl;

pub use entry::{now_millis, DecodeError, Entry, Status};
pub use keys::{ItemKeys, Keys};
pub use ttl::Jitter;
