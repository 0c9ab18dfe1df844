//! Startup: builds the service from its settings, binds, and runs until a
//! shutdown future.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context;
use fred::{clients::SubscriberClient, prelude::*};
use tokio::net::{TcpListener, TcpSocket};
use tokio_util::task::AbortOnDropHandle;

use crate::{
    cache::{Jitter, Keys},
    changes::Feed,
    config::{CacheSettings, DatabaseSettings, ServeArgs},
    http::{self, AppState, ConnectionLimits, Limits},
    read_path::{self, ReadPath},
    redis::{Nodes, RedisCommands, Subscriber},
    store,
    store::{PostStore, Replicas},
    telemetry,
};

/// Longest a shutdown waits for running flights and refreshes (so that a
/// leader still publishes its outcome and releases its lock).
const DRAIN_LIMIT: Duration = Duration::from_secs(10);
/// Longest a shutdown waits for each of Redis's QUIT and the pool's close.
const QUIT_LIMIT: Duration = Duration::from_secs(2);
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
    /// The metrics exporter's upkeep (see `telemetry::metrics::upkeep`).
    _metrics_upkeep: AbortOnDropHandle<()>,
    /// Builds the existence guard whenever it stands aside and the change
    /// feed is up (EXISTENCE_GUARD on).
    _guard: Option<AbortOnDropHandle<()>>,
    /// DATABASE_REPLICA_URLS, and the task that probes them.
    replicas: Option<Arc<Replicas>>,
    _replicas: Option<AbortOnDropHandle<()>>,
    /// What reads that need PostgreSQL's word run on (closed at shutdown).
    past: Arc<store::PastReads>,
    /// SHUTDOWN_DELAY.
    shutdown_delay: Duration,
}

/// The read path's settings from the cache settings, with LOAD_TIMEOUT and
/// LOAD_STATEMENTS as resolved (they depend on the database's settings).
pub fn read_path_settings(c: &CacheSettings, database: &DatabaseSettings) -> read_path::Settings {
    read_path::Settings {
        strategy: c.cache_strategy,
        wake: c.cache_strategy.wake(c.poll_interval),
        batch_loads: c.cache_strategy.batches_loads(),
        cache_ttl: c.cache_ttl,
        negative_ttl: c.negative_ttl,
        jitter: Jitter::new(c.ttl_jitter),
        lock_ttl: c.lock_ttl,
        wait_timeout: c.wait_timeout,
        load_timeout: c.load_timeout(database),
        load_batch_max: c.load_batch_max,
        load_statements: c.load_statements(database),
        load_queue_timeout: database.db_acquire_timeout,
        redis_timeout: c.redis_timeout,
        stale_while_revalidate: c.stale_while_revalidate,
        early_refresh_beta: c.early_refresh_beta,
        max_stale: c.max_stale,
        failure_ttl: c.failure_ttl,
        max_entry_bytes: c.max_entry_bytes,
        // The baselines that measure Redis alone (`none`, `naive`) read
        // without the memory tier.
        memory_bytes: if c.cache_strategy.uses_memory() {
            c.l1_max_bytes
        } else {
            0
        },
        memory_ttl: c.l1_ttl,
        min_lsn_wait: c.min_lsn_wait,
        #[cfg(feature = "testkit")]
        hooks: read_path::Hooks::default(),
    }
}

impl Application {
    pub async fn build(args: ServeArgs) -> anyhow::Result<Self> {
        let settings = read_path_settings(&args.cache, &args.database);
        Self::build_with(args, settings).await
    }

    /// As [`Application::build`], with test observation points in the read path.
    #[cfg(feature = "testkit")]
    pub async fn build_with_hooks(
        args: ServeArgs,
        hooks: read_path::Hooks,
    ) -> anyhow::Result<Self> {
        let settings = read_path::Settings {
            hooks,
            ..read_path_settings(&args.cache, &args.database)
        };
        Self::build_with(args, settings).await
    }

