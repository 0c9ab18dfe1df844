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
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use fred::prelude::*;

use crate::{
    read_path::{ReadPath, Since},
    redis::{ChangeKind, RedisCommands, RedisError},
    store::PostStore,
};

/// How often the decoder appends a beat while it keeps up.
pub const BEAT_EVERY: Duration = Duration::from_millis(500);
/// A fleet whose last beat is older than this has no decoder keeping up.
pub const BEAT_STALE: Duration = Duration::from_secs(2);
/// Entries kept in the stream (about: trimmed with `~`). At two beats a
/// second, over an hour's worth when nothing changes.
const STREAM_MAX: u64 = 10_000;
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
    /// them). An entry without the field reads as no deletes.
    Posts {
        lsn: u64,
        ids: Vec<i64>,
        deleted: Vec<i64>,
    },
    /// Every post (a TRUNCATE, a transaction past the bound, a gap): the
    /// cutoff was raised to `cutoff` (unix ms; 0 in an entry without the
    /// field), for the change at `lsn` (0: not known).
    All { lsn: u64, cutoff: u64 },
    /// The decoder keeps up: it has applied everything to `lsn`, and the
    /// server's WAL is `behind` bytes further.
    Beat { lsn: u64, behind: u64 },
}

impl Entry {
    fn fields(&self) -> Vec<(&'static str, String)> {
        match self {
            Entry::Posts { lsn, ids, deleted } => {
                let list =
                    |ids: &[i64]| ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
                let mut fields = vec![("lsn", lsn.to_string()), ("ids", list(ids))];
                if !deleted.is_empty() {
                    fields.push(("deleted", list(deleted)));
                }
                fields
            }
            Entry::All { lsn, cutoff } => vec![
                ("lsn", lsn.to_string()),
                ("all", "1".into()),
                ("cutoff", cutoff.to_string()),
            ],
            Entry::Beat { lsn, behind } => {
                vec![("lsn", lsn.to_string()), ("beat", behind.to_string())]
            }
        }
    }

    /// An entry as read back; `None` for one that does not read as an entry
    /// (written by something else): the reader then forgets everything.
    fn parse(fields: &HashMap<String, String>) -> Option<Self> {
        let lsn = fields.get("lsn")?.parse().ok()?;
        if let Some(behind) = fields.get("beat") {
            return Some(Entry::Beat {
                lsn,
                behind: behind.parse().ok()?,
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
        Some(Entry::Posts { lsn, ids, deleted })
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

/// What the instance knows of the decoder, from the stream.
#[derive(Debug, Default)]
pub struct Beats {
    last: Mutex<Option<(Instant, u64)>>,
}

impl Beats {
    /// Forgets the beats read so far: after a reconnect, the feed is up
    /// again only once a beat comes that was appended after everything the
    /// stream lost meanwhile was applied.
    fn forget(&self) {
        let mut last = self.last.lock().unwrap();
        if let Some((_, behind)) = *last {
            // Stale, but the last lag known stays readable.
            *last = Instant::now()
                .checked_sub(BEAT_STALE)
                .map(|at| (at, behind));
        }
    }

    fn beat(&self, behind: u64) {
        *self.last.lock().unwrap() = Some((Instant::now(), behind));
    }

    /// When the last beat was read, and how far behind the server the
    /// decoder then was, in bytes.
    pub fn last(&self) -> Option<(Instant, u64)> {
        *self.last.lock().unwrap()
    }

    /// Whether a decoder keeps up: a beat within BEAT_STALE.
    pub fn fresh(&self) -> bool {
        self.last().is_some_and(|(at, _)| at.elapsed() < BEAT_STALE)
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
        loop {
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
                    tokio::time::sleep(backoff).await;
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
            self.beats.forget();
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
            *backoff = RETRY_FIRST;
            for (id, fields) in read.into_values().flatten() {
                self.take(Entry::parse(&fields)).await;
                *last = Some(id);
            }
        }
    }

    async fn take(&self, entry: Option<Entry>) {
        match entry {
            Some(Entry::Beat { behind, .. }) => self.beats.beat(behind),
            Some(Entry::Posts { ids, deleted, .. }) => {
                for id in ids {
                    if deleted.contains(&id) {
                        self.read_path.forget_deleted(&id);
                    } else {
                        self.read_path.forget(&id);
                    }
                }
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
    fn entries_read_back_as_written() {
        for entry in [
            Entry::Posts {
                lsn: 0x1_6B00_0000,
                ids: vec![1, 42, i64::MAX],
                deleted: vec![],
            },
            Entry::Posts {
                lsn: 0x1_6B00_0000,
                ids: vec![1, 42, i64::MAX],
                deleted: vec![42],
            },
            Entry::Posts {
                lsn: 7,
                ids: vec![],
                deleted: vec![],
            },
            Entry::All {
                lsn: 9,
                cutoff: 1_700_000_000_000,
            },
            Entry::Beat {
                lsn: 9,
                behind: 120,
            },
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
