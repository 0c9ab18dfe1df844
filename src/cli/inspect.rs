//! Subcommands: `postcache inspect <id> [--json]`: what Redis holds for one
//! post, in words or as JSON, with the same settings (REDIS_URL, KEY_PREFIX)
//! as `serve`.
//!
//! It reads and never writes: the value (decoded: status, when stored, how
//! long fresh, how long its load took), shown as the value while reads are
//! served from it and as the fail-safe copy while it is a copy of the item
//! (the one key keeps both, see `cache/entry.rs`), the TTLs of the value
//! and of the lock (a leader's claim in the value key while it loads a post
//! nobody had stored), a short prefix of the lock holder's token
//! (enough to tell two holders apart in logs, not to steal the lock), the
//! item's change fence, the ready channel's subscribers (requests waiting
//! on another's load) and the fleet's cutoff (`invalidate --all`).

use std::fmt;

use anyhow::Context;
use serde::Serialize;
use time::{format_description::well_known::Rfc3339, OffsetDateTime};

use crate::{
    cache::{now_millis, Entry, Keys, Status},
    config::InspectArgs,
    redis::{snapshot, ItemSnapshot},
};

/// Characters of the lock holder's token shown (its tokens are 32 hex
/// characters: 8 tell holders apart).
const TOKEN_PREFIX_LEN: usize = 8;

/// What Redis holds for one post.
#[derive(Debug, Clone, Serialize)]
pub struct Inspection {
    pub id: i64,
    /// The status of the value's entry, the one reads are served from
    /// (`absent` when the key only keeps the fail-safe copy).
    pub status: EntryStatus,
    /// When this was read (RFC 3339); ages are counted from it.
    pub inspected_at: String,
    /// The value key, its entry shown while reads are served from it: not
    /// invalidated by a change, not a backoff copy past its backoff.
    pub value: Stored,
    /// The fail-safe copy: the last good entry (found, or a deleted post's
    /// tombstone), kept MAX_STALE past freshness for when loads fail. The
    /// same key as the value.
    pub fail_safe: Stored,
    pub lock: Lock,
    pub fence: Fence,
    pub ready_channel: Channel,
    /// Every entry whose load began before this (RFC 3339) is stale
    /// (`invalidate --all`, a truncate); null when there is none.
    pub cutoff: Option<String>,
}

/// The status of an entry, or why there is none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryStatus {
    /// The post, as loaded.
    Found,
    /// The post does not exist (negative caching).
    NotFound,
    /// The last load failed (a failure marker, FAILURE_TTL long).
    Failed,
    /// A stale copy re-served while loads fail, without refreshes.
    Backoff,
    /// The post is over MAX_ENTRY_BYTES: a marker without its body, so that
    /// every read loads it from PostgreSQL at once (never cached).
    TooLarge,
    /// No entry.
    Absent,
    /// Bytes that are not an entry (read as a miss, overwritten by the next
    /// store).
    Undecodable,
}

/// A key holding an entry.
#[derive(Debug, Clone, Serialize)]
pub struct Stored {
    pub key: String,
    /// Its PTTL in milliseconds; null when absent or without expiry.
    pub ttl_ms: Option<u64>,
    /// The decoded entry; null when absent or undecodable.
    pub entry: Option<EntryView>,
}

/// A decoded entry, its times as RFC 3339 and as ages.
#[derive(Debug, Clone, Serialize)]
pub struct EntryView {
    pub status: EntryStatus,
    pub stored_at: String,
    /// Since it was stored.
    pub age_ms: u64,
    pub fresh_until: String,
    /// Freshness left; negative: stale for that long.
    pub fresh_for_ms: i64,
    /// How long the load that produced it took.
    pub load_ms: f64,
    pub body_bytes: usize,
    /// The response's ETag (found entries only).
    pub etag: Option<String>,
    /// Its load began before the cutoff: it is served as stale at most.
    pub before_cutoff: bool,
    /// A change was applied after its load: kept only as the fail-safe copy.
    pub invalidated: bool,
    /// A backoff copy's end of backoff (RFC 3339); null otherwise.
    pub backoff_until: Option<String>,
}

/// The leader lock.
#[derive(Debug, Clone, Serialize)]
pub struct Lock {
    pub key: String,
    pub held: bool,
    pub ttl_ms: Option<u64>,
    /// The first characters of the holder's token.
    pub holder: Option<String>,
}

