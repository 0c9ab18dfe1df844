//! How an answer was served, as HTTP shows it: the `X-Cache` header and the
//! `outcome` label of the request metrics.

use crate::{cache::Status, flight::Served};

/// The `X-Cache` header value.
pub fn header(served: Served) -> &'static str {
    match served {
        Served::Hit => "hit",
        Served::Stale => "stale",
        Served::Miss => "miss",
        Served::CoalescedLocal | Served::CoalescedRemote => "coalesced",
        Served::Bypass => "bypass",
    }
}

/// The `outcome` label of the request metrics: a hit on a not-found entry
/// is a negative hit.
pub fn label(served: Served, status: Status) -> &'static str {
    match (served, status) {
        (Served::Hit, Status::NotFound) => "negative_hit",
        (Served::Hit, _) => "hit",
        (Served::Stale, _) => "stale",
        (Served::Miss, _) => "miss",
        (Served::CoalescedLocal, _) => "coalesced_local",
        (Served::CoalescedRemote, _) => "coalesced_remote",
        (Served::Bypass, _) => "bypass",
    }
}
