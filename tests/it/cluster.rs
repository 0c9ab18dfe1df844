//! Redis Cluster: a local 3-master cluster started by the test support, keys
//! of one post on one slot, sharded pub/sub, and the single-flight scenarios.

use std::time::Duration;

use futures::future::join_all;
use postcache::{
    cli::inspect::{self, EntryStatus},
    testkit::{fire, wait_until, RedisCluster, TableLock, TestApp, TestEnv, PATIENT},
};

use crate::scenarios;

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
        env.keys.fail_safe(5),
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
    let replies: Vec<_> = join_all(requests)
        .await
        .into_iter()
        .map(|r| r.unwrap().0)
        .collect();
    let after = inspect::run(&env.inspect_args(&["5"])).await.unwrap();

    assert!(
        classic.iter().all(|r| r.lines().nth(1) == Some("0")),
        "classic subscribers: {classic:?}"
    );
    assert!(replies.iter().all(|r| r.status == 200));
    let misses = replies
        .iter()
        .filter(|r| r.x_cache.as_deref() == Some("miss"))
        .count();
    assert_eq!(misses, 1);
    // `inspect` on a cluster: the shard subscriber and the lock, then the entry.
    assert!(inspected.lock.held);
    assert_eq!(inspected.ready_channel.subscribers, 1);
    assert_eq!(after.status, EntryStatus::Found);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_failover_is_survived_failing_open_meanwhile() {
    let mut cluster = RedisCluster::start(3, 1).await;
    let env = TestEnv::with_redis(30, cluster.url()).await;
    let app = env.spawn(&["--redis-timeout", "200ms"]).await;
    let victim = cluster.master_of(&env.keys.value(1));
    assert_eq!(app.get("/posts/1").await.x_cache.as_deref(), Some("miss"));

    cluster.kill(victim);
    // Until a replica is promoted, requests on the dead master's slots fail
    // open; the rest of the keyspace keeps caching.
    let during: Vec<_> = join_all((1..=30).map(|id| {
        let app = &app;
        async move { app.get(&format!("/posts/{id}")).await }
    }))
    .await;
    assert!(
        during.iter().all(|r| r.status == 200),
        "{:?}",
        during.iter().map(|r| r.status).collect::<Vec<_>>()
    );

    // After the failover, caching resumes on those slots without a restart.
    wait_until(
        "caching to resume after the failover",
        Duration::from_secs(30),
        async || {
            // The test's own client may wait for the new topology: bound it.
            let del = fred::prelude::KeysInterface::del::<(), _>(&env.redis, env.keys.value(1));
            let _ = tokio::time::timeout(Duration::from_secs(1), del).await;
            let x = app.get("/posts/1").await.x_cache;
            let again = app.get("/posts/1").await.x_cache;
            let resumed = x.as_deref() == Some("miss") && again.as_deref() == Some("hit");
            if !resumed {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            resumed
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

/// A cluster, an instance that has cached post 1, post 1's value key, and
/// a master other than the one that serves it.
async fn post_one_cached_on_a_cluster() -> (RedisCluster, TestEnv, TestApp, String, u16) {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(10, cluster.url()).await;
    let app = env.spawn(&["--redis-timeout", "200ms"]).await;
    let key = env.keys.value(1);
    assert_eq!(app.get("/posts/1").await.x_cache.as_deref(), Some("miss"));
    let from = cluster.master_of(&key);
    let to = *cluster.ports.iter().find(|&&p| p != from).unwrap();
    (cluster, env, app, key, to)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_slot_moves_to_another_master_its_keys_are_cached_again() {
    let (cluster, _env, app, key, to) = post_one_cached_on_a_cluster().await;

    cluster.move_slot(&key, to);

    // The node that lost the slot answers MOVED: the service re-reads the
    // topology and sends the slot's commands to its new master.
    assert_eq!(cluster.master_of(&key), to);
    wait_until(
        "the moved slot to be cached again",
        Duration::from_secs(10),
        async || {
            let first = app.get("/posts/1").await.x_cache;
            let again = app.get("/posts/1").await.x_cache;
            first.as_deref() != Some("bypass") && again.as_deref() == Some("hit")
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn while_a_slot_is_being_moved_its_node_is_not_held_for_down() {
    let (cluster, _env, app, key, to) = post_one_cached_on_a_cluster().await;

    // Mid-migration, the old master answers ASK for the moved value: those
    // reads fail open, but an ASK proves the node up, so its breaker stays
    // closed however many there are.
    cluster.begin_slot_move(&key, to);
    for _ in 0..6 {
        assert_eq!(app.get("/posts/1").await.status, 200);
    }
    let ready = app.get("/readyz").await.json();

    assert_eq!(ready["redis"], "up", "{ready}");
}
