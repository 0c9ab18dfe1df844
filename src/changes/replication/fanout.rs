//! The change feed: the fan-out of CHANGE_FEED=replication: the decoder
//! appends each transaction it has applied to Redis to one Redis Stream, and
//! every instance reads the stream from its last position to forget what its
//! memory tier holds of the posts changed.
//!
//! ```text
//!  decoder: apply to Redis ─► XADD P{post-changes}:stream  lsn, ids | all | beat
//!  every instance: XREAD BLOCK from its last id ─► forget ids (all: the cutoff)
//! ```
//!
//! Why a stream and not pub/sub: a message published while a subscriber's
//! connection is being remade is lost without a word, while a stream is
//! read on from the last id seen, each XREAD after the previous one. When a
//! read fails (Redis may have restarted or failed over, and lost entries),
//! the instance takes the stream from its end once it answers again,
//! forgetting its whole memory tier then, and says its feed is down until a
//! beat appended after that comes; meanwhile its memory tier serves while
//! the last beat is fresh.
//! Redis itself needs nothing from the stream: the decoder applied every
//! change there before appending it.
//!
//! The decoder also appends a beat every BEAT_EVERY while it keeps up,
//! with how far behind the server it is: an instance whose last beat is
//! older than BEAT_STALE says its feed is down (its memory tier stops
//! serving), and the standbys try to take the slot.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use fred::prelude::*;
use tokio::sync::Notify;

use crate::{
    read_path::{ReadPath, Since},
    redis::{ChangeKind, RedisCommands, RedisError},
    store::PostStore,
};

/// How often the decoder appends a beat while it keeps up. Its age bounds
/// how far behind the server an instance may be (`PostCache-Max-Staleness`).
pub const BEAT_EVERY: Duration = Duration::from_millis(100);
/// The soonest a beat follows the last when the decoder's position moved
/// without a change to posts (the server's keepalive after WAL of other
/// tables): reads waiting for a position past the last change hear of it
/// within this, not a BEAT_EVERY later. At most 50 such beats a second.
pub const POSITION_EVERY: Duration = Duration::from_millis(20);
/// A fleet whose last beat is older than this has no decoder keeping up.
pub const BEAT_STALE: Duration = Duration::from_secs(2);
/// Entries kept in the stream (about: trimmed with `~`): at the most beats
/// there are (BEAT_EVERY, and POSITION_EVERY while other tables are
/// written, 60 a second), over 25 minutes' worth, so that an instance
/// stopped for minutes still reads on from where it was. Entries are a few
/// tens of bytes: a few megabytes of Redis.
const STREAM_MAX: u64 = 100_000;
/// Longest one XREAD blocks.
const BLOCK: Duration = Duration::from_millis(1000);
/// Entries read per XREAD.
const READ_COUNT: u64 = 500;
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// Posts fenced per script after a change to every post (see
/// `Reader::fence_suspects`).
const FENCED_TOGETHER: usize = 256;

/// What one entry of the stream says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// These posts changed, in the transaction that committed at `lsn`;
    /// those of them in `deleted` were deleted (the existence guard drops
    /// them). An entry without the field reads as no deletes. `upto`, when
    /// not 0, says the decoder had then applied every change committed up
    /// to it (nothing waits for a retry): a read that asks for a position
    /// (`PostCache-Min-LSN`) is answered from the cache once its instance
    /// has read that far. Entries that are not the decoder's say 0.
    Posts {
        lsn: u64,
        ids: Vec<i64>,
        deleted: Vec<i64>,
        upto: u64,
    },
    /// Every post (a TRUNCATE, a transaction past the bound, a gap): the
    /// cutoff was raised to `cutoff` (unix ms; 0 in an entry without the
    /// field), for the change at `lsn` (0: not known).
    All { lsn: u64, cutoff: u64 },
    /// The decoder is alive: it has applied everything to `lsn`, and the
    /// primary's WAL was `behind` bytes further when it last looked (0:
    /// level, every commit visible `age_ms` before the beat applied; see
    /// `liveness.rs`). `session` names the decoder's session (0 in an entry
    /// without it).
    Beat {
        lsn: u64,
        behind: u64,
        age_ms: u64,
        session: u64,
    },
    /// The decoder of `session` gave up the slot (it could not vouch for its
    /// connection): its beats say nothing more, and the other instances
    /// take the slot without waiting for the beats to go stale.
    Stopped { session: u64 },
}

