//! A circuit breaker in front of Redis: while Redis is down, requests stop
//! paying REDIS_TIMEOUT on every command and fail open at once.
//!
//! Closed: commands pass; BREAKER_FAILURES consecutive connection failures or
//! timeouts open it. Open: commands are refused without touching Redis for
//! BREAKER_COOLDOWN. Half-open: one command (the probe) passes; its success
//! closes the breaker, its failure opens it for another cooldown.

use std::{
    sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    time::{Duration, Instant},
};

use crate::telemetry::metrics;

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

    /// Whether a command may go to Redis now.
    pub fn allow(&self) -> bool {
        match self.state() {
            State::Closed => true,
            State::Open => false,
            // Exactly one caller gets to probe.
            State::HalfOpen => self
                .probing
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok(),
        }
    }

    pub fn record_success(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self.open_until.swap(0, Ordering::AcqRel) != 0 {
            tracing::info!("redis answers again; circuit breaker closed");
            metrics::breaker_state(State::Closed as u8 as f64);
        }
        self.probing.store(false, Ordering::Release);
    }

    pub fn record_failure(&self) {
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
            metrics::breaker_state(State::Open as u8 as f64);
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
            b.record_failure();
            assert!(b.allow(), "still closed");
        }
        b.record_failure();
        assert_eq!(b.state(), State::Open);
        assert!(!b.allow());

        std::thread::sleep(BREAKER_COOLDOWN + Duration::from_millis(20));
        assert_eq!(b.state(), State::HalfOpen);
        assert!(b.allow(), "one probe");
        assert!(!b.allow(), "only one probe");
        b.record_failure();
        assert_eq!(b.state(), State::Open, "a failed probe reopens");

        std::thread::sleep(BREAKER_COOLDOWN + Duration::from_millis(20));
        assert!(b.allow());
        b.record_success();
        assert_eq!(b.state(), State::Closed);
        assert!(b.allow() && b.allow());
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
