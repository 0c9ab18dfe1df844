//! Startup: builds the service from its settings, binds, and runs until a
//! shutdown future.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context;
use fred::{
    clients::SubscriberClient,
    prelude::*,
    types::config::{ClusterDiscoveryPolicy, Config as RedisConfig, ReconnectPolicy, ServerConfig},
};
use tokio::net::{TcpListener, TcpSocket};
use tokio_util::task::AbortOnDropHandle;

use crate::{
    cache::{Jitter, Keys},
    changes::Feed,
    config::{CacheSettings, DatabaseSettings, ServeArgs},
    db,
    flight::{self, ReadPath},
    http::{self, AppState, ConnectionLimits, Limits},
    posts::{PostStore, Replicas},
    redis::{Nodes, RedisCommands, Subscriber},
    telemetry,
};

/// Longest the service waits for Redis at start before serving fail-open.
const REDIS_STARTUP_WAIT: Duration = Duration::from_secs(2);
/// Longest a shutdown waits for running flights and refreshes (so that a
/// leader still publishes its outcome and releases its lock).
const DRAIN_LIMIT: Duration = Duration::from_secs(10);
/// Longest a shutdown waits for each of Redis's QUIT and the pool's close.
const QUIT_LIMIT: Duration = Duration::from_secs(2);
/// Reconnect delays: from 50 ms doubling up to 100 ms, for ever, plus up to
/// RECONNECT_JITTER_MS. Short, because a Redis that comes back empty must be
/// found within a fraction of a second (the read path fails open meanwhile,
/// loading from PostgreSQL); a refused connection costs Redis nothing.
const RECONNECT_MIN_MS: u32 = 50;
const RECONNECT_MAX_MS: u32 = 100;
const RECONNECT_JITTER_MS: u32 = 50;

/// Connections the kernel queues for the accept loop (capped by the
/// system's `somaxconn`). Larger than the usual 1,024, so that a burst of new
/// connections is accepted, or refused with a 503 past MAX_CONNECTIONS, at
/// once rather than dropped and retried by the client's TCP a second later.
const LISTEN_BACKLOG: u32 = 4096;

/// A built, bound, not yet running service.
pub struct Application {
    listener: TcpListener,
    /// ADMIN_ADDR's listener, when set.
    admin: Option<TcpListener>,
    endpoint: http::Endpoint,
    connections: ConnectionLimits,
    state: AppState,
    redis: Client,
    subscriber: SubscriberClient,
    /// On a cluster, the clients of its nodes, stopped at shutdown.
    nodes: Arc<Nodes>,
    /// The change feed (and the cutoff's follower) while the service runs.
    feed: Feed,
    /// The Redis connections' upkeep (scripts, cluster topology) while the
    /// service runs.
    _upkeep: Option<AbortOnDropHandle<()>>,
    /// Builds the existence guard whenever it stands aside and the change
    /// feed is up.
    _guard: AbortOnDropHandle<()>,
    /// DATABASE_REPLICA_URLS, and the task that probes them.
    replicas: Option<Arc<Replicas>>,
    _replicas: Option<AbortOnDropHandle<()>>,
}

/// The read path's settings from the cache settings, with LOAD_TIMEOUT and
/// LOAD_STATEMENTS as resolved (they depend on the database's settings).
pub fn read_path_settings(c: &CacheSettings, database: &DatabaseSettings) -> flight::Settings {
    flight::Settings {
        strategy: c.cache_strategy,
        wake: flight::Wake::of(c.cache_strategy, c.poll_interval),
        cache_ttl: c.cache_ttl,
        negative_ttl: c.negative_ttl,
        jitter: Jitter::new(c.ttl_jitter),
        lock_ttl: c.lock_ttl,
        wait_timeout: c.wait_timeout,
        load_timeout: c.load_timeout(database),
        load_batch_max: c.load_batch_max,
        load_statements: c.load_statements(database),
        load_queue_timeout: database.db_acquire_timeout,
        existence_guard: c.existence_guard,
        redis_timeout: c.redis_timeout,
        stale_while_revalidate: c.stale_while_revalidate,
        early_refresh_beta: c.early_refresh_beta,
        max_stale: c.max_stale,
        failure_ttl: c.failure_ttl,
        max_entry_bytes: c.max_entry_bytes,
        memory_bytes: c.l1_max_bytes,
        memory_ttl: c.l1_ttl,
        #[cfg(feature = "testkit")]
        hooks: flight::Hooks::default(),
    }
}

