//! Stampede benchmark: 1,000 concurrent requests on a cold key over 4
//! instances, 20 times, against the real PostgreSQL and Redis.
//!
//! ```text
//! cargo run --release --example stampede [-- --rounds 20 --requests 1000 --instances 4]
//! ```
//!
//! Each round holds the leader's load back with a table lock until every
//! request is inside the service, releases it, and measures:
//! - database reads per stampede, from PostgreSQL's own statistics;
//! - Redis commands per request, from `INFO commandstats` deltas;
//! - how long after the leader's publish each waiting instance's flight was
//!   woken (inside the service: the pub/sub path itself), and how long after it
//!   each client got its answer (this adds the fan-out of 1,000 HTTP responses
//!   on this machine's cores). The publish instant is seen by a subscriber of
//!   the benchmark's own.
//!
//! It uses Redis's command statistics, so run it while nothing else uses that Redis.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use fred::{clients::SubscriberClient, prelude::*};
use futures::future::join_all;
use postcache::{
    read_path::{Hooks, WaitEnd},
    testkit::{fire, quantile, TableLock, TestApp, TestEnv, PATIENT},
};

struct Args {
    rounds: usize,
    requests: usize,
    instances: usize,
    strategy: String,
}

fn args() -> Args {
    let mut a = Args {
        rounds: 20,
        requests: 1000,
        instances: 4,
        strategy: "pubsub".into(),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let value = pair.get(1).cloned().unwrap_or_default();
        match pair[0].as_str() {
            "--rounds" => a.rounds = value.parse().expect("--rounds N"),
            "--requests" => a.requests = value.parse().expect("--requests N"),
            "--instances" => a.instances = value.parse().expect("--instances N"),
            "--strategy" => a.strategy = value,
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

async fn commandstats(redis: &Client) -> HashMap<String, u64> {
    let info: String = redis
        .info(Some(fred::types::InfoKind::CommandStats))
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let a = args();
    let env = TestEnv::new(a.rounds as u64 + 10).await;
    let flags = [PATIENT, &["--cache-strategy", a.strategy.as_str()]].concat();
    let watcher = Builder::from_config(Config::from_url(&env.redis_url).unwrap())
        .build_subscriber_client()
        .unwrap();
    watcher.init().await.unwrap();

    println!(
        "stampede: {} requests on a cold key over {} instances ({}), {} rounds",
        a.requests, a.instances, a.strategy, a.rounds
    );
    println!("| round | db reads | redis cmds | cmds/request | miss | coalesced | flights woken after publish, max ms | clients answered after publish p50 ms | p99 ms |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let wakes: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let hooks = Hooks {
        wait_ended: Some({
            let wakes = wakes.clone();
            Arc::new(move |ended_by| {
                if ended_by == WaitEnd::Message {
                    wakes.lock().unwrap().push(Instant::now());
                }
            })
        }),
        ..Hooks::default()
    };
    let mut all_wakes = Vec::new();
    let mut all_after = Vec::new();
    let mut total_reads = Vec::new();
    let mut total_cmds = 0;
    for round in 1..=a.rounds {
        let id = round as i64;
        let reads_before = env.post_reads().await;
        let apps: Vec<TestApp> =
            join_all((0..a.instances).map(|_| env.spawn_with_hooks(&flags, hooks.clone()))).await;
        wakes.lock().unwrap().clear();
        let published = watch_publish(&watcher, &env.keys.channel(id)).await;
        let cmds_before = commandstats(&env.redis).await;
        let lock = TableLock::take(&env).await;

        let requests = fire(&apps, &format!("/posts/{id}"), a.requests);
        env.until_held(&apps, a.requests).await;
        lock.release().await;
        let results: Vec<_> = join_all(requests)
            .await
            .into_iter()
            .map(|r| {
                let (reply, at) = r.unwrap();
                (reply.status, reply.x_cache, at)
            })
            .collect();
        let published_at = tokio::time::timeout(Duration::from_secs(5), published)
            .await
            .expect("no publish seen")
            .unwrap();
        let cmds_after = commandstats(&env.redis).await;
        for app in apps {
            app.stop().await;
        }
        let reads = env.post_reads().await - reads_before;

        let cmds: u64 = cmds_after
            .iter()
            .map(|(name, calls)| calls - cmds_before.get(name).copied().unwrap_or(0))
            .sum::<u64>()
            - 1; // the INFO that took the second reading
        total_cmds += cmds;
        let count = |t: &str| results.iter().filter(|r| r.1.as_deref() == Some(t)).count();
        assert!(results.iter().all(|r| r.0 == 200), "a request failed");
        let mut after: Vec<Duration> = results
            .iter()
            .filter(|r| r.1.as_deref() == Some("coalesced"))
            .map(|r| r.2.saturating_duration_since(published_at))
            .collect();
        after.sort();
        let mut woken: Vec<Duration> = wakes
            .lock()
            .unwrap()
            .iter()
            .map(|at| at.saturating_duration_since(published_at))
            .collect();
        woken.sort();
        println!(
            "| {round} | {reads} | {cmds} | {:.3} | {} | {} | {} ({} flights) | {} | {} |",
            cmds as f64 / a.requests as f64,
            count("miss"),
            count("coalesced"),
            ms(quantile(&woken, 1.0)),
            woken.len(),
            ms(quantile(&after, 0.5)),
            ms(quantile(&after, 0.99)),
        );
        all_wakes.extend(woken);
        all_after.extend(after);
        total_reads.push(reads);
    }
    all_after.sort();
    all_wakes.sort();
    println!();
    println!(
        "summary: db reads per stampede min {} max {}; redis commands per request {:.3}; \
         waiting flights woken after the publish p50 {} ms, p99 {} ms ({} flights); \
         clients answered after the publish p50 {} ms, p99 {} ms",
        total_reads.iter().min().unwrap(),
        total_reads.iter().max().unwrap(),
        total_cmds as f64 / (a.requests * a.rounds) as f64,
        ms(quantile(&all_wakes, 0.5)),
        ms(quantile(&all_wakes, 0.99)),
        all_wakes.len(),
        ms(quantile(&all_after, 0.5)),
        ms(quantile(&all_after, 0.99)),
    );
}

/// Resolves with the instant the benchmark's own subscriber saw a publish on `channel`.
async fn watch_publish(
    watcher: &SubscriberClient,
    channel: &str,
) -> tokio::task::JoinHandle<Instant> {
    let mut rx = watcher.message_rx();
    watcher.subscribe(channel).await.unwrap();
    let channel = channel.to_owned();
    tokio::spawn(async move {
        loop {
            let m = rx.recv().await.unwrap();
            if *m.channel == *channel {
                return Instant::now();
            }
        }
    })
}
