//! The Redis commands of the read path, each bounded by REDIS_TIMEOUT and
//! guarded by the circuit breaker of the node that serves the key
//! (`nodes.rs`).

use std::{
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use fred::{
    error::ErrorKind,
    prelude::*,
    types::{Expiration, SetOptions},
};
use tokio_util::task::AbortOnDropHandle;

use super::{
    breaker::{Breaker, State},
    freshness::StoreFor,
    nodes::{self, Nodes},
    scripts::{Scripts, RETRY},
};
use crate::{
    cache::{now_millis, Entry, ItemKeys},
    telemetry::metrics,
};

/// The first pause before a step of upkeep (a finish, a release, a script
/// load) is retried; it doubles up to the second.
pub(super) const RETRY_FIRST: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_millis(100);

/// Runs `attempt` until it succeeds or `give_up` has passed, pausing with
/// backoff in between; the last error if it never succeeded.
pub(super) async fn with_backoff<T, F, Fut>(
    give_up: Instant,
    mut attempt: F,
) -> Result<T, RedisError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, RedisError>>,
{
    let mut backoff = RETRY_FIRST;
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(error) if Instant::now() >= give_up => return Err(error),
            Err(_) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RETRY_MAX);
            }
        }
    }
}

/// Why a Redis step failed; every such failure makes the read fail open.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("redis command timed out after {0:?}")]
    Timeout(Duration),
    #[error("redis circuit breaker open")]
    CircuitOpen,
    #[error("redis command failed: {0}")]
    Command(#[from] fred::error::Error),
}

/// What PTTL says of a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockTtl {
    /// No such key: released or expired.
    Absent,
    /// The key has no expiry (set from outside the protocol).
    NoExpiry,
    /// It expires after this long.
    Expires(Duration),
}

/// What the leader's finish did.
#[derive(Debug)]
pub struct Finished {
    /// Whether the lock still held our token (and was deleted).
    pub released: bool,
    /// What was published: the entry, or on failure the backoff copy;
    /// `None` when fenced (a change was applied since the leader's read:
    /// nothing stored, [`RETRY`](super::scripts::RETRY) published).
    pub published: Option<Entry>,
}

/// What the leader sees before it reads: the stored entry, and the item's
/// change fence (empty when none), which its finish must find unchanged.
#[derive(Debug)]
pub struct Before {
    pub entry: Option<Entry>,
    pub fence: String,
}

/// How a change is applied to an item's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// The item is gone: tombstones in place of what is kept.
    Deleted,
    /// Anything else: what is stored is no longer to be trusted.
    Changed,
}

/// The lifetimes the application of a change writes with.
#[derive(Debug, Clone, Copy)]
pub struct ApplyFor {
    /// How long the fence outlives the change.
    pub fence: Duration,
    /// The tombstone as the value (NEGATIVE_TTL), and as the fail-safe copy
    /// (0: none).
    pub tombstone: Duration,
    pub tombstone_copy: Duration,
    /// The stale-while-revalidate window (0: off).
    pub grace: Duration,
}

/// What Redis holds under one item's names, read at once (`postcache
/// inspect`). TTLs are PTTL's replies: -2 absent, -1 no expiry.
#[derive(Debug, Clone, Default)]
pub struct ItemSnapshot {
    pub value: Option<Bytes>,
    pub value_ttl: i64,
    pub fail_safe: Option<Bytes>,
    pub fail_safe_ttl: i64,
    /// The lock holder's token.
    pub lock: Option<String>,
    pub lock_ttl: i64,
    /// The last change applied to the item, while its fence lives.
    pub fence: Option<String>,
    pub fence_ttl: i64,
    /// Subscribers of the ready channel on the node serving its slot.
    pub subscribers: i64,
}

/// The command clients plus the bound applied to each command.
#[derive(Clone)]
pub struct RedisCommands {
    /// Where each key's commands go (see `nodes.rs`).
    nodes: Arc<Nodes>,
    timeout: Duration,
    /// A Redis Cluster: publish with SPUBLISH (sharded pub/sub).
    sharded: bool,
    scripts: Scripts,
}

fn ms(d: Duration) -> i64 {
    if d.is_zero() {
        0
    } else {
        d.as_millis().max(1) as i64
    }
}

