//! Test support: each test gets its own database and KEY_PREFIX, and runs the
//! real service in-process on 127.0.0.1:0 against the real PostgreSQL and Redis.
#![allow(dead_code)] // each test binary uses a different part of this module

// Defined before the submodules, which use it.
/// Waits while `$cond` holds (it may `.await`), failing the test after 30 s:
/// no test waits without a bound.
#[macro_export]
macro_rules! wait_while {
    ($what:expr, $cond:expr) => {{
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while $cond {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {}",
                $what
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }};
}

pub mod faults;
pub mod scenarios;

use std::{
    sync::Once,
    time::{Duration, Instant},
};

use clap::Parser;
use fred::prelude::*;
use postcache::{
    cache::{Entry, Keys},
    cli::seed::generate,
    config::{Cli, Command, ServeArgs},
    flight::Hooks,
    http::AppState,
    posts::PostStore,
    startup::Application,
};
use rand::Rng;
use sqlx::{postgres::PgPoolOptions, Connection, PgConnection, PgPool};
use tokio::{sync::oneshot, task::JoinHandle};

/// The PostgreSQL server the tests use (override with TEST_DATABASE_URL).
pub fn server_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// The Redis server the tests use (override with TEST_REDIS_URL).
pub fn redis_url() -> String {
    std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

static TRACING: Once = Once::new();

/// Logs are silent unless TEST_LOG is set.
pub fn init_tracing() {
    TRACING.call_once(|| {
        if std::env::var_os("TEST_LOG").is_some() {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_env("TEST_LOG")
                        .unwrap_or_else(|_| "debug,sqlx=warn,fred=info".into()),
                )
                .with_test_writer()
                .init();
        }
    });
}

/// One test's world: a fresh, migrated, seeded database and a key prefix.
pub struct TestEnv {
    pub db_name: String,
    pub db_url: String,
    pub prefix: String,
    pub keys: Keys,
    /// A pool for the test's own SQL (not counted: it never reads `posts`
    /// except through [`TestEnv::post_reads`]'s statistics).
    pub admin: PgPool,
    pub redis: Client,
    pub redis_url: String,
}

impl TestEnv {
    /// A database with posts 1..=posts seeded.
    pub async fn new(posts: u64) -> Self {
        Self::with_redis(posts, redis_url()).await
    }

    pub async fn with_redis(posts: u64, redis_url: String) -> Self {
        Self::build(posts, redis_url, true).await
    }

    /// As [`TestEnv::with_redis`] for a Redis that may be down: the test's own
    /// client connects in the background.
    pub async fn with_redis_lazy(posts: u64, redis_url: String) -> Self {
        Self::build(posts, redis_url, false).await
    }

    async fn build(posts: u64, redis_url: String, redis_up: bool) -> Self {
        init_tracing();
        let tag = format!("{:016x}", rand::rng().random::<u64>());
        let db_name = format!("postcache_test_{tag}");
        let db_url = format!("{}/{db_name}", server_url());
        let settings = postcache::config::DatabaseSettings {
            database_url: db_url.clone(),
            db_max_connections: 4,
            db_acquire_timeout: Duration::from_secs(10),
            db_statement_timeout: Duration::from_secs(30),
        };
        postcache::db::migrate(&settings)
            .await
            .expect("failed to create the test database");
        if posts > 0 {
            let store = PostStore::new(postcache::db::connect(&settings).await.unwrap());
            let all: Vec<_> = (1..=posts as i64).map(|id| generate(id, 1)).collect();
            for chunk in all.chunks(5_000) {
                store.upsert_batch(chunk).await.expect("failed to seed");
            }
            store.pool().close().await;
        }
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect(&db_url)
            .await
            .expect("failed to connect to the test database");
        let redis = Builder::from_config(postcache::startup::redis_config(&redis_url).unwrap())
            .set_policy(fred::types::config::ReconnectPolicy::new_constant(0, 100))
            .build()
            .unwrap();
        if redis_up {
            redis.init().await.expect("failed to connect to Redis");
        } else {
            drop(redis.connect());
        }
        let prefix = format!("t{tag}:");
        Self {
            keys: Keys::new(prefix.clone(), "post"),
            db_name,
            db_url,
            prefix,
            admin,
            redis,
            redis_url,
        }
    }

    /// The settings of an instance of this world, plus `extra` flags.
    pub fn serve_args(&self, extra: &[&str]) -> ServeArgs {
        let mut argv = vec![
            "postcache",
            "serve",
            "--database-url",
            &self.db_url,
            "--redis-url",
            &self.redis_url,
            "--key-prefix",
            &self.prefix,
            "--listen-addr",
            "127.0.0.1:0",
            "--no-migrate",
        ];
        // A flag in `extra` replaces the same flag of the base settings.
        for flag in extra.iter().filter(|a| a.starts_with("--")) {
            if let Some(at) = argv.iter().position(|a| a == flag) {
                argv.drain(at..at + 2);
            }
        }
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv)
            .expect("valid test settings")
            .command
        {
            Command::Serve(args) => *args,
            _ => unreachable!("serve was asked for"),
        }
    }

    /// Starts an instance with `extra` flags.
    pub async fn spawn(&self, extra: &[&str]) -> TestApp {
        self.spawn_with_hooks(extra, Hooks::default()).await
    }

    pub async fn spawn_with_hooks(&self, extra: &[&str], hooks: Hooks) -> TestApp {
        let app = Application::build_with_hooks(self.serve_args(extra), hooks)
            .await
            .expect("failed to build the app");
        let addr = app.local_addr();
        let state = app.state().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            app.run_until_stopped(async {
                let _ = stopped.await;
            })
            .await
            .expect("server failed");
        });
        TestApp {
            base: format!("http://{addr}"),
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(1024)
                .build()
                .unwrap(),
            state,
            stop: Some(stop),
            handle: Some(handle),
        }
    }

    /// Reads of `posts` counted by PostgreSQL itself (sequential plus index
    /// scans). Counts are exact only once the backends that did the reads
    /// have flushed their statistics, which they do when they exit: call this
    /// after the instances are stopped (their pools closed).
    pub async fn post_reads(&self) -> i64 {
        let mut conn = self.after_service_backends_exit().await;
        let mut last = -1;
        loop {
            let reads: i64 = sqlx::query_scalar(
                "select (coalesce(seq_scan, 0) + coalesce(idx_scan, 0))::bigint
                 from pg_stat_user_tables where relname = 'posts'",
            )
            .fetch_one(&mut conn)
            .await
            .unwrap();
            if reads == last {
                return reads;
            }
            last = reads;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A connection to the test database, once every backend of the service
    /// has exited (and so flushed its statistics).
    pub async fn after_service_backends_exit(&self) -> PgConnection {
        let mut conn = PgConnection::connect(&self.db_url).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let others: i64 = sqlx::query_scalar(
                "select count(*) from pg_stat_activity
                 where datname = current_database() and pid <> pg_backend_pid()
                   and backend_type = 'client backend'
                   and application_name = 'postcache'",
            )
            .fetch_one(&mut conn)
            .await
            .unwrap();
            if others == 0 {
                return conn;
            }
            assert!(Instant::now() < deadline, "service backends did not exit");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The stored entry of a post, decoded.
    pub async fn stored(&self, id: i64) -> Option<Entry> {
        let raw: Option<bytes::Bytes> = self.redis.get(self.keys.value(id)).await.unwrap();
        raw.map(|raw| Entry::decode(raw).expect("a decodable entry"))
    }

    /// PTTL of a key, in milliseconds (-2 absent, -1 no expiry).
    pub async fn pttl(&self, key: &str) -> i64 {
        self.redis.pttl(key).await.unwrap()
    }

    /// Subscribers of a channel on the server: PUBSUB NUMSUB, or on a
    /// cluster PUBSUB SHARDNUMSUB summed over every primary.
    pub async fn numsub(&self, channel: &str) -> i64 {
        let count = |reply: Vec<Value>| reply.get(1).and_then(Value::as_i64).unwrap_or(0);
        if !self.redis.is_clustered() {
            return count(self.redis.pubsub_numsub(channel).await.unwrap());
        }
        let mut total = 0;
        let state = self.redis.cached_cluster_state().expect("cluster state");
        for server in state.unique_primary_nodes() {
            let node = self.redis.with_cluster_node(&server);
            total += count(node.pubsub_shardnumsub(channel).await.unwrap());
            total += count(node.pubsub_numsub(channel).await.unwrap());
        }
        total
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // Drop the database from a thread of its own: Drop cannot await, and
        // the test's runtime may be shutting down.
        let url = server_url();
        let name = self.db_name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut conn) = PgConnection::connect(&format!("{url}/postgres")).await {
                    let _ =
                        sqlx::query(&format!("drop database if exists \"{name}\" with (force)"))
                            .execute(&mut conn)
                            .await;
                }
            });
        })
        .join();
    }
}

