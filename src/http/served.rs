//! HTTP: how an answer was served, as HTTP shows it: the `X-Cache`,
//! `X-Cache-Tier` and `Cache-Status` headers and the `outcome` and `tier`
//! labels of the request metrics.

use axum::http::{HeaderName, HeaderValue};

use crate::{cache::Status, read_path::Served};

pub const X_CACHE: HeaderName = HeaderName::from_static("x-cache");
pub const X_CACHE_TIER: HeaderName = HeaderName::from_static("x-cache-tier");
pub const X_CACHE_BYPASS: HeaderName = HeaderName::from_static("x-cache-bypass");
pub const CACHE_STATUS: HeaderName = HeaderName::from_static("cache-status");

/// A `'static` string as a header value, checked once, when compiled: a
/// value made at run time is checked byte by byte on every answer.
macro_rules! value {
    ($text:expr) => {
        const { HeaderValue::from_static($text) }
    };
}

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
    Served::KnownMissing,
];

/// A header's value for each way of serving, written once: as a string
/// (`$text`, for logs, metrics and tests) and as a header value checked
/// when compiled (`$value`, for answers).
macro_rules! per_served {
    ($(#[$doc:meta])* $text:ident, $value:ident { $($served:pat => $string:literal,)* }) => {
        $(#[$doc])*
        pub fn $text(served: Served) -> &'static str {
            match served {
                $($served => $string,)*
            }
        }

        #[doc = concat!("[`", stringify!($text), "`] as a header value.")]
        pub fn $value(served: Served) -> HeaderValue {
            match served {
                $($served => value!($string),)*
            }
        }
    };
}

per_served! {
    /// The `X-Cache` header value.
    header, header_value {
        Served::Memory | Served::Hit | Served::KnownMissing => "hit",
        Served::Stale => "stale",
        Served::Miss => "miss",
        Served::CoalescedLocal | Served::CoalescedRemote => "coalesced",
        Served::Bypass | Served::TooLarge => "bypass",
    }
}

per_served! {
    /// The `Cache-Status` header (RFC 9211): how the answer was served, in
    /// the standard's words. `hit` is an answer given without a load
    /// (`detail` says where from: the memory tier, Redis, a stale copy, or
    /// the existence guard, which knows the post cannot exist and caches
    /// nothing); `fwd=miss` is an answer loaded from PostgreSQL,
    /// `collapsed` when not by this request's own load: `detail=local`, it
    /// joined a flight of this process (whichever instance loaded for that
    /// flight); `detail=fleet`, its own flight was answered by another
    /// instance's load. `fwd=bypass` is a load that skipped the cache.
    /// Static strings: a hit pays no formatting for it.
    cache_status, cache_status_value {
        Served::Memory => "postcache; hit; detail=memory",
        Served::Hit => "postcache; hit; detail=redis",
        Served::Stale => "postcache; hit; detail=stale",
        Served::KnownMissing => "postcache; hit; detail=existence-guard",
        Served::Miss => "postcache; fwd=miss",
        Served::CoalescedLocal => "postcache; fwd=miss; collapsed; detail=local",
        Served::CoalescedRemote => "postcache; fwd=miss; collapsed; detail=fleet",
        Served::Bypass => "postcache; fwd=bypass",
        Served::TooLarge => "postcache; fwd=bypass; detail=too-large",
    }
}

/// `X-Cache-Bypass` of a read past the cache for a position or a staleness
/// bound the cache could not vouch for (see `position.rs`).
pub const PAST_BYPASS: &str = "position";
/// `Cache-Status` of such a read.
pub const PAST_CACHE_STATUS: &str = "postcache; fwd=bypass; detail=position";

/// The `X-Cache-Bypass` header: why a bypass skipped the cache, where
/// that is not Redis failing.
pub fn bypass_reason(served: Served) -> Option<&'static str> {
    match served {
        Served::TooLarge => Some("too-large"),
        _ => None,
    }
}

/// [`bypass_reason`] as a header value.
pub fn bypass_reason_value(served: Served) -> Option<HeaderValue> {
    match served {
        Served::TooLarge => Some(value!("too-large")),
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
        (Served::KnownMissing, _) => "negative_hit",
    }
}

/// The `X-Cache-Tier` header of a hit: where it was found.
pub fn hit_tier(served: Served) -> Option<&'static str> {
    match served {
        Served::Memory => Some("memory"),
        Served::Hit => Some("redis"),
        Served::KnownMissing => Some("guard"),
        _ => None,
    }
}

/// [`hit_tier`] as a header value.
pub fn hit_tier_value(served: Served) -> Option<HeaderValue> {
    match served {
        Served::Memory => Some(value!("memory")),
        Served::Hit => Some(value!("redis")),
        Served::KnownMissing => Some(value!("guard")),
        _ => None,
    }
}

/// The `tier` label of the request metrics: the hit's tier, `redis` for a
/// stale answer (a copy kept there), `none` for what a load answered.
pub fn tier_label(served: Served) -> &'static str {
    match served {
        Served::Memory => "memory",
        Served::Hit | Served::Stale => "redis",
        Served::KnownMissing => "guard",
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

    /// The header values, made when compiled, say what the strings say
    /// (the OpenAPI document lists the strings).
    #[test]
    fn the_values_are_the_strings() {
        for served in ALL {
            assert_eq!(header_value(served), header(served));
            assert_eq!(cache_status_value(served), cache_status(served));
            assert_eq!(
                hit_tier_value(served).as_ref().map(|v| v.to_str().unwrap()),
                hit_tier(served)
            );
            assert_eq!(
                bypass_reason_value(served)
                    .as_ref()
                    .map(|v| v.to_str().unwrap()),
                bypass_reason(served)
            );
        }
    }
}
