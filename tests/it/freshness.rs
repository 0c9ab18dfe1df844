//! Freshness: stale-while-revalidate, early refresh, fail-safe, failure
//! backoff and HTTP caching, against the real servers.

use std::time::{Duration, Instant};

use futures::future::join_all;
use postcache::{
    cache::now_millis,
    cli::invalidate,
    testkit::{wait_until, Reply, TableLock, TestApp, TestEnv, A_WHILE},
};
use reqwest::Method;
use tokio::task::JoinHandle;

use crate::support::fresh_for;

/// Fires `n` requests for `path` over `apps` and returns the replies.
async fn burst(apps: &[TestApp], path: &str, n: usize) -> Vec<Reply> {
    join_all((0..n).map(|i| apps[i % apps.len()].get(path))).await
}

/// Sends `GET path` with `If-None-Match: tag`, as a task of its own.
fn revalidate(app: &TestApp, path: &str, tag: &str) -> JoinHandle<Reply> {
    let (http, path, tag) = (app.http.clone(), path.to_owned(), tag.to_owned());
    tokio::spawn(async move {
        let headers = [("if-none-match", tag.as_str())];
        http.send(Method::GET, &path, &headers).await.unwrap()
    })
}

/// Two instances with `flags`, and the first one's reply to post `id`,
/// a miss: the post is loaded and stored for both.
async fn two_after_a_miss(env: &TestEnv, flags: &[&str], id: i64) -> (Vec<TestApp>, Reply) {
    let apps = join_all((0..2).map(|_| env.spawn(flags))).await;
    let first = apps[0].get(&format!("/posts/{id}")).await;
    assert_eq!(first.x_cache.as_deref(), Some("miss"));
    (apps, first)
}