impl Entry {
    fn fields(&self) -> Vec<(&'static str, String)> {
        match self {
            Entry::Posts {
                lsn,
                ids,
                deleted,
                upto,
            } => {
                let list =
                    |ids: &[i64]| ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
                let mut fields = vec![("lsn", lsn.to_string()), ("ids", list(ids))];
                if !deleted.is_empty() {
                    fields.push(("deleted", list(deleted)));
                }
                if *upto != 0 {
                    fields.push(("upto", upto.to_string()));
                }
                fields
            }
            Entry::All { lsn, cutoff } => vec![
                ("lsn", lsn.to_string()),
                ("all", "1".into()),
                ("cutoff", cutoff.to_string()),
            ],
            Entry::Beat {
                lsn,
                behind,
                age_ms,
                session,
            } => {
                let mut fields = vec![("lsn", lsn.to_string()), ("beat", behind.to_string())];
                if *age_ms != 0 {
                    fields.push(("age", age_ms.to_string()));
                }
                if *session != 0 {
                    fields.push(("session", session.to_string()));
                }
                fields
            }
            Entry::Stopped { session } => {
                vec![("lsn", "0".into()), ("stopped", session.to_string())]
            }
        }
    }

    /// An entry as read back; `None` for one that does not read as an entry
    /// (written by something else): the reader then forgets everything.
    fn parse(fields: &HashMap<String, String>) -> Option<Self> {
        let lsn = fields.get("lsn")?.parse().ok()?;
        let number = |name: &str| -> Option<u64> {
            match fields.get(name) {
                Some(n) => n.parse().ok(),
                None => Some(0),
            }
        };
        if let Some(behind) = fields.get("beat") {
            return Some(Entry::Beat {
                lsn,
                behind: behind.parse().ok()?,
                age_ms: number("age")?,
                session: number("session")?,
            });
        }
        if let Some(session) = fields.get("stopped") {
            return Some(Entry::Stopped {
                session: session.parse().ok()?,
            });
        }
        if fields.contains_key("all") {
            let cutoff = match fields.get("cutoff") {
                Some(cutoff) => cutoff.parse().ok()?,
                None => 0,
            };
            return Some(Entry::All { lsn, cutoff });
        }
        let list = |ids: &str| -> Option<Vec<i64>> {
            if ids.is_empty() {
                return Some(Vec::new());
            }
            ids.split(',').map(|id| id.parse().ok()).collect()
        };
        let ids = list(fields.get("ids")?)?;
        let deleted = list(fields.get("deleted").map_or("", String::as_str))?;
        let upto = match fields.get("upto") {
            Some(upto) => upto.parse().ok()?,
            None => 0,
        };
        Some(Entry::Posts {
            lsn,
            ids,
            deleted,
            upto,
        })
    }
}

/// An entry as Redis returns it: its id and its fields.
type StreamEntry = (String, HashMap<String, String>);

/// Appends `entry` to the stream at `key`.
pub async fn append(redis: &RedisCommands, key: &str, entry: &Entry) -> Result<(), RedisError> {
    redis.stream_append(key, STREAM_MAX, entry.fields()).await
}

/// Entries looked at, newest first, for the last beat.
const BEAT_SEARCH: u64 = 200;

/// The position of the last beat in the stream at `key`: everything up to
/// it was applied to Redis and announced (a decoder beats only with
/// nothing waiting for Redis). `None` when none of the last entries is one.
pub async fn last_beat(redis: &RedisCommands, key: &str) -> Result<Option<u64>, RedisError> {
    let tail = redis.stream_tail(key, BEAT_SEARCH).await?;
    Ok(tail.iter().find_map(|fields| match Entry::parse(fields) {
        Some(Entry::Beat { lsn, .. }) => Some(lsn),
        _ => None,
    }))
}

