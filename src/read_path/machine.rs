//! The protocol: one flight's coordination as a state machine, with pure
//! transitions (`waiter.rs` drives it against Redis).
//!
//! ```text
//!  Start ─► Elect ──won──► Lead ──done──► End(Answer)
//!     ▲       │  ▲            └─fenced─► Elect (new token), or after
//!     │       │  │                       FENCED_ROUNDS End(Unstored)
//!     │      lost└──────────────────────────────┐
//!     │       ▼                                 │
//!     │  first time: Listen (SUBSCRIBE, confirmed)
//!     │       ▼                                 │
//!     │     Look (GET) ──an answer──► End(Answer), "recheck"
//!     │       ▼     └──too large───► End(Pass), "too_large"
//!     │    deadline? ──► End(TimedOut), "timeout"
//!     │       ▼                                 │
//!     └──── Sleep: a message (an answer? End, "message"), or woken to
//!           look again (the lock's expiry, a re-check notice, RETRY,
//!           the poll interval) ─► past the deadline? End(TimedOut)
//! ```
//!
//! A Redis step that fails ends in `FailOpen` (the flight loads straight
//! from the source); one that outlives the hard bound (WAIT_TIMEOUT plus a
//! REDIS_TIMEOUT) in `TimedOut`. Every wait (from the first lost election)
//! ends exactly once, named by a [`WaitEnd`].

use std::time::{Duration, Instant};

use super::{answer::Outcome, freshness::Verdict, Served};
use crate::cache::Entry;

/// How a leader's turn ended.
#[derive(Debug, PartialEq)]
pub(super) enum Led {
    /// With an outcome for its flight.
    Done(Outcome),
    /// Fenced: a change to the item was applied while it loaded, so what it
    /// read (given here) may predate the change. Nothing was stored, and its
    /// waiters were told to elect a leader again; so should its own flight.
    Fenced(Entry),
}

/// How many times in a row a flight's own leader may be fenced by changes
/// before it answers with what it read last (not storing it): a post
/// changed faster than it can be read would otherwise never be answered.
pub(super) const FENCED_ROUNDS: u32 = 3;

/// How a wait ended: the `ended_by` label of `postcache_waits_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WaitEnd {
    /// The leader's ready message carried the answer.
    Message,
    /// A look at the value found the answer.
    Recheck,
    /// This waiter took the lock over (the leader was gone or fenced).
    Takeover,
    /// The item is too large to cache: this waiter loads it uncached.
    TooLarge,
    /// The load failed (a failure marker, or a failure published).
    Failure,
    /// WAIT_TIMEOUT passed.
    Timeout,
}

impl WaitEnd {
    pub const ALL: [WaitEnd; 6] = [
        WaitEnd::Message,
        WaitEnd::Recheck,
        WaitEnd::Takeover,
        WaitEnd::TooLarge,
        WaitEnd::Failure,
        WaitEnd::Timeout,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            WaitEnd::Message => "message",
            WaitEnd::Recheck => "recheck",
            WaitEnd::Takeover => "takeover",
            WaitEnd::TooLarge => "too_large",
            WaitEnd::Failure => "failure",
            WaitEnd::Timeout => "timeout",
        }
    }
}

/// What happened at the last step.
#[derive(Debug)]
pub(super) enum Event {
    /// The flight begins.
    Start,
    /// The election (SET NX): won or lost.
    Elected(bool),
    /// This flight's leader is done.
    Led(Led),
    /// The listener is in place (a confirmed subscription, or an interval).
    Listening,
    /// The value looked at (GET), judged.
    Looked(Verdict),
    /// A ready message, judged.
    Heard(Verdict),
    /// Woken with nothing to judge: look again.
    Woken,
    /// A Redis step failed.
    RedisFailed,
    /// A Redis step outlived the hard bound.
    Overran,
}

