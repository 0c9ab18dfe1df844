//! Reads that ask for a position or a staleness bound (read your writes):
//! where they are answered from, decided once, here.
//!
//! A client that wrote to PostgreSQL reads `pg_current_wal_lsn()` after its
//! commit and asks for it (`PostCache-Min-LSN`): the answer then reflects
//! every commit at or before that position. The change feed (replication)
//! applies changes in commit order, first to Redis and then, as each
//! instance reads the fleet's stream, to its memory tier, so once this
//! process's [`FeedPosition`] has passed the position the cache has every
//! change up to it: a change at or before it would have invalidated the
//! entry. The read is then served as any other. Otherwise it waits for the
//! feed, woken by the stream's reader, up to MIN_LSN_WAIT; past that it is
//! read past the cache ([`Primary::read_at_least`]: a replica that has
//! replayed the position, or the primary), and stores nothing.
//!
//! A staleness bound (`PostCache-Max-Staleness`) is met by the cache while
//! this process heard the decoder say, within it, that it was level with
//! the server. Otherwise the primary's position is asked, once for every
//! such read waiting here ([`Primary::primary_position`], a ReadIndex
//! round), by a statement that began after the read arrived: once the feed
//! passes it, the cache answers. A flood of such reads costs a statement
//! per round and no row.
//!
//! Without a position known (another mode, the feed down), reads that ask
//! for one go past the cache.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use futures::future::BoxFuture;

use crate::telemetry::metrics;

/// What a read asked for beside its keys; never both `None` (an ordinary
/// read asks for nothing and has no `Wanted`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Wanted {
    /// Every commit up to this WAL position (bytes from 0/0).
    pub min_lsn: Option<u64>,
    /// Heard from the decoder within this.
    pub max_staleness: Option<Duration>,
}

/// The change feed's position as this process knows it: every change up
/// to it is applied to Redis and to this process's memory tier.
pub trait FeedPosition: Send + Sync + 'static {
    /// The position at `now`, while a decoder keeps up (`None` otherwise:
    /// another mode, or the feed down).
    fn position_at(&self, now: Instant) -> Option<u64>;

    /// How long ago the decoder last said it was level with the server,
    /// while it keeps up (`None` otherwise).
    fn staleness(&self) -> Option<Duration>;

    /// Waits, at most `limit`, until the position has passed `lsn`
    /// (woken, not polling): whether it has.
    fn reached(&self, lsn: u64, limit: Duration) -> BoxFuture<'_, bool>;

    /// [`FeedPosition::position_at`] now.
    fn position(&self) -> Option<u64> {
        self.position_at(Instant::now())
    }
}

/// A feed that never knows a position (no change feed in replication
/// mode): reads that ask for one go past the cache.
#[derive(Debug, Default)]
pub struct NoPosition;

impl FeedPosition for NoPosition {
    fn position_at(&self, _: Instant) -> Option<u64> {
        None
    }

    fn staleness(&self) -> Option<Duration> {
        None
    }

    fn reached(&self, _: u64, _: Duration) -> BoxFuture<'_, bool> {
        Box::pin(async { false })
    }
}

/// Why PostgreSQL gave no word to a read that needed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PastFailure {
    /// Every connection for such reads was taken (shed: 503, `Retry-After`).
    #[error("every connection for reads past the cache is taken")]
    Full,
    /// PostgreSQL did not answer.
    #[error("PostgreSQL did not answer")]
    Failed,
}

/// Items read past the cache, at a position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPast<K> {
    /// The bodies of the keys that exist.
    pub found: Vec<(K, Bytes)>,
    /// From a replica: the position it had replayed before it read, every
    /// commit up to it in `found`. From the primary: its WAL insert
    /// position, past every commit visible to the read (and maybe some
    /// not visible yet): a client's position past it is in the future.
    pub position: u64,
    /// No row read is newer than this position (the server's, read after
    /// the rows).
    pub upto: u64,
    /// Read from a replica (else the primary).
    pub replica: bool,
}

