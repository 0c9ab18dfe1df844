//! Connecting to Redis: REDIS_URL read into the client's settings, the
//! service's reconnect and timeout policy, and the clients made from them
//! (the serving instance's, and a one-shot command's).

use std::time::Duration;

use anyhow::Context;
use fred::{
    clients::SubscriberClient,
    prelude::*,
    types::config::{ClusterDiscoveryPolicy, Config as RedisConfig, ReconnectPolicy, ServerConfig},
};

use super::{Nodes, RedisCommands};

/// Longest the service waits for Redis at start before serving fail-open.
const REDIS_STARTUP_WAIT: Duration = Duration::from_secs(2);
/// Reconnect delays: from 50 ms doubling up to 100 ms, for ever, plus up to
/// RECONNECT_JITTER_MS. Short, because a Redis that comes back empty must be
/// found within a fraction of a second (the read path fails open meanwhile,
/// loading from PostgreSQL); a refused connection costs Redis nothing.
const RECONNECT_MIN_MS: u32 = 50;
const RECONNECT_MAX_MS: u32 = 100;
const RECONNECT_JITTER_MS: u32 = 50;

/// Reads REDIS_URL: `redis://` or `rediss://` for one server,
/// `redis-cluster://host:port[,host:port…]` (or `rediss-cluster://`) for a
/// Redis Cluster, whose nodes may also be given as `?node=host:port`.
pub fn config_from_url(url: &str) -> anyhow::Result<RedisConfig> {
    let url = cluster_nodes_as_query(url);
    // The URL may hold a password: never put it in an error message.
    let mut config = RedisConfig::from_url(&url)
        .map_err(|e| anyhow::anyhow!("invalid REDIS_URL: {}", e.kind().to_str()))?;
    // Redis down at start is not fatal: keep reconnecting, serve fail-open meanwhile.
    config.fail_fast = false;
    // The topology is re-read from any node of the last one known, as well
    // as from REDIS_URL's (whose names are resolved again each time). The
    // client library's default asks REDIS_URL's nodes only: with one seed
    // named, a failover of that seed was never seen, and its slots stayed
    // on the dead node, bypassed, for good.
    if config.server.is_clustered() {
        config
            .server
            .set_cluster_discovery_policy(ClusterDiscoveryPolicy::UseCache)
            .expect("a cluster's server settings");
    }
    Ok(config)
}

/// `redis-cluster://a:1,b:2,c:3` → `redis-cluster://a:1?node=b:2&node=c:3`,
/// the form the client library reads.
fn cluster_nodes_as_query(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    if !scheme.ends_with("-cluster") {
        return url.to_owned();
    }
    let (authority, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let (credentials, hosts) = match authority.rsplit_once('@') {
        Some((c, h)) => (format!("{c}@"), h),
        None => (String::new(), authority),
    };
    let mut hosts = hosts.split(',').filter(|h| !h.is_empty());
    let Some(first) = hosts.next() else {
        return url.to_owned();
    };
    let extra: Vec<String> = hosts.map(|h| format!("node={h}")).collect();
    if extra.is_empty() {
        return url.to_owned();
    }
    let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
    let mut params: Vec<String> = query
        .split('&')
        .filter(|q| !q.is_empty())
        .map(str::to_owned)
        .collect();
    params.extend(extra);
    format!("{scheme}://{credentials}{first}{path}?{}", params.join("&"))
}

/// The TCP settings of every Redis connection (REDIS_TCP_KEEPALIVE,
/// REDIS_TCP_USER_TIMEOUT; zero: off): a connection whose peer is gone
/// without a word (a host lost, a NAT entry dropped) fails and is made
/// again, instead of holding its commands until the kernel gives up on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tcp {
    pub keepalive: Duration,
    pub user_timeout: Duration,
}

impl Tcp {
    fn config(self) -> fred::types::config::TcpConfig {
        let keepalive = (!self.keepalive.is_zero()).then(|| {
            fred::socket2::TcpKeepalive::new()
                .with_time(self.keepalive)
                .with_interval((self.keepalive / 3).max(Duration::from_secs(1)))
                .with_retries(3)
        });
        fred::types::config::TcpConfig {
            keepalive,
            user_timeout: (!self.user_timeout.is_zero()).then_some(self.user_timeout),
            ..Default::default()
        }
    }
}

