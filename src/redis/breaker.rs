//! The Redis side: a circuit breaker in front of Redis. While Redis is
//! down, requests stop paying REDIS_TIMEOUT on every command and fail open
//! at once.
//!
//! Closed: commands pass; BREAKER_FAILURES consecutive connection failures or
//! timeouts open it. Open: commands are refused without touching Redis for
//! BREAKER_COOLDOWN. Half-open: one command (the probe) passes; its success
//! closes the breaker, its failure opens it for another cooldown. A new
//! connection that took the scripts and answers a keyed read closes it at
//! once (`scripts/loading.rs`).
//!
//! The probe is a [`Permit`]: a command's future may be dropped at any await
//! (its client went away), and a probe that ends without a verdict must not
//! keep every later command from probing. Dropping an unsettled probe permit
//! gives the probe back.

use std::{
    sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// Consecutive failures that open the breaker.
pub const BREAKER_FAILURES: u32 = 3;
/// How long an open breaker refuses commands before letting a probe through.
pub const BREAKER_COOLDOWN: Duration = Duration::from_millis(500);

/// Lock-free: it sits on the path of every Redis command. Atomics rather than
/// a mutex because the common case (closed) is a single relaxed load.
pub struct Breaker {
    epoch: Instant,
    failures: AtomicU32,
    /// Milliseconds since `epoch` until which the breaker is open; 0 = closed.
    open_until: AtomicU64,
    /// A half-open probe is in flight.
    probing: AtomicBool,
}

/// The breaker's state, as exported in metrics (0, 1, 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed = 0,
    Open = 1,
    HalfOpen = 2,
}

impl Default for Breaker {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
        }
    }
}

impl Breaker {
    fn now_ms(&self) -> u64 {
        // +1 so that 0 always means "closed".
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    pub fn state(&self) -> State {
        match self.open_until.load(Ordering::Acquire) {
            0 => State::Closed,
            until if self.now_ms() < until => State::Open,
            _ => State::HalfOpen,
        }
    }

    /// Leave for one command to go to Redis now, `None` when refused.
    pub fn permit(&self) -> Option<Permit<'_>> {
        let probe = match self.state() {
            State::Closed => false,
            State::Open => return None,
            // Exactly one caller gets to probe.
            State::HalfOpen => {
                self.probing
                    .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                    .ok()?;
                true
            }
        };
        Some(Permit {
            breaker: self,
            probe,
        })
    }

    /// A connection to Redis was (re)established and answered: close at once
    /// rather than wait for the next probe after the cooldown.
    pub fn reconnected(&self) {
        self.record_success();
    }

    fn record_success(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self.open_until.swap(0, Ordering::AcqRel) != 0 {
            tracing::info!("redis answers again; circuit breaker closed");
        }
        self.probing.store(false, Ordering::Release);
    }

    fn record_failure(&self) {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        let probe_failed = self.probing.swap(false, Ordering::AcqRel);
        if probe_failed || failures >= BREAKER_FAILURES {
            let was = self.open_until.swap(
                self.now_ms() + BREAKER_COOLDOWN.as_millis() as u64,
                Ordering::AcqRel,
            );
            if was == 0 {
                tracing::warn!(failures, "redis failing; circuit breaker opened");
            }
        }
    }
}

/// Leave for one command; tell the breaker how it went with
/// [`Permit::succeeded`] or [`Permit::failed`].
pub struct Permit<'a> {
    breaker: &'a Breaker,
    /// This command is the half-open probe.
    probe: bool,
}

impl Permit<'_> {
    pub fn succeeded(mut self) {
        self.probe = false;
        self.breaker.record_success();
    }

    pub fn failed(mut self) {
        self.probe = false;
        self.breaker.record_failure();
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.probe {
            // Dropped before its verdict (the command's future was
            // cancelled): the next command probes instead.
            self.breaker.probing.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_opens_after_consecutive_failures_and_probes_once_after_the_cooldown() {
        let b = Breaker::default();
        for _ in 0..BREAKER_FAILURES - 1 {
            b.permit().expect("still closed").failed();
        }
        b.permit().expect("still closed").failed();
        assert_eq!(b.state(), State::Open);
        assert!(b.permit().is_none());

        std::thread::sleep(BREAKER_COOLDOWN + Duration::from_millis(20));
        assert_eq!(b.state(), State::HalfOpen);
        let probe = b.permit().expect("one probe");
        assert!(b.permit().is_none(), "only one probe");
        probe.failed();
        assert_eq!(b.state(), State::Open, "a failed probe reopens");

        std::thread::sleep(BREAKER_COOLDOWN + Duration::from_millis(20));
        b.permit().expect("a probe").succeeded();
        assert_eq!(b.state(), State::Closed);
        assert!(b.permit().is_some() && b.permit().is_some());
    }

    #[test]
    fn a_probe_dropped_without_a_verdict_lets_the_next_command_probe() {
        let b = Breaker::default();
        for _ in 0..BREAKER_FAILURES {
            b.permit().expect("closed").failed();
        }
        std::thread::sleep(BREAKER_COOLDOWN + Duration::from_millis(20));

        drop(b.permit().expect("the probe"));

        let next = b.permit().expect("the probe was given back");
        next.succeeded();
        assert_eq!(b.state(), State::Closed);
    }

    #[test]
    fn a_success_resets_the_count() {
        let b = Breaker::default();
        for _ in 0..BREAKER_FAILURES - 1 {
            b.record_failure();
        }
        b.record_success();
        for _ in 0..BREAKER_FAILURES - 1 {
            b.record_failure();
        }
        // Without the reset, these failures would add up past the threshold.
        assert_eq!(
            b.state(),
            State::Closed,
            "the count restarted at the success"
        );
        b.record_failure();
        assert_eq!(b.state(), State::Open, "and counts on from there");
    }
}
