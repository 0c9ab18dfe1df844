//! The change feed (trigger): the feed's loop: one connection LISTENs, a
//! catch-up reads the outbox on every notification, and every change read is
//! applied to the cache.
//!
//! ```text
//!  ┌► starting point (first time: the fleet's position, else now)
//!  │   LISTEN postcache_changes            (before the catch-up: a commit
//!  │   catch up from the previous snapshot  after its snapshot notifies)
//!  │   up ── notification, or every SWEEP_EVERY ──► catch up again
//!  │        │ the connection fails, a step overruns its bound
//!  └─ down, backoff ◄┘
//! ```
//!
//! Nothing is lost while the connection is down: the previous snapshot is
//! kept, and the catch-up after the reconnect reads every change that
//! committed since, from the outbox. Notifications carry nothing: they only
//! say "look". A change that cannot be applied (its Redis node down) does
//! not hold the others back: it waits in a retry list, tried again at every
//! catch-up, and the feed says it is down until the list is empty. Every
//! step on PostgreSQL is bounded, so a connection cut without a word costs
//! a reconnect, not a hang.

pub mod outbox;

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::{stream, StreamExt};
use sqlx::{postgres::PgListener, PgPool};
use tokio::sync::watch;
use tracing::Instrument;

use super::FeedState;
use crate::{
    config::DatabaseSettings,
    read_path::ReadPath,
    redis::{ChangeKind, RedisError},
    store::{self, PostStore},
    telemetry::metrics,
};
use outbox::{CatchUp, Change, Op, CHANNEL};

/// A catch-up also runs this often without a notification: a safety net
/// for a notification lost, and the beat at which the listener's connection
/// is checked and the outbox pruned.
const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// Margin over DB_STATEMENT_TIMEOUT of the bound on each step on PostgreSQL
/// (a connection, a LISTEN, a page, a commit, a check, a prune).
const STEP_MARGIN: Duration = Duration::from_secs(1);
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
/// Most changes kept for a retry; past it they are dropped for one
/// invalidation of every post (the cutoff), applied once Redis answers.
const RETRY_LIST_MAX: usize = 10_000;

/// The feed of one process.
pub(super) struct Follower {
    /// Catch-ups and pruning; the listener has a pool of its own per session.
    pub pool: PgPool,
    pub database: DatabaseSettings,
    pub read_path: Arc<ReadPath<PostStore>>,
    pub retention: Duration,
    pub state: Arc<watch::Sender<Option<FeedState>>>,
}

/// What the feed keeps across reconnects.
struct TriggerProgress {
    /// The snapshot of the last catch-up: every change visible in it has
    /// been applied, or is in `retry`.
    previous: Option<String>,
    /// Changes that could not be applied yet, by post (`None`: every post).
    retry: HashMap<Option<i64>, Change>,
    position_written: Option<Instant>,
    pruned: Option<Instant>,
}

/// Runs `step` within `limit`, or fails.
async fn bounded<T, E: Into<anyhow::Error>>(
    limit: Duration,
    what: &str,
    step: impl std::future::Future<Output = Result<T, E>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, step).await {
        Ok(done) => done.map_err(Into::into),
        Err(_) => Err(anyhow::anyhow!("{what}: no answer within {limit:?}")),
    }
}

impl Follower {
    fn step_limit(&self) -> Duration {
        self.database.db_statement_timeout + self.database.db_acquire_timeout + STEP_MARGIN
    }