/// PostgreSQL's word, for reads the cache cannot vouch for: asked on
/// connections of their own, never the loads'.
pub trait Primary<K>: Send + Sync + 'static {
    /// The primary's WAL insert position, read by a statement that began
    /// after this call (one statement for every call waiting meanwhile).
    fn primary_position(&self) -> BoxFuture<'_, Result<u64, PastFailure>>;

    /// The highest position the primary is known to have reached (0: none):
    /// a position at or below it is not in the future.
    fn known_primary(&self) -> u64;

    /// The primary has reached `at`.
    fn saw(&self, at: u64);

    /// `keys` read past the cache, at a position at least `min`: from a
    /// replica that has replayed it, else the primary.
    fn read_at_least<'a>(
        &'a self,
        keys: &'a [K],
        min: Option<u64>,
    ) -> BoxFuture<'a, Result<ReadPast<K>, PastFailure>>;
}

/// Why a read that asked for something got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The position asked is past the primary's: no client can have seen
    /// it (a 400; the primary's own position is not said).
    #[error("the position asked is past the database's")]
    Future { asked: u64 },
    /// PostgreSQL's word was needed and not given.
    #[error(transparent)]
    Past(#[from] PastFailure),
}

/// Where a read that asked for something is answered from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// From the cache, which has every change up to `at`.
    Cache { at: u64, waited: bool },
    /// Past the cache: nothing this process knows vouches for it.
    Past,
}

/// The least a read whose staleness bound the beats do not meet waits for
/// the feed to pass the primary's position (MIN_LSN_WAIT if longer): a
/// decoder that keeps up proves a position past it within a beat or two.
pub const PRIMARY_WAIT: Duration = Duration::from_millis(300);

/// What the read path asks for reads that ask for something: the feed's
/// position, PostgreSQL's word, and MIN_LSN_WAIT.
pub(super) struct Asks<K> {
    pub feed: Arc<dyn FeedPosition>,
    pub primary: Arc<dyn Primary<K>>,
    pub wait: Duration,
}

impl<K: Send + Sync + 'static> Asks<K> {
    /// Decides where a read that asked for `wanted` is answered from,
    /// waiting up to MIN_LSN_WAIT for the feed to pass the position it
    /// needs; refused for a position in the future, or when PostgreSQL's
    /// word was needed and not given.
    ///
    /// - The feed vouches for it now (its beats meet the staleness bound,
    ///   its position is past the one asked): the cache.
    /// - No position is known: past the cache.
    /// - A staleness bound the beats do not meet: the primary's position is
    ///   asked (one round for every such read waiting), and the cache
    ///   answers once the feed has passed it (a bound of 0 ms is met).
    /// - A position past the feed's: past the primary's last known
    ///   position, the primary is asked while the feed is waited for; a
    ///   position past the primary's is refused as soon as it answers, and
    ///   the feed passing the position first answers from the cache
    ///   without waiting for it.
    ///
    /// Whatever the feed does not pass within the wait is read past the
    /// cache.
    pub async fn route(&self, wanted: Wanted) -> Result<Route, Refused> {
        let feed = &*self.feed;
        let fresh_enough = match wanted.max_staleness {
            None => true,
            Some(bound) => feed.staleness().is_some_and(|age| age <= bound),
        };
        let Some(at) = feed.position() else {
            return Ok(Route::Past);
        };
        self.primary.saw(at);
        let min = wanted.min_lsn.unwrap_or(0);
        if fresh_enough && at >= min {
            return Ok(Route::Cache { at, waited: false });
        }
        let future = Refused::Future { asked: min };
        let wait = self.wait;
        if fresh_enough {
            // A position at or below one the primary is known to have
            // reached is not in the future: no statement.
            if min <= self.primary.known_primary() || wait.is_zero() {
                return Ok(wait_for(feed, min, wait).await);
            }
            // Else the primary is asked at once, beside the wait for the
            // feed (not before it: a write's position, read at once, is
            // passed by the feed within a few milliseconds). A position
            // past the primary's is refused without a wait; one the feed
            // passes first is answered from the cache without waiting for
            // the answer, and the round goes on, in a task of its own, for
            // the reads that share it.
            let asked = tokio::spawn({
                let primary = self.primary.clone();
                async move { primary.primary_position().await }
            });
            let reached = wait_for(feed, min, wait);
            tokio::pin!(reached);
            return tokio::select! {
                biased;
                route = &mut reached => Ok(route),
                primary = asked => match primary {
                    Ok(Ok(primary)) if min > primary => Err(future),
                    // Not in the future, or the primary could not be
                    // asked: the feed decides (a read past the cache fails
                    // as it would).
                    _ => Ok(reached.await),
                },
            };
        }
        let primary = self.primary.primary_position().await?;
        if min > primary {
            return Err(future);
        }
        // A wait of none stays none; any other is at least PRIMARY_WAIT.
        let wait = if wait.is_zero() {
            wait
        } else {
            wait.max(PRIMARY_WAIT)
        };
        Ok(wait_for(feed, primary, wait).await)
    }
}