    async fn build_with(args: ServeArgs, settings: read_path::Settings) -> anyhow::Result<Self> {
        install_tls_provider();
        args.validate()?;
        if !args.database_replica_urls.0.is_empty() {
            store::check_replica_lag(args.replica_max_lag, args.fence_ttl())?;
        }
        if !args.no_migrate {
            store::migrate(&args.database).await?;
        }
        let pool = store::connect(&args.database).await?;
        let replicas = connect_replicas(&args)?;
        let (redis, subscriber, nodes) = crate::redis::connect(
            &args.cache.redis_url,
            args.cache.redis_timeout,
            args.cache.redis_tcp(),
        )
        .await?;
        let c = &args.cache;
        let nodes = Arc::new(nodes);
        let commands = RedisCommands::with_nodes(nodes.clone(), c.redis_timeout);
        let upkeep = commands.upkeep();
        let store = match &replicas {
            Some(replicas) => PostStore::with_replicas(pool.clone(), replicas.clone()),
            None => PostStore::new(pool.clone()),
        };
        // The feed's position, as the stream's reader learns it, and
        // PostgreSQL's word on a pool of its own: what reads that ask for a
        // position need (see `read_path/asked.rs`).
        let beats = Arc::new(crate::changes::fanout::Beats::default());
        let past = Arc::new(store::PastReads::new(
            store::connect_past(&args.database, args.past_read_connections)?,
            replicas.clone(),
            args.load_timeout(),
        ));
        let read_path = ReadPath::new(
            store.clone(),
            Keys::new(c.key_prefix.clone(), "post"),
            commands,
            Subscriber::start(subscriber.clone(), c.redis_timeout),
            settings,
            beats.clone(),
            past.clone(),
        );
        let metrics = telemetry::metrics::install();
        let metrics_upkeep =
            AbortOnDropHandle::new(tokio::spawn(telemetry::metrics::upkeep(metrics.clone())));
        let feed = Feed::start(
            args.change_feed,
            &args.database,
            crate::changes::FeedTimeouts {
                retention: args.change_retention,
                replication: args.replication_timeout,
                redis_replica: args.redis_replica_wait,
            },
            &c.key_prefix,
            read_path.clone(),
            beats,
        )
        .await?;
        // With EXISTENCE_GUARD off nobody builds the guard, and it stands
        // aside for good.
        let guard = c.existence_guard.then(|| {
            AbortOnDropHandle::new(tokio::spawn(keep_guard(read_path.clone(), feed.status())))
        });
        let replicas_task = replicas.as_ref().map(|replicas| {
            tracing::info!(
                replicas = replicas.report().len(),
                max_lag_ms = args.replica_max_lag.as_millis() as u64,
                "loads read from replicas that have replayed each key's last change, while the change feed is up in replication mode"
            );
            AbortOnDropHandle::new(tokio::spawn(keep_replicas(replicas.clone(), feed.status())))
        });
        let caching = http::CachingHeaders::new(read_path.settings().stale_while_revalidate);
        let probe_pool = store::connect_probe(&args.database, http::PROBE_TIMEOUT)?;
        let probe = http::Probe::new(probe_pool.clone(), read_path.redis().clone());
        let mut pools = vec![
            ("loads", pool.clone()),
            ("past", past.pool().clone()),
            ("probe", probe_pool),
        ];
        pools.extend(feed.pool().map(|pool| ("feed", pool.clone())));
        let state = AppState::new(http::Shared {
            read_path,
            db: pool,
            probe,
            metrics,
            feed: feed.status(),
            caching,
            replicas: replicas.clone(),
            pools,
            draining: Default::default(),
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
            _metrics_upkeep: metrics_upkeep,
            _guard: guard,
            replicas,
            _replicas: replicas_task,
            past,
            shutdown_delay: args.shutdown_delay,
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
        // At the signal, readiness turns 503 first; the listener stops
        // SHUTDOWN_DELAY later, serving until then (a load balancer takes
        // the instance out of rotation meanwhile).
        let (state, delay) = (self.state.clone(), self.shutdown_delay);
        let shutdown = async move {
            shutdown.await;
            state.drain();
            if !delay.is_zero() {
                tracing::info!(
                    delay = %humantime::format_duration(delay),
                    "draining: /readyz answers 503, requests are served until SHUTDOWN_DELAY has passed"
                );
                tokio::time::sleep(delay).await;
            }
        };
        let (stop_admin, admin_stopped) = tokio::sync::watch::channel(false);
        let admin = self.admin.map(|listener| {
            tracing::info!(addr = ?listener.local_addr().ok(), "admin listening (/livez, /readyz, /metrics)");
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
            self.past.close().await;
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
        .map(|url| store::connect_replica(&args.database, url, http::PROBE_TIMEOUT))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let primary = store::connect_probe(&args.database, http::PROBE_TIMEOUT)?;
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

/// Builds the existence guard (`read_path/existence.rs`) whenever it stands aside
/// while the change feed is up: at start, and after a change to every post
/// or an outage of the feed. Never with CHANGE_FEED=off (it stands aside).
async fn keep_guard(read_path: Arc<ReadPath<PostStore>>, feed: crate::changes::FeedStatus) {
    loop {
        if read_path.existence().wants_build() && feed.get() == crate::changes::FeedState::Up {
            let started = std::time::Instant::now();
            match read_path.build_existence_set().await {
                Ok(true) => {
                    let (ids, bytes) = read_path.existence().usage().unwrap_or_default();
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