/// What the instance knows of the decoder, from the stream: its last beat,
/// and how far it has applied the server's changes (its position), which
/// reads that ask for a position wait on.
#[derive(Debug)]
pub struct Beats {
    last: Mutex<Option<(Instant, u64)>>,
    /// What `beat_at` counts from.
    epoch: Instant,
    /// When the last beat was read: milliseconds from `epoch`, plus one (0:
    /// none since the stream was last taken up from its end). An atomic, so
    /// that a read asking for a position judges it without a lock.
    beat_at: AtomicU64,
    /// As `beat_at`, for the last beat that said the decoder was not behind
    /// the server at all.
    level_at: AtomicU64,
    /// Every change committed up to here (a WAL position, bytes from 0/0)
    /// was applied to Redis by the decoder and forgotten by this instance's
    /// memory tier before it was set.
    applied: AtomicU64,
    /// Woken whenever `applied` moves on.
    advanced: Notify,
    /// The session of the decoder whose beat was read last (0: none).
    session: AtomicU64,
    /// When a read of the stream last succeeded (as `beat_at`).
    read_at: AtomicU64,
    /// When the stream was last taken up from its end (as `beat_at`): the
    /// beats forgotten then say nothing of the decoder, whose next one is
    /// on its way.
    taken_up_at: AtomicU64,
}

impl Default for Beats {
    fn default() -> Self {
        Self {
            last: Mutex::new(None),
            epoch: Instant::now(),
            beat_at: AtomicU64::new(0),
            level_at: AtomicU64::new(0),
            applied: AtomicU64::new(0),
            advanced: Notify::new(),
            session: AtomicU64::new(0),
            read_at: AtomicU64::new(0),
            taken_up_at: AtomicU64::new(0),
        }
    }
}

impl Beats {
    /// Forgets the beats read so far: after a reconnect, the feed is up
    /// again only once a beat comes that was appended after everything the
    /// stream lost meanwhile was applied.
    fn forget(&self) {
        self.beat_at.store(0, Ordering::SeqCst);
        self.level_at.store(0, Ordering::SeqCst);
        // The next beat says the position again: a decoder's progress, on
        // whatever WAL timeline it reads now (a promoted standby's may be
        // behind this one).
        self.applied.store(0, Ordering::SeqCst);
        let mut last = self.last.lock().unwrap();
        if let Some((_, behind)) = *last {
            // Stale, but the last lag known stays readable.
            *last = Instant::now()
                .checked_sub(BEAT_STALE)
                .map(|at| (at, behind));
        }
    }

    /// The stream is taken up from its end (at start, or after a failed
    /// read): the beats are forgotten, and for BEAT_STALE they judge no
    /// decoder (see [`Beats::judge_decoder`]).
    fn taken_up(&self) {
        self.forget();
        let at = self.epoch.elapsed().as_millis() as u64 + 1;
        self.taken_up_at.store(at, Ordering::SeqCst);
    }

    /// Whether the beats may judge the decoder dead: not within BEAT_STALE
    /// of this instance's taking the stream up from its end, when no beat
    /// is fresh because it forgot them, not because none came (found: a
    /// standby whose stream connection was cut took the slot from a live
    /// decoder, ending its walsender, and a change waited 525 ms while the
    /// new one started). A decoder that said it stopped is judged at once.
    pub fn judge_decoder(&self) -> bool {
        self.judge_decoder_at(Instant::now())
    }

    fn judge_decoder_at(&self, now: Instant) -> bool {
        self.age_at(self.taken_up_at.load(Ordering::SeqCst), now)
            .is_none_or(|age| age >= BEAT_STALE)
    }

    fn beat(&self, lsn: u64, behind: u64, age_ms: u64, session: u64) {
        *self.last.lock().unwrap() = Some((Instant::now(), behind));
        self.session.store(session, Ordering::SeqCst);
        // A beat says the decoder's whole progress: it is the position,
        // even below the last one (a new decoder on a new timeline, a slot
        // made again), which only makes reads wait or go past the cache.
        self.applied.store(lsn, Ordering::SeqCst);
        let at = self.epoch.elapsed().as_millis() as u64 + 1;
        // Only a beat that says the decoder had applied every commit
        // visible when it last looked bounds the instance's staleness
        // (PostCache-Max-Staleness), from when it looked: the beat's age.
        if behind == 0 {
            let level = at.saturating_sub(age_ms).max(1);
            self.level_at.fetch_max(level, Ordering::SeqCst);
        }
        self.beat_at.store(at, Ordering::SeqCst);
        // Every beat wakes the waiting reads: also one that says a
        // position already held, after the feed came back.
        self.advanced.notify_waiters();
    }

    /// The decoder of `session` gave up the slot: if it is the one that
    /// beat last, the feed is down until a beat comes again.
    fn stopped(&self, session: u64) {
        if session != 0 && self.session.load(Ordering::SeqCst) == session {
            self.forget();
        }
    }

