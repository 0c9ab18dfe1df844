//! The checker's fleet: a private PostgreSQL (and standby), a private
//! Redis, and the instances, each a process on a port of its own that a
//! restart keeps, reaching Redis and PostgreSQL through proxies of the
//! checker's (which cut or silence their connections).

use std::{
    path::PathBuf,
    process::{Child, Command},
    sync::{
        atomic::{AtomicU16, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context};
use postcache::testkit::{free_port, PgServer, RedisServer, ServiceProcess, TcpProxy, TestEnv};
use sqlx::{Connection, PgConnection};

use crate::Args;

/// What a reader needs of an instance.
#[derive(Clone)]
pub struct Target {
    pub index: u8,
    pub base: String,
    /// Counts the instance's processes: a read is judged per process.
    pub incarnation: Arc<AtomicU16>,
    pub client: reqwest::Client,
}

/// One instance: its port, its proxies to Redis and to the primary, its
/// current process.
pub struct Instance {
    pub target: Target,
    port: u16,
    pub proxy: TcpProxy,
    pub pg_proxy: TcpProxy,
    process: Mutex<Option<Child>>,
}

pub struct Fleet {
    args: Args,
    pub primary: tokio::sync::Mutex<PgServer>,
    pub standby: Option<PgServer>,
    pub redis: tokio::sync::Mutex<RedisServer>,
    /// Redis's replica, behind a link that can stall (the `redis-failover`
    /// fault promotes it, and makes another).
    pub redis_replica: tokio::sync::Mutex<Option<RedisReplica>>,
    /// The database, the key prefix, a pool and a Redis client of the
    /// checker's own.
    pub env: TestEnv,
    pub instances: Vec<Instance>,
    log_dir: PathBuf,
    /// libfaketime, preloaded into every instance when the `clock-skew`
    /// fault is scheduled: each instance's wall clock is then shifted by
    /// what its file in `log_dir` says (see [`Fleet::skew`]).
    faketime: Option<PathBuf>,
    /// The next version of the canary (see [`Fleet::until_healthy`]).
    canary_version: std::sync::atomic::AtomicU64,
}

/// A replica of the fleet's Redis, replicating through a proxy (its link)
/// that can stall.
pub struct RedisReplica {
    pub server: RedisServer,
    pub link: TcpProxy,
}

impl RedisReplica {
    /// A replica of `primary`, once it has synced (or after a while).
    pub async fn of(primary: &RedisServer) -> Self {
        // The replica syncs at once (Redis waits 5 s by default for more
        // replicas to share the transfer).
        primary.cli(&["config", "set", "repl-diskless-sync-delay", "0"]);
        let link = TcpProxy::start(([127, 0, 0, 1], primary.port).into()).await;
        let port = link.addr.port().to_string();
        // The file a full sync leaves behind is removed: promoted, then
        // restarted, it would come back with what it held then.
        let server = RedisServer::start_with(&[
            "--replicaof",
            "127.0.0.1",
            &port,
            "--rdb-del-sync-files",
            "yes",
        ])
        .await;
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10)
            && !server
                .cli(&["info", "replication"])
                .contains("master_link_status:up")
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self { server, link }
    }
}

/// Where libfaketime is found (`LIBFAKETIME` first): the Debian package's
/// multi-threaded build.
pub fn libfaketime() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("LIBFAKETIME").map(PathBuf::from),
        Some("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1".into()),
        Some("/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1".into()),
        Some("/usr/lib/faketime/libfaketimeMT.so.1".into()),
    ];
    candidates.into_iter().flatten().find(|path| path.exists())
}

/// Longest an instance takes to answer /healthz after it is started.
const START_LIMIT: Duration = Duration::from_secs(30);
/// Bound on each request the checker makes to watch the fleet.
const WATCH_TIMEOUT: Duration = Duration::from_secs(2);

