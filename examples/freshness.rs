//! Freshness benchmark: a hot key with a short CACHE_TTL under constant load,
//! with stale-while-revalidate off, on, and with early refresh.
//!
//! ```text
//! cargo run --release --example freshness [-- --seconds 30 --rate 400]
//! ```
//!
//! The database is made slow for the run (posts becomes a view whose query
//! sleeps 50 ms), so that waiting for a load shows. Each configuration runs
//! two instances for the given time at a constant arrival rate on one post,
//! and prints the share of requests that waited for a load (X-Cache miss or
//! coalesced), the share served stale, latency quantiles and the loads.

use std::time::{Duration, Instant};

use futures::future::join_all;
use postcache::testkit::{numeric_arg, TestApp, TestEnv};

/// How long each load takes during the run.
const SLOW_LOAD: Duration = Duration::from_millis(50);

fn pct(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let seconds = numeric_arg("--seconds", 30);
    let rate = numeric_arg("--rate", 400);
    let env = TestEnv::new(10).await;
    env.slow_loads(SLOW_LOAD).await;
    let configs: [(&str, &[&str]); 3] = [
        ("SWR off", &[]),
        (
            "SWR on (STALE_WHILE_REVALIDATE=10s)",
            &["--stale-while-revalidate", "10s"],
        ),
        (
            "early refresh (EARLY_REFRESH_BETA=1)",
            &["--early-refresh-beta", "1"],
        ),
    ];
    println!(
        "hot key, CACHE_TTL=1s ±10%, loads of {} ms, {rate} requests/s over 2 instances for {seconds} s each",
        SLOW_LOAD.as_millis()
    );
    println!("| configuration | requests | waited for a load | served stale | p50 ms | p99 ms | max ms | database loads |");
    println!("|---|---|---|---|---|---|---|---|");
    for (i, (name, extra)) in configs.iter().enumerate() {
        let id = i as i64 + 1;
        let mut flags = vec![
            "--cache-ttl",
            "1s",
            "--ttl-jitter",
            "0.1",
            "--redis-timeout",
            "1s",
        ];
        flags.extend_from_slice(extra);
        let before = env.post_reads().await;
        let apps: Vec<TestApp> = join_all((0..2).map(|_| env.spawn(&flags))).await;
        apps[0].get(&format!("/posts/{id}")).await; // warm-up

        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let started = Instant::now();
        let mut pending = Vec::new();
        let mut n = 0usize;
        while started.elapsed() < Duration::from_secs(seconds) {
            tick.tick().await;
            let sent = Instant::now();
            let request = apps[n % 2].http.spawn_get(&format!("/posts/{id}"));
            pending.push(async move {
                let (reply, at) = request.await.unwrap();
                (reply.x_cache.unwrap_or_default(), at - sent)
            });
            n += 1;
        }
        let results: Vec<_> = join_all(pending).await;
        for app in apps {
            app.stop().await;
        }
        let db = env.post_reads().await - before;
        let waited = results
            .iter()
            .filter(|(x, _)| x == "miss" || x == "coalesced")
            .count();
        let stale = results.iter().filter(|(x, _)| x == "stale").count();
        let mut lat: Vec<Duration> = results.iter().map(|(_, d)| *d).collect();
        lat.sort();
        println!(
            "| {name} | {} | {:.2}% ({waited}) | {:.2}% | {:.2} | {:.2} | {:.2} | {db} |",
            results.len(),
            100.0 * waited as f64 / results.len() as f64,
            100.0 * stale as f64 / results.len() as f64,
            pct(&lat, 0.5),
            pct(&lat, 0.99),
            pct(&lat, 1.0),
        );
    }
}