impl Application {
    pub async fn build(args: ServeArgs) -> anyhow::Result<Self> {
        let settings = read_path_settings(&args.cache, &args.database);
        Self::build_with(args, settings).await
    }

    /// As [`Application::build`], with test observation points in the read path.
    #[cfg(feature = "testkit")]
    pub async fn build_with_hooks(args: ServeArgs, hooks: flight::Hooks) -> anyhow::Result<Self> {
        let settings = flight::Settings {
            hooks,
            ..read_path_settings(&args.cache, &args.database)
        };
        Self::build_with(args, settings).await
    }

    async fn build_with(args: ServeArgs, settings: flight::Settings) -> anyhow::Result<Self> {
        install_tls_provider();
        args.validate()?;
        if !args.no_migrate {
            db::migrate(&args.database).await?;
        }
        let pool = db::connect(&args.database).await?;
        let replicas = connect_replicas(&args)?;
        let (redis, subscriber, nodes) = connect_redis(&args).await?;
        let c = &args.cache;
        let nodes = Arc::new(nodes);
        let commands = RedisCommands::with_nodes(nodes.clone(), c.redis_timeout);
        let upkeep = commands.upkeep();
        let store = match &replicas {
            Some(replicas) => PostStore::with_replicas(pool.clone(), replicas.clone()),
            None => PostStore::new(pool.clone()),
        };
        let read_path = ReadPath::new(
            store,
            Keys::new(c.key_prefix.clone(), "post"),
            commands,
            Subscriber::start(subscriber.clone(), c.redis_timeout),
            settings,
        );
        let metrics = telemetry::metrics::install();
        let feed = Feed::start(
            args.change_feed,
            &args.database,
            args.change_retention,
            &c.key_prefix,
            read_path.clone(),
        )
        .await?;
        let guard =
            AbortOnDropHandle::new(tokio::spawn(keep_guard(read_path.clone(), feed.status())));
        let replicas_task = replicas.as_ref().map(|replicas| {
            tracing::info!(
                replicas = replicas.report().len(),
                max_lag_ms = args.replica_max_lag.as_millis() as u64,
                "loads read from replicas that have replayed each key's last change, while the change feed is up in replication mode"
            );
            AbortOnDropHandle::new(tokio::spawn(keep_replicas(replicas.clone(), feed.status())))
        });
        let caching = http::CachingHeaders::new(read_path.settings().stale_while_revalidate);
        let probe = http::Probe::new(
            db::connect_probe(&args.database, http::PROBE_TIMEOUT)?,
            read_path.redis().clone(),
        );
        let state = AppState::new(http::Shared {
            read_path,
            db: pool,
            probe,
            metrics,
            feed: feed.status(),
            caching,
            replicas: replicas.clone(),
        });
        let limits = Limits {
            max_in_flight: args.max_in_flight,
            request_timeout: args.request_timeout,
        };
        let listener = bind(args.listen_addr)
            .with_context(|| format!("failed to bind {}", args.listen_addr))?;
        let admin = match args.admin_addr.0 {
            Some(addr) => {
                Some(bind(addr).with_context(|| format!("failed to bind ADMIN_ADDR {addr}"))?)
            }
            None => None,
        };
        let connections = ConnectionLimits {
            header_read_timeout: args.header_read_timeout,
            idle_timeout: args.idle_timeout,
            max_connections: http::connection_cap(
                args.max_connections,
                args.database.db_max_connections,
            ),
        };
        Ok(Self {
            endpoint: http::Endpoint::new(state.clone(), limits),
            connections,
            listener,
            admin,
            state,
            redis,
            subscriber,
            nodes,
            feed,
            _upkeep: upkeep,
            _guard: guard,
            replicas,
            _replicas: replicas_task,
        })
    }

