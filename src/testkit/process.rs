//! A TCP proxy that cuts or stalls connections, and `postcache serve` as a
//! process that can be signalled.

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
/// refused), or stalled (bytes held, connections kept).
pub struct TcpProxy {
    pub addr: SocketAddr,
    open: Arc<AtomicBool>,
    stalled: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl TcpProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicBool::new(true));
        let stalled = Arc::new(AtomicBool::new(false));
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = tokio::spawn({
            let (open, stalled, connections) = (open.clone(), stalled.clone(), connections.clone());
            async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    if !open.load(Ordering::SeqCst) {
                        let _ = client.shutdown().await;
                        continue;
                    }
                    let stalled = stalled.clone();
                    let pipe = tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(target).await else {
                            return;
                        };
                        let (client_rx, client_tx) = client.into_split();
                        let (server_rx, server_tx) = server.into_split();
                        tokio::join!(
                            pump(client_rx, server_tx, stalled.clone()),
                            pump(server_rx, client_tx, stalled)
                        );
                    });
                    connections.lock().unwrap().push(pipe);
                }
            }
        });
        Self {
            addr,
            open,
            stalled,
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

    /// Holds every byte in both directions (a network that stalls) until
    /// `stall(false)`; connections stay open.
    pub fn stall(&self, stalled: bool) {
        self.stalled.store(stalled, Ordering::SeqCst);
    }
}

/// Copies one direction of a connection, holding bytes while stalled.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stalled: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while stalled.load(Ordering::SeqCst) {
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
    fn binary() -> PathBuf {
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

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
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
