//! The HTTP contract and plain cache-aside, against the real servers.

use std::time::Duration;

use fred::prelude::ClientLike;
use postcache::{
    cache::{Jitter, Status},
    testkit::{free_port, wait_until, TableLock, TestEnv, A_WHILE, PATIENT},
};

#[tokio::test]
async fn a_post_is_served_as_json_first_as_a_miss_then_as_a_hit() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(&[]).await;

    let first = app.get("/posts/2").await;
    let second = app.get("/posts/2").await;

    assert_eq!(first.status, 200);
    assert_eq!(first.x_cache.as_deref(), Some("miss"));
    assert_eq!(first.content_type.as_deref(), Some("application/json"));
    let post = first.json();
    assert_eq!(post["id"], 2);
    for field in ["title", "body", "author", "created_at", "updated_at"] {
        assert!(post[field].is_string(), "{field} missing in {post}");
    }
    assert_eq!(second.status, 200);
    assert_eq!(second.x_cache.as_deref(), Some("hit"));
    assert_eq!(second.body, first.body, "a hit serves the same bytes");
}

#[tokio::test]
async fn every_invalid_id_answers_400_with_a_json_error() {
    let env = TestEnv::new(1).await;
    let app = env.spawn(&[]).await;
    let long = "1".repeat(10_000);
    let bad = [
        "abc",
        "0",
        "-1",
        "1.5",
        "+1",
        "9223372036854775808",
        "99999999999999999999999",
        "",
        long.as_str(),
        "%20",
        "1%20",
        "%FF",
        "1e3",
    ];
    for id in bad {
        let reply = app.get(&format!("/posts/{id}")).await;
        assert_eq!(reply.status, 400, "/posts/{id} gave {}", reply.status);
        assert_eq!(reply.content_type.as_deref(), Some("application/json"));
        assert!(!reply.error().is_empty());
    }
    let max = app.get("/posts/9223372036854775807").await;
    assert_eq!(max.status, 404, "the largest id is valid (and absent)");
}

#[tokio::test]
async fn an_unknown_post_is_404_and_cached_as_not_found_for_the_negative_ttl() {
    let env = TestEnv::new(1).await;
    let app = env
        .spawn(&["--negative-ttl", "4s", "--ttl-jitter", "0.25"])
        .await;

    let first = app.get("/posts/77").await;
    let second = app.get("/posts/77").await;

    assert_eq!(
        (first.status, first.x_cache.as_deref()),
        (404, Some("miss"))
    );
    assert_eq!(first.error(), "post not found");
    assert_eq!(
        (second.status, second.x_cache.as_deref()),
        (404, Some("hit"))
    );
    let entry = env.stored(77).await.expect("a not-found entry is stored");
    assert_eq!(entry.status(), Status::NotFound);
    let pttl = env.pttl(&env.keys.value(77)).await;
    assert!(
        (2_900..=5_000).contains(&pttl),
        "PTTL {pttl} outside 4s ± 25%"
    );
}

#[tokio::test]
async fn a_hit_does_not_query_postgres() {
    let env = TestEnv::new(5).await;
    let before = env.post_reads().await;
    let app = env.spawn(&[]).await;

    let miss = app.get("/posts/3").await;
    for _ in 0..20 {
        assert_eq!(app.get("/posts/3").await.x_cache.as_deref(), Some("hit"));
    }
    app.stop().await;

    assert_eq!(miss.x_cache.as_deref(), Some("miss"));
    assert_eq!(
        env.post_reads().await - before,
        1,
        "one load, then only hits"
    );
}

#[tokio::test]
async fn the_stored_ttl_lies_inside_the_jitter_window() {
    let env = TestEnv::new(40).await;
    let app = env
        .spawn(&["--cache-ttl", "60s", "--ttl-jitter", "0.1"])
        .await;
    let (lo, hi) = Jitter::new(0.1).window(Duration::from_secs(60));

    // The freshness stored in each entry; the key outlives it as the
    // fail-safe copy (by MAX_STALE).
    let mut pttls = Vec::new();
    for id in 1..=40 {
        assert_eq!(app.get(&format!("/posts/{id}")).await.status, 200);
        let entry = env.stored(id).await.expect("stored");
        let fresh = (entry.fresh_until() - entry.stored_at()) as i64;
        assert!(env.pttl(&env.keys.value(id)).await > fresh);
        pttls.push(fresh);
    }

    for pttl in &pttls {
        assert!(
            (lo.as_millis() as i64..=hi.as_millis() as i64).contains(pttl),
            "freshness {pttl} ms outside [{lo:?}, {hi:?}]"
        );
    }
    let spread = pttls.iter().max().unwrap() - pttls.iter().min().unwrap();
    assert!(
        spread > 1_000,
        "40 TTLs spread over only {spread} ms: no jitter?"
    );
}