impl Fleet {
    /// The servers and the database, with no instance running yet.
    /// `skewed`: the `clock-skew` fault is scheduled.
    pub async fn start(args: &Args, skewed: bool) -> anyhow::Result<Self> {
        anyhow::ensure!(PgServer::available(), "initdb and pg_basebackup are needed");
        let faketime = match skewed {
            true => Some(libfaketime().context(
                "the clock-skew fault needs libfaketime (apt-get install libfaketime, or LIBFAKETIME)",
            )?),
            false => None,
        };
        let redis = RedisServer::start().await;
        let primary = PgServer::primary().await;
        let env = TestEnv::on_server(0, primary.url(), redis.url()).await;
        let standby = if args.replicas {
            Some(PgServer::standby_of(&primary, &[]).await)
        } else {
            None
        };
        let log_dir =
            std::env::temp_dir().join(format!("postcache-coherence-{}", std::process::id()));
        std::fs::create_dir_all(&log_dir)?;
        let mut instances = Vec::new();
        for index in 0..args.instances {
            std::fs::write(log_dir.join(format!("clock-{index}")), "+0")?;
            let port = free_port();
            let proxy = TcpProxy::start(([127, 0, 0, 1], redis.port).into()).await;
            let pg_proxy = TcpProxy::start(([127, 0, 0, 1], primary.port).into()).await;
            let base = format!("http://127.0.0.1:{port}");
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .pool_max_idle_per_host(64)
                .build()?;
            instances.push(Instance {
                target: Target {
                    index: index as u8,
                    base,
                    incarnation: Arc::default(),
                    client,
                },
                port,
                proxy,
                pg_proxy,
                process: Mutex::new(None),
            });
        }
        Ok(Self {
            args: args.clone(),
            primary: tokio::sync::Mutex::new(primary),
            standby,
            redis_replica: tokio::sync::Mutex::new(Some(RedisReplica::of(&redis).await)),
            redis: tokio::sync::Mutex::new(redis),
            env,
            instances,
            log_dir,
            faketime,
            canary_version: Default::default(),
        })
    }

    pub fn log_dir(&self) -> PathBuf {
        self.log_dir.clone()
    }

    pub fn targets(&self) -> Vec<Target> {
        self.instances.iter().map(|i| i.target.clone()).collect()
    }

    /// The database's URL on the primary.
    pub fn db_url(&self) -> String {
        self.env.db_url.clone()
    }

    /// A connection of the checker's own to the primary, named so.
    pub async fn connect(&self, name: &str) -> sqlx::Result<PgConnection> {
        PgConnection::connect(&format!("{}?application_name={name}", self.env.db_url)).await
    }

    pub async fn start_instances(&self) -> anyhow::Result<()> {
        for i in 0..self.instances.len() {
            self.start_instance(i).await?;
        }
        Ok(())
    }

