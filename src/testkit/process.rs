//! Test support: A TCP proxy that cuts or stalls connections, and `postcache
//! serve` as a process that can be signalled.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

use super::{eventually, free_port, kill, Http};

/// A TCP proxy in front of a server: connections can be cut (and new ones
/// refused), or stalled (bytes held, connections kept), or, in front of
/// Redis, only the commands that subscribe held, or only the connections
/// that listen (subscribe or read a stream) cut.
pub struct TcpProxy {
    pub addr: SocketAddr,
    /// Where new connections go (see [`TcpProxy::retarget`]).
    target: Arc<Mutex<SocketAddr>>,
    open: Arc<AtomicBool>,
    hold: Arc<Hold>,
    connections: Arc<Mutex<Vec<Piped>>>,
    accept: JoinHandle<()>,
}

/// One connection through the proxy: its pumps, and what its client sent.
struct Piped {
    pumps: JoinHandle<()>,
    seen: Arc<Seen>,
}

/// What a connection's client sent, as the proxy saw it.
#[derive(Default)]
struct Seen {
    /// A Redis command that listens (SUBSCRIBE, SSUBSCRIBE, XREAD).
    listens: AtomicBool,
    /// A PostgreSQL startup packet that asks for a replication session.
    replicates: AtomicBool,
}

impl TcpProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicBool::new(true));
        let hold = Arc::new(Hold::default());
        let connections: Arc<Mutex<Vec<Piped>>> = Arc::default();
        let target = Arc::new(Mutex::new(target));
        let accept = tokio::spawn({
            let (open, hold, connections) = (open.clone(), hold.clone(), connections.clone());
            let target = target.clone();
            async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    if !open.load(Ordering::SeqCst) {
                        let _ = client.shutdown().await;
                        continue;
                    }
                    let hold = hold.clone();
                    let seen = Arc::new(Seen::default());
                    let target = *target.lock().unwrap();
                    let pumps = tokio::spawn({
                        let seen = seen.clone();
                        async move {
                            let Ok(server) = TcpStream::connect(target).await else {
                                return;
                            };
                            // As the servers and clients do on their own
                            // sockets: without it, each small write that
                            // follows one not yet acknowledged waits for the
                            // peer's delayed ACK (40 ms).
                            let _ = client.set_nodelay(true);
                            let _ = server.set_nodelay(true);
                            let (client_rx, client_tx) = client.into_split();
                            let (server_rx, server_tx) = server.into_split();
                            tokio::join!(
                                pump(client_rx, server_tx, hold.clone(), seen.clone(), true),
                                pump(server_rx, client_tx, hold, seen, false)
                            );
                        }
                    });
                    let mut connections = connections.lock().unwrap();
                    connections.retain(|c| !c.pumps.is_finished());
                    connections.push(Piped { pumps, seen });
                }
            }
        });
        Self {
            addr,
            target,
            open,
            hold,
            connections,
            accept,
        }
    }

    /// Cuts every connection and refuses new ones (the server looks down).
    pub fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for c in self.connections.lock().unwrap().drain(..) {
            c.pumps.abort();
        }
    }

    /// Cuts the connections whose client sent a SUBSCRIBE (or SSUBSCRIBE)
    /// or an XREAD: a process's subscriber and its change stream reader.
    /// The others stay, and new connections are taken. Returns how many
    /// were cut.
    pub fn cut_listeners(&self) -> usize {
        let mut connections = self.connections.lock().unwrap();
        let before = connections.len();
        connections.retain(|c| {
            let listens = c.seen.listens.load(Ordering::SeqCst);
            if listens {
                c.pumps.abort();
            }
            !listens
        });
        before - connections.len()
    }

    /// Sends new connections to `to`, and cuts the present ones: an
    /// address moved to another server (a virtual IP after a failover).
    pub fn retarget(&self, to: SocketAddr) {
        *self.target.lock().unwrap() = to;
        for c in self.connections.lock().unwrap().drain(..) {
            c.pumps.abort();
        }
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }

    /// Refuses new connections (each closed as it is taken) until
    /// [`TcpProxy::restore`]; the present ones stay.
    pub fn refuse_new(&self) {
        self.open.store(false, Ordering::SeqCst);
    }

    /// Holds every byte in both directions (a network that stalls) until
    /// `stall(false)`; connections stay open.
    pub fn stall(&self, stalled: bool) {
        self.hold.all.store(stalled, Ordering::SeqCst);
    }

    /// Holds every byte, both ways, of the PostgreSQL replication sessions
    /// (a silent replication connection: nothing forwarded, nothing
    /// closed) until `stall_replication(false)`; other connections pass.
    pub fn stall_replication(&self, stalled: bool) {
        self.hold.replication.store(stalled, Ordering::SeqCst);
    }

    /// Holds the bytes that carry a Redis SUBSCRIBE (or SSUBSCRIBE) until
    /// `hold_subscribes(false)`; everything else passes.
    pub fn hold_subscribes(&self, held: bool) {
        self.hold.subscribes.store(held, Ordering::SeqCst);
    }
}