/// The item's change fence: the last change applied to it, kept a while so
/// that a leader that read the row before the change stores nothing.
#[derive(Debug, Clone, Serialize)]
pub struct Fence {
    pub key: String,
    pub change: Option<String>,
    pub ttl_ms: Option<u64>,
}

/// The ready channel.
#[derive(Debug, Clone, Serialize)]
pub struct Channel {
    pub name: String,
    /// Connections subscribed to it (each instance's shared subscriber
    /// subscribes once for all its waiters of this post).
    pub subscribers: i64,
}

pub async fn run(args: &InspectArgs) -> anyhow::Result<Inspection> {
    args.cache.validate()?;
    let redis = crate::redis::connect_commands(
        &args.cache.redis_url,
        args.cache.redis_timeout,
        args.cache.redis_tcp(),
    )
    .await?;
    let keys = Keys::new(args.cache.key_prefix.clone(), "post");
    let item = keys.item(args.id);
    let snapshot = snapshot(&redis, &item)
        .await
        .context("failed to read the post's keys from Redis")?;
    let cutoff = redis
        .cutoff(&keys.cutoff())
        .await
        .context("failed to read the cutoff from Redis")?;
    Ok(Inspection::new(
        args.id,
        &keys,
        snapshot,
        cutoff,
        now_millis(),
    ))
}

impl Inspection {
    /// What `snapshot` shows, as of `now` (unix ms).
    pub fn new(id: i64, keys: &Keys, snapshot: ItemSnapshot, cutoff: u64, now: u64) -> Self {
        let item = keys.item(id);
        let entry = snapshot.value.and_then(|raw| Entry::decode(raw).ok());
        let ttl_ms = ttl(snapshot.value_ttl);
        let served = entry.as_ref().filter(|e| {
            let backoff_over = e.is_backoff() && now >= e.backoff_until();
            !(e.is_invalidated() || backoff_over)
        });
        let copy = entry
            .as_ref()
            .filter(|e| matches!(e.status(), Status::Found | Status::NotFound));
        let value = Stored {
            key: item.value.clone(),
            ttl_ms,
            entry: served.map(|e| EntryView::new(e, cutoff, now)),
        };
        let status = match (
            &value.entry,
            &entry,
            ttl_ms.is_some() || snapshot.value_ttl == -1,
        ) {
            (Some(view), ..) => view.status,
            (None, Some(_), _) => EntryStatus::Absent,
            (None, None, true) => EntryStatus::Undecodable,
            (None, None, false) => EntryStatus::Absent,
        };
        let lock = snapshot.lock;
        let lock_key = if snapshot.lock_in_value {
            item.value.clone()
        } else {
            item.lock
        };
        Self {
            id,
            status,
            inspected_at: rfc3339(now),
            value,
            fail_safe: Stored {
                key: item.value,
                ttl_ms,
                entry: copy.map(|e| EntryView::new(e, cutoff, now)),
            },
            lock: Lock {
                key: lock_key,
                held: lock.is_some(),
                ttl_ms: ttl(snapshot.lock_ttl),
                holder: lock.map(|token| token.chars().take(TOKEN_PREFIX_LEN).collect()),
            },
            fence: Fence {
                key: item.fence,
                change: snapshot.fence,
                ttl_ms: ttl(snapshot.fence_ttl),
            },
            ready_channel: Channel {
                name: item.channel,
                subscribers: snapshot.subscribers,
            },
            cutoff: (cutoff > 0).then(|| rfc3339(cutoff)),
        }
    }
}

impl EntryView {
    fn new(entry: &Entry, cutoff: u64, now: u64) -> Self {
        let status = match entry.status() {
            _ if entry.is_backoff() => EntryStatus::Backoff,
            Status::Found => EntryStatus::Found,
            Status::NotFound => EntryStatus::NotFound,
            Status::Failed => EntryStatus::Failed,
            Status::TooLarge => EntryStatus::TooLarge,
        };
        let found = entry.status() == Status::Found;
        Self {
            status,
            stored_at: rfc3339(entry.stored_at()),
            age_ms: now.saturating_sub(entry.stored_at()),
            fresh_until: rfc3339(entry.fresh_until()),
            fresh_for_ms: entry.fresh_until() as i64 - now as i64,
            load_ms: entry.load_time().as_secs_f64() * 1000.0,
            body_bytes: entry.body().len(),
            etag: found.then(|| crate::http::etag(entry)),
            before_cutoff: entry.read_at() < cutoff,
            invalidated: entry.is_invalidated(),
            backoff_until: entry.is_backoff().then(|| rfc3339(entry.backoff_until())),
        }
    }
}

