//! Loads from a read replica that always lags: the replica's share of the
//! loads, old versions served, and commit → new version, with the standby
//! up and then stopped mid-run.
//!
//! ```text
//! cargo build --release && cargo run --release --example replicas [-- 1000]
//! ```
//!
//! Starts a private redis-server, a private PostgreSQL primary and a
//! streaming standby of it (`pg_basebackup -R`, `recovery_min_apply_delay =
//! 500ms`, so it is always behind), and three release instances
//! (`target/release/postcache`, or POSTCACHE_BIN) with CHANGE_FEED
//! replication and the standby as DATABASE_REPLICA_URLS, over 1,000 posts.
//! Runs a Zipf(1.1) read load (about 1,000 requests/s) and commits N updates
//! (default 1,000), one every 10 ms, to the 20 hottest posts, each setting a
//! new version into the title; after each commit a probe per instance reads
//! the post every millisecond until it carries the new version, then ten
//! more times, counting any older version. Then the same again with the
//! standby stopped halfway.

mod commit_to_read;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use futures::future::join_all;
use postcache::testkit::{quantile, Http, PgServer, RedisServer, ServiceProcess, TestEnv};

use crate::commit_to_read::{
    changes_asked, ms, read_load, update, AFTER, HOT, INSTANCES, PACE, POSTS, PROBE_LIMIT,
};

struct Probe {
    fresh_after: Option<Duration>,
    old_after_new: usize,
    not_ok: usize,
}

async fn version(http: &Http, id: i64) -> Result<u64, ()> {
    let reply = http.get(&format!("/posts/{id}")).await;
    if reply.status != 200 {
        return Err(());
    }
    // The seeded title (no version yet) counts as version 0.
    Ok(reply.json()["title"]
        .as_str()
        .and_then(|t| t.strip_prefix('v'))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0))
}

async fn probe(http: Http, id: i64, wanted: u64, committed: Instant) -> Probe {
    let mut p = Probe {
        fresh_after: None,
        old_after_new: 0,
        not_ok: 0,
    };
    while committed.elapsed() < PROBE_LIMIT {
        match version(&http, id).await {
            Ok(v) if v >= wanted => {
                p.fresh_after = Some(committed.elapsed());
                break;
            }
            Ok(_) => {}
            Err(()) => p.not_ok += 1,
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    if p.fresh_after.is_some() {
        for _ in 0..AFTER {
            match version(&http, id).await {
                Ok(v) if v >= wanted => {}
                Ok(_) => p.old_after_new += 1,
                Err(()) => p.not_ok += 1,
            }
        }
    }
    p
}

/// Loads routed, over the fleet, by `to/reason`
/// (`postcache_replica_routed_total`).
async fn routed(fleet: &[ServiceProcess]) -> BTreeMap<String, f64> {
    let mut routed = BTreeMap::new();
    for s in fleet {
        let text = s.http.get("/metrics").await.text();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("postcache_replica_routed_total{") else {
                continue;
            };
            let label = |name: &str| rest.split(&format!("{name}=\"")).nth(1)?.split('"').next();
            let (Some(to), Some(reason)) = (label("to"), label("reason")) else {
                continue;
            };
            let n: f64 = rest.rsplit(' ').next().unwrap().parse().unwrap();
            *routed.entry(format!("{to}/{reason}")).or_default() += n;
        }
    }
    routed
}

/// One run of `changes` updates; `halfway` runs at its middle.
async fn run(
    label: &str,
    env: &TestEnv,
    fleet: &[ServiceProcess],
    first: u64,
    changes: u64,
    mut halfway: impl FnMut(),
) -> u64 {
    let https: Vec<Http> = fleet.iter().map(|s| s.http.clone()).collect();
    let routed0 = routed(fleet).await;
    let load = read_load(&https).await;
    let mut probes = Vec::new();
    let mut every = tokio::time::interval(PACE);
    for n in first..first + changes {
        every.tick().await;
        if n == first + changes / 2 {
            halfway();
        }
        let id = (n as i64) % HOT + 1;
        update(env, id, n).await;
        let committed = Instant::now();
        for http in &https {
            probes.push(tokio::spawn(probe(http.clone(), id, n, committed)));
        }
    }
    let probes: Vec<Probe> = join_all(probes)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let record = load.stop().await;
    let mut by: BTreeMap<String, f64> = routed(fleet).await;
    for (route, n) in &routed0 {
        *by.entry(route.clone()).or_default() -= n;
    }
    by.retain(|_, n| *n > 0.0);
    let replica: f64 = by
        .iter()
        .filter(|(r, _)| r.starts_with("replica/"))
        .map(|(_, n)| n)
        .sum();
    let primary: f64 = by
        .iter()
        .filter(|(r, _)| r.starts_with("primary/"))
        .map(|(_, n)| n)
        .sum();
    let by: Vec<String> = by.iter().map(|(r, n)| format!("{r} {n:.0}")).collect();
    let mut fresh: Vec<Duration> = probes.iter().filter_map(|p| p.fresh_after).collect();
    fresh.sort();
    let never = probes.len() - fresh.len();
    let old: usize = probes.iter().map(|p| p.old_after_new).sum();
    let not_ok = probes.iter().map(|p| p.not_ok).sum::<usize>() + record.failures().len();
    println!(
        "| {label} | {changes} | {:.0}% ({replica:.0} of {:.0}: {}) | {old} | {} | {} | {} | {never} | {} requests, {not_ok} not 200 |",
        100.0 * replica / (replica + primary).max(1.0),
        replica + primary,
        by.join(", "),
        ms(quantile(&fresh, 0.5)),
        ms(quantile(&fresh, 0.99)),
        ms(fresh.last().copied().unwrap_or_default()),
        record.samples.len() + probes.len(),
    );
    first + changes
}

#[tokio::main]
async fn main() {
    let changes = changes_asked();
    let redis = RedisServer::start().await;
    let primary = PgServer::primary().await;
    let env = TestEnv::on_server(POSTS, primary.url(), redis.url()).await;
    let mut standby = PgServer::standby_of(&primary, &["recovery_min_apply_delay = '500ms'"]).await;
    let vars = [
        ("RUST_LOG", "warn".to_owned()),
        ("CHANGE_FEED", "replication".to_owned()),
        (
            "DATABASE_REPLICA_URLS",
            format!("{}/{}", standby.url(), env.db_name),
        ),
    ];
    let fleet = join_all((0..INSTANCES).map(|_| env.start_process(&vars))).await;
    for s in &fleet {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = s.http.get("/readyz").await.json();
            if ready["change_feed"] == "up" && ready["replicas"][0]["state"] == "up" {
                break;
            }
            assert!(Instant::now() < deadline, "not ready: {ready}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    println!(
        "{INSTANCES} instances, a standby always 500 ms behind (recovery_min_apply_delay), \
         Zipf(1.1) reads over {POSTS} posts, updates to the {HOT} hottest every {} ms\n",
        PACE.as_millis()
    );
    println!("| run | updates | loads read from the replica | older version after the new one | commit → new version p50 (ms) | p99 | max | never fresh within 5 s | reads |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let next = run("standby up", &env, &fleet, 1, changes, || {}).await;
    run(
        "standby stopped halfway",
        &env,
        &fleet,
        next,
        changes,
        || standby.stop(),
    )
    .await;
}