/// What a proxy holds back.
#[derive(Default)]
struct Hold {
    all: AtomicBool,
    subscribes: AtomicBool,
    replication: AtomicBool,
}

impl Hold {
    fn holds(&self, bytes: &[u8]) -> bool {
        self.all.load(Ordering::SeqCst)
            || (self.subscribes.load(Ordering::SeqCst)
                && bytes
                    .windows(9)
                    .any(|w| w.eq_ignore_ascii_case(b"subscribe")))
    }
}

/// Copies one direction of a connection, holding bytes as `hold` says;
/// on the client's side (`client`), notes in `seen` what the client sent.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    hold: Arc<Hold>,
    seen: Arc<Seen>,
    client: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if client {
            let bytes = &buf[..n];
            let has = |word: &[u8]| {
                bytes
                    .windows(word.len())
                    .any(|w| w.eq_ignore_ascii_case(word))
            };
            if has(b"subscribe") || has(b"xread") {
                seen.listens.store(true, Ordering::SeqCst);
            }
            // The startup packet's `replication` parameter.
            if has(b"replication\0database\0") {
                seen.replicates.store(true, Ordering::SeqCst);
            }
        }
        while hold.holds(&buf[..n])
            || (hold.replication.load(Ordering::SeqCst) && seen.replicates.load(Ordering::SeqCst))
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// `postcache serve` as a child process, logging to a temp file.
pub struct ServiceProcess {
    pub http: Http,
    child: Option<Child>,
    log: PathBuf,
}

impl ServiceProcess {
    /// The binary beside the running test or example (`target/<profile>/`),
    /// or POSTCACHE_BIN.
    pub fn binary() -> PathBuf {
        if let Some(bin) = std::env::var_os("POSTCACHE_BIN") {
            return bin.into();
        }
        let exe = std::env::current_exe().expect("the running executable");
        // tests: target/<profile>/deps/<test>; examples: target/<profile>/examples/<example>
        exe.parent()
            .and_then(Path::parent)
            .expect("a target directory")
            .join("postcache")
    }

    /// Starts the binary with the environment `vars` and waits until
    /// /healthz answers.
    pub async fn start(vars: &[(&str, String)]) -> Self {
        let port = free_port();
        let log = std::env::temp_dir().join(format!("postcache-{port}-{}.log", std::process::id()));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(Self::binary())
            .arg("serve")
            .env("LISTEN_ADDR", format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "info")
            .envs(vars.iter().map(|(k, v)| (k, v)))
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("failed to start postcache");
        let me = Self {
            http: Http::new(format!("http://127.0.0.1:{port}")),
            child: Some(child),
            log,
        };
        let http = &me.http;
        let started = eventually(Duration::from_secs(20), async || {
            http.send(reqwest::Method::GET, "/healthz", &[])
                .await
                .is_ok()
        })
        .await;
        assert!(started, "postcache did not start: {}", me.logs());
        me
    }

    /// Runs `postcache serve` with the environment `vars` until it exits,
    /// for settings it must refuse: its exit status and output (stdout and
    /// stderr), or `None` if it was still running after `limit` (killed).
    pub async fn refused(
        vars: &[(&str, String)],
        limit: Duration,
    ) -> Option<(std::process::ExitStatus, String)> {
        let port = free_port();
        let log = std::env::temp_dir().join(format!(
            "postcache-refused-{port}-{}.log",
            std::process::id()
        ));
        let file = std::fs::File::create(&log).unwrap();
        let mut child = Command::new(Self::binary())
            .arg("serve")
            .env("LISTEN_ADDR", format!("127.0.0.1:{port}"))
            .envs(vars.iter().map(|(k, v)| (k, v)))
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("failed to start postcache");
        let mut status = None;
        eventually(limit, async || {
            status = child.try_wait().unwrap();
            status.is_some()
        })
        .await;
        if status.is_none() {
            kill(Some(child));
        }
        let output = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        status.map(|status| (status, output))
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The process's resident memory (VmRSS), in MiB.
    pub fn resident_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the process's status");
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in the status");
        kib / 1024.0
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Whether the process exits within `limit`.
    pub async fn exits_within(&mut self, limit: Duration) -> bool {
        let child = self.child.as_mut().expect("running");
        eventually(limit, async || child.try_wait().unwrap().is_some()).await
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        kill(self.child.take());
        let _ = std::fs::remove_file(&self.log);
    }
}
