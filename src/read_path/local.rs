//! The protocol: in-process flights. Concurrent misses for one key in one
//! process share one run.
//!
//! The run is a spawned task, so a request whose client goes away (its future
//! dropped) never cancels the work the other requests of the flight wait for.
//! The result is handed out through a `watch` channel: every joiner, early or
//! late, sees the single value, and if the task panics its sender is dropped,
//! which wakes every joiner with an error instead of leaving them hanging.
//!
//! A flight can be overtaken: this process served a newer answer for its
//! key from Redis while it ran (a leader elsewhere stored it after this
//! flight's load, or its message, was read). It is then detached: it ends
//! for those who joined it, and a request that comes after starts a new one,
//! so that nobody who came after the newer answer gets the older one.

use std::{
    collections::HashMap,
    future::Future,
    hash::Hash,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};

use tokio::sync::watch;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::{
    answer::{Answer, Outcome, ReadError},
    panics,
};
use crate::telemetry::metrics;

type Slot<V> = watch::Receiver<Option<V>>;

/// The flights in progress in this process, by key.
pub struct LocalFlights<K, V> {
    /// A std mutex: only held to look up, insert or remove, never across an await.
    running: Arc<Mutex<HashMap<K, Slot<V>>>>,
    /// How many run: read without the lock by [`LocalFlights::detach`], which
    /// every hit in Redis calls (flights are rare beside hits).
    count: Arc<AtomicUsize>,
    /// Where flight tasks are spawned, so that shutdown can wait for them.
    tasks: TaskTracker,
}

/// How a caller took part in a flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// This caller started the flight.
    Owner,
    /// This caller joined a flight another request started.
    Joiner,
}

/// Why a caller got no result from a flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unshared {
    /// The flight's task ended without a result (it panicked).
    #[error("the flight ended without a result")]
    Abandoned,
    /// A joiner's patience ran out before the flight ended.
    #[error("the flight did not end in time")]
    TimedOut,
}

impl<K, V> LocalFlights<K, V> {
    pub fn new(tasks: TaskTracker) -> Self {
        Self {
            running: Arc::default(),
            count: Arc::default(),
            tasks,
        }
    }
}

impl<K, V> Default for LocalFlights<K, V> {
    fn default() -> Self {
        Self::new(TaskTracker::new())
    }
}

/// Removes a flight from the map when its task ends, however it ends.
struct Deregister<K: Eq + Hash, V> {
    running: Arc<Mutex<HashMap<K, Slot<V>>>>,
    count: Arc<AtomicUsize>,
    key: K,
    slot: Slot<V>,
}

impl<K: Eq + Hash, V> Drop for Deregister<K, V> {
    fn drop(&mut self) {
        metrics::flights(-1.0);
        self.count.fetch_sub(1, Ordering::SeqCst);
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        // Only our own slot: never a later flight that reused the key.
        if running
            .get(&self.key)
            .is_some_and(|s| s.same_channel(&self.slot))
        {
            running.remove(&self.key);
        }
    }
}

impl<K, V> LocalFlights<K, V>
where
    K: Clone + Eq + Hash + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, Slot<V>>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Joins the flight for `key`, starting it with `start()` if none runs.
    ///
    /// The flight is removed from the map only after its result is published,
    /// so a caller arriving in between still gets that result; one arriving
    /// after finds whatever the run left behind (e.g. the cache entry).
    /// A joiner waits at most `patience`; the owner waits for the run, which
    /// is bounded by its own protocol.
    pub async fn run<F, Fut>(
        &self,
        key: K,
        patience: Duration,
        start: F,
    ) -> (Role, Result<V, Unshared>)
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = V> + Send + 'static,
    {
        // A joiner's `start` is dropped before it waits, not after: what it
        // holds for a flight it did not start is let go of now (a claim
        // won at the first look, see won.rs).
        let (role, mut slot, unstarted) = {
            let mut running = self.lock();
            match running.get(&key) {
                Some(slot) => (Role::Joiner, slot.clone(), Some(start)),
                None => {
                    let (tx, rx) = watch::channel(None);
                    running.insert(key.clone(), rx.clone());
                    let deregister = Deregister {
                        running: self.running.clone(),
                        count: self.count.clone(),
                        key,
                        slot: rx.clone(),
                    };
                    let fut = start();
                    metrics::flights(1.0);
                    self.count.fetch_add(1, Ordering::SeqCst);
                    self.tasks.spawn(async move {
                        let value = fut.await;
                        // Publish first, then deregister (on drop).
                        tx.send_replace(Some(value));
                        drop(deregister);
                    });
                    (Role::Owner, rx, None)
                }
            }
        };
        drop(unstarted);
        let wait = async {
            match slot.wait_for(Option::is_some).await {
                Ok(value) => Ok(value.clone().expect("wait_for returned a Some")),
                Err(_) => Err(Unshared::Abandoned),
            }
        };
        let result = match role {
            Role::Owner => wait.await,
            Role::Joiner => tokio::time::timeout(patience, wait)
                .await
                .unwrap_or(Err(Unshared::TimedOut)),
        };
        (role, result)
    }

    /// Detaches the flight for `key`, if one runs: it goes on for those
    /// who joined it, and the next caller starts a new one (see the
    /// module's comment).
    pub fn detach(&self, key: &K) {
        if self.count.load(Ordering::SeqCst) == 0 {
            return;
        }
        self.lock().remove(key);
    }

    /// Detaches every flight running (a change to every item).
    pub fn detach_all(&self) {
        if self.count.load(Ordering::SeqCst) == 0 {
            return;
        }
        self.lock().clear();
    }
}

