//! The protocol: whether loads are getting answers. Tells an instance that
//! is busy (its connections all taken by statements that keep succeeding:
//! [`Busy`](super::Busy), 503 with Retry-After and nothing stored) from a
//! database that has stopped answering (connections all taken by
//! statements, or connects, that hang: a load failure like any other, so
//! that fail-safe copies are served and the failure is remembered for
//! FAILURE_TTL).

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use tokio::time::Instant;

/// When a statement last succeeded (with rows or none), as nanoseconds
/// after `base`; 0 for never.
#[derive(Debug)]
pub struct LoadProgress {
    base: Instant,
    last: AtomicU64,
}

impl Default for LoadProgress {
    fn default() -> Self {
        Self {
            base: Instant::now(),
            last: AtomicU64::new(0),
        }
    }
}

impl LoadProgress {
    /// A statement succeeded now.
    pub fn succeeded(&self) {
        let since = self.base.elapsed().as_nanos().max(1);
        self.last
            .fetch_max(u64::try_from(since).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Whether a statement succeeded at or after `since`.
    pub fn succeeded_since(&self, since: Instant) -> bool {
        let last = self.last.load(Ordering::Relaxed);
        last != 0 && self.base + Duration::from_nanos(last) >= since
    }

    /// Whether a statement succeeded within the last `window`.
    pub fn succeeded_within(&self, window: Duration) -> bool {
        let now = Instant::now();
        self.succeeded_since(now.checked_sub(window).unwrap_or(self.base))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_answer_counts_for_the_window_it_falls_in() {
        let progress = LoadProgress::default();
        assert!(
            !progress.succeeded_within(Duration::from_secs(3600)),
            "never"
        );
        tokio::time::advance(Duration::from_millis(10)).await;
        progress.succeeded();
        let at = Instant::now();
        assert!(progress.succeeded_since(at));
        tokio::time::advance(Duration::from_millis(300)).await;
        assert!(progress.succeeded_within(Duration::from_millis(300)));
        assert!(!progress.succeeded_within(Duration::from_millis(299)));
        assert!(!progress.succeeded_since(at + Duration::from_millis(1)));
    }
}