/// Whether a fred error says Redis cannot serve: unreachable, or an error
/// reply that means "not now" (loading, a read-only replica, a master down,
/// a busy script, a cluster down or mid-resharding). Other error replies
/// prove Redis up.
pub(super) fn is_outage(e: &fred::error::Error) -> bool {
    if is_redirect(e) {
        return false;
    }
    /// Error reply prefixes of a Redis that is up but not serving.
    const NOT_SERVING: [&str; 6] = [
        "LOADING",
        "READONLY",
        "MASTERDOWN",
        "BUSY",
        "CLUSTERDOWN",
        "TRYAGAIN",
    ];
    let unreachable = matches!(
        e.kind(),
        ErrorKind::IO
            | ErrorKind::Timeout
            | ErrorKind::Canceled
            | ErrorKind::Backpressure
            | ErrorKind::Tls
            | ErrorKind::Routing
            | ErrorKind::Cluster
    );
    let details = e.details().trim_start();
    unreachable || NOT_SERVING.iter().any(|p| details.starts_with(p))
}

/// A MOVED or ASK reply: the key's slot is served by another node (a
/// resharding, a failover), which proves this node up.
fn is_redirect(e: &fred::error::Error) -> bool {
    is_moved(e) || e.details().trim_start().starts_with("ASK ")
}

fn is_moved(e: &fred::error::Error) -> bool {
    e.details().trim_start().starts_with("MOVED ")
}

/// The `kind` label of a failed command in the metrics.
fn error_label(e: &fred::error::Error) -> &'static str {
    match e.kind() {
        // The client's own bound (the same REDIS_TIMEOUT) fired first.
        ErrorKind::Timeout => "timeout",
        _ if is_outage(e) => "connection",
        _ => "reply",
    }
}

impl RedisCommands {
    /// The commands of a single Redis.
    pub fn new(client: Client, timeout: Duration) -> Self {
        Self::with_nodes(Arc::new(Nodes::single(client)), timeout)
    }

    pub fn with_nodes(nodes: Arc<Nodes>, timeout: Duration) -> Self {
        Self {
            sharded: nodes.default_client().is_clustered(),
            nodes,
            timeout,
            scripts: Scripts::new(),
        }
    }

    /// Starts the connections' upkeep (see [`nodes::keep`]): the scripts
    /// loaded on every new connection and, on a cluster, the nodes following
    /// the topology while the returned handle lives.
    #[must_use = "dropping the handle stops following the cluster's topology"]
    pub fn upkeep(&self) -> Option<AbortOnDropHandle<()>> {
        nodes::keep(&self.nodes, self.scripts.clone(), self.timeout)
    }

    /// Whether every circuit breaker in use lets commands through.
    pub fn breaker_closed(&self) -> bool {
        self.nodes.state() == State::Closed
    }

    /// The state of the breaker of `key`'s node, as the metric shows it:
    /// 0 closed, 1 open, 2 half-open.
    pub fn breaker_state_of(&self, key: &str) -> u8 {
        self.nodes.for_key(key).breaker.state() as u8
    }

    /// Puts the breakers' state in the metrics (before they are rendered).
    pub fn report_breakers(&self) {
        self.nodes.report();
    }

    /// Runs `command` on the client of `key`'s node, under that node's
    /// breaker and REDIS_TIMEOUT (see [`RedisCommands::redirected`]).
    async fn bounded<T, Fut>(
        &self,
        key: &str,
        command: impl Fn(Client) -> Fut,
    ) -> Result<T, RedisError>
    where
        Fut: Future<Output = Result<T, fred::error::Error>>,
    {
        self.on_node(key, true, command).await
    }

    /// Runs one command of lock hygiene (finish, release, extend) on the
    /// client of `key`'s node, under REDIS_TIMEOUT but not the breaker: a
    /// leader must be able to finish and let go of its lock whatever other
    /// commands of this process met. The change feed's commands (applying
    /// a change, the cutoff, the stream) go this way too: the breaker
    /// guards the reads, and the feed's background work must neither take
    /// a read's half-open probe nor open the breaker for the reads.
    async fn unrefused<T, Fut>(
        &self,
        key: &str,
        command: impl Fn(Client) -> Fut,
    ) -> Result<T, RedisError>
    where
        Fut: Future<Output = Result<T, fred::error::Error>>,
    {
        self.on_node(key, false, command).await
    }

