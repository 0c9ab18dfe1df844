//! Natural batching of loads: misses that queue while a load statement
//! runs share the next one (`where id = any($1)`), and each key still has
//! its own election, fence, finish and wake-up.

use futures::future::join_all;
use postcache::{
    cache::Status,
    testkit::{wait_until, HeldLoad, RedisServer, TableLock, TestApp, TestEnv, A_WHILE, PATIENT},
};

/// One statement at a time, up to 64 keys each, and patient bounds.
fn batched<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut flags = PATIENT.to_vec();
    flags.extend(["--load-statements", "1", "--load-batch-max", "64"]);
    flags.extend(extra);
    flags
}

/// Waits until each of `ids` has its lock taken (its leader elected).
async fn until_claimed(env: &TestEnv, ids: impl Iterator<Item = i64> + Clone) {
    wait_until("every key's leader to be elected", A_WHILE, async || {
        for id in ids.clone() {
            if !env.lock_held(id).await {
                return false;
            }
        }
        true
    })
    .await;
}

async fn statements(app: &TestApp) -> f64 {
    app.http.metric("postcache_db_statements_total").await
}

/// 100 cold misses on one instance while its one statement is held: the
/// 99 queued go in ⌈99/64⌉ = 2 statements, and the same 100 ids asked of
/// another instance wait for them and are woken, without a statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_misses_share_statements_and_waiters_elsewhere_are_woken() {
    let env = TestEnv::new(100).await;
    let before = env.transactions().await;
    let flags = batched(&["--change-feed", "off"]);
    let a = env.spawn(&flags).await;
    let b = env.spawn(&flags).await;
    let statements_before = statements(&a).await;

    let lock = TableLock::take(&env).await;
    let mut on_a = vec![a.http.spawn_get("/posts/1")];
    env.until_held(std::slice::from_ref(&a), 1).await;
    on_a.extend((2..=100).map(|id| a.http.spawn_get(&format!("/posts/{id}"))));
    until_claimed(&env, 1..=100).await;
    let on_b: Vec<_> = (1..=100)
        .map(|id| b.http.spawn_get(&format!("/posts/{id}")))
        .collect();
    for id in 1..=100 {
        env.until_subscribed(id).await;
    }
    assert_eq!(a.reads_in_progress() + b.reads_in_progress(), 200);
    lock.release().await;

    for (i, (requests, served)) in [(on_a, "miss"), (on_b, "coalesced")]
        .into_iter()
        .enumerate()
    {
        for (id, request) in (1..=100).zip(requests) {
            let (reply, _) = request.await.unwrap();
            assert_eq!(reply.status, 200, "instance {i}, post {id}");
            assert_eq!(reply.json()["id"], id, "instance {i}");
            assert_eq!(
                reply.x_cache.as_deref(),
                Some(served),
                "instance {i}, post {id}"
            );
        }
    }
    // Both instances count in this process's metrics; b sent none.
    let sent = statements(&a).await - statements_before;
    assert!(sent <= 3.0, "{sent} statements for 100 keys");
    a.stop().await;
    b.stop().await;
    // Counted by PostgreSQL too (its connections' setup and this test's
    // own transactions aside): far from a statement per key.
    let transactions = env.transactions().await - before;
    assert!(transactions < 20, "{transactions} transactions");
}

/// The queued keys' statement fails: each of its keys fails (503, a
/// failure marker of its own), and each recovers once the table is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_batch_fails_each_of_its_keys() {
    let env = TestEnv::new(30).await;
    let a = env.spawn(&batched(&["--failure-ttl", "300ms"])).await;
    let statements_before = statements(&a).await;

    let mut lock = TableLock::take(&env).await;
    let first = a.http.spawn_get("/posts/1");
    env.until_held(std::slice::from_ref(&a), 1).await;
    let queued: Vec<_> = (2..=30)
        .map(|id| a.http.spawn_get(&format!("/posts/{id}")))
        .collect();
    until_claimed(&env, 2..=30).await;
    // The table goes away as the held statement ends: the queued keys'
    // statement finds none.
    lock.execute("alter table posts rename to posts_away").await;
    lock.commit().await;

    let _ = first.await.unwrap();
    for (id, request) in (2..=30).zip(queued) {
        let (reply, _) = request.await.unwrap();
        assert_eq!(reply.status, 503, "post {id}: {}", reply.text());
        let marker = env.stored(id).await.expect("a failure marker");
        assert_eq!(marker.status(), Status::Failed, "post {id}");
    }
    let sent = statements(&a).await - statements_before;
    assert!(sent <= 2.0, "{sent} statements");

    env.break_posts(false).await;
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let paths: Vec<String> = (1..=30).map(|id| format!("/posts/{id}")).collect();
    let replies = join_all(paths.iter().map(|path| a.get(path))).await;
    for (id, reply) in (1..=30).zip(replies) {
        assert_eq!(reply.status, 200, "post {id} after the repair");
        assert_eq!(reply.json()["id"], id);
    }
}

