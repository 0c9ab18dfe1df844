//! What postcache stores in Redis: key names, the entry envelope, TTLs.

mod entry;
mod keys;
mod ttl;

pub use entry::{now_millis, DecodeError, Entry, Status};
pub use keys::Keys;
pub use ttl::Jitter;
