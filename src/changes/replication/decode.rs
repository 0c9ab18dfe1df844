//! The change feed (replication): the decoder at work, holding the slot:
//! each committed transaction's changed posts, gathered into batches,
//! applied to Redis and appended to the stream; the LSN confirmed once they
//! are.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use futures::{stream, FutureExt, StreamExt};
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use tracing::Instrument;

use super::{
    batch::{Batch, DecoderProgress, Pending, RETRY_LIST_MAX},
    fanout::{self, Entry, BEAT_EVERY, POSITION_EVERY},
    liveness::{Seen, Session, Verdict},
    pgoutput::{self, Layouts, Message},
    Candidate,
};
use crate::{read_path::Since, redis::ChangeKind, telemetry::metrics};

/// Changes applied to Redis at once, one script each (a Redis Cluster).
const APPLYING: usize = 64;
/// Changes applied by one script on a single Redis.
const APPLIED_TOGETHER: usize = 100;
/// How long the decoder first waits for a batch's commits to become
/// visible on the server, doubling up to VISIBLE_MAX_PAUSE (see
/// `until_visible`).
const VISIBLE_FIRST_PAUSE: Duration = Duration::from_millis(1);
const VISIBLE_MAX_PAUSE: Duration = Duration::from_millis(50);

/// What the decoder keeps of the relations it was told of.
#[derive(Default)]
struct Relations(HashMap<u32, pgoutput::Relation>);

