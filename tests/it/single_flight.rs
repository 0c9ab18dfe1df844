//! Fleet-wide single-flight: one load per key for every instance, waiters woken by pub/sub.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use fred::prelude::*;
use futures::future::join_all;
use postcache::{
    cache::{Entry, Status},
    read_path::Hooks,
    testkit::{answered, fire, wait_until, TableLock, TestEnv, PATIENT},
};

use crate::scenarios;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_concurrent_misses_over_three_instances_make_one_query() {
    let env = TestEnv::new(10).await;
    scenarios::a_thousand_misses_make_one_query(&env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_answer_within_milliseconds_of_the_release_not_a_poll_later() {
    let env = TestEnv::new(10).await;
    scenarios::waiters_answer_within_milliseconds_of_the_release(&env).await;
}

#[tokio::test]
async fn a_value_written_from_outside_without_publish_is_found_by_the_recheck() {
    let env = TestEnv::new(10).await;
    // A leader elsewhere holds its claim in the value key.
    let value_key = env.claim(4, "outsider", Duration::from_secs(20)).await;
    // The outsider's value lands over its claim after the waiter's election
    // and before its re-check, and nobody publishes: only the re-check can
    // find it.
    // Read then (not before the instance starts, whose change feed may raise
    // the cutoff as it takes a fresh slot).
    let writer = env.redis.clone();
    let hooks = Hooks {
        before_recheck: Some(Arc::new(move |key: String| {
            let entry = Entry::new(
                Status::Found,
                br#"{"id":4,"from":"outside"}"#,
                Duration::from_secs(60),
                Duration::ZERO,
            );
            let (writer, raw) = (writer.clone(), entry.raw().clone());
            Box::pin(async move {
                let _: () = writer
                    .set(key, raw, Some(Expiration::EX(60)), None, false)
                    .await
                    .unwrap();
            })
        })),
        ..Hooks::default()
    };
    let app = env.spawn_with_hooks(PATIENT, hooks).await;

    let started = Instant::now();
    let reply = app.get("/posts/4").await;

    assert_eq!(reply.status, 200);
    assert_eq!(reply.x_cache.as_deref(), Some("coalesced"));
    assert_eq!(&reply.body[..], br#"{"id":4,"from":"outside"}"#);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "waited {:?}",
        started.elapsed()
    );
    assert!(env.pttl(&value_key).await > 0);
    let stored = env.stored(4).await.expect("the outsider's entry");
    assert_eq!(&stored.body()[..], br#"{"id":4,"from":"outside"}"#);
}

#[tokio::test]
async fn a_lock_nobody_fills_is_taken_over_after_its_expiry_with_one_query() {
    let env = TestEnv::new(10).await;
    let before = env.post_reads().await;
    env.claim(5, "crashed-leader", Duration::from_millis(700))
        .await;
    // The lock's lifetime counts from here, not from the first request.
    let locked_at = Instant::now();
    let app = env.spawn(&["--wait-timeout", "5s"]).await;

    let replies = join_all((0..20).map(|_| app.get("/posts/5"))).await;
    let took = locked_at.elapsed();
    app.stop().await;

    assert!(replies.iter().all(|r| r.status == 200));
    assert!(
        took >= Duration::from_millis(690),
        "answered before the lock expired: {took:?}"
    );
    assert!(
        took < Duration::from_millis(2_500),
        "took {took:?} after a 700 ms lock"
    );
    assert_eq!(env.post_reads().await - before, 1);
}

#[tokio::test]
async fn a_lock_held_past_wait_timeout_gives_504_in_json() {
    let env = TestEnv::new(10).await;
    env.claim(6, "stuck", Duration::from_secs(10)).await;
    let app = env.spawn(&["--wait-timeout", "400ms"]).await;

    let started = Instant::now();
    let reply = app.get("/posts/6").await;

    assert_eq!(reply.status, 504);
    assert!(!reply.error().is_empty());
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(390) && took < Duration::from_secs(2),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_load_gives_503_to_every_waiter_at_once_and_recovers_after_repair() {
    let env = TestEnv::new(10).await;
    // No failure backoff here: the next request after the repair loads again
    // (the backoff has tests of its own).
    let flags = [PATIENT, &["--failure-ttl", "0s"]].concat();
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;
    let mut lock = TableLock::take(&env).await;
    let requests = fire(&apps, "/posts/8", 50);
    env.until_held(&apps, 50).await;
    // Break the table under the blocked leader, then let it go.
    lock.execute("alter table posts rename to posts_away").await;
    let released = lock.commit().await;
    let results: Vec<_> = answered(requests).await;

    assert!(
        results.iter().all(|(r, _)| r.status == 503),
        "{:?}",
        results.iter().map(|(r, _)| r.status).collect::<Vec<_>>()
    );
    let slowest = results
        .iter()
        .map(|(_, done)| *done - released)
        .max()
        .unwrap();
    assert!(
        slowest < Duration::from_secs(1),
        "waiters learnt of the failure after {slowest:?}"
    );
    assert!(
        !env.lock_held(8).await,
        "the failed leader released its lock"
    );

    env.break_posts(false).await;
    let after = apps[0].get("/posts/8").await;
    assert_eq!(after.status, 200);
}

#[tokio::test]
async fn after_a_burst_no_subscriber_and_no_lock_remain() {
    let env = TestEnv::new(20).await;
    let apps = join_all((0..2).map(|_| env.spawn(&[]))).await;

    for round in 0..3 {
        let ids: Vec<i64> = (1..=20).collect();
        let replies = join_all(ids.iter().flat_map(|id| {
            let path = format!("/posts/{id}");
            apps.iter().map(move |app| {
                let path = path.clone();
                async move { app.get(&path).await }
            })
        }))
        .await;
        assert!(replies.iter().all(|r| r.status == 200), "round {round}");
        let _: () = env
            .redis
            .del(ids.iter().map(|id| env.keys.value(*id)).collect::<Vec<_>>())
            .await
            .unwrap();
    }

    for id in 1..=20 {
        assert!(!env.lock_held(id).await, "lock of {id} left behind");
    }
    wait_until(
        "every subscription to end",
        Duration::from_secs(5),
        async || {
            let mut subscribed = 0;
            for id in 1..=20 {
                subscribed += env.numsub(&env.keys.channel(id)).await;
            }
            let local: usize = apps
                .iter()
                .map(|a| a.state.read_path.subscriber().channels())
                .sum();
            subscribed == 0 && local == 0
        },
    )
    .await;
}

/// A cold miss's leader makes two round trips to Redis: its first look,
/// which claims the post (a memcache lease's get), and its finish, after
/// it has answered. No lookup before the claim, no lock key. (The counter
/// is the test process's: a task left by an earlier test may add to one
/// miss's count, so five misses are counted and most must cost two.)
#[tokio::test]
async fn a_cold_miss_makes_two_redis_round_trips() {
    let env = TestEnv::new(10).await;
    let app = env.spawn(&["--change-feed", "off"]).await;
    let calls = async || app.http.metric("postcache_redis_calls_total").await;

    let mut counts = Vec::new();
    for id in 1..=5 {
        let before = calls().await;
        let reply = app.get(&format!("/posts/{id}")).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.x_cache.as_deref(), Some("miss"));
        // The finish has landed (it runs after the answer).
        let stored = env.stored(id).await.expect("stored");
        assert_eq!(stored.body(), reply.body);
        assert!(!env.lock_held(id).await, "the claim was replaced");
        counts.push(calls().await - before);
    }

    let two = counts.iter().filter(|&&n| n == 2.0).count();
    assert!(two >= 4, "Redis round trips per miss: {counts:?}");
}

/// A request whose first look claims a post that a flight of its process
/// already waits on (the claim it waited on gone without a word) joins
/// that flight and lets its own claim go at once, with `retry`: the flight
/// elects again now instead of sleeping out the claim it had seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_won_by_a_request_that_joins_a_waiting_flight_wakes_it() {
    let env = TestEnv::new(10).await;
    let before = env.post_reads().await;
    let value_key = env.claim(5, "vanishing", Duration::from_secs(20)).await;
    let app = env.spawn(PATIENT).await;

    let first = app.http.spawn_get("/posts/5");
    env.until_subscribed(5).await;
    // Past its re-check: asleep until the claim's 20 s run out, or a message.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _: i64 = env.redis.del(&value_key).await.unwrap();

    let started = Instant::now();
    let second = app.get("/posts/5").await;
    let (first, _) = first.await.unwrap();
    let took = started.elapsed();
    app.stop().await;

    assert_eq!((first.status, second.status), (200, 200));
    assert_eq!(first.body, second.body);
    assert!(took < Duration::from_secs(2), "took {took:?}");
    assert_eq!(env.post_reads().await - before, 1);
}