    async fn on_node<T, Fut>(
        &self,
        key: &str,
        refusable: bool,
        command: impl Fn(Client) -> Fut,
    ) -> Result<T, RedisError>
    where
        Fut: Future<Output = Result<T, fred::error::Error>>,
    {
        let node = self.nodes.for_key(key);
        // Boxed: the client library's command futures are large (a GET's is
        // 6.8 KB), and unboxed they would be copied into every future that
        // awaits them, level by level up to the request's (memmove was the
        // top user-space cost of a hit in Redis). One allocation instead.
        let sent = Box::pin(command(node.client.clone()));
        let result = if refusable {
            guarded(&node.breaker, self.timeout, sent).await
        } else {
            self.timed(sent).await
        };
        match result {
            // Boxed: rare, and it would double the size of every command's future.
            Err(RedisError::Command(e)) if is_moved(&e) => Box::pin(self.redirected(command)).await,
            result => result,
        }
    }

    /// A node answered MOVED: the key's slot is served elsewhere (a
    /// resharding, or a failover not seen yet). The topology is re-read in
    /// the background, and the command goes once more through the cluster
    /// client, which follows MOVED by itself. (An ASK, for a key already
    /// moved out of a slot being migrated, is not followed: the client
    /// library's ASK handling fails after several ASKINGs in version 10.1, so
    /// such a read fails open until the migration is done.)
    async fn redirected<T, Fut>(&self, command: impl Fn(Client) -> Fut) -> Result<T, RedisError>
    where
        Fut: Future<Output = Result<T, fred::error::Error>>,
    {
        self.nodes.moved();
        self.timed(command(self.nodes.default_client().clone()))
            .await
    }

