//! The load path is only for loads: readiness probes on a connection of
//! their own at most once a second, a pool with no connection free sheds
//! the request (503, Retry-After) without marking the key failed, and
//! `/metrics` and `/readyz` can be served on ADMIN_ADDR.

use std::time::{Duration, Instant};

use futures::future::join_all;
use postcache::testkit::{free_port, server_url, Http, Reply, TableLock, TestEnv};
use sqlx::{Connection, PgConnection};

/// Backends of this world's database with `application_name`.
async fn backends(env: &TestEnv, name: &str) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_stat_activity
         where datname = current_database() and application_name = $1",
    )
    .bind(name)
    .fetch_one(&env.admin)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_readyz_takes_no_load_connection() {
    let env = TestEnv::new(60).await;
    // One load connection, given up on after 300 ms: before, each /readyz
    // ran `select 1` on it.
    let app = env
        .spawn(&["--db-max-connections", "1", "--db-acquire-timeout", "300ms"])
        .await;

    // The one load connection is held by a leader blocked on the table:
    // readiness still answers, at once, from its own connection.
    let lock = TableLock::take(&env).await;
    let holder = app.http.spawn_get("/posts/1");
    env.until_held(std::slice::from_ref(&app), 1).await;
    let started = Instant::now();
    let held = join_all((0..200).map(|_| app.get("/readyz"))).await;
    let took = started.elapsed();
    lock.release().await;
    assert_eq!(holder.await.unwrap().0.status, 200);

    // A flood beside cold reads: every read gets its connection.
    let flooding = Instant::now() + Duration::from_millis(1_500);
    let flood = join_all((0..8).map(|_| {
        let http = app.http.clone();
        tokio::spawn(async move {
            let mut answers = Vec::new();
            while Instant::now() < flooding {
                let burst = join_all((0..25).map(|_| http.get("/readyz"))).await;
                answers.extend(burst.into_iter().map(|r| r.status));
            }
            answers
        })
    }));
    let reads = async {
        let mut statuses = Vec::new();
        for id in 2..=50 {
            statuses.push(app.get(&format!("/posts/{id}")).await.status);
        }
        statuses
    };
    let (flood, reads) = tokio::join!(flood, reads);
    let probes = backends(&env, "postcache-readiness").await;

    assert!(
        held.iter()
            .all(|r| r.status == 200 && r.json()["postgres"] == "up"),
        "{:?}",
        held.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert!(took < Duration::from_millis(1_000), "{took:?}");
    let answers: Vec<u16> = flood.into_iter().flat_map(|a| a.unwrap()).collect();
    assert!(answers.len() > 200, "a flood: {} requests", answers.len());
    assert!(answers.iter().all(|s| *s == 200), "{answers:?}");
    assert!(reads.iter().all(|s| *s == 200), "cold reads: {reads:?}");
    assert!(probes <= 1, "{probes} readiness connections");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readyz_probes_at_most_once_a_second() {
    let env = TestEnv::new(1).await;
    let app = env.spawn(&[]).await;
    assert_eq!(app.get("/readyz").await.json()["postgres"], "up");

    // PostgreSQL refuses this world's connections from now on; the probe's
    // connection is ended, so its next probe must connect and fails.
    let mut server = PgConnection::connect(&format!("{}/postgres", server_url()))
        .await
        .unwrap();
    let allow = |allowed: bool| {
        format!(
            "alter database {} with allow_connections {allowed}",
            env.db_name
        )
    };
    sqlx::query(&allow(false))
        .execute(&mut server)
        .await
        .unwrap();
    sqlx::query(
        "select pg_terminate_backend(pid) from pg_stat_activity
         where datname = $1 and application_name = 'postcache-readiness'",
    )
    .bind(&env.db_name)
    .execute(&mut server)
    .await
    .unwrap();
    let within_the_second = app.get("/readyz").await.json()["postgres"].clone();
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let after_it = app.get("/readyz").await;
    sqlx::query(&allow(true))
        .execute(&mut server)
        .await
        .unwrap();

    assert_eq!(
        within_the_second, "up",
        "the last probe, under a second old"
    );
    // Redis answers: copies are served, so the instance stays in rotation.
    assert_eq!(after_it.json()["postgres"], "down");
    assert_eq!(
        (after_it.status, after_it.json()["status"].as_str()),
        (200, Some("degraded"))
    );
}

/// Busy: one connection, a key per statement, each statement 150 ms, six
/// cold keys at once. The first keys are loaded; those still queued after
/// the acquire timeout (200 ms), while statements kept succeeding, are
/// shed: 503 with Retry-After, their locks let go, nothing stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_with_no_connection_free_sheds_with_retry_after_and_marks_nothing() {
    // (Was faults::an_exhausted_pool_answers_503_after_the_acquire_timeout,
    // with its assertions, and FAILURE_TTL on to show that no marker is left.)
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&[
            "--db-max-connections",
            "1",
            "--db-acquire-timeout",
            "200ms",
            "--load-batch-max",
            "1",
            "--failure-ttl",
            "30s",
            "--lock-ttl",
            "10s",
        ])
        .await;
    let shed_before = app
        .http
        .metric(r#"postcache_shed_total{reason="db_pool"}"#)
        .await;
    env.slow_loads(Duration::from_millis(150)).await;

    let paths: Vec<String> = (1..=6).map(|id| format!("/posts/{id}")).collect();
    let started = Instant::now();
    let replies = join_all(paths.iter().map(|path| app.get(path))).await;
    let took = started.elapsed();
    let busy: Vec<(i64, &Reply)> = (1..=6)
        .zip(&replies)
        .filter(|(_, reply)| reply.status != 200)
        .collect();
    let ids: Vec<i64> = busy.iter().map(|(id, _)| *id).collect();
    let locks_left = join_all(ids.iter().map(|&id| env.lock_held(id))).await;
    let stored = join_all(ids.iter().map(|&id| env.stored(id))).await;
    let shed = app
        .http
        .metric(r#"postcache_shed_total{reason="db_pool"}"#)
        .await
        - shed_before;

    assert!(
        (2..=5).contains(&busy.len()),
        "some loaded, the rest shed: {:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    for (id, reply) in &busy {
        assert_eq!(reply.status, 503, "post {id}: {}", reply.text());
        assert_eq!(
            reply
                .headers
                .get("retry-after")
                .map(|v| v.to_str().unwrap()),
            Some("1")
        );
        assert!(!reply.error().is_empty());
    }
    assert!(
        took < Duration::from_millis(1_000),
        "answered after the acquire timeout: {took:?}"
    );
    assert!(
        locks_left.iter().all(|held| !held),
        "each lock let go at once: {locks_left:?}"
    );
    assert!(
        stored.iter().all(Option::is_none),
        "no failure marker: {stored:?}"
    );
    assert_eq!(shed, busy.len() as f64);
    for id in ids {
        // One at a time, each is loaded: not failed for FAILURE_TTL.
        let after = app.get(&format!("/posts/{id}")).await;
        assert_eq!(after.status, 200, "post {id}: {}", after.text());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_addr_serves_readyz_and_metrics_and_nothing_else() {
    let env = TestEnv::new(1).await;
    let port = free_port();
    let app = env
        .spawn(&["--admin-addr", &format!("127.0.0.1:{port}")])
        .await;
    let admin = Http::new(format!("http://127.0.0.1:{port}"));

    let ready = admin.get("/readyz").await;
    let metrics = admin.get("/metrics").await;
    let post = admin.get("/posts/1").await;

    assert_eq!(ready.status, 200, "{}", ready.text());
    assert_eq!(ready.json()["postgres"], "up");
    assert_eq!(metrics.status, 200);
    assert!(metrics.text().contains("postcache_requests_total"));
    assert_eq!(post.status, 404);
    assert_eq!(admin.get("/livez").await.json()["status"], "ok");
    assert_eq!(
        app.get("/readyz").await.status,
        200,
        "the main port still has it"
    );
    assert_eq!(app.get("/posts/1").await.status, 200);
}

/// A pool that times out because it cannot connect (PostgreSQL down or
/// unreachable) is a failure, not a busy instance: the failure is
/// remembered for FAILURE_TTL (and a fail-safe copy, where one exists,
/// served), without Retry-After.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_that_cannot_be_reached_is_a_failure_not_busy() {
    let env = TestEnv::new(1).await;
    let closed = free_port();
    let app = env
        .spawn(&[
            "--database-url",
            &format!("postgres://postgres@127.0.0.1:{closed}/x"),
            "--db-acquire-timeout",
            "300ms",
            "--failure-ttl",
            "30s",
            "--change-feed",
            "off",
        ])
        .await;

    let reply = app.get("/posts/1").await;
    let stored = env.stored(1).await;

    assert_eq!(reply.status, 503, "{}", reply.text());
    assert!(reply.headers.get("retry-after").is_none());
    assert_eq!(
        stored.map(|e| e.status()),
        Some(postcache::cache::Status::Failed),
        "the failure is remembered"
    );
}
