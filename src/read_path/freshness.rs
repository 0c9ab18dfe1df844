//! The protocol: freshness, as pure functions of an entry, the clock and
//! the settings: what an entry read from Redis means for a read (the
//! verdict, decided once, here), when a fresh hit refreshes early (XFetch),
//! and how long the leader's finish keeps what it loaded (the store policy).
//!
//! ```text
//! stored_at        fresh_until     + STALE_WHILE_REVALIDATE     + MAX_STALE
//!     │── Fresh ───────│── StaleInGrace ──│── Miss ───────────────────│ key expires
//!                      └──── the same key kept as the fail-safe copy ──┘
//! ```
//!
//! A change marks the entry INVALIDATED (a miss, kept as the fail-safe
//! copy); a failed load re-serves the copy flagged BACKOFF until its
//! backoff_until.

use std::time::Duration;

use super::{Answer, ReadError, Served};
use crate::{
    cache::{Entry, Status},
    redis::StoreFor,
};

/// What an entry read from Redis means for a read at a given instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Fresh: serve it.
    Fresh(Entry),
    /// A fail-safe copy re-served after a failed load, until its
    /// backoff_until (FAILURE_TTL after the failure): serve it as stale,
    /// never refresh it.
    Backoff(Entry),
    /// Past freshness, inside the grace window: serve it as stale while one
    /// background refresh runs.
    StaleInGrace(Entry),
    /// A failure marker: the last load failed within FAILURE_TTL.
    Failed,
    /// A fresh too-large marker: the item is over MAX_ENTRY_BYTES, so it is
    /// never stored: load it from the source, without a lock or a wait.
    TooLarge,
    /// Nothing to serve: absent, undecodable, invalidated by a change, past
    /// its backoff, or stale past the grace window (the last three kept as
    /// the fail-safe copy).
    Miss,
}

/// The verdict on `entry` (`None`: absent or undecodable) at `now` (unix
/// milliseconds), with `grace` the stale-while-revalidate window and
/// `cutoff` the fleet's cutoff (0: none), raised by `invalidate --all` or a
/// truncate: an entry read before it (on its loader's clock) is a miss at
/// once, with no grace (a truncate deletes every post: no old body is
/// served stale) and no backoff copy. The reader's clock is not compared
/// with the cutoff (found: a reader 5 s behind the raiser served entries
/// read before a truncate for 5 s, "fresh until the cutoff", their
/// `PostCache-LSN` past it); the loader's still is (see
/// docs/design/consistency.md, "Clocks").
pub fn judge(entry: Option<Entry>, now: u64, grace: Duration, cutoff: u64) -> Verdict {
    let Some(entry) = entry else {
        return Verdict::Miss;
    };
    let fresh_until = entry.fresh_until();
    // Order matters: a failure marker carries no body whatever its flags,
    // and a backoff copy is served whatever its freshness, until its
    // backoff ends.
    if entry.status() == Status::Failed {
        Verdict::Failed
    } else if entry.read_at() < cutoff {
        Verdict::Miss
    } else if entry.status() == Status::TooLarge {
        // Past its freshness, a marker says nothing: the item may have
        // shrunk. No grace: it has no body to serve.
        if now < fresh_until {
            Verdict::TooLarge
        } else {
            Verdict::Miss
        }
    } else if entry.is_invalidated() {
        // A change was applied after its read: kept only as the fail-safe copy.
        Verdict::Miss
    } else if entry.is_backoff() {
        // Past its backoff, the copy is the fail-safe copy again.
        if now >= entry.backoff_until() {
            Verdict::Miss
        } else {
            Verdict::Backoff(entry)
        }
    } else if now < fresh_until && !entry.is_changed() {
        // (A changed entry's fresh_until is the applier's clock when it
        // applied the change: never fresh again, on any reader's clock.)
        Verdict::Fresh(entry)
    } else if !grace.is_zero() && now < fresh_until.saturating_add(millis(grace)) {
        Verdict::StaleInGrace(entry)
    } else {
        Verdict::Miss
    }
}

impl Verdict {
    /// What a read waiting for another's load makes of an entry it found or
    /// was sent: an answer (served as `fresh` when fresh), a failure, or
    /// `None` (nothing yet: keep waiting). A stale entry in its grace window
    /// is not an answer for a waiter: it waits for the load in progress. A
    /// too-large marker is no answer either: a waiter loads the item itself
    /// (see `waiter.rs`), a leader loads it as it holds the lock.
    pub fn settle(self, fresh: Served) -> Option<Result<Answer, ReadError>> {
        match self {
            Verdict::Fresh(entry) | Verdict::Backoff(entry) => Some(Answer::new(entry, fresh)),
            Verdict::Failed => Some(Err(ReadError::Unavailable)),
            Verdict::StaleInGrace(_) | Verdict::Miss | Verdict::TooLarge => None,
        }
    }
}

