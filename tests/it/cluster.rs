//! Redis Cluster: a local 3-master cluster started by the test support, keys
//! of one post on one slot, sharded pub/sub, and the single-flight scenarios.

use std::time::Duration;

use futures::future::join_all;
use postcache::{
    cli::inspect::{self, EntryStatus},
    testkit::{fire, wait_until, RedisCluster, TableLock, TestApp, TestEnv, PATIENT},
};

use crate::{
    scenarios,
    support::{replies, served_as},
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_misses_over_three_instances_make_one_query_on_a_cluster() {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(10, cluster.url()).await;
    scenarios::a_thousand_misses_make_one_query(&env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_waiters_are_woken_by_sharded_pubsub_within_milliseconds() {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(10, cluster.url()).await;
    scenarios::waiters_answer_within_milliseconds_of_the_release(&env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_posts_keys_share_one_slot_and_waiters_use_shard_channels() {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(10, cluster.url()).await;
    let port = cluster.ports[0];
    let slot = |key: &str| cluster.cli(port, &["cluster", "keyslot", key]);
    let keys = [
        env.keys.value(5),
        env.keys.lock(5),
        env.keys.channel(5),
        env.keys.fence(5),
    ];
    assert!(keys.iter().all(|k| slot(k) == slot(&keys[0])), "{keys:?}");

    let apps = join_all((0..2).map(|_| env.spawn(PATIENT))).await;
    let lock = TableLock::take(&env).await;
    let requests = fire(&apps, "/posts/5", 20);
    env.until_held(&apps, 20).await;
    let owner = cluster.master_of(&env.keys.channel(5));
    let channel = env.keys.channel(5);
    // The waiting instance listens on the owning shard, with SSUBSCRIBE.
    wait_until("a shard subscriber", Duration::from_secs(5), async || {
        let sharded = cluster.cli(owner, &["pubsub", "shardnumsub", &channel]);
        sharded.lines().nth(1) == Some("1")
    })
    .await;
    let classic: Vec<String> = cluster
        .ports
        .iter()
        .map(|p| cluster.cli(*p, &["pubsub", "numsub", &channel]))
        .collect();
    let inspected = inspect::run(&env.inspect_args(&["5"])).await.unwrap();
    lock.release().await;
    let replies = replies(requests).await;
    let after = inspect::run(&env.inspect_args(&["5"])).await.unwrap();

    assert!(
        classic.iter().all(|r| r.lines().nth(1) == Some("0")),
        "classic subscribers: {classic:?}"
    );
    assert!(replies.iter().all(|r| r.status == 200));
    assert_eq!(served_as(&replies, "miss"), 1);
    // `inspect` on a cluster: the shard subscriber and the lock, then the entry.
    assert!(inspected.lock.held);
    assert_eq!(inspected.ready_channel.subscribers, 1);
    assert_eq!(after.status, EntryStatus::Found);
}

/// Without the memory tier: what is tested is which Redis node answers.
const REDIS_ONLY: &[&str] = &["--redis-timeout", "200ms", "--l1-max-bytes", "0"];

/// How each of `ids` is served now: (X-Cache, X-Cache-Tier) of one GET.
async fn served(
    app: &TestApp,
    ids: impl Iterator<Item = i64>,
) -> Vec<(i64, Option<String>, Option<String>)> {
    let mut served = Vec::new();
    for id in ids {
        let reply = app.get(&format!("/posts/{id}")).await;
        assert_eq!(reply.status, 200, "post {id}: {}", reply.text());
        served.push((id, reply.x_cache.clone(), reply.tier().map(str::to_owned)));
    }
    served
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_failover_bypasses_its_keys_only_and_caching_resumes_on_its_slots() {
    let mut cluster = RedisCluster::start(3, 1).await;
    let env = TestEnv::with_redis(30, cluster.url()).await;
    let app = env.spawn(REDIS_ONLY).await;
    let victim = cluster.master_of(&env.keys.value(1));
    let on_victim = |id: i64| cluster.master_of(&env.keys.value(id)) == victim;
    let (theirs, others): (Vec<i64>, Vec<i64>) = (1..=30).partition(|&id| on_victim(id));
    served(&app, 1..=30).await;

    // The replica is held back until the outage has been looked at: a
    // promotion within those reads would make them misses on the new master.
    let replica = cluster.replicas_of(victim)[0];
    cluster.allow_failover(replica, false);
    cluster.kill(victim);
    // Until a replica is promoted, the dead master's posts fail open; the
    // other shards' posts are still hits in Redis.
    let during_theirs = served(&app, theirs.iter().copied()).await;
    let during_others = served(&app, others.iter().copied()).await;

    assert!(!others.is_empty());
    for (id, x_cache, _) in &during_theirs {
        assert_eq!(
            x_cache.as_deref(),
            Some("bypass"),
            "post {id} of the dead master"
        );
    }
    for (id, x_cache, tier) in &during_others {
        assert_eq!(
            (x_cache.as_deref(), tier.as_deref()),
            (Some("hit"), Some("redis")),
            "post {id} of a live master"
        );
    }
    // After the failover, caching resumes on its slots without a restart:
    // a post of the dead master is stored on its replica, then a hit there.
    cluster.allow_failover(replica, true);
    wait_until(
        "caching to resume after the failover",
        Duration::from_secs(30),
        async || {
            let reply = app.get("/posts/1").await;
            reply.x_cache.as_deref() == Some("hit") && reply.tier() == Some("redis")
        },
    )
    .await;
    cluster.restart(victim).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_waiters_whose_pubsub_connection_is_killed_subscribe_again() {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(10, cluster.url()).await;
    let owner = cluster.master_of(&env.keys.channel(6));
    scenarios::waiters_survive_a_killed_pubsub_connection(&env, || {
        cluster.cli(owner, &["client", "kill", "type", "pubsub"]);
    })
    .await;
}

/// A cluster, an instance that has cached post 1 in Redis (its memory
/// tier off), post 1's value key, its master and another master.
async fn post_one_cached_on_a_cluster() -> (RedisCluster, TestEnv, TestApp, String, u16, u16) {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(10, cluster.url()).await;
    let app = env.spawn(REDIS_ONLY).await;
    let key = env.keys.value(1);
    assert_eq!(app.get("/posts/1").await.x_cache.as_deref(), Some("miss"));
    let hit = app.get("/posts/1").await;
    assert_eq!(
        (hit.x_cache.as_deref(), hit.tier()),
        (Some("hit"), Some("redis"))
    );
    let from = cluster.master_of(&key);
    let to = *cluster.ports.iter().find(|&&p| p != from).unwrap();
    (cluster, env, app, key, from, to)
}

/// How many error replies starting with `kind` (MOVED, ASK) the node on
/// `port` has sent.
fn replied(cluster: &RedisCluster, port: u16, kind: &str) -> u64 {
    let stats = cluster.cli(port, &["info", "errorstats"]);
    let prefix = format!("errorstat_{kind}:count=");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_slot_moves_to_another_master_its_keys_are_read_there() {
    let (cluster, _env, app, key, from, to) = post_one_cached_on_a_cluster().await;

    cluster.move_slot(&key, to);

    // The node that lost the slot answers MOVED: the command follows it
    // through the cluster client (the value moved with the slot: a hit in
    // Redis at once), and the service re-reads the topology, after which
    // the slot's commands go to its new master without a MOVED.
    assert_eq!(cluster.master_of(&key), to);
    let first = app.get("/posts/1").await;
    assert!(
        replied(&cluster, from, "MOVED") > 0,
        "the old master was asked first"
    );
    wait_until(
        "the slot's commands to go to its new master",
        Duration::from_secs(10),
        async || {
            let moved = replied(&cluster, from, "MOVED");
            app.get("/posts/1").await;
            replied(&cluster, from, "MOVED") == moved
        },
    )
    .await;
    let again = app.get("/posts/1").await;

    assert_eq!(
        (first.x_cache.as_deref(), first.tier()),
        (Some("hit"), Some("redis"))
    );
    assert_eq!(
        (again.x_cache.as_deref(), again.tier()),
        (Some("hit"), Some("redis"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn while_a_slot_is_being_moved_its_node_is_not_held_for_down() {
    let (cluster, _env, app, key, from, to) = post_one_cached_on_a_cluster().await;

    // Mid-migration, the old master answers ASK for the moved value: those
    // reads fail open, but an ASK proves the node up, so its breaker stays
    // closed however many there are.
    cluster.begin_slot_move(&key, to);
    let asked = replied(&cluster, from, "ASK");
    let mut reads = Vec::new();
    for _ in 0..6 {
        reads.push(app.get("/posts/1").await);
    }
    let asked = replied(&cluster, from, "ASK") - asked;
    let ready = app.get("/readyz").await.json();

    for reply in &reads {
        assert_eq!(
            (reply.status, reply.x_cache.as_deref()),
            (200, Some("bypass"))
        );
    }
    assert!(asked >= 6, "each read met an ASK: {asked}");
    assert_eq!(ready["redis"], "up", "{ready}");
}
