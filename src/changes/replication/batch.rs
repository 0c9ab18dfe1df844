//! The change feed (replication): what the decoder holds between reading and
//! applying: the transaction being read, the batch of committed ones, and
//! how far it has got (what may be confirmed, what waits for Redis).

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use pgwire_replication::Lsn;

use super::BULK;
use crate::redis::ChangeKind;

/// One transaction being read.
pub(super) struct Pending {
    pub(super) posts: HashMap<i64, ChangeKind>,
    /// Every post: the bound was passed, a TRUNCATE, or something that
    /// could not be read.
    pub(super) all: bool,
    pub(super) commit_time_micros: i64,
    /// Its transaction id (the low 32 bits, as the stream's BEGIN says).
    pub(super) xid: u32,
}

impl Pending {
    pub(super) fn new(commit_time_micros: i64, xid: u32) -> Self {
        Self {
            posts: HashMap::new(),
            all: false,
            commit_time_micros,
            xid,
        }
    }

    pub(super) fn note(&mut self, id: Option<i64>, kind: ChangeKind) {
        if self.all {
            return;
        }
        let Some(id) = id else {
            // A row whose id is null or not sent: which post is unknown.
            self.every_post();
            return;
        };
        self.posts
            .entry(id)
            .and_modify(|kept| *kept = kept.then(kind))
            .or_insert(kind);
        if self.posts.len() >= BULK {
            self.every_post();
        }
    }

    pub(super) fn every_post(&mut self) {
        self.all = true;
        self.posts = HashMap::new();
    }
}

/// Posts gathered from several transactions before they are applied.
pub(super) const BATCH_MAX: usize = 1_000;
/// Under a write load, how often a batch is applied: the longest a
/// committed transaction waits for others to be applied with. It is what a
/// read asking for a write's position (`PostCache-Min-LSN`) may wait for on
/// top of the feed's own latency: at 5 ms, such reads just after a write
/// took 8.3 ms at p99; at 2 ms a load of thousands of commits a second
/// still goes in batches of tens.
pub(super) const LINGER: Duration = Duration::from_millis(2);

/// Committed transactions read but not applied yet: the later change of
/// each post (applying it once, with its LSN, fences every leader that read
/// before either).
#[derive(Default)]
pub(super) struct Batch {
    pub(super) posts: HashMap<i64, (ChangeKind, u64)>,
    /// The end of the last transaction in it.
    pub(super) last: Option<Lsn>,
    pub(super) first_commit_micros: i64,
    /// Until when it waits for more commits: set when its first
    /// transaction came less than LINGER after the last batch went.
    pub(super) until: Option<Instant>,
    /// When its first transaction was read.
    pub(super) began: Option<Instant>,
    /// Where the server said it had sent everything, after its last
    /// transaction.
    pub(super) read_to: Lsn,
    /// When the last batch was applied.
    pub(super) flushed: Option<Instant>,
    /// The ids of its transactions: none is applied before all are visible
    /// on the server (see `decode.rs`, `until_visible`).
    pub(super) xids: Vec<u32>,
}

impl Batch {
    /// Whether it may wait for more commits before it is applied: only
    /// while commits come faster than one per LINGER (its first came less
    /// than LINGER after the last batch went), so that a lone commit goes
    /// at once, and a write load is applied once per LINGER.
    pub(super) fn lingers(&self) -> bool {
        self.until.is_some_and(|until| Instant::now() < until)
    }

    /// Whether a commit just added makes it go before the commits already
    /// received behind it are read: only once it is full, or its first was
    /// read a LINGER ago (commits kept coming: applied at least that
    /// often). Otherwise it goes once nothing more is here (see
    /// `decode.rs`), so that a backlog, after an application that took long
    /// (a Redis far away, a replica waited for), is applied in batches as
    /// large as it is, not one transaction per round trip (found: with a
    /// 40 ms acknowledgement per application, 24 transactions a second, and
    /// the feed fell behind without bound).
    pub(super) fn due(&self) -> bool {
        self.posts.len() >= BATCH_MAX || self.began.is_some_and(|at| at.elapsed() >= LINGER)
    }

    pub(super) fn add(&mut self, tx: Pending, lsn: Lsn, progress: &mut DecoderProgress) {
        if self.last.is_none() {
            self.began = Some(Instant::now());
            self.first_commit_micros = tx.commit_time_micros;
            self.until = self
                .flushed
                .map(|at| at + LINGER)
                .filter(|until| Instant::now() < *until);
        }
        self.xids.push(tx.xid);
        for (id, kind) in tx.posts {
            // Applied with this later change, or kept with it (a delete
            // among them stays a delete: see `ChangeKind::then`).
            // Earlier, in this order: kept for a retry, then in this batch.
            let retried = progress.retry.remove(&id).map(|(kind, _)| kind);
            let batched = self.posts.get(&id).map(|(kind, _)| *kind);
            let kind = [retried, batched, Some(kind)]
                .into_iter()
                .flatten()
                .reduce(ChangeKind::then)
                .unwrap_or(kind);
            self.posts.insert(id, (kind, lsn.0));
        }
        self.last = Some(lsn);
    }
}

