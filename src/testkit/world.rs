//! Test support: one test's world (its database, its key prefix, its
//! instances).

use std::time::Duration;

use clap::Parser;
use fred::prelude::*;
use rand::Rng;
use sqlx::{postgres::PgPoolOptions, Connection, PgConnection, PgPool};

use super::{
    database::{blocked_loads, drop_slots},
    free_port,
    http::TestApp,
    in_progress, init_tracing, postgres_port, redis_url, server_url, wait_until, ServiceProcess,
    TcpProxy, A_WHILE,
};
use crate::{
    cache::{Entry, Keys},
    cli::seed::generate,
    config::{Cli, Command, DatabaseSettings, InspectArgs, InvalidateArgs, ServeArgs},
    read_path::Hooks,
    startup::Application,
    store::PostStore,
};

/// A fresh, migrated, seeded database and a key prefix, dropped with it.
pub struct TestEnv {
    /// The PostgreSQL server, without a database (the shared one, or a
    /// test's private [`super::PgServer`]).
    pub server: String,
    pub db_name: String,
    pub db_url: String,
    pub prefix: String,
    pub keys: Keys,
    /// A pool for the test's own SQL (its reads of `posts` are not counted:
    /// [`TestEnv::post_reads`] counts the service's only).
    pub admin: PgPool,
    pub redis: Client,
    pub redis_url: String,
}

impl TestEnv {
    /// A database with posts 1..=posts seeded, on the shared Redis.
    pub async fn new(posts: u64) -> Self {
        Self::with_redis(posts, redis_url()).await
    }

    pub async fn with_redis(posts: u64, redis_url: String) -> Self {
        Self::build(posts, server_url(), redis_url, true).await
    }

    /// A database with posts 1..=posts seeded on `server` (a private
    /// PostgreSQL: see [`super::PgServer`]), on `redis_url`.
    pub async fn on_server(posts: u64, server: String, redis_url: String) -> Self {
        Self::build(posts, server, redis_url, true).await
    }

    /// As [`TestEnv::with_redis`] for a Redis that may be down: the test's own
    /// client connects in the background.
    pub async fn with_redis_lazy(posts: u64, redis_url: String) -> Self {
        Self::build(posts, server_url(), redis_url, false).await
    }