    /// Follows the changes until aborted.
    pub async fn run(&self) {
        let mut progress = TriggerProgress {
            previous: None,
            retry: HashMap::new(),
            position_written: None,
            pruned: None,
        };
        let mut backoff = RETRY_FIRST;
        loop {
            // One connection's life: it ends only with why it ended.
            let Err(error) = self.listen_and_follow(&mut progress, &mut backoff).await;
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
        // Changes may go unseen while down: no memory tier then.
        self.read_path.serve_from_memory(state == FeedState::Up);
        self.state.send_replace(Some(state));
    }

    async fn listen_and_follow(
        &self,
        progress: &mut TriggerProgress,
        backoff: &mut Duration,
    ) -> anyhow::Result<std::convert::Infallible> {
        let limit = self.step_limit();
        // Before LISTEN: a change committed between this snapshot and the
        // LISTEN is not visible in it, so the first catch-up reads it.
        if progress.previous.is_none() {
            let start = bounded(limit, "starting point", self.starting_point()).await?;
            progress.previous = Some(start);
        }
        // A pool of its own, dropped with the session: a listener dropped on
        // a connection that stopped answering keeps it (sqlx sends UNLISTEN
        // first), and must not keep the next session from connecting.
        let pool = store::connect_feed(&self.database, 1)?;
        let mut listener = bounded(limit, "listen", async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        })
        .await?;
        self.catch_up(progress).await?;
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
                    bounded(limit, "listener check", sqlx::query("select 1").execute(&mut listener)).await?;
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
            if outbox::is_past_snapshot(&self.pool, &position).await {
                return Ok(position);
            }
            tracing::warn!(
                position,
                "change-feed position in Redis is not of this database; starting from now"
            );
        }
        Ok(outbox::snapshot(&self.pool).await?)
    }

    /// Reads every change not visible in the previous snapshot and applies
    /// it, with what waits for a retry (beside the first page, not before
    /// it: a change stuck on a stalled node must not delay the new ones);
    /// its snapshot then becomes the previous one (what fails to apply is
    /// kept for a retry). Up once nothing waits.
    async fn catch_up(&self, progress: &mut TriggerProgress) -> anyhow::Result<()> {
        let limit = self.step_limit();
        let previous = progress
            .previous
            .clone()
            .expect("set before the first catch-up");
        let mut catch_up = bounded(limit, "catch-up", CatchUp::begin(&self.pool)).await?;
        let mut changes: Vec<Change> = std::mem::take(&mut progress.retry).into_values().collect();
        let mut after = 0;
        loop {
            let page = match bounded(limit, "catch-up page", catch_up.page(&previous, after)).await
            {
                Ok(page) => page,
                Err(error) => {
                    // Still waiting: kept for the next catch-up.
                    for change in changes {
                        keep_for_retry(&mut progress.retry, change);
                    }
                    return Err(error);
                }
            };
            after = page.last.unwrap_or(after);
            // After what waited: the later of a post's changes is applied.
            changes.extend(page.changes);
            let span = tracing::debug_span!("apply_changes", changes = changes.len());
            self.apply(std::mem::take(&mut changes), progress)
                .instrument(span)
                .await;
            if !page.full {
                break;
            }
        }
        let snapshot = catch_up.snapshot.clone();
        bounded(limit, "catch-up commit", catch_up.end()).await?;
        progress.previous = Some(snapshot);
        self.write_position_if_due(progress).await;
        self.set(if progress.retry.is_empty() {
            FeedState::Up
        } else {
            FeedState::Down
        });
        Ok(())
    }

    /// Applies changes: the last of each post (a post changed twice needs
    /// one invalidation, of the later kind; one change of every post stands
    /// for all), a few at once. What fails goes to the retry list.
    async fn apply(&self, changes: Vec<Change>, progress: &mut TriggerProgress) {
        let mut last: HashMap<Option<i64>, Change> = HashMap::new();
        for change in changes {
            last.insert(scope(&change), change);
        }
        let failed: Vec<(Change, RedisError)> = stream::iter(last.into_values())
            .map(|change| async move {
                match self.apply_one(&change).await {
                    Ok(()) => None,
                    Err(error) => Some((change, error)),
                }
            })
            .buffer_unordered(APPLYING)
            .filter_map(std::future::ready)
            .collect()
            .await;
        for (change, error) in failed {
            tracing::debug!(%error, change = change.id, "change not applied; retrying");
            keep_for_retry(&mut progress.retry, change);
        }
    }

    async fn apply_one(&self, change: &Change) -> Result<(), RedisError> {
        let path = &self.read_path;
        match (change.op, change.post_id) {
            (_, None) | (Op::Truncate | Op::InvalidateAll, _) => {
                path.invalidate_all(change.id).await?;
            }
            (Op::Delete, Some(id)) => {
                path.invalidate(&id, change.id, ChangeKind::Deleted).await?;
            }
            (_, Some(id)) => {
                path.invalidate(&id, change.id, ChangeKind::Changed).await?;
            }
        }
        let now = crate::cache::now_millis() as i128 * 1000;
        let lag = change
            .changed_at
            .unix_micros()
            .and_then(|at| u64::try_from(now - at).ok())
            .map_or(Duration::ZERO, Duration::from_micros);
        metrics::change_applied(change.op.as_str(), lag);
        tracing::debug!(
            change = change.id,
            post = change.post_id,
            op = change.op.as_str(),
            "change applied"
        );
        Ok(())
    }

    async fn write_position_if_due(&self, progress: &mut TriggerProgress) {
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

    async fn prune_if_due(&self, progress: &mut TriggerProgress) {
        if progress.pruned.is_some_and(|at| at.elapsed() < PRUNE_EVERY) {
            return;
        }
        let Some(applied) = progress.previous.clone() else {
            return;
        };
        progress.pruned = Some(Instant::now());
        let pruning = outbox::prune(&self.pool, self.retention, &applied);
        match bounded(self.step_limit(), "prune", pruning).await {
            Ok(0) => {}
            Ok(pruned) => tracing::debug!(pruned, "change outbox pruned"),
            Err(error) => tracing::warn!(
                error = format!("{error:#}"),
                "could not prune the change outbox"
            ),
        }
    }
}

