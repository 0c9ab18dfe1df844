//! Whether what the change feed wrote to a node would survive its failover:
//! WAIT for the node's replicas, on a connection of the node's own.
//!
//! A Redis primary answers a write before its replicas have it. A failover
//! to a replica that missed a change's application gives back the entry
//! the change invalidated, and the claim it deleted (a leader that read
//! the row before the change then stores it): nothing would apply the
//! change again. So the decoder holds a change applied only once a replica
//! of each node it touched acknowledges it; until then it keeps the change
//! for a retry (applying it again is a no-op on a node that has it, and
//! redoes it on one promoted without it).
//!
//! ```text
//!  decoder: apply the batch (the shared connection) ─► replicated(keys):
//!      per node touched, on its own connection:
//!          no replica (INFO replication, at most a second old) ─► durable
//!          SET <key>:replicated 1 PX 60000 ; WAIT 1 <limit> ; INFO replication
//!              acknowledged, and the same master_replid as before the writes?
//! ```
//!
//! - WAIT blocks the connection it is sent on, so it never goes on the
//!   shared one, where every read of the process waits behind it.
//! - WAIT covers the writes of its own connection: the marker's SET, on
//!   that connection, comes after every application (each was answered
//!   before), so its acknowledgement is theirs too. The marker shares the
//!   touched key's hash tag, hence its node.
//! - A connection made again to another server (a promoted replica behind
//!   the same address) would acknowledge none of the writes the old one
//!   took: the replication id, read before the writes and after the WAIT,
//!   must be the same, and the marker and the WAIT are never sent again on
//!   a new connection.
//! - One replica is enough: a failover promotes the replica that has the
//!   most of its primary's stream (Sentinel, and a cluster's replicas,
//!   choose by replication offset).

use std::{
    sync::{Mutex, PoisonError},
    time::{Duration, Instant},
};

use fred::{
    prelude::*,
    types::{config::Options, ClusterHash, CustomCommand, Expiration},
};
use tokio_util::task::AbortOnDropHandle;

/// How long a node's count of replicas is taken as known.
const REPLICAS_KNOWN_FOR: Duration = Duration::from_secs(1);
/// How long a node that had a replica is waited for as if it still had
/// one: a replica reconnecting (after its primary restarted, or a network
/// blip) is not counted by its primary until it has (a replica tries once
/// a second), and it may still be promoted meanwhile. Short: a primary
/// promoted behind the same address, with no replica of its own yet, is
/// waited for in vain this long (every change kept for a retry, and read
/// past Redis once per post and instance).
const REPLICAS_REMEMBERED_FOR: Duration = Duration::from_secs(5);
/// How long a marker key lives (it only needs to outlive its WAIT).
const MARKER_MS: i64 = 60_000;

/// A node's connection for WAIT, and what it last learnt of the node.
pub(super) struct Durable {
    client: Client,
    _connection: AbortOnDropHandle<Result<(), fred::error::Error>>,
    /// What the last `INFO replication` said, and when.
    seen: Mutex<Option<Seen>>,
    /// When the node was last seen with a replica.
    had_replicas: Mutex<Option<Instant>>,
}

/// What one `INFO replication` said of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    at: Instant,
    /// `master_replid`: a new one after a promotion or a restart.
    replid: String,
    /// The replicas to wait for (see [`Durable::read`]).
    replicas: u64,
}

impl Durable {
    /// A connection of its own to the node of `shared` (same settings),
    /// connected within `timeout`.
    pub(super) async fn connect(shared: &Client, timeout: Duration) -> Result<Self, Error> {
        let client = shared.clone_new();
        let connection = AbortOnDropHandle::new(client.connect());
        tokio::time::timeout(timeout, client.wait_for_connect())
            .await
            .map_err(|_| Error::new(ErrorKind::Timeout, "no connection for WAIT"))??;
        Ok(Self {
            client,
            _connection: connection,
            seen: Mutex::new(None),
            had_replicas: Mutex::new(None),
        })
    }

