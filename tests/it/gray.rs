//! Gray failures of the change feed (replication): faults that close
//! nothing and say nothing. The decoder's connections to PostgreSQL going
//! silent (a proxy that forwards nothing and closes nothing, as a dead NAT
//! entry does), and a walsender slowed by another table's bulk write, which
//! must not be taken for the first.

use std::time::{Duration, Instant};

use postcache::testkit::{wait_until, Http, ServiceProcess, TestEnv, A_WHILE};

/// Lifetimes far past the tests' bounds: a change not applied is served
/// for ten minutes, never expired away within a test.
fn replication(extra: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    let mut vars = vec![
        ("CHANGE_FEED", "replication".to_owned()),
        ("CACHE_TTL", "600s".to_owned()),
        ("L1_TTL", "600s".to_owned()),
    ];
    vars.extend(extra.iter().cloned());
    vars
}

async fn decodes(process: &ServiceProcess) -> bool {
    process.http.metric("postcache_change_feed_decoder").await == 1.0
}

async fn feed_state(http: &Http) -> String {
    match http.send(reqwest::Method::GET, "/readyz", &[]).await {
        Ok(reply) => reply.json()["change_feed"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        Err(_) => "unanswered".into(),
    }
}

/// The title post `id` reads with `headers`, if a 200.
async fn title_with(http: &Http, id: i64, headers: &[(&str, &str)]) -> Option<String> {
    let reply = http
        .send(reqwest::Method::GET, &format!("/posts/{id}"), headers)
        .await
        .ok()?;
    (reply.status == 200).then(|| reply.json()["title"].as_str().unwrap().to_owned())
}

/// Instance A decodes, with every connection it makes to PostgreSQL through
/// a proxy; B and C stand by. The proxy then forwards nothing and closes
/// nothing, and a post is retitled. Without a deadline of its own the
/// decoder read nothing, which looked the same as nothing to read: it went
/// on beating "nothing behind" for as long as the kernel kept the socket,
/// B served the old title, and both said their feed was up (seen: never
/// seen on B in 20 s). Now the decoder stops beating once it cannot vouch
/// for its connection, another instance takes the slot (ending A's
/// walsender), and:
/// - B, read plainly, serves the new title within 5 s of the commit;
/// - past 3 s after the commit, B's `/readyz` never says the feed is up
///   while B still serves the old title;
/// - a read on C asking for at most 1 s of staleness, 1.2 s or more after
///   the commit, never answers the old title. (On C: such a read, past the
///   cache, would also hold B's later reads to the new title, and this test
///   is about the feed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decoder_whose_connections_go_silent_is_replaced_within_seconds() {
    let env = TestEnv::new(5).await;
    env.retitle(1, "before").await;
    let (proxy, url) = env.proxied_database().await;
    let a = env
        .start_process(&replication(&[("DATABASE_URL", url)]))
        .await;
    wait_until("A to decode", A_WHILE, async || decodes(&a).await).await;
    let b = env.start_process(&replication(&[])).await;
    let c = env.start_process(&replication(&[])).await;
    crate::support::until_feed(&b.http, "up").await;
    crate::support::until_feed(&c.http, "up").await;
    assert!(!decodes(&b).await && !decodes(&c).await, "A holds the slot");
    for http in [&a.http, &b.http, &c.http] {
        assert_eq!(http.title(1).await.as_deref(), Some("before"));
        assert_eq!(http.title(1).await.as_deref(), Some("before"));
    }
    // A walsender younger than the takeover's grace is left to its
    // timeout: let A's be older (as any that has run a while is).
    tokio::time::sleep(Duration::from_secs(4)).await;

    proxy.stall(true);
    env.retitle(1, "after the silence").await;
    let committed = Instant::now();
    let mut up_while_old = Vec::new();
    let mut stale_despite_bound = Vec::new();
    let seen_at = loop {
        let since = committed.elapsed();
        let title = b.http.title(1).await;
        if title.as_deref() == Some("after the silence") {
            break since;
        }
        assert!(
            since < Duration::from_secs(5),
            "B still reads {title:?} {since:?} after the commit (its feed: {})",
            feed_state(&b.http).await
        );
        let state = feed_state(&b.http).await;
        if since > Duration::from_secs(3) && state == "up" {
            up_while_old.push(since);
        }
        if since > Duration::from_millis(1200) {
            let bounded = title_with(&c.http, 1, &[("PostCache-Max-Staleness", "1s")]).await;
            if bounded.as_deref() == Some("before") {
                stale_despite_bound.push(since);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        up_while_old.is_empty(),
        "B said its feed was up while it served the old title, at {up_while_old:?}"
    );
    assert!(
        stale_despite_bound.is_empty(),
        "C served the old title to reads bounded to 1 s of staleness, at {stale_despite_bound:?}"
    );
    eprintln!("the new title was seen on B {seen_at:?} after the commit");
    assert!(
        decodes(&b).await || decodes(&c).await,
        "B or C took the slot"
    );
    let mut took_over = 0.0;
    for http in [&b.http, &c.http] {
        took_over += http.metric("postcache_change_feed_takeovers_total").await;
    }
    assert!(
        took_over >= 1.0
            || a.http
                .metric("postcache_change_feed_decoder_gave_up_total")
                .await
                >= 1.0,
        "the slot changed hands through a takeover or A's giving up"
    );
    proxy.stall(false);
}

/// Another table's bulk write, committed just before a post is retitled:
/// the walsender decodes it for seconds, sending nothing, before it comes
/// to the post's change. That is a slow walsender, not a dead connection:
/// the decoder says it is alive and behind (never level), nobody takes the
/// slot from it (which would only start the decoding over), a read bounded
/// in staleness goes past the cache, and the change arrives once decoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_walsender_slowed_by_a_bulk_write_elsewhere_keeps_the_slot() {
    let env = TestEnv::new(5).await;
    env.retitle(1, "before").await;
    sqlx::query("create table bulk (id bigint, pad text)")
        .execute(&env.admin)
        .await
        .unwrap();
    let a = env.start_process(&replication(&[])).await;
    wait_until("A to decode", A_WHILE, async || decodes(&a).await).await;
    let b = env.start_process(&replication(&[])).await;
    crate::support::until_feed(&b.http, "up").await;
    assert_eq!(b.http.title(1).await.as_deref(), Some("before"));

    let started = Instant::now();
    sqlx::query("insert into bulk select n, repeat('x', 100) from generate_series(1, 3000000) n")
        .execute(&env.admin)
        .await
        .unwrap();
    let written = started.elapsed();
    env.retitle(1, "after the bulk write").await;
    let committed = Instant::now();
    let mut bounded_old = 0;
    let mut states = std::collections::BTreeMap::<String, usize>::new();
    let seen_at = loop {
        if b.http.title(1).await.as_deref() == Some("after the bulk write") {
            break committed.elapsed();
        }
        assert!(
            committed.elapsed() < Duration::from_secs(120),
            "the change never arrived"
        );
        let bounded = title_with(&b.http, 1, &[("PostCache-Max-Staleness", "1s")]).await;
        if committed.elapsed() > Duration::from_millis(1200) && bounded.as_deref() == Some("before")
        {
            bounded_old += 1;
        }
        *states.entry(feed_state(&b.http).await).or_default() += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "bulk write {written:?}; the change seen {seen_at:?} after its commit; B's feed meanwhile: {states:?}"
    );
    assert_eq!(
        bounded_old, 0,
        "reads bounded to 1 s of staleness got the old title"
    );
    assert!(decodes(&a).await, "A kept the slot");
    for process in [&a, &b] {
        assert_eq!(
            process
                .http
                .metric("postcache_change_feed_takeovers_total")
                .await,
            0.0
        );
        assert_eq!(
            process
                .http
                .metric("postcache_change_feed_decoder_gave_up_total")
                .await,
            0.0
        );
    }
}

/// Instance A loses its connection to PostgreSQL (the rest of the fleet
/// keeps its own); a post changes. A's load of it fails, and A re-serves
/// the last good copy, the version before the change, flagged as a backoff
/// copy in Redis for FAILURE_TTL. B, whose own loads succeed, must not take
/// A's failure for the fleet's and serve that old copy: it loads the post
/// itself. (Seen in the coherence checker with the decoder's connections
/// silenced: the other instances served A's copies, older than the versions
/// they had served, for FAILURE_TTL.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_instances_failed_load_is_not_the_fleets_while_its_loads_succeed() {
    let env = TestEnv::new(5).await;
    env.retitle(3, "before").await;
    let flags = ["--l1-max-bytes", "0", "--failure-ttl", "5s"];
    let (proxy, a) = env.spawn_proxied(&flags).await;
    let b = env.spawn(&flags).await;
    crate::support::until_feed(&b.http, "up").await;
    assert_eq!(a.http.title(3).await.as_deref(), Some("before"));

    proxy.cut();
    env.retitle(3, "after").await;
    wait_until("the change to be applied", A_WHILE, async || {
        env.stored(3).await.is_some_and(|e| e.is_invalidated())
    })
    .await;
    // A cannot load: the last good copy, flagged for FAILURE_TTL.
    let reply = a.http.get("/posts/3").await;
    assert_eq!(reply.x_cache.as_deref(), Some("stale"), "{}", reply.text());
    assert_eq!(reply.json()["title"], "before");
    assert!(env.stored(3).await.is_some_and(|e| e.is_backoff()));
    // B has just loaded something: its database answers.
    assert_eq!(b.get("/posts/4").await.status, 200);
    assert_eq!(b.http.title(3).await.as_deref(), Some("after"));
    proxy.restore();
}