    async fn build(posts: u64, server: String, redis_url: String, redis_up: bool) -> Self {
        init_tracing();
        let tag = format!("{:016x}", rand::rng().random::<u64>());
        let db_name = format!("postcache_test_{tag}");
        let db_url = format!("{server}/{db_name}");
        let settings = DatabaseSettings {
            database_url: db_url.clone(),
            db_max_connections: 4,
            db_acquire_timeout: Duration::from_secs(10),
            db_statement_timeout: Duration::from_secs(30),
            db_tcp_keepalive: Duration::from_secs(5),
            db_tcp_user_timeout: Duration::from_secs(10),
        };
        crate::store::migrate(&settings)
            .await
            .expect("failed to create the test database");
        if posts > 0 {
            let store = PostStore::new(crate::store::connect(&settings).await.unwrap());
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
        let redis = Builder::from_config(crate::redis::config_from_url(&redis_url).unwrap())
            .set_policy(fred::types::config::ReconnectPolicy::new_constant(0, 100))
            .build()
            .unwrap();
        if redis_up {
            tokio::time::timeout(A_WHILE, redis.init())
                .await
                .expect("Redis did not answer")
                .expect("failed to connect to Redis");
        } else {
            drop(redis.connect());
        }
        let prefix = format!("t{tag}:");
        Self {
            keys: Keys::new(prefix.clone(), "post"),
            server,
            db_name,
            db_url,
            prefix,
            admin,
            redis,
            redis_url,
        }
    }

    /// The flags naming this world's database, Redis and key prefix.
    fn world_flags(&self) -> [&str; 6] {
        [
            "--database-url",
            &self.db_url,
            "--redis-url",
            &self.redis_url,
            "--key-prefix",
            &self.prefix,
        ]
    }

    /// The settings of an instance of this world, with `extra` flags. A flag
    /// of `extra` replaces the same flag of the base settings and any earlier
    /// one of `extra` (`--flag value`, `--flag=value` or a boolean `--flag`).
    pub fn serve_args(&self, extra: &[&str]) -> ServeArgs {
        let [d, db, r, redis, k, prefix] = self.world_flags();
        let base = [
            d,
            db,
            r,
            redis,
            k,
            prefix,
            "--listen-addr",
            "127.0.0.1:0",
            "--no-migrate",
            // Off unless a test is about it: whether it is built by the
            // time a test reads a missing id would be a race.
            "--existence-guard",
            "off",
        ];
        let mut flags: Vec<(String, Option<String>)> = Vec::new();
        let mut args = base.iter().chain(extra).copied().peekable();
        while let Some(arg) = args.next() {
            let (flag, value) = match arg.split_once('=') {
                Some((flag, value)) => (flag, Some(value.to_owned())),
                None if args.peek().is_some_and(|next| !next.starts_with("--")) => {
                    (arg, args.next().map(str::to_owned))
                }
                None => (arg, None),
            };
            assert!(flag.starts_with("--"), "not a flag: {flag}");
            flags.retain(|(f, _)| f != flag);
            flags.push((flag.to_owned(), value));
        }
        let argv = ["postcache", "serve"].into_iter().map(str::to_owned).chain(
            flags
                .into_iter()
                .flat_map(|(flag, value)| std::iter::once(flag).chain(value)),
        );
        match Cli::try_parse_from(argv)
            .expect("valid test settings")
            .command
        {
            Command::Serve(args) => *args,
            _ => unreachable!("serve was asked for"),
        }
    }

    /// The arguments of `postcache invalidate` on this world, with `args`.
    pub fn invalidate_args(&self, args: &[&str]) -> InvalidateArgs {
        let argv = ["postcache", "invalidate"].into_iter();
        let argv = argv.chain(self.world_flags()).chain(args.iter().copied());
        let cli = Cli::try_parse_from(argv).expect("valid arguments");
        match cli.command {
            Command::Invalidate(args) => *args,
            _ => unreachable!("invalidate was asked for"),
        }
    }

    /// The arguments of `postcache inspect` on this world, with `args`.
    pub fn inspect_args(&self, args: &[&str]) -> InspectArgs {
        let world = ["--redis-url", &self.redis_url, "--key-prefix", &self.prefix];
        let argv = ["postcache", "inspect"].into_iter().chain(world);
        let cli = Cli::try_parse_from(argv.chain(args.iter().copied())).expect("valid arguments");
        match cli.command {
            Command::Inspect(args) => *args,
            _ => unreachable!("inspect was asked for"),
        }
    }

    /// Starts an instance in this process, with `extra` flags.
    pub async fn spawn(&self, extra: &[&str]) -> TestApp {
        TestApp::start(
            Application::build(self.serve_args(extra))
                .await
                .expect("failed to build the app"),
        )
    }

    /// As [`TestEnv::spawn`], with observation points in the read path.
    pub async fn spawn_with_hooks(&self, extra: &[&str], hooks: Hooks) -> TestApp {
        TestApp::start(
            Application::build_with_hooks(self.serve_args(extra), hooks)
                .await
                .expect("failed to build the app"),
        )
    }

    /// Starts `postcache serve` as a child process of this world, with
    /// `extra` environment variables (which override the world's).
    pub async fn start_process(&self, extra: &[(&str, String)]) -> ServiceProcess {
        let mut vars = vec![
            ("DATABASE_URL", self.db_url.clone()),
            ("REDIS_URL", self.redis_url.clone()),
            ("KEY_PREFIX", self.prefix.clone()),
            ("NO_MIGRATE", "true".to_owned()),
            // As in `serve_args`: off unless a test is about it.
            ("EXISTENCE_GUARD", "off".to_owned()),
        ];
        vars.retain(|(name, _)| extra.iter().all(|(n, _)| n != name));
        vars.extend(extra.iter().cloned());
        ServiceProcess::start(&vars).await
    }

    /// The database URL of this world through a [`TcpProxy`] in front of
    /// PostgreSQL, to cut or stall the service's connections.
    pub async fn proxied_database(&self) -> (TcpProxy, String) {
        let proxy = TcpProxy::start(([127, 0, 0, 1], postgres_port()).into()).await;
        let url = format!("postgres://postgres@{}/{}", proxy.addr, self.db_name);
        (proxy, url)
    }

    /// An instance whose every connection to PostgreSQL goes through a
    /// proxy the test can cut or stall, with `flags`.
    pub async fn spawn_proxied(&self, flags: &[&str]) -> (TcpProxy, TestApp) {
        let (proxy, url) = self.proxied_database().await;
        let app = self
            .spawn(&[&["--database-url", url.as_str()][..], flags].concat())
            .await;
        (proxy, app)
    }

    /// An instance whose Redis is gone (nothing listens on its port), each
    /// call to it given up on after 100 ms: the fail-open path, without a
    /// server to stop.
    pub async fn spawn_without_redis(&self) -> TestApp {
        let closed = format!("redis://127.0.0.1:{}", free_port());
        self.spawn(&["--redis-url", &closed, "--redis-timeout", "100ms"])
            .await
    }

    /// Waits until a waiter listens on post `id`'s ready channel.
    pub async fn until_subscribed(&self, id: i64) {
        let channel = self.keys.channel(id);
        wait_until("a waiter to subscribe", A_WHILE, async || {
            self.numsub(&channel).await >= 1
        })
        .await;
    }

    /// Waits until `n` reads are in progress over `apps`, a load is
    /// blocked (held back by a [`TableLock`]), and the instances have gone
    /// quiet in Redis: every read has had its first look and waits. (The
    /// first look that claims the post sends its leader to the load at
    /// once, while the other reads' looks may still be queued.) The
    /// stampede is assembled.
    pub async fn until_held(&self, apps: &[TestApp], n: usize) {
        wait_until(
            "requests to arrive and the leader to block",
            A_WHILE,
            async || in_progress(apps) >= n && blocked_loads(self).await >= 1,
        )
        .await;
        // The counter is the process's: every instance here counts in it.
        let calls = async || apps[0].http.metric("postcache_redis_calls_total").await;
        let mut last = calls().await;
        wait_until("the instances to go quiet in Redis", A_WHILE, async || {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = calls().await;
            std::mem::replace(&mut last, now) == now
        })
        .await;
    }

    /// Reads of the posts table counted by PostgreSQL itself (sequential
    /// plus index scans; `posts_data` once [`TestEnv::slow_loads`] made
    /// `posts` a view). Counts are exact only once the backends that did the reads
    /// have flushed their statistics, which they do when they exit: call this
    /// after the instances are stopped (their pools closed).
    pub async fn post_reads(&self) -> i64 {
        let mut conn = self.after_service_backends_exit().await;
        let mut last = -1;
        wait_until("the statistics to settle", A_WHILE, async || {
            if last >= 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let reads: i64 = sqlx::query_scalar(
                "select coalesce(sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0)), 0)::bigint
                 from pg_stat_user_tables where relname in ('posts', 'posts_data')",
            )
            .fetch_one(&mut conn)
            .await
            .unwrap();
            std::mem::replace(&mut last, reads) == reads
        })
        .await;
        last
    }

    /// A connection to the test database, once every backend of the service
    /// has exited (and so flushed its statistics).
    pub async fn after_service_backends_exit(&self) -> PgConnection {
        let mut conn = PgConnection::connect(&self.db_url).await.unwrap();
        wait_until("the service's backends to exit", A_WHILE, async || {
            let others: i64 = sqlx::query_scalar(
                "select count(*) from pg_stat_activity
                 where datname = current_database() and pid <> pg_backend_pid()
                   and backend_type = 'client backend'
                   and application_name = 'postcache'",
            )
            .fetch_one(&mut conn)
            .await
            .unwrap();
            others == 0
        })
        .await;
        conn
    }

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

    /// Transactions ended in this database (committed or rolled back),
    /// counted by PostgreSQL: each statement the service sends outside a
    /// transaction is one. Exact once the service's backends exited (see
    /// [`TestEnv::rollbacks`]).
    pub async fn transactions(&self) -> i64 {
        let mut conn = self.after_service_backends_exit().await;
        sqlx::query_scalar(
            "select (xact_commit + xact_rollback)::bigint from pg_stat_database
             where datname = current_database()",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap()
    }

    /// Makes every load of a post take `by` longer: `posts` becomes a view
    /// over the table (renamed `posts_data`) that sleeps per row.
    pub async fn slow_loads(&self, by: Duration) {
        for sql in [
            "alter table posts rename to posts_data".to_owned(),
            format!(
                "create view posts as select p.* from posts_data p
                 cross join lateral (select pg_sleep({})) slow",
                by.as_secs_f64()
            ),
        ] {
            sqlx::query(&sql).execute(&self.admin).await.unwrap();
        }
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

    /// The stored entry of a post, decoded. A leader's claim in its key is
    /// waited out (for A_WHILE): a leader answers its requests before its
    /// finish stores the row, so a test that reads Redis after a miss's
    /// answer may find the claim a moment longer.
    pub async fn stored(&self, id: i64) -> Option<Entry> {
        let raw = self.settled(&self.keys.value(id)).await;
        raw.map(|raw| Entry::decode(raw).expect("a decodable entry"))
    }

    /// The post stored for `id` (see [`TestEnv::stored`]), as JSON; `None`
    /// when nothing is stored. Panics on a body that is not JSON.
    pub async fn stored_post(&self, id: i64) -> Option<serde_json::Value> {
        let entry = self.stored(id).await?;
        Some(serde_json::from_slice(&entry.body()).expect("a JSON body"))
    }

    /// What `key` holds once no claim is there (see [`TestEnv::stored`]).
    async fn settled(&self, key: &str) -> Option<bytes::Bytes> {
        let give_up = std::time::Instant::now() + A_WHILE;
        loop {
            let raw: Option<bytes::Bytes> = self.redis.get(key).await.unwrap();
            match raw {
                Some(raw) if crate::cache::is_claim(&raw) => {
                    assert!(
                        std::time::Instant::now() < give_up,
                        "{key} still holds a claim"
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                raw => return raw,
            }
        }
    }

    /// Ends a post's stored freshness now, as time would: the entry stays,
    /// with its TTL, as the fail-safe copy.
    pub async fn expire_freshness(&self, id: i64) {
        let key = self.keys.value(id);
        let mut raw = self.settled(&key).await.expect("a stored entry").to_vec();
        let past = crate::cache::now_millis() - 1;
        let at = crate::cache::entry::FRESH_UNTIL_AT;
        raw[at..at + 8].copy_from_slice(&past.to_be_bytes());
        let _: () = self
            .redis
            .custom(
                fred::types::CustomCommand::new_static("SET", None::<u16>, false),
                vec![
                    Value::String(key.into()),
                    Value::Bytes(raw.into()),
                    Value::String("KEEPTTL".into()),
                ],
            )
            .await
            .unwrap();
    }

    /// Sets a post's title by plain SQL, as any other writer would.
    pub async fn retitle(&self, id: i64, title: &str) {
        sqlx::query("update posts set title = $1 where id = $2")
            .bind(title)
            .bind(id)
            .execute(&self.admin)
            .await
            .unwrap();
    }

    /// PTTL of a key, in milliseconds (-2 absent, -1 no expiry).
    pub async fn pttl(&self, key: &str) -> i64 {
        self.redis.pttl(key).await.unwrap()
    }

    /// Sets `key` to `value` for `ttl`, from outside the service.
    pub async fn set(&self, key: &str, value: impl Into<Value> + Send, ttl: Duration) {
        let px = fred::types::Expiration::PX(ttl.as_millis() as i64);
        let _: () = self
            .redis
            .set(key, value.into(), Some(px), None, false)
            .await
            .unwrap();
    }

    /// Puts the claim of a leader named `holder` in post `id`'s value key
    /// for `ttl`, from outside the service: a leader elsewhere loading a
    /// post nobody had stored (see `cache/entry.rs`). Returns the key,
    /// which is that leader's lock.
    pub async fn claim(&self, id: i64, holder: &str, ttl: Duration) -> String {
        let key = self.keys.value(id);
        self.set(&key, crate::cache::claim_of(holder), ttl).await;
        key
    }

    /// Whether a leader's lock on post `id` is held: its lock key, or a
    /// claim in its value key.
    pub async fn lock_held(&self, id: i64) -> bool {
        if self.pttl(&self.keys.lock(id)).await != -2 {
            return true;
        }
        let value: Option<bytes::Bytes> = self.redis.get(self.keys.value(id)).await.unwrap();
        value.is_some_and(|raw| crate::cache::is_claim(&raw))
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

/// The world's admin pool, for the helpers that only need a connection
/// (`database.rs`).
impl AsRef<PgPool> for TestEnv {
    fn as_ref(&self) -> &PgPool {
        &self.admin
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // Drop the database from a thread of its own: Drop cannot await, and
        // the test's runtime may be shutting down.
        let url = self.server.clone();
        let name = self.db_name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut conn) = PgConnection::connect(&format!("{url}/postgres")).await {
                    drop_slots(&mut conn, &name).await;
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