/// Most changes kept for a retry; past it, one raise of the cutoff.
pub(super) const RETRY_LIST_MAX: usize = 10_000;
/// How often changes that wait for Redis are tried again (each try bounded
/// by REDIS_TIMEOUT). Often, so that they land within moments of Redis's
/// return: a Redis paused for 2 s let a change wait up to 880 ms past the
/// pause while the tries came with the beats, a BEAT_EVERY apart, and the
/// sessions ended on a beat that could not be appended. A try that fails
/// costs a timed-out command; nothing else waits on it.
pub(super) const RETRY_EVERY: Duration = Duration::from_millis(50);

/// How far the decoder has got.
pub(super) struct DecoderProgress {
    /// The last position the stream was told everything is applied to
    /// (a beat, or a change entry's `upto`), and when.
    pub(super) announced: u64,
    pub(super) announced_at: Instant,
    /// Everything the server sent up to here is read (applied, or waiting
    /// in `retry`).
    pub(super) applied: Lsn,
    /// The last position before the oldest change that waits: confirmed
    /// while something waits.
    pub(super) held_at: Option<Lsn>,
    /// Changes that could not be applied yet: the later of each post's,
    /// with its commit LSN.
    pub(super) retry: HashMap<i64, (ChangeKind, u64)>,
    /// The last wait for Redis's replicas went unacknowledged: batches do
    /// not wait again until a retry's wait is acknowledged (see
    /// `decode.rs`, `replicated`).
    pub(super) replicas_behind: bool,
    /// A retry is applying (it waits for the replicas whatever the last
    /// wait said).
    pub(super) retrying: bool,
    /// When a retry last waited for the replicas.
    pub(super) replicas_tried: Option<Instant>,
    /// When the changes in `retry` were last tried (see [`RETRY_EVERY`]).
    pub(super) retried_at: Option<Instant>,
}

impl Default for DecoderProgress {
    fn default() -> Self {
        Self {
            announced: 0,
            announced_at: Instant::now(),
            applied: Lsn::default(),
            held_at: None,
            retry: HashMap::new(),
            replicas_behind: false,
            retrying: false,
            replicas_tried: None,
            retried_at: None,
        }
    }
}

impl DecoderProgress {
    /// When what waits in `retry` is next tried: a RETRY_EVERY after the
    /// last try ended (at once if none was made); `None` while nothing
    /// waits.
    pub(super) fn retry_at(&self) -> Option<Instant> {
        self.retry_at_after(RETRY_EVERY)
    }

    /// As [`DecoderProgress::retry_at`], `every` after the last try.
    fn retry_at_after(&self, every: Duration) -> Option<Instant> {
        if self.retry.is_empty() {
            return None;
        }
        Some(self.retried_at.map_or_else(Instant::now, |at| at + every))
    }

    /// Whether what waits in `retry` is to be tried now, `every` after the
    /// last try ended.
    pub(super) fn retry_due_after(&self, every: Duration) -> bool {
        self.retry_at_after(every)
            .is_some_and(|at| at <= Instant::now())
    }

    pub(super) fn announce(&mut self, upto: u64) {
        if upto > self.announced {
            self.announced = upto;
        }
        self.announced_at = Instant::now();
    }

    pub(super) fn read_to(&mut self, lsn: Lsn) {
        self.applied = self.applied.max(lsn);
        if self.retry.is_empty() {
            self.held_at = None;
        }
    }

    pub(super) fn keep(&mut self, id: i64, kind: ChangeKind, lsn: u64) {
        if self.held_at.is_none() {
            self.held_at = Some(self.applied);
        }
        let (kind, lsn) = match self.retry.get(&id) {
            Some((kept_kind, kept)) if *kept > lsn => (kind.then(*kept_kind), *kept),
            Some((kept_kind, _)) => (kept_kind.then(kind), lsn),
            None => (kind, lsn),
        };
        self.retry.insert(id, (kind, lsn));
    }