/// A PTTL reply as milliseconds left: `None` when absent (-2) or without
/// expiry (-1).
fn ttl(pttl: i64) -> Option<u64> {
    u64::try_from(pttl).ok()
}

fn rfc3339(unix_ms: u64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(unix_ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| format!("{unix_ms} (unix ms)"))
}

/// A duration in milliseconds for people: `850 ms`, `12.3 s`, `4 min 10 s`.
struct Millis(u64);

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            ms if ms < 1_000 => write!(f, "{ms} ms"),
            ms if ms < 60_000 => write!(f, "{:.1} s", ms as f64 / 1000.0),
            ms => write!(f, "{} min {} s", ms / 60_000, ms % 60_000 / 1000),
        }
    }
}

impl fmt::Display for EntryStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EntryStatus::Found => "found",
            EntryStatus::NotFound => "not found",
            EntryStatus::Failed => "failed (the last load failed)",
            EntryStatus::Backoff => "backoff copy (stale, re-served while loads fail)",
            EntryStatus::TooLarge => {
                "too large (over MAX_ENTRY_BYTES: read from PostgreSQL, never cached)"
            }
            EntryStatus::Absent => "absent",
            EntryStatus::Undecodable => "undecodable (read as a miss)",
        })
    }
}

fn expiry(ttl_ms: Option<u64>) -> String {
    match ttl_ms {
        Some(ms) => format!("expires in {}", Millis(ms)),
        None => "no expiry".to_string(),
    }
}

impl fmt::Display for Stored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(entry) = &self.entry else {
            return write!(f, "{}: none", self.key);
        };
        write!(f, "{}: {}", self.key, entry.status)?;
        if entry.body_bytes > 0 {
            write!(f, ", {} bytes", entry.body_bytes)?;
        }
        if let Some(etag) = &entry.etag {
            write!(f, ", ETag {etag}")?;
        }
        writeln!(f)?;
        write!(
            f,
            "    stored {} ago ({}), loaded in {:.1} ms",
            Millis(entry.age_ms),
            entry.stored_at,
            entry.load_ms
        )?;
        writeln!(f)?;
        let fresh = match u64::try_from(entry.fresh_for_ms) {
            Ok(left) => format!("fresh for {} more", Millis(left)),
            Err(_) => format!("stale for {}", Millis(entry.fresh_for_ms.unsigned_abs())),
        };
        write!(f, "    {fresh}; key {}", expiry(self.ttl_ms))?;
        if entry.before_cutoff {
            write!(f, "; loaded before the cutoff: stale")?;
        }
        if entry.invalidated {
            write!(f, "; invalidated by a change")?;
        }
        if let Some(until) = &entry.backoff_until {
            write!(f, "; backoff until {until}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Inspection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "post {}: {}", self.id, self.status)?;
        writeln!(f, "  value {}", self.value)?;
        writeln!(f, "  fail-safe copy {}", self.fail_safe)?;
        match &self.lock.holder {
            Some(holder) => writeln!(
                f,
                "  lock {}{}: held by {holder}…, {}",
                self.lock.key,
                if self.lock.key == self.value.key {
                    " (a claim in the value key)"
                } else {
                    ""
                },
                expiry(self.lock.ttl_ms)
            )?,
            None => writeln!(f, "  lock {}: free", self.lock.key)?,
        }
        match &self.fence.change {
            Some(change) => writeln!(
                f,
                "  fence {}: change {change}, {}",
                self.fence.key,
                expiry(self.fence.ttl_ms)
            )?,
            None => writeln!(f, "  fence {}: none", self.fence.key)?,
        }
        writeln!(
            f,
            "  ready channel {}: {} subscriber{}",
            self.ready_channel.name,
            self.ready_channel.subscribers,
            if self.ready_channel.subscribers == 1 {
                ""
            } else {
                "s"
            }
        )?;
        match &self.cutoff {
            Some(cutoff) => writeln!(f, "  cutoff: entries loaded before {cutoff} are stale"),
            None => writeln!(f, "  cutoff: none"),
        }
    }
}