#[tokio::test]
async fn an_undecodable_entry_is_a_miss_and_gets_replaced() {
    let env = TestEnv::new(2).await;
    // Each round's garbage is met by a GET in Redis: no memory tier before it.
    let app = env.spawn(&["--l1-max-bytes", "0"]).await;
    let key = env.keys.value(2);
    let counted = r#"postcache_garbage_total{kind="entry"}"#;
    let before = app.http.metric(counted).await;
    for garbage in [
        &b"not an entry"[..],
        b"",
        b"\x02\x07garbage-garbage-garbage-garbage-garbage-!",
    ] {
        env.set(&key, garbage, Duration::from_secs(60)).await;

        let reply = app.get("/posts/2").await;

        assert_eq!(reply.status, 200);
        assert_eq!(reply.x_cache.as_deref(), Some("miss"));
        assert_eq!(reply.json()["id"], 2);
        let stored = env.stored(2).await.expect("replaced by a real entry");
        assert_eq!(stored.status(), Status::Found);
        assert_eq!(stored.body(), reply.body);
    }
    // Each is met twice: by the first look and by the claim's read of the
    // value (a leader that just finished is served without a load).
    assert_eq!(
        app.http.metric(counted).await - before,
        6.0,
        "each undecodable entry counted where it was met"
    );
}

/// A rolling upgrade: an instance of the previous layout (envelope version
/// 1, its fail-safe copy under a key of its own) stored a fresh entry. It is
/// never served: read as a miss, loaded, and replaced.
#[tokio::test]
async fn an_entry_of_the_previous_layout_is_never_served_and_gets_replaced() {
    let env = TestEnv::new(2).await;
    let app = env.spawn(&["--l1-max-bytes", "0"]).await;
    let now = postcache::cache::now_millis();
    let body = br#"{"id":2,"title":"from the previous layout"}"#;
    let mut v1 = vec![1u8, 0, 0];
    v1.extend_from_slice(&now.to_be_bytes());
    v1.extend_from_slice(&(now + 60_000).to_be_bytes());
    v1.extend_from_slice(&0u32.to_be_bytes());
    v1.extend_from_slice(&7u64.to_be_bytes());
    v1.extend_from_slice(body);
    env.set(
        &env.keys.value(2),
        bytes::Bytes::from(v1),
        Duration::from_secs(60),
    )
    .await;

    let reply = app.get("/posts/2").await;

    assert_eq!(
        (reply.status, reply.x_cache.as_deref()),
        (200, Some("miss"))
    );
    assert_ne!(reply.json()["title"], "from the previous layout");
    let stored = env
        .stored(2)
        .await
        .expect("replaced by an entry of this layout");
    assert_eq!(stored.body(), reply.body);
    assert_eq!(app.get("/posts/2").await.x_cache.as_deref(), Some("hit"));
}

/// A cached post is one key in Redis, its body stored once: the entry
/// serves reads while fresh and stays as the fail-safe copy after, and the
/// lock is gone once the load is done.
#[tokio::test]
async fn a_cached_post_is_one_key_of_at_most_its_body_and_150_bytes() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(&["--max-stale", "1h"]).await;
    let reply = app.get("/posts/2").await;
    assert_eq!(reply.x_cache.as_deref(), Some("miss"));
    env.stored(2).await.expect("stored");

    let value = env.keys.value(2);
    let prefix = value.strip_suffix("post:{2}").expect("the contract's name");
    let list = fred::types::CustomCommand::new_static("KEYS", None::<u16>, false);
    let keys: Vec<String> = env
        .redis
        .custom(list, vec![format!("{prefix}*{{2}}")])
        .await
        .unwrap();
    assert_eq!(keys, std::slice::from_ref(&value), "one key for the post");
    let usage = fred::types::CustomCommand::new_static("MEMORY", None::<u16>, false);
    let bytes: i64 = env
        .redis
        .custom(usage, vec!["USAGE", value.as_str(), "SAMPLES", "0"])
        .await
        .unwrap();
    let body = reply.body.len() as i64;
    assert!(
        bytes <= body + 150,
        "{bytes} bytes in Redis for a body of {body}"
    );
}

#[tokio::test]
async fn unknown_routes_are_404_and_wrong_methods_405_both_in_json() {
    let env = TestEnv::new(1).await;
    let app = env.spawn(&[]).await;

    let unknown = app.get("/nothing/here").await;
    let post = app.http.request(reqwest::Method::POST, "/posts/1").await;
    let delete = app.http.request(reqwest::Method::DELETE, "/healthz").await;

    assert_eq!(unknown.status, 404);
    assert!(!unknown.error().is_empty());
    for reply in [post, delete] {
        assert_eq!(reply.status, 405);
        assert!(!reply.error().is_empty());
    }
}

