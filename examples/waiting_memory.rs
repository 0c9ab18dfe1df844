//! Memory of one instance holding 10,000 concurrent waiting requests.
//!
//! ```text
//! cargo build --release && cargo run --release --example waiting_memory [-- 10000]
//! ```
//!
//! Starts the release binary (`target/release/postcache`, or POSTCACHE_BIN),
//! holds the leader's load back with a table lock, opens N concurrent requests
//! for one cold post, and reads the process's resident memory (VmRSS) before,
//! while all N wait, after they are answered, and 20 s after their
//! connections were closed (what the allocator has given back).

use std::time::{Duration, Instant};

use futures::future::join_all;
use postcache::testkit::{wait_until, Http, TableLock, TestEnv};

/// How long after the burst's connections closed the memory is read again.
const RETURN_WAIT: u64 = 20;
/// Longest wait for the burst's connections to close.
const CLOSE_WAIT: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map_or(10_000, |s| s.parse().expect("N"));
    let env = TestEnv::new(10).await;
    let service = env
        .start_process(&[
            ("WAIT_TIMEOUT", "60s".into()),
            ("LOCK_TTL", "90s".into()),
            ("DB_STATEMENT_TIMEOUT", "80s".into()),
            ("REQUEST_TIMEOUT", "120s".into()),
            // The burst's kept-alive connections are closed soon after it.
            ("IDLE_TIMEOUT", "5s".into()),
            // Every request on a connection of its own, and the metrics' too.
            ("MAX_CONNECTIONS", (n + 16).to_string()),
            ("RUST_LOG", "warn".into()),
        ])
        .await;
    let http = &service.http;
    // Warm the connection pools and allocator with a few ordinary requests.
    for id in 1..=5 {
        http.get(&format!("/posts/{id}")).await;
    }
    let idle = service.resident_mib();

    let lock = TableLock::take(&env).await;
    let started = Instant::now();
    // A client of its own, dropped after the burst: its connections close.
    let burst = Http::new(http.base.clone());
    let requests: Vec<_> = (0..n).map(|_| burst.spawn_get("/posts/9")).collect();
    wait_until(
        "every request to arrive",
        Duration::from_secs(60),
        async || http.metric("postcache_reads_in_progress").await >= n as f64,
    )
    .await;
    let arrived = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let waiting = service.resident_mib();
    lock.release().await;
    let statuses = join_all(requests).await;
    let ok = statuses
        .iter()
        .filter(|r| r.as_ref().is_ok_and(|(reply, _)| reply.status == 200))
        .count();
    let after = service.resident_mib();
    drop(burst);
    // Bounded: a connection still open is reported, not waited for.
    let closing = Instant::now();
    let open = loop {
        let open = http.metric("postcache_connections_open").await - 1.0;
        if open <= 0.0 || closing.elapsed() > CLOSE_WAIT {
            break open;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let closed_in = closing.elapsed();
    // The allocator hands freed pages back to the system after a delay
    // (jemalloc: about ten seconds of decay).
    tokio::time::sleep(Duration::from_secs(RETURN_WAIT)).await;
    let later = service.resident_mib();

    println!("| instance state | resident memory (MiB) |");
    println!("|---|---|");
    println!("| idle, warmed | {idle:.1} |");
    println!("| {n} requests waiting on one load | {waiting:.1} |");
    println!("| after all were answered | {after:.1} |");
    println!("| {RETURN_WAIT} s after their connections closed | {later:.1} |");
    println!();
    println!(
        "{:.1} KiB per waiting request (connection, HTTP state, task); {n} arrived in {:.1} s; {ok}/{n} answered 200",
        (waiting - idle) * 1024.0 / n as f64,
        arrived.as_secs_f64()
    );
    println!(
        "the burst's connections closed in {:.1} s ({open} still open)",
        closed_in.as_secs_f64()
    );
}
