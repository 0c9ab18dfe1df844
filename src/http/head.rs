//! HTTP: the head of a hit, rendered once per entry.
//!
//! A found post served from the memory tier or from Redis answers with the
//! same headers every time but three: `Content-Type`, `X-Cache`,
//! `Cache-Status`, `X-Cache-Tier` and `ETag` follow from the entry and the
//! tier alone, while `Cache-Control` (its `max-age`), `Age` and
//! `PostCache-LSN` change with the clock and the change feed. Building the
//! header map anew inserts and hashes every header: about 1,800 of the
//! 13,700 instructions of a memory hit (callgrind,
//! `load/results/2026-12-06/hit-profile.md`).
//!
//! So each thread keeps the heads it rendered last, in a small table of its
//! own keyed by what a head is made of (the entry's validator, the tier,
//! whether a position is told). A hit copies its head (two allocations, no
//! hashing) and writes the three changing values in place. The table is the
//! thread's: no lock, and no count another core writes. Nothing in a head
//! depends on anything but its key, so a head is never stale and nothing
//! evicts it: a new version of a post has a new validator, hence a new key.

use std::cell::RefCell;

use axum::http::{header, HeaderMap, HeaderValue};

use super::{position, served};
use crate::read_path::Served;

/// Heads kept per thread (a power of two): one per hot post, about 700
/// bytes each.
const SLOTS: usize = 64;

/// What a head is made of.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key {
    etag: u64,
    served: Served,
    with_lsn: bool,
}

struct Rendered {
    key: Key,
    headers: HeaderMap,
}

thread_local! {
    static HEADS: RefCell<Box<[Option<Rendered>]>> =
        RefCell::new((0..SLOTS).map(|_| None).collect());
}

/// The values of a hit's head that change from one request to the next.
pub(super) struct Changing {
    pub cache_control: HeaderValue,
    pub age: HeaderValue,
    /// `PostCache-LSN`, when the instance knows its position.
    pub lsn: Option<HeaderValue>,
}

/// The head of a found entry with validator `etag`, served as `served`,
/// with `changing` written in; `None` unless `served` is a hit of the
/// memory tier or of Redis (the other answers are rarer, and some carry
/// headers of their own: [`super::handlers::respond`] builds them).
pub(super) fn hit(etag: u64, served: Served, changing: Changing) -> Option<HeaderMap> {
    if !matches!(served, Served::Memory | Served::Hit) {
        return None;
    }
    let key = Key {
        etag,
        served,
        with_lsn: changing.lsn.is_some(),
    };
    let mut headers = HEADS
        .try_with(|heads| {
            let mut heads = heads.borrow_mut();
            let slot = &mut heads[slot(etag)];
            match slot {
                Some(rendered) if rendered.key == key => rendered.headers.clone(),
                _ => {
                    let headers = render(key);
                    *slot = Some(Rendered {
                        key,
                        headers: headers.clone(),
                    });
                    headers
                }
            }
        })
        // The thread is being torn down: render without keeping.
        .unwrap_or_else(|_| render(key));
    set(&mut headers, changing);
    Some(headers)
}

fn slot(etag: u64) -> usize {
    // The validator is a hash of the body already: its top bits are as
    // good as any.
    (etag >> 58) as usize % SLOTS
}

/// The head of `key` with placeholders where [`Changing`] goes, in the
/// order [`super::handlers::respond`] puts them.
fn render(key: Key) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(HEADERS);
    headers.insert(header::CONTENT_TYPE, JSON);
    tier_headers(&mut headers, key.served);
    headers.insert(header::CACHE_CONTROL, PLACEHOLDER);
    headers.insert(header::AGE, PLACEHOLDER);
    headers.insert(header::ETAG, etag_value(key.etag));
    if key.with_lsn {
        headers.insert(position::LSN, PLACEHOLDER);
    }
    headers
}

/// What a head holds until [`set`] writes over it (never sent: every
/// placeholder is written over, a test shows).
const PLACEHOLDER: HeaderValue = HeaderValue::from_static("");

/// Writes `changing` over the placeholders, in place: a pass over the
/// head's few headers compares names, where a lookup would hash them.
fn set(headers: &mut HeaderMap, changing: Changing) {
    let Changing {
        cache_control,
        age,
        mut lsn,
    } = changing;
    let (mut cache_control, mut age) = (Some(cache_control), Some(age));
    for (name, value) in headers.iter_mut() {
        let new = if name == header::CACHE_CONTROL {
            cache_control.take()
        } else if name == header::AGE {
            age.take()
        } else if name == position::LSN {
            lsn.take()
        } else {
            None
        };
        if let Some(new) = new {
            *value = new;
        }
    }
}

