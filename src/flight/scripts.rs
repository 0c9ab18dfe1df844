//! The read path's Lua scripts, and keeping them loaded.
//!
//! A Redis that comes back (restarted, failed over, or a new empty node) has
//! forgotten every script. Rather than have a request discover that by a
//! NOSCRIPT and pay SCRIPT LOAD and a second EVALSHA inside its
//! REDIS_TIMEOUT, the scripts are loaded on each connection as soon as it is
//! (re)established, and only then does that reconnect close the breaker.
//! EVALSHA's reload on NOSCRIPT stays as the fallback for a server that lost
//! its scripts without a reconnect (SCRIPT FLUSH).

use std::time::{Duration, Instant};

use fred::{
    prelude::*,
    types::{config::Server as RedisServer, scripts::Script},
};
use tokio::sync::broadcast;

use super::redis::{is_outage, with_backoff, RedisError};
use crate::cache::entry;

/// The leader's finish, in one round trip, fenced by the lock and by the
/// change fence.
///
/// Change fence: a change applied to the item after the leader looked at
/// its fence (before its read) means the row it read may be older than the
/// change. Such a finish stores nothing and publishes [`RETRY`]: its
/// waiters, and the leader's own flight, elect a leader again, who reads
/// the new row (a stale set, in the words of Facebook's memcache paper,
/// never lands).
///
/// Lock fencing: the finish writes only while the lock still holds this
/// leader's token, or when the lock is gone and nothing newer is stored. A
/// leader whose lock expired or was lost and taken over must not store its
/// older row (or its failure) over the new leader's value: it publishes what
/// is stored instead (or nothing, when nothing is).
///
/// On success: store the entry (unless its TTL is 0) and, for a found entry,
/// its fail-safe copy; a not-found entry turns an existing fail-safe copy
/// into the item's tombstone (or deletes it, MAX_STALE off), so that a
/// deleted item never comes back from it. On failure: an entry still fresh
/// is left as it is (a failed refresh never degrades it); otherwise store as
/// the backoff, for FAILURE_TTL, the last good copy (the value if it is a
/// found entry, else the fail-safe copy, found or tombstone; never one read
/// before the cutoff) with its BACKOFF flag set, or else the failure marker.
/// Then publish what is stored on the ready channel, and release the lock if
/// it is ours.
///
/// Which TTLs is decided in Rust (`freshness::store_for`); which copy, here,
/// because only Redis knows what is stored at the moment of the finish.
///
/// KEYS[1] value, KEYS[2] lock, KEYS[3] fail-safe copy, KEYS[4] fence.
/// ARGV[1] entry, ARGV[2] value TTL ms (0: do not store), ARGV[3] token,
/// ARGV[4] channel, ARGV[5] fail-safe copy TTL ms (0: none), ARGV[6] FAILURE_TTL ms,
/// ARGV[7] the publish command: PUBLISH, or SPUBLISH on a Redis Cluster (the
/// channel shares the keys' hash tag, so it lives on the same shard),
/// ARGV[8] now, unix ms, ARGV[9] the fence the leader saw ("" for none),
/// ARGV[10] the cutoff, unix ms (0: none), ARGV[11] [`RETRY`].
/// Returns {released, payload, fenced}: what was published, or the entry itself.
///
/// The `$…` placeholders are the envelope's layout, filled in from the
/// constants of `cache/entry.rs` by [`with_layout`] (Lua strings count from 1).
const FINISH_LUA: &str = include_str!("finish.lua");

/// The body that applies a change to an item's keys (run by
/// [`apply_many_lua`], for one item or several); idempotent (a
/// change already in the item's set of applied changes is skipped: applied
/// by this instance or another, in whatever order the changes arrive).
///
/// Sets the fence to the change, a value no fence had before, and records
/// the change as applied (both for the fence's lifetime, while there is a
/// value or a leader to fence). A delete puts a tombstone (a not-found entry) in place
/// of the value and of the fail-safe copy, where they exist. Any other
/// change deletes the value, or with stale-while-revalidate marks a found
/// one stale (fresh until now, kept no longer than the grace window), and
/// deletes a tombstone copy (the item exists again).
///
/// KEYS[1] value, KEYS[2] lock, KEYS[3] fail-safe copy, KEYS[4] fence,
/// KEYS[5] the changes applied.
/// ARGV[1] change id, ARGV[2] `delete` or `change`, ARGV[3] fence TTL ms,
/// ARGV[4] the tombstone, ARGV[5] its TTL ms as the value, ARGV[6] as the
/// fail-safe copy (0: none), ARGV[7] the grace window ms (0: off),
/// ARGV[8] now, unix ms, as 8 big-endian bytes.
/// Returns 1 when applied, 0 when skipped.
const APPLY_LUA: &str = include_str!("apply.lua");

