//! Freshness after a change: how soon each instance serves a post's new
//! version once its UPDATE has committed, under a read load.
//!
//! ```text
//! cargo build --release && cargo run --release --example change_feed [-- 1000]
//! CHANGE_FEED=trigger cargo run --release --example change_feed
//! ```
//!
//! CHANGE_FEED (default `replication`) is passed to the instances.
//! Starts a private redis-server and three release instances
//! (`target/release/postcache`, or POSTCACHE_BIN) over 1,000 posts, runs a
//! Zipf(1.1) read load over them (about 1,000 requests/s), and commits N
//! updates (default 1,000), one every 10 ms, to the 20 hottest posts, each
//! setting a new version into the title. After each commit, a probe per
//! instance reads the post every millisecond until it carries the new
//! version (the time from the commit to that response is the figure), then
//! ten more times: any older version then is counted (it must be 0). Last,
//! with the load stopped, the Redis commands the instances send per change
//! (seen by MONITOR, less what they send with no change over as long), and
//! the transactions the fleet runs on PostgreSQL per change (from
//! `pg_stat_database`, less the updates themselves and what runs with no
//! change over as long).

mod commit_to_read;

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use futures::future::join_all;
use postcache::testkit::{quantile, Http, RedisServer, TestEnv};

use crate::commit_to_read::{
    changes_asked, ms, read_load, update, AFTER, HOT, INSTANCES, PACE, POSTS, PROBE_LIMIT,
};

/// Updates made with the load stopped, to count Redis commands.
const QUIET_CHANGES: i64 = 200;

/// What one probe saw on one instance.
struct Probe {
    /// From the commit to the first response with the new version.
    fresh_after: Option<Duration>,
    /// Responses with an older version after that one.
    old_after_new: usize,
}

async fn version(http: &Http, id: i64) -> Option<u64> {
    let reply = http.get(&format!("/posts/{id}")).await;
    if reply.status != 200 {
        return None;
    }
    reply.json()["title"]
        .as_str()?
        .strip_prefix('v')?
        .parse()
        .ok()
}

