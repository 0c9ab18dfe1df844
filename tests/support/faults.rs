//! Real faults: a private redis-server, a TCP proxy that can cut or stall a
//! connection, and `postcache serve` as a separate process that can be killed.

use std::{
    net::{SocketAddr, TcpListener as StdListener},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use tokio::{
    io::AsyncWriteExt,
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

/// A local port with nothing listening on it (yet).
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A private `redis-server` on a free port, in a temp dir, killed on drop.
pub struct RedisServer {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts one and waits until it answers.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Self {
        let mut server = Self::reserve_with(extra);
        server.restart();
        server
    }

    /// Picks a port and a dir without starting the server (Redis "down at start").
    pub fn reserve() -> Self {
        Self::reserve_with(&[])
    }

    fn reserve_with(extra: &[&str]) -> Self {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("postcache-redis-{port}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            port,
            dir,
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port.
    pub fn restart(&mut self) {
        self.kill();
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &self.port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(&self.dir)
        .args(&self.extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("redis-server must be installed"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.answers() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: the server vanishes mid-traffic.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn answers(&self) -> bool {
        Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "ping"])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
    }

    /// Runs a redis-cli command against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A TCP proxy in front of a server: connections can be cut, and new ones refused.
pub struct TcpProxy {
    pub addr: SocketAddr,
    open: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl TcpProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicBool::new(true));
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (open, connections) = (open.clone(), connections.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((mut client, _)) = listener.accept().await else {
                        return;
                    };
                    if !open.load(Ordering::SeqCst) {
                        let _ = client.shutdown().await;
                        continue;
                    }
                    let pipe = tokio::spawn(async move {
                        if let Ok(mut server) = TcpStream::connect(target).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    connections.lock().unwrap().push(pipe);
                }
            })
        };
        Self {
            addr,
            open,
            connections,
            accept,
        }
    }

    /// Cuts every connection and refuses new ones (the server looks down).
    pub fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for c in self.connections.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// `postcache serve` as a child process.
pub struct ServiceProcess {
    pub base: String,
    child: Option<Child>,
    pub log: PathBuf,
}

impl ServiceProcess {
    /// Starts the binary with `env` and waits until /healthz answers.
    pub async fn start(env: &[(&str, String)]) -> Self {
        let port = free_port();
        let log = std::env::temp_dir().join(format!("postcache-{port}-{}.log", std::process::id()));
        let file = std::fs::File::create(&log).unwrap();
        let binary = option_env!("CARGO_BIN_EXE_postcache")
            .map(str::to_owned)
            .or_else(|| std::env::var("POSTCACHE_BIN").ok())
            .unwrap_or_else(|| "target/release/postcache".to_owned());
        let mut cmd = Command::new(binary);
        cmd.arg("serve")
            .env("LISTEN_ADDR", format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "info")
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("failed to start postcache");
        let me = Self {
            base: format!("http://127.0.0.1:{port}"),
            child: Some(child),
            log,
        };
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if http
                .get(format!("{}/healthz", me.base))
                .send()
                .await
                .is_ok()
            {
                return me;
            }
            assert!(
                Instant::now() < deadline,
                "postcache did not start: {}",
                me.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the process to exit; returns whether it exited in time.
    pub fn wait(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let child = self.child.as_mut().unwrap();
        loop {
            if child.try_wait().unwrap().is_some() {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A local Redis Cluster of `masters` masters (and `replicas` replicas each)
/// from `redis-server --cluster-enabled yes` on free ports, in a temp dir,
/// created with `redis-cli --cluster create`, killed on drop.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    dir: PathBuf,
    nodes: Vec<Option<Child>>,
}

/// A port free for the node and for its cluster bus (port + 10000).
fn free_cluster_port(taken: &[u16]) -> u16 {
    loop {
        let port = 20_000 + (rand::random::<u16>() % 20_000);
        if taken.contains(&port) {
            continue;
        }
        let ok = StdListener::bind(("127.0.0.1", port)).is_ok()
            && StdListener::bind(("127.0.0.1", port + 10_000)).is_ok();
        if ok {
            return port;
        }
    }
}

impl RedisCluster {
    pub fn start(masters: usize, replicas: usize) -> Self {
        let count = masters * (1 + replicas);
        let mut ports = Vec::new();
        for _ in 0..count {
            let port = free_cluster_port(&ports);
            ports.push(port);
        }
        let dir = std::env::temp_dir().join(format!(
            "postcache-cluster-{}-{}",
            ports[0],
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cluster = Self {
            ports: ports.clone(),
            dir,
            nodes: Vec::new(),
        };
        for i in 0..count {
            let child = cluster.spawn_node(i);
            cluster.nodes.push(Some(child));
        }
        for &port in &ports {
            wait_for_ping(port);
        }
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        cluster.wait_until_ok();
        cluster
    }

    fn spawn_node(&self, i: usize) -> Child {
        let port = self.ports[i];
        Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
            ])
            .args([
                "--cluster-config-file",
                &format!("nodes-{port}.conf"),
                "--cluster-node-timeout",
                "1000",
            ])
            // A replica may always take over (its data is a cache).
            .args(["--cluster-replica-validity-factor", "0"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed")
    }

    /// Waits until every live node reports `cluster_state:ok`.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for (i, &port) in self.ports.iter().enumerate() {
            if self.nodes.get(i).is_some_and(Option::is_none) {
                continue;
            }
            while !self
                .cli(port, &["cluster", "info"])
                .contains("cluster_state:ok")
            {
                assert!(Instant::now() < deadline, "cluster not ok on {port}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// `redis-cluster://127.0.0.1:p1,127.0.0.1:p2,…` (the masters' seeds).
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis-cluster://{}", hosts.join(","))
    }

    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string()])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The port of the master that serves `key`'s slot.
    pub fn master_of(&self, key: &str) -> u16 {
        let slot: u16 = self
            .cli(self.ports[0], &["cluster", "keyslot", key])
            .parse()
            .unwrap();
        let nodes = self.cli(self.ports[0], &["cluster", "nodes"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let port: u16 = fields[1].split(['@', ':']).nth(1).unwrap().parse().unwrap();
            for range in &fields[8..] {
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(lo), Ok(hi)) = (lo.parse::<u16>(), hi.parse::<u16>()) {
                    if (lo..=hi).contains(&slot) {
                        return port;
                    }
                }
            }
        }
        panic!("no master serves slot {slot}")
    }

    /// SIGKILL the node on `port`.
    pub fn kill(&mut self, port: u16) {
        let i = self.ports.iter().position(|p| *p == port).unwrap();
        if let Some(mut child) = self.nodes[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the node on `port` again (it rejoins with its nodes.conf).
    pub fn restart(&mut self, port: u16) {
        let i = self.ports.iter().position(|p| *p == port).unwrap();
        let child = self.spawn_node(i);
        self.nodes[i] = Some(child);
        wait_for_ping(port);
    }
}

fn wait_for_ping(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = Command::new("redis-cli")
            .args(["-p", &port.to_string(), "ping"])
            .output();
        if out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG") {
            return;
        }
        assert!(Instant::now() < deadline, "redis node {port} did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for child in self.nodes.iter_mut().filter_map(Option::take) {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