impl Layouts for Relations {
    fn id_column(&self, relation: u32) -> Option<usize> {
        self.0.get(&relation).and_then(|r| r.id_column)
    }
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

fn since_commit(commit_time_micros: i64) -> Duration {
    let now = crate::cache::now_millis() as i64 * 1000;
    Duration::from_micros((now - (commit_time_micros + PG_EPOCH_MICROS)).max(0) as u64)
}

impl Candidate {
    pub(super) async fn decode(
        &self,
        client: &mut ReplicationClient,
        session: &mut Session,
        start: Lsn,
    ) -> anyhow::Result<()> {
        let mut relations = Relations::default();
        let mut pending: Option<Pending> = None;
        let mut batch = Batch::default();
        // Everything before the start was applied by the decoders before.
        let mut progress = DecoderProgress::default();
        progress.read_to(start);
        let mut beat = tokio::time::interval(BEAT_EVERY);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // What is here already is read before anything is applied, so
            // that a burst of commits costs one round of applications and
            // one stream entry; once nothing more is here, the batch goes.
            let event = match client.recv().now_or_never() {
                Some(event) => {
                    // A long burst still beats (judged busy: what the
                    // server sent may wait in this process).
                    if session.judged.elapsed() >= BEAT_EVERY {
                        let open = pending.is_some() || batch.last.is_some();
                        self.judge_and_beat(client, session, &mut progress, open, false)
                            .await?;
                    }
                    // Less often than between bursts: each try may take
                    // a REDIS_TIMEOUT, which the burst waits out.
                    if progress.retry_due_after(BEAT_EVERY) {
                        self.retry(&mut progress).await?;
                    }
                    event?
                }
                // A batch lingers a little for more commits: under a write
                // load that turns a round of applications, a stream entry
                // and every instance's read per commit into one per batch.
                // It sleeps the linger out rather than wake for each event,
                // then reads what came meanwhile at once: a wake-up per
                // batch, not one per commit.
                None if batch.lingers() => {
                    if let Some(until) = batch.until {
                        tokio::time::sleep_until(until.into()).await;
                    }
                    continue;
                }
                None => {
                    self.flush(&mut batch, &mut progress, session).await?;
                    client.update_applied_lsn(progress.confirmable());
                    // The position moved past what the stream last said
                    // (a keepalive after WAL of other tables): a beat says
                    // so soon, for reads waiting on a position (see
                    // POSITION_EVERY), not a BEAT_EVERY later.
                    let keeps_up = pending.is_none() && progress.retry.is_empty();
                    let tell = (keeps_up && progress.applied.0 > progress.announced)
                        .then(|| progress.announced_at + POSITION_EVERY);
                    let retry_at = progress.retry_at();
                    tokio::select! {
                        event = client.recv() => event?,
                        _ = tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now).into()), if retry_at.is_some() => {
                            self.retry(&mut progress).await?;
                            client.update_applied_lsn(progress.confirmable());
                            continue;
                        }
                        _ = beat.tick() => {
                            self.retry(&mut progress).await?;
                            let open = pending.is_some();
                            self.judge_and_beat(client, session, &mut progress, open, true).await?;
                            client.update_applied_lsn(progress.confirmable());
                            continue;
                        }
                        _ = tokio::time::sleep_until(tell.unwrap_or_else(Instant::now).into()), if tell.is_some() => {
                            let open = pending.is_some();
                            self.judge_and_beat(client, session, &mut progress, open, true).await?;
                            continue;
                        }
                    }
                }
            };
            let Some(event) = event else {
                anyhow::bail!("the replication stream ended");
            };
            match event {
                ReplicationEvent::Begin {
                    commit_time_micros,
                    xid,
                    ..
                } => pending = Some(Pending::new(commit_time_micros, xid)),
                ReplicationEvent::XLogData { data, .. } => {
                    let Some(tx) = pending.as_mut() else {
                        continue;
                    };
                    read_message(&data, &mut relations, tx);
                }
                ReplicationEvent::Commit { end_lsn, .. } => {
                    let Some(tx) = pending.take() else {
                        continue;
                    };
                    if tx.all {
                        self.flush(&mut batch, &mut progress, session).await?;
                        self.until_visible(&[tx.xid], session, &progress).await?;
                        self.all_posts(Some(end_lsn.0), Since(end_lsn.0)).await?;
                        metrics::change_applied("all", since_commit(tx.commit_time_micros));
                        // Every post: what waited is covered.
                        progress.retry.clear();
                        progress.read_to(end_lsn);
                        client.update_applied_lsn(progress.confirmable());
                        continue;
                    }
                    batch.add(tx, end_lsn, &mut progress);
                    if batch.due() {
                        self.flush(&mut batch, &mut progress, session).await?;
                        client.update_applied_lsn(progress.confirmable());
                    }
                }
                ReplicationEvent::KeepAlive { wal_end, .. } => {
                    tracing::trace!(%wal_end, "keepalive");
                    if pending.is_none() {
                        // Nothing of ours is open: everything the server
                        // sent is read, once the batch is applied (the
                        // server sends one whenever it waits for WAL: the
                        // batch lingers on).
                        if batch.last.is_some() {
                            batch.read_to = batch.read_to.max(wal_end);
                        } else {
                            progress.read_to(wal_end);
                            client.update_applied_lsn(progress.confirmable());
                        }
                    }
                }
                ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
            }
        }
    }

    /// Judges what this session can vouch for now and beats it (see
    /// `liveness.rs`): level, behind, nothing (unsure), or, dead, the
    /// session ends, the fleet told.
    async fn judge_and_beat(
        &self,
        client: &ReplicationClient,
        session: &mut Session,
        progress: &mut DecoderProgress,
        open: bool,
        waiting: bool,
    ) -> anyhow::Result<()> {
        let now = Instant::now();
        session.judged = now;
        // Told or not, the position waits a POSITION_EVERY before the next
        // telling (no beat goes out while unsure, and none is tried at once
        // again).
        progress.announced_at = now;
        let seen = Seen {
            applied: progress.applied.0,
            open: open || !progress.retry.is_empty(),
            received: client.metrics().last_wal_end().0,
            waiting,
        };
        let probe = session.probes.borrow().clone();
        let (verdict, nudge) = session.judge.judge(probe.as_ref(), seen, now);
        // The test kit's deliberate defect: level, proven or not.
        #[cfg(feature = "testkit")]
        let verdict = if self.read_path.settings().hooks.blind_decoder && !seen.open {
            Verdict::Level {
                age: Duration::ZERO,
            }
        } else {
            verdict
        };
        if nudge {
            session
                .nudge
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let (behind, age) = match verdict {
            Verdict::Level { age } => (0, age),
            Verdict::Behind { bytes } => (bytes, Duration::ZERO),
            Verdict::Unsure => return Ok(()),
            Verdict::Dead(why) => {
                metrics::decoder_gave_up();
                let stopped = Entry::Stopped {
                    session: session.id,
                };
                if let Err(error) =
                    fanout::append(self.read_path.redis(), &self.stream_key, &stopped).await
                {
                    tracing::debug!(%error, "could not tell the fleet the decoder stopped");
                }
                anyhow::bail!("the decoder gives up the slot: {why}");
            }
        };
        // The position: every change up to it applied, none waiting for a
        // retry (applied on a primary its replicas did not acknowledge, or
        // not at all): reads that ask for a position, and the floors, rely
        // on it (found: a beat said the decoder's whole progress, changes
        // kept for a retry included, and the floors lapsed before a failover
        // undid those changes).
        let position = progress.confirmable().0;
        let entry = Entry::Beat {
            lsn: position,
            behind,
            age_ms: age.as_millis() as u64,
            session: session.id,
        };
        // A beat that cannot be appended (Redis down or paused) is not
        // told: the instances judge the feed by the beats they read, and
        // late beats make them distrust it. The session goes on, and what
        // it decodes meanwhile waits for Redis in the retry list (found: a
        // session that ended on a paused Redis was started again, and its
        // changes applied, up to 880 ms after Redis's return).
        if let Err(error) = fanout::append(self.read_path.redis(), &self.stream_key, &entry).await {
            tracing::debug!(%error, "a beat could not be appended; the next one is tried");
            return Ok(());
        }
        progress.announce(position);
        metrics::feed_lag_bytes(behind);
        Ok(())
    }

    /// Applies the committed transactions read so far to Redis, then
    /// appends them to the stream as one entry. What fails (a node down)
    /// waits in the retry list, and holds the confirmed LSN back until it
    /// is applied: after a crash the server sends it again. An error ends
    /// the session unconfirmed.
    async fn flush(
        &self,
        batch: &mut Batch,
        progress: &mut DecoderProgress,
        session: &mut Session,
    ) -> anyhow::Result<()> {
        batch.until = None;
        let Some(last) = batch.last.take() else {
            return Ok(());
        };
        self.until_visible(&std::mem::take(&mut batch.xids), session, progress)
            .await?;
        batch.flushed = Some(Instant::now());
        let lag = since_commit(batch.first_commit_micros);
        let changes: Vec<(i64, ChangeKind, u64)> = batch
            .posts
            .drain()
            .map(|(id, (kind, lsn))| (id, kind, lsn))
            .collect();
        let span = tracing::debug_span!(
            "apply_changes",
            changes = changes.len(),
            lsn = u64::from(last)
        );
        self.apply(changes, last, lag, progress)
            .instrument(span)
            .await?;
        progress.read_to(last.max(std::mem::take(&mut batch.read_to)));
        Ok(())
    }

    /// Waits until every transaction of `xids` is visible to a new snapshot
    /// on the server.
    ///
    /// PostgreSQL hands a commit to logical decoding once its record is
    /// flushed, a moment before the transaction leaves the proc array; a
    /// synchronous standby stretches that moment until it confirms the
    /// commit. A change applied in it would let a load that claims the post
    /// afterwards (it must include the change, so it reads the primary)
    /// read the row as it was and store it, with nothing left to
    /// invalidate it. So the decoder applies nothing of a batch until a
    /// snapshot of the server shows each of its transactions (completed
    /// before its xmax and not among its running, see [`Snapshot::shows`]):
    /// one query per batch, almost always answered at once. While
    /// it waits, the beats say the decoder is behind (alive, never level:
    /// the instances keep their memory tiers, which hold what every reader
    /// of the primary still sees, and no instance takes the slot).
    async fn until_visible(
        &self,
        xids: &[u32],
        session: &mut Session,
        progress: &DecoderProgress,
    ) -> anyhow::Result<()> {
        if xids.is_empty() {
            return Ok(());
        }
        let mut pause = VISIBLE_FIRST_PAUSE;
        loop {
            if session.judged.elapsed() >= BEAT_EVERY {
                self.beat_behind(session, progress).await?;
            }
            // Bounded: a connection gone silent must end the session, not
            // hold the decoder (and the slot) for as long as the kernel
            // keeps the socket.
            let query = sqlx::query_scalar("select pg_current_snapshot()::text")
                .fetch_one(&self.visibility);
            let text: String = match tokio::time::timeout(self.timeout, query).await {
                Ok(text) => text?,
                Err(_) => anyhow::bail!(
                    "the primary's snapshot could not be read in {:?}",
                    self.timeout
                ),
            };
            let snapshot = Snapshot::parse(&text)
                .ok_or_else(|| anyhow::anyhow!("unreadable snapshot {text:?}"))?;
            if xids.iter().all(|&xid| snapshot.shows(xid)) {
                return Ok(());
            }
            tracing::debug!(
                transactions = xids.len(),
                "a batch waits for its commits to become visible"
            );
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(VISIBLE_MAX_PAUSE);
        }
    }

    /// Applies changes, appends those applied to the stream, and keeps the
    /// others for a retry (past RETRY_LIST_MAX, one raise of the cutoff instead).
    async fn apply(
        &self,
        changes: Vec<(i64, ChangeKind, u64)>,
        lsn: Lsn,
        lag: Duration,
        progress: &mut DecoderProgress,
    ) -> anyhow::Result<()> {
        #[cfg(feature = "testkit")]
        let changes = match &self.read_path.settings().hooks.lose_change {
            Some(lose) => changes
                .into_iter()
                .filter(|(id, _, lsn)| !lose(*id, *lsn))
                .collect(),
            None => changes,
        };
        if changes.is_empty() {
            return Ok(());
        }
        let results: Vec<((i64, ChangeKind, u64), bool)> = if self
            .read_path
            .redis()
            .applies_together()
        {
            // One script per chunk: far fewer round trips and script
            // calls than one per post.
            let chunks: Vec<Vec<(i64, ChangeKind, u64)>> = changes
                .chunks(APPLIED_TOGETHER)
                .map(<[_]>::to_vec)
                .collect();
            stream::iter(chunks)
                    .map(|chunk| {
                        let read_path = self.read_path.clone();
                        async move {
                            let items: Vec<(i64, i64, ChangeKind)> = chunk
                                .iter()
                                .map(|(id, kind, lsn)| (*id, *lsn as i64, *kind))
                                .collect();
                            let done = read_path.invalidate_many_in_redis(&items).await;
                            if let Err(error) = &done {
                                tracing::debug!(%error, posts = chunk.len(), "changes not applied; retrying");
                            }
                            let ok = done.is_ok();
                            chunk.into_iter().map(move |change| (change, ok)).collect::<Vec<_>>()
                        }
                    })
                    .buffer_unordered(4)
                    .flat_map(stream::iter)
                    .collect()
                    .await
        } else {
            stream::iter(changes)
                .map(|change| {
                    let read_path = self.read_path.clone();
                    async move {
                        let (id, kind, lsn) = change;
                        let done = read_path.invalidate_in_redis(&id, lsn as i64, kind).await;
                        if let Err(error) = &done {
                            tracing::debug!(%error, id, "change not applied; retrying");
                        }
                        (change, done.is_ok())
                    }
                })
                .buffer_unordered(APPLYING)
                .collect()
                .await
        };
        let results = self.replicated(results, progress).await;
        let mut ids = Vec::with_capacity(results.len());
        let mut told = Vec::with_capacity(results.len());
        let mut deleted = Vec::new();
        for ((id, kind, at), replicated) in results {
            if replicated == Replicated::NotApplied {
                progress.keep(id, kind, at);
                continue;
            }
            if replicated == Replicated::Yes {
                metrics::change_applied(if kind.deletes() { "delete" } else { "update" }, lag);
            } else {
                progress.keep(id, kind, at);
            }
            ids.push(id);
            told.push((id, kind, at));
            // Recreated: it exists (the instances' guards admit it).
            if kind == ChangeKind::Deleted {
                deleted.push(id);
            }
        }
        if progress.retry.len() > RETRY_LIST_MAX {
            tracing::warn!(
                waiting = progress.retry.len(),
                "too many changes wait for Redis: every post is invalidated instead"
            );
            self.all_posts(Some(lsn.0), Since(lsn.0)).await?;
            progress.retry.clear();
        }
        if !ids.is_empty() {
            // Nothing waits for a retry: every change up to here is applied
            // (before this batch, everything up to `applied` was).
            let upto = if progress.retry.is_empty() {
                progress.applied.0.max(lsn.0)
            } else {
                0
            };
            let entry = Entry::Posts {
                lsn: lsn.0,
                ids,
                deleted,
                upto,
            };
            match fanout::append(self.read_path.redis(), &self.stream_key, &entry).await {
                Ok(()) => progress.announce(upto),
                // Applied, but the instances were not told (their memory
                // tiers hold the rows as they were): applied again and
                // told with the retries (a change applied already is a
                // no-op), the slot's position held meanwhile.
                Err(error) => {
                    tracing::debug!(%error, posts = told.len(), "changes applied but not told; retrying");
                    for (id, kind, at) in told {
                        progress.keep(id, kind, at);
                    }
                }
            }
        }
        Ok(())
    }

    /// The applications of `results` that reached a Redis replica as well,
    /// where Redis has replicas (see `redis/replicas.rs`): one that did
    /// not is applied again later (a no-op on a node that has it), so that
    /// a failover to a replica that missed it undoes nothing. Its instances
    /// are told of it meanwhile (the primary has it), but nothing waits on
    /// its position (`upto`), and the slot's confirmed position holds.
    ///
    /// While the last wait went unacknowledged, a batch does not wait (it
    /// is kept for the retry, which does): a stalled replica must not slow
    /// the feed by REDIS_REPLICA_WAIT a batch.
    async fn replicated(
        &self,
        results: Vec<((i64, ChangeKind, u64), bool)>,
        progress: &mut DecoderProgress,
    ) -> Vec<((i64, ChangeKind, u64), Replicated)> {
        let keys: Vec<String> = results
            .iter()
            .filter(|(_, done)| *done)
            .map(|((id, _, _), _)| self.read_path.keys().value(id))
            .collect();
        let acknowledged = if self.replica_wait.is_zero() || keys.is_empty() {
            true
        } else if progress.replicas_behind && !progress.retrying {
            false
        } else {
            match self
                .read_path
                .redis()
                .replicated(&keys, self.replica_wait)
                .await
            {
                Ok(acknowledged) => acknowledged,
                Err(error) => {
                    tracing::debug!(%error, "whether Redis's replicas have the changes is not known; applying them again");
                    false
                }
            }
        };
        if !keys.is_empty() {
            progress.replicas_behind = !acknowledged;
        }
        if !acknowledged {
            metrics::changes_unreplicated(keys.len());
            tracing::debug!(
                posts = keys.len(),
                "no Redis replica acknowledged the changes applied; applying them again"
            );
        }
        results
            .into_iter()
            .map(|(change, done)| {
                let state = match (done, acknowledged) {
                    (false, _) => Replicated::NotApplied,
                    (true, true) => Replicated::Yes,
                    (true, false) => Replicated::PrimaryOnly,
                };
                (change, state)
            })
            .collect()
    }

    /// A beat that says the decoder is alive and behind, whatever it has
    /// applied (it holds something back).
    async fn beat_behind(
        &self,
        session: &mut Session,
        progress: &DecoderProgress,
    ) -> anyhow::Result<()> {
        session.judged = Instant::now();
        let wal = session.probes.borrow().as_ref().map_or(0, |p| p.wal);
        let entry = Entry::Beat {
            lsn: progress.confirmable().0,
            behind: wal.saturating_sub(progress.applied.0).max(1),
            age_ms: 0,
            session: session.id,
        };
        // Not told, as in `judge_and_beat`: the session goes on.
        if let Err(error) = fanout::append(self.read_path.redis(), &self.stream_key, &entry).await {
            tracing::debug!(%error, "a beat could not be appended; the next one is tried");
        }
        Ok(())
    }

    /// Tries again what waits for Redis (while its replicas do not
    /// acknowledge, once a REPLICAS_RETRY_EVERY: each try waits for them).
    async fn retry(&self, progress: &mut DecoderProgress) -> anyhow::Result<()> {
        if progress.retry.is_empty() {
            return Ok(());
        }
        if progress.replicas_behind {
            if progress
                .replicas_tried
                .is_some_and(|at| at.elapsed() < REPLICAS_RETRY_EVERY)
            {
                progress.retried_at = Some(Instant::now());
                return Ok(());
            }
            progress.replicas_tried = Some(Instant::now());
        }
        let waiting: Vec<(i64, ChangeKind, u64)> = progress
            .retry
            .drain()
            .map(|(id, (kind, lsn))| (id, kind, lsn))
            .collect();
        let newest = waiting.iter().map(|c| c.2).max().unwrap_or(0);
        progress.retrying = true;
        let applied = self
            .apply(waiting, Lsn(newest), Duration::ZERO, progress)
            .await;
        progress.retrying = false;
        // From its end: a try that timed out is not followed by the next
        // at once.
        progress.retried_at = Some(Instant::now());
        applied
    }
}