async fn probe(http: Http, id: i64, wanted: u64, committed: Instant) -> Probe {
    let mut fresh_after = None;
    while committed.elapsed() < PROBE_LIMIT {
        if version(&http, id).await.is_some_and(|v| v >= wanted) {
            fresh_after = Some(committed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut old_after_new = 0;
    if fresh_after.is_some() {
        for _ in 0..AFTER {
            if version(&http, id).await.is_none_or(|v| v < wanted) {
                old_after_new += 1;
            }
        }
    }
    Probe {
        fresh_after,
        old_after_new,
    }
}

/// The commands the instances send to `redis` (MONITOR's lines, less
/// those run inside scripts) while `during` runs: (all, EVALSHA).
async fn sent_while(
    redis: &RedisServer,
    during: impl std::future::Future<Output = ()>,
) -> (u64, u64) {
    use std::io::BufRead;
    let port = redis.url().rsplit(':').next().unwrap().to_owned();
    let mut monitor = std::process::Command::new("redis-cli")
        .args(["-p", &port, "monitor"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("redis-cli monitor");
    let out = monitor.stdout.take().unwrap();
    let lines = std::thread::spawn(move || {
        std::io::BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    during.await;
    let _ = monitor.kill();
    let _ = monitor.wait();
    let lines = lines.join().unwrap();
    let sent: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains('"') && !l.contains(" lua]"))
        .collect();
    let evalsha = sent
        .iter()
        .filter(|l| l.to_ascii_lowercase().contains("\"evalsha\""))
        .count();
    (sent.len() as u64, evalsha as u64)
}

#[tokio::main]
async fn main() {
    let changes = changes_asked();
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(POSTS, redis.url()).await;
    let mode = std::env::var("CHANGE_FEED").unwrap_or_else(|_| "replication".into());
    let vars = [
        ("RUST_LOG", "warn".to_owned()),
        ("CHANGE_FEED", mode.clone()),
    ];
    let fleet = join_all((0..INSTANCES).map(|_| env.start_process(&vars))).await;
    let https: Vec<Http> = fleet.iter().map(|s| s.http.clone()).collect();
    for id in 1..=HOT {
        for http in &https {
            http.get(&format!("/posts/{id}")).await;
        }
    }

    let load = read_load(&https).await;
    let mut probes = Vec::new();
    let mut every = tokio::time::interval(PACE);
    for n in 1..=changes {
        every.tick().await;
        let id = (n as i64 - 1) % HOT + 1;
        update(&env, id, n).await;
        let committed = Instant::now();
        for (instance, http) in https.iter().enumerate() {
            let probing = tokio::spawn(probe(http.clone(), id, n, committed));
            probes.push((instance, probing));
        }
    }
    let mut seen: HashMap<usize, Vec<Probe>> = HashMap::new();
    for (instance, probing) in probes {
        seen.entry(instance)
            .or_default()
            .push(probing.await.unwrap());
    }
    let record = load.stop().await;

    // Redis commands per change, with the load stopped: less what the
    // instances send in as long with no change at all.
    let quiet = Duration::from_secs(3);
    let xacts_before = transactions(&env).await;
    let (background, _) = sent_while(&redis, tokio::time::sleep(quiet)).await;
    let xacts_idle = transactions(&env).await - xacts_before;
    let (sent, evalsha) = sent_while(&redis, async {
        let started = Instant::now();
        for n in 0..QUIET_CHANGES {
            update(&env, n % HOT + 1, changes + 1 + n as u64).await;
        }
        tokio::time::sleep(quiet.saturating_sub(started.elapsed())).await;
    })
    .await;
    let xacts_changing = transactions(&env).await - xacts_before - xacts_idle;
    let per_change = |calls: u64| calls as f64 / QUIET_CHANGES as f64 / INSTANCES as f64;
    // The updates are transactions too (each its own).
    let fleet_xacts =
        (xacts_changing - xacts_idle - QUIET_CHANGES).max(0) as f64 / QUIET_CHANGES as f64;

    println!("CHANGE_FEED={mode}, {INSTANCES} instances\n");
    println!(
        "| instance | changes | fresh after commit, p50 (ms) | p99 | max | never fresh within {}s | older version after the new one |",
        PROBE_LIMIT.as_secs()
    );
    println!("|---|---|---|---|---|---|---|");
    let mut all = Vec::new();
    for instance in 0..INSTANCES {
        let probes = &seen[&instance];
        let mut fresh: Vec<Duration> = probes.iter().filter_map(|p| p.fresh_after).collect();
        fresh.sort();
        all.extend(fresh.iter().copied());
        let never = probes.len() - fresh.len();
        let old: usize = probes.iter().map(|p| p.old_after_new).sum();
        println!(
            "| {} | {} | {} | {} | {} | {never} | {old} |",
            instance + 1,
            probes.len(),
            ms(quantile(&fresh, 0.5)),
            ms(quantile(&fresh, 0.99)),
            ms(*fresh.last().unwrap()),
        );
    }
    all.sort();
    println!(
        "| all | {} | {} | {} | {} | | |",
        all.len(),
        ms(quantile(&all, 0.5)),
        ms(quantile(&all, 0.99)),
        ms(*all.last().unwrap()),
    );
    println!();
    let failed = record.failures().len();
    println!(
        "Read load meanwhile: {} requests, {failed} not 200. Redis commands per change per instance, \
         with the load stopped: {:.2} sent ({:.2} EVALSHA: the change applied), less {background} \
         sent in {}s with no change (the cutoff's follower, the feed's beat); commands run inside \
         the scripts are not counted.",
        record.samples.len(),
        per_change(sent.saturating_sub(background)),
        per_change(evalsha),
        quiet.as_secs(),
    );
    println!(
        "PostgreSQL transactions the whole fleet ran per change, with the load stopped: \
         {fleet_xacts:.2} (less the update itself and {xacts_idle} run in {}s with no change; \
         the replication stream is not a transaction).",
        quiet.as_secs()
    );
}

/// Transactions committed in the world's database so far (the statistics
/// are flushed within a second: waited for).
async fn transactions(env: &TestEnv) -> i64 {
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sqlx::query_scalar("select xact_commit from pg_stat_database where datname = $1")
        .bind(&env.db_name)
        .fetch_one(&env.admin)
        .await
        .unwrap()
}