    /// A read of the stream succeeded now.
    fn read_now(&self) {
        let at = self.epoch.elapsed().as_millis() as u64 + 1;
        self.read_at.store(at, Ordering::SeqCst);
    }

    /// Whether this instance read the stream within `within`: its view of
    /// the beats is current (a standby that cannot read it must not judge
    /// the decoder by beats it does not see).
    pub fn stream_read_within(&self, within: Duration) -> bool {
        self.age(self.read_at.load(Ordering::SeqCst))
            .is_some_and(|age| age < within)
    }

    /// The position as read, fresh or not (0: none since the stream was
    /// last taken up): every change up to it was applied to Redis and
    /// forgotten here.
    fn applied(&self) -> u64 {
        self.applied.load(Ordering::SeqCst)
    }

    /// Everything committed up to `lsn` is applied here.
    fn advance(&self, lsn: u64) {
        if self.applied.fetch_max(lsn, Ordering::SeqCst) < lsn {
            self.advanced.notify_waiters();
        }
    }

    /// When the last beat was read, and how far behind the server the
    /// decoder then was, in bytes.
    pub fn last(&self) -> Option<(Instant, u64)> {
        *self.last.lock().unwrap()
    }

    /// Whether a decoder keeps up: a beat within BEAT_STALE.
    pub fn fresh(&self) -> bool {
        self.fresh_at(Instant::now())
    }

    /// [`Beats::fresh`], judged at `now`.
    fn fresh_at(&self, now: Instant) -> bool {
        self.age_at(self.beat_at.load(Ordering::SeqCst), now)
            .is_some_and(|age| age < BEAT_STALE)
    }

    /// How long ago the last beat was read (`None`: none since the stream
    /// was last taken up).
    pub fn since_beat(&self) -> Option<Duration> {
        self.age(self.beat_at.load(Ordering::SeqCst))
    }

    /// How long ago the last beat that said the decoder had applied all the
    /// server had sent was read, while beats come (`None`: none since the
    /// stream was last taken up, or the feed is down): a bound on how far
    /// behind the server this instance may be, as a decoder that keeps up
    /// beats every BEAT_EVERY.
    pub fn staleness(&self) -> Option<Duration> {
        if !self.fresh() {
            return None;
        }
        self.age(self.level_at.load(Ordering::SeqCst))
    }

    fn age(&self, at: u64) -> Option<Duration> {
        self.age_at(at, Instant::now())
    }

    /// How long before `now` the instant `at` (as `beat_at` counts) was.
    fn age_at(&self, at: u64, now: Instant) -> Option<Duration> {
        match at {
            0 => None,
            at => Some(Duration::from_millis(
                (now.saturating_duration_since(self.epoch).as_millis() as u64 + 1)
                    .saturating_sub(at),
            )),
        }
    }

    /// The position this instance has applied every change up to, while a
    /// decoder keeps up (`None` otherwise: in another mode, or with the
    /// feed down, nothing is known).
    pub fn position(&self) -> Option<u64> {
        self.position_at(Instant::now())
    }

    /// [`Beats::position`], judged at `now`: a request that has read the
    /// clock already spares a reading.
    pub fn position_at(&self, now: Instant) -> Option<u64> {
        let applied = self.applied.load(Ordering::SeqCst);
        (applied > 0 && self.fresh_at(now)).then_some(applied)
    }

    /// Waits until this instance has applied every change up to `lsn`, for
    /// at most `limit`, woken by the stream's reader (no polling): whether it
    /// has, with a decoder keeping up.
    pub async fn reached(&self, lsn: u64, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let advanced = self.advanced.notified();
            tokio::pin!(advanced);
            // Registered before the position is read: an advance between
            // the two still wakes it.
            advanced.as_mut().enable();
            if self.position().is_some_and(|at| at >= lsn) {
                return true;
            }
            if tokio::time::timeout_at(deadline, advanced).await.is_err() {
                return self.position().is_some_and(|at| at >= lsn);
            }
        }
    }
}

/// The feed's position as the read path asks it (see
/// `read_path/asked.rs`).
impl crate::read_path::FeedPosition for Beats {
    fn position_at(&self, now: Instant) -> Option<u64> {
        Beats::position_at(self, now)
    }

    fn staleness(&self) -> Option<Duration> {
        Beats::staleness(self)
    }

