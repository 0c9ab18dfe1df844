//! The protocol (the read path): cache lookup, in-process flight, fleet-wide
//! leader election, pub/sub wake-up, and freshness (stale-while-revalidate, early refresh,
//! fail-safe). Generic over what it loads: it knows nothing of posts.
//!
//! ```text
//! read(key) ── memory tier (memory.rs) ──fresh──► Memory hit (maybe an early refresh)
//!    │ not there
//!    ▼
//! first look (first_look.rs): SET value <claim> NX GET PX, or a plain GET
//!   for a key seen stored lately (warm.rs)
//!    ── judge ──Fresh──► Hit (maybe an early refresh: refresh.rs)
//!             │ Backoff ─► Stale   StaleInGrace ─► Stale + one refresh
//!             │ Failed ──► 503 at once
//!             │ Miss (claimed, or another's claim there)   │ redis error or breaker open
//!             ▼                                            ▼
//!        existence guard (existence.rs) ── cannot exist ──► 404
//!             ▼
//!        in-process flight (local.rs: one per key; joiners never touch Redis)
//!             │
//!   waiter.rs (machine.rs's transitions), until WAIT_TIMEOUT:
//!     elect: the claim won at the first look, else SET value <claim> NX
//!        │   (a copy kept past freshness: SET lock NX PX, with the fence)
//!        │──won──► leader.rs: double-check, load (batch/; the watchdog
//!        │lost     extends the claim), finish (after answering, where the
//!        │         row read may be answered at once)
//!        ▼
//!     SUBSCRIBE ready (once) ─► GET again ─► PTTL claim ─► wait for:
//!        message ─► answer                 claim expiry ─► loop (maybe lead)
//! ```
//!
//! Every Redis failure fails open: the flight loads straight from the source
//! (`Bypass`), still one load per key per process at a time.
//!
//! A read that asks for a position or a staleness bound (read your
//! writes) is routed in `asked.rs`, behind the same door
//! ([`ReadPath::serve`]): the cache, the cache once the change feed has
//! passed the position, or a read past the cache, never stored, and never
//! older than what this process served (floor.rs).
//!
//! `ReadPath` is the front door and the only type of this file; every
//! other file is one role or one concept, and none of them sees the read
//! path: each is handed the `Context` it needs (`context.rs`). The files:
//! `answer.rs` (what a read answers), `asked.rs` (reads that ask for a
//! position: where they are answered from, the feed's position and
//! PostgreSQL's word they need), `freshness.rs` (pure verdicts and the
//! store policy), `local.rs` (in-process flights), `waiter.rs` (a flight's
//! fleet-wide coordination, driving `machine.rs`, one flight's state
//! machine with pure transitions, and [`WaitEnd`], how a wait ends),
//! `leader.rs` (the leader's work, with the guard that lets go of its lock
//! when it vanishes), `letgo.rs` (locks and claims let go in the
//! background), `first_look.rs` (the first look that claims) and `won.rs` (the
//! claims it won, on their way to a flight), `warm.rs` (keys seen stored lately),
//! `refresh.rs` (background refreshes, leaders nobody waits on),
//! `load.rs` (loads from the source), `batch/` (loads queued while
//! statements run share the next one), `progress.rs` (busy told from a
//! database that stopped answering), `memory.rs` (the memory tier and its
//! fencing against evictions), `existence.rs` (the existence guard: the
//! set of the items that exist),
//! `apply.rs` (changes applied to the cache: fences, tombstones, the
//! cutoff), `panics.rs` (a flight that panics answers 503, logged once
//! with its key), `settings.rs` (CACHE_STRATEGY among them), `source.rs`
//! (what the read path loads from: [`Source`]), and `lab.rs`: the load
//! lab's baselines, a reader of their own put in front when CACHE_STRATEGY
//! names one. The Redis side (commands, nodes, breakers, scripts,
//! subscriber) is the `redis` module.

mod answer;
pub mod apply;
mod asked;
mod batch;
mod context;
pub mod existence;
mod first_look;
mod floor;
mod freshness;
mod lab;
mod leader;
mod letgo;
mod load;
mod local;
mod machine;
mod memory;
mod panics;
mod progress;
mod refresh;
mod settings;
mod source;
mod waiter;
mod warm;
mod won;