    /// The bound address (the chosen port when LISTEN_ADDR had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// ADMIN_ADDR's bound address, when set.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        let admin = self.admin.as_ref()?;
        Some(admin.local_addr().expect("a bound listener has an address"))
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until `shutdown` completes, then lets in-flight requests finish.
    pub async fn run_until_stopped(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        tracing::info!(addr = %self.local_addr(), "listening");
        let (stop_admin, admin_stopped) = tokio::sync::watch::channel(false);
        let admin = self.admin.map(|listener| {
            tracing::info!(addr = ?listener.local_addr().ok(), "admin listening (/metrics, /readyz)");
            let mut stopped = admin_stopped.clone();
            let app = http::admin_app(self.state.clone());
            tokio::spawn(async move {
                let until = async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                };
                if let Err(error) = axum::serve(listener, app).with_graceful_shutdown(until).await {
                    tracing::warn!(%error, "the admin listener failed");
                }
            })
        });
        http::serve(self.listener, self.endpoint, self.connections, shutdown).await;
        stop_admin.send_replace(true);
        if let Some(admin) = admin {
            if tokio::time::timeout(QUIT_LIMIT, admin).await.is_err() {
                tracing::warn!("admin connections still open at shutdown; closing anyway");
            }
        }
        tracing::info!("stopped accepting; finishing flights and refreshes");
        if !self.state.read_path.drain(DRAIN_LIMIT).await {
            tracing::warn!("flights still running at shutdown; their locks expire by themselves");
        }
        self.feed.stop().await;
        // QUIT waits for a connection: bounded, so that a shutdown while Redis
        // is down (the clients reconnecting for ever) still ends.
        let quit = async {
            let _ = self.subscriber.quit().await;
            let _ = self.redis.quit().await;
            self.nodes.stop().await;
        };
        if tokio::time::timeout(QUIT_LIMIT, quit).await.is_err() {
            tracing::warn!("redis did not answer QUIT; closing anyway");
        }
        let close = async {
            self.state.db.close().await;
            self.state.probe.close().await;
            if let Some(replicas) = &self.replicas {
                replicas.close().await;
            }
        };
        if tokio::time::timeout(QUIT_LIMIT, close).await.is_err() {
            tracing::warn!("postgres connections did not close in time; exiting anyway");
        }
        Ok(())
    }
}

/// Binds the listener with a listen queue of LISTEN_BACKLOG.
fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // As std's bind does: a restarted instance can bind at once although
    // connections of the previous one linger in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Reads REDIS_URL: `redis://` or `rediss://` for one server,