/// What the flight does next.
#[derive(Debug, PartialEq)]
pub(super) enum Step {
    /// Try to take the lock.
    Elect,
    /// Lead the load, holding the lock.
    Lead,
    /// Start listening for the leader's message.
    Listen,
    /// Look at the value.
    Look,
    /// Sleep until woken, the lock's expiry, or the deadline.
    Sleep,
    /// Done.
    End(End),
}

/// How a flight ends.
#[derive(Debug, PartialEq)]
pub(super) enum End {
    Answer(Outcome),
    /// The item is too large to cache: load it here, uncached.
    Pass,
    /// Fenced FENCED_ROUNDS times (or at the deadline): answer with what
    /// the leader read last, not stored.
    Unstored(Entry),
    TimedOut,
    /// Redis failed: load straight from the source.
    FailOpen,
}

/// One flight's state machine: its deadline, the fenced rounds of its own
/// leader, and the wait in progress.
#[derive(Debug)]
pub(super) struct FlightMachine {
    deadline: Instant,
    fenced: u32,
    /// Since when this flight waits (from a lost election, until it ends
    /// or the flight takes over).
    since: Option<Instant>,
    /// A wait just ended, and how long it took: for the driver to record.
    ended: Option<(WaitEnd, Duration)>,
}

impl FlightMachine {
    pub fn new(deadline: Instant) -> Self {
        Self {
            deadline,
            fenced: 0,
            since: None,
            ended: None,
        }
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether a wait is in progress.
    pub fn waiting(&self) -> bool {
        self.since.is_some()
    }

    /// The wait that ended at the last transition, if one did.
    pub fn take_ended(&mut self) -> Option<(WaitEnd, Duration)> {
        self.ended.take()
    }

    /// The step after `event`, at `now`.
    pub fn next(&mut self, event: Event, now: Instant) -> Step {
        match event {
            Event::Start | Event::Woken => self.elect(now),
            Event::Elected(true) => {
                self.end_wait(WaitEnd::Takeover, now);
                Step::Lead
            }
            Event::Elected(false) if self.waiting() => Step::Look,
            Event::Elected(false) => Step::Listen,
            Event::Led(Led::Done(outcome)) => Step::End(End::Answer(outcome)),
            // What our leader read may predate a change: elect again, like
            // its waiters, and read the row anew (a bounded number of times).
            Event::Led(Led::Fenced(entry)) => {
                self.fenced += 1;
                if self.fenced >= FENCED_ROUNDS || now >= self.deadline {
                    Step::End(End::Unstored(entry))
                } else {
                    Step::Elect
                }
            }
            Event::Listening => {
                self.since = Some(now);
                Step::Look
            }
            Event::Looked(verdict) => match self.judged(verdict, WaitEnd::Recheck, now) {
                Some(step) => step,
                None if now >= self.deadline => self.time_out(now),
                None => Step::Sleep,
            },
            // A stale entry published: keep waiting for a fresh one.
            Event::Heard(verdict) => self
                .judged(verdict, WaitEnd::Message, now)
                .unwrap_or_else(|| self.elect(now)),
            Event::RedisFailed => Step::End(End::FailOpen),
            Event::Overran => self.time_out(now),
        }
    }

    /// Elect, unless a waiter is past its deadline: it then neither leads
    /// nor loads.
    fn elect(&mut self, now: Instant) -> Step {
        if self.waiting() && now >= self.deadline {
            self.time_out(now)
        } else {
            Step::Elect
        }
    }

    /// The end a judged entry makes of the wait, if any: too large (pass),
    /// an answer (`how`, or a failure), or nothing yet (`None`).
    fn judged(&mut self, verdict: Verdict, how: WaitEnd, now: Instant) -> Option<Step> {
        if verdict == Verdict::TooLarge {
            self.end_wait(WaitEnd::TooLarge, now);
            return Some(Step::End(End::Pass));
        }
        let outcome = verdict.settle(Served::CoalescedRemote)?;
        self.end_wait(
            if outcome.is_err() {
                WaitEnd::Failure
            } else {
                how
            },
            now,
        );
        Some(Step::End(End::Answer(outcome)))
    }

    fn time_out(&mut self, now: Instant) -> Step {
        self.end_wait(WaitEnd::Timeout, now);
        Step::End(End::TimedOut)
    }

    fn end_wait(&mut self, how: WaitEnd, now: Instant) {
        if let Some(since) = self.since.take() {
            self.ended = Some((how, now.saturating_duration_since(since)));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        cache::{now_millis, Status},
        read_path::{Answer, ReadError},
    };

    const SECOND: Duration = Duration::from_secs(1);

    fn found() -> Entry {
        Entry::new(Status::Found, b"{}", SECOND * 60, Duration::ZERO)
    }

    fn failed() -> Entry {
        Entry::new(Status::Failed, &[], Duration::ZERO, Duration::ZERO)
    }

    fn fresh(entry: Entry) -> Verdict {
        crate::read_path::freshness::judge(Some(entry), now_millis(), Duration::ZERO, 0)
    }

    /// A flight that has lost its first election and listens.
    fn waiting(start: Instant) -> FlightMachine {
        let mut wait = FlightMachine::new(start + 5 * SECOND);
        assert_eq!(wait.next(Event::Start, start), Step::Elect);
        assert_eq!(wait.next(Event::Elected(false), start), Step::Listen);
        assert_eq!(wait.next(Event::Listening, start), Step::Look);
        wait
    }

    #[test]
    fn winning_the_first_election_leads_and_ends_no_wait() {
        let now = Instant::now();
        let mut wait = FlightMachine::new(now + SECOND);
        assert_eq!(wait.next(Event::Start, now), Step::Elect);
        assert_eq!(wait.next(Event::Elected(true), now), Step::Lead);
        assert_eq!(wait.take_ended(), None);
        let answer = Answer::new(found(), Served::Miss);
        assert_eq!(
            wait.next(Event::Led(Led::Done(answer.clone())), now),
            Step::End(End::Answer(answer))
        );
        assert_eq!(wait.take_ended(), None);
    }

    #[test]
    fn a_loser_listens_once_then_looks_and_sleeps() {
        let now = Instant::now();
        let mut wait = waiting(now);
        assert_eq!(wait.next(Event::Looked(Verdict::Miss), now), Step::Sleep);
        assert_eq!(wait.next(Event::Woken, now), Step::Elect);
        // Listening already: no second subscription.
        assert_eq!(wait.next(Event::Elected(false), now), Step::Look);
        assert_eq!(wait.take_ended(), None);
    }

    #[test]
    fn a_look_that_finds_the_answer_ends_the_wait_as_a_recheck() {
        let now = Instant::now();
        let mut wait = waiting(now);
        let later = now + Duration::from_millis(30);
        let step = wait.next(Event::Looked(fresh(found())), later);
        assert!(
            matches!(step, Step::End(End::Answer(Ok(a))) if a.served == Served::CoalescedRemote)
        );
        assert_eq!(
            wait.take_ended(),
            Some((WaitEnd::Recheck, Duration::from_millis(30)))
        );
    }

    #[test]
    fn a_message_answers_and_a_failure_is_named_failure() {
        let now = Instant::now();
        let mut wait = waiting(now);
        let step = wait.next(Event::Heard(fresh(found())), now);
        assert!(matches!(step, Step::End(End::Answer(Ok(_)))));
        assert_eq!(wait.take_ended().map(|e| e.0), Some(WaitEnd::Message));

        let mut wait = waiting(now);
        let step = wait.next(Event::Heard(fresh(failed())), now);
        assert_eq!(step, Step::End(End::Answer(Err(ReadError::Unavailable))));
        assert_eq!(wait.take_ended().map(|e| e.0), Some(WaitEnd::Failure));
    }

    #[test]
    fn a_stale_message_keeps_the_waiter_waiting() {
        let now = Instant::now();
        let mut wait = waiting(now);
        assert_eq!(wait.next(Event::Heard(Verdict::Miss), now), Step::Elect);
        assert!(wait.waiting());
        assert_eq!(wait.take_ended(), None);
    }

    #[test]
    fn a_too_large_item_is_passed_at_once() {
        let now = Instant::now();
        let mut wait = waiting(now);
        assert_eq!(
            wait.next(Event::Heard(Verdict::TooLarge), now),
            Step::End(End::Pass)
        );
        assert_eq!(wait.take_ended().map(|e| e.0), Some(WaitEnd::TooLarge));
    }

    #[test]
    fn a_waiter_that_wins_takes_over() {
        let now = Instant::now();
        let mut wait = waiting(now);
        assert_eq!(wait.next(Event::Woken, now), Step::Elect);
        assert_eq!(wait.next(Event::Elected(true), now), Step::Lead);
        assert_eq!(wait.take_ended().map(|e| e.0), Some(WaitEnd::Takeover));
        assert!(!wait.waiting());
        // Losing again later starts a new wait, with a listener anew.
        assert_eq!(
            wait.next(Event::Led(Led::Fenced(found())), now),
            Step::Elect
        );
        assert_eq!(wait.next(Event::Elected(false), now), Step::Listen);
    }

    #[test]
    fn past_the_deadline_a_waiter_gives_up_before_electing_or_sleeping() {
        let now = Instant::now();
        let late = now + 6 * SECOND;
        let mut wait = waiting(now);
        assert_eq!(
            wait.next(Event::Looked(Verdict::Miss), late),
            Step::End(End::TimedOut)
        );
        assert_eq!(wait.take_ended().map(|e| e.0), Some(WaitEnd::Timeout));

        let mut wait = waiting(now);
        assert_eq!(wait.next(Event::Woken, late), Step::End(End::TimedOut));
        assert_eq!(wait.take_ended().map(|e| e.0), Some(WaitEnd::Timeout));

        // A leader (not waiting) is never timed out between its steps.
        let mut wait = FlightMachine::new(now);
        assert_eq!(wait.next(Event::Start, late), Step::Elect);
    }

    #[test]
    fn a_leader_fenced_again_and_again_answers_what_it_read_unstored() {
        let now = Instant::now();
        let mut wait = FlightMachine::new(now + SECOND);
        wait.next(Event::Start, now);
        for _ in 1..FENCED_ROUNDS {
            assert_eq!(wait.next(Event::Elected(true), now), Step::Lead);
            assert_eq!(
                wait.next(Event::Led(Led::Fenced(found())), now),
                Step::Elect
            );
        }
        wait.next(Event::Elected(true), now);
        let entry = found();
        assert_eq!(
            wait.next(Event::Led(Led::Fenced(entry.clone())), now),
            Step::End(End::Unstored(entry))
        );
    }

    #[test]
    fn redis_failing_fails_open_and_an_overrun_times_out() {
        let now = Instant::now();
        let mut wait = FlightMachine::new(now + SECOND);
        wait.next(Event::Start, now);
        assert_eq!(wait.next(Event::RedisFailed, now), Step::End(End::FailOpen));
        assert_eq!(wait.take_ended(), None);

        let mut wait = waiting(now);
        assert_eq!(wait.next(Event::Overran, now), Step::End(End::TimedOut));
        assert_eq!(wait.take_ended().map(|e| e.0), Some(WaitEnd::Timeout));
    }

    #[test]
    fn every_wait_end_has_its_own_label() {
        let labels: std::collections::HashSet<_> =
            WaitEnd::ALL.iter().map(|e| e.as_str()).collect();
        assert_eq!(labels.len(), WaitEnd::ALL.len());
    }
}
