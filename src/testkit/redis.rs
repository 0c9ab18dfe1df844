//! Test support: a private `redis-server`, alone, over TLS, or as a cluster:
//! started in a temp dir on free ports, killed on drop.

use std::{
    net::TcpListener as StdListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use super::{free_port, kill, wait_until, A_WHILE};

/// A fresh temp dir for one server.
fn temp_dir(what: &str, port: u16) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("postcache-{what}-{port}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Starts `redis-server` in `dir`, persistence off, with `args`: the one
/// place a private Redis is started.
fn spawn_redis(dir: &Path, args: &[String]) -> Child {
    Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server must be installed")
}

/// Runs `redis-cli` with `args` and returns its output, trimmed.
fn redis_cli(args: &[String]) -> String {
    let out = Command::new("redis-cli").args(args).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A private `redis-server` on a free port, in a temp dir, killed on drop.
pub struct RedisServer {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// What `redis-server` and `redis-cli` are given besides the port.
    server_args: Vec<String>,
    cli_args: Vec<String>,
    tls: bool,
}

impl RedisServer {
    /// Starts one and waits until it answers.
    pub async fn start() -> Self {
        let mut server = Self::reserve();
        server.restart().await;
        server
    }

    /// Picks a port and a dir without starting the server (Redis "down at start").
    pub fn reserve() -> Self {
        let port = free_port();
        Self {
            port,
            dir: temp_dir("redis", port),
            child: None,
            server_args: vec!["--port".into(), port.to_string()],
            cli_args: vec!["-p".into(), port.to_string()],
            tls: false,
        }
    }

    /// A server speaking TLS only, with a certificate for `localhost` from a
    /// throwaway CA (`openssl` must be installed); `None` without openssl.
    /// Clients trust the CA through `SSL_CERT_FILE` = [`RedisServer::ca`].
    pub async fn start_tls() -> Option<Self> {
        let mut server = Self::reserve();
        let made = Command::new("sh")
            .arg("-c")
            .arg(
                "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 -subj '/CN=postcache test CA' \
                 && openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj '/CN=localhost' \
                 && printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\nbasicConstraints=CA:FALSE\\n' > ext.cnf \
                 && openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 -extfile ext.cnf",
            )
            .current_dir(&server.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !made.is_ok_and(|s| s.success()) {
            return None;
        }
        let port = server.port.to_string();
        server.server_args = ["--port", "0", "--tls-port", &port]
            .into_iter()
            .chain([
                "--tls-cert-file",
                "server.pem",
                "--tls-key-file",
                "server.key",
            ])
            .chain(["--tls-ca-cert-file", "ca.pem", "--tls-auth-clients", "no"])
            .map(str::to_owned)
            .collect();
        let ca = server.ca().to_string_lossy().into_owned();
        server.cli_args = ["-p", &port, "--tls", "--cacert", &ca]
            .into_iter()
            .map(str::to_owned)
            .collect();
        server.tls = true;
        server.restart().await;
        Some(server)
    }

    /// The CA that signed a TLS server's certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    pub fn url(&self) -> String {
        if self.tls {
            format!("rediss://localhost:{}", self.port)
        } else {
            format!("redis://127.0.0.1:{}", self.port)
        }
    }

    /// Starts (again) on the same port and waits until it answers.
    pub async fn restart(&mut self) {
        self.restart_with(&[]).await;
        wait_until("redis-server to serve", A_WHILE, async || {
            self.cli(&["ping"]) == "PONG"
        })
        .await;
    }

    /// Starts (again) on the same port, with `extra` arguments this time
    /// only, and waits until it answers anything (`LOADING`, say).
    pub async fn restart_with(&mut self, extra: &[&str]) {
        self.kill();
        let args: Vec<String> = self
            .server_args
            .iter()
            .cloned()
            .chain(extra.iter().map(|a| a.to_string()))
            .collect();
        self.child = Some(spawn_redis(&self.dir, &args));
        wait_until("redis-server to start", A_WHILE, async || {
            !self.cli(&["ping"]).is_empty()
        })
        .await;
    }

    /// Starts one with `extra` arguments (`--replicaof …`, say) and waits
    /// until it answers anything.
    pub async fn start_with(extra: &[&str]) -> Self {
        let mut server = Self::reserve();
        server.restart_with(extra).await;
        server
    }

    /// SIGKILL: the server vanishes mid-traffic.
    pub fn kill(&mut self) {
        kill(self.child.take());
    }

    /// Runs a redis-cli command against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        let all: Vec<String> = self
            .cli_args
            .iter()
            .cloned()
            .chain(args.iter().map(|a| a.to_string()))
            .collect();
        redis_cli(&all)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A local Redis Cluster of `masters` masters (and `replicas` replicas each)
/// on free ports, created with `redis-cli --cluster create`, killed on drop.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    dir: PathBuf,
    nodes: Vec<Option<Child>>,
}

/// A port free for the node and for its cluster bus (port + 10000), both
/// below Linux's ephemeral ports (32768 and up by default): a port found
/// free there could be taken by an outgoing connection before the node
/// binds it, and the node would never start.
fn free_cluster_port(taken: &[u16]) -> u16 {
    loop {
        let port = 12_000 + (rand::random::<u16>() % 10_000);
        if !taken.contains(&port)
            && StdListener::bind(("127.0.0.1", port)).is_ok()
            && StdListener::bind(("127.0.0.1", port + 10_000)).is_ok()
        {
            return port;
        }
    }
}

impl RedisCluster {
    pub async fn start(masters: usize, replicas: usize) -> Self {
        let mut ports = Vec::new();
        for _ in 0..masters * (1 + replicas) {
            ports.push(free_cluster_port(&ports));
        }
        let mut cluster = Self {
            dir: temp_dir("cluster", ports[0]),
            nodes: Vec::new(),
            ports: ports.clone(),
        };
        for &port in &ports {
            let node = cluster.spawn_node(port).await;
            cluster.nodes.push(Some(node));
        }
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(ports.iter().map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        cluster.wait_until_ok().await;
        cluster
    }

    async fn spawn_node(&self, port: u16) -> Child {
        let args = [
            "--port",
            &port.to_string(),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            &format!("nodes-{port}.conf"),
            "--cluster-node-timeout",
            "1000",
            // A replica may always take over (its data is a cache).
            "--cluster-replica-validity-factor",
            "0",
            // The other shards keep serving while one has no master (a cache
            // wants that; the README recommends it).
            "--cluster-require-full-coverage",
            "no",
        ]
        .map(str::to_owned);
        let child = spawn_redis(&self.dir, &args);
        wait_until("a cluster node to start", A_WHILE, async || {
            self.cli(port, &["ping"]) == "PONG"
        })
        .await;
        child
    }

    /// Waits until every live node reports `cluster_state:ok`.
    pub async fn wait_until_ok(&self) {
        for (i, &port) in self.ports.iter().enumerate() {
            if self.nodes.get(i).is_some_and(Option::is_none) {
                continue;
            }
            wait_until("the cluster to be ok", A_WHILE, async || {
                self.cli(port, &["cluster", "info"])
                    .contains("cluster_state:ok")
            })
            .await;
        }
    }

    /// `redis-cluster://127.0.0.1:p1,127.0.0.1:p2,…`
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis-cluster://{}", hosts.join(","))
    }

    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        let all: Vec<String> = ["-p".to_owned(), port.to_string()]
            .into_iter()
            .chain(args.iter().map(|a| a.to_string()))
            .collect();
        redis_cli(&all)
    }

    /// The port of the master that serves `key`'s slot.
    #[track_caller]
    pub fn master_of(&self, key: &str) -> u16 {
        self.serving(key)
            .unwrap_or_else(|| panic!("no master serves the slot of {key}"))
    }

    /// The port of the master that serves `key`'s slot as a live node sees
    /// it: `None` while that master is failing and no replica has taken over.
    pub fn serving(&self, key: &str) -> Option<u16> {
        let live = self
            .ports
            .iter()
            .zip(&self.nodes)
            .find_map(|(port, node)| node.is_some().then_some(*port))?;
        let slot: u16 = self.cli(live, &["cluster", "keyslot", key]).parse().ok()?;
        let nodes = self.cli(live, &["cluster", "nodes"]);
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
                        return Some(port);
                    }
                }
            }
        }
        None
    }

    /// Moves `key`'s slot, and the keys in it, from its master to the
    /// master on `to` (a resharding of one slot, as `redis-cli --cluster
    /// reshard` does it).
    pub fn move_slot(&self, key: &str, to: u16) {
        let slot = self.begin_slot_move(key, to);
        let to_id = self.cli(to, &["cluster", "myid"]);
        for (port, node) in self.ports.iter().zip(&self.nodes) {
            if node.is_some() {
                self.cli(*port, &["cluster", "setslot", &slot, "node", &to_id]);
            }
        }
    }

    /// The first half of [`RedisCluster::move_slot`]: the slot marked
    /// migrating and importing, and its keys moved, but the move not
    /// finished: its old master answers ASK for the keys it no longer has.
    /// Returns the slot.
    pub fn begin_slot_move(&self, key: &str, to: u16) -> String {
        let from = self.master_of(key);
        let slot = self.cli(from, &["cluster", "keyslot", key]);
        let id = |port: u16| self.cli(port, &["cluster", "myid"]);
        let (from_id, to_id) = (id(from), id(to));
        self.cli(to, &["cluster", "setslot", &slot, "importing", &from_id]);
        self.cli(from, &["cluster", "setslot", &slot, "migrating", &to_id]);
        let keys = self.cli(from, &["cluster", "getkeysinslot", &slot, "1000"]);
        let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        if !keys.is_empty() {
            let to_port = to.to_string();
            let mut migrate = vec!["migrate", "127.0.0.1", &to_port, "", "0", "5000", "KEYS"];
            migrate.extend(keys);
            assert_eq!(self.cli(from, &migrate), "OK", "MIGRATE");
        }
        slot
    }

    /// The ports of the replicas of the master on `master`.
    pub fn replicas_of(&self, master: u16) -> Vec<u16> {
        let id = self.cli(master, &["cluster", "myid"]);
        self.cli(master, &["cluster", "replicas", &id])
            .lines()
            .filter_map(|line| {
                let address = line.split_whitespace().nth(1)?;
                address.split(['@', ':']).nth(1)?.parse().ok()
            })
            .collect()
    }

    /// Whether the replica on `port` may take over when its master fails
    /// (`cluster-replica-no-failover`): a test holds a failover back while
    /// it looks at the outage, so the promotion cannot race it.
    pub fn allow_failover(&self, port: u16, allow: bool) {
        let no = if allow { "no" } else { "yes" };
        let reply = self.cli(port, &["config", "set", "cluster-replica-no-failover", no]);
        assert_eq!(reply, "OK", "config set on {port}");
    }

    /// SIGKILL the node on `port`.
    pub fn kill(&mut self, port: u16) {
        let i = self.ports.iter().position(|p| *p == port).unwrap();
        kill(self.nodes[i].take());
    }

    /// Starts the node on `port` again (it rejoins with its nodes.conf).
    pub async fn restart(&mut self, port: u16) {
        let i = self.ports.iter().position(|p| *p == port).unwrap();
        let child = self.spawn_node(port).await;
        self.nodes[i] = Some(child);
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for child in self.nodes.iter_mut() {
            kill(child.take());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
