//! Scenarios run against a single Redis and against a Redis Cluster.

use std::time::{Duration, Instant};

use futures::future::join_all;

use super::{blocked_loads, TableLock, TestApp, TestEnv};

/// Settings for tests that hold a load back: generous bounds, so only the
/// behaviour under test decides the outcome.
pub const PATIENT: &[&str] = &[
    "--redis-timeout",
    "2s",
    "--wait-timeout",
    "20s",
    "--lock-ttl",
    "25s",
    "--db-statement-timeout",
    "20s",
];

/// Fires `n` requests for `path`, spread round-robin over `apps`.
pub fn fire(
    apps: &[TestApp],
    path: &str,
    n: usize,
) -> Vec<tokio::task::JoinHandle<(super::Reply, Instant)>> {
    (0..n)
        .map(|i| {
            let app = &apps[i % apps.len()];
            let (http, url) = (app.http.clone(), format!("{}{path}", app.base));
            tokio::spawn(async move {
                let response = http.get(url).send().await.expect("request failed");
                let status = response.status().as_u16();
                let headers = response.headers().clone();
                let x_cache = headers
                    .get("x-cache")
                    .map(|v| v.to_str().unwrap().to_owned());
                let body = response.bytes().await.unwrap();
                let done = Instant::now();
                (
                    super::Reply {
                        status,
                        x_cache,
                        content_type: None,
                        body,
                        headers,
                    },
                    done,
                )
            })
        })
        .collect()
}

pub async fn in_progress(apps: &[TestApp]) -> usize {
    apps.iter().map(TestApp::reads_in_progress).sum()
}

/// 1,000 concurrent requests for one cold post over 3 instances: one
/// database read (counted by PostgreSQL), 1 miss and 999 coalesced, identical
/// bodies, no lock and no subscriber left behind.
pub async fn a_thousand_misses_make_one_query(env: &TestEnv) {
    let before = env.post_reads().await;
    let apps = join_all((0..3).map(|_| env.spawn(PATIENT))).await;
    let lock = TableLock::take(env).await;

    // Every request is inside the service before the leader's load may finish.
    let requests = fire(&apps, "/posts/7", 1000);
    let deadline = Instant::now() + Duration::from_secs(60);
    while in_progress(&apps).await < 1000 || blocked_loads(env).await < 1 {
        assert!(Instant::now() < deadline, "requests did not all arrive");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    lock.release().await;
    let replies: Vec<_> = join_all(requests)
        .await
        .into_iter()
        .map(|r| r.unwrap().0)
        .collect();
    for app in apps {
        app.stop().await;
    }

    assert!(replies.iter().all(|r| r.status == 200));
    assert!(
        replies.iter().all(|r| r.body == replies[0].body),
        "bodies differ"
    );
    let count = |tag: &str| {
        replies
            .iter()
            .filter(|r| r.x_cache.as_deref() == Some(tag))
            .count()
    };
    let mut tags: Vec<_> = replies.iter().map(|r| r.x_cache.clone()).collect();
    tags.sort();
    tags.dedup();
    assert_eq!((count("miss"), count("coalesced")), (1, 999), "{tags:?}");
    assert_eq!(
        env.post_reads().await - before,
        1,
        "PostgreSQL saw more than one read"
    );
    assert_eq!(
        env.pttl(&env.keys.lock(7)).await,
        -2,
        "the lock was released"
    );
    let channel = env.keys.channel(7);
    let deadline = Instant::now() + Duration::from_secs(5);
    while env.numsub(&channel).await != 0 {
        assert!(
            Instant::now() < deadline,
            "the ready channel kept subscribers"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waiters answer within milliseconds of the leader's release, not a poll
/// interval later.
pub async fn waiters_answer_within_milliseconds_of_the_release(env: &TestEnv) {
    let apps = join_all((0..2).map(|_| env.spawn(PATIENT))).await;
    let lock = TableLock::take(env).await;
    let requests = fire(&apps, "/posts/3", 40);
    wait_while!(
        "requests to arrive and the leader to block",
        in_progress(&apps).await < 40 || blocked_loads(env).await < 1
    );
    tokio::time::sleep(Duration::from_millis(300)).await;

    let released = lock.release().await;
    let results: Vec<_> = join_all(requests)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();

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