impl<K> LocalFlights<K, Outcome>
where
    K: Clone + Eq + Hash + std::fmt::Display + Send + Sync + 'static,
{
    /// Runs `fly(this, key)` once per key in this process: the first caller
    /// owns the flight, later ones join it and share its outcome (a joiner's
    /// answer is marked as such). The flight runs in a span naming its key,
    /// and a panic in it answers 503, logged once (panics.rs).
    pub async fn answer<T, F, Fut>(
        &self,
        this: &Arc<T>,
        key: K,
        patience: Duration,
        fly: F,
    ) -> Result<Answer, ReadError>
    where
        T: Send + Sync + 'static,
        F: FnOnce(Arc<T>, K) -> Fut,
        Fut: Future<Output = Outcome> + Send + 'static,
    {
        let this = this.clone();
        // The flight's task is the child of the request that began it.
        let parent = tracing::Span::current();
        let (role, outcome) = self
            .run(key.clone(), patience, move || {
                // The request's own span is at debug level: this one names the key.
                let span = tracing::info_span!(
                    parent: &parent,
                    "flight",
                    key = %key,
                    role = tracing::field::Empty,
                    load_ms = tracing::field::Empty
                );
                let named = key.clone();
                // Boxed where it is made: the run's state machine is large
                // (every step's future), and the wrappers below and the spawn
                // would each copy it; they copy a pointer instead.
                let flight = Box::pin(fly(this, key));
                // A panic answers 503; a leader's lock is let go as it unwinds.
                async move { panics::caught(flight, &named, || Err(ReadError::Unavailable)).await }
                    .instrument(span)
            })
            .await;
        let outcome = outcome.unwrap_or_else(|error| {
            Err(match error {
                // A flight whose task panicked ended without an outcome.
                Unshared::Abandoned => ReadError::Unavailable,
                Unshared::TimedOut => ReadError::Timeout,
            })
        });
        let span = tracing::Span::current();
        if let Ok(answer) = &outcome {
            tracing::debug!(?role, served = ?answer.served, stored_at = answer.entry().stored_at(), "flight answered");
        }
        match role {
            Role::Owner => {
                span.record("role", "flight_owner");
                outcome
            }
            Role::Joiner => {
                span.record("role", "flight_joiner");
                outcome.map(Answer::joined)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATIENCE: Duration = Duration::from_secs(5);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_callers_share_one_run() {
        let flights = Arc::new(LocalFlights::<u32, u32>::default());
        let runs = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..100 {
            let (flights, runs) = (flights.clone(), runs.clone());
            tasks.push(tokio::spawn(async move {
                flights
                    .run(1, PATIENCE, || async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        7
                    })
                    .await
            }));
        }
        let mut owners = 0;
        for t in tasks {
            let (role, v) = t.await.unwrap();
            assert_eq!(v.unwrap(), 7);
            owners += usize::from(role == Role::Owner);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(owners, 1);
        assert!(flights.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_detached_flight_ends_for_its_joiners_and_the_next_caller_starts_anew() {
        let flights = Arc::new(LocalFlights::<u32, u32>::default());
        let first = owner(&flights, 100, 1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let joiner = {
            let flights = flights.clone();
            tokio::spawn(async move { flights.run(1, PATIENCE, || async { 9 }).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        flights.detach(&1);
        let (role, after) = flights.run(1, PATIENCE, || async { 2 }).await;
        assert_eq!((role, after), (Role::Owner, Ok(2)), "a new flight");
        assert_eq!(joiner.await.unwrap(), (Role::Joiner, Ok(1)));
        assert_eq!(first.await.unwrap(), (Role::Owner, Ok(1)));
        assert!(flights.is_empty());
    }

    /// Starts the flight of key 1 in a task of its own: it runs `ms`
    /// milliseconds and yields `value`.
    fn owner(
        flights: &Arc<LocalFlights<u32, u32>>,
        ms: u64,
        value: u32,
    ) -> tokio::task::JoinHandle<(Role, Result<u32, Unshared>)> {
        let flights = flights.clone();
        tokio::spawn(async move {
            flights
                .run(1, PATIENCE, || async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    value
                })
                .await
        })
    }

    #[tokio::test]
    async fn a_cancelled_owner_does_not_cancel_the_run() {
        let flights = Arc::new(LocalFlights::<u32, u32>::default());
        let owner = owner(&flights, 50, 9);
        tokio::time::sleep(Duration::from_millis(5)).await;
        owner.abort();
        let (role, v) = flights.run(1, PATIENCE, || async { unreachable!() }).await;
        assert_eq!((role, v.unwrap()), (Role::Joiner, 9));
    }

    #[tokio::test]
    async fn a_panicking_run_wakes_every_joiner_with_an_error() {
        let flights = Arc::new(LocalFlights::<u32, u32>::default());
        let joiners: Vec<_> = (0..10)
            .map(|_| {
                let flights = flights.clone();
                tokio::spawn(async move {
                    flights
                        .run(1, PATIENCE, || async {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            panic!("load exploded")
                        })
                        .await
                })
            })
            .collect();
        for j in joiners {
            let (_, v) = tokio::time::timeout(Duration::from_secs(2), j)
                .await
                .expect("no hang")
                .unwrap();
            assert!(v.is_err());
        }
        assert!(flights.is_empty(), "the map is cleaned after a panic");
    }

    #[tokio::test]
    async fn a_joiner_stops_waiting_after_its_patience() {
        let flights = Arc::new(LocalFlights::<u32, u32>::default());
        let owner = owner(&flights, 300, 3);
        tokio::time::sleep(Duration::from_millis(5)).await;

        let (role, joined) = flights
            .run(1, Duration::from_millis(50), || async { unreachable!() })
            .await;

        assert_eq!((role, joined), (Role::Joiner, Err(Unshared::TimedOut)));
        assert_eq!(owner.await.unwrap().1, Ok(3), "the run goes on");
    }
}