use std::{
    future::Future,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use futures::{
    future::{join_all, Either},
    FutureExt,
};
use tracing::Instrument;

pub use answer::{Answer, ReadError, Served};
pub use asked::{
    FeedPosition, NoPosition, PastFailure, Primary, ReadPast, Refused, Wanted, PRIMARY_WAIT,
};
pub use machine::WaitEnd;
pub use progress::LoadProgress;
pub use settings::{fence_ttl, Settings, Strategy, Wake};
#[cfg(feature = "testkit")]
pub use settings::{Hook, Hooks};
pub use source::{Busy, LoadError, Loaded, LoadedMany, Since, Source};

use answer::Outcome;
use asked::{Asks, Route};
use context::Context;
use first_look::Won;
use freshness::{judge, Verdict};
use lab::Lab;
use load::Loader;
use local::LocalFlights;
use memory::MemoryTier;
use refresh::Refreshes;
use waiter::Coordinator;

use crate::{
    cache::{now_millis, Keys},
    redis::{ChangeKind, RedisCommands, RedisError, Subscriber},
    telemetry::metrics,
};

/// What a first look in Redis says beside its verdict.
#[derive(Debug, Clone, Copy)]
struct Looked {
    /// Redis is worth trying again (for the lock) when there is nothing to
    /// serve: not known down.
    redis_up: bool,
    /// No entry was found in the value key (nothing, a leader's claim, or
    /// bytes that are not an entry): a flight claims the value key itself.
    absent: bool,
}

/// A first look in Redis at one key, judged, with what it leaves to the
/// answer: the time of the look, the memory tier's ticket taken before it
/// (see memory.rs), and the claim the look won, if it did (see won.rs).
struct LookOutcome<S: Source> {
    now: u64,
    /// The change feed's position before the look (floor.rs).
    looked_at: u64,
    verdict: Verdict,
    looked: Looked,
    ticket: memory::Ticket,
    won: Option<Box<Won<S>>>,
}

/// The read path of one process: its one door is [`ReadPath::serve`] (and
/// [`ReadPath::memory_hit`], a fresh copy of the memory tier answered
/// before anything else), which decides where each read is answered from;
/// the changes the feed applies come in through [`ReadPath::invalidate`]
/// and its siblings.
/// Its roles are handed its `Context` (context.rs), never the read path
/// itself.
pub struct ReadPath<S: Source> {
    /// What the roles share (context.rs).
    ctx: Arc<Context<S>>,
    /// The load lab's reader when CACHE_STRATEGY names a baseline (lab.rs).
    lab: Option<Arc<Lab<S>>>,
    flights: LocalFlights<S::Key, Outcome>,
    /// Background refreshes running in this process (refresh.rs).
    refreshes: Arc<Refreshes<S>>,
    /// Reads in progress (every read not yet answered): lets tests and
    /// operators see how many requests a stampede holds.
    reads_in_progress: AtomicUsize,
    /// The items that exist (existence.rs).
    existence: existence::ExistenceSet,
    /// Keys seen stored in Redis lately: looked up, not claimed (warm.rs).
    warm: warm::Warm,
    /// What reads that ask for a position need (asked.rs).
    asks: Asks<S::Key>,
}

/// The keys a read asks for: one (a single read: its first look claims
/// the key), or many at once (a batch read: one look per Redis node).
#[derive(Debug, Clone)]
pub enum Items<K> {
    One(K),
    Many(Vec<K>),
}

impl<K> Items<K> {
    fn into_keys(self) -> Vec<K> {
        match self {
            Items::One(key) => vec![key],
            Items::Many(keys) => keys,
        }
    }
}

/// A read, as it enters [`ReadPath::serve`].
#[derive(Debug, Clone)]
pub struct Request<K> {
    pub items: Items<K>,
    /// What it asks for beside the keys (`None`: an ordinary read).
    pub wanted: Option<Wanted>,
    /// When it arrived.
    pub started: Instant,
}

/// What a read answers.
#[derive(Debug)]
pub struct Reply {
    /// An answer per key, in the order asked.
    pub answers: Vec<Result<Answer, ReadError>>,
    /// The WAL position every answer is known fresh at (every commit up to
    /// it reflected), while this process knows one.
    pub at: Option<u64>,
    /// Read past the cache, for what the read asked.
    pub past: bool,
}

impl Reply {
    /// Answers from the cache, read from position `at` on: it says no
    /// position when one is served stale (the fail-safe copy of a failed
    /// load may be the version before a change).
    fn from_cache(answers: Vec<Result<Answer, ReadError>>, at: Option<u64>) -> Self {
        Self {
            at: at.filter(|_| !any_stale(&answers)),
            answers,
            past: false,
        }
    }
}

/// Whether one of `answers` is served stale.
fn any_stale(answers: &[Result<Answer, ReadError>]) -> bool {
    answers
        .iter()
        .any(|answer| answer.as_ref().is_ok_and(|a| a.served == Served::Stale))
}

/// Counts a read as in progress until dropped (answered or cancelled).
struct InProgress<'a>(&'a AtomicUsize);

impl<'a> InProgress<'a> {
    fn enter(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::reads(1.0);
        Self(counter)
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        metrics::reads(-1.0);
    }
}

impl<S: Source> ReadPath<S> {
    /// The read path over `source`; `feed` and `primary` answer the reads
    /// that ask for a position (asked.rs).
    pub fn new(
        source: S,
        keys: Keys,
        redis: RedisCommands,
        subscriber: Arc<Subscriber>,
        settings: Settings,
        feed: Arc<dyn FeedPosition>,
        primary: Arc<dyn Primary<S::Key>>,
    ) -> Arc<Self> {
        panics::install_hook();
        // What entries loaded here count their loads' start from.
        crate::cache::entry::process_epoch();
        let memory = MemoryTier::new(settings.memory_bytes, settings.memory_ttl);
        let loader = Loader::new(source, &settings);
        let ctx = Arc::new(Context::new(
            loader, keys, redis, subscriber, settings, memory,
        ));
        let refreshes = Arc::new(Refreshes::default());
        let lab = Lab::new(ctx.settings.strategy, &ctx, &refreshes).map(Arc::new);
        let asks = Asks {
            feed,
            primary,
            wait: ctx.settings.min_lsn_wait,
        };
        Arc::new(Self {
            asks,
            flights: LocalFlights::new(ctx.tasks.clone()),
            lab,
            ctx,
            refreshes,
            reads_in_progress: AtomicUsize::new(0),
            existence: existence::ExistenceSet::default(),
            warm: warm::Warm::default(),
        })
    }