    /// Starts instance `i`'s next process and waits until it answers.
    pub async fn start_instance(&self, i: usize) -> anyhow::Result<()> {
        let instance = &self.instances[i];
        instance.target.incarnation.fetch_add(1, Ordering::SeqCst);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_dir.join(format!("instance-{i}.log")))?;
        let defective = self.args.lose_changes.is_some() || !self.args.defects.is_empty();
        let (program, first) = match defective {
            true => (std::env::current_exe()?, "instance"),
            false => (
                self.args
                    .binary
                    .clone()
                    .unwrap_or_else(ServiceProcess::binary),
                "serve",
            ),
        };
        let mut command = Command::new(&program);
        command
            .arg(first)
            .env("LISTEN_ADDR", format!("127.0.0.1:{}", instance.port))
            .env(
                "DATABASE_URL",
                format!(
                    "postgres://postgres@{}/{}",
                    instance.pg_proxy.addr, self.env.db_name
                ),
            )
            .env("REDIS_URL", format!("redis://{}", instance.proxy.addr))
            .env("KEY_PREFIX", &self.env.prefix)
            .env("NO_MIGRATE", "true")
            .env("CHANGE_FEED", &self.args.change_feed)
            .env("CACHE_TTL", &self.args.cache_ttl)
            .env("RUST_LOG", "warn")
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(standby) = &self.standby {
            command.env(
                "DATABASE_REPLICA_URLS",
                format!("{}/{}", standby.url(), self.env.db_name),
            );
        }
        if let Some(faketime) = &self.faketime {
            // Only the wall clock: Instant (CLOCK_MONOTONIC) is the
            // machine's. The file is read again every second.
            command
                .env("LD_PRELOAD", faketime)
                .env(
                    "FAKETIME_TIMESTAMP_FILE",
                    self.log_dir.join(format!("clock-{i}")),
                )
                .env("FAKETIME_CACHE_DURATION", "1")
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        if let Some(every) = self.args.lose_changes {
            command.env(LOSE_CHANGES, every.to_string());
        }
        if !self.args.defects.is_empty() {
            command.env(DEFECTS, self.args.defects.join(","));
        }
        for setting in &self.args.set {
            let (name, value) = setting
                .split_once('=')
                .with_context(|| format!("--set {setting}: NAME=value"))?;
            command.env(name, value);
        }
        let child = command
            .spawn()
            .with_context(|| format!("could not start {}", program.display()))?;
        *instance.process.lock().unwrap() = Some(child);
        let started = Instant::now();
        while started.elapsed() < START_LIMIT {
            let up = instance
                .target
                .client
                .get(format!("{}/healthz", instance.target.base))
                .timeout(WATCH_TIMEOUT)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if up {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        bail!(
            "instance {i} did not start within {START_LIMIT:?}; see {}",
            self.log_dir.display()
        )
    }

    /// SIGKILL of instance `i`'s process.
    pub fn kill(&self, i: usize) {
        if let Some(mut child) = self.instances[i].process.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Shifts instance `i`'s wall clock to `seconds` from the machine's (a
    /// step, as NTP makes one), within a second: its processes read their
    /// clock through libfaketime, which reads this file every second.
    pub fn skew(&self, i: usize, seconds: i64) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.faketime.is_some(),
            "the instances run without libfaketime"
        );
        let file = self.log_dir.join(format!("clock-{i}"));
        // Written whole, then renamed: libfaketime never reads half a file.
        let next = self.log_dir.join(format!("clock-{i}.next"));
        std::fs::write(&next, format!("{seconds:+}"))?;
        std::fs::rename(next, file)?;
        Ok(())
    }

    /// Sends `signal` (`STOP`, `CONT`) to instance `i`'s process.
    pub fn signal(&self, i: usize, signal: &str) {
        if let Some(child) = &*self.instances[i].process.lock().unwrap() {
            let _ = Command::new("kill")
                .args([format!("-{signal}"), child.id().to_string()])
                .status();
        }
    }

    /// A GET of the checker's own to instance `i`, bounded.
    async fn watch(&self, i: usize, path: &str) -> Option<(u16, String)> {
        let target = &self.instances[i].target;
        let response = target
            .client
            .get(format!("{}{path}", target.base))
            .timeout(WATCH_TIMEOUT)
            .send()
            .await
            .ok()?;
        let status = response.status().as_u16();
        Some((status, response.text().await.ok()?))
    }

    /// A series of instance `i`'s metrics.
    pub async fn metric(&self, i: usize, series: &str) -> Option<f64> {
        let (_, text) = self.watch(i, "/metrics").await?;
        postcache::testkit::metric(&text, series)
    }

    /// The times each instance's decoder gave up the slot (`None`: its
    /// metrics did not answer; a counter not yet moved is 0).
    pub async fn decoders_gave_up(&self) -> Vec<Option<u64>> {
        let mut counts = Vec::with_capacity(self.instances.len());
        for i in 0..self.instances.len() {
            let answered = self.watch(i, "/metrics").await.map(|(_, text)| {
                let series = "postcache_change_feed_decoder_gave_up_total";
                postcache::testkit::metric(&text, series).unwrap_or(0.0) as u64
            });
            counts.push(answered);
        }
        counts
    }

    /// The instance whose process decodes the fleet's changes.
    pub async fn decoder(&self) -> Option<usize> {
        for i in 0..self.instances.len() {
            if self.metric(i, "postcache_change_feed_decoder").await == Some(1.0) {
                return Some(i);
            }
        }
        None
    }

    /// Why the fleet is not healthy, if it is not: every instance ready,
    /// its change feed up (unless off) and its replicas up.
    pub async fn unhealthy(&self) -> Option<String> {
        for i in 0..self.instances.len() {
            let Some((status, body)) = self.watch(i, "/readyz").await else {
                return Some(format!("instance {i} does not answer"));
            };
            if status != 200 {
                return Some(format!("instance {i}: /readyz {status} {body}"));
            }
            let ready: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if self.args.change_feed != "off" && ready["change_feed"] != "up" {
                return Some(format!(
                    "instance {i}: change feed {}",
                    ready["change_feed"]
                ));
            }
            if let Some(replicas) = ready["replicas"].as_array() {
                if replicas.iter().any(|r| r["state"] != "up") {
                    return Some(format!("instance {i}: replicas {}", ready["replicas"]));
                }
            }
        }
        None
    }

    /// Waits until the fleet is healthy, and proves it: every instance
    /// ready, and a change to the canary (a post no reader reads) served by
    /// every instance within the normal bound of its commit. An instance
    /// may say it is ready before it has noticed a fault (a probe a second
    /// old, beats not yet late): only a change seen end to end says the
    /// change feed works again. Why not, past `limit`.
    pub async fn until_healthy(&self, limit: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            let why = match self.unhealthy().await {
                Some(why) => why,
                None => match self.canary_seen().await {
                    Ok(()) => return Ok(()),
                    Err(why) => format!("{why:#}"),
                },
            };
            if started.elapsed() > limit {
                bail!("not healthy after {limit:?}: {why}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The canary's id: past the posts the readers and writers use.
    fn canary(&self) -> i64 {
        self.args.posts + 1
    }

    /// Writes a new version of the canary, then reads it on every instance
    /// until each serves it, for at most the normal bound (CHANGE_FEED=off:
    /// only whether it answers).
    ///
    /// The version before is first read until each instance's cache holds
    /// it: a canary that is a miss anywhere is read from PostgreSQL there
    /// and proves nothing of the feed (found: a bulk write's heal judged
    /// 1.3 s before the walsender had decoded it, its canary not cached).
    async fn canary_seen(&self) -> anyhow::Result<()> {
        if self.args.change_feed != "off" {
            for instance in &self.instances {
                let target = &instance.target;
                for _ in 0..CANARY_PRIMES {
                    let reply = self.read_canary(target).await;
                    let cached = reply.is_ok_and(|r| {
                        r.status() == 200
                            && r.headers()
                                .get("x-cache")
                                .and_then(|v| v.to_str().ok())
                                .is_some_and(|v| v.starts_with("hit"))
                    });
                    if cached {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
        let version = self.canary_version.fetch_add(1, Ordering::SeqCst);
        let title = format!("canary.{version}");
        sqlx::query(
            "insert into posts (id, title, body, author) values ($1, $2, 'canary', 'coherence')
             on conflict (id) do update set title = excluded.title",
        )
        .bind(self.canary())
        .bind(&title)
        .execute(&self.env.admin)
        .await
        .context("the canary's write")?;
        let committed = Instant::now();
        for (i, instance) in self.instances.iter().enumerate() {
            let target = &instance.target;
            loop {
                let reply = self.read_canary(target).await;
                let served = match reply {
                    Ok(r) if r.status() == 200 => {
                        let json: serde_json::Value = r.json().await.unwrap_or_default();
                        json["title"].as_str().map(str::to_owned)
                    }
                    _ => None,
                };
                if served.as_deref() == Some(title.as_str())
                    || self.args.change_feed == "off" && served.is_some()
                {
                    break;
                }
                if committed.elapsed() > self.args.bound {
                    bail!("instance {i} served the canary's change no sooner than {:?} after its commit", self.args.bound);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        Ok(())
    }

    /// One read of the canary on `target`.
    async fn read_canary(&self, target: &Target) -> reqwest::Result<reqwest::Response> {
        target
            .client
            .get(format!("{}/posts/{}", target.base, self.canary()))
            .timeout(WATCH_TIMEOUT)
            .send()
            .await
    }

    /// The fleet's replication slot.
    pub fn slot(&self) -> String {
        postcache::changes::replication::slot_name(&self.env.db_name, &self.env.prefix)
    }

    pub fn stop(&self) {
        for i in 0..self.instances.len() {
            self.signal(i, "CONT");
            self.kill(i);
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for i in 0..self.instances.len() {
            self.kill(i);
        }
    }
}

/// Reads of the canary's version before, at most, until an instance's
/// cache holds it.
const CANARY_PRIMES: usize = 10;

/// The environment variable that tells an instance of this program to lose
/// one change in N.
const LOSE_CHANGES: &str = "COHERENCE_LOSE_CHANGES";
/// The environment variable that names its other defects (`--defect`).
const DEFECTS: &str = "COHERENCE_DEFECTS";

/// `coherence instance`: the service, with its settings from the
/// environment as `postcache serve` takes them, and the defects of
/// COHERENCE_LOSE_CHANGES and COHERENCE_DEFECTS through the testkit's
/// hooks.
pub fn run_instance() -> anyhow::Result<()> {
    use clap::Parser;
    use postcache::{
        config::{Cli, Command},
        read_path::Hooks,
        startup::{shutdown_signal, Application},
    };
    let cli = Cli::parse_from(["postcache", "serve"]);
    let Command::Serve(args) = cli.command else {
        unreachable!("serve was asked for")
    };
    let every: Option<u64> = match std::env::var(LOSE_CHANGES) {
        Ok(every) => Some(every.parse().context(LOSE_CHANGES)?),
        Err(_) => None,
    };
    anyhow::ensure!(every != Some(0), "{LOSE_CHANGES} must be at least 1");
    let defects = std::env::var(DEFECTS).unwrap_or_default();
    let defects: Vec<&str> = defects.split(',').filter(|d| !d.is_empty()).collect();
    if let Err(error) = postcache::telemetry::init(cli.log_format) {
        eprintln!("error: {error:#}");
        std::process::exit(2);
    }
    postcache::startup::install_tls_provider();
    let lose_change = every.map(|every| {
        tracing::warn!(
            every,
            "a deliberate defect: the decoder loses one change in {every}"
        );
        Arc::new(move |id: i64, lsn: u64| {
            let lost = xxhash_rust::xxh3::xxh3_64(&[id.to_le_bytes(), lsn.to_le_bytes()].concat())
                .is_multiple_of(every);
            if lost {
                tracing::warn!(id, lsn, "change lost on purpose");
            }
            lost
        }) as Arc<dyn Fn(i64, u64) -> bool + Send + Sync>
    });
    for defect in &defects {
        tracing::warn!(defect, "a deliberate defect");
    }
    let hooks = Hooks {
        lose_change,
        no_floors: defects.contains(&"no-floors"),
        blind_decoder: defects.contains(&"blind-decoder"),
        changed_unflagged: defects.contains(&"changed-unflagged"),
        ..Hooks::default()
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let app = Application::build_with_hooks(*args, hooks).await?;
            app.run_until_stopped(shutdown_signal()).await
        })
}