#[tokio::test]
async fn healthz_is_ok_and_readyz_reports_both_backends() {
    let env = TestEnv::new(1).await;
    let app = env.spawn(&[]).await;

    let health = app.get("/healthz").await;
    let ready = app.get("/readyz").await;
    let live = app.get("/livez").await;

    assert_eq!(health.status, 200);
    assert_eq!(ready.status, 200);
    assert_eq!(live.status, 200);
    assert_eq!(ready.json()["postgres"], "up");
    assert_eq!(ready.json()["redis"], "up");
    // A probe's answer is this process now: no cache keeps it.
    for reply in [&health, &ready, &live] {
        assert_eq!(reply.headers["cache-control"], "no-store");
    }
}

/// Readiness follows what the instance can serve: with one dependency down
/// it still answers reads (Redis down: from PostgreSQL; PostgreSQL down:
/// the copies it has), so it stays in rotation, `degraded`. A balancer that
/// heeded a 503 there would take every instance out at once, for a
/// dependency they all share. With both down, 503.
#[tokio::test]
async fn readyz_stays_200_degraded_while_reads_are_answered_and_names_what_is_down() {
    let env = TestEnv::new(1).await;
    let no_redis = env.spawn_without_redis().await;
    let closed = free_port();
    let postgres_url = format!("postgres://postgres@127.0.0.1:{closed}/x");
    let no_postgres_flags = [
        "--database-url",
        &postgres_url,
        "--db-acquire-timeout",
        "300ms",
    ];
    let no_postgres = env.spawn(&no_postgres_flags).await;
    let closed_redis = format!("redis://127.0.0.1:{}", free_port());
    let neither = env
        .spawn(
            &[
                &no_postgres_flags[..],
                &["--redis-url", &closed_redis, "--redis-timeout", "100ms"],
            ]
            .concat(),
        )
        .await;

    let r = no_redis.get("/readyz").await;
    let served = no_redis.get("/posts/1").await;
    let p = no_postgres.get("/readyz").await;
    let n = neither.get("/readyz").await;

    let states = |reply: &postcache::testkit::Reply| {
        let body = reply.json();
        (
            reply.status,
            body["status"].as_str().map(str::to_owned),
            body["postgres"].as_str().map(str::to_owned),
            body["redis"].as_str().map(str::to_owned),
        )
    };
    let some = |s: &str| Some(s.to_owned());
    assert_eq!(
        states(&r),
        (200, some("degraded"), some("up"), some("down"))
    );
    assert_eq!(served.status, 200, "reads fail open to PostgreSQL");
    assert_eq!(
        states(&p),
        (200, some("degraded"), some("down"), some("up"))
    );
    assert_eq!(
        states(&n),
        (503, some("unavailable"), some("down"), some("down"))
    );
}

#[tokio::test]
async fn a_request_in_flight_finishes_after_the_shutdown_signal() {
    let env = TestEnv::new(1).await;
    let app = env.spawn(PATIENT).await;
    let lock = TableLock::take(&env).await;
    let pending = app.http.spawn_get("/posts/1");
    env.until_held(std::slice::from_ref(&app), 1).await;

    let addr = app.http.addr();
    let stopping = tokio::spawn(app.stop());
    // The shutdown has begun once the listener is closed.
    wait_until("the listener to close", A_WHILE, async || {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;
    lock.release().await;

    let (reply, _) = pending.await.expect("the request was answered");
    assert_eq!(reply.status, 200);
    stopping.await.unwrap();
}

#[tokio::test]
async fn the_openapi_document_is_served_with_the_caching_headers_of_reads() {
    let env = TestEnv::new(1).await;
    let app = env.spawn(&[]).await;

    let reply = app.get("/openapi.json").await;

    assert_eq!(reply.status, 200);
    assert_eq!(reply.content_type.as_deref(), Some("application/json"));
    assert_eq!(reply.headers["cache-control"], "no-store");
    let doc = reply.json();
    assert_eq!(doc["openapi"], "3.1.0");
    let read = &doc["paths"]["/posts/{id}"]["get"]["responses"];
    for header in [
        "X-Cache",
        "X-Cache-Tier",
        "X-Cache-Bypass",
        "Cache-Status",
        "ETag",
        "Cache-Control",
        "Age",
        "Warning",
    ] {
        assert!(read["200"]["headers"][header].is_object(), "{header}");
    }
    for status in ["304", "400", "404", "503", "504"] {
        assert!(read[status].is_object(), "{status}");
    }
}