/// What a change is about: one post, or (`None`) every post.
fn scope(change: &Change) -> Option<i64> {
    match change.op {
        Op::Truncate | Op::InvalidateAll => None,
        _ => change.post_id,
    }
}

/// Keeps a change for a retry: the later of two for one post; past
/// RETRY_LIST_MAX, one change of every post in place of the whole list.
fn keep_for_retry(retry: &mut HashMap<Option<i64>, Change>, change: Change) {
    let all = |id| Change {
        id,
        post_id: None,
        op: Op::InvalidateAll,
        changed_at: change.changed_at,
    };
    if retry.len() >= RETRY_LIST_MAX && !retry.contains_key(&scope(&change)) {
        tracing::warn!(
            "too many changes waiting for Redis; every post will be invalidated instead"
        );
        let id = retry
            .values()
            .map(|c| c.id)
            .chain([change.id])
            .max()
            .unwrap_or(change.id);
        retry.clear();
        retry.insert(None, all(id));
        return;
    }
    let later = match retry.get(&scope(&change)) {
        Some(kept) => kept.id < change.id,
        None => true,
    };
    if later {
        retry.insert(scope(&change), change);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(id: i64, post: i64) -> Change {
        Change {
            id,
            post_id: Some(post),
            op: Op::Update,
            changed_at: crate::posts::Timestamp::from_unix_seconds(0),
        }
    }

    #[test]
    fn the_retry_list_keeps_the_later_change_of_a_post() {
        let mut retry = HashMap::new();
        keep_for_retry(&mut retry, change(5, 1));
        keep_for_retry(&mut retry, change(3, 1));
        keep_for_retry(&mut retry, change(4, 2));

        assert_eq!(retry.len(), 2);
        assert_eq!(retry[&Some(1)].id, 5);
    }

    #[test]
    fn a_full_retry_list_becomes_one_change_of_every_post() {
        let mut retry = HashMap::new();
        for post in 0..RETRY_LIST_MAX as i64 {
            keep_for_retry(&mut retry, change(post + 1, post));
        }
        assert_eq!(retry.len(), RETRY_LIST_MAX);

        keep_for_retry(&mut retry, change(99_999, -1));

        assert_eq!(retry.len(), 1);
        let all = &retry[&None];
        assert_eq!((all.op, all.id), (Op::InvalidateAll, 99_999));
    }
}