/// Inserts the headers that say how an answer served as `served` was
/// served: `X-Cache`, `Cache-Status`, and `X-Cache-Tier` or
/// `X-Cache-Bypass`. Their values are constants, checked when built.
pub(super) fn tier_headers(headers: &mut HeaderMap, served: Served) {
    headers.insert(served::X_CACHE, served::header_value(served));
    headers.insert(served::CACHE_STATUS, served::cache_status_value(served));
    if let Some(tier) = served::hit_tier_value(served) {
        headers.insert(served::X_CACHE_TIER, tier);
    }
    if let Some(reason) = served::bypass_reason_value(served) {
        headers.insert(served::X_CACHE_BYPASS, reason);
    }
}

/// `Content-Type` of a post.
pub(super) const JSON: HeaderValue = HeaderValue::from_static("application/json");

/// Headers an answer carries at most: content type, X-Cache, Cache-Status,
/// X-Cache-Tier or X-Cache-Bypass, Cache-Control, Age, ETag, Warning,
/// PostCache-LSN. The map is made this large at once: one that starts
/// small (room for 6) and grows on the seventh insert reallocates and
/// rehashes.
pub(super) const HEADERS: usize = 9;

/// An entry's validator as the `ETag` header shows it, put together on the
/// stack.
pub(super) fn etag_value(etag: u64) -> HeaderValue {
    HeaderValue::from_bytes(&quoted_hex(etag)).expect("quotes and hex digits")
}

/// `"` + 16 lower-case hex digits + `"`.
pub(super) fn quoted_hex(n: u64) -> [u8; 18] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [b'"'; 18];
    for (i, digit) in out[1..17].iter_mut().enumerate() {
        *digit = HEX[((n >> (60 - 4 * i)) & 0xf) as usize];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changing(max_age: &'static str, age: &'static str, lsn: Option<&'static str>) -> Changing {
        Changing {
            cache_control: HeaderValue::from_static(max_age),
            age: HeaderValue::from_static(age),
            lsn: lsn.map(HeaderValue::from_static),
        }
    }

    fn listed(headers: &HeaderMap) -> Vec<(String, String)> {
        let mut listed: Vec<_> = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
            .collect();
        listed.sort();
        listed
    }

    /// A kept head, copied, is the head rendered anew with the same values:
    /// every placeholder is written over, and nothing of the request before
    /// stays.
    #[test]
    fn a_kept_head_is_the_head_rendered_anew() {
        for served in served::ALL {
            for lsn in [None, Some("0/16B3748"), Some("1/0")] {
                for (max_age, age) in [("public, max-age=5", "3"), ("public, max-age=60", "0")] {
                    let expected = hit(7, served, changing(max_age, age, lsn)).map(|h| listed(&h));
                    // Kept now: the second is a copy.
                    let again = hit(7, served, changing(max_age, age, lsn)).map(|h| listed(&h));
                    assert_eq!(again, expected);
                    let Some(expected) = expected else {
                        assert!(!matches!(served, Served::Memory | Served::Hit));
                        continue;
                    };
                    let mut made = HeaderMap::new();
                    made.insert(header::CONTENT_TYPE, JSON);
                    tier_headers(&mut made, served);
                    made.insert(header::CACHE_CONTROL, HeaderValue::from_static(max_age));
                    made.insert(header::AGE, HeaderValue::from_static(age));
                    made.insert(header::ETAG, etag_value(7));
                    if let Some(lsn) = lsn {
                        made.insert(position::LSN, HeaderValue::from_static(lsn));
                    }
                    assert_eq!(expected, listed(&made));
                    assert!(expected.iter().all(|(_, v)| !v.is_empty()), "{expected:?}");
                }
            }
        }
    }

    /// Heads of different entries, tiers, or with and without a position,
    /// never stand in for each other, also in the same slot.
    #[test]
    fn heads_are_kept_apart_by_what_they_are_made_of() {
        let same_slot = [1u64, 2, 3, (1 << 58) + 1];
        for (i, etag) in same_slot.into_iter().enumerate() {
            for served in [Served::Memory, Served::Hit] {
                for lsn in [None, Some("0/1")] {
                    let age: &'static str = ["0", "1", "2", "3"][i];
                    let head = hit(etag, served, changing("public, max-age=1", age, lsn)).unwrap();
                    assert_eq!(head[header::ETAG], format!("\"{etag:016x}\"").as_str());
                    assert_eq!(head[header::AGE], age);
                    assert_eq!(
                        head["x-cache-tier"],
                        if served == Served::Memory {
                            "memory"
                        } else {
                            "redis"
                        }
                    );
                    assert_eq!(head.contains_key(position::LSN), lsn.is_some());
                }
            }
        }
    }

    #[test]
    fn the_etag_is_quoted_hex() {
        for n in [0, 1, 0xf, 0x0123_4567_89ab_cdef, u64::MAX, 1 << 63] {
            let expected = format!("\"{n:016x}\"");
            assert_eq!(quoted_hex(n).as_slice(), expected.as_bytes());
            assert_eq!(etag_value(n), expected.as_str());
        }
    }
}