/// While Redis's replicas do not acknowledge, how often the changes kept
/// for them are applied again and waited for.
const REPLICAS_RETRY_EVERY: Duration = Duration::from_millis(500);
/// Where a change's application stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replicated {
    /// Not applied (Redis failed): applied again later.
    NotApplied,
    /// Applied on the primary, not acknowledged by a replica: applied
    /// again later.
    PrimaryOnly,
    /// Applied, and acknowledged where Redis has replicas.
    Yes,
}

/// A snapshot of the server, as `pg_current_snapshot()` prints it
/// (`xmin:xmax:xip,...`): what a new query there sees.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    /// Every transaction from here on is not seen (not completed yet, or
    /// completed after the snapshot was taken).
    xmax: u64,
    /// Transactions below `xmax` still running.
    running: Vec<u64>,
}

impl Snapshot {
    fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split(':');
        let (_xmin, xmax, running) = (parts.next()?, parts.next()?, parts.next()?);
        Some(Self {
            xmax: xmax.parse().ok()?,
            running: running
                .split(',')
                .filter(|x| !x.is_empty())
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?,
        })
    }

    /// Whether the transaction `xid` (the low 32 bits of its id, as the
    /// stream's BEGIN gives it) is seen: completed before `xmax` and not
    /// running. A transaction waiting for a synchronous standby is at or
    /// past `xmax` (it has not completed), not among the running.
    fn shows(&self, xid: u32) -> bool {
        // The full id whose low 32 bits are `xid`, within 2^31 of xmax.
        let behind = (self.xmax as u32).wrapping_sub(xid) as i32;
        let Some(full) = self.xmax.checked_add_signed(-i64::from(behind)) else {
            return true;
        };
        full < self.xmax && !self.running.contains(&full)
    }
}

