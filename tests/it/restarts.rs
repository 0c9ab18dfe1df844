//! Redis coming back under load: a server restarted empty on the same port,
//! a cluster master restarted. Three instances under a steady Zipf load; no
//! request may fail, and the hit ratio must be back to its level within a
//! second of Redis accepting commands.

use std::time::{Duration, Instant};

use futures::future::join_all;
use postcache::testkit::{
    wait_until, Http, Record, RedisCluster, RedisServer, SteadyLoad, TestApp, TestEnv, Zipf,
};

const POSTS: u64 = 100;
/// The settings of the report: short TTLs, a tight REDIS_TIMEOUT.
const FLAGS: &[&str] = &["--cache-ttl", "3s", "--redis-timeout", "100ms"];
/// How long the hit ratio may take to come back once Redis accepts commands.
const RECOVERY_BOUND: Duration = Duration::from_secs(1);
/// How far the hit ratio may fall short of its level and still count as
/// back: the sampling noise of the ~300 requests of one second.
const NOISE: f64 = 0.04;

/// About 300 requests/s over the fleet.
fn steady_load(apps: &[TestApp]) -> SteadyLoad {
    let fleet: Vec<Http> = apps.iter().map(|a| a.http.clone()).collect();
    SteadyLoad::start(
        &fleet,
        Zipf::new(POSTS as usize, 1.1),
        12,
        Duration::from_millis(40),
    )
}

/// Asserts no failed request, and the hit ratio in the second after
/// [`RECOVERY_BOUND`] past `back` (when Redis accepted commands again) back
/// to its level in the two seconds before `fault`.
fn assert_recovered(record: &Record, fault: Instant, back: Instant) {
    let failures = record.failures();
    assert!(
        failures.is_empty(),
        "{} requests failed, the first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    let second = Duration::from_secs(1);
    let before = record
        .hit_ratio(fault - 2 * second, fault, 200)
        .expect("traffic before the fault");
    let after = record
        .hit_ratio(back + RECOVERY_BOUND, back + RECOVERY_BOUND + second, 200)
        .expect("traffic after the return");
    let first = record.recovery(back, back + 2 * second, before - NOISE, second / 2);
    let report = format!(
        "hit ratio before the fault {:.1}%, from {RECOVERY_BOUND:?} after the return {:.1}%; \
         first half-second back at that level {first:?} after the return; \
         in the first second: {:?}",
        100.0 * before,
        100.0 * after,
        record.mix(back, back + second)
    );
    eprintln!("{report}");
    assert!(after >= before - NOISE, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restarted_empty_under_load_costs_no_error_and_the_hit_ratio_is_back_within_a_second(
) {
    let mut redis = RedisServer::start().await;
    let env = TestEnv::with_redis(POSTS, redis.url()).await;
    let apps = join_all((0..3).map(|_| env.spawn(FLAGS))).await;
    let load = steady_load(&apps);
    // Warm past one TTL, so the hit ratio before is the steady one.
    tokio::time::sleep(Duration::from_secs(4)).await;

    let fault = Instant::now();
    redis.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    redis.restart().await;
    let back = Instant::now();
    // Until just before the entries stored after the return expire.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let record = load.stop().await;

    assert_recovered(&record, fault, back);
}

/// How many scripts a server holds.
fn cached_scripts(info_memory: &str) -> Option<u32> {
    info_memory
        .lines()
        .find_map(|l| l.strip_prefix("number_of_cached_scripts:"))
        .and_then(|n| n.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_that_comes_back_empty_is_given_the_scripts_before_any_request_needs_them() {
    let mut redis = RedisServer::start().await;
    let env = TestEnv::with_redis(10, redis.url()).await;
    let app = env.spawn(&[]).await;
    let scripts = |redis: &RedisServer| cached_scripts(&redis.cli(&["info", "memory"]));
    wait_until(
        "the scripts to be loaded at start",
        Duration::from_secs(5),
        async || scripts(&redis) == Some(3),
    )
    .await;

    redis.restart().await;
    assert_eq!(scripts(&redis), Some(0), "a restarted server has none");
    // No request is sent: the reconnect alone loads them.
    wait_until(
        "the scripts to be loaded again",
        Duration::from_secs(2),
        async || scripts(&redis) == Some(3),
    )
    .await;

    assert_eq!(app.get("/posts/1").await.x_cache.as_deref(), Some("miss"));
    assert_eq!(app.get("/posts/1").await.x_cache.as_deref(), Some("hit"));
    let errors = redis.cli(&["info", "errorstats"]);
    assert!(!errors.contains("NOSCRIPT"), "{errors}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_master_restarted_empty_under_load_costs_no_error_and_the_hit_ratio_is_back_within_a_second(
) {
    let mut cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(POSTS, cluster.url()).await;
    let apps = join_all((0..3).map(|_| env.spawn(FLAGS))).await;
    let victim = cluster.master_of(&env.keys.value(1));
    let load = steady_load(&apps);
    tokio::time::sleep(Duration::from_secs(4)).await;

    let fault = Instant::now();
    cluster.kill(victim);
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.restart(victim).await;
    cluster.wait_until_ok().await;
    let back = Instant::now();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let record = load.stop().await;

    assert_recovered(&record, fault, back);
}
