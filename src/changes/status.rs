//! The change feed: its state and report, as `/readyz` and the metrics
//! read them.

use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::fanout::Beats;

/// What `/readyz` says of the feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedState {
    /// CHANGE_FEED=off.
    Off,
    /// Following, caught up.
    Up,
    /// Not connected, behind, or (replication) no decoder keeps up: changes
    /// wait in the outbox or the slot.
    Down,
}

impl FeedState {
    pub fn as_str(self) -> &'static str {
        match self {
            FeedState::Off => "off",
            FeedState::Up => "up",
            FeedState::Down => "down",
        }
    }
}

/// The mode in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Replication,
    Trigger,
    Off,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Replication => "replication",
            Mode::Trigger => "trigger",
            Mode::Off => "off",
        }
    }
}

/// What the feed reports beside its state.
#[derive(Debug, Clone, Copy, Default)]
pub struct Report {
    /// `None` until told (CHANGE_FEED=auto, PostgreSQL not reached yet).
    pub mode: Option<Mode>,
    /// Replication: the WAL the slot holds back, in bytes.
    pub lag_bytes: Option<u64>,
    /// Replication: seconds since the decoder last said it keeps up.
    pub lag_seconds: Option<f64>,
}

/// The state of a feed, as the HTTP layer reads it (`None` until its first
/// attempt has ended: down, for `/readyz`).
#[derive(Debug, Clone)]
pub struct FeedStatus {
    pub(super) state: watch::Receiver<Option<FeedState>>,
    pub(super) report: Arc<Mutex<Report>>,
    /// The decoder's beats and position as this instance read them
    /// (replication; never a position in another mode).
    pub(super) beats: Arc<Beats>,
}

impl FeedStatus {
    pub fn get(&self) -> FeedState {
        self.state.borrow().unwrap_or(FeedState::Down)
    }

    pub fn report(&self) -> Report {
        *self.report.lock().unwrap()
    }

    /// The decoder's position and beats, as this instance read them:
    /// what reads asking for a position or a staleness bound go by.
    pub fn beats(&self) -> &Arc<Beats> {
        &self.beats
    }
}
