//! The Redis side: the scripts kept loaded on every connection.
//!
//! A Redis that comes back (restarted, failed over, or a new empty node) has
//! forgotten every script. Rather than have a request discover that by a
//! NOSCRIPT and pay SCRIPT LOAD and a second EVALSHA inside its
//! REDIS_TIMEOUT, the scripts are loaded on each connection as soon as it is
//! (re)established, and only then does that reconnect close the breaker.
//! EVALSHA's reload on NOSCRIPT stays as the fallback for a server that lost
//! its scripts without a reconnect (SCRIPT FLUSH).

use std::time::{Duration, Instant};

use fred::{prelude::*, types::config::Server as RedisServer};
use tokio::sync::broadcast;

use super::registry::Scripts;
use crate::redis::error::{is_outage, with_backoff, RedisError};

/// What a client of the read path is connected to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::redis) enum Server {
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

/// SCRIPT LOAD of every script on `server`: the node that just
/// connected on a cluster, the one server otherwise.
async fn load_on(
    scripts: &Scripts,
    client: &Client,
    server: &RedisServer,
) -> Result<(), fred::error::Error> {
    let options = fred::types::config::Options {
        cluster_node: client.is_clustered().then(|| server.clone()),
        ..Default::default()
    };
    let node = client.with_options(&options);
    for script in scripts.all() {
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
async fn serves(client: &Client, kind: Server, server: &RedisServer, timeout: Duration) -> bool {
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
async fn load_everywhere(scripts: &Scripts, client: &Client) -> Result<(), fred::error::Error> {
    for script in scripts.all() {
        script.load(client).await?;
    }
    Ok(())
}

/// Loads the scripts on each connection of `client` as it is (re)established
/// (`reconnects`, taken from the client before it connects), then, if the
/// server answers a keyed read, calls `loaded` with it (which then closes
/// its breaker: it serves). Runs until aborted; a connection made before
/// the receiver was taken is covered by a first load everywhere.
pub(in crate::redis) async fn keep_loaded(
    scripts: Scripts,
    client: Client,
    kind: Server,
    mut reconnects: broadcast::Receiver<RedisServer>,
    timeout: Duration,
    loaded: impl Fn(&RedisServer) + Send + 'static,
) {
    if client.is_connected() {
        let _ = tokio::time::timeout(timeout, load_everywhere(&scripts, &client)).await;
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
                    Some(server) => load_on(&scripts, &client, server).await,
                    None => load_everywhere(&scripts, &client).await,
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
                    if serves(&client, kind, server, timeout).await {
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