    pub fn redis(&self) -> &RedisCommands {
        &self.ctx.redis
    }

    pub fn keys(&self) -> &Keys {
        &self.ctx.keys
    }

    pub fn subscriber(&self) -> &Arc<Subscriber> {
        &self.ctx.subscriber
    }

    pub fn settings(&self) -> &Settings {
        &self.ctx.settings
    }

    /// Serves from the memory tier (the change feed is up, or off), or not
    /// (it is down: the tier is emptied, and the existence guard stands
    /// aside until built again once the feed is back).
    pub fn serve_from_memory(&self, serving: bool) {
        self.ctx.memory.serve(serving);
        if !serving {
            self.existence.stand_aside();
        }
    }

    /// The existence guard (existence.rs).
    pub fn existence(&self) -> &existence::ExistenceSet {
        &self.existence
    }

    /// Builds the existence guard from the source if it stands aside;
    /// whether it is built now. Call only while the change feed is up.
    pub async fn build_existence_set(&self) -> Result<bool, LoadError> {
        let Some(build) = self.existence.begin_build() else {
            return Ok(false);
        };
        match self.ctx.loader.ordinals().await {
            Ok(Some(set)) => Ok(self.existence.finish_build(build, set)),
            Ok(None) => {
                self.existence.abandon_build(build);
                Ok(false)
            }
            Err(error) => {
                self.existence.abandon_build(build);
                Err(error)
            }
        }
    }

    /// Whether the existence guard says `key` cannot exist.
    fn known_missing(&self, key: &S::Key) -> bool {
        S::ordinal(key).is_some_and(|ordinal| self.existence.says_missing(ordinal))
    }

    /// The guard's answer for `key`: not found, when it cannot exist.
    fn known_missing_answer(&self, key: &S::Key) -> Option<Result<Answer, ReadError>> {
        if !self.known_missing(key) {
            return None;
        }
        let entry = crate::cache::Entry::new(
            crate::cache::Status::NotFound,
            &[],
            self.ctx.settings.negative_ttl,
            Duration::ZERO,
        );
        Some(Answer::new(entry, Served::KnownMissing))
    }

    /// Whether the memory tier is on and serving, with its bytes and entries.
    pub fn memory_usage(&self) -> (bool, u64, usize) {
        let (bytes, entries) = self.ctx.memory.usage();
        (self.ctx.memory.is_serving(), bytes, entries)
    }

    /// Evictions of `key`'s stripe of the memory tier (changes applied
    /// here to it, or to another key of its stripe): a test waits for it
    /// to move to know a change has reached this process.
    #[cfg(feature = "testkit")]
    pub fn evictions(&self, key: &S::Key) -> u64 {
        self.ctx.memory.ticket(key).generation
    }

    /// Reads not yet answered.
    pub fn reads_in_progress(&self) -> usize {
        self.reads_in_progress.load(Ordering::Relaxed)
    }

    /// Waits, at most `limit`, for flights and background refreshes to end,
    /// so that a leader shut down still publishes and releases its lock.
    pub async fn drain(&self, limit: Duration) -> bool {
        self.ctx.tasks.close();
        tokio::time::timeout(limit, self.ctx.tasks.wait())
            .await
            .is_ok()
    }

