//! Memory of one instance holding 5,000 slow or idle clients, before and
//! after their deadlines close them, and what a client past MAX_CONNECTIONS
//! gets.
//!
//! ```text
//! cargo build --release && cargo run --release --example slow_clients [-- 5000]
//! ```
//!
//! Starts the release binary (`target/release/postcache`, or POSTCACHE_BIN)
//! with HEADER_READ_TIMEOUT=5s, IDLE_TIMEOUT=5s and MAX_CONNECTIONS=N, then:
//! N connections that send a request line and one header and nothing more
//! (half-open); 500 more past the cap; after the header deadline, N
//! kept-alive connections left idle after one request each. It reads the
//! process's resident memory (VmRSS) at each step and prints a table.

use std::time::{Duration, Instant};

use futures::{stream, StreamExt};
use postcache::testkit::{RawConn, TestEnv};

const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
const PAST_THE_CAP: usize = 500;
/// Connections opened at once (the listen queue holds 1,024).
const OPENING: usize = 256;

/// Opens `n` connections, each sent `first` (if any) and then nothing more.
async fn open(addr: std::net::SocketAddr, n: usize, first: Option<&'static [u8]>) -> Vec<RawConn> {
    stream::iter(0..n)
        .map(|_| async move {
            let mut conn = RawConn::open(addr).await;
            if let Some(bytes) = first {
                conn.send(bytes).await.expect("send");
            }
            conn
        })
        .buffer_unordered(OPENING)
        .collect()
        .await
}

/// Waits for the server to close every connection; the seconds from their
/// opening (or their last answer) to their close, the slowest one.
async fn all_closed(conns: &mut [RawConn]) -> f64 {
    let closes = stream::iter(conns.iter_mut())
        .map(|c| async {
            let closed = c
                .closed_within(Duration::from_secs(60))
                .await
                .expect("closed by the server");
            (closed - c.answered.unwrap_or(c.opened)).as_secs_f64()
        })
        .buffer_unordered(OPENING)
        .collect::<Vec<_>>()
        .await;
    closes.into_iter().fold(0.0, f64::max)
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map_or(5_000, |s| s.parse().expect("N"));
    let env = TestEnv::new(10).await;
    let service = env
        .start_process(&[
            ("HEADER_READ_TIMEOUT", "5s".into()),
            ("IDLE_TIMEOUT", "5s".into()),
            ("MAX_CONNECTIONS", n.to_string()),
            ("RUST_LOG", "warn".into()),
        ])
        .await;
    let addr = service.http.addr();
    for id in 1..=5 {
        RawConn::open(addr).await.get(&format!("/posts/{id}")).await;
    }
    let idle = service.resident_mib();

    let started = Instant::now();
    let mut half_open = open(
        addr,
        n,
        Some(b"GET /posts/1 HTTP/1.1\r\nhost: postcache\r\n"),
    )
    .await;
    let opened_in = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let holding = service.resident_mib();

    let refusals: Vec<(bool, Duration)> = stream::iter(0..PAST_THE_CAP)
        .map(|_| async move {
            let mut conn = RawConn::open(addr).await;
            let reply = conn.reply(Duration::from_secs(5)).await;
            (
                reply.is_some_and(|r| r.status == 503),
                conn.opened.elapsed(),
            )
        })
        .buffer_unordered(OPENING)
        .collect()
        .await;
    let refused = refusals.iter().filter(|(is_503, _)| *is_503).count();
    let slowest_refusal = refusals.iter().map(|(_, took)| *took).max().unwrap();

    let slowest_half = all_closed(&mut half_open).await;
    drop(half_open);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after_half = service.resident_mib();
    let served = RawConn::open(addr).await.get("/posts/2").await.status;

    let mut kept = open(addr, n, None).await;
    stream::iter(kept.iter_mut())
        .for_each_concurrent(OPENING, |c| async {
            assert_eq!(c.get("/posts/3").await.status, 200);
        })
        .await;
    let idle_held = service.resident_mib();
    let slowest_idle = all_closed(&mut kept).await;
    drop(kept);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after_idle = service.resident_mib();

    println!("| instance state | resident memory (MiB) |");
    println!("|---|---|");
    println!("| idle, warmed | {idle:.1} |");
    println!("| {n} half-open connections (headers never finished) | {holding:.1} |");
    println!(
        "| after HEADER_READ_TIMEOUT ({}s) closed them | {after_half:.1} |",
        HEADER_READ_TIMEOUT.as_secs()
    );
    println!("| {n} idle kept-alive connections (one request each) | {idle_held:.1} |");
    println!(
        "| after IDLE_TIMEOUT ({}s) closed them | {after_idle:.1} |",
        IDLE_TIMEOUT.as_secs()
    );
    println!();
    println!(
        "{:.1} KiB per half-open connection; {:.1} KiB more per idle kept-alive one, in the \
         memory the half-open ones left; \
         {n} opened in {:.1} s; the last half-open one closed {slowest_half:.1} s after it \
         opened, the last idle one {slowest_idle:.1} s after its answer",
        (holding - idle) * 1024.0 / n as f64,
        (idle_held - after_half) * 1024.0 / n as f64,
        opened_in.as_secs_f64(),
    );
    println!(
        "past MAX_CONNECTIONS={n}: {refused}/{PAST_THE_CAP} new connections answered 503, \
         the slowest {:.1} ms after its connect; after the deadline a new client got {served}",
        slowest_refusal.as_secs_f64() * 1000.0
    );
}
