//! Scenarios run against a single Redis and against a Redis Cluster.

use std::time::Duration;

use futures::future::join_all;
use postcache::testkit::{answered, fire, wait_until, TableLock, TestEnv, PATIENT};

use crate::support::{replies, served_as};

/// 1,000 concurrent requests for one cold post over 3 instances: one
/// database read (counted by PostgreSQL), 1 miss and 999 coalesced, identical
/// bodies, no lock and no subscriber left behind.
pub async fn a_thousand_misses_make_one_query(env: &TestEnv) {
    let before = env.post_reads().await;
    let apps = join_all((0..3).map(|_| env.spawn(PATIENT))).await;
    let lock = TableLock::take(env).await;

    // Every request is inside the service before the leader's load may finish.
    let requests = fire(&apps, "/posts/7", 1000);
    env.until_held(&apps, 1000).await;
    lock.release().await;
    let replies = replies(requests).await;
    for app in apps {
        app.stop().await;
    }

    assert!(replies.iter().all(|r| r.status == 200));
    assert!(
        replies.iter().all(|r| r.body == replies[0].body),
        "bodies differ"
    );
    let count = |tag: &str| served_as(&replies, tag);
    let mut tags: Vec<_> = replies.iter().map(|r| r.x_cache.clone()).collect();
    tags.sort();
    tags.dedup();
    assert_eq!((count("miss"), count("coalesced")), (1, 999), "{tags:?}");
    assert_eq!(
        env.post_reads().await - before,
        1,
        "PostgreSQL saw more than one read"
    );
    assert!(!env.lock_held(7).await, "the lock was released");
    let channel = env.keys.channel(7);
    wait_until(
        "the ready channel to lose its subscribers",
        Duration::from_secs(5),
        async || env.numsub(&channel).await == 0,
    )
    .await;
}

/// Waiters answer within milliseconds of the leader's release, not a poll
/// interval later.
pub async fn waiters_answer_within_milliseconds_of_the_release(env: &TestEnv) {
    let apps = join_all((0..2).map(|_| env.spawn(PATIENT))).await;
    let lock = TableLock::take(env).await;
    let requests = fire(&apps, "/posts/3", 40);
    env.until_held(&apps, 40).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    let released = lock.release().await;
    let results: Vec<_> = answered(requests).await;

    let mut after: Vec<Duration> = results.iter().map(|(_, done)| *done - released).collect();
    after.sort();
    let (median, max) = (after[after.len() / 2], after[after.len() - 1]);
    assert!(results.iter().all(|(r, _)| r.status == 200));
    // A poller with the default 100 ms interval would add 50 ms on average.
    assert!(
        median < Duration::from_millis(40),
        "median {median:?} after the release"
    );
    assert!(
        max < Duration::from_millis(250),
        "slowest {max:?} after the release"
    );
}

/// Waiters whose pub/sub connection is killed (`kill_pubsub`) subscribe
/// again and are woken by the leader that finishes right after.
pub async fn waiters_survive_a_killed_pubsub_connection(env: &TestEnv, kill_pubsub: impl Fn()) {
    let apps = join_all((0..2).map(|_| env.spawn(PATIENT))).await;
    let lock = TableLock::take(env).await;
    let requests = fire(&apps, "/posts/6", 20);
    env.until_held(&apps, 20).await;
    env.until_subscribed(6).await;
    let channel = env.keys.channel(6);

    kill_pubsub();
    wait_until(
        "the waiter to subscribe again",
        Duration::from_secs(10),
        async || env.numsub(&channel).await >= 1,
    )
    .await;
    let released = lock.release().await;
    let replies: Vec<_> = answered(requests).await;

    assert!(replies.iter().all(|(r, _)| r.status == 200));
    let slowest = replies.iter().map(|(_, at)| *at - released).max().unwrap();
    assert!(
        slowest < Duration::from_secs(1),
        "the last waiter answered {slowest:?} after the release"
    );
    assert_eq!(served_as(replies.iter().map(|(r, _)| r), "miss"), 1);
}