    /// One command under REDIS_TIMEOUT, its failure counted.
    async fn timed<T>(
        &self,
        fut: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                metrics::redis_error(error_label(&e));
                Err(e.into())
            }
            Err(_) => {
                metrics::redis_error("timeout");
                Err(RedisError::Timeout(self.timeout))
            }
        }
    }

    /// GET a value key and decode it. Bytes that are not an entry count as
    /// absent: the next store overwrites them.
    pub async fn lookup(&self, key: &str) -> Result<Option<Entry>, RedisError> {
        let raw: Option<Bytes> = self
            .bounded(key, |c| async move { c.get(key).await })
            .await?;
        Ok(decoded(key, raw))
    }

    /// The leader's look before its read: the value and the item's fence,
    /// in one MGET (they share a slot).
    pub async fn before_load(&self, keys: &ItemKeys) -> Result<Before, RedisError> {
        let (value, fence) = (keys.value.as_str(), keys.fence.as_str());
        let (raw, seen): (Option<Bytes>, Option<String>) = self
            .bounded(value, |c| async move { c.mget(vec![value, fence]).await })
            .await?;
        Ok(Before {
            entry: decoded(value, raw),
            fence: seen.unwrap_or_default(),
        })
    }

    /// SET a value with a TTL (the strategies without a lock).
    pub async fn store(&self, key: &str, entry: &Entry, ttl: Duration) -> Result<(), RedisError> {
        let px = ms(ttl).max(1);
        self.bounded(key, |c| async move {
            let value = entry.raw().clone();
            c.set(key, value, Some(Expiration::PX(px)), None, false)
                .await
        })
        .await
    }

    /// `SET lock token NX PX ttl`: true when this caller now holds the lock.
    pub async fn try_lock(
        &self,
        key: &str,
        token: &str,
        ttl: Duration,
    ) -> Result<bool, RedisError> {
        let px = ms(ttl).max(1);
        let reply: Option<String> = self
            .bounded(key, |c| async move {
                let nx = Some(SetOptions::NX);
                c.set(key, token, Some(Expiration::PX(px)), nx, false).await
            })
            .await?;
        metrics::lock_election(reply.is_some());
        Ok(reply.is_some())
    }

    /// PTTL of a lock.
    pub async fn pttl(&self, key: &str) -> Result<LockTtl, RedisError> {
        let ms: i64 = self
            .bounded(key, |c| async move { c.pttl(key).await })
            .await?;
        Ok(match ms {
            -2 => LockTtl::Absent,
            ms if ms < 0 => LockTtl::NoExpiry,
            ms => LockTtl::Expires(Duration::from_millis(ms as u64)),
        })
    }

    /// The leader's finish (see `finish.lua` and `scripts.rs`): `fence` is
    /// what it saw before its read, `cutoff` the one in force.
    pub async fn finish(
        &self,
        keys: &ItemKeys,
        token: &str,
        entry: &Entry,
        store: StoreFor,
        fence: &str,
        cutoff: u64,
    ) -> Result<Finished, RedisError> {
        let args: Vec<Value> = vec![
            Value::Bytes(entry.raw().clone()),
            Value::Integer(ms(store.value)),
            Value::from(token),
            Value::from(keys.channel.as_str()),
            Value::Integer(ms(store.fail_safe)),
            Value::Integer(ms(store.failure)),
            Value::from(if self.sharded { "SPUBLISH" } else { "PUBLISH" }),
            Value::Integer(now_millis() as i64),
            Value::from(fence),
            Value::Integer(cutoff as i64),
            Value::Bytes(Bytes::from_static(RETRY)),
        ];
        let script_keys = [&keys.value, &keys.lock, &keys.fail_safe, &keys.fence];
        let (released, payload, fenced): (i64, Bytes, i64) = self
            .unrefused(&keys.value, |c| {
                let (script_keys, args) = (script_keys.map(String::as_str).to_vec(), args.clone());
                async move {
                    let finish = &self.scripts.finish;
                    finish.evalsha_with_reload(&c, script_keys, args).await
                }
            })
            .await?;
        let published =
            (fenced == 0).then(|| Entry::decode(payload).unwrap_or_else(|_| entry.clone()));
        Ok(Finished {
            released: released == 1,
            published,
        })
    }

    /// Applies change `change` to an item's keys (see `apply.lua`); whether
    /// it did anything (false: applied already). `tombstone` is the
    /// not-found entry a delete leaves.
    pub async fn apply(
        &self,
        keys: &ItemKeys,
        change: i64,
        kind: ChangeKind,
        tombstone: &Entry,
        lifetimes: ApplyFor,
    ) -> Result<bool, RedisError> {
        // One item's keys share a slot: the script of several runs anywhere.
        let applied = self
            .apply_many(&[(keys, change, kind)], tombstone, lifetimes)
            .await?;
        Ok(applied == 1)
    }

    /// Whether several items' changes can go in one script (a single Redis:
    /// on a cluster their keys are in different slots).
    pub fn applies_together(&self) -> bool {
        !self.sharded
    }

    /// [`RedisCommands::apply`] of several items in one round trip (see
    /// `apply_many_lua`); how many were applied. Several items only on a
    /// single Redis ([`RedisCommands::applies_together`]).
    pub async fn apply_many(
        &self,
        items: &[(&ItemKeys, i64, ChangeKind)],
        tombstone: &Entry,
        lifetimes: ApplyFor,
    ) -> Result<u64, RedisError> {
        let Some((first, ..)) = items.first() else {
            return Ok(0);
        };
        let mut args: Vec<Value> = Vec::with_capacity(6 + items.len() * 2);
        args.extend([
            Value::Integer(ms(lifetimes.fence).max(1)),
            Value::Bytes(tombstone.raw().clone()),
            Value::Integer(ms(lifetimes.tombstone).max(1)),
            Value::Integer(ms(lifetimes.tombstone_copy)),
            Value::Integer(ms(lifetimes.grace)),
            Value::Bytes(Bytes::copy_from_slice(&now_millis().to_be_bytes())),
        ]);
        let mut script_keys: Vec<&str> = Vec::with_capacity(items.len() * 5);
        for (keys, change, kind) in items {
            script_keys.extend([
                keys.value.as_str(),
                &keys.lock,
                &keys.fail_safe,
                &keys.fence,
                &keys.applied,
            ]);
            args.push(Value::Integer(*change));
            args.push(Value::from(match kind {
                ChangeKind::Deleted => "delete",
                ChangeKind::Changed => "change",
            }));
        }
        let applied: i64 = self
            .unrefused(&first.value, |c| {
                let (script_keys, args) = (script_keys.clone(), args.clone());
                async move {
                    let apply = &self.scripts.apply_many;
                    apply.evalsha_with_reload(&c, script_keys, args).await
                }
            })
            .await?;
        Ok(applied.max(0) as u64)
    }

    /// The cutoff stored at `key` (unix ms; 0 when none). Under
    /// REDIS_TIMEOUT but not the breaker: it is read every second in the
    /// background, and must neither take a half-open probe meant for a
    /// read nor open the breaker for the reads.
    pub async fn cutoff(&self, key: &str) -> Result<u64, RedisError> {
        let raw: Option<String> = self
            .unrefused(key, |c| async move { c.get(key).await })
            .await?;
        Ok(raw.and_then(|r| r.parse().ok()).unwrap_or(0))
    }

    /// Raises the cutoff at `key` to `to` (never lowers it), once per
    /// `change` (remembered in `applied` for `remember`); the one in force.
    pub async fn raise_cutoff(
        &self,
        key: &str,
        applied: &str,
        to: u64,
        change: Option<i64>,
        remember: Duration,
    ) -> Result<u64, RedisError> {
        let args = vec![
            Value::Integer(to as i64),
            change.map_or(Value::from(""), Value::Integer),
            Value::Integer(ms(remember).max(1)),
        ];
        let now_in_force: i64 = self
            .unrefused(key, |c| {
                let args = args.clone();
                async move {
                    let raise = &self.scripts.raise_cutoff;
                    raise
                        .evalsha_with_reload(&c, vec![key, applied], args)
                        .await
                }
            })
            .await?;
        Ok(now_in_force.max(0) as u64)
    }

    /// XADD of `fields` to the stream at `key`, trimmed to about `max`
    /// entries. Under REDIS_TIMEOUT but not the breaker: the change feed's
    /// beats come every half second, and must neither take a half-open
    /// probe meant for a read nor open the breaker for the reads.
    pub async fn stream_append(
        &self,
        key: &str,
        max: u64,
        fields: Vec<(&'static str, String)>,
    ) -> Result<(), RedisError> {
        self.unrefused(key, |c| {
            let fields = fields.clone();
            async move {
                c.xadd::<Value, _, _, _, _>(key, false, ("MAXLEN", "~", max as i64), "*", fields)
                    .await
                    .map(drop)
            }
        })
        .await
    }

    /// The change feed's gap marker at `key` (see `Keys::feed_gap`): sets it
    /// to `why` unless it is set already (the first reason stays). Not
    /// through the breaker, as the stream.
    pub async fn mark_gap(&self, key: &str, why: &str) -> Result<(), RedisError> {
        self.unrefused(key, |c| async move {
            c.set::<Value, _, _>(key, why, None, Some(SetOptions::NX), false)
                .await
                .map(drop)
        })
        .await
    }

    /// The change feed's gap marker at `key`: why the gap, when one is open.
    pub async fn gap(&self, key: &str) -> Result<Option<String>, RedisError> {
        self.unrefused(key, |c| async move { c.get(key).await })
            .await
    }

    /// Closes the change feed's gap at `key` (the cutoff is raised).
    pub async fn close_gap(&self, key: &str) -> Result<(), RedisError> {
        self.unrefused(
            key,
            |c| async move { c.del::<Value, _>(key).await.map(drop) },
        )
        .await
    }

    /// A client of its own, with the same settings, not yet connected: for
    /// a blocking read, which would hold up every command queued behind it
    /// on a shared connection.
    pub fn dedicated_client(&self) -> Client {
        self.nodes.default_client().clone_new()
    }

    /// GET of a plain string key.
    pub async fn get_string(&self, key: &str) -> Result<Option<String>, RedisError> {
        self.bounded(key, |c| async move { c.get(key).await }).await
    }

    /// SET of a plain string key, without expiry.
    pub async fn set_string(&self, key: &str, value: &str) -> Result<(), RedisError> {
        self.bounded(key, |c| async move {
            c.set(key, value, None, None, false).await
        })
        .await
    }

    /// Releases a lock if it still holds `token`.
    pub async fn release(&self, lock_key: &str, token: &str) -> Result<bool, RedisError> {
        let released: i64 = self
            .unrefused(lock_key, |c| async move {
                let release = &self.scripts.release;
                release
                    .evalsha_with_reload(&c, vec![lock_key], vec![token])
                    .await
            })
            .await?;
        Ok(released == 1)
    }

    /// Lets go of a lock a leader holds with `token` without finishing:
    /// released, and [`RETRY`] published on `channel` for its waiters;
    /// whether it was still held.
    pub async fn abandon(
        &self,
        lock_key: &str,
        channel: &str,
        token: &str,
    ) -> Result<bool, RedisError> {
        let publish = if self.sharded { "SPUBLISH" } else { "PUBLISH" };
        let released: i64 = self
            .unrefused(lock_key, |c| async move {
                let args: Vec<Value> = vec![
                    Value::from(token),
                    Value::from(channel),
                    Value::from(publish),
                    Value::Bytes(Bytes::from_static(RETRY)),
                ];
                let abandon = &self.scripts.abandon;
                abandon.evalsha_with_reload(&c, vec![lock_key], args).await
            })
            .await?;
        Ok(released == 1)
    }

    /// Extends a lock to `ttl` if it still holds `token`.
    pub async fn extend(
        &self,
        lock_key: &str,
        token: &str,
        ttl: Duration,
    ) -> Result<bool, RedisError> {
        let extended: i64 = self
            .unrefused(lock_key, |c| async move {
                let args = vec![Value::from(token), Value::Integer(ms(ttl).max(1))];
                let extend = &self.scripts.extend;
                extend.evalsha_with_reload(&c, vec![lock_key], args).await
            })
            .await?;
        Ok(extended == 1)
    }

    /// What Redis holds for one item: its keys and their TTLs in one
    /// pipeline (they share a slot), then its channel's subscribers.
    pub async fn snapshot(&self, keys: &ItemKeys) -> Result<ItemSnapshot, RedisError> {
        let replies: Vec<Value> = self
            .unrefused(&keys.value, |c| async move {
                let pipeline = c.pipeline();
                for key in [&keys.value, &keys.fail_safe, &keys.lock, &keys.fence] {
                    let () = pipeline.get(key).await?;
                    let () = pipeline.pttl(key).await?;
                }
                pipeline.all().await
            })
            .await?;
        let sharded = self.sharded;
        let numsub: Vec<Value> = self
            .unrefused(&keys.channel, |c| async move {
                if sharded {
                    c.pubsub_shardnumsub(&keys.channel).await
                } else {
                    c.pubsub_numsub(&keys.channel).await
                }
            })
            .await?;
        let mut replies = replies.into_iter();
        let mut next = || replies.next().unwrap_or(Value::Null);
        let bytes = |v: Value| v.as_bytes().map(Bytes::copy_from_slice);
        let ttl = |v: Value| v.as_i64().unwrap_or(-2);
        Ok(ItemSnapshot {
            value: bytes(next()),
            value_ttl: ttl(next()),
            fail_safe: bytes(next()),
            fail_safe_ttl: ttl(next()),
            lock: next().into_string(),
            lock_ttl: ttl(next()),
            fence: next().into_string(),
            fence_ttl: ttl(next()),
            // [channel, count]
            subscribers: numsub.get(1).and_then(Value::as_i64).unwrap_or(0),
        })
    }

    /// PING, for readiness (bypasses the breaker: readiness must see the
    /// truth). On a cluster, each primary through its own client, at once:
    /// the cluster serves while any of them answers (the slots of one that
    /// does not fail open, and its breaker says so). Through the cluster
    /// client it would wait out a failover: that client holds every
    /// command until all its primaries answer.
    pub async fn ping(&self) -> Result<(), RedisError> {
        let ping = |client: Client| async move {
            match tokio::time::timeout(self.timeout, client.ping::<()>(None)).await {
                Ok(result) => Ok(result?),
                Err(_) => Err(RedisError::Timeout(self.timeout)),
            }
        };
        let primaries = self.nodes.primary_clients();
        if primaries.is_empty() {
            return ping(self.nodes.default_client().clone()).await;
        }
        let mut last = None;
        for result in futures::future::join_all(primaries.into_iter().map(ping)).await {
            match result {
                Ok(()) => return Ok(()),
                Err(error) => last = Some(error),
            }
        }
        Err(last.expect("at least one primary was asked"))
    }
}

