//! `GET /posts?ids=`: many posts in one request, in the order asked, with
//! the ids not found and unavailable; the misses share load statements,
//! and another instance then hits.

use std::time::Duration;

use postcache::{
    cache::{Entry, Status},
    testkit::{RedisCluster, TestApp, TestEnv},
};
use reqwest::Method;

fn ids(reply: &postcache::testkit::Reply, field: &str) -> Vec<i64> {
    reply.json()[field]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect()
}

fn post_ids(reply: &postcache::testkit::Reply) -> Vec<i64> {
    reply.json()["posts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_i64().unwrap())
        .collect()
}

async fn statements(app: &TestApp) -> f64 {
    app.http.metric("postcache_db_statements_total").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn posts_come_in_the_order_asked_each_once_with_the_missing_ids_named() {
    let env = TestEnv::new(20).await;
    let app = env.spawn(&[]).await;

    let reply = app.get("/posts?ids=5,3,999,5,1,3").await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.content_type.as_deref(), Some("application/json"));
    assert_eq!(post_ids(&reply), vec![5, 3, 1]);
    assert_eq!(ids(&reply, "not_found"), vec![999]);
    assert!(ids(&reply, "unavailable").is_empty());
    let single = app.get("/posts/5").await.json();
    assert_eq!(
        reply.json()["posts"][0],
        single,
        "the same JSON as a single read"
    );
    // The smallest freshness of the parts: the not-found id's (NEGATIVE_TTL 10s).
    let cache_control = reply.headers["cache-control"].to_str().unwrap();
    let max_age: u64 = cache_control
        .split("max-age=")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(max_age <= 10, "{cache_control}");

    // The ETag covers every part, in order: a match is 304.
    let etag = reply.headers["etag"].to_str().unwrap().to_owned();
    let again = app
        .http
        .send(
            Method::GET,
            "/posts?ids=5,3,999,5,1,3",
            &[("if-none-match", etag.as_str())],
        )
        .await
        .unwrap();
    assert_eq!(again.status, 304);
    let other_order = app
        .http
        .send(
            Method::GET,
            "/posts?ids=1,3,5,999",
            &[("if-none-match", etag.as_str())],
        )
        .await
        .unwrap();
    assert_eq!(other_order.status, 200);
    assert_ne!(other_order.headers["etag"], etag.as_str());
    // Percent-encoded commas are commas.
    assert_eq!(post_ids(&app.get("/posts?ids=2%2C4").await), vec![2, 4]);
}

#[tokio::test]
async fn empty_bad_repeated_and_long_lists_are_400_in_json() {
    let env = TestEnv::new(1).await;
    let app = env.spawn(&[]).await;
    let hundred = vec!["1"; 100].join(",");
    assert_eq!(app.get(&format!("/posts?ids={hundred}")).await.status, 200);
    let too_many = vec!["1"; 101].join(",");
    for query in [
        "",
        "?ids=",
        "?ids=1,,2",
        "?ids=1,x",
        "?ids=0",
        "?ids=-3",
        "?ids=1&ids=2",
        "?id=1",
        "?ids=%FF",
        &format!("?ids={too_many}"),
    ] {
        let reply = app.get(&format!("/posts{query}")).await;
        assert_eq!(reply.status, 400, "{query}: {}", reply.text());
        assert!(
            reply.error().starts_with("invalid ids"),
            "{query}: {}",
            reply.error()
        );
    }
}

/// One id whose load failed (its failure marker stored): it is listed as
/// unavailable, the rest are served, and nothing of it is cacheable.
#[tokio::test]
async fn an_id_whose_load_failed_is_unavailable_and_the_rest_are_served() {
    let env = TestEnv::new(5).await;
    let app = env.spawn(&[]).await;
    let failed = Entry::new(Status::Failed, b"", Duration::from_secs(30), Duration::ZERO);
    env.set(
        &env.keys.value(2),
        failed.raw().clone(),
        Duration::from_secs(30),
    )
    .await;

    let reply = app.get("/posts?ids=1,2,3").await;
    assert_eq!(reply.status, 200);
    assert_eq!(post_ids(&reply), vec![1, 3]);
    assert_eq!(ids(&reply, "unavailable"), vec![2]);
    assert!(ids(&reply, "not_found").is_empty());
    assert_eq!(reply.headers["cache-control"], "no-store");
    assert!(reply.headers.get("etag").is_none());
}

/// 20 cold ids on one instance share load statements; asked of another
/// instance next, they are all hits: no statement there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_cold_ids_shares_statements_and_another_instance_then_hits() {
    let env = TestEnv::new(40).await;
    let a = env.spawn(&[]).await;
    let b = env.spawn(&[]).await;
    let list = (11..=30)
        .map(|id| id.to_string())
        .collect::<Vec<_>>()
        .join(",");

    let before = statements(&a).await;
    let first = a.get(&format!("/posts?ids={list}")).await;
    let on_a = statements(&a).await - before;
    let second = b.get(&format!("/posts?ids={list}")).await;
    let on_b = statements(&a).await - before - on_a;

    assert_eq!(post_ids(&first), (11..=30).collect::<Vec<_>>());
    assert_eq!(first.json(), second.json());
    assert_eq!(on_a, 1.0, "statements for 20 cold ids");
    assert_eq!(on_b, 0.0, "the other instance hits");
}

/// On a Redis Cluster a batch spans shards: one look per node, each id
/// served in its order, and hits once loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_spanning_the_shards_of_a_cluster_is_read_and_then_hit() {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(60, cluster.url()).await;
    let app = env.spawn(&[]).await;
    let list = (1..=60)
        .map(|id| id.to_string())
        .collect::<Vec<_>>()
        .join(",");

    let first = app.get(&format!("/posts?ids={list}")).await;
    let before = statements(&app).await;
    // The memory tier aside: every id from Redis, over every shard.
    let other = env.spawn(&["--l1-max-bytes", "0"]).await;
    let second = other.get(&format!("/posts?ids={list}")).await;

    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(post_ids(&first), (1..=60).collect::<Vec<_>>());
    assert_eq!(first.json(), second.json());
    assert_eq!(statements(&app).await - before, 0.0, "all hits in Redis");
}