    fn reached(&self, lsn: u64, limit: Duration) -> futures::future::BoxFuture<'_, bool> {
        Box::pin(Beats::reached(self, lsn, limit))
    }
}

/// Reads the stream for one instance until aborted; `connected` says
/// whether a read has succeeded since it started.
pub(in crate::changes) struct Reader {
    pub read_path: Arc<ReadPath<PostStore>>,
    /// A connection of its own: XREAD BLOCK holds it.
    pub client: Client,
    pub key: String,
    pub timeout: Duration,
    pub beats: Arc<Beats>,
    pub connected: tokio::sync::watch::Sender<bool>,
}

impl Reader {
    pub async fn run(self) {
        let mut last: Option<String> = None;
        let mut backoff = RETRY_FIRST;
        // Its connection is made as the feed starts: a first read sent
        // before it is up would fail (reads are never sent twice).
        let limit = BLOCK + self.timeout;
        let _ = tokio::time::timeout(limit, self.client.wait_for_connect()).await;
        loop {
            // Listened to before the read: a reconnection while it fails
            // is heard.
            let mut reconnected = self.client.reconnect_rx();
            match self.follow(&mut last, &mut backoff).await {
                Ok(never) => match never {},
                Err(error) => {
                    if backoff == RETRY_FIRST {
                        tracing::warn!(
                            error = format!("{error:#}"),
                            "change stream unreadable; reading it again"
                        );
                    } else {
                        tracing::debug!(
                            error = format!("{error:#}"),
                            "change stream still unreadable"
                        );
                    }
                    // Entries may be lost meanwhile (a Redis restarted, a
                    // failover): read again from the stream's end, and
                    // forget the memory tier then (see `follow`). Until
                    // then the tier serves on for as long as the last beat
                    // is fresh (BEAT_STALE): a Redis blip costs it nothing,
                    // an outage no more than that of staleness, as a stalled
                    // decoder does. (A read whose connection dropped fails at
                    // once: it is never sent again on the next connection.)
                    // Redis may come back without its fences: loads read
                    // the primary from now (see `follow`).
                    if *self.connected.borrow() {
                        self.read_path.all_changed(Since::PRIMARY, u64::MAX);
                    }
                    last = None;
                    // Read again as the connection is made again, not a
                    // pause after it: each read sent before fails at once,
                    // and the pauses grow (100, 200, 400 ms) while the
                    // memory tier serves posts the stream says changed
                    // (tested: 358 ms after a proxy took connections again,
                    // 5 to 64 ms now). A read that failed on a standing
                    // connection waits out its pause.
                    let _ = tokio::time::timeout(backoff, reconnected.recv()).await;
                    backoff = (backoff * 2).min(RETRY_MAX);
                }
            }
        }
    }

