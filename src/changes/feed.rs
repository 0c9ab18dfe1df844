//! The feed's loop: one connection LISTENs, a catch-up reads the outbox on
//! every notification, and every change read is applied to the cache.
//!
//! ```text
//!  ┌► starting point (first time: the fleet's position, else now)
//!  │   LISTEN postcache_changes            (before the catch-up: a commit
//!  │   catch up from the previous snapshot  after its snapshot notifies)
//!  │   up ── notification, or every SWEEP_EVERY ──► catch up again
//!  │        │ the connection fails, a catch-up fails (PostgreSQL or Redis)
//!  └─ down, backoff ◄┘
//! ```
//!
//! Nothing is lost while the connection is down: the previous snapshot is
//! kept, and the catch-up after the reconnect reads every change that
//! committed since, from the outbox. Notifications carry nothing: they only
//! say "look". A catch-up that fails part-way applies its changes again
//! next time (applying is idempotent).

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::{stream, StreamExt, TryStreamExt};
use sqlx::{postgres::PgListener, PgPool};
use time::OffsetDateTime;
use tokio::sync::watch;

use super::{
    outbox::{self, CatchUp, Change, Op, CHANNEL, PAGE},
    FeedState,
};
use crate::{
    flight::{ChangeKind, ReadPath},
    posts::PostStore,
    telemetry::metrics,
};

/// A catch-up also runs this often without a notification: a safety net
/// for a notification lost, and the beat at which the listener's connection
/// is checked, the outbox pruned and the fleet's position written.
const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// Bound on the listener connection's answer to a check.
const CHECK_LIMIT: Duration = Duration::from_secs(2);
/// How often the fleet's position is written to Redis, at most.
const POSITION_EVERY: Duration = Duration::from_secs(1);
/// How often the outbox is pruned.
const PRUNE_EVERY: Duration = Duration::from_secs(60);
/// Pauses between attempts while the feed is down: doubling from the first
/// to the second.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// Changes of one page applied at once.
const APPLYING: usize = 64;

/// The feed of one process.
pub(super) struct Follower {
    pub pool: PgPool,
    pub read_path: Arc<ReadPath<PostStore>>,
    pub retention: Duration,
    pub state: watch::Sender<Option<FeedState>>,
}

/// What a session keeps across reconnects.
struct Progress {
    /// The snapshot of the last catch-up: every change visible in it has
    /// been applied.
    previous: Option<String>,
    position_written: Option<Instant>,
    pruned: Option<Instant>,
}

