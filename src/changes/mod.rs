//! The change feed: changes made to `posts` in PostgreSQL, by any writer,
//! invalidate the cache fleet-wide within milliseconds.
//!
//! ```text
//! writer ─► posts ─trigger─► post_changes (outbox) ─NOTIFY at commit─► every instance:
//!              catch up from the outbox (by snapshot) ─► apply each change to Redis
//!              (fence, delete / mark stale / tombstone: flight/apply.rs)
//! ```
//!
//! - Capture (`migrations/0002_post_changes.sql`): statement triggers on
//!   `posts` append every insert, update (that changes something), delete
//!   and truncate to the outbox in the writer's own transaction, which
//!   notifies `postcache_changes` once per statement.
//! - Delivery ([`feed`]): each instance LISTENs, and on every notification
//!   (and every few seconds) catches up from the outbox past the snapshot of
//!   its last catch-up ([`outbox`]), so nothing is missed while its
//!   connection is down. A starting instance begins at the fleet's position
//!   (kept in Redis). The outbox is pruned past CHANGE_RETENTION.
//! - Apply: every instance applies every change; applying is idempotent.
//!   While the feed is down, `/readyz` says `"change_feed": "down"` and
//!   `postcache_change_feed_up` is 0: the instance still serves, and
//!   freshness falls back to the TTLs (a change made meanwhile is applied
//!   on the reconnect, or seen when its entry expires, whichever is first).
//! - The cutoff of `invalidate --all` is followed from Redis every second,
//!   with the feed or without it.

mod feed;
pub mod outbox;

use std::{sync::Arc, time::Duration};

use anyhow::Context;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;

pub use outbox::{Change, Op};

use crate::{
    config::{ChangeFeed, DatabaseSettings},
    db,
    flight::ReadPath,
    posts::PostStore,
};

/// Longest a starting instance waits for its feed's first catch-up before
/// it serves anyway, with the feed down (a first attempt that fails ends
/// the wait at once: PostgreSQL or Redis unreachable).
const STARTUP_WAIT: Duration = Duration::from_secs(2);
/// How often the cutoff of `invalidate --all` is read from Redis.
const CUTOFF_EVERY: Duration = Duration::from_secs(1);
/// Longest a shutdown waits for the feed's connections to close.
const CLOSE_LIMIT: Duration = Duration::from_secs(2);

/// What `/readyz` says of the feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedState {
    /// CHANGE_FEED=off.
    Off,
    /// Listening and caught up.
    Up,
    /// Not connected, or a catch-up failed: changes wait in the outbox.
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

/// The state of a feed, as the HTTP layer reads it (`None` until its first
/// attempt has ended: down, for `/readyz`).
#[derive(Debug, Clone)]
pub struct FeedStatus(watch::Receiver<Option<FeedState>>);

impl FeedStatus {
    pub fn get(&self) -> FeedState {
        self.0.borrow().unwrap_or(FeedState::Down)
    }
}

/// The feed of one process, and the cutoff's follower; both stop when it
/// is stopped or dropped.
pub struct Feed {
    status: FeedStatus,
    pool: Option<PgPool>,
    _tasks: Vec<AbortOnDropHandle<()>>,
}

impl Feed {
    /// Starts following (CHANGE_FEED=on) and returns once the first
    /// catch-up is done or has failed, or after STARTUP_WAIT.
    pub async fn start(
        mode: ChangeFeed,
        database: &DatabaseSettings,
        retention: Duration,
        read_path: Arc<ReadPath<PostStore>>,
    ) -> anyhow::Result<Self> {
        // A cutoff raised before this process started holds from its
        // first request.
        if let Err(error) = read_path.follow_cutoff().await {
            tracing::warn!(%error, "could not read the cutoff of invalidate --all; following it in the background");
        }
        let mut tasks = vec![AbortOnDropHandle::new(tokio::spawn(follow_cutoff(
            read_path.clone(),
        )))];
        if mode == ChangeFeed::Off {
            let (_, state) = watch::channel(Some(FeedState::Off));
            return Ok(Self {
                status: FeedStatus(state),
                pool: None,
                _tasks: tasks,
            });
        }
        // The memory tier serves once the feed is up (caught up).
        read_path.serve_from_memory(false);
        // Catch-ups and pruning take turns on one connection; the listener
        // has a pool of its own.
        let pool = db::connect_feed(database, 1).context("invalid DATABASE_URL")?;
        let (sender, mut state) = watch::channel(None);
        let follower = feed::Follower {
            pool: pool.clone(),
            database: database.clone(),
            read_path,
            retention,
            state: sender,
        };
        tasks.push(AbortOnDropHandle::new(tokio::spawn(follower.run())));
        let first = tokio::time::timeout(STARTUP_WAIT, state.wait_for(Option::is_some))
            .await
            .ok()
            .and_then(|seen| seen.ok().and_then(|s| *s));
        if first != Some(FeedState::Up) {
            tracing::warn!(
                "change feed not up at start; serving, with freshness from the TTLs until it is"
            );
        }
        Ok(Self {
            status: FeedStatus(state),
            pool: Some(pool),
            _tasks: tasks,
        })
    }

    pub fn status(&self) -> FeedStatus {
        self.status.clone()
    }

    /// Stops following and closes the feed's connections (bounded).
    pub async fn stop(self) {
        let Self { pool, _tasks, .. } = self;
        drop(_tasks);
        if let Some(pool) = pool {
            if tokio::time::timeout(CLOSE_LIMIT, pool.close())
                .await
                .is_err()
            {
                tracing::warn!("change feed connections did not close in time");
            }
        }
    }
}

/// Reads the cutoff of `invalidate --all` from Redis every CUTOFF_EVERY.
async fn follow_cutoff(read_path: Arc<ReadPath<PostStore>>) {
    let mut every = tokio::time::interval(CUTOFF_EVERY);
    loop {
        every.tick().await;
        if let Err(error) = read_path.follow_cutoff().await {
            tracing::debug!(%error, "could not read the cutoff of invalidate --all");
        }
    }
}