    /// Reads the stream from `last` (its end when `None`) until a read
    /// fails; `backoff` is reset by every read that succeeds.
    async fn follow(
        &self,
        last: &mut Option<String>,
        backoff: &mut Duration,
    ) -> anyhow::Result<std::convert::Infallible> {
        let limit = BLOCK + self.timeout;
        // Past the client's own command timeout (REDIS_TIMEOUT); and a
        // command whose connection drops fails at once, never sent again
        // on the next one: Redis restarted or failed over may have lost
        // entries, and until this read fails the memory tier serves on,
        // unaware of the changes no decoder can apply meanwhile.
        let options = fred::types::config::Options {
            timeout: Some(limit),
            max_attempts: Some(1),
            fail_fast: true,
            ..Default::default()
        };
        let client = self.client.with_options(&options);
        if last.is_none() {
            // From the end: what came before is in Redis already, and this
            // process's memory tier holds nothing older than now.
            let tail: Vec<StreamEntry> =
                bounded(limit, client.xrevrange(&self.key, "+", "-", Some(1))).await?;
            *last = Some(
                tail.first()
                    .map_or_else(|| "0-0".to_owned(), |(id, _)| id.clone()),
            );
            // The entries before it are not read, and one may have raised
            // the cutoff (a truncate, a gap): the cutoff is read before any
            // beat vouches for a position past them (a raiser sets it before
            // it appends). Found: an instance resumed after a stop named a
            // truncate's position and served, from Redis, rows from before
            // it, judged by the cutoff before it, until the background read
            // of the cutoff, a second apart, caught up.
            self.read_path
                .follow_cutoff()
                .await
                .map_err(|error| anyhow::anyhow!("the fleet's cutoff: {error}"))?;
            self.beats.taken_up();
            // Redis may have lost what was applied: no position vouches.
            self.read_path.feed_position(0);
            // What the memory tier took in while the stream was not read.
            self.read_path.forget_all();
            if *self.connected.borrow() {
                // Read again after a failure: Redis may have lost its
                // fences with everything else (restarted empty, a failover
                // to a replica that had not them all). A key changed within
                // the fence's lifetime and loaded from a read replica that
                // has not replayed the change would be stored with nothing
                // to refuse it (`load/coherence` measured 20 s stale reads),
                // so from the failure until the fence's lifetime after this,
                // loads read the primary.
                self.read_path.all_changed(Since::PRIMARY, u64::MAX);
            }
        }
        loop {
            let after = last.clone().expect("set above");
            let read: Value = bounded(
                limit,
                client.xread(
                    Some(READ_COUNT),
                    Some(BLOCK.as_millis() as u64),
                    &self.key,
                    after.as_str(),
                ),
            )
            .await?;
            // Nil when the block ends with nothing new.
            let read: HashMap<String, Vec<StreamEntry>> = if read.is_null() {
                HashMap::new()
            } else {
                read.into_xread_response()?
            };
            self.connected.send_replace(true);
            self.beats.read_now();
            *backoff = RETRY_FIRST;
            for (id, fields) in read.into_values().flatten() {
                self.take(Entry::parse(&fields)).await;
                *last = Some(id);
            }
            // The floors (read_path/floor.rs) lapse as the position passes.
            self.read_path.feed_position(self.beats.applied());
        }
    }

    async fn take(&self, entry: Option<Entry>) {
        match entry {
            // Set once what it says is applied here (the memory tier has
            // forgotten what it names).
            Some(Entry::Beat {
                lsn,
                behind,
                age_ms,
                session,
            }) => self.beats.beat(lsn, behind, age_ms, session),
            Some(Entry::Stopped { session }) => self.beats.stopped(session),
            Some(Entry::Posts {
                lsn,
                ids,
                deleted,
                upto,
            }) => {
                // Not acknowledged by Redis's replicas yet (or something
                // waits for a retry): a failover may undo them.
                if upto == 0 {
                    for id in &ids {
                        self.read_path.pin_changed(id, lsn);
                    }
                }
                for id in ids {
                    if deleted.contains(&id) {
                        self.read_path.forget_deleted(&id);
                    } else {
                        self.read_path.forget(&id);
                    }
                }
                self.beats.advance(upto);
            }
            Some(Entry::All { .. }) | None => {
                if entry.is_none() {
                    tracing::warn!(key = self.key, "an entry of the change stream does not read as one; forgetting the memory tier");
                }
                // From now on loads from replicas must have replayed it.
                let (since, cutoff) = match entry {
                    Some(Entry::All { lsn, cutoff }) if lsn > 0 => (Since(lsn), cutoff),
                    Some(Entry::All { cutoff, .. }) => (Since::PRIMARY, cutoff),
                    _ => (Since::PRIMARY, 0),
                };
                let suspects = self.read_path.all_changed(since, cutoff);
                // The entry's own cutoff holds here at once, whether or not
                // Redis answers now: a read that asks for a position past
                // this change must not be served an entry read before it.
                self.read_path.raise_cutoff_to(cutoff);
                if let Err(error) = self.read_path.follow_cutoff().await {
                    tracing::debug!(%error, "could not read the cutoff");
                }
                self.read_path.forget_all();
                self.fence_suspects(suspects, since).await;
            }
        }
    }
}

