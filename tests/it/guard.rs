//! The existence guard: ids that cannot exist are answered 404 without a
//! load (after one look in Redis, which may hold an entry the guard has
//! not heard of); an insert is served once the change feed has
//! applied it; with the feed off the guard stands aside.

use postcache::testkit::{wait_until, RedisServer, TestApp, TestEnv, A_WHILE};

use crate::support::until_feed;

/// The existence guard on (the tests' instances have it off).
const GUARDED: &[&str] = &["--existence-guard", "on"];

async fn metric(app: &TestApp, series: &str) -> f64 {
    app.http.metric(series).await
}

async fn until_built(app: &TestApp, ids: f64) {
    wait_until("the existence guard to be built", A_WHILE, async || {
        metric(app, "postcache_guard_ids").await == ids
            && app.get("/posts/100000").await.tier() == Some("guard")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ids_that_cannot_exist_never_reach_postgres() {
    let env = TestEnv::new(100).await;
    let app = env.spawn(GUARDED).await;
    until_built(&app, 100.0).await;
    assert!(metric(&app, "postcache_guard_bytes").await > 0.0);

    let statements = metric(&app, "postcache_db_statements_total").await;
    let calls = metric(&app, "postcache_redis_calls_total").await;
    for id in 1_000..1_200 {
        let reply = app.get(&format!("/posts/{id}")).await;
        assert_eq!(reply.status, 404, "post {id}");
        assert_eq!(reply.tier(), Some("guard"));
        assert_eq!(
            reply.cache_status(),
            Some("postcache; hit; detail=existence-guard")
        );
        assert!(!reply.error().is_empty());
    }
    // One look in Redis each (a plain GET: a first look that claimed would
    // leave a claim to let go of), and nothing left claimed.
    let looks = metric(&app, "postcache_redis_calls_total").await - calls;
    assert!((200.0..250.0).contains(&looks), "{looks} Redis round trips");
    assert!(!env.lock_held(1_000).await, "post 1000 claimed");
    let list = (2_001..2_100)
        .map(|id| id.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let batch = app.get(&format!("/posts?ids=1,{list}")).await;
    assert_eq!(batch.json()["not_found"].as_array().unwrap().len(), 99);
    assert_eq!(batch.json()["posts"][0]["id"], 1);
    // Post 1 was loaded; none of the 299 missing ids was.
    let sent = metric(&app, "postcache_db_statements_total").await - statements;
    assert!(sent <= 1.0, "{sent} statements");
    // Existing posts are served as ever.
    assert_eq!(app.get("/posts/42").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_insert_is_served_once_the_feed_applies_it_and_a_delete_is_missing_by_its_load() {
    let env = TestEnv::new(10).await;
    let app = env.spawn(GUARDED).await;
    until_built(&app, 10.0).await;
    assert_eq!(app.get("/posts/500").await.status, 404);

    sqlx::query(
        "insert into posts (id, title, body, author, created_at, updated_at)
         values (500, 'new', 'b', 'a', now(), now())",
    )
    .execute(&env.admin)
    .await
    .unwrap();
    wait_until("the insert to be served", A_WHILE, async || {
        app.get("/posts/500").await.status == 200
    })
    .await;
    assert_eq!(app.get("/posts/500").await.json()["title"], "new");

    sqlx::query("delete from posts where id = 7")
        .execute(&env.admin)
        .await
        .unwrap();
    wait_until("the delete to be seen", A_WHILE, async || {
        app.get("/posts/7").await.status == 404
    })
    .await;
    // Missing by the load and the absence Redis keeps, not by the guard:
    // the news of a deletion may come after the post was inserted again.
    assert!(!app.state.read_path.existence().says_missing(7));
    assert!(!app.state.read_path.existence().says_missing(500));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_feed_off_the_guard_stands_aside() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&["--existence-guard", "on", "--change-feed", "off"])
        .await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let statements = metric(&app, "postcache_db_statements_total").await;
    let reply = app.get("/posts/999").await;
    assert_eq!(reply.status, 404);
    assert_ne!(reply.tier(), Some("guard"));
    assert_eq!(
        metric(&app, "postcache_db_statements_total").await - statements,
        1.0
    );
}

/// A change to every post (a TRUNCATE) makes the guard stand aside, then
/// it is built again with what the table now holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_truncate_the_guard_is_built_again() {
    let env = TestEnv::new(10).await;
    let app = env.spawn(GUARDED).await;
    until_built(&app, 10.0).await;
    sqlx::query("truncate posts")
        .execute(&env.admin)
        .await
        .unwrap();
    wait_until("post 3 to be gone", A_WHILE, async || {
        app.get("/posts/3").await.status == 404
    })
    .await;
    until_built(&app, 0.0).await;
    // (Post 3's not-found answer is in the memory tier now.)
    let reply = app.get("/posts/4").await;
    assert_eq!((reply.status, reply.tier()), (404, Some("guard")));
}

/// While the change feed is down the guard stands aside (a post inserted
/// then is not said missing), and once the feed is back the guard is built
/// again, with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn while_the_feed_is_down_the_guard_stands_aside_and_is_built_again_after() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(3, redis.url()).await;
    let app = env
        .spawn(&[
            "--existence-guard",
            "on",
            "--redis-timeout",
            "100ms",
            "--change-feed",
            "trigger",
        ])
        .await;
    until_built(&app, 3.0).await;
    let guard = || app.state.read_path.existence();
    assert!(guard().says_missing(50));

    redis.cli(&["client", "pause", "1500", "all"]);
    // The insert's notification makes the feed meet the paused Redis.
    sqlx::query(
        "insert into posts (id, title, body, author, created_at, updated_at)
         values (50, 'during', 'b', 'a', now(), now())",
    )
    .execute(&env.admin)
    .await
    .unwrap();
    until_feed(&app.http, "down").await;
    wait_until("the guard to stand aside", A_WHILE, async || {
        guard().wants_build()
    })
    .await;
    assert!(!guard().says_missing(50), "aside while the feed is down");

    until_feed(&app.http, "up").await;
    wait_until("the guard to be built again", A_WHILE, async || {
        guard().says_missing(999)
    })
    .await;
    assert!(!guard().says_missing(50));
    assert_eq!(app.get("/posts/50").await.json()["title"], "during");
}