    /// What may be confirmed to the server: everything before the oldest
    /// change that waits.
    pub(super) fn confirmable(&self) -> Lsn {
        match self.held_at {
            Some(at) if !self.retry.is_empty() => at,
            _ => self.applied,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_waits_for_redis_is_tried_at_once_then_a_retry_every_apart() {
        let mut progress = DecoderProgress::default();
        assert_eq!(progress.retry_at(), None, "nothing waits");
        assert!(!progress.retry_due_after(RETRY_EVERY));
        progress.keep(4, ChangeKind::Changed, 7);
        assert!(
            progress.retry_due_after(RETRY_EVERY),
            "never tried: at once"
        );
        let tried = Instant::now();
        progress.retried_at = Some(tried);
        assert_eq!(progress.retry_at(), Some(tried + RETRY_EVERY));
        assert!(!progress.retry_due_after(RETRY_EVERY));
        progress.retried_at = Some(tried - RETRY_EVERY);
        assert!(progress.retry_due_after(RETRY_EVERY));
        assert!(!progress.retry_due_after(RETRY_EVERY * 2), "a longer wait");
        progress.retry.clear();
        assert!(
            !progress.retry_due_after(RETRY_EVERY),
            "nothing waits any more"
        );
    }

    #[test]
    fn a_transaction_past_the_bound_keeps_no_ids() {
        let mut tx = Pending::new(0, 1);
        for id in 0..BULK as i64 - 1 {
            tx.note(Some(id), ChangeKind::Changed);
        }
        assert!(!tx.all);
        tx.note(Some(-1), ChangeKind::Deleted);
        assert!(tx.all);
        assert!(tx.posts.is_empty() && tx.posts.capacity() == 0);
        tx.note(Some(5), ChangeKind::Changed);
        assert!(tx.posts.is_empty());
    }

    #[test]
    fn commits_behind_a_slow_application_go_together_not_one_by_one() {
        let mut batch = Batch {
            // The last application took 40 ms.
            flushed: Some(Instant::now() - Duration::from_millis(40)),
            ..Batch::default()
        };
        let mut progress = DecoderProgress::default();
        for (i, id) in (1..=3).enumerate() {
            let mut tx = Pending::new(0, i as u32);
            tx.note(Some(id), ChangeKind::Changed);
            batch.add(tx, Lsn(100 + i as u64), &mut progress);
            assert!(!batch.due(), "due after {} commits", i + 1);
        }
        // Commits kept coming for a LINGER: it goes.
        batch.began = Some(Instant::now() - LINGER);
        assert!(batch.due());
        assert_eq!(batch.posts.len(), 3);
    }

    /// A delete in a transaction, or in a batch, or kept for a retry, is
    /// applied as a delete, whatever came after it: its copy gives way to
    /// the tombstone, never served as stale (the post's later version is
    /// loaded anew). Written again after it, the post exists: recreated,
    /// which the existence guard admits.
    #[test]
    fn a_delete_among_a_posts_changes_is_applied_as_a_delete() {
        let mut tx = Pending::new(0, 1);
        tx.note(Some(1), ChangeKind::Changed);
        tx.note(Some(1), ChangeKind::Deleted);
        tx.note(Some(2), ChangeKind::Deleted);
        tx.note(Some(2), ChangeKind::Changed);
        tx.note(Some(3), ChangeKind::Changed);
        tx.note(Some(3), ChangeKind::Changed);
        assert_eq!(tx.posts[&1], ChangeKind::Deleted);
        assert_eq!(tx.posts[&2], ChangeKind::Recreated);
        assert_eq!(tx.posts[&3], ChangeKind::Changed);

        let mut progress = DecoderProgress::default();
        progress.keep(4, ChangeKind::Deleted, 5);
        progress.keep(4, ChangeKind::Changed, 7);
        assert_eq!(progress.retry[&4], (ChangeKind::Recreated, 7));
        // Kept out of order: the later one (by position) says last.
        progress.keep(6, ChangeKind::Changed, 9);
        progress.keep(6, ChangeKind::Deleted, 8);
        assert_eq!(progress.retry[&6], (ChangeKind::Recreated, 9));
        let mut batch = Batch::default();
        let mut first = Pending::new(0, 1);
        first.note(Some(5), ChangeKind::Deleted);
        first.note(Some(7), ChangeKind::Changed);
        batch.add(first, Lsn(10), &mut progress);
        let mut second = Pending::new(0, 2);
        second.note(Some(5), ChangeKind::Changed);
        second.note(Some(4), ChangeKind::Changed);
        second.note(Some(7), ChangeKind::Deleted);
        second.note(Some(6), ChangeKind::Changed);
        batch.add(second, Lsn(20), &mut progress);
        assert_eq!(batch.posts[&5], (ChangeKind::Recreated, 20));
        assert_eq!(batch.posts[&4], (ChangeKind::Recreated, 20));
        assert_eq!(batch.posts[&7], (ChangeKind::Deleted, 20));
        assert_eq!(batch.posts[&6], (ChangeKind::Recreated, 20));
        assert!(progress.retry.is_empty());
        assert!([ChangeKind::Deleted, ChangeKind::Recreated]
            .iter()
            .all(|kind| kind.deletes()));
        assert!(!ChangeKind::Changed.deletes());
    }
}
