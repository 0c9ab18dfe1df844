//! The protocol: natural batching of loads. While LOAD_STATEMENTS load
//! statements are in flight, the keys of new loads queue; the next statement
//! reads all of them at once (up to LOAD_BATCH_MAX), so that at saturation
//! the statements per load fall towards 1/batch while at low load nothing
//! waits: below the bound a load's statement starts at once, and a batch of
//! one key is the single-key statement.
//!
//! Only the statement is shared. Each key keeps its own election, fence,
//! finish and wake-up (a leader waits here for its key's row as it would for
//! its own statement). A failed statement fails each of its keys; a key the
//! statement did not return is not found.
//!
//! The statements run on spawned tasks, so a request that goes away never
//! cancels a statement other keys wait for; a task that panics, or is
//! dropped, drops its keys' senders, which answers each of them with a
//! failure instead of leaving it waiting.

use std::{
    collections::{HashMap, VecDeque},
    panic::AssertUnwindSafe,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use bytes::Bytes;
use futures::FutureExt;
use tokio::sync::oneshot;

use super::{source::Loaded, Busy, LoadError, LoadProgress, Since, Source};
use crate::telemetry::metrics;

/// What one key's load gave: its body, `None` when absent, with the
/// statement's position, or the batch's failure (shared by its keys).
type Answered = Result<Loaded, Arc<LoadError>>;

/// What one statement read: the bodies found by key, and its position.
type Read<K> = (HashMap<K, Bytes>, u64);

/// One key waiting for a statement.
struct Queued<K> {
    key: K,
    /// The last change its read must include.
    since: Since,
    /// Names this wait, to take it out of the queue.
    ticket: u64,
    reply: oneshot::Sender<Answered>,
}

/// The keys waiting for a statement, and how many statements run.
struct Queue<K> {
    waiting: VecDeque<Queued<K>>,
    running: usize,
    next_ticket: u64,
    /// Keys a batch read is about to load (see [`Batches::expect`]), with
    /// how many reads expect each: a statement about to start waits, at
    /// most [`EXPECTED_WAIT`], until none is left.
    expected: HashMap<K, usize>,
}

/// Longest a statement waits for the keys a batch read expects: about a
/// Redis round trip (their claims), never more.
const EXPECTED_WAIT: Duration = Duration::from_millis(50);

/// Loads from `S`, batched: see the module's comment.
pub(super) struct Batches<S: Source> {
    source: S,
    /// Most keys per statement.
    max_batch: usize,
    /// Most statements in flight.
    max_running: usize,
    /// Longest a key waits for its statement to start (DB_ACQUIRE_TIMEOUT):
    /// past it the instance is busy (see [`Busy`]) if statements succeeded
    /// meanwhile, and the load failed if none did (the database is not
    /// answering; see `progress.rs`).
    patience: Duration,
    /// When a statement last succeeded.
    answered: LoadProgress,
    /// When a statement last failed (not for want of a connection).
    failed: LoadProgress,
    /// A std mutex: held only to queue or take keys, never across an await.
    queue: Mutex<Queue<S::Key>>,
    /// Wakes statements waiting for expected keys when none is left.
    arrived: tokio::sync::Notify,
    /// Longest a statement waits for them ([`EXPECTED_WAIT`]).
    expected_wait: Duration,
}

impl<S: Source> Batches<S> {
    pub fn new(source: S, max_batch: usize, max_running: usize, patience: Duration) -> Arc<Self> {
        Self::waiting(source, max_batch, max_running, patience, EXPECTED_WAIT)
    }

    /// [`Batches::new`], statements waiting at most `expected_wait` for
    /// the keys a batch read expects.
    fn waiting(
        source: S,
        max_batch: usize,
        max_running: usize,
        patience: Duration,
        expected_wait: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            source,
            max_batch: max_batch.max(1),
            max_running: max_running.max(1),
            patience,
            answered: LoadProgress::default(),
            failed: LoadProgress::default(),
            queue: Mutex::new(Queue {
                waiting: VecDeque::new(),
                running: 0,
                next_ticket: 0,
                expected: HashMap::new(),
            }),
            arrived: tokio::sync::Notify::new(),
            expected_wait,
        })
    }

    /// A batch read is about to load `keys` (they missed in Redis): until
    /// each has queued for a statement or was settled without one (its
    /// [`Expected`] dropped), statements wait, at most [`EXPECTED_WAIT`],
    /// so that the read's misses share one statement.
    pub fn expect(self: &Arc<Self>, key: &S::Key) -> Expected<S> {
        let mut queue = self.lock();
        // Queued already (another read's load): nothing to wait for.
        let queued = queue.waiting.iter().any(|q| &q.key == key);
        if !queued {
            *queue.expected.entry(key.clone()).or_default() += 1;
        }
        Expected {
            batches: self.clone(),
            key: (!queued).then(|| key.clone()),
        }
    }

    /// No load of `key` will come now (its lock is another's, or its
    /// value was found): no read waits for it any longer.
    pub fn not_loading(&self, key: &S::Key) {
        let mut queue = self.lock();
        if queue.expected.remove(key).is_some() && queue.expected.is_empty() {
            self.arrived.notify_waiters();
        }
    }

    /// `key` is no longer expected by one read.
    fn unexpect(&self, queue: &mut Queue<S::Key>, key: &S::Key) {
        if let Some(n) = queue.expected.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                queue.expected.remove(key);
            }
            if queue.expected.is_empty() {
                self.arrived.notify_waiters();
            }
        }
    }

    /// Whether a statement succeeded within `window`, and none failed
    /// since.
    pub fn answered_within(&self, window: Duration) -> bool {
        let now = tokio::time::Instant::now();
        let since = now.checked_sub(window).unwrap_or(now);
        self.answered.succeeded_since(since) && !self.failed.succeeded_since(since)
    }

    /// The source itself, for the loads that are never batched (the load
    /// lab's baselines: a statement per request).
    pub fn source(&self) -> &S {
        &self.source
    }

    /// Loads `key` with the next statement: at once if fewer than
    /// LOAD_STATEMENTS run, else with the keys queued meanwhile. A key whose
    /// statement has not started within DB_ACQUIRE_TIMEOUT is taken out of
    /// the queue: [`Busy`], as a load that got no connection in time, if a
    /// statement succeeded while it waited; else a failure.
    pub async fn load(self: &Arc<Self>, key: &S::Key, since: Since) -> Result<Loaded, LoadError> {
        let (reply, mut answer) = oneshot::channel();
        let (start, ticket) = {
            let mut queue = self.lock();
            let ticket = queue.next_ticket;
            queue.next_ticket += 1;
            if queue.expected.contains_key(key) {
                // Arrived: every read that expected it is served by this load.
                queue.expected.remove(key);
                if queue.expected.is_empty() {
                    self.arrived.notify_waiters();
                }
            }
            queue.waiting.push_back(Queued {
                key: key.clone(),
                since,
                ticket,
                reply,
            });
            let start = queue.running < self.max_running;
            if start {
                queue.running += 1;
            }
            (start, ticket)
        };
        if start {
            tokio::spawn(self.clone().statements());
        }
        let queued_at = tokio::time::Instant::now();
        let answered = match tokio::time::timeout(self.patience, &mut answer).await {
            Ok(answered) => answered,
            Err(_) => {
                let dequeued = {
                    let mut queue = self.lock();
                    let at = queue.waiting.iter().position(|q| q.ticket == ticket);
                    at.and_then(|at| queue.waiting.remove(at)).is_some()
                };
                if dequeued {
                    return Err(if self.answered.succeeded_since(queued_at) {
                        Busy.into()
                    } else {
                        anyhow::anyhow!(
                            "no load statement succeeded in {:?}: the database is not answering",
                            self.patience
                        )
                    });
                }
                // Its statement runs: wait for it (LOAD_TIMEOUT bounds it).
                answer.await
            }
        };
        match answered {
            Ok(Ok(loaded)) => Ok(loaded),
            Ok(Err(failed)) if failed.is::<Busy>() => Err(Busy.into()),
            Ok(Err(failed)) => Err(anyhow::anyhow!("{failed:#}")),
            Err(_) => Err(anyhow::anyhow!(
                "the load's statement ended without an answer"
            )),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<S::Key>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One statement slot: runs statements while keys are queued, each for
    /// as many as are queued (up to LOAD_BATCH_MAX), then frees the slot.
    async fn statements(self: Arc<Self>) {
        let mut slot = Slot(&self.queue, true);
        // Spawned from a task, this one would run next (the scheduler's
        // LIFO slot), before the other misses already woken have queued
        // their keys: let them queue first.
        tokio::task::yield_now().await;
        self.until_expected_arrived().await;
        loop {
            let batch: Vec<Queued<S::Key>> = {
                let mut queue = self.lock();
                if queue.waiting.is_empty() {
                    // Freed under the lock that queues: a key queued after
                    // this finds the slot free and starts a statement.
                    queue.running -= 1;
                    slot.1 = false;
                    return;
                }
                let n = queue.waiting.len().min(self.max_batch);
                queue.waiting.drain(..n).collect()
            };
            self.statement(batch).await;
        }
    }

    /// Waits, at most [`EXPECTED_WAIT`], until no key is expected.
    async fn until_expected_arrived(&self) {
        let deadline = tokio::time::Instant::now() + self.expected_wait;
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            // Registered before the look, so a notice in between is not lost.
            arrived.as_mut().enable();
            if self.lock().expected.is_empty() {
                return;
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return;
            }
        }
    }

    /// Reads `batch`'s keys in one statement and answers each.
    async fn statement(&self, mut batch: Vec<Queued<S::Key>>) {
        // Keys whose loads were given up (timed out, or their task dropped).
        batch.retain(|queued| !queued.reply.is_closed());
        // A key queued twice (by a read elsewhere in this process after a
        // change) is read once, so as to include the later change.
        let mut keys: Vec<(S::Key, Since)> = Vec::with_capacity(batch.len());
        let mut at: HashMap<&S::Key, usize> = HashMap::with_capacity(batch.len());
        for queued in &batch {
            match at.get(&queued.key) {
                Some(&i) => keys[i].1 = keys[i].1.max(queued.since),
                None => {
                    at.insert(&queued.key, keys.len());
                    keys.push((queued.key.clone(), queued.since));
                }
            }
        }
        drop(at);
        if keys.is_empty() {
            return;
        }
        metrics::load_statement(keys.len());
        let read = AssertUnwindSafe(async {
            if let [(key, since)] = keys.as_slice() {
                let loaded = self.source.load(key, *since).await?;
                let found = loaded.body.map(|body| (key.clone(), body));
                Ok::<_, LoadError>((HashMap::from_iter(found), loaded.upto))
            } else {
                let rows = self.source.load_many(&keys).await?;
                Ok((rows.found.into_iter().collect(), rows.upto))
            }
        })
        .catch_unwind()
        .await;
        let found: Result<Read<S::Key>, Arc<LoadError>> = match read {
            Ok(Ok(found)) => {
                self.answered.succeeded();
                Ok(found)
            }
            Ok(Err(error)) => {
                if !error.is::<Busy>() {
                    self.failed.succeeded();
                }
                Err(Arc::new(error))
            }
            // The panic hook has logged it; each key is answered a failure.
            Err(_) => Err(Arc::new(anyhow::anyhow!("the load's statement panicked"))),
        };
        for queued in batch {
            let loaded = match &found {
                Ok((found, upto)) => Ok(Loaded {
                    body: found.get(&queued.key).cloned(),
                    upto: *upto,
                }),
                Err(error) => Err(error.clone()),
            };
            // Its load was given up meanwhile: nobody to answer.
            let _ = queued.reply.send(loaded);
        }
    }
}

/// A batch read's expectation that its key will load (see
/// [`Batches::expect`]): dropped when the key's read ends, however it
/// ends, it stops holding statements back.
pub(super) struct Expected<S: Source> {
    batches: Arc<Batches<S>>,
    key: Option<S::Key>,
}

impl<S: Source> Drop for Expected<S> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut queue = self.batches.lock();
            self.batches.unexpect(&mut queue, &key);
        }
    }
}

/// A statement slot taken; freed when its task ends by being dropped (the
/// runtime shutting down) rather than by emptying the queue.
struct Slot<'a, K>(&'a Mutex<Queue<K>>, bool);

impl<K> Drop for Slot<'_, K> {
    fn drop(&mut self) {
        if self.1 {
            let mut queue = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            queue.running -= 1;
        }
    }
}

#[cfg(test)]
mod tests;