/// One running instance.
pub struct TestApp {
    pub base: String,
    pub http: reqwest::Client,
    pub state: AppState,
    stop: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<()>>,
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub x_cache: Option<String>,
    pub content_type: Option<String>,
    pub body: bytes::Bytes,
    pub headers: reqwest::header::HeaderMap,
}

impl Reply {
    #[track_caller]
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    #[track_caller]
    pub fn error(&self) -> String {
        self.json()["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error field in {:?}", self.json()))
            .to_owned()
    }
}

impl TestApp {
    pub async fn get(&self, path: &str) -> Reply {
        self.request(reqwest::Method::GET, path).await
    }

    pub async fn request(&self, method: reqwest::Method, path: &str) -> Reply {
        let response = self
            .http
            .request(method, format!("{}{path}", self.base))
            .send()
            .await
            .expect("request failed");
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        let x_cache = header("x-cache");
        let content_type = header("content-type");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await.expect("body failed");
        Reply {
            status,
            x_cache,
            content_type,
            body,
            headers,
        }
    }

    /// Closes the instance's idle PostgreSQL connections, so that their
    /// backends exit and flush their statistics; the pool reconnects on demand.
    pub async fn stop_pool_connections(&self) {
        let pool = &self.state.db;
        // Idle connections are dropped when the pool is told to keep none.
        while pool.num_idle() > 0 {
            if let Some(conn) = pool.try_acquire() {
                let _ = conn.detach().close().await;
            } else {
                tokio::task::yield_now().await;
            }
        }
    }