    /// Whether every write this process made to the node of `key` before
    /// this call has reached one of its replicas, waiting at most `limit`
    /// (true at once for a node without replicas); each other command
    /// bounded by `timeout`.
    ///
    /// The acknowledgement counts only if the node is the one seen before
    /// the writes were made: the same `master_replid` as the last look
    /// (before this call), read again after the WAIT. A promotion or a
    /// restart between them (found: writes made on a primary just before
    /// it was killed, the WAIT sent on the connection made again to the
    /// promoted replica, and acknowledged there) gives a new one.
    pub(super) async fn replicated(
        &self,
        key: &str,
        limit: Duration,
        timeout: Duration,
    ) -> Result<bool, Error> {
        let before = match self.seen() {
            Some(seen) if seen.replicas > 0 || seen.at.elapsed() < REPLICAS_KNOWN_FOR => seen,
            last => match self.read(key, timeout).await {
                // Read after the writes: it cannot vouch for the node they
                // reached. The next call's will.
                Ok(now) if now.replicas > 0 => return Ok(false),
                Ok(now) => now,
                // A node known to have no replica is not held to one
                // because a look failed: on a loaded machine an INFO past
                // REDIS_TIMEOUT would keep a Redis without replicas from
                // beating level for half a second (the likely cause of a
                // staleness bound read past the cache in one CI run).
                Err(_) if last.is_some_and(|seen| seen.replicas == 0) => return Ok(true),
                Err(error) => return Err(error),
            },
        };
        if before.replicas == 0 {
            return Ok(true);
        }
        let marker = format!("{key}:replicated");
        let slot = ClusterHash::Custom(fred::types::cluster::ClusterRouting::hash_key(
            marker.as_bytes(),
        ));
        // Never sent again on a new connection: there it would cover none
        // of the writes.
        let once = |bound: Duration| Options {
            timeout: Some(bound),
            max_attempts: Some(1),
            fail_fast: true,
            ..Options::default()
        };
        let () = self
            .client
            .with_options(&once(timeout))
            .set(&marker, 1, Some(Expiration::PX(MARKER_MS)), None, false)
            .await?;
        let wait = CustomCommand::new_static("WAIT", slot, true);
        let acknowledged: i64 = self
            .client
            .with_options(&once(limit + timeout))
            .custom(wait, vec![1, limit.as_millis().max(1) as i64])
            .await?;
        let after = self.read(key, timeout).await?;
        Ok(acknowledged >= 1 && after.replid == before.replid)
    }

    fn seen(&self) -> Option<Seen> {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Reads `INFO replication` of the node of `key`: its replication id,
    /// and the replicas to wait for: its connected replicas, or one if it
    /// had one within REPLICAS_REMEMBERED_FOR (found: a replica
    /// reconnecting to its restarted primary, not counted, then promoted
    /// with what it held before, had acknowledged none of the changes
    /// since).
    async fn read(&self, key: &str, timeout: Duration) -> Result<Seen, Error> {
        let slot = ClusterHash::Custom(fred::types::cluster::ClusterRouting::hash_key(
            key.as_bytes(),
        ));
        let info: String = self
            .client
            .with_options(&Options {
                timeout: Some(timeout),
                ..Options::default()
            })
            .custom(
                CustomCommand::new_static("INFO", slot, false),
                vec!["replication"],
            )
            .await?;
        let connected = connected_replicas(&info);
        let replicas = {
            let mut had = self
                .had_replicas
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if connected > 0 {
                *had = Some(Instant::now());
                connected
            } else if had.is_some_and(|at| at.elapsed() < REPLICAS_REMEMBERED_FOR) {
                1
            } else {
                0
            }
        };
        let seen = Seen {
            at: Instant::now(),
            replid: field(&info, "master_replid").unwrap_or_default().to_owned(),
            replicas,
        };
        *self.seen.lock().unwrap_or_else(PoisonError::into_inner) = Some(seen.clone());
        Ok(seen)
    }

    /// QUIT, bounded.
    pub(super) async fn stop(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.client.quit()).await;
    }
}

/// The value of `name` in an `INFO` reply.
fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|line| {
        line.trim()
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(':'))
    })
}

/// `connected_slaves` of an `INFO replication` reply (0 when absent: a
/// replica itself, or a reply of another shape).
fn connected_replicas(info: &str) -> u64 {
    field(info, "connected_slaves")
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connected_replicas_are_read_from_info() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\nslave0:ip=127.0.0.1\r\n";
        assert_eq!(connected_replicas(info), 2);
        assert_eq!(connected_replicas("# Replication\r\nrole:slave\r\n"), 0);
        assert_eq!(connected_replicas("connected_slaves:x"), 0);
        let info = "role:master\r\nmaster_replid:abc123\r\nmaster_replid2:000\r\n";
        assert_eq!(field(info, "master_replid"), Some("abc123"));
        assert_eq!(field(info, "master_repl"), None);
    }
}
