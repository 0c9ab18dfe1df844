//! Lookups: value keys read and decoded, one at a time (batched with the
//! node's other lookups, see `coalesce.rs`) or many in one round trip per
//! node.

use std::sync::Arc;

use bytes::Bytes;
use fred::prelude::*;
use tokio::sync::oneshot;

use super::{replies::decoded, BreakerRule, RedisCommands};
use crate::{
    cache::Entry,
    redis::{
        coalesce::{again, queued_reply, Turn},
        error::{guarded, RedisError},
        nodes::Node,
        queued::QueuedGet,
    },
    telemetry::metrics,
};

impl RedisCommands {
    /// GET a value key and decode it. Bytes that are not an entry count as
    /// absent: the next store overwrites them. Batched naturally with the
    /// node's other lookups (see `coalesce.rs`).
    pub async fn lookup(&self, key: &str) -> Result<Option<Entry>, RedisError> {
        let node = self.nodes().for_key(key);
        let turn = node.gets.turn(self, &node, || {
            let (reply, answer) = oneshot::channel();
            let key = key.to_owned();
            (QueuedGet { key, reply }, answer)
        });
        let raw = match turn {
            Turn::Lead(baton) => {
                let raw = self.get_raw(key).await;
                drop(baton);
                raw
            }
            Turn::Queued(answer) => queued_reply(self.timeout(), answer).await,
        }?;
        Ok(decoded(key, raw))
    }

    /// The entry at `value` and the item's fence key `fence` (in the same
    /// slot), read together in one round trip: a waiter's look, by whose
    /// fence it judges the messages it hears later (`cache/message.rs`).
    /// The fence's bytes are empty when there is none.
    pub async fn lookup_fenced(
        &self,
        value: &str,
        fence: &str,
    ) -> Result<(Option<Entry>, Bytes), RedisError> {
        let node = self.nodes().for_key(value);
        let mut read = self.read_node(&node, &[value, fence]).await.into_iter();
        let mut next = || read.next().unwrap_or(Err(RedisError::Reply("mget")));
        let (raw, fenced) = (next()?, next()?);
        Ok((decoded(value, raw), fenced.unwrap_or_default()))
    }

    /// One GET, unbatched.
    async fn get_raw(&self, key: &str) -> Result<Option<Bytes>, RedisError> {
        self.on_node(
            key,
            BreakerRule::Heeded,
            |c| async move { c.get(key).await },
        )
        .await
    }

    /// The raw values of `names`, all served by `node`, in one round trip:
    /// an MGET on a single Redis, a pipeline of GETs on a cluster node (a
    /// node's keys are in many slots, which one MGET cannot span). Under
    /// the node's breaker and REDIS_TIMEOUT. If the node refuses the batch
    /// (a MOVED: a slot has moved), each key is read on its own, which
    /// follows the redirection and gives each key its own error.
    pub(in crate::redis) async fn read_node(
        &self,
        node: &Node,
        names: &[&str],
    ) -> Vec<Result<Option<Bytes>, RedisError>> {
        if let [name] = names {
            return vec![self.get_raw(name).await];
        }
        metrics::redis_call();
        let sent = Box::pin(async {
            if self.sharded() {
                // Sent at once, not as a fred pipeline (see `claim_values`).
                let gets = names
                    .iter()
                    .map(|name| node.client.get::<Option<Bytes>, _>(*name));
                futures::future::try_join_all(gets).await
            } else {
                node.client
                    .mget::<Vec<Option<Bytes>>, _>(names.to_vec())
                    .await
            }
        });
        match guarded(&node.breaker, self.timeout(), sent).await {
            Ok(raws) if raws.len() == names.len() => raws.into_iter().map(Ok).collect(),
            Ok(_) => names
                .iter()
                .map(|_| Err(RedisError::Reply("mget")))
                .collect(),
            Err(RedisError::Command(_)) => {
                futures::future::join_all(names.iter().map(|name| self.get_raw(name))).await
            }
            Err(error) => names.iter().map(|_| Err(again(&error))).collect(),
        }
    }

    /// The entries of many value keys, in one round trip per node (see
    /// [`RedisCommands::read_node`]).
    pub async fn lookup_many(&self, keys: &[String]) -> Vec<Result<Option<Entry>, RedisError>> {
        let mut groups: Vec<(Arc<Node>, Vec<usize>)> = Vec::new();
        for (at, key) in keys.iter().enumerate() {
            let node = self.nodes().for_key(key);
            match groups.iter_mut().find(|(n, _)| Arc::ptr_eq(n, &node)) {
                Some((_, members)) => members.push(at),
                None => groups.push((node, vec![at])),
            }
        }
        let reads = groups.iter().map(|(node, members)| async move {
            let names: Vec<&str> = members.iter().map(|&at| keys[at].as_str()).collect();
            (members, self.read_node(node, &names).await)
        });
        let mut found: Vec<Option<Result<Option<Entry>, RedisError>>> =
            keys.iter().map(|_| None).collect();
        for (members, looked) in futures::future::join_all(reads).await {
            for (&at, raw) in members.iter().zip(looked) {
                found[at] = Some(raw.map(|raw| decoded(&keys[at], raw)));
            }
        }
        found
            .into_iter()
            .map(|read| read.unwrap_or(Err(RedisError::Reply("mget"))))
            .collect()
    }
}