    /// The front door: every read, plain or asking for a position, of one
    /// key or many, enters here once, and where it is answered from is
    /// decided here, once (asked.rs): the cache, the cache after a wait for
    /// the change feed, or past the cache. Refused for a position in the
    /// future, or when PostgreSQL's word was needed and not given.
    ///
    /// The common read (one key, asking for nothing) is not boxed, and its
    /// future holds no more than the read's and the position it began at:
    /// every waiting request keeps it for the whole wait (see
    /// `http/server`'s `a_request_future_stays_small`). The others are.
    pub fn serve<'a>(
        self: &'a Arc<Self>,
        request: Request<S::Key>,
    ) -> impl Future<Output = Result<Reply, Refused>> + Send + 'a {
        let Request {
            items,
            wanted,
            started,
        } = request;
        match (items, wanted) {
            (Items::One(key), None) => {
                // Read before the read: every change up to it is in the
                // cache. Kept as a plain number (0: none; no position is
                // 0), which every waiting request holds.
                let at = self.asks.feed.position_at(started).unwrap_or(0);
                Either::Left(self.read(key).map(move |answer| {
                    Ok(Reply::from_cache(
                        vec![answer],
                        Some(at).filter(|&at| at > 0),
                    ))
                }))
            }
            (items, wanted) => Either::Right(Box::pin(self.serve_rest(items, wanted, started))),
        }
    }

    /// [`ReadPath::serve`] for a batch, or a read that asked for something.
    async fn serve_rest(
        self: &Arc<Self>,
        items: Items<S::Key>,
        wanted: Option<Wanted>,
        started: Instant,
    ) -> Result<Reply, Refused> {
        match wanted {
            None => Ok(self.from_cache(items, started).await),
            Some(wanted) => self.serve_wanted(items, wanted).await,
        }
    }

    /// A read from the cache, with the position its answers are known
    /// fresh at: the feed's when the read began (every change up to it is
    /// in the cache).
    async fn from_cache(self: &Arc<Self>, items: Items<S::Key>, started: Instant) -> Reply {
        let at = self.asks.feed.position_at(started);
        let answers = match items {
            Items::One(key) => vec![self.read(key).await],
            Items::Many(keys) => self.read_many(keys).await,
        };
        Reply::from_cache(answers, at)
    }

    /// A read that asked for `wanted`: from the cache once it is known
    /// fresh enough, else past it.
    async fn serve_wanted(
        self: &Arc<Self>,
        items: Items<S::Key>,
        wanted: Wanted,
    ) -> Result<Reply, Refused> {
        if let Route::Cache { at, waited } = self.asks.route(wanted).await? {
            let reply = self.from_cache(items.clone(), Instant::now()).await;
            // A stale copy is no answer to a position.
            if !any_stale(&reply.answers) {
                metrics::position_read(if waited { "wait" } else { "cache" });
                return Ok(Reply {
                    at: Some(at),
                    ..reply
                });
            }
        }
        self.read_past(items.into_keys(), wanted).await
    }

    /// Reads `keys` past the cache, at a position at least the one
    /// `wanted` names and no older than what this process served of them
    /// (floor.rs): an answer per key, in order (served as a bypass, stored
    /// nowhere), and a position they reflect every commit up to, if one is
    /// known.
    ///
    /// From a replica, that is the position it had replayed before it read
    /// (a standby shows commits in the order they were replayed). The
    /// primary shows a commit a moment after its record is written (longer
    /// while a synchronous standby holds it), so its WAL position may name
    /// a commit its rows do not have yet: the answer says the position this
    /// process's change feed had reached before the read (the decoder
    /// applies a commit only once it is visible), or none.
    async fn read_past(&self, keys: Vec<S::Key>, wanted: Wanted) -> Result<Reply, Refused> {
        let started = Instant::now();
        let visible = self.asks.feed.position_at(started);
        let min = wanted.min_lsn.unwrap_or(0);
        let floor = keys
            .iter()
            .map(|key| self.ctx.floors.upto(key))
            .max()
            .unwrap_or(0);
        let at_least = Some(min.max(floor)).filter(|&at| at > 0);
        let read = self.asks.primary.read_at_least(&keys, at_least).await?;
        if read.position < min {
            return Err(Refused::Future { asked: min });
        }
        metrics::position_read(if read.replica { "replica" } else { "primary" });
        let took = started.elapsed();
        let answers: Vec<_> = keys
            .iter()
            .map(|key| {
                let (status, body) = match read.found.iter().find(|(found, _)| found == key) {
                    Some((_, body)) => (crate::cache::Status::Found, &body[..]),
                    None => (crate::cache::Status::NotFound, &b""[..]),
                };
                let entry = crate::cache::Entry::from_load(
                    status,
                    body,
                    Duration::ZERO,
                    took,
                    started,
                    read.upto,
                );
                Answer::new(entry, Served::Bypass)
            })
            .collect();
        // What this process serves of them from now on is no older.
        for (key, answer) in keys.iter().zip(&answers) {
            if let Ok(answer) = answer {
                self.served_past(key, answer);
            }
        }
        let at = if read.replica {
            Some(read.position)
        } else {
            visible
        };
        Ok(Reply {
            answers,
            at,
            past: true,
        })
    }

    /// Reads one item through the cache (see [`ReadPath::serve`], the
    /// door). The product's read, or the load lab's reader for a baseline
    /// (chosen at startup).
    pub async fn read(self: &Arc<Self>, key: S::Key) -> Result<Answer, ReadError> {
        let _in_progress = InProgress::enter(&self.reads_in_progress);
        match &self.lab {
            None => self.get(key).await,
            // Boxed: the product's future does not grow by the baselines'.
            Some(lab) => Box::pin(lab.read(key)).await,
        }
    }

    /// Many keys read at once (a batch read): the memory tier first, then
    /// one look in Redis per node for the rest (`lookup_many`), then each
    /// key as a single read goes on from its look: a hit served, a miss
    /// through this process's flight for the key, with its own fleet-wide
    /// election, fence, finish and wake-up. The misses' loads run together,
    /// so they share statements (`batch.rs`). `keys` are distinct; the
    /// answers come in their order.
    pub async fn read_many(self: &Arc<Self>, keys: Vec<S::Key>) -> Vec<Result<Answer, ReadError>> {
        if self.lab.is_some() {
            // The load lab's baselines: a read per key, as they stand.
            return join_all(keys.into_iter().map(|key| self.read(key))).await;
        }
        let _in_progress = InProgress::enter(&self.reads_in_progress);
        let now = now_millis();
        let looked_at = self.ctx.floors.position();
        let mut answers: Vec<Option<Result<Answer, ReadError>>> =
            keys.iter().map(|key| self.from_memory(key, now)).collect();
        let rest: Vec<usize> = (0..keys.len())
            .filter(|&at| answers[at].is_none())
            .collect();
        if !rest.is_empty() {
            // Taken before anything is read (see memory.rs).
            let tickets: Vec<_> = rest
                .iter()
                .map(|&at| self.ctx.memory.ticket(&keys[at]))
                .collect();
            let names: Vec<String> = rest
                .iter()
                .map(|&at| self.ctx.keys.value(&keys[at]))
                .collect();
            let looked = Box::pin(self.ctx.redis.lookup_many(&names)).await;
            let grace = self.ctx.settings.stale_while_revalidate;
            let reads = rest
                .iter()
                .zip(looked)
                .zip(tickets)
                .map(|((&at, looked), ticket)| {
                    let (verdict, looked) = self.judge_look_up(looked, now, grace);
                    let key = keys[at].clone();
                    // A miss: its load is about to queue; a statement waits
                    // for it and the read's other misses (see batch.rs).
                    let expected = (matches!(verdict, Verdict::Miss) && !self.known_missing(&key))
                        .then(|| self.ctx.loader.expect(&key));
                    let look = LookOutcome {
                        now,
                        looked_at,
                        verdict,
                        looked,
                        ticket,
                        won: None,
                    };
                    let read = self.after_look_up(key, look);
                    async move {
                        let answer = read.await;
                        drop(expected);
                        answer
                    }
                });
            for (&at, answer) in rest.iter().zip(join_all(reads).await) {
                answers[at] = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or(Err(ReadError::Unavailable)))
            .collect()
    }

    // Never back in time (floor.rs).

    /// The change feed has applied every change up to WAL position
    /// `position` to Redis and this process's memory tier (0: no position is
    /// known any more): the floors it passes lapse.
    pub fn feed_position(&self, position: u64) {
        self.ctx.floors.advance(position);
    }

    /// `answer` was served for `key` past the cache (a read that asked for
    /// a position or a staleness bound): nothing older is served here from
    /// now on.
    fn served_past(&self, key: &S::Key, answer: &Answer) {
        if self.ctx.floors.raise(key, answer.entry(), true) {
            self.ctx.memory.keep_only(key, answer.entry().etag());
        }
    }

    /// A change to `key`, committed at or before WAL position `change`, is
    /// on the Redis primary but not acknowledged by a replica: nothing
    /// looked up in Redis is served for it until the feed's position passes
    /// `change` (a failover may give back the entry it invalidated), only
    /// what this process loads from now on (see floor.rs, `pin`).
    pub fn pin_changed(&self, key: &S::Key, change: u64) {
        self.ctx.floors.pin(key, change);
    }

    // Changes applied (apply.rs): what the change feed and `invalidate` call.

    /// Applies change `change` (an increasing id) to `key`; false when it
    /// was applied already.
    pub async fn invalidate(
        &self,
        key: &S::Key,
        change: i64,
        kind: ChangeKind,
    ) -> Result<bool, RedisError> {
        let applied = apply::apply_change(
            &self.ctx.redis,
            &self.ctx.keys,
            &self.ctx.settings,
            key,
            (change, None),
            kind,
        )
        .await;
        // After Redis (see memory.rs), whether this process applied the
        // change, another did, or Redis failed; and a flight of the key
        // that may have read before it is detached (see `forget`).
        self.ctx.memory.evict(key);
        self.flights.detach(key);
        // A change may be an insert; a deletion leaves the guard as it is
        // (see existence.rs).
        if let (Some(ordinal), ChangeKind::Changed | ChangeKind::Recreated) =
            (S::ordinal(key), kind)
        {
            self.existence.admit(ordinal);
        }
        applied
    }

    /// Applies change `change` to `key` in Redis only (the change feed's
    /// decoder: every instance's memory tier forgets the item when it reads
    /// the change from the fleet's stream); false when it was applied
    /// already. `change` is the commit LSN: the key is fenced whether or not
    /// anything is cached (see `store/replicas.rs`).
    pub async fn invalidate_in_redis(
        &self,
        key: &S::Key,
        change: i64,
        kind: ChangeKind,
    ) -> Result<bool, RedisError> {
        let changes = [(key, change, kind)];
        let applied = apply::fenced(
            &self.ctx.redis,
            &self.ctx.keys,
            &self.ctx.settings,
            &changes,
        );
        Ok(applied.await? == 1)
    }

    /// Applies several changes to Redis in one round trip where Redis allows
    /// it (a single server; see [`RedisCommands::applies_together`]); the
    /// decoder's, fenced as [`ReadPath::invalidate_in_redis`].
    pub async fn invalidate_many_in_redis(
        &self,
        changes: &[(S::Key, i64, ChangeKind)],
    ) -> Result<u64, RedisError> {
        let changes: Vec<_> = changes
            .iter()
            .map(|(key, change, kind)| (key, *change, *kind))
            .collect();
        apply::fenced(
            &self.ctx.redis,
            &self.ctx.keys,
            &self.ctx.settings,
            &changes,
        )
        .await
    }

    /// This process's memory tier forgets `key` (Redis has its change),
    /// and the existence guard admits it (the change may be its insert).
    ///
    /// A flight of the key still running here is detached (see local.rs):
    /// it may have read before the change, and a request that comes after
    /// the change was heard of must not get its answer (a read asking for
    /// a position relies on it).
    pub fn forget(&self, key: &S::Key) {
        self.ctx.memory.evict(key);
        self.flights.detach(key);
        if let Some(ordinal) = S::ordinal(key) {
            self.existence.admit(ordinal);
        }
    }

    /// As [`ReadPath::forget`], for an item deleted: the existence guard
    /// keeps it (the news may come after the item was inserted again and
    /// served here: see existence.rs).
    pub fn forget_deleted(&self, key: &S::Key) {
        self.ctx.memory.evict(key);
        self.flights.detach(key);
    }

    /// Every item changed at `since`, the cutoff raised to `cutoff` for it
    /// (see [`Source::all_changed`]); the decoder's instance tells it before
    /// it raises the cutoff.
    pub fn all_changed(&self, since: Since, cutoff: u64) -> Option<Vec<S::Key>> {
        self.ctx.loader.source().all_changed(since, cutoff)
    }

    /// This process's memory tier forgets everything, and the existence
    /// guard stands aside until built again.
    pub fn forget_all(&self) {
        self.ctx.memory.clear();
        self.flights.detach_all();
        self.existence.stand_aside();
    }

    /// The cutoff in force in this process, unix milliseconds (0: none).
    pub fn cutoff(&self) -> u64 {
        self.ctx.cutoff()
    }

    /// Invalidates everything read before now, for change `change`: the
    /// fleet's cutoff in Redis is raised to now (by this process's clock),
    /// unless that change raised it already, and this process's follows.
    /// Returns the cutoff in force.
    pub async fn invalidate_all(&self, change: i64) -> Result<u64, RedisError> {
        let cutoff = apply::raise_cutoff(&self.ctx.redis, &self.ctx.keys, change).await;
        self.ctx.memory.clear();
        self.existence.stand_aside();
        let cutoff = cutoff?;
        self.ctx.raise_cutoff(cutoff);
        Ok(cutoff)
    }

    /// Invalidates everything read before now, for no change in
    /// particular (a gap in the feed, or a doubt): the fleet's cutoff in
    /// Redis is raised to now, and this process's follows and forgets.
    /// Returns the cutoff in force.
    pub async fn invalidate_all_now(&self) -> Result<u64, RedisError> {
        let cutoff = apply::raise_cutoff_now(&self.ctx.redis, &self.ctx.keys).await;
        self.forget_all();
        let cutoff = cutoff?;
        self.ctx.raise_cutoff(cutoff);
        Ok(cutoff)
    }

    /// Takes the fleet's cutoff from Redis (another instance or the
    /// `invalidate --all` command may have raised it). Returns it.
    /// Raises this process's cutoff to `cutoff` (unix ms) if it is higher,
    /// without asking Redis: the cutoff a change to every post carries.
    pub fn raise_cutoff_to(&self, cutoff: u64) -> u64 {
        self.ctx.raise_cutoff(cutoff)
    }

    pub async fn follow_cutoff(&self) -> Result<u64, RedisError> {
        let cutoff = self.ctx.redis.cutoff(&self.ctx.keys.cutoff()).await?;
        Ok(self.ctx.raise_cutoff(cutoff))
    }

    /// The fleet-wide read (strategies `pubsub` and `poll`): look up, judge,
    /// and on a miss hand off to this process's flight for the key.
    async fn get(self: &Arc<Self>, key: S::Key) -> Result<Answer, ReadError> {
        let span = tracing::Span::current();
        let now = now_millis();
        if let Some(answer) = self.from_memory(&key, now) {
            span.record("role", "memory_hit");
            return answer;
        }
        self.get_from_redis(key, now).await
    }

    /// The rest of [`ReadPath::get`]: Redis, then this process's flight.
    ///
    /// What it awaits is boxed, so that its own future stays small: a request
    /// waiting for a flight keeps it (inside its request's future) for the
    /// whole wait, while the GET's future (about 500 bytes) is freed as soon
    /// as the GET is answered.
    ///
    /// The first look claims the item if nobody has stored it (one command
    /// for the miss and its election: see [`first_look::look_up_or_claim`]),
    /// except for an item this process has seen stored lately (a hit is
    /// likely, and plain lookups are batched into one `MGET`: warm.rs),
    /// where loads may read a replica (their leader reads the change fence
    /// with its claim, which a lookup has no use for), and where the
    /// existence guard says the item cannot exist (its miss is answered
    /// without a load: a claim would only be let go again).
    async fn get_from_redis(self: &Arc<Self>, key: S::Key, now: u64) -> Result<Answer, ReadError> {
        let grace = self.ctx.settings.stale_while_revalidate;
        let ticket = self.ctx.memory.ticket(&key);
        let looked_at = self.ctx.floors.position();
        let warm = self.warm.holds(&key);
        let plain = warm || self.ctx.loader.source().reads_copies() || self.known_missing(&key);
        let (verdict, looked, won) = if plain {
            let (verdict, looked) = Box::pin(
                self.look_up(&key, now, grace)
                    .instrument(tracing::debug_span!("first_look", claims = false)),
            )
            .await;
            if warm && looked.absent {
                self.warm.forget(&key);
            }
            (verdict, looked, None)
        } else {
            Box::pin(
                self.look_up_or_claim(&key, now, grace)
                    .instrument(tracing::debug_span!("first_look", claims = true)),
            )
            .await
        };
        let look = LookOutcome {
            now,
            looked_at,
            verdict,
            looked,
            ticket,
            won,
        };
        self.after_look_up(key, look).await
    }

    /// The first look that claims (see [`ReadPath::get_from_redis`]), its
    /// verdict, and the claim when won.
    async fn look_up_or_claim(
        self: &Arc<Self>,
        key: &S::Key,
        now: u64,
        grace: Duration,
    ) -> (Verdict, Looked, Option<Box<Won<S>>>) {
        let keys = self.ctx.keys.item(key);
        match first_look::look_up_or_claim(&self.ctx, key, &keys).await {
            Ok((_, Some(won))) => {
                let looked = Looked {
                    redis_up: true,
                    absent: true,
                };
                (Verdict::Miss, looked, Some(won))
            }
            Ok((entry, None)) => {
                let (verdict, looked) = self.judge_look_up(Ok(entry), now, grace);
                (verdict, looked, None)
            }
            Err(error) => {
                let (verdict, looked) = self.judge_look_up(Err(error), now, grace);
                (verdict, looked, None)
            }
        }
    }

    /// What follows the first look in Redis: serve it, or this process's
    /// flight. The memory tier keeps nothing older than what is served (see
    /// memory.rs), and a post served found is known to the existence guard
    /// (see existence.rs).
    async fn after_look_up(
        self: &Arc<Self>,
        key: S::Key,
        look: LookOutcome<S>,
    ) -> Result<Answer, ReadError> {
        let answer = self.answer_after_look_up(key.clone(), look).await;
        if let Ok(answer) = &answer {
            // What this process serves from now on is no older.
            let forced = matches!(answer.served, Served::Bypass | Served::TooLarge);
            if self.ctx.floors.raise(&key, answer.entry(), forced) {
                self.ctx.memory.keep_only(&key, answer.entry().etag());
            }
            // What this process serves from now on is no older.
            self.ctx.memory.supersede(&key, answer.entry());
            if matches!(
                answer.served,
                Served::Hit
                    | Served::Stale
                    | Served::Miss
                    | Served::CoalescedLocal
                    | Served::CoalescedRemote
            ) {
                self.warm.mark(&key);
            }
            if let Some(ordinal) = S::ordinal(&key) {
                if answer.entry().status() == crate::cache::Status::Found {
                    self.existence.seen_found(ordinal);
                }
            }
        }
        answer
    }

    /// Whether `answer` may be served for `key`, looked up at feed position
    /// `looked_at`: never older than this process served (floor.rs), a
    /// stale copy no more than a fresh one.
    fn admitted(&self, key: &S::Key, answer: &Answer, looked_at: u64) -> bool {
        if answer.served == Served::Stale {
            self.ctx.floors.admits_stale(key, answer.entry())
        } else {
            self.ctx.floors.admits(key, answer.entry(), looked_at)
        }
    }

    async fn answer_after_look_up(
        self: &Arc<Self>,
        key: S::Key,
        look: LookOutcome<S>,
    ) -> Result<Answer, ReadError> {
        let LookOutcome {
            now,
            looked_at,
            verdict,
            looked,
            ticket,
            won,
        } = look;
        let span = tracing::Span::current();
        // What was found is older than a version this process served
        // (floor.rs): a miss, loaded from the primary by this process's
        // flight for the key instead.
        let mut below_floor = false;
        match verdict {
            Verdict::Fresh(entry) if self.ctx.floors.admits(&key, &entry, looked_at) => {
                span.record("role", "hit");
                // A flight of this key still running read before this
                // (see local.rs): later requests must not get its answer.
                self.flights.detach(&key);
                self.ctx.fill_memory(&key, &entry, &ticket);
                self.refreshes.maybe_early(&self.ctx, &key, &entry, now);
                return Answer::new(entry, Served::Hit);
            }
            Verdict::Fresh(_) => {
                metrics::floor_miss();
                below_floor = true;
            }
            // A stale copy older than what this process served is a miss
            // as well.
            Verdict::Backoff(entry) | Verdict::StaleInGrace(entry)
                if !self.ctx.floors.admits_stale(&key, &entry) =>
            {
                metrics::floor_miss();
                below_floor = true;
            }
            Verdict::Backoff(entry) => {
                span.record("role", "fail_safe");
                return Answer::new(entry, Served::Stale);
            }
            Verdict::StaleInGrace(entry) => {
                span.record("role", "stale_while_revalidate");
                self.refreshes
                    .start(&self.ctx, key, Some(entry.stored_at()));
                return Answer::new(entry, Served::Stale);
            }
            Verdict::Failed => {
                span.record("role", "failure_backoff");
                return Err(ReadError::Unavailable);
            }
            Verdict::TooLarge => {
                // Hit-for-pass: one load per key in this process, no lock.
                return Box::pin(self.in_flight(key, |this, key| async move {
                    this.ctx.loader.pass(&key).await
                }))
                .await;
            }
            Verdict::Miss => {
                // Checked here, past the look in Redis, so that hits pay
                // nothing for it.
                match self.known_missing_answer(&key) {
                    Some(Ok(answer))
                        if !self.ctx.floors.admits(&key, answer.entry(), looked_at) =>
                    {
                        metrics::floor_miss();
                        below_floor = true;
                    }
                    Some(answer) => {
                        span.record("role", "guard");
                        return answer;
                    }
                    None => {}
                }
            }
        }
        // Boxed: a hit in Redis never makes it.
        Box::pin(self.in_flight(key, move |this, key| async move {
            // The claim this request's first look won, if it did: the
            // flight's election takes it (won.rs). Dropped untaken (this
            // request joined a flight already running, or the flight ends
            // without electing), it is let go.
            let _won = won;
            if !looked.redis_up || below_floor {
                return this.ctx.loader.bypass(&key).await;
            }
            // Taken before anything of the flight is read (see memory.rs).
            let ticket = this.ctx.memory.ticket(&key);
            let outcome = Coordinator::new(&this.ctx, &key, looked.absent).run().await;
            if let Ok(answer) = &outcome {
                // Older than what this process served since the flight
                // began (a late message, a leader that read before the
                // floor): loaded from the primary instead.
                if !this.admitted(&key, answer, looked_at) {
                    metrics::floor_miss();
                    return this.ctx.loader.bypass(&key).await;
                }
                this.ctx.keep_in_memory(&key, answer, &ticket);
            }
            outcome
        }))
        .await
    }

    /// A fresh answer from the memory tier, without awaiting anything: the
    /// HTTP layer answers it before routing. `None` for anything else (the
    /// full read then runs as usual).
    ///
    /// With the position it is known fresh at (`PostCache-LSN`): the feed's
    /// at `started`, read before the tier (every change up to it was
    /// applied there).
    pub fn memory_hit(
        self: &Arc<Self>,
        key: &S::Key,
        started: Instant,
        now: u64,
    ) -> Option<(Answer, Option<u64>)> {
        // Off (0 bytes) for the strategies that bypass it.
        if !self.ctx.memory.is_on() {
            return None;
        }
        let at = self.asks.feed.position_at(started);
        Some((self.from_memory(key, now)?.ok()?, at))
    }

    /// A fresh entry of the memory tier (an early refresh started as for a
    /// hit in Redis: the tier keeps no entry past its freshness).
    fn from_memory(self: &Arc<Self>, key: &S::Key, now: u64) -> Option<Result<Answer, ReadError>> {
        let entry = self.ctx.memory.get(key, S::ordinal(key), now)?;
        match judge(Some(entry), now, Duration::ZERO, self.ctx.cutoff()) {
            Verdict::Fresh(entry) => {
                self.refreshes.maybe_early(&self.ctx, key, &entry, now);
                Some(Answer::new(entry, Served::Memory))
            }
            // Read before a cutoff raised since.
            _ => None,
        }
    }

    /// The first GET and its verdict, with what it says of Redis and the key.
    async fn look_up(&self, key: &S::Key, now: u64, grace: Duration) -> (Verdict, Looked) {
        let looked = self.ctx.redis.lookup(&self.ctx.keys.value(key)).await;
        self.judge_look_up(looked, now, grace)
    }

    /// A first look's verdict (see [`ReadPath::look_up`]).
    fn judge_look_up(
        &self,
        looked: Result<Option<crate::cache::Entry>, RedisError>,
        now: u64,
        grace: Duration,
    ) -> (Verdict, Looked) {
        let (redis_up, absent) = (true, true);
        match looked {
            Ok(entry) => {
                let absent = entry.is_none();
                let verdict = self.ctx.judge(entry, now, grace);
                (verdict, Looked { redis_up, absent })
            }
            // Redis known down: straight to the source (still one load per
            // key in this process, through the flight).
            Err(error @ RedisError::CircuitOpen) => {
                tracing::debug!(%error, "failing open");
                let redis_up = false;
                (Verdict::Miss, Looked { redis_up, absent })
            }
            // One failed GET does not prove Redis down: the flight still tries
            // the lock, and fails open if that fails too (by then the breaker
            // counts the failures and opens).
            Err(error) => {
                tracing::warn!(%error, "redis lookup failed");
                (Verdict::Miss, Looked { redis_up, absent })
            }
        }
    }

    /// Runs `fly` once per key in this process: the first caller owns the
    /// flight, later ones join it and share its outcome (local.rs).
    async fn in_flight<F, Fut>(self: &Arc<Self>, key: S::Key, fly: F) -> Result<Answer, ReadError>
    where
        F: FnOnce(Arc<Self>, S::Key) -> Fut,
        Fut: Future<Output = Outcome> + Send + 'static,
    {
        let patience = self.ctx.settings.wait_timeout;
        self.flights.answer(self, key, patience, fly).await
    }
}
