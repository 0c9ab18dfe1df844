//! Redis up but not serving, caused for real on private servers: each
//! error reply that means "not now" (`LOADING`, `READONLY`, `MASTERDOWN`,
//! `CLUSTERDOWN`; `BUSY` is in `guarantees.rs`) is a failure of the node,
//! not a sign that it is up: requests fail open, and the breaker counts it.

use postcache::testkit::{wait_until, RedisCluster, RedisServer, TestApp, TestEnv, A_WHILE};

const BREAKER: &str = "postcache_redis_breaker_state";
const OUTAGES: &str = r#"postcache_redis_errors_total{kind="connection"}"#;
const REPLIES: &str = r#"postcache_redis_errors_total{kind="reply"}"#;

/// Reads posts `ids`: every one answered 200 from PostgreSQL (`bypass`).
async fn all_bypass(app: &TestApp, ids: std::ops::RangeInclusive<i64>) {
    for id in ids {
        let reply = app.get(&format!("/posts/{id}")).await;
        assert_eq!(
            (reply.status, reply.x_cache.as_deref()),
            (200, Some("bypass")),
            "post {id}: {}",
            reply.text()
        );
    }
}

/// A replica of `master`, started with `flags` besides, once it has synced
/// (its link to the master up).
async fn synced_replica(master: &RedisServer, flags: &[&str]) -> RedisServer {
    let port = master.port.to_string();
    let replicaof = ["--replicaof", "127.0.0.1", &port];
    let replica = RedisServer::start_with(&[&replicaof[..], flags].concat()).await;
    wait_until("the replica to sync", A_WHILE, async || {
        replica
            .cli(&["info", "replication"])
            .contains("master_link_status:up")
    })
    .await;
    replica
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_loading_its_data_opens_the_breaker() {
    // A master with a dataset that takes seconds to load on its replica:
    // 2,000 keys, 2 ms each.
    let master = RedisServer::start_with(&["--enable-debug-command", "yes"]).await;
    master.cli(&["debug", "populate", "2000"]);
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(20, redis.url()).await;
    let app = env.spawn(&["--redis-timeout", "250ms"]).await;
    assert_eq!(app.get("/posts/1").await.x_cache.as_deref(), Some("miss"));

    // Made a (writable) replica, it loads the master's data while the
    // instance's connections stay open: every command gets LOADING.
    for setting in [
        ["replica-read-only", "no"],
        ["key-load-delay", "2000"],
        ["loading-process-events-interval-bytes", "1024"],
    ] {
        assert_eq!(redis.cli(&["config", "set", setting[0], setting[1]]), "OK");
    }
    redis.cli(&["replicaof", "127.0.0.1", &master.port.to_string()]);
    wait_until("the replica to load", A_WHILE, async || {
        redis.cli(&["get", "x"]).starts_with("LOADING")
    })
    .await;
    let outages = app.http.metric(OUTAGES).await;
    all_bypass(&app, 2..=6).await;
    let loading = redis.cli(&["get", "x"]);
    let (breaker, outages) = (
        app.http.metric(BREAKER).await,
        app.http.metric(OUTAGES).await - outages,
    );

    assert!(loading.starts_with("LOADING"), "still loading: {loading}");
    assert!(outages >= 3.0, "{outages} failures counted as outages");
    assert_eq!(breaker, 1.0, "open");
    wait_until("caching to resume once loaded", A_WHILE, async || {
        app.get("/posts/7").await.x_cache.as_deref() == Some("hit")
    })
    .await;
}

/// A read-only replica refuses every request's first look (a `SET NX GET`,
/// which claims a post nobody has stored): each read fails open, and the
/// breaker opens, as for any node that refuses every command. (A replica
/// that nothing invalidates serves nothing, stale or not.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_replica_refuses_the_first_look_and_opens_the_breaker() {
    let master = RedisServer::start().await;
    let replica = synced_replica(&master, &[]).await;
    let env = TestEnv::with_redis(10, replica.url()).await;
    let app = env.spawn(&["--redis-timeout", "250ms"]).await;
    let (outages, replies) = (
        app.http.metric(OUTAGES).await,
        app.http.metric(REPLIES).await,
    );

    all_bypass(&app, 1..=5).await;
    let (breaker, outages, replies) = (
        app.http.metric(BREAKER).await,
        app.http.metric(OUTAGES).await - outages,
        app.http.metric(REPLIES).await - replies,
    );

    assert!(outages >= 2.0, "{outages} refusals counted as outages");
    assert_eq!(breaker, 1.0, "open");
    assert_eq!(replies, 0.0, "none is taken for an ordinary error reply");
    let errors = replica.cli(&["info", "errorstats"]);
    assert!(errors.contains("errorstat_READONLY"), "{errors}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_that_loses_its_master_opens_the_breaker() {
    let mut master = RedisServer::start().await;
    let replica = synced_replica(&master, &["--replica-serve-stale-data", "no"]).await;
    // Connected while it serves (PING, which clients send as they connect,
    // is refused too once its master is gone).
    let env = TestEnv::with_redis(10, replica.url()).await;
    let app = env.spawn(&["--redis-timeout", "250ms"]).await;

    master.kill();
    wait_until("the replica to refuse", A_WHILE, async || {
        replica.cli(&["get", "x"]).starts_with("MASTERDOWN")
    })
    .await;
    let outages = app.http.metric(OUTAGES).await;
    all_bypass(&app, 1..=5).await;
    let outages = app.http.metric(OUTAGES).await - outages;

    assert!(outages >= 3.0, "{outages} failures counted as outages");
    assert_eq!(app.http.metric(BREAKER).await, 1.0, "open");
    let errors = replica.cli(&["info", "errorstats"]);
    assert!(errors.contains("errorstat_MASTERDOWN"), "{errors}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_that_is_down_opens_the_breakers() {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(10, cluster.url()).await;
    let app = env
        .spawn(&["--redis-timeout", "250ms", "--l1-max-bytes", "0"])
        .await;
    assert_eq!(app.get("/posts/1").await.x_cache.as_deref(), Some("miss"));
    // A slot nobody serves, with full coverage required: every node
    // answers CLUSTERDOWN to every command.
    let slot = cluster.cli(
        cluster.ports[0],
        &["cluster", "keyslot", &env.keys.value(1)],
    );
    for &port in &cluster.ports {
        cluster.cli(
            port,
            &["config", "set", "cluster-require-full-coverage", "yes"],
        );
    }
    // The owner lets go first: a node that dropped the slot while the
    // owner still claimed it would take the owner's claim back from its
    // next ping, and stay up.
    let owner = cluster.master_of(&env.keys.value(1));
    let others = cluster.ports.iter().filter(|&&port| port != owner);
    for &port in std::iter::once(&owner).chain(others) {
        cluster.cli(port, &["cluster", "delslots", &slot]);
    }
    // Each node marks the cluster down on its own beat: wait for all.
    wait_until(
        "the cluster to be down on every node",
        A_WHILE,
        async || {
            cluster
                .ports
                .iter()
                .all(|&port| cluster.cli(port, &["get", "x"]).starts_with("CLUSTERDOWN"))
        },
    )
    .await;
    let outages = app.http.metric(OUTAGES).await;

    all_bypass(&app, 2..=10).await;
    // The client library reconnects after each CLUSTERDOWN reply: a
    // reconnect must not close the breaker while the cluster is down.
    let redis = app.state.read_path.redis();
    let key = env.keys.value(5);
    let mut states = Vec::new();
    for _ in 0..40 {
        states.push(redis.breaker_state_of(&key));
        app.get("/posts/5").await;
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }

    let outages = app.http.metric(OUTAGES).await - outages;
    assert!(outages >= 3.0, "{outages} failures counted as outages");
    assert_eq!(states[0], 1, "open");
    assert!(!states.contains(&0), "never closed while down: {states:?}");
}
