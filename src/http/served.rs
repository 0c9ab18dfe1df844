//! HTTP: how an answer was served, as HTTP shows it: the `X-Cache` and
//! `X-Cache-Tier` headers and the `outcome` and `tier` labels of the request
//! metrics.

use crate::{cache::Status, flight::Served};

/// Every way an answer is served: the values the OpenAPI document lists,
/// and what the tests go through.
pub const ALL: [Served; 9] = [
    Served::Memory,
    Served::Hit,
    Served::Stale,
    Served::Miss,
    Served::CoalescedLocal,
    Served::CoalescedRemote,
    Served::Bypass,
    Served::TooLarge,
    Served::Guard,
];

/// The `X-Cache` header value.
pub fn header(served: Served) -> &'static str {
    match served {
        Served::Memory | Served::Hit | Served::Guard => "hit",
        Served::Stale => "stale",
        Served::Miss => "miss",
        Served::CoalescedLocal | Served::CoalescedRemote => "coalesced",
        Served::Bypass | Served::TooLarge => "bypass",
    }
}

/// The `X-Cache-Bypass` header: why a bypass skipped the cache, where
/// that is not Redis failing.
pub fn bypass_reason(served: Served) -> Option<&'static str> {
    match served {
        Served::TooLarge => Some("too-large"),
        _ => None,
    }
}

/// The `outcome` label of the request metrics: a hit on a not-found entry
/// is a negative hit.
pub fn label(served: Served, status: Status) -> &'static str {
    match (served, status) {
        (Served::Memory | Served::Hit, Status::NotFound) => "negative_hit",
        (Served::Memory | Served::Hit, _) => "hit",
        (Served::Stale, _) => "stale",
        (Served::Miss, _) => "miss",
        (Served::CoalescedLocal, _) => "coalesced_local",
        (Served::CoalescedRemote, _) => "coalesced_remote",
        (Served::Bypass, _) => "bypass",
        (Served::TooLarge, _) => "too_large",
        (Served::Guard, _) => "negative_hit",
    }
}

/// The `X-Cache-Tier` header of a hit: where it was found.
pub fn hit_tier(served: Served) -> Option<&'static str> {
    match served {
        Served::Memory => Some("memory"),
        Served::Hit => Some("redis"),
        Served::Guard => Some("guard"),
        _ => None,
    }
}

/// The `tier` label of the request metrics: the hit's tier, `redis` for a
/// stale answer (a copy kept there), `none` for what a load answered.
pub fn tier_label(served: Served) -> &'static str {
    match served {
        Served::Memory => "memory",
        Served::Hit | Served::Stale => "redis",
        Served::Guard => "guard",
        Served::Miss
        | Served::CoalescedLocal
        | Served::CoalescedRemote
        | Served::Bypass
        | Served::TooLarge => "none",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::metrics::REQUEST_LABELS;

    /// The request series are registered up front: every pair an answer
    /// can be counted under must be among them.
    #[test]
    fn every_outcome_and_tier_is_registered() {
        for served in ALL {
            for status in [Status::Found, Status::NotFound] {
                let pair = (label(served, status), tier_label(served));
                assert!(REQUEST_LABELS.contains(&pair), "{pair:?}");
            }
        }
        assert!(REQUEST_LABELS.contains(&("error", "none")));
    }
}