#[track_caller]
fn tags(replies: &[Reply]) -> Vec<&str> {
    replies
        .iter()
        .map(|r| r.x_cache.as_deref().unwrap_or("-"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_entry_is_served_at_once_while_one_refresh_runs_for_the_fleet() {
    let env = TestEnv::new(10).await;
    let before = env.post_reads().await;
    let flags = fresh_for(
        "1s",
        &[
            "--stale-while-revalidate",
            "60s",
            "--redis-timeout",
            "2s",
            "--lock-ttl",
            "20s",
            "--db-statement-timeout",
            "15s",
        ],
    );
    let (apps, _) = two_after_a_miss(&env, &flags, 3).await;
    tokio::time::sleep(Duration::from_millis(1_100)).await;

    // The refresh will be held back by the table lock: every answer must
    // come back while it is held.
    let lock = TableLock::take(&env).await;
    let replies = tokio::time::timeout(Duration::from_secs(10), burst(&apps, "/posts/3", 200))
        .await
        .expect("stale answers did not wait for the load");
    let held_stale = env
        .stored(3)
        .await
        .expect("entry kept through the grace window");
    lock.release().await;

    assert!(replies.iter().all(|r| r.status == 200));
    assert!(
        tags(&replies).iter().all(|t| *t == "stale"),
        "{:?}",
        tags(&replies)
    );
    assert!(replies.iter().all(|r| r.headers.get("warning").is_some()));
    assert!(!held_stale.is_fresh(now_millis()));
    wait_until(
        "the entry to be refreshed",
        Duration::from_secs(5),
        async || env.stored(3).await.unwrap().is_fresh(now_millis()),
    )
    .await;
    assert_eq!(
        apps[1].get("/posts/3").await.x_cache.as_deref(),
        Some("hit")
    );
    for app in apps {
        app.stop().await;
    }
    assert_eq!(
        env.post_reads().await - before,
        2,
        "the warm-up load and one refresh"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_grace_window_a_stale_entry_is_a_miss() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&fresh_for("300ms", &["--stale-while-revalidate", "300ms"]))
        .await;
    assert_eq!(app.get("/posts/2").await.x_cache.as_deref(), Some("miss"));
    // Kept past TTL + grace, as the fail-safe copy (MAX_STALE): what ends
    // the grace window is the entry's freshness, not the key's life.
    env.stored(2).await.expect("stored");
    let pttl = env.pttl(&env.keys.value(2)).await;
    assert!(pttl > 600, "kept as the fail-safe copy, PTTL {pttl}");

    tokio::time::sleep(Duration::from_millis(700)).await;

    assert!(env.stored(2).await.is_some(), "the copy is still there");
    assert_eq!(app.get("/posts/2").await.x_cache.as_deref(), Some("miss"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_steady_traffic_early_refresh_keeps_a_hot_key_from_ever_missing() {
    let env = TestEnv::new(10).await;
    // Every load takes 20 ms (a slow query), so that the load time Δ of the
    // stored entries is steady, and β = 2.5 makes Δ·β ≈ 50 ms. At the ~250
    // requests/s below, the refresh then fires about 100–150 ms before
    // expiry (each hit fires with probability exp(−remaining / (Δ·β))).
    env.slow_loads(Duration::from_millis(20)).await;
    let before = env.post_reads().await;
    let flags = fresh_for(
        "1s",
        &["--early-refresh-beta", "2.5", "--redis-timeout", "2s"],
    );
    let (apps, _) = two_after_a_miss(&env, &flags, 4).await;

    let run = Duration::from_secs(4);
    let started = Instant::now();
    let mut replies = Vec::new();
    while started.elapsed() < run {
        replies.extend(burst(&apps, "/posts/4", 4).await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for app in apps {
        app.stop().await;
    }

    assert!(replies.iter().all(|r| r.status == 200));
    let not_hits: Vec<_> = tags(&replies).into_iter().filter(|t| *t != "hit").collect();
    assert!(
        not_hits.is_empty(),
        "{} requests waited: {not_hits:?}",
        not_hits.len()
    );
    let loads = env.post_reads().await - before;
    // The warm-up load, then refreshes: at least one per 1 s period (no
    // request missed), and about one per period for the whole fleet, never
    // one per instance or per request (periods last 1 s minus the early part).
    assert!((5..=9).contains(&loads), "{loads} loads in {run:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_loads_fail_the_fail_safe_copy_is_served_and_the_database_is_tried_once_per_failure_ttl(
) {
    let env = TestEnv::new(10).await;
    let flags = fresh_for(
        "300ms",
        &[
            "--failure-ttl",
            "500ms",
            "--max-stale",
            "1h",
            "--redis-timeout",
            "2s",
        ],
    );
    let (apps, fresh) = two_after_a_miss(&env, &flags, 5).await;
    tokio::time::sleep(Duration::from_millis(350)).await;
    let copy = env.stored(5).await.expect("kept as the fail-safe copy");
    assert!(copy.fresh_until() < now_millis(), "past its freshness");
    env.break_posts(true).await;
    for app in &apps {
        app.stop_pool_connections().await;
    }
    let rollbacks_before = env.rollbacks().await;

    let run = Duration::from_millis(2_000);
    let started = Instant::now();
    let mut replies = Vec::new();
    while started.elapsed() < run {
        replies.extend(burst(&apps, "/posts/5", 10).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.break_posts(false).await;
    for app in apps.iter() {
        app.stop_pool_connections().await;
    }
    let attempts = env.rollbacks().await - rollbacks_before;

    assert!(
        replies.iter().all(|r| r.status == 200),
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert!(
        tags(&replies).iter().all(|t| *t == "stale"),
        "{:?}",
        tags(&replies)
    );
    assert!(replies.iter().all(|r| r.body == fresh.body));
    assert!(replies.iter().all(|r| r
        .headers
        .get("warning")
        .map(|w| w.to_str().unwrap().starts_with("111"))
        == Some(true)));
    // 2 s at one attempt per 500 ms (±10% jitter) for the whole fleet, and
    // one more per instance as the outage begins: an instance whose own
    // loads had just succeeded tries the database itself before it trusts
    // another's failure (read_path/context.rs, `judge`).
    assert!(
        (2..=6 + apps.len() as i64).contains(&attempts),
        "{attempts} failed loads in {run:?}"
    );

    tokio::time::sleep(Duration::from_millis(600)).await;
    let recovered = apps[1].get("/posts/5").await;
    assert_eq!(
        (recovered.status, recovered.x_cache.as_deref()),
        (200, Some("miss"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cold_key_whose_load_failed_answers_503_at_once_during_failure_ttl() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&["--failure-ttl", "3s", "--redis-timeout", "2s"])
        .await;
    env.break_posts(true).await;
    app.stop_pool_connections().await;
    let before = env.rollbacks().await;

    let first = app.get("/posts/6").await;
    let started = Instant::now();
    let rest = burst(std::slice::from_ref(&app), "/posts/6", 30).await;
    let took = started.elapsed();
    app.stop_pool_connections().await;
    let attempts = env.rollbacks().await - before;

    assert_eq!(first.status, 503);
    assert!(rest.iter().all(|r| r.status == 503));
    assert!(took < Duration::from_secs(1), "{took:?}");
    assert_eq!(attempts, 1, "only the first request tried the database");
    env.break_posts(false).await;
}

/// A read past the memory tier keeps copies of the If-None-Match values,
/// not the request (whose head shares the connection's read buffer): a
/// revalidation answered from Redis, and revalidations that waited on a held
/// load (its leader and its joiners), still get 304.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revalidations_past_the_memory_tier_get_304_from_redis_and_after_a_load() {
    let env = TestEnv::new(10).await;
    let app = env.spawn(&["--l1-max-bytes", "0"]).await;
    let etag = app.get("/posts/4").await.headers["etag"]
        .to_str()
        .unwrap()
        .to_owned();
    let from_redis = revalidate(&app, "/posts/4", &etag).await.unwrap();
    invalidate::run(&env.invalidate_args(&["4"])).await.unwrap();
    let lock = TableLock::take(&env).await;
    let waiting: Vec<_> = (0..3)
        .map(|_| revalidate(&app, "/posts/4", &etag))
        .collect();
    let changed = revalidate(&app, "/posts/4", "\"0000000000000000\"");
    env.until_held(std::slice::from_ref(&app), 4).await;
    lock.release().await;
    let waited: Vec<Reply> = join_all(waiting)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let changed = changed.await.unwrap();

    assert_eq!(from_redis.status, 304);
    assert_eq!(from_redis.tier(), Some("redis"));
    assert_eq!(
        from_redis.cache_status(),
        Some("postcache; hit; detail=redis"),
        "a 304 says how it was served as a 200 would"
    );
    assert_eq!(
        waited.iter().map(|r| r.status).collect::<Vec<_>>(),
        [304, 304, 304]
    );
    let mut roles = tags(&waited);
    roles.sort_unstable();
    assert!(
        roles == ["coalesced", "coalesced", "miss"] || roles == ["coalesced"; 3],
        "{roles:?}"
    );
    assert!(waited.iter().all(|r| r.headers["etag"] == etag.as_str()));
    assert_eq!(changed.status, 200);
}

#[tokio::test]
async fn etags_are_stable_and_a_matching_if_none_match_gets_304() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&["--cache-ttl", "60s", "--stale-while-revalidate", "30s"])
        .await;

    let first = app.get("/posts/7").await;
    let second = app.get("/posts/7").await;
    let etag = first.headers["etag"].to_str().unwrap().to_owned();
    let revalidated = revalidate(&app, "/posts/7", &etag).await.unwrap();
    let other = revalidate(&app, "/posts/7", "\"0000000000000000\"")
        .await
        .unwrap();

    assert_eq!(
        second.headers["etag"],
        etag.as_str(),
        "stable across a miss and a hit"
    );
    assert!(
        etag.starts_with('"') && etag.ends_with('"'),
        "a strong ETag: {etag}"
    );
    let cache_control = first.headers["cache-control"].to_str().unwrap();
    assert!(
        cache_control.starts_with("public, max-age="),
        "{cache_control}"
    );
    assert!(
        cache_control.ends_with("stale-while-revalidate=30"),
        "{cache_control}"
    );
    let max_age: u64 = cache_control["public, max-age=".len()..]
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((50..=66).contains(&max_age), "max-age {max_age}");
    assert!(second.headers.get("age").is_some());
    assert_eq!(revalidated.status, 304);
    assert_eq!(revalidated.headers["etag"], etag.as_str());
    assert!(revalidated.body.is_empty());
    assert_eq!(other.status, 200);

    sqlx::query("update posts set title = 'changed' where id = 7")
        .execute(&env.admin)
        .await
        .unwrap();
    // The change feed makes every instance forget the old body.
    wait_until("the change to be served", A_WHILE, async || {
        app.get("/posts/7").await.json()["title"] == "changed"
    })
    .await;
    let changed = app.get("/posts/7").await;
    assert_eq!(changed.json()["title"], "changed");
    assert_ne!(
        changed.headers["etag"],
        etag.as_str(),
        "a new body, a new ETag"
    );
}