/// The cache once the feed has passed `target` within `wait`, else past
/// it.
async fn wait_for(feed: &dyn FeedPosition, target: u64, wait: Duration) -> Route {
    if wait.is_zero() {
        return Route::Past;
    }
    let started = Instant::now();
    let reached = feed.reached(target, wait).await;
    metrics::position_wait(started.elapsed());
    match feed.position() {
        Some(at) if reached && at >= target => Route::Cache { at, waited: true },
        _ => Route::Past,
    }
}

#[cfg(test)]
mod tests {
    //! The routing alone, over a model of the feed and the primary (the
    //! same decisions against real servers: tests/it/read_your_writes.rs).

    use std::sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Mutex,
    };

    use super::*;

    /// A feed at `position` (0: none known), `staleness` ms behind (none:
    /// beats not level), that passes `later` after `after`.
    #[derive(Default)]
    struct Feed {
        position: AtomicU64,
        staleness: Mutex<Option<Duration>>,
        later: Mutex<Option<(Duration, u64)>>,
    }

    impl FeedPosition for Feed {
        fn position_at(&self, _: Instant) -> Option<u64> {
            Some(self.position.load(Ordering::SeqCst)).filter(|&at| at > 0)
        }

        fn staleness(&self) -> Option<Duration> {
            *self.staleness.lock().unwrap()
        }

        fn reached(&self, lsn: u64, limit: Duration) -> BoxFuture<'_, bool> {
            Box::pin(async move {
                let later = *self.later.lock().unwrap();
                if let Some((after, to)) = later.filter(|(after, _)| *after <= limit) {
                    tokio::time::sleep(after).await;
                    self.position.fetch_max(to, Ordering::SeqCst);
                } else {
                    tokio::time::sleep(limit).await;
                }
                self.position.load(Ordering::SeqCst) >= lsn
            })
        }
    }

    /// A primary at `at`, answering after `delay`, counting its rounds.
    struct Word {
        at: u64,
        delay: Duration,
        rounds: AtomicUsize,
        known: AtomicU64,
    }

    impl Primary<i64> for Word {
        fn primary_position(&self) -> BoxFuture<'_, Result<u64, PastFailure>> {
            Box::pin(async move {
                self.rounds.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(self.delay).await;
                self.saw(self.at);
                Ok(self.at)
            })
        }

        fn known_primary(&self) -> u64 {
            self.known.load(Ordering::SeqCst)
        }

        fn saw(&self, at: u64) {
            self.known.fetch_max(at, Ordering::SeqCst);
        }

        fn read_at_least<'a>(
            &'a self,
            _: &'a [i64],
            _: Option<u64>,
        ) -> BoxFuture<'a, Result<ReadPast<i64>, PastFailure>> {
            Box::pin(async { Err(PastFailure::Failed) })
        }
    }

    fn asks(feed: Feed, primary_at: u64, delay_ms: u64) -> (Asks<i64>, Arc<Word>) {
        let word = Arc::new(Word {
            at: primary_at,
            delay: Duration::from_millis(delay_ms),
            rounds: AtomicUsize::new(0),
            known: AtomicU64::new(0),
        });
        let asks = Asks {
            feed: Arc::new(feed),
            primary: word.clone(),
            wait: Duration::from_millis(100),
        };
        (asks, word)
    }

    fn feed(position: u64, staleness_ms: Option<u64>) -> Feed {
        Feed {
            position: AtomicU64::new(position),
            staleness: Mutex::new(staleness_ms.map(Duration::from_millis)),
            later: Mutex::new(None),
        }
    }

    fn lsn(min: u64) -> Wanted {
        Wanted {
            min_lsn: Some(min),
            max_staleness: None,
        }
    }

    fn stale(ms: u64) -> Wanted {
        Wanted {
            min_lsn: None,
            max_staleness: Some(Duration::from_millis(ms)),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn what_the_feed_vouches_for_is_the_cache_without_a_statement() {
        let (asks, word) = asks(feed(500, Some(20)), 1000, 5);
        assert_eq!(
            asks.route(lsn(400)).await,
            Ok(Route::Cache {
                at: 500,
                waited: false
            })
        );
        assert_eq!(
            asks.route(stale(50)).await,
            Ok(Route::Cache {
                at: 500,
                waited: false
            })
        );
        assert_eq!(word.rounds.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_position_known_every_ask_goes_past_the_cache() {
        let (asks, word) = asks(feed(0, None), 1000, 5);
        assert_eq!(asks.route(lsn(1)).await, Ok(Route::Past));
        assert_eq!(asks.route(stale(0)).await, Ok(Route::Past));
        assert_eq!(word.rounds.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_position_is_refused_when_the_primary_answers_not_after_the_wait() {
        let (asks, _) = asks(feed(500, Some(0)), 1000, 5);
        let started = tokio::time::Instant::now();
        assert_eq!(
            asks.route(lsn(2000)).await,
            Err(Refused::Future { asked: 2000 })
        );
        assert_eq!(started.elapsed(), Duration::from_millis(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_position_the_feed_passes_first_is_the_cache_without_waiting_for_the_primary() {
        let feed = feed(500, Some(0));
        *feed.later.lock().unwrap() = Some((Duration::from_millis(2), 700));
        let (asks, _) = asks(feed, 1000, 50);
        let started = tokio::time::Instant::now();
        assert_eq!(
            asks.route(lsn(600)).await,
            Ok(Route::Cache {
                at: 700,
                waited: true
            })
        );
        assert_eq!(started.elapsed(), Duration::from_millis(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_position_at_or_below_the_primarys_known_one_costs_no_statement() {
        let (asks, word) = asks(feed(500, Some(0)), 1000, 5);
        word.saw(800);
        // The feed does not pass it within the wait: past the cache, and
        // no round was asked for.
        assert_eq!(asks.route(lsn(700)).await, Ok(Route::Past));
        assert_eq!(word.rounds.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unmet_bound_waits_for_the_primarys_position_for_primary_wait_at_least() {
        // The beats are 40 ms old: a bound of 0 is not met. The primary is
        // at 1000; the feed passes it 250 ms later, within PRIMARY_WAIT
        // (longer than the 100 ms MIN_LSN_WAIT).
        let feed = feed(500, Some(40));
        *feed.later.lock().unwrap() = Some((Duration::from_millis(250), 1000));
        let (asks, word) = asks(feed, 1000, 5);
        assert_eq!(
            asks.route(stale(0)).await,
            Ok(Route::Cache {
                at: 1000,
                waited: true
            })
        );
        assert_eq!(word.rounds.load(Ordering::SeqCst), 1);
        // Never passed: past the cache.
        let (asks, _) = never_passing(1000);
        assert_eq!(asks.route(stale(0)).await, Ok(Route::Past));
    }

    fn never_passing(primary_at: u64) -> (Asks<i64>, Arc<Word>) {
        asks(feed(500, Some(40)), primary_at, 5)
    }
}