/// Changes, each as [`APPLY_LUA`] applies it, in one round trip: one item
/// anywhere (its keys share a slot), several only on a single Redis (the
/// change feed's decoder: their keys are in different hash slots).
/// KEYS: the five keys of each item in turn, as APPLY_LUA's.
/// ARGV[1] fence TTL ms, ARGV[2] the tombstone, ARGV[3] its TTL ms as the
/// value, ARGV[4] as the fail-safe copy, ARGV[5] the grace window ms,
/// ARGV[6] now (8 bytes); then for each item its change id and its kind.
/// Returns how many were applied (the others were already).
fn apply_many_lua() -> String {
    let lua = with_layout(APPLY_LUA)
        .replace("KEYS[", "K[")
        .replace("ARGV[", "A[");
    // The helpers once, the body per item.
    let (helpers, one) = lua
        .split_once("-- Applied already")
        .expect("apply.lua's body starts with its first check");
    format!(
        r#"
{helpers}
local function apply_one(K, A)
-- Applied already{one}
end
local applied = 0
for i = 0, (#KEYS / 5) - 1 do
  local K = {{KEYS[i*5+1], KEYS[i*5+2], KEYS[i*5+3], KEYS[i*5+4], KEYS[i*5+5]}}
  local A = {{ARGV[7+i*2], ARGV[8+i*2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]}}
  applied = applied + apply_one(K, A)
end
return applied
"#
    )
}

/// The message that tells waiters to elect a leader again (a fenced
/// finish): too short to be an entry, so never taken for one.
pub const RETRY: &[u8] = b"retry";

/// A Lua script with the envelope's layout filled in.
fn with_layout(lua: &str) -> String {
    // Lua's string.byte counts from 1.
    let at = |offset: usize| (offset + 1).to_string();
    lua.replace("$VERSION_AT", &at(0))
        .replace("$VERSION", &entry::VERSION.to_string())
        .replace("$HEADER", &entry::HEADER_LEN.to_string())
        .replace("$STATUS", &at(entry::STATUS_AT))
        .replace("$FLAGS", &at(entry::FLAGS_AT))
        .replace("$STORED_AT", &at(entry::STORED_AT))
        .replace("$FRESH_UNTIL", &at(entry::FRESH_UNTIL_AT))
        .replace("$LOAD_AT", &at(entry::LOAD_AT))
        .replace("$FOUND", &entry::STATUS_FOUND.to_string())
        .replace("$NOT_FOUND", &entry::STATUS_NOT_FOUND.to_string())
        .replace("$FAILED", &entry::STATUS_FAILED.to_string())
        .replace("$BACKOFF", &entry::FLAG_BACKOFF.to_string())
}

/// Raises the cutoff to ARGV[1] (unix ms) unless it is higher already, once
/// per change: a change seen again (another instance, a catch-up replayed)
/// does not raise it again.
/// KEYS[1] the cutoff, KEYS[2] the changes that raised it; ARGV[2] the
/// change id ("" for none), ARGV[3] how long a change is remembered, ms.
/// Returns the cutoff in force.
const RAISE_CUTOFF_LUA: &str = r#"
local current = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if ARGV[2] ~= '' then
  if redis.call('SADD', KEYS[2], ARGV[2]) == 0 then
    return current
  end
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
local wanted = tonumber(ARGV[1])
if wanted > current then
  redis.call('SET', KEYS[1], ARGV[1])
  return wanted
end
return current
"#;

/// Releases a lock only if it still holds the given token.
/// KEYS[1] lock; ARGV[1] token. Returns 1 when released.
const RELEASE_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

/// A leader gone without finishing (its task panicked, or was dropped): its
/// lock is released if it still holds the token, and [`RETRY`] published so
/// that its waiters elect a new leader now rather than at the lock's expiry.
/// KEYS[1] lock; ARGV[1] token, ARGV[2] channel, ARGV[3] the publish
/// command (PUBLISH, or SPUBLISH on a cluster), ARGV[4] [`RETRY`].
/// Returns 1 when released (and published).
const ABANDON_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call(ARGV[3], ARGV[2], ARGV[4])
  return 1
end
return 0
"#;

/// Extends a lock only if it still holds the given token (the watchdog).
/// KEYS[1] lock; ARGV[1] token, ARGV[2] TTL ms. Returns 1 when extended.
const EXTEND_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#;

/// What a client of the read path is connected to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Server {
    /// One Redis (or the cluster client, which routes by itself).
    Single,
    /// One node of a Redis Cluster, through a client of its own.
    ClusterNode,
}

/// The key a reconnected node is asked about (EXISTS), to see that it
/// serves keyed commands; nothing writes it.
const SERVING_PROBE: &str = "postcache:serving-probe";

/// How long a reconnect keeps trying to load the scripts (a server still
/// loading its data refuses them for a while); after that, EVALSHA's reload
/// on NOSCRIPT takes over.
const LOAD_PATIENCE: Duration = Duration::from_secs(10);

/// The scripts of the read path.
#[derive(Clone)]
pub(super) struct Scripts {
    pub finish: Script,
    pub release: Script,
    pub abandon: Script,
    pub extend: Script,
    pub apply_many: Script,
    pub raise_cutoff: Script,
}

impl Scripts {
    pub fn new() -> Self {
        Self {
            finish: Script::from_lua(with_layout(FINISH_LUA)),
            release: Script::from_lua(RELEASE_LUA),
            abandon: Script::from_lua(ABANDON_LUA),
            extend: Script::from_lua(EXTEND_LUA),
            apply_many: Script::from_lua(apply_many_lua()),
            raise_cutoff: Script::from_lua(RAISE_CUTOFF_LUA),
        }
    }

