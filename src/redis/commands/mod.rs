//! The Redis side: the commands, each bounded by REDIS_TIMEOUT and guarded
//! by the circuit breaker of the node that serves the key (`nodes.rs`);
//! the scripts' calls (`scripts/`) go through [`RedisCommands::eval`];
//! lookups of value keys in `lookup.rs`, the change feed's commands in
//! `feed.rs`, what the commands answer in `replies.rs`, and how each kind
//! of command a node batches goes out in `batches.rs`.

mod batches;
mod feed;
mod lookup;
mod replies;

use std::{future::Future, sync::Arc, time::Duration};

use fred::{
    prelude::*,
    types::{Expiration, SetOptions},
};
use tokio::sync::oneshot;
use tokio_util::task::AbortOnDropHandle;

use super::{
    breaker::State,
    coalesce::{again, queued_reply, Turn},
    error::{error_label, guarded, is_moved, RedisError},
    nodes::{self, Nodes},
    queued::{QueuedClaim, QueuedFinish, QueuedValueClaim},
    scripts::{ms, Call, Claim, ClaimKeys, ClaimMany, Claimed, Finish, Finished, Scripts},
};
use crate::{
    cache::{is_claim, Entry, ItemKeys},
    telemetry::metrics,
};
use replies::decoded;
pub use replies::{Before, FirstLook, LockTtl, OnWon, ValueClaim};

