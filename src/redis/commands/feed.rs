//! The change feed's commands: the cutoff, the stream, the gap marker and
//! the decoder's position. They go around the breaker (see
//! [`BreakerRule::Bypassed`]), except the position's, which the feed
//! reads and writes as any command.

use fred::{prelude::*, types::SetOptions};

use std::{sync::Arc, time::Duration};

use super::{BreakerRule, RedisCommands};
use crate::{
    redis::{
        error::{is_moved, RedisError},
        nodes::Node,
    },
    telemetry::metrics,
};

impl RedisCommands {
    /// The cutoff stored at `key` (unix ms; 0 when none). Under
    /// REDIS_TIMEOUT but not the breaker: it is read every second in the
    /// background, and must neither take a half-open probe meant for a
    /// read nor open the breaker for the reads.
    pub async fn cutoff(&self, key: &str) -> Result<u64, RedisError> {
        let raw: Option<String> = self
            .on_node(
                key,
                BreakerRule::Bypassed,
                |c| async move { c.get(key).await },
            )
            .await?;
        Ok(raw.and_then(|r| r.parse().ok()).unwrap_or(0))
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
        self.on_node(key, BreakerRule::Bypassed, |c| {
            let fields = fields.clone();
            async move {
                c.xadd::<Value, _, _, _, _>(key, false, ("MAXLEN", "~", max as i64), "*", fields)
                    .await
                    .map(drop)
            }
        })
        .await
    }

    /// The last `count` entries of the stream at `key`, newest first: each
    /// its fields. Not through the breaker, as the stream.
    pub async fn stream_tail(
        &self,
        key: &str,
        count: u64,
    ) -> Result<Vec<std::collections::HashMap<String, String>>, RedisError> {
        self.on_node(key, BreakerRule::Bypassed, |c| async move {
            let tail: Vec<(String, std::collections::HashMap<String, String>)> =
                c.xrevrange(key, "+", "-", Some(count)).await?;
            Ok(tail.into_iter().map(|(_, fields)| fields).collect())
        })
        .await
    }

    /// The change feed's gap marker at `key` (see `Keys::feed_gap`): sets it
    /// to `why` unless it is set already (the first reason stays). Not
    /// through the breaker, as the stream.
    pub async fn mark_gap(&self, key: &str, why: &str) -> Result<(), RedisError> {
        self.on_node(key, BreakerRule::Bypassed, |c| async move {
            c.set::<Value, _, _>(key, why, None, Some(SetOptions::NX), false)
                .await
                .map(drop)
        })
        .await
    }

    /// The change feed's gap marker at `key`: why the gap, when one is open.
    pub async fn gap(&self, key: &str) -> Result<Option<String>, RedisError> {
        self.on_node(
            key,
            BreakerRule::Bypassed,
            |c| async move { c.get(key).await },
        )
        .await
    }

    /// Closes the change feed's gap at `key` (the cutoff is raised).
    pub async fn close_gap(&self, key: &str) -> Result<(), RedisError> {
        self.on_node(key, BreakerRule::Bypassed, |c| async move {
            c.del::<Value, _>(key).await.map(drop)
        })
        .await
    }

    /// Whether everything this process wrote to the nodes of `keys` before
    /// the call has reached a replica of each of them that has replicas,
    /// waiting at most `limit` (see `replicas.rs`). Not through the
    /// breaker, as the stream.
    pub async fn replicated(&self, keys: &[String], limit: Duration) -> Result<bool, RedisError> {
        let mut nodes: Vec<(Arc<Node>, &str)> = Vec::new();
        for key in keys {
            let node = self.nodes().for_key(key);
            if !nodes.iter().any(|(n, _)| Arc::ptr_eq(n, &node)) {
                nodes.push((node, key));
            }
        }
        let timeout = self.timeout();
        let checks = nodes.iter().map(|(node, key)| async move {
            metrics::redis_call();
            node.replicated(key, limit, timeout).await
        });
        let mut all = true;
        for checked in futures::future::join_all(checks).await {
            match checked {
                Ok(acknowledged) => all &= acknowledged,
                Err(error) if is_moved(&error) => {
                    self.nodes().moved();
                    return Err(RedisError::from(error));
                }
                Err(error) => return Err(RedisError::from(error)),
            }
        }
        Ok(all)
    }

    /// A client of its own, with the same settings, not yet connected: for
    /// a blocking read, which would hold up every command queued behind it
    /// on a shared connection.
    pub fn dedicated_client(&self) -> Client {
        self.nodes().default_client().clone_new()
    }

    /// GET of a plain string key.
    pub async fn get_string(&self, key: &str) -> Result<Option<String>, RedisError> {
        self.on_node(
            key,
            BreakerRule::Heeded,
            |c| async move { c.get(key).await },
        )
        .await
    }

    /// SET of a plain string key, without expiry.
    pub async fn set_string(&self, key: &str, value: &str) -> Result<(), RedisError> {
        self.on_node(key, BreakerRule::Heeded, |c| async move {
            c.set(key, value, None, None, false).await
        })
        .await
    }
}
