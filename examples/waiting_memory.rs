//! Memory of one instance holding 10,000 concurrent waiting requests.
//!
//! ```text
//! cargo build --release && cargo run --release --example waiting_memory [-- 10000]
//! ```
//!
//! Starts the release binary (`target/release/postcache`, or POSTCACHE_BIN),
//! holds the leader's load back with a table lock, opens N concurrent requests
//! for one cold post, and reads the process's resident memory (VmRSS) before,
//! while all N wait, and after they are answered.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use futures::future::join_all;
use support::{faults::ServiceProcess, TableLock, TestEnv};

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

async fn gauge(http: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map_or(10_000, |s| s.parse().expect("N"));
    let env = TestEnv::new(10).await;
    let service = ServiceProcess::start(&[
        ("DATABASE_URL", env.db_url.clone()),
        ("KEY_PREFIX", env.prefix.clone()),
        ("NO_MIGRATE", "true".into()),
        ("WAIT_TIMEOUT", "60s".into()),
        ("LOCK_TTL", "90s".into()),
        ("DB_STATEMENT_TIMEOUT", "80s".into()),
        ("REQUEST_TIMEOUT", "120s".into()),
        ("RUST_LOG", "warn".into()),
    ])
    .await;
    let pid = service.pid();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(n)
        .build()
        .unwrap();
    // Warm the connection pools and allocator with a few ordinary requests.
    for id in 1..=5 {
        http.get(format!("{}/posts/{id}", service.base))
            .send()
            .await
            .unwrap();
    }
    let idle = rss_kib(pid);

    let lock = TableLock::take(&env).await;
    let started = Instant::now();
    let requests: Vec<_> = (0..n)
        .map(|_| {
            let (http, url) = (http.clone(), format!("{}/posts/9", service.base));
            tokio::spawn(async move { http.get(url).send().await.map(|r| r.status().as_u16()) })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while gauge(&http, &service.base, "postcache_reads_in_progress").await < n as f64 {
        assert!(Instant::now() < deadline, "not all requests arrived");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let arrived = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let waiting = rss_kib(pid);
    lock.release().await;
    let statuses = join_all(requests).await;
    let ok = statuses.iter().filter(|s| matches!(s, Ok(Ok(200)))).count();
    let after = rss_kib(pid);

    println!("| instance state | resident memory (MiB) |");
    println!("|---|---|");
    println!("| idle, warmed | {:.1} |", idle as f64 / 1024.0);
    println!(
        "| {n} requests waiting on one load | {:.1} |",
        waiting as f64 / 1024.0
    );
    println!("| after all were answered | {:.1} |", after as f64 / 1024.0);
    println!();
    println!(
        "{:.1} KiB per waiting request (connection, HTTP state, task); {n} arrived in {:.1} s; {ok}/{n} answered 200",
        (waiting.saturating_sub(idle)) as f64 / n as f64,
        arrived.as_secs_f64()
    );
}