impl Follower {
    /// Follows the changes until aborted.
    pub async fn run(self) {
        let mut progress = Progress {
            previous: None,
            position_written: None,
            pruned: None,
        };
        let mut backoff = RETRY_FIRST;
        loop {
            let error = self.session(&mut progress, &mut backoff).await;
            if *self.state.borrow() == Some(FeedState::Up) {
                tracing::warn!(
                    error = format!("{error:#}"),
                    "change feed down; catching up when it is back"
                );
                metrics::feed_reconnected();
            } else {
                tracing::debug!(error = format!("{error:#}"), "change feed still down");
            }
            self.set(FeedState::Down);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RETRY_MAX);
        }
    }

    fn set(&self, state: FeedState) {
        metrics::feed_up(state == FeedState::Up);
        self.state.send_replace(Some(state));
    }

    /// One connection's life; returns why it ended.
    async fn session(&self, progress: &mut Progress, backoff: &mut Duration) -> anyhow::Error {
        match self.listen_and_follow(progress, backoff).await {
            Ok(never) => match never {},
            Err(error) => error,
        }
    }

    async fn listen_and_follow(
        &self,
        progress: &mut Progress,
        backoff: &mut Duration,
    ) -> anyhow::Result<std::convert::Infallible> {
        // Before LISTEN: a change committed between this snapshot and the
        // LISTEN is not visible in it, so the first catch-up reads it.
        if progress.previous.is_none() {
            progress.previous = Some(self.starting_point().await?);
        }
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(CHANNEL).await?;
        self.catch_up(progress).await?;
        self.set(FeedState::Up);
        *backoff = RETRY_FIRST;
        let mut beat = tokio::time::interval(SWEEP_EVERY);
        beat.reset();
        loop {
            tokio::select! {
                notified = listener.try_recv() => match notified? {
                    // One catch-up for every notification already here.
                    Some(_) => while listener.next_buffered().is_some() {},
                    // The connection was lost and made again (LISTEN
                    // included): what committed meanwhile is in the outbox.
                    None => {
                        tracing::info!("change feed reconnected; catching up");
                        metrics::feed_reconnected();
                    }
                },
                _ = beat.tick() => {
                    // A connection cut without a word would leave us deaf.
                    tokio::time::timeout(CHECK_LIMIT, sqlx::query("select 1").execute(&mut listener))
                        .await
                        .map_err(|_| anyhow::anyhow!("the listener's connection did not answer"))??;
                    self.prune_if_due(progress).await;
                }
            }
            self.catch_up(progress).await?;
        }
    }

    /// Where a process that has applied nothing yet starts: the fleet's
    /// position in Redis (so that changes made while no instance ran are
    /// applied), or else the database's snapshot now.
    async fn starting_point(&self) -> anyhow::Result<String> {
        let key = self.read_path.keys().feed_position();
        if let Some(position) = self.read_path.redis().get_string(&key).await? {
            if outbox::is_snapshot(&self.pool, &position).await {
                return Ok(position);
            }
            tracing::warn!(
                position,
                "unreadable change-feed position in Redis; starting from now"
            );
        }
        Ok(outbox::snapshot(&self.pool).await?)
    }

    /// Reads and applies every change not visible in the previous
    /// snapshot; on success, its snapshot becomes the previous one.
    async fn catch_up(&self, progress: &mut Progress) -> anyhow::Result<()> {
        let previous = progress
            .previous
            .clone()
            .expect("set before the first catch-up");
        let mut catch_up = CatchUp::begin(&self.pool).await?;
        let mut after = 0;
        loop {
            let page = catch_up.page(&previous, after).await?;
            let Some(last) = page.last() else { break };
            after = last.id;
            let full = page.len() as i64 == PAGE;
            self.apply(page).await?;
            if !full {
                break;
            }
        }
        let snapshot = catch_up.snapshot.clone();
        catch_up.end().await?;
        progress.previous = Some(snapshot);
        self.write_position_if_due(progress).await;
        Ok(())
    }

    /// Applies one page: the last change of each post (a post changed
    /// twice needs one invalidation, of the later kind), a few at once.
    async fn apply(&self, page: Vec<Change>) -> anyhow::Result<()> {
        let mut last: HashMap<Option<i64>, Change> = HashMap::new();
        for change in page {
            let every =
                change.post_id.is_none() || matches!(change.op, Op::Truncate | Op::InvalidateAll);
            last.insert(if every { None } else { change.post_id }, change);
        }
        stream::iter(last.into_values())
            .map(|change| self.apply_one(change))
            .buffer_unordered(APPLYING)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    async fn apply_one(&self, change: Change) -> anyhow::Result<()> {
        let path = &self.read_path;
        match (change.op, change.post_id) {
            (Op::Truncate | Op::InvalidateAll, _) | (_, None) => {
                path.invalidate_all().await?;
            }
            (Op::Delete, Some(id)) => {
                path.invalidate(&id, change.id, ChangeKind::Deleted).await?;
            }
            (_, Some(id)) => {
                path.invalidate(&id, change.id, ChangeKind::Changed).await?;
            }
        }
        let lag = OffsetDateTime::now_utc() - change.changed_at;
        metrics::change_applied(change.op.as_str(), lag.try_into().unwrap_or_default());
        tracing::debug!(
            change = change.id,
            post = change.post_id,
            op = change.op.as_str(),
            "change applied"
        );
        Ok(())
    }

    async fn write_position_if_due(&self, progress: &mut Progress) {
        if progress
            .position_written
            .is_some_and(|at| at.elapsed() < POSITION_EVERY)
        {
            return;
        }
        let Some(position) = &progress.previous else {
            return;
        };
        let key = self.read_path.keys().feed_position();
        match self.read_path.redis().set_string(&key, position).await {
            Ok(()) => progress.position_written = Some(Instant::now()),
            Err(error) => tracing::debug!(%error, "could not write the change-feed position"),
        }
    }

    async fn prune_if_due(&self, progress: &mut Progress) {
        if progress.pruned.is_some_and(|at| at.elapsed() < PRUNE_EVERY) {
            return;
        }
        progress.pruned = Some(Instant::now());
        match outbox::prune(&self.pool, self.retention).await {
            Ok(0) => {}
            Ok(pruned) => tracing::debug!(pruned, "change outbox pruned"),
            Err(error) => tracing::warn!(%error, "could not prune the change outbox"),
        }
    }
}