/// A row changes after the batch read it and before its key's finish: that
/// key alone is fenced (nothing stored, elected again, the new row read);
/// the batch's other keys are stored as read.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_fenced_mid_batch_reads_again_and_the_others_are_stored() {
    let env = TestEnv::new(10).await;
    // Post 5's first load only.
    let load = HeldLoad::of(env.keys.value(5));
    let a = env.spawn_with_hooks(&batched(&[]), load.hooks()).await;
    let statements_before = statements(&a).await;

    let lock = TableLock::take(&env).await;
    let first = a.http.spawn_get("/posts/1");
    env.until_held(std::slice::from_ref(&a), 1).await;
    let queued: Vec<_> = (2..=10)
        .map(|id| a.http.spawn_get(&format!("/posts/{id}")))
        .collect();
    until_claimed(&env, 2..=10).await;
    lock.release().await;
    load.until_held().await;
    let evictions = a.state.read_path.evictions(&5);
    env.retitle(5, "after the change").await;
    // In Redis and in this process (which answers a row read before a
    // change applied elsewhere only: see changes.rs).
    wait_until("the change to be applied", A_WHILE, async || {
        env.pttl(&env.keys.fence(5)).await > 0 && a.state.read_path.evictions(&5) > evictions
    })
    .await;
    load.release();

    assert_eq!(first.await.unwrap().0.status, 200);
    for (id, request) in (2..=10).zip(queued) {
        let (reply, _) = request.await.unwrap();
        assert_eq!(reply.status, 200, "post {id}");
        let body = env.stored_post(id).await.expect("stored");
        if id == 5 {
            assert_eq!(reply.json()["title"], "after the change");
            assert_eq!(body["title"], "after the change");
        } else {
            assert_ne!(reply.json()["title"], "after the change");
            assert_eq!(body["title"], reply.json()["title"], "post {id}");
        }
    }
    // The held one, the batch, and post 5 read again.
    let sent = statements(&a).await - statements_before;
    assert!(sent <= 3.0, "{sent} statements");
}

/// 100 cold misses arriving together on one instance: their lookups,
/// claims and finishes go out to Redis in batches (an MGET, one script call
/// for many items), not one round trip each: at most one per miss where
/// each costs three without batching (GET, claim, finish). Every post is
/// served as itself, by its own leader. Redis is paused for a moment (a
/// private one) so that the lookups are all queued behind the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_lookups_claims_and_finishes_share_round_trips() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(100, redis.url()).await;
    let app = env
        .spawn(&batched(&["--change-feed", "off", "--redis-timeout", "2s"]))
        .await;
    let calls = async || app.http.metric("postcache_redis_calls_total").await;
    let before = calls().await;

    redis.cli(&["client", "pause", "300", "all"]);
    let requests: Vec<_> = (1..=100)
        .map(|id| app.http.spawn_get(&format!("/posts/{id}")))
        .collect();
    for (id, request) in (1..=100).zip(requests) {
        let (reply, _) = request.await.unwrap();
        assert_eq!(reply.status, 200, "post {id}");
        assert_eq!(reply.json()["id"], id);
        assert_eq!(reply.x_cache.as_deref(), Some("miss"), "post {id}");
    }

    let round_trips = calls().await - before;
    assert!(
        round_trips <= 100.0,
        "{round_trips} Redis round trips for 100 misses"
    );
    for id in 1..=100 {
        assert!(env.stored(id).await.is_some(), "post {id} stored");
        assert!(!env.lock_held(id).await, "post {id} released");
    }
}
