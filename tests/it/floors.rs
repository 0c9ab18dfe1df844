//! Never back in time: a process never serves an older version of a post
//! than one it served (`read_path/floor.rs`), whichever tier holds the
//! older one: the memory tier, Redis, or another instance's leader.

use std::time::{Duration, Instant};

use postcache::testkit::{wait_until, Http, ServiceProcess, TestEnv, A_WHILE};

fn replication() -> Vec<(&'static str, String)> {
    vec![
        ("CHANGE_FEED", "replication".to_owned()),
        ("CACHE_TTL", "600s".to_owned()),
        ("L1_TTL", "600s".to_owned()),
    ]
}

async fn decodes(process: &ServiceProcess) -> bool {
    process.http.metric("postcache_change_feed_decoder").await == 1.0
}

async fn title_with(http: &Http, id: i64, headers: &[(&str, &str)]) -> (Option<String>, String) {
    let reply = http
        .send(reqwest::Method::GET, &format!("/posts/{id}"), headers)
        .await
        .unwrap();
    let title = (reply.status == 200).then(|| reply.json()["title"].as_str().unwrap().to_owned());
    (title, reply.x_cache.unwrap_or_default())
}

/// The decoder stopped (SIGSTOP), a post retitled, and read on the other
/// instance with `PostCache-Max-Staleness: 0ms`: that read goes past the
/// cache and answers the new title. Every plain read on that instance
/// after it must answer the new title too, though its memory tier and
/// Redis still hold the old one (no decoder applies the change). Seen
/// before: the next 28 plain reads over 1.5 s all answered the old title.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_read_past_the_cache_no_plain_read_goes_back_in_time() {
    let env = TestEnv::new(5).await;
    env.retitle(1, "old").await;
    let a = env.start_process(&replication()).await;
    wait_until("A to decode", A_WHILE, async || decodes(&a).await).await;
    let b = env.start_process(&replication()).await;
    crate::support::until_feed(&b.http, "up").await;
    for _ in 0..3 {
        assert_eq!(b.http.title(1).await.as_deref(), Some("old"));
    }
    assert_eq!(
        title_with(&b.http, 1, &[]).await.1,
        "hit",
        "B holds the old title"
    );

    a.signal("STOP");
    let stopped = Instant::now();
    env.retitle(1, "new").await;
    let (past, how) = title_with(&b.http, 1, &[("PostCache-Max-Staleness", "0ms")]).await;
    assert_eq!(past.as_deref(), Some("new"), "read past the cache ({how})");
    let mut seen = Vec::new();
    while stopped.elapsed() < Duration::from_millis(1500) {
        seen.push(title_with(&b.http, 1, &[]).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.signal("CONT");
    let old: Vec<_> = seen
        .iter()
        .filter(|(title, _)| title.as_deref() != Some("new"))
        .collect();
    assert!(
        old.is_empty(),
        "{} of {} plain reads after the new title went back: {old:?}",
        old.len(),
        seen.len()
    );
    assert!(
        b.http.metric("postcache_floor_misses_total").await >= 1.0,
        "the old copies were refused"
    );
}
