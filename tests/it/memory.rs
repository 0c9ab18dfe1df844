//! The memory tier: hits without a Redis round trip, and no less coherent
//! for it. A stampede warms every instance with one load; a change evicts
//! the tier on every instance (the change-feed tests warm it too); an entry
//! is never served past its freshness nor L1_TTL; the byte budget holds;
//! early refresh still runs; with Redis gone, what it holds is still served.

use std::time::{Duration, Instant};

use futures::future::join_all;
use postcache::testkit::{fire, wait_until, RedisServer, TableLock, TestEnv, A_WHILE, PATIENT};

use crate::support::{fresh_for, replies, served_as};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stampede_warms_every_instance_with_one_load() {
    let env = TestEnv::new(10).await;
    let before = env.post_reads().await;
    let apps = join_all((0..3).map(|_| env.spawn(PATIENT))).await;
    let lock = TableLock::take(&env).await;
    let requests = fire(&apps, "/posts/7", 300);
    env.until_held(&apps, 300).await;
    lock.release().await;
    let replies = replies(requests).await;
    let after: Vec<_> = join_all(apps.iter().map(|app| app.get("/posts/7"))).await;
    for app in apps {
        app.stop().await;
    }

    assert!(replies.iter().all(|r| r.status == 200));
    assert_eq!(served_as(&replies, "miss"), 1);
    // Cache-Status says the same in RFC 9211's words: `local` for the
    // requests that joined a flight of their instance, `fleet` for the
    // flights answered by another instance's load.
    let mut statuses = std::collections::BTreeMap::<_, usize>::new();
    for reply in &replies {
        let status = reply.cache_status().expect("a Cache-Status on every read");
        let expected = match reply.x_cache.as_deref() {
            Some("miss") => &["postcache; fwd=miss"][..],
            Some("coalesced") => &[
                "postcache; fwd=miss; collapsed; detail=local",
                "postcache; fwd=miss; collapsed; detail=fleet",
            ],
            other => panic!("X-Cache {other:?} in a stampede"),
        };
        assert!(
            expected.contains(&status),
            "{status} for {:?}",
            reply.x_cache
        );
        *statuses.entry(status).or_default() += 1;
    }
    assert_eq!(
        statuses.len(),
        3,
        "a miss, local and fleet joiners: {statuses:?}"
    );
    for reply in &after {
        assert_eq!(
            (reply.x_cache.as_deref(), reply.tier()),
            (Some("hit"), Some("memory")),
            "every instance kept the stampede's answer"
        );
        assert_eq!(reply.cache_status(), Some("postcache; hit; detail=memory"));
        assert_eq!(reply.body, replies[0].body);
    }
    assert_eq!(env.post_reads().await - before, 1, "one load for the fleet");
}