/// An entry read from `key`; bytes that are not one count as absent.
fn decoded(key: &str, raw: Option<Bytes>) -> Option<Entry> {
    raw.and_then(|raw| match Entry::decode(raw) {
        Ok(entry) => Some(entry),
        Err(error) => {
            metrics::garbage("entry");
            tracing::warn!(%error, key, "undecodable cache entry, treated as a miss");
            None
        }
    })
}

/// Runs `fut` if the breaker allows, bounded by `timeout`, and tells the
/// breaker how it went.
pub(crate) async fn guarded<T>(
    breaker: &Breaker,
    timeout: Duration,
    fut: impl Future<Output = Result<T, fred::error::Error>>,
) -> Result<T, RedisError> {
    let Some(permit) = breaker.permit() else {
        metrics::redis_error("circuit_open");
        return Err(RedisError::CircuitOpen);
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(value)) => {
            permit.succeeded();
            Ok(value)
        }
        Ok(Err(e)) => {
            if is_outage(&e) {
                permit.failed();
            } else {
                // An error reply: Redis is up.
                permit.succeeded();
            }
            metrics::redis_error(error_label(&e));
            Err(e.into())
        }
        Err(_) => {
            permit.failed();
            metrics::redis_error("timeout");
            Err(RedisError::Timeout(timeout))
        }
    }
}