    /// Reads this instance has not answered yet.
    pub fn reads_in_progress(&self) -> usize {
        self.state.read_path.reads_in_progress()
    }

    /// Graceful stop: waits for in-flight requests and closes the pools.
    pub async fn stop(mut self) {
        self.shutdown().await;
    }

    async fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(handle) = self.handle.take() {
            tokio::time::timeout(Duration::from_secs(20), handle)
                .await
                .expect("the service did not stop")
                .expect("the service panicked");
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Holds `LOCK TABLE posts IN ACCESS EXCLUSIVE MODE` until released: every
/// load of a post blocks meanwhile.
pub struct TableLock {
    tx: Option<sqlx::Transaction<'static, sqlx::Postgres>>,
}

impl TableLock {
    pub async fn take(env: &TestEnv) -> Self {
        let mut tx = env.admin.begin().await.unwrap();
        sqlx::query("lock table posts in access exclusive mode")
            .execute(&mut *tx)
            .await
            .unwrap();
        Self { tx: Some(tx) }
    }

    /// The transaction holding the lock, to change the table under it.
    pub fn tx_mut_for_test(&mut self) -> &mut sqlx::Transaction<'static, sqlx::Postgres> {
        self.tx.as_mut().unwrap()
    }

    /// Commits what was done under the lock, releasing it.
    pub async fn commit(mut self) -> Instant {
        self.tx.take().unwrap().commit().await.unwrap();
        Instant::now()
    }

    pub async fn release(mut self) -> Instant {
        self.tx.take().unwrap().rollback().await.unwrap();
        Instant::now()
    }
}

/// Backends of the service currently blocked on a lock (a leader held back by [`TableLock`]).
pub async fn blocked_loads(env: &TestEnv) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_stat_activity
         where datname = current_database() and wait_event_type = 'Lock'
           and application_name = 'postcache'",
    )
    .fetch_one(&env.admin)
    .await
    .unwrap()
}

impl TestEnv {
    /// Transactions rolled back in this database, counted by PostgreSQL (a
    /// failed load is one). Exact once the service's backends exited: call
    /// after the instances are stopped or their connections closed (see
    /// [`TestApp::stop_pool_connections`]).
    pub async fn rollbacks(&self) -> i64 {
        let mut conn = self.after_service_backends_exit().await;
        sqlx::query_scalar(
            "select xact_rollback::bigint from pg_stat_database where datname = current_database()",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap()
    }

    /// Makes every load fail (the table is renamed away) or work again.
    pub async fn break_posts(&self, broken: bool) {
        let sql = if broken {
            "alter table posts rename to posts_away"
        } else {
            "alter table posts_away rename to posts"
        };
        sqlx::query(sql).execute(&self.admin).await.unwrap();
    }
}
