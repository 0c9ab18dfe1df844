//! Test support: requests to an instance, and instances running in the
//! test's process.

use std::time::{Duration, Instant};

use reqwest::{header::HeaderMap, Method};
use sqlx::Connection;
use tokio::{sync::oneshot, task::JoinHandle};

use super::{wait_until, A_WHILE};
use crate::{http::AppState, startup::Application};

/// The one way tests send requests: a cloneable client bound to an
/// instance's base URL.
#[derive(Clone)]
pub struct Http {
    client: reqwest::Client,
    pub base: String,
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub x_cache: Option<String>,
    pub content_type: Option<String>,
    pub body: bytes::Bytes,
    pub headers: HeaderMap,
}

impl Reply {
    /// `X-Cache-Tier`: where a hit was found (`memory`, `redis`).
    pub fn tier(&self) -> Option<&str> {
        self.headers
            .get("x-cache-tier")
            .and_then(|v| v.to_str().ok())
    }

    /// `Cache-Status` (RFC 9211): how the answer was served, in the
    /// standard's words.
    pub fn cache_status(&self) -> Option<&str> {
        self.headers
            .get("cache-status")
            .and_then(|v| v.to_str().ok())
    }

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

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl Http {
    pub fn new(base: String) -> Self {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(1024)
            .build()
            .expect("a client");
        Self { client, base }
    }

    /// The instance's address, for bare sockets.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.base
            .trim_start_matches("http://")
            .parse()
            .expect("an http://ip:port base")
    }

    /// Sends a request with `headers`; an error when no response came.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<Reply, reqwest::Error> {
        let mut request = self.client.request(method, format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap_or_default().to_owned())
        };
        let (x_cache, content_type) = (header("x-cache"), header("content-type"));
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await?;
        Ok(Reply {
            status,
            x_cache,
            content_type,
            body,
            headers,
        })
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.request(Method::GET, path).await
    }

    pub async fn request(&self, method: Method, path: &str) -> Reply {
        self.send(method, path, &[]).await.expect("request failed")
    }

    /// The title `GET /posts/{id}` serves; `None` when it is not a 200.
    pub async fn title(&self, id: i64) -> Option<String> {
        let reply = self.get(&format!("/posts/{id}")).await;
        (reply.status == 200).then(|| reply.json()["title"].as_str().unwrap().to_owned())
    }

    /// A series of the instance's `/metrics` (`name{labels}` as rendered),
    /// 0 when absent.
    pub async fn metric(&self, series: &str) -> f64 {
        metric(&self.get("/metrics").await.text(), series).unwrap_or(0.0)
    }

    /// Sends a GET as a task of its own; it answers with the reply and the
    /// instant it arrived.
    pub fn spawn_get(&self, path: &str) -> JoinHandle<(Reply, Instant)> {
        let (http, path) = (self.clone(), path.to_owned());
        tokio::spawn(async move {
            let reply = http.get(&path).await;
            (reply, Instant::now())
        })
    }
}

/// A series in a Prometheus text exposition (`name{labels}` as rendered).
pub fn metric(exposition: &str, series: &str) -> Option<f64> {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// Fires `n` GETs of `path` as tasks, spread round-robin over `apps`.
pub fn fire(apps: &[TestApp], path: &str, n: usize) -> Vec<JoinHandle<(Reply, Instant)>> {
    (0..n)
        .map(|i| apps[i % apps.len()].http.spawn_get(path))
        .collect()
}

/// Waits for every request fired (each is bounded by the service's own
/// REQUEST_TIMEOUT) and returns the replies with when they arrived.
pub async fn answered(requests: Vec<JoinHandle<(Reply, Instant)>>) -> Vec<(Reply, Instant)> {
    let mut replies = Vec::with_capacity(requests.len());
    for request in requests {
        replies.push(request.await.expect("the request task"));
    }
    replies
}

/// Reads not yet answered over `apps`.
pub fn in_progress(apps: &[TestApp]) -> usize {
    apps.iter().map(TestApp::reads_in_progress).sum()
}

/// One instance running in the test's process.
pub struct TestApp {
    pub http: Http,
    pub state: AppState,
    stop: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<()>>,
}

impl TestApp {
    pub(super) fn start(app: Application) -> Self {
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
        Self {
            http: Http::new(format!("http://{addr}")),
            state,
            stop: Some(stop),
            handle: Some(handle),
        }
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.http.get(path).await
    }

    /// Reads this instance has not answered yet.
    pub fn reads_in_progress(&self) -> usize {
        self.state.read_path.reads_in_progress()
    }

    /// Closes the instance's idle PostgreSQL connections, so that their
    /// backends exit and flush their statistics; the pool reconnects on demand.
    pub async fn stop_pool_connections(&self) {
        let pool = &self.state.db;
        wait_until("idle connections to close", A_WHILE, async || {
            if let Some(conn) = pool.try_acquire() {
                let _ = conn.detach().close().await;
            }
            pool.num_idle() == 0
        })
        .await;
    }

    /// Graceful stop: waits for in-flight requests and closes the pools.
    pub async fn stop(mut self) {
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