/// XFetch (Vattani, Chierichetti, Lowenstein, VLDB 2015): refresh early when
/// `now − Δ·β·ln(u) ≥ expiry`, u uniform in (0, 1], Δ the last load's duration.
/// With r = expiry − now, this fires with probability exp(−r / (Δ·β)).
pub fn xfetch_fires(
    now_ms: u64,
    fresh_until_ms: u64,
    load_time: Duration,
    beta: f64,
    u: f64,
) -> bool {
    if beta <= 0.0 {
        return false;
    }
    let gap_ms = -(load_time.as_secs_f64() * 1e3 * beta * u.ln());
    now_ms as f64 + gap_ms >= fresh_until_ms as f64
}

/// The settings the store policy reads.
#[derive(Debug, Clone, Copy)]
pub struct Lifetimes {
    pub stale_while_revalidate: Duration,
    pub max_stale: Duration,
    /// FAILURE_TTL, already jittered (0: off).
    pub failure_ttl: Duration,
}

/// How long to keep what a load produced, in the one value key:
/// - found: its freshness plus the longer of the grace window and MAX_STALE:
///   past the grace window it is no longer served, but it stays as the
///   fail-safe copy (the body stored once);
/// - not found: its freshness; but when it replaces a copy of the item
///   (found, or an earlier tombstone: the item existed), for freshness plus
///   MAX_STALE as that copy's tombstone, so that a deleted item is answered
///   404, never its old body, when loads fail (the finish script sees which);
/// - failed: nothing but the backoff, for FAILURE_TTL;
/// - too large: the marker for its freshness, which takes the place of any
///   copy kept from before the item grew (it is older than the item).
pub fn store_for(entry: &Entry, l: Lifetimes) -> StoreFor {
    let fresh = Duration::from_millis(entry.fresh_until().saturating_sub(entry.stored_at()));
    match entry.status() {
        Status::Found => StoreFor {
            value: fresh + l.stale_while_revalidate.max(l.max_stale),
            tombstone: Duration::ZERO,
            failure: Duration::ZERO,
        },
        Status::NotFound => StoreFor {
            value: fresh,
            tombstone: if l.max_stale.is_zero() {
                Duration::ZERO
            } else {
                fresh + l.max_stale
            },
            failure: Duration::ZERO,
        },
        Status::Failed => StoreFor {
            value: Duration::ZERO,
            tombstone: Duration::ZERO,
            failure: l.failure_ttl,
        },
        Status::TooLarge => StoreFor {
            value: fresh,
            tombstone: Duration::ZERO,
            failure: Duration::ZERO,
        },
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, Rng, SeedableRng};

    use super::*;

    /// The refresh fires at the rate the formula predicts: exp(−r / (Δ·β)).
    #[test]
    fn xfetch_fires_at_the_predicted_rate() {
        let mut rng = StdRng::seed_from_u64(2015);
        let load = Duration::from_millis(20);
        let beta = 2.0; // Δ·β = 40 ms
        let fresh_until = 1_000_000;
        for remaining_ms in [0u64, 10, 40, 80, 160] {
            let trials = 20_000;
            let fired = (0..trials)
                .filter(|_| {
                    let u = 1.0 - rng.random::<f64>();
                    xfetch_fires(fresh_until - remaining_ms, fresh_until, load, beta, u)
                })
                .count();
            let rate = fired as f64 / trials as f64;
            let predicted = (-(remaining_ms as f64) / 40.0).exp();
            assert!(
                (rate - predicted).abs() < 0.015,
                "{remaining_ms} ms before expiry: fired {rate:.4}, predicted {predicted:.4}"
            );
        }
    }

    #[test]
    fn xfetch_never_fires_when_off() {
        assert!(!xfetch_fires(
            999,
            1000,
            Duration::from_secs(1),
            0.0,
            0.000_001
        ));
    }

    /// Freshness is judged by each instance's wall clock against the
    /// loader's: a skew of d moves the verdict by exactly d, no more. (The
    /// value key's Redis TTL, on Redis's clock, bounds how long any instance
    /// can serve it.)
    /// A change applied with STALE_WHILE_REVALIDATE on sets fresh_until to
    /// the applier's clock; a reader whose clock is behind it still finds
    /// the entry stale (its grace window alone moves with the skew).
    #[test]
    fn a_changed_entry_is_never_fresh_on_a_clock_behind_the_applier() {
        let entry = Entry::stamped(Status::Found, b"x", 10_000, 20_000, Duration::ZERO);
        // Applied at 15,000 on the applier's clock; the reader's is 2 s behind.
        let changed = Entry::stamped(Status::Found, b"x", 10_000, 15_000, Duration::ZERO);
        let grace = Duration::from_millis(5_000);
        let reader_now = 15_000 - 2_000;
        assert!(matches!(
            judge(Some(entry), reader_now, grace, 0),
            Verdict::Fresh(_)
        ));
        assert!(
            matches!(
                judge(Some(changed.clone()), reader_now, grace, 0),
                Verdict::Fresh(_)
            ),
            "without the flag, the skew makes it fresh"
        );
        assert!(matches!(
            judge(Some(changed.as_changed()), reader_now, grace, 0),
            Verdict::StaleInGrace(_)
        ));
        assert!(matches!(
            judge(Some(changed.as_changed()), 20_000, grace, 0),
            Verdict::Miss
        ));
    }

    /// The cutoff is never compared with the reader's clock: an entry read
    /// before it is a miss for a reader whose clock is behind the raiser's
    /// (found: such a reader served entries read before a truncate under a
    /// 3 s skew, with a position past it).
    #[test]
    fn an_entry_read_before_the_cutoff_is_a_miss_on_a_clock_behind_the_raiser() {
        let cutoff = 50_000;
        let before = Entry::stamped(Status::Found, b"x", 44_000, 104_000, Duration::ZERO);
        let grace = Duration::from_millis(5_000);
        for now in [45_000, 49_999, 53_000] {
            assert_eq!(
                judge(Some(before.clone()), now, grace, cutoff),
                Verdict::Miss
            );
        }
        // Read after it: fresh as ever.
        let after = Entry::stamped(Status::Found, b"x", 51_000, 111_000, Duration::ZERO);
        assert!(matches!(
            judge(Some(after), 45_000, grace, cutoff),
            Verdict::Fresh(_)
        ));
    }

    #[test]
    fn a_clock_skew_moves_the_verdict_by_the_skew() {
        let entry = Entry::stamped(Status::Found, b"x", 10_000, 11_000, Duration::ZERO);
        let grace = Duration::from_millis(500);
        let skew = 200;
        let at = |true_now: u64, skew: i64| {
            judge(
                Some(entry.clone()),
                true_now.saturating_add_signed(skew),
                grace,
                0,
            )
        };

        // Ahead by 200 ms: stale 200 ms early, out of grace 200 ms early.
        assert!(matches!(at(10_799, skew), Verdict::Fresh(_)));
        assert!(matches!(at(10_800, skew), Verdict::StaleInGrace(_)));
        assert!(matches!(at(11_300, skew), Verdict::Miss));
        // Behind by 200 ms: fresh 200 ms longer, and no longer than that.
        assert!(matches!(at(11_199, -skew), Verdict::Fresh(_)));
        assert!(matches!(at(11_200, -skew), Verdict::StaleInGrace(_)));
        assert!(matches!(at(11_700, -skew), Verdict::Miss));
    }

    #[test]
    fn a_backoff_copy_is_settled_as_stale_and_a_marker_as_a_failure() {
        let entry = Entry::stamped(Status::Found, b"x", 0, 10, Duration::ZERO).as_backoff(2_000);
        let answer = judge(Some(entry.clone()), 1_000, Duration::ZERO, 0)
            .settle(Served::CoalescedRemote)
            .expect("settled")
            .expect("an answer");
        assert_eq!(answer.served, Served::Stale);
        // Past its backoff it is the fail-safe copy again: a miss.
        assert_eq!(judge(Some(entry), 2_000, Duration::ZERO, 0), Verdict::Miss);
        let marker = Entry::stamped(Status::Failed, b"", 0, 0, Duration::ZERO);
        assert_eq!(
            judge(Some(marker), 1, Duration::ZERO, 0).settle(Served::Miss),
            Some(Err(ReadError::Unavailable))
        );
        assert_eq!(
            judge(None, 1, Duration::ZERO, 0).settle(Served::Miss),
            None,
            "a miss keeps a waiter waiting"
        );
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    fn status() -> impl Strategy<Value = Status> {
        prop_oneof![
            Just(Status::Found),
            Just(Status::NotFound),
            Just(Status::Failed),
            Just(Status::TooLarge)
        ]
    }

    fn entry() -> impl Strategy<Value = Entry> {
        (
            status(),
            0u64..1_000_000,
            0u64..1_000_000,
            0u8..4,
            0u64..3_000_000,
            0u64..10_000,
        )
            .prop_map(
                |(status, stored_at, fresh_for, flag, backoff_until, load_ms)| {
                    let e = Entry::stamped(
                        status,
                        b"{}",
                        stored_at,
                        stored_at + fresh_for,
                        Duration::from_millis(load_ms),
                    );
                    match flag {
                        1 => e.as_backoff(backoff_until),
                        2 => e.as_invalidated(),
                        3 => e.as_changed(),
                        _ => e,
                    }
                },
            )
    }

    fn lifetimes() -> impl Strategy<Value = Lifetimes> {
        (0u64..100_000, 0u64..10_000_000, 0u64..100_000).prop_map(|(swr, stale, failure)| {
            Lifetimes {
                stale_while_revalidate: Duration::from_millis(swr),
                max_stale: Duration::from_millis(stale),
                failure_ttl: Duration::from_millis(failure),
            }
        })
    }

    proptest! {
        /// Exactly one verdict, from the definitions in the module map above.
        #[test]
        fn the_verdict_follows_status_flag_and_clock(e in entry(), now in 0u64..3_000_000, grace_ms in 0u64..1_000_000) {
            let grace = Duration::from_millis(grace_ms);
            let verdict = judge(Some(e.clone()), now, grace, 0);
            let in_grace = grace_ms > 0 && now < e.fresh_until() + grace_ms;
            let expected = match e.status() {
                Status::Failed => Verdict::Failed,
                Status::TooLarge if now < e.fresh_until() => Verdict::TooLarge,
                Status::TooLarge => Verdict::Miss,
                _ if e.is_invalidated() => Verdict::Miss,
                _ if e.is_backoff() && now < e.backoff_until() => Verdict::Backoff(e.clone()),
                _ if e.is_backoff() => Verdict::Miss,
                _ if now < e.fresh_until() && !e.is_changed() => Verdict::Fresh(e.clone()),
                _ if in_grace => Verdict::StaleInGrace(e.clone()),
                _ => Verdict::Miss,
            };
            prop_assert_eq!(verdict, expected);
        }

        /// A cutoff makes every entry read before it a miss (a failure
        /// marker aside), whatever the clock says, and leaves the others as
        /// they were.
        #[test]
        fn a_cutoff_ends_what_was_read_before_it(e in entry(), now in 0u64..3_000_000, cutoff in 0u64..2_000_000, grace_ms in 0u64..1_000_000) {
            let grace = Duration::from_millis(grace_ms);
            let verdict = judge(Some(e.clone()), now, grace, cutoff);
            if e.read_at() >= cutoff {
                prop_assert_eq!(verdict, judge(Some(e.clone()), now, grace, 0));
            } else if e.status() == Status::Failed {
                prop_assert_eq!(verdict, Verdict::Failed);
            } else {
                prop_assert_eq!(verdict, Verdict::Miss);
            }
        }

        /// A settled answer never carries a failure, and is stale exactly for a backoff copy.
        #[test]
        fn a_settled_answer_holds_no_failure(e in entry(), now in 0u64..3_000_000) {
            if let Some(Ok(answer)) = judge(Some(e.clone()), now, Duration::ZERO, 0).settle(Served::CoalescedRemote) {
                prop_assert_ne!(answer.entry().status(), Status::Failed);
                prop_assert_eq!(answer.served == Served::Stale, e.is_backoff());
            }
        }

        #[test]
        fn the_store_policy_keeps_each_kind_as_documented(e in entry(), l in lifetimes()) {
            let s = store_for(&e, l);
            let fresh = Duration::from_millis(e.fresh_until() - e.stored_at());
            match e.status() {
                Status::Found => {
                    // Served through the grace window, kept as the fail-safe
                    // copy through MAX_STALE: one key, as long as the longer.
                    prop_assert_eq!(s.value, fresh + l.stale_while_revalidate.max(l.max_stale));
                    prop_assert!(s.tombstone.is_zero() && s.failure.is_zero());
                }
                Status::NotFound => {
                    prop_assert_eq!(s.value, fresh);
                    // The tombstone lives as long as a found copy would.
                    prop_assert_eq!(s.tombstone.is_zero(), l.max_stale.is_zero());
                    prop_assert!(s.tombstone.is_zero() || s.tombstone == fresh + l.max_stale);
                    prop_assert!(s.failure.is_zero());
                }
                Status::Failed => {
                    prop_assert!(s.value.is_zero() && s.tombstone.is_zero());
                    prop_assert_eq!(s.failure, l.failure_ttl);
                }
                Status::TooLarge => {
                    prop_assert_eq!(s.value, fresh);
                    prop_assert!(s.tombstone.is_zero() && s.failure.is_zero());
                }
            }
        }
    }
}