/// The client builder of REDIS_URL with the service's connection policy:
/// reconnecting for ever, each command bounded by REDIS_TIMEOUT.
fn builder(url: &str, timeout: Duration, tcp: Tcp) -> anyhow::Result<Builder> {
    let config = config_from_url(url)?;
    let mut builder = Builder::from_config(config);
    builder
        .set_policy({
            let mut policy =
                ReconnectPolicy::new_exponential(0, RECONNECT_MIN_MS, RECONNECT_MAX_MS, 2);
            policy.set_jitter(RECONNECT_JITTER_MS);
            policy
        })
        .with_connection_config(|c| {
            c.connection_timeout = timeout.max(Duration::from_millis(500));
            c.internal_command_timeout = timeout.max(Duration::from_millis(500));
            c.tcp = tcp.config();
        })
        .with_performance_config(|p| {
            // Each command bounded inside the client too: a command whose
            // own bound fires is marked, and the client does not replay it on
            // the next connection. (The read path's bound, the same
            // REDIS_TIMEOUT, may fire first, or the request go away, and then
            // the command can still be replayed: a lock attempt left that way
            // is released behind it, see `leader.rs`.)
            p.default_command_timeout = timeout;
            // The shared subscriber's fan-out buffer: a stampede over many
            // keys must not lag it (a lag costs every waiter a re-check).
            p.broadcast_channel_capacity = 4096;
        });
    Ok(builder)
}

/// The commands of REDIS_URL for a one-shot command (`invalidate`): one
/// client, connected (a cluster client routes each key by itself).
pub async fn connect_commands(
    url: &str,
    timeout: Duration,
    tcp: Tcp,
) -> anyhow::Result<RedisCommands> {
    let client = builder(url, timeout, tcp)?
        .build()
        .context("invalid Redis settings")?;
    drop(client.connect());
    tokio::time::timeout(REDIS_STARTUP_WAIT, client.wait_for_connect())
        .await
        .context("Redis did not answer")?
        .context("failed to connect to Redis")?;
    Ok(RedisCommands::new(client, timeout))
}

/// The command client, the shared subscriber (both reconnecting for ever),
/// and where each key's commands go: on a cluster, a client per primary,
/// made with the same settings as its node appears.
pub async fn connect(
    url: &str,
    timeout: Duration,
    tcp: Tcp,
) -> anyhow::Result<(Client, SubscriberClient, Nodes)> {
    let builder = builder(url, timeout, tcp)?;
    let client = builder.build().context("invalid Redis settings")?;
    let subscriber = builder
        .build_subscriber_client()
        .context("invalid Redis settings")?;
    // The connection tasks run (and reconnect) in the background.
    drop(client.connect());
    drop(subscriber.connect());
    let ready = async {
        client.wait_for_connect().await?;
        subscriber.wait_for_connect().await
    };
    match tokio::time::timeout(REDIS_STARTUP_WAIT, ready).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "redis unavailable at start; serving fail-open"),
        Err(_) => tracing::warn!("redis unavailable at start; serving fail-open"),
    }
    let nodes = if client.is_clustered() {
        Nodes::cluster(client.clone(), move |server| {
            let mut node = builder.clone();
            let mut config = node.get_config().cloned().unwrap_or_default();
            config.server = ServerConfig::Centralized {
                server: server.clone(),
            };
            node.set_config(config);
            Ok(node.build()?)
        })
    } else {
        Nodes::single(client.clone())
    };
    Ok((client, subscriber, nodes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_list_their_nodes_with_commas() {
        assert_eq!(
            cluster_nodes_as_query("redis-cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002"),
            "redis-cluster://127.0.0.1:7000?node=127.0.0.1:7001&node=127.0.0.1:7002"
        );
        assert_eq!(
            cluster_nodes_as_query("rediss-cluster://u:p@a:1,b:2"),
            "rediss-cluster://u:p@a:1?node=b:2"
        );
        assert_eq!(cluster_nodes_as_query("redis://a:1"), "redis://a:1");
        assert_eq!(
            cluster_nodes_as_query("redis-cluster://a:1?node=b:2"),
            "redis-cluster://a:1?node=b:2"
        );
        let config = config_from_url("redis-cluster://127.0.0.1:7000,127.0.0.1:7001").unwrap();
        assert!(config.server.is_clustered());
        // The topology is re-read from the nodes last seen, not only these.
        let ServerConfig::Clustered { policy, .. } = &config.server else {
            panic!("a cluster")
        };
        assert_eq!(*policy, ClusterDiscoveryPolicy::UseCache);
        assert!(!config_from_url("redis://127.0.0.1:6379")
            .unwrap()
            .server
            .is_clustered());
    }
}