/// `redis-cluster://host:port[,host:port…]` (or `rediss-cluster://`) for a
/// Redis Cluster, whose nodes may also be given as `?node=host:port`.
pub fn redis_config(url: &str) -> anyhow::Result<RedisConfig> {
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

/// The client builder of REDIS_URL with the service's connection policy:
/// reconnecting for ever, each command bounded by REDIS_TIMEOUT.
fn redis_builder(cache: &CacheSettings) -> anyhow::Result<Builder> {
    let config = redis_config(&cache.redis_url)?;
    let mut builder = Builder::from_config(config);
    builder
        .set_policy({
            let mut policy =
                ReconnectPolicy::new_exponential(0, RECONNECT_MIN_MS, RECONNECT_MAX_MS, 2);
            policy.set_jitter(RECONNECT_JITTER_MS);
            policy
        })
        .with_connection_config(|c| {
            c.connection_timeout = cache.redis_timeout.max(Duration::from_millis(500));
            c.internal_command_timeout = cache.redis_timeout.max(Duration::from_millis(500));
        })
        .with_performance_config(|p| {
            // Each command bounded inside the client too: a command whose
            // own bound fires is marked, and the client does not replay it on
            // the next connection. (The read path's bound, the same
            // REDIS_TIMEOUT, may fire first, or the request go away, and then
            // the command can still be replayed: a lock attempt left that way
            // is released behind it, see `leader.rs`.)
            p.default_command_timeout = cache.redis_timeout;
            // The shared subscriber's fan-out buffer: a stampede over many
            // keys must not lag it (a lag costs every waiter a re-check).
            p.broadcast_channel_capacity = 4096;
        });
    Ok(builder)
}

/// The commands of REDIS_URL for a one-shot command (`invalidate`): one
/// client, connected (a cluster client routes each key by itself).
pub async fn redis_commands(cache: &CacheSettings) -> anyhow::Result<RedisCommands> {
    let client = redis_builder(cache)?
        .build()
        .context("invalid Redis settings")?;
    drop(client.connect());
    tokio::time::timeout(REDIS_STARTUP_WAIT, client.wait_for_connect())
        .await
        .context("Redis did not answer")?
        .context("failed to connect to Redis")?;
    Ok(RedisCommands::new(client, cache.redis_timeout))
}

/// The command client, the shared subscriber (both reconnecting for ever),
/// and where each key's commands go: on a cluster, a client per primary,
/// made with the same settings as its node appears.
async fn connect_redis(args: &ServeArgs) -> anyhow::Result<(Client, SubscriberClient, Nodes)> {
    let builder = redis_builder(&args.cache)?;
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

/// Completes on ctrl-c or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutdown signal received");
}

/// Makes ring the process's TLS provider (fred, sqlx and the replication
/// connection all use rustls; with two providers compiled in, rustls would
/// not choose). Idempotent.
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// How often the guard's keeper looks whether a build is wanted.
const GUARD_CHECK: Duration = Duration::from_millis(200);

/// The read replicas' pools (none when DATABASE_REPLICA_URLS is empty).
fn connect_replicas(args: &ServeArgs) -> anyhow::Result<Option<Arc<Replicas>>> {
    if args.database_replica_urls.0.is_empty() {
        return Ok(None);
    }
    let replicas = args
        .database_replica_urls
        .0
        .iter()
        .map(|url| db::connect_replica(&args.database, url, http::PROBE_TIMEOUT))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let primary = db::connect_probe(&args.database, http::PROBE_TIMEOUT)?;
    Ok(Some(Arc::new(Replicas::new(
        replicas,
        primary,
        args.replica_max_lag,
        args.fence_ttl(),
        args.load_timeout(),
    ))))
}

/// Probes the replicas, and tells them whether the change feed is up in
/// replication mode (only then are its fences LSNs, and set for every
/// change).
async fn keep_replicas(replicas: Arc<Replicas>, feed: crate::changes::FeedStatus) {
    let probe = async {
        replicas.probe_forever().await;
    };
    let follow = async {
        let mut said = None;
        loop {
            let report = feed.report();
            let up = feed.get() == crate::changes::FeedState::Up
                && report.mode == Some(crate::changes::Mode::Replication);
            replicas.set_feed_up(up);
            if report.mode.is_some()
                && report.mode != Some(crate::changes::Mode::Replication)
                && said.is_none()
            {
                tracing::error!(
                    mode = report.mode.map(|m| m.as_str()),
                    "DATABASE_REPLICA_URLS is set but the change feed is not in replication mode (wal_level is not logical?): every load reads the primary"
                );
                said = Some(());
            }
            tokio::time::sleep(FEED_CHECK).await;
        }
    };
    tokio::join!(probe, follow);
}

/// How often the replicas learn whether the change feed is up.
const FEED_CHECK: std::time::Duration = std::time::Duration::from_millis(50);

/// Builds the existence guard (`flight/guard.rs`) whenever it stands aside
/// while the change feed is up: at start, and after a change to every post
/// or an outage of the feed. Never with CHANGE_FEED=off (it stands aside).
async fn keep_guard(read_path: Arc<ReadPath<PostStore>>, feed: crate::changes::FeedStatus) {
    loop {
        let wanted = read_path.settings().existence_guard && read_path.guard().wants_build();
        if wanted && feed.get() == crate::changes::FeedState::Up {
            let started = std::time::Instant::now();
            match read_path.build_guard().await {
                Ok(true) => {
                    let (ids, bytes) = read_path.guard().usage().unwrap_or_default();
                    crate::telemetry::metrics::guard(ids, bytes, started.elapsed());
                    tracing::info!(
                        ids,
                        bytes,
                        took_ms = started.elapsed().as_millis() as u64,
                        "existence guard built"
                    );
                }
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(
                        error = format!("{error:#}"),
                        "existence guard build failed; retrying"
                    )
                }
            }
        }
        tokio::time::sleep(GUARD_CHECK).await;
    }
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
        let config = redis_config("redis-cluster://127.0.0.1:7000,127.0.0.1:7001").unwrap();
        assert!(config.server.is_clustered());
        // The topology is re-read from the nodes last seen, not only these.
        let ServerConfig::Clustered { policy, .. } = &config.server else {
            panic!("a cluster")
        };
        assert_eq!(*policy, ClusterDiscoveryPolicy::UseCache);
        assert!(!redis_config("redis://127.0.0.1:6379")
            .unwrap()
            .server
            .is_clustered());
    }
}