/// Reads one message into the transaction.
fn read_message(data: &[u8], relations: &mut Relations, tx: &mut Pending) {
    match pgoutput::decode(data, relations) {
        Ok(Message::Relation(relation)) => {
            if relation.id_column.is_none() {
                tracing::warn!(
                    relation = relation.name,
                    "a published relation has no id column: its changes invalidate every post"
                );
            }
            relations.0.insert(relation.oid, relation);
        }
        Ok(Message::Changed { id, .. }) => tx.note(id, ChangeKind::Changed),
        Ok(Message::Deleted { id, .. }) => tx.note(id, ChangeKind::Deleted),
        Ok(Message::Moved { from, to, .. }) => {
            tx.note(from, ChangeKind::Deleted);
            tx.note(to, ChangeKind::Changed);
        }
        Ok(Message::Truncated(_)) => tx.every_post(),
        Ok(Message::Other) => {}
        Err(error) => {
            metrics::change_skipped("undecodable");
            tracing::warn!(%error, "a replication message could not be read: every post is invalidated");
            tx.every_post();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Snapshot;

    #[test]
    fn a_snapshot_shows_what_completed_before_it_and_nothing_running() {
        // 742 waits for a synchronous standby: not completed, so xmax.
        let held = Snapshot::parse("742:742:").unwrap();
        assert!(!held.shows(742));
        assert!(held.shows(741));
        assert!(!held.shows(743));

        let busy = Snapshot::parse("740:745:740,742").unwrap();
        assert_eq!(busy.running, vec![740, 742]);
        assert!(!busy.shows(740));
        assert!(busy.shows(741));
        assert!(!busy.shows(742));
        assert!(busy.shows(744));
        assert!(!busy.shows(745));
        assert!(busy.shows(3));

        // Past a wraparound: the low 32 bits name the id nearest xmax.
        let next_epoch = Snapshot::parse(&format!("{0}:{0}:", (1u64 << 32) + 5)).unwrap();
        assert!(next_epoch.shows(0xFFFF_FFFE));
        assert!(next_epoch.shows(4));
        assert!(!next_epoch.shows(5));

        assert_eq!(Snapshot::parse("1:2"), None);
        assert_eq!(Snapshot::parse("1:x:"), None);
    }
}