/// Whether a command heeds its node's circuit breaker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BreakerRule {
    /// The read path's commands: refused while the breaker is open, and
    /// their failures count toward opening it.
    Heeded,
    /// Lock hygiene (finish, release, extend) and the change feed's
    /// commands (applying a change, the cutoff, the stream): under
    /// REDIS_TIMEOUT only. A leader must be able to finish and let go of
    /// its lock whatever other commands of this process met, and the
    /// feed's background work must neither take a read's half-open probe
    /// nor open the breaker for the reads.
    Bypassed,
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

    /// Where each key's commands go (see `nodes.rs`).
    fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    /// REDIS_TIMEOUT. The commands' fields are read through this and
    /// [`RedisCommands::nodes`] by the files of this module (`lookup.rs`,
    /// `feed.rs`), never directly.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The node serving `key` (for tests).
    #[cfg(test)]
    pub(super) fn node_of(&self, key: &str) -> Arc<nodes::Node> {
        self.nodes.for_key(key)
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

    /// Runs `command` on the client of `key`'s node, under REDIS_TIMEOUT
    /// and, as `breaker` says, that node's breaker (see
    /// [`RedisCommands::redirected`] for a node that answers MOVED).
    pub(super) async fn on_node<T, Fut>(
        &self,
        key: &str,
        breaker: BreakerRule,
        command: impl Fn(Client) -> Fut,
    ) -> Result<T, RedisError>
    where
        Fut: Future<Output = Result<T, fred::error::Error>>,
    {
        let node = self.nodes.for_key(key);
        metrics::redis_call();
        // Boxed: the client library's command futures are large (a GET's is
        // 6.8 KB), and unboxed they would be copied into every future that
        // awaits them, level by level up to the request's (memmove was the
        // top user-space cost of a hit in Redis). One allocation instead.
        let sent = Box::pin(command(node.client.clone()));
        let result = match breaker {
            BreakerRule::Heeded => guarded(&node.breaker, self.timeout, sent).await,
            BreakerRule::Bypassed => self.timed(sent).await,
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
        let started = std::time::Instant::now();
        let answered = tokio::time::timeout(self.timeout, fut).await;
        metrics::redis_latency(started.elapsed());
        match answered {
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

    /// SET a value with a TTL (the strategies without a lock).
    pub async fn store(&self, key: &str, entry: &Entry, ttl: Duration) -> Result<(), RedisError> {
        let px = ms(ttl).max(1);
        self.on_node(key, BreakerRule::Heeded, |c| async move {
            let value = entry.raw().clone();
            c.set(key, value, Some(Expiration::PX(px)), None, false)
                .await
        })
        .await
    }

    /// Takes an item's lock with `token` (`SET NX PX ttl`) and, if taken,
    /// reads what its leader must see before the load, in the same round
    /// trip (the claim script); `None` when someone else holds the lock.
    /// Under the breaker, as a read: a lock not taken is no one's to let go.
    pub async fn claim(
        &self,
        keys: &ItemKeys,
        token: &str,
        ttl: Duration,
    ) -> Result<Option<Before>, RedisError> {
        let claim = Claim { keys, token, ttl };
        let claimed = if self.sharded {
            self.script(&claim, BreakerRule::Heeded).await
        } else {
            // Batched naturally with the node's other claims.
            let node = self.nodes.for_key(&keys.lock);
            let turn = node.claims.turn(self, &node, || {
                let (reply, answer) = oneshot::channel();
                let (keys, token) = (ClaimKeys::of(keys), token.to_owned());
                (
                    QueuedClaim {
                        keys,
                        token,
                        ttl,
                        reply,
                    },
                    answer,
                )
            });
            match turn {
                Turn::Lead(baton) => {
                    let claimed = self.script(&claim, BreakerRule::Heeded).await;
                    drop(baton);
                    claimed
                }
                Turn::Queued(answer) => queued_reply(self.timeout, answer).await,
            }
        }?;
        metrics::lock_election(claimed.is_some());
        Ok(claimed.map(|Claimed { value, fence }| Before {
            entry: decoded(&keys.value, value),
            fence,
        }))
    }

    /// Claims an item's absent value key for a leader (a memcache lease):
    /// `SET value <claim> NX GET PX ttl`, which returns what the key held
    /// and takes it only if it held nothing. One command, no script; the
    /// lock, the claim's expiry and the value are then one key, and a
    /// change applied meanwhile deletes the claim, which its finish then
    /// misses (see `scripts/finish/finish.lua`): no fence to compare.
    ///
    /// `with_fence` (loads that may read a lagging replica): a GET of the
    /// change fence goes in the same pipeline, for the load to include the
    /// item's last change. It may be read just after a change took the
    /// claim away; the load, which begins after this reply, includes that
    /// change anyway. Under the breaker, as a read.
    pub async fn claim_value(
        &self,
        keys: &ItemKeys,
        claim: &str,
        ttl: Duration,
        with_fence: bool,
    ) -> Result<ValueClaim, RedisError> {
        let claimed = self.value_claim(keys, claim, ttl, with_fence, None).await?;
        metrics::lock_election(matches!(claimed, ValueClaim::Won { .. }));
        Ok(claimed)
    }

    /// A request's first look at an item, which claims it if it is absent
    /// (a memcache lease: a miss and its election in one command). As
    /// [`RedisCommands::claim_value`] without the fence; what the key holds
    /// is returned in full (`Stored`), as a lookup would.
    ///
    /// `on_won` runs where the won reply is read, before any later reply
    /// of the node's value claims is handed out: a request of this process
    /// that looks later finds the claim and, if it starts the flight, can
    /// find it handed over (see `read_path/won.rs`). A lookup that claims
    /// counts as a won election; one that finds the key held or stored
    /// counts as nothing (it was a lookup).
    pub async fn look_up_or_claim(
        &self,
        keys: &ItemKeys,
        claim: &str,
        ttl: Duration,
        on_won: OnWon,
    ) -> Result<FirstLook, RedisError> {
        let claimed = self
            .value_claim(keys, claim, ttl, false, Some(on_won))
            .await?;
        Ok(match claimed {
            ValueClaim::Won { .. } => {
                metrics::lock_election(true);
                FirstLook::Claimed
            }
            ValueClaim::Held => FirstLook::Looked(None),
            ValueClaim::Stored(raw) => FirstLook::Looked(decoded(&keys.value, Some(raw))),
        })
    }

    async fn value_claim(
        &self,
        keys: &ItemKeys,
        claim: &str,
        ttl: Duration,
        with_fence: bool,
        on_won: Option<OnWon>,
    ) -> Result<ValueClaim, RedisError> {
        let fence = with_fence.then_some(keys.fence.as_str());
        let item = (keys.value.as_str(), fence, claim, ttl);
        let claimed = if self.sharded {
            let claimed = self.claim_values(&[item]).await.pop();
            won(&claimed, on_won);
            claimed
        } else {
            // Batched naturally with the node's other value claims.
            let node = self.nodes.for_key(&keys.value);
            let mut on_won = Some(on_won);
            let turn = node.value_claims.turn(self, &node, || {
                let (reply, answer) = oneshot::channel();
                let queued = QueuedValueClaim {
                    value: keys.value.clone(),
                    fence: with_fence.then(|| keys.fence.clone()),
                    claim: claim.to_owned(),
                    ttl,
                    on_won: on_won.take().flatten(),
                    reply,
                };
                (queued, answer)
            });
            match turn {
                Turn::Lead(baton) => {
                    let claimed = self.claim_values(&[item]).await.pop();
                    // Before the baton hands the turn to the queued claims.
                    won(&claimed, on_won.flatten());
                    drop(baton);
                    claimed
                }
                Turn::Queued(answer) => Some(queued_reply(self.timeout, answer).await),
            }
        };
        claimed.unwrap_or(Err(RedisError::Reply("claim")))
    }

    /// The value claims of `items` (each its value key, fence key if read,
    /// claim and TTL; all served by one node) in one round trip, under the
    /// node's breaker: each one's reply, in their order.
    ///
    /// The commands are sent at once, each on its own, not as a fred
    /// `Pipeline`: fred 10.1 writes a pipeline's commands one by one and
    /// flushes after each (its router flushes whenever no other command is
    /// queued behind the one it writes, and a pipeline reaches it as one
    /// message), a `writev` per command; commands sent at once queue behind
    /// each other and go out in one write. In a cold storm the instance's
    /// `writev`s per request fell from 0.95 to 0.12 (`load/cold-syscalls`).
    pub(super) async fn claim_values(
        &self,
        items: &[(&str, Option<&str>, &str, Duration)],
    ) -> Vec<Result<ValueClaim, RedisError>> {
        let Some(&(first, ..)) = items.first() else {
            return Vec::new();
        };
        let sent: Result<Vec<Value>, RedisError> = self
            .on_node(first, BreakerRule::Heeded, |c| async move {
                let mut sent = Vec::with_capacity(items.len());
                for &(value, fence, claim, ttl) in items {
                    let px = Some(Expiration::PX(ms(ttl).max(1)));
                    sent.push(futures::future::Either::Left(c.set::<Value, _, _>(
                        value,
                        claim,
                        px,
                        Some(SetOptions::NX),
                        true,
                    )));
                    if let Some(fence) = fence {
                        sent.push(futures::future::Either::Right(c.get::<Value, _>(fence)));
                    }
                }
                futures::future::try_join_all(sent).await
            })
            .await;
        let sent_count: usize = items
            .iter()
            .map(|(_, f, ..)| 1 + f.is_some() as usize)
            .sum();
        match sent {
            Ok(replies) if replies.len() == sent_count => {
                let mut replies = replies.into_iter();
                items
                    .iter()
                    .map(|(_, fence, ..)| {
                        let held = replies.next().unwrap_or(Value::Null);
                        let fence = match fence {
                            Some(_) => replies.next().unwrap_or(Value::Null),
                            None => Value::Null,
                        };
                        value_claim(held, fence)
                    })
                    .collect()
            }
            Ok(_) => items
                .iter()
                .map(|_| Err(RedisError::Reply("claim")))
                .collect(),
            Err(error) => items.iter().map(|_| Err(again(&error))).collect(),
        }
    }

    /// The claims of `items` (on a single Redis) in one call of the claim
    /// script for many: each one's reply, in their order.
    pub(super) async fn claim_batch(
        &self,
        items: &[(&ClaimKeys, &str, Duration)],
    ) -> Vec<Result<Option<Claimed>, RedisError>> {
        match self.script(&ClaimMany { items }, BreakerRule::Heeded).await {
            Ok(claims) => claims.into_iter().map(Ok).collect(),
            Err(error) => items.iter().map(|_| Err(again(&error))).collect(),
        }
    }

    /// PTTL of a lock.
    pub async fn pttl(&self, key: &str) -> Result<LockTtl, RedisError> {
        let ms: i64 = self
            .on_node(
                key,
                BreakerRule::Heeded,
                |c| async move { c.pttl(key).await },
            )
            .await?;
        Ok(match ms {
            -2 => LockTtl::Absent,
            ms if ms < 0 => LockTtl::NoExpiry,
            ms => LockTtl::Expires(Duration::from_millis(ms as u64)),
        })
    }

    /// Runs a script's call (see `scripts/`) on the node of its first key,
    /// under REDIS_TIMEOUT but not the breaker: the scripts are lock
    /// hygiene (finish, release, extend, abandon) and the change feed's
    /// work (apply, cutoff), which must go through whatever the reads met
    /// (see [`BreakerRule::Bypassed`]).
    pub async fn eval<C: Call>(&self, call: &C) -> Result<C::Reply, RedisError> {
        self.script(call, BreakerRule::Bypassed).await
    }

    /// A leader's finish (see [`Finish`]), under REDIS_TIMEOUT but not the
    /// breaker, as [`RedisCommands::eval`]. On a single Redis, batched
    /// naturally with the node's other finishes (see `coalesce.rs`).
    pub async fn finish(&self, finish: &Finish<'_>) -> Result<Finished, RedisError> {
        if self.sharded {
            return self.eval(finish).await;
        }
        let node = self.nodes.for_key(&finish.keys.value);
        let turn = node.finishes.turn(self, &node, || {
            let (reply, answer) = oneshot::channel();
            let keys = finish.keys().into_iter().map(str::to_owned).collect();
            (
                QueuedFinish {
                    keys,
                    args: finish.args(),
                    reply,
                },
                answer,
            )
        });
        match turn {
            Turn::Lead(baton) => {
                let finished = self.eval(finish).await;
                drop(baton);
                finished
            }
            Turn::Queued(answer) => {
                let reply = queued_reply(self.timeout, answer).await?;
                finish.reply(reply).ok_or(RedisError::Reply("finish"))
            }
        }
    }

    /// A script's call on the node of its first key.
    async fn script<C: Call>(
        &self,
        call: &C,
        breaker: BreakerRule,
    ) -> Result<C::Reply, RedisError> {
        let keys = call.keys();
        let Some(first) = keys.first().copied() else {
            return Err(RedisError::Reply(call.name()));
        };
        let args = call.args();
        let reply: Value = self
            .on_node(first, breaker, |c| {
                let (keys, args) = (keys.clone(), args.clone());
                async move {
                    let script = self.scripts.get(call.script());
                    script.evalsha_with_reload(&c, keys, args).await
                }
            })
            .await?;
        call.reply(reply).ok_or(RedisError::Reply(call.name()))
    }

    /// A Redis Cluster: scripts publish with SPUBLISH (sharded pub/sub).
    pub fn sharded(&self) -> bool {
        self.sharded
    }

    /// Whether several items' changes can go in one script (a single Redis:
    /// on a cluster their keys are in different slots).
    pub fn applies_together(&self) -> bool {
        !self.sharded
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

/// One value claim's replies: what `SET NX GET` found, and the fence.
fn value_claim(held: Value, fence: Value) -> Result<ValueClaim, RedisError> {
    Ok(match held {
        Value::Null => ValueClaim::Won {
            fence: match fence {
                Value::Null => String::new(),
                fence => fence.into_string().ok_or(RedisError::Reply("claim"))?,
            },
        },
        Value::Bytes(held) if is_claim(&held) => ValueClaim::Held,
        Value::Bytes(held) => ValueClaim::Stored(held),
        Value::String(held) if is_claim(held.as_bytes()) => ValueClaim::Held,
        Value::String(held) => ValueClaim::Stored(held.into_inner()),
        _ => return Err(RedisError::Reply("claim")),
    })
}

/// Runs `on_won` if `claimed` is a won claim.
pub(super) fn won(claimed: &Option<Result<ValueClaim, RedisError>>, on_won: Option<OnWon>) {
    if let (Some(Ok(ValueClaim::Won { .. })), Some(on_won)) = (claimed, on_won) {
        on_won();
    }
}

/// The commands on a real Redis (REDIS_URL, else the local one), under a key
/// prefix of this test's own.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{claim_of, Keys, Status};

    async fn redis() -> (Client, RedisCommands, String) {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let client = Client::new(Config::from_url(&url).unwrap(), None, None, None);
        client.init().await.expect("the tests' Redis is up");
        let commands = RedisCommands::new(client.clone(), Duration::from_secs(1));
        let prefix = format!("postcache:commands:{:016x}:", rand::random::<u64>());
        (client, commands, prefix)
    }

    #[tokio::test]
    async fn a_value_claim_takes_an_absent_key_only_and_reads_the_fence() {
        let (client, commands, prefix) = redis().await;
        let names = Keys::new(prefix, "post");
        let (cold, fenced, stored) = (names.item(1), names.item(2), names.item(3));
        let minute = Duration::from_secs(60);
        let ours = claim_of("a");

        // Absent: taken, for the lock's lifetime, with no fence.
        assert_eq!(
            commands
                .claim_value(&cold, &ours, minute, true)
                .await
                .unwrap(),
            ValueClaim::Won {
                fence: String::new()
            }
        );
        let held: Option<String> = client.get(&cold.value).await.unwrap();
        assert_eq!(held.as_deref(), Some(ours.as_str()));
        let pttl: i64 = client.pttl(&cold.value).await.unwrap();
        assert!((50_000..=60_000).contains(&pttl), "{pttl}");
        // Claimed: another leader's claim is held, and left alone; a lookup
        // sees no entry.
        assert_eq!(
            commands
                .claim_value(&cold, &claim_of("b"), minute, true)
                .await
                .unwrap(),
            ValueClaim::Held
        );
        let held: Option<String> = client.get(&cold.value).await.unwrap();
        assert_eq!(held.as_deref(), Some(ours.as_str()));
        assert_eq!(commands.lookup(&cold.value).await.unwrap(), None);

        // A change fenced the item: read with the claim.
        let _: () = client
            .set(&fenced.fence, "17", None, None, false)
            .await
            .unwrap();
        assert_eq!(
            commands
                .claim_value(&fenced, &ours, minute, true)
                .await
                .unwrap(),
            ValueClaim::Won { fence: "17".into() }
        );

        // An entry there (a copy past its freshness, say): nothing taken.
        let entry = Entry::new(Status::Found, b"{}", minute, Duration::ZERO);
        commands.store(&stored.value, &entry, minute).await.unwrap();
        let claimed = commands
            .claim_value(&stored, &ours, minute, true)
            .await
            .unwrap();
        assert!(
            matches!(&claimed, ValueClaim::Stored(raw) if Entry::decode(raw.clone()).unwrap() == entry),
            "{claimed:?}"
        );
        assert_eq!(commands.lookup(&stored.value).await.unwrap(), Some(entry));

        for keys in [&cold, &fenced, &stored] {
            let _: i64 = client
                .del(vec![keys.value.clone(), keys.fence.clone()])
                .await
                .unwrap();
        }
    }

    /// A first look claims an absent key (its hook run first), and reads
    /// anything else as a lookup would, leaving it as it was.
    #[tokio::test]
    async fn a_first_look_claims_an_absent_key_and_reads_anything_else() {
        let (client, commands, prefix) = redis().await;
        let names = Keys::new(prefix, "post");
        let (cold, stored, garbage) = (names.item(1), names.item(2), names.item(3));
        let minute = Duration::from_secs(60);
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let hook = || -> OnWon {
            let ran = ran.clone();
            Box::new(move || {
                ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            })
        };
        let ours = claim_of("a");

        let looked = commands.look_up_or_claim(&cold, &ours, minute, hook());
        assert!(matches!(looked.await.unwrap(), FirstLook::Claimed));
        assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 1);
        let held: Option<String> = client.get(&cold.value).await.unwrap();
        assert_eq!(held.as_deref(), Some(ours.as_str()));
        let pttl: i64 = client.pttl(&cold.value).await.unwrap();
        assert!((50_000..=60_000).contains(&pttl), "{pttl}");
        // Claimed already: seen as no entry, the claim left alone.
        let theirs = claim_of("b");
        let looked = commands.look_up_or_claim(&cold, &theirs, minute, hook());
        assert!(matches!(looked.await.unwrap(), FirstLook::Looked(None)));
        let held: Option<String> = client.get(&cold.value).await.unwrap();
        assert_eq!(held.as_deref(), Some(ours.as_str()));

        // An entry: read whole, its TTL untouched.
        let entry = Entry::new(Status::Found, b"{\"id\":2}", minute, Duration::ZERO);
        let hour = Duration::from_secs(3600);
        commands.store(&stored.value, &entry, hour).await.unwrap();
        let looked = commands.look_up_or_claim(&stored, &ours, minute, hook());
        assert!(
            matches!(looked.await.unwrap(), FirstLook::Looked(Some(e)) if e == entry),
            "the entry"
        );
        let pttl: i64 = client.pttl(&stored.value).await.unwrap();
        assert!(pttl > 3_500_000, "{pttl}");
        // Bytes that are not an entry (another layout): no entry, and not
        // taken (the next store replaces them).
        let _: () = client
            .set(&garbage.value, "not an entry", None, None, false)
            .await
            .unwrap();
        let looked = commands.look_up_or_claim(&garbage, &ours, minute, hook());
        assert!(matches!(looked.await.unwrap(), FirstLook::Looked(None)));
        let kept: Option<String> = client.get(&garbage.value).await.unwrap();
        assert_eq!(kept.as_deref(), Some("not an entry"));
        assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 1, "won once");

        for keys in [&cold, &stored, &garbage] {
            let _: i64 = client.del(&keys.value).await.unwrap();
        }
    }
}