    fn all(&self) -> [&Script; 6] {
        [
            &self.finish,
            &self.release,
            &self.abandon,
            &self.extend,
            &self.apply_many,
            &self.raise_cutoff,
        ]
    }

    /// SCRIPT LOAD of every script on `server`: the node that just
    /// connected on a cluster, the one server otherwise.
    async fn load_on(
        &self,
        client: &Client,
        server: &RedisServer,
    ) -> Result<(), fred::error::Error> {
        let options = fred::types::config::Options {
            cluster_node: client.is_clustered().then(|| server.clone()),
            ..Default::default()
        };
        let node = client.with_options(&options);
        for script in self.all() {
            let lua = script.lua().expect("built from Lua source").clone();
            node.script_load::<String, _>(lua).await?;
        }
        Ok(())
    }

    /// Whether `server` serves keyed commands: a new connection alone does
    /// not prove it. The client library reconnects after a CLUSTERDOWN, and
    /// a server loading its data, or a replica that lost its master, takes
    /// connections and scripts; each refuses keyed commands. A cluster node
    /// must say `cluster_state:ok` first (asked without a key: a keyed
    /// command answered CLUSTERDOWN would make the client reconnect again,
    /// for ever); then it, or a single server, must answer EXISTS of a key
    /// nobody writes (a redirect, MOVED or ASK, proves it serves).
    async fn serves(
        client: &Client,
        kind: Server,
        server: &RedisServer,
        timeout: Duration,
    ) -> bool {
        let options = fred::types::config::Options {
            cluster_node: client.is_clustered().then(|| server.clone()),
            ..Default::default()
        };
        let node = client.with_options(&options);
        let check = async {
            if kind == Server::ClusterNode {
                let info: String = node.cluster_info().await?;
                if !info.contains("cluster_state:ok") {
                    return Ok(false);
                }
            }
            match node.exists::<i64, _>(SERVING_PROBE).await {
                Ok(_) => Ok(true),
                Err(error) => Ok(!is_outage(&error)),
            }
        };
        matches!(
            tokio::time::timeout(timeout, check).await,
            Ok(Ok::<bool, fred::error::Error>(true))
        )
    }

    /// SCRIPT LOAD of every script on every primary.
    async fn load_everywhere(&self, client: &Client) -> Result<(), fred::error::Error> {
        for script in self.all() {
            script.load(client).await?;
        }
        Ok(())
    }
}

/// Loads the scripts on each connection of `client` as it is (re)established
/// (`reconnects`, taken from the client before it connects), then, if the
/// server answers a keyed read, calls `loaded` with it (which then closes
/// its breaker: it serves). Runs until aborted; a connection made before
/// the receiver was taken is covered by a first load everywhere.
pub(super) async fn keep_loaded(
    scripts: Scripts,
    client: Client,
    kind: Server,
    mut reconnects: broadcast::Receiver<RedisServer>,
    timeout: Duration,
    loaded: impl Fn(&RedisServer) + Send + 'static,
) {
    if client.is_connected() {
        let _ = tokio::time::timeout(timeout, scripts.load_everywhere(&client)).await;
    }
    loop {
        // Which server connected; `None`: some reconnects were missed, so
        // every primary.
        let server = match reconnects.recv().await {
            Ok(server) => Some(server),
            Err(broadcast::error::RecvError::Lagged(_)) => None,
            Err(broadcast::error::RecvError::Closed) => return,
        };
        let load = with_backoff(Instant::now() + LOAD_PATIENCE, || async {
            let load = async {
                match &server {
                    Some(server) => scripts.load_on(&client, server).await,
                    None => scripts.load_everywhere(&client).await,
                }
            };
            match tokio::time::timeout(timeout, load).await {
                Ok(result) => result.map_err(RedisError::from),
                Err(_) => Err(RedisError::Timeout(timeout)),
            }
        })
        .await;
        match load {
            Ok(()) => {
                tracing::debug!(?server, "scripts loaded on a new connection");
                if let Some(server) = &server {
                    if Scripts::serves(&client, kind, server, timeout).await {
                        loaded(server);
                    } else {
                        tracing::debug!(
                            ?server,
                            "reconnected but not serving; the breaker probes as usual"
                        );
                    }
                }
            }
            Err(error) => {
                tracing::warn!(?server, %error, "could not load the scripts after a reconnect");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every placeholder of the scripts is filled from `cache/entry.rs`.
    #[test]
    fn the_scripts_read_the_envelope_layout_from_its_constants() {
        for lua in [with_layout(FINISH_LUA), with_layout(APPLY_LUA)] {
            assert!(!lua.contains('$'), "{lua}");
        }
        let lua = with_layout(FINISH_LUA);
        let status_byte = format!("string.byte(s, {})", entry::STATUS_AT + 1);
        assert!(lua.contains(&status_byte), "{lua}");
        assert!(lua.contains(&format!("== {}", entry::VERSION)));
    }
}