#[tokio::test]
async fn a_memory_hit_is_never_served_past_its_freshness() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(&fresh_for("1s", &[])).await;
    // Each entry was loaded before its miss was answered: fresh until at
    // most one CACHE_TTL after that.
    let mut fresh_until = None;
    let (mut memory_hits, mut misses) = (0, 0);
    let mut late = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(2500) {
        let sent = Instant::now();
        let reply = app.get("/posts/1").await;
        assert_eq!(reply.status, 200);
        match (reply.x_cache.as_deref(), reply.tier()) {
            (Some("miss"), _) => {
                misses += 1;
                fresh_until = Some(Instant::now() + Duration::from_secs(1));
            }
            (_, Some("memory")) => {
                memory_hits += 1;
                let until = fresh_until.expect("a miss came first");
                if sent >= until {
                    late.push(sent - until);
                }
            }
            other => panic!("{other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    assert!(memory_hits > 10, "{memory_hits} memory hits");
    assert!(misses >= 2, "it expired: {misses} misses");
    assert!(
        late.is_empty(),
        "served from memory past freshness: {late:?}"
    );
}

#[tokio::test]
async fn a_memory_hit_is_never_served_past_l1_ttl() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(&["--l1-ttl", "300ms"]).await;
    app.get("/posts/2").await;
    let first = app.get("/posts/2").await;
    // Past L1_TTL (the post stays fresh in Redis for CACHE_TTL, 60 s).
    tokio::time::sleep(Duration::from_millis(350)).await;
    let later = app.get("/posts/2").await;
    let again = app.get("/posts/2").await;

    assert_eq!(first.tier(), Some("memory"));
    assert_eq!(
        (later.x_cache.as_deref(), later.tier()),
        (Some("hit"), Some("redis")),
        "past L1_TTL, read from Redis again"
    );
    assert_eq!(again.tier(), Some("memory"), "and kept again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_byte_budget_holds_under_large_posts() {
    let env = TestEnv::new(60).await;
    sqlx::query("update posts set body = repeat('x', 40000) || id::text")
        .execute(&env.admin)
        .await
        .unwrap();
    let budget: u64 = 256 * 1024;
    let app = env.spawn(&["--l1-max-bytes", &budget.to_string()]).await;
    let app = &app;
    // The tier serves once the change feed is up.
    wait_until("the memory tier to serve", A_WHILE, async || {
        app.state.read_path.memory_usage().0
    })
    .await;
    for _ in 0..3 {
        let replies = join_all(
            (1..=60).map(|id| async move { (id, app.get(&format!("/posts/{id}")).await) }),
        )
        .await;
        for (id, reply) in replies {
            assert_eq!(reply.status, 200);
            let body = reply.json()["body"].as_str().unwrap().to_owned();
            assert_eq!(body.len(), 40000 + id.to_string().len());
            assert!(body.ends_with(&id.to_string()), "post {id}'s own body");
        }
    }
    let (_, bytes, entries) = app.state.read_path.memory_usage();
    let gauge = app.http.metric("postcache_memory_tier_bytes").await;
    // What fits is served: a post read twice in a row, alone, is kept
    // (evicting others) and then served from memory.
    app.get("/posts/7").await;
    let again = app.get("/posts/7").await;

    assert!(bytes <= budget, "{bytes} bytes kept");
    assert_eq!(gauge, bytes as f64);
    assert!(
        (1..=6).contains(&entries),
        "{entries} entries of 40 KB in 256 KiB"
    );
    assert_eq!(again.tier(), Some("memory"), "what fits is served");
}

/// XFetch with a large β fires on nearly every hit near expiry: memory
/// hits must start it as Redis hits do, or the entry would expire.
#[tokio::test]
async fn memory_hits_past_the_refresh_point_start_the_fleet_wide_refresh() {
    let env = TestEnv::new(3).await;
    let app = env
        .spawn(&fresh_for("1s", &["--early-refresh-beta", "5000"]))
        .await;
    app.get("/posts/3").await;
    let mut tiers = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(2500) {
        let reply = app.get("/posts/3").await;
        tiers.push(reply.tier().unwrap_or("none").to_owned());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Without refreshes started by memory hits (nearly every hit), the
    // entry would expire after 1 s and be missed.
    let misses = tiers.iter().filter(|t| *t == "none").count();
    assert_eq!(misses, 0, "never expired: {tiers:?}");
    let memory = tiers.iter().filter(|t| *t == "memory").count();
    assert!(memory * 2 > tiers.len(), "mostly from memory: {tiers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_gone_memory_hits_go_on_and_the_rest_fails_open() {
    let mut redis = RedisServer::start().await;
    let env = TestEnv::with_redis(10, redis.url()).await;
    let app = env.spawn(&["--redis-timeout", "100ms"]).await;
    for id in 1..=3 {
        app.get(&format!("/posts/{id}")).await;
    }

    redis.kill();
    let mut kept = Vec::new();
    for id in 1..=3 {
        kept.push(app.get(&format!("/posts/{id}")).await);
    }
    let mut others = Vec::new();
    for id in 4..=8 {
        others.push(app.get(&format!("/posts/{id}")).await);
    }
    redis.restart().await;

    for reply in &kept {
        assert_eq!((reply.status, reply.tier()), (200, Some("memory")));
    }
    for reply in &others {
        assert_eq!(
            (reply.status, reply.x_cache.as_deref()),
            (200, Some("bypass"))
        );
    }
    wait_until("caching to resume", A_WHILE, async || {
        app.get("/posts/9").await.x_cache.as_deref() != Some("bypass")
    })
    .await;
}