impl Reader {
    /// Fences the keys this instance read from a replica behind a change to
    /// every post, between the cutoff and now (see `store/replica_floor.rs`), with
    /// that change, and tells the fleet's memory tiers; if they are not
    /// known (or cannot be fenced), raises the cutoff again.
    async fn fence_suspects(&self, suspects: Option<Vec<i64>>, since: Since) {
        let fenced = match suspects {
            Some(ids) if ids.is_empty() => return,
            Some(ids) => self.fence(&ids, since).await.map(|()| ids),
            None => Err(anyhow::anyhow!("the keys read from replicas are not known")),
        };
        match fenced {
            Ok(ids) => {
                tracing::info!(
                    posts = ids.len(),
                    lsn = since.0,
                    "fenced the posts read from a replica behind a change to every post"
                );
                let entry = Entry::Posts {
                    lsn: since.0,
                    ids,
                    deleted: Vec::new(),
                    upto: 0,
                };
                if let Err(error) = append(self.read_path.redis(), &self.key, &entry).await {
                    tracing::warn!(%error, "could not tell the fleet of the fenced posts");
                }
            }
            Err(error) => {
                tracing::warn!(
                    error = format!("{error:#}"),
                    "posts read from a replica behind a change to every post: raising the cutoff again"
                );
                if let Err(error) = self.read_path.invalidate_all_now().await {
                    tracing::warn!(%error, "could not raise the cutoff");
                }
            }
        }
    }

    async fn fence(&self, ids: &[i64], since: Since) -> anyhow::Result<()> {
        let change = i64::try_from(since.0)?;
        if self.read_path.redis().applies_together() {
            for chunk in ids.chunks(FENCED_TOGETHER) {
                let items: Vec<_> = chunk
                    .iter()
                    .map(|&id| (id, change, ChangeKind::Changed))
                    .collect();
                self.read_path.invalidate_many_in_redis(&items).await?;
            }
        } else {
            for &id in ids {
                self.read_path
                    .invalidate_in_redis(&id, change, ChangeKind::Changed)
                    .await?;
            }
        }
        Ok(())
    }
}

async fn bounded<T>(
    limit: Duration,
    command: impl std::future::Future<Output = Result<T, fred::error::Error>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, command).await {
        Ok(done) => Ok(done?),
        Err(_) => Err(anyhow::anyhow!("no answer within {limit:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_back(entry: &Entry) -> Option<Entry> {
        let fields = entry
            .fields()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        Entry::parse(&fields)
    }

    #[test]
    fn beats_forgotten_as_the_stream_is_taken_up_judge_no_decoder_for_beat_stale() {
        let beats = Beats::default();
        beats.taken_up();
        beats.beat(100, 0, 0, 7);
        let now = Instant::now();
        assert!(beats.fresh_at(now));
        assert!(beats.judge_decoder_at(now + BEAT_STALE));
        // Taken up again (a read failed): no beat is fresh, and none is
        // judged missing yet.
        beats.taken_up();
        let now = Instant::now();
        assert!(!beats.fresh_at(now));
        assert!(!beats.judge_decoder_at(now));
        assert!(!beats.judge_decoder_at(now + BEAT_STALE / 2));
        // BEAT_STALE on, with no beat read meanwhile: the decoder is late.
        assert!(beats.judge_decoder_at(now + BEAT_STALE + Duration::from_millis(2)));
        // A decoder that said it stopped is judged at once (the stream was
        // taken up long before).
        let beats = Beats::default();
        beats.beat(100, 0, 0, 7);
        beats.stopped(7);
        assert!(!beats.fresh());
        assert!(beats.judge_decoder());
    }

    #[test]
    fn entries_read_back_as_written() {
        for entry in [
            Entry::Posts {
                lsn: 0x1_6B00_0000,
                ids: vec![1, 42, i64::MAX],
                deleted: vec![],
                upto: 0,
            },
            Entry::Posts {
                lsn: 0x1_6B00_0000,
                ids: vec![1, 42, i64::MAX],
                deleted: vec![42],
                upto: 0x1_6B00_0000,
            },
            Entry::Posts {
                lsn: 7,
                ids: vec![],
                deleted: vec![],
                upto: 7,
            },
            Entry::All {
                lsn: 9,
                cutoff: 1_700_000_000_000,
            },
            Entry::Beat {
                lsn: 9,
                behind: 120,
                age_ms: 0,
                session: 0,
            },
            Entry::Beat {
                lsn: 9,
                behind: 0,
                age_ms: 35,
                session: 0xDEAD_BEEF,
            },
            Entry::Stopped { session: 7 },
        ] {
            assert_eq!(read_back(&entry), Some(entry));
        }
    }

    #[test]
    fn an_entry_not_ours_does_not_read() {
        let fields = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>()
        };
        assert_eq!(Entry::parse(&fields(&[("lsn", "1"), ("ids", "1,x")])), None);
        assert_eq!(Entry::parse(&fields(&[("ids", "1")])), None);
        assert_eq!(Entry::parse(&fields(&[("lsn", "1")])), None);
    }
}
