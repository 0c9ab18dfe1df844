//! Redis coming back under load: a server restarted empty on the same port,
//! a cluster master restarted, a cluster master replaced by its replica.
//! Three instances under a steady Zipf load; no request may fail, and caching
//! must resume within a second or two of Redis serving again.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use futures::future::join_all;
use postcache::testkit::{
    wait_until, Http, Record, RedisCluster, RedisServer, Sample, SteadyLoad, TestApp, TestEnv, Zipf,
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

#[track_caller]
fn assert_no_failure(record: &Record) {
    let failures = record.failures();
    assert!(
        failures.is_empty(),
        "{} requests failed, the first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
}

/// Asserts no failed request, and the hit ratio in the second after
/// [`RECOVERY_BOUND`] past `back` (when Redis accepted commands again) back
/// to its level in the two seconds before `fault`.
fn assert_recovered(record: &Record, fault: Instant, back: Instant) {
    assert_no_failure(record);
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

/// The scripts: claim and finish (each also for many items), release,
/// abandon, extend, apply, raise the cutoff.
const SCRIPTS: u32 = 9;

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
        async || scripts(&redis) == Some(SCRIPTS),
    )
    .await;

    redis.restart().await;
    // Restarted, the server has none; no request is sent: the reconnect
    // alone loads them.
    wait_until(
        "the scripts to be loaded again",
        Duration::from_secs(2),
        async || scripts(&redis) == Some(SCRIPTS),
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

/// The share of `bypass` among `samples`.
fn bypassed(samples: &[&Sample]) -> f64 {
    let n = samples.iter().filter(|s| s.x_cache == "bypass").count();
    n as f64 / samples.len().max(1) as f64
}

/// A cluster of 3 masters (with `replicas` each) under the steady load of
/// three instances, warmed past one TTL.
struct Sharded {
    cluster: RedisCluster,
    env: TestEnv,
    _apps: Vec<TestApp>,
    /// The master of post 1, and the posts it holds.
    victim: u16,
    on_victim: HashSet<i64>,
    load: SteadyLoad,
}

/// Which nodes REDIS_URL names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Seeds {
    /// Every node.
    All,
    /// Only the master that will fail (as many write it: one service name).
    TheVictim,
}

impl Sharded {
    async fn under_load(replicas: usize, seeds: Seeds) -> Self {
        let cluster = RedisCluster::start(3, replicas).await;
        let env = TestEnv::with_redis(POSTS, cluster.url()).await;
        let victim = cluster.master_of(&env.keys.value(1));
        let url = match seeds {
            Seeds::All => cluster.url(),
            Seeds::TheVictim => format!("redis-cluster://127.0.0.1:{victim}"),
        };
        // Without the memory tier: what is measured is which requests reach
        // which Redis node, and the tier would answer most of them first.
        let flags = [FLAGS, &["--l1-max-bytes", "0", "--redis-url", &url]].concat();
        let apps = join_all((0..3).map(|_| env.spawn(&flags))).await;
        let on_victim = (1..=POSTS as i64)
            .filter(|&id| cluster.master_of(&env.keys.value(id)) == victim)
            .collect();
        let load = steady_load(&apps);
        tokio::time::sleep(Duration::from_secs(4)).await;
        Self {
            cluster,
            env,
            _apps: apps,
            victim,
            on_victim,
            load,
        }
    }
}

/// The samples in `[from, to)` of posts in `posts`, and of the others.
fn split<'a>(
    record: &'a Record,
    from: Instant,
    to: Instant,
    posts: &HashSet<i64>,
) -> (Vec<&'a Sample>, Vec<&'a Sample>) {
    record
        .between(from, to)
        .iter()
        .partition(|s| posts.contains(&s.id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_cluster_master_bypasses_its_own_keys_only() {
    let Sharded {
        cluster,
        env: _env,
        victim,
        on_victim,
        load,
        _apps,
    } = Sharded::under_load(0, Seeds::All).await;

    let fault = Instant::now();
    cluster.cli(victim, &["client", "pause", "2000", "all"]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let healed = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let record = load.stop().await;

    assert_no_failure(&record);
    let (there, elsewhere) = split(&record, fault, healed, &on_victim);
    let (_, after) = split(
        &record,
        healed + Duration::from_secs(1),
        healed + Duration::from_secs(2),
        &HashSet::new(),
    );
    let report = format!(
        "while one master stalled, bypassed: {:.1}% of its keys' requests, {:.1}% of the others'; \
         from 1 s after: {:.1}%",
        100.0 * bypassed(&there),
        100.0 * bypassed(&elsewhere),
        100.0 * bypassed(&after),
    );
    eprintln!("{report}");
    assert!(!on_victim.is_empty() && on_victim.len() < POSTS as usize);
    // All of them but those answered before the pause took hold.
    assert!(
        bypassed(&there) >= 0.9,
        "the stalled shard's keys fail open: {report}"
    );
    assert!(bypassed(&elsewhere) < 0.05, "{report}");
    assert!(bypassed(&after) < 0.05, "{report}");
}

/// A master killed, its replica promoted: no request fails, the other
/// shards' keys are cached throughout (each node has a client of its own:
/// the library's cluster client holds every command while one primary is
/// unreachable), and caching resumes on the failed slots within 2 s of the
/// promotion.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_a_cluster_master_fails_over_other_shards_keep_caching_and_its_slots_resume_within_two_seconds(
) {
    fails_over(Seeds::All).await;
}

/// The same when the master that dies is the only node REDIS_URL names, and
/// it never comes back: the topology is refreshed from the nodes the
/// cluster knows, not only from REDIS_URL's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_the_seed_master_fails_over_and_never_returns_its_slots_resume_within_two_seconds() {
    fails_over(Seeds::TheVictim).await;
}

async fn fails_over(seeds: Seeds) {
    let Sharded {
        mut cluster,
        env,
        victim,
        on_victim,
        load,
        _apps: apps,
    } = Sharded::under_load(1, seeds).await;
    // Readiness through the failover, every 100 ms, on one instance.
    let (stop_readiness, mut stopped) = tokio::sync::watch::channel(false);
    let readiness = {
        let http = apps[0].http.clone();
        tokio::spawn(async move {
            let mut seen = Vec::new();
            while !*stopped.borrow_and_update() {
                let reply = http.get("/readyz").await;
                seen.push((reply.status, reply.json()["redis"].to_string()));
                let _ = tokio::time::timeout(Duration::from_millis(100), stopped.changed()).await;
            }
            seen
        })
    };

    let fault = Instant::now();
    cluster.kill(victim);
    wait_until(
        "a replica to take over",
        Duration::from_secs(30),
        async || {
            cluster
                .serving(&env.keys.value(1))
                .is_some_and(|port| port != victim)
        },
    )
    .await;
    let promoted = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let record = load.stop().await;
    stop_readiness.send_replace(true);
    let ready = readiness.await.unwrap();
    let mut breakers = Vec::new();
    for app in &apps {
        breakers.push(app.http.metric("postcache_redis_breaker_state").await);
    }

    assert_no_failure(&record);
    let (there, elsewhere) = split(&record, fault, promoted, &on_victim);
    let from = promoted + Duration::from_secs(2);
    let (_, after) = split(
        &record,
        from,
        from + Duration::from_secs(2),
        &HashSet::new(),
    );
    let mut readiness: Vec<(String, usize)> = Vec::new();
    for (status, redis) in &ready {
        let seen = format!("{status} {}", redis.trim_matches('"'));
        match readiness.iter_mut().find(|(s, _)| *s == seen) {
            Some((_, n)) => *n += 1,
            None => readiness.push((seen, 1)),
        }
    }
    let report = format!(
        "failover took {:?}; while it ran, bypassed: {:.1}% of the failed shard's requests, \
         {:.1}% of the others'; from 2 s after the promotion: {:.1}%; the first 2 s: {:?}; \
         /readyz every 100 ms: {readiness:?}",
        promoted - fault,
        100.0 * bypassed(&there),
        100.0 * bypassed(&elsewhere),
        100.0 * bypassed(&after),
        record.mix(promoted, from),
    );
    eprintln!("{report}");
    assert!(!on_victim.is_empty() && on_victim.len() < POSTS as usize);
    assert!(bypassed(&elsewhere) < 0.05, "{report}");
    for instance in 0..apps.len() {
        let theirs: Vec<&Sample> = after
            .iter()
            .copied()
            .filter(|s| s.instance == instance)
            .collect();
        assert!(bypassed(&theirs) < 0.05, "instance {instance}: {report}");
    }
    assert_eq!(
        breakers,
        [0.0, 0.0, 0.0],
        "the dead master's breakers retired"
    );
    // Ready throughout (`circuit_open` while the dead master's breaker is).
    assert!(ready.len() > 20, "{ready:?}");
    assert!(ready.iter().all(|(status, _)| *status == 200), "{ready:?}");
}
