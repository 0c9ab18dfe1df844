//! Faults caused for real, against in-process instances: Redis down at
//! start, killed, paused and restarted; a slow leader; PostgreSQL cut,
//! stalled or exhausted; overload and bad input.

use std::time::{Duration, Instant};

use fred::prelude::*;
use futures::future::join_all;
use postcache::{
    cache::{message, Entry, Status},
    testkit::{fire, wait_until, RedisServer, TableLock, TestApp, TestEnv, A_WHILE, PATIENT},
};

use crate::support::fresh_for;

async fn statuses(
    app: &TestApp,
    ids: impl IntoIterator<Item = i64>,
) -> Vec<(u16, String, Duration)> {
    let mut out = Vec::new();
    for id in ids {
        let started = Instant::now();
        let r = app.get(&format!("/posts/{id}")).await;
        out.push((r.status, r.x_cache.unwrap_or_default(), started.elapsed()));
    }
    out
}

/// Waits until `app` answers `path` from Redis again, not bypassing it.
async fn resumed(app: &TestApp, path: &str) {
    wait_until("caching to resume", Duration::from_secs(10), async || {
        app.get(path).await.x_cache.as_deref() != Some("bypass")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_down_at_start_requests_bypass_and_caching_resumes_when_it_returns() {
    let mut redis = RedisServer::reserve();
    let env = TestEnv::with_redis_lazy(20, redis.url()).await;
    let app = env.spawn(&["--redis-timeout", "100ms"]).await;

    let down = statuses(&app, 1..=10).await;
    redis.restart().await;
    resumed(&app, "/posts/11").await;
    let again = statuses(&app, [12, 12]).await;

    assert!(
        down.iter().all(|(s, x, _)| *s == 200 && x == "bypass"),
        "{down:?}"
    );
    // The breaker stops paying the timeout: after the first few, fast (two
    // timed-out steps would cost at least 200 ms).
    assert!(
        down[5..]
            .iter()
            .all(|(_, _, t)| *t < Duration::from_millis(150)),
        "{down:?}"
    );
    assert_eq!((again[0].1.as_str(), again[1].1.as_str()), ("miss", "hit"));
    // The hit may be the memory tier's: the miss stored it in Redis too.
    assert!(env.stored(12).await.is_some(), "stored in Redis");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_redis_dies_mid_traffic_requests_fail_open_and_pubsub_resumes_after_restart() {
    let mut redis = RedisServer::start().await;
    let env = TestEnv::with_redis(20, redis.url()).await;
    let flags = [PATIENT, &["--redis-timeout", "200ms"]].concat();
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;
    assert_eq!(
        apps[0].get("/posts/1").await.x_cache.as_deref(),
        Some("miss")
    );

    redis.kill();
    // What the memory tier holds is still served; the rest bypasses Redis.
    let kept = apps[0].get("/posts/1").await;
    let down = statuses(&apps[0], 2..=9).await;
    redis.restart().await;
    for app in &apps {
        resumed(app, "/posts/20").await;
    }
    // The shared subscription works again: a cross-instance stampede coalesces.
    let lock = TableLock::take(&env).await;
    let requests = fire(&apps, "/posts/9", 40);
    env.until_held(&apps, 40).await;
    lock.release().await;
    let stampede: Vec<(u16, String)> = join_all(requests)
        .await
        .into_iter()
        .map(|r| {
            let (reply, _) = r.unwrap();
            (reply.status, reply.x_cache.unwrap_or_default())
        })
        .collect();

    assert_eq!((kept.status, kept.tier()), (200, Some("memory")));
    assert!(
        down.iter()
            .all(|(s, x, t)| *s == 200 && x == "bypass" && *t < Duration::from_secs(1)),
        "{down:?}"
    );
    assert!(stampede.iter().all(|(s, _)| *s == 200));
    let misses = stampede.iter().filter(|(_, x)| x == "miss").count();
    assert_eq!(misses, 1, "{stampede:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_redis_costs_each_request_at_most_the_timeout_then_fails_open() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(20, redis.url()).await;
    let app = env.spawn(&["--redis-timeout", "100ms"]).await;
    assert_eq!(app.get("/posts/1").await.status, 200);

    redis.cli(&["client", "pause", "3000", "all"]);
    let paused = statuses(&app, 2..=12).await;

    for (status, x_cache, took) in &paused {
        assert_eq!((*status, x_cache.as_str()), (200, "bypass"));
        // At most two Redis steps time out (the GET, then the lock) before the
        // breaker opens, plus the load.
        assert!(*took < Duration::from_millis(600), "{paused:?}");
    }
}

/// With Redis down, a burst on one key is still one query per instance:
/// the in-process flight coalesces what bypasses Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_down_a_burst_on_one_key_is_one_query_per_instance() {
    let redis = RedisServer::reserve();
    let env = TestEnv::with_redis_lazy(10, redis.url()).await;
    let apps = join_all((0..2).map(|_| env.spawn(&["--redis-timeout", "100ms"]))).await;
    let before = env.post_reads().await;
    // Long enough for every request of the burst to join the first's load.
    env.slow_loads(Duration::from_millis(500)).await;

    let burst = fire(&apps, "/posts/7", 40);
    let replies = postcache::testkit::answered(burst).await;
    for app in apps {
        app.stop().await;
    }
    let reads = env.post_reads().await - before;

    assert!(
        replies
            .iter()
            .all(|(r, _)| r.status == 200 && r.x_cache.as_deref() == Some("bypass")),
        "{:?}",
        replies
            .iter()
            .map(|(r, _)| (r.status, r.x_cache.clone()))
            .collect::<Vec<_>>()
    );
    assert_eq!(reads, 2, "one query per instance for 40 requests");
}

/// A load slower than WAIT_TIMEOUT: its waiters, on another instance and
/// in its own, are answered 504 at WAIT_TIMEOUT; the request that leads it
/// still gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_slower_than_the_wait_timeout_still_answers_its_own_request() {
    let env = TestEnv::new(10).await;
    let flags = [
        "--wait-timeout",
        "500ms",
        "--db-statement-timeout",
        "5s",
        "--lock-ttl",
        "10s",
    ];
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;
    let lock = TableLock::take(&env).await;
    let leader = apps[0].http.spawn_get("/posts/3");
    env.until_held(&apps[..1], 1).await;
    let started = Instant::now();
    let joiner = apps[0].http.spawn_get("/posts/3");
    let remote = apps[1].http.spawn_get("/posts/3");
    let (joined, joined_at) = joiner.await.unwrap();
    let (waited, waited_at) = remote.await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    lock.release().await;
    let (led, _) = leader.await.unwrap();

    assert_eq!(joined.status, 504, "{}", joined.text());
    assert_eq!(waited.status, 504, "{}", waited.text());
    for at in [joined_at, waited_at] {
        let took = at - started;
        assert!(
            took < Duration::from_millis(1_200),
            "answered after {took:?}"
        );
    }
    assert_eq!(led.status, 200, "{}", led.text());
    assert_eq!(led.x_cache.as_deref(), Some("miss"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_but_live_leader_keeps_its_lock_and_is_not_duplicated() {
    let env = TestEnv::new(10).await;
    // The load is slow on the way, not in the statement (DB_STATEMENT_TIMEOUT
    // stays below LOCK_TTL): a network that stalls for four lock lifetimes.
    let (proxy, url) = env.proxied_database().await;
    let before = env.post_reads().await;
    let flags = [
        "--database-url",
        &url,
        "--lock-ttl",
        "300ms",
        "--db-statement-timeout",
        "250ms",
        "--db-acquire-timeout",
        "5s",
        "--load-timeout",
        "5s",
        "--wait-timeout",
        "10s",
        "--redis-timeout",
        "2s",
    ];
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;
    // Both pools hold a connection through the proxy before it stalls.
    for app in &apps {
        assert_eq!(app.get("/healthz").await.status, 200);
        assert_eq!(app.get("/readyz").await.status, 200);
    }
    proxy.stall(true);
    let requests = fire(&apps, "/posts/4", 20);
    wait_until("the requests to arrive", A_WHILE, async || {
        apps.iter().map(TestApp::reads_in_progress).sum::<usize>() >= 20
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    proxy.stall(false);
    let statuses: Vec<u16> = join_all(requests)
        .await
        .into_iter()
        .map(|r| r.unwrap().0.status)
        .collect();
    for app in apps {
        app.stop().await;
    }

    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(
        env.post_reads().await - before,
        1,
        "the watchdog kept the lock: one load"
    );
}

/// The server's statement_timeout, not the client's LOAD_TIMEOUT (set far
/// above it here), ends a load that would wait for ever, and PostgreSQL
/// cancels the statement: no load of the service is left waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_statement_timeout_ends_a_load_that_would_run_for_ever() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&[
            "--db-statement-timeout",
            "300ms",
            "--load-timeout",
            "20s",
            "--lock-ttl",
            "25s",
            "--wait-timeout",
            "25s",
            "--failure-ttl",
            "0s",
        ])
        .await;
    let lock = TableLock::take(&env).await;

    let started = Instant::now();
    let reply = app.get("/posts/5").await;
    let took = started.elapsed();
    // Still under the lock: the statement is gone from the server.
    let waiting = postcache::testkit::blocked_loads(&env).await;
    lock.release().await;

    assert_eq!(reply.status, 503);
    assert!(!reply.error().is_empty());
    assert!(took < Duration::from_millis(1_500), "{took:?}");
    assert_eq!(waiting, 0, "the statement was cancelled by the server");
    assert_eq!(app.get("/posts/5").await.status, 200, "recovered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_postgres_cut_requests_get_503_fast_and_recover_without_a_restart() {
    let env = TestEnv::new(10).await;
    let (proxy, app) = env
        .spawn_proxied(&["--db-acquire-timeout", "300ms", "--failure-ttl", "0s"])
        .await;
    assert_eq!(app.get("/posts/1").await.status, 200);

    proxy.cut();
    let down = statuses(&app, 2..=6).await;
    proxy.restore();
    wait_until("a recovery", Duration::from_secs(10), async || {
        app.get("/posts/7").await.status == 200
    })
    .await;

    for (status, _, took) in &down {
        assert_eq!(*status, 503, "{down:?}");
        assert!(*took < Duration::from_millis(1_500), "{down:?}");
    }
    let ready = app.get("/readyz").await;
    assert_eq!(ready.json()["postgres"], "up");
}

/// The loads' pool pings only connections idle for a while, so one used
/// moments ago whose server process was ended meanwhile fails its statement:
/// the statement runs again on another connection (here both of the pool's
/// are gone, the third try opens one), and the read is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_whose_connections_were_ended_moments_ago_reads_again_on_another() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&["--db-max-connections", "2", "--failure-ttl", "30s"])
        .await;
    // Two statements at once: the pool opens both its connections.
    let lock = TableLock::take(&env).await;
    let mut first = Vec::new();
    for (id, blocked) in [(1, 1), (2, 2)] {
        first.push(app.http.spawn_get(&format!("/posts/{id}")));
        wait_until("a blocked load", A_WHILE, async || {
            postcache::testkit::blocked_loads(&env).await == blocked
        })
        .await;
    }
    lock.release().await;
    for request in first {
        assert_eq!(request.await.unwrap().0.status, 200);
    }
    let used = Instant::now();

    let ended: Vec<bool> = sqlx::query_scalar(
        "select pg_terminate_backend(pid) from pg_stat_activity
         where datname = $1 and application_name = 'postcache'",
    )
    .bind(&env.db_name)
    .fetch_all(&env.admin)
    .await
    .unwrap();
    assert_eq!(ended.len(), 2, "the loads' connections are in the pool");
    wait_until("the sessions to end", A_WHILE, async || {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pg_stat_activity
             where datname = $1 and application_name = 'postcache'",
        )
        .bind(&env.db_name)
        .fetch_one(&env.admin)
        .await
        .unwrap()
            == 0
    })
    .await;
    let after = app.get("/posts/3").await;

    // Past it the pool pings the connection first, and this would not
    // test the second attempt.
    assert!(
        used.elapsed() < postcache::store::PING_IDLE_AFTER,
        "the connection was idle for {:?}",
        used.elapsed()
    );
    assert_eq!(after.status, 200, "{:?}", after.body);
    assert_eq!(after.x_cache.as_deref(), Some("miss"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_concurrency_limit_requests_get_a_fast_503() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&[PATIENT, &["--max-in-flight", "10"]].concat())
        .await;
    let lock = TableLock::take(&env).await;
    let held = fire(std::slice::from_ref(&app), "/posts/8", 10);
    env.until_held(std::slice::from_ref(&app), 10).await;

    let started = Instant::now();
    let shed = join_all((0..20).map(|_| app.get("/posts/8"))).await;
    let took = started.elapsed();
    lock.release().await;

    assert!(shed
        .iter()
        .all(|r| r.status == 503 && !r.error().is_empty()));
    assert!(took < Duration::from_millis(500), "{took:?}");
    assert!(join_all(held)
        .await
        .into_iter()
        .all(|r| r.unwrap().0.status == 200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_past_request_timeout_gets_503_and_its_load_still_lands() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&[PATIENT, &["--request-timeout", "300ms"]].concat())
        .await;
    let lock = TableLock::take(&env).await;

    let started = Instant::now();
    let late = app.get("/posts/6").await;
    let took = started.elapsed();
    lock.release().await;

    assert_eq!(late.status, 503, "{}", late.text());
    assert_eq!(late.error(), "the request took too long");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
    // The flight was not the request's: it finished and stored the post
    // (in Redis, not only in the memory tier).
    wait_until("the load to land", Duration::from_secs(10), async || {
        app.get("/posts/6").await.x_cache.as_deref() == Some("hit")
    })
    .await;
    assert!(env.stored(6).await.is_some(), "stored in Redis");
}

/// Sends a raw HTTP/1.1 request and returns the status code (0 if the
/// server closed the connection without one); fails the test if no answer
/// comes within 10 s.
async fn raw_status(app: &TestApp, request: String) -> u16 {
    tokio::time::timeout(Duration::from_secs(10), send_raw(app, request))
        .await
        .expect("an answer or a closed connection")
}

async fn send_raw(app: &TestApp, request: String) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(app.http.base.trim_start_matches("http://"))
        .await
        .unwrap();
    // The server may answer before reading everything: ignore write errors.
    let _ = stream.write_all(request.as_bytes()).await;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(2).any(|w| w == b"\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&head)
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn oversized_paths_get_414_and_oversized_headers_431() {
    let env = TestEnv::new(1).await;
    let app = env.spawn(&[]).await;

    let long_path = raw_status(
        &app,
        format!(
            "GET /posts/{} HTTP/1.1\r\nhost: x\r\n\r\n",
            "9".repeat(100_000)
        ),
    )
    .await;
    let long_header = raw_status(
        &app,
        format!(
            "GET /posts/1 HTTP/1.1\r\nhost: x\r\nx-filler: {}\r\n\r\n",
            "a".repeat(1_000_000)
        ),
    )
    .await;
    let many_headers = raw_status(
        &app,
        format!(
            "GET /posts/1 HTTP/1.1\r\nhost: x\r\n{}\r\n",
            "x-h: 1\r\n".repeat(500)
        ),
    )
    .await;

    assert_eq!(
        [long_path, long_header, many_headers],
        [414, 431, 431],
        "a path past the server's limit is 414, headers past them 431"
    );
    assert_eq!(app.get("/posts/1").await.status, 200, "still serving");
}

/// What a leader's finish does, from outside: stores `entry` as post `id`'s
/// value, then publishes it framed under `fence` (cache/message.rs).
async fn store_and_publish(env: &TestEnv, id: i64, entry: &Entry, fence: &[u8]) {
    env.set(
        &env.keys.value(id),
        entry.raw().clone(),
        Duration::from_secs(60),
    )
    .await;
    let _: () = env
        .redis
        .publish(env.keys.channel(id), message::framed(fence, entry.raw()))
        .await
        .unwrap();
}

/// A ready message is judged by the fence it was published under, never
/// by comparing clocks. Here a leader elsewhere, whose clock is 10 s ahead,
/// published the old row just before a change that the waiter's look saw
/// (the fence), and the message reaches the waiter after its look (a
/// subscription dispatched late): it looks again instead of serving the
/// old row. Compared by store time, as it was, the message looked newer
/// than the look and was served.
#[tokio::test]
async fn a_ready_message_published_before_a_change_the_look_saw_is_not_served() {
    let env = TestEnv::new(10).await;
    env.claim(2, "outsider", Duration::from_secs(10)).await;
    // The change, applied before the waiter looks: its fence.
    env.set(&env.keys.fence(2), "200", Duration::from_secs(60))
        .await;
    let app = env.spawn(&["--wait-timeout", "5s"]).await;
    let pending = app.http.spawn_get("/posts/2");
    let channel = env.keys.channel(2);
    wait_until("the subscription", A_WHILE, async || {
        env.numsub(&channel).await > 0
    })
    .await;
    // The look after the subscription is done once the waiter sleeps.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let ahead = postcache::cache::now_millis() + 10_000;
    let old = Entry::stamped(
        Status::Found,
        br#"{"id":2,"title":"old"}"#,
        ahead,
        ahead + 60_000,
        Duration::ZERO,
    );
    let _: () = env
        .redis
        .publish(&channel, message::framed(b"100", old.raw()))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !pending.is_finished(),
        "answered by the message from before the change"
    );

    // The leader after the change: stored under the fence the look saw.
    let new = Entry::new(
        Status::Found,
        br#"{"id":2,"title":"new"}"#,
        Duration::from_secs(60),
        Duration::ZERO,
    );
    store_and_publish(&env, 2, &new, b"200").await;
    let (reply, _) = pending.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(&reply.body[..], br#"{"id":2,"title":"new"}"#);
}

#[tokio::test]
async fn garbage_on_a_ready_channel_is_ignored_and_the_waiter_still_answers() {
    let env = TestEnv::new(10).await;
    env.claim(2, "outsider", Duration::from_secs(10)).await;
    let app = env.spawn(&["--wait-timeout", "5s"]).await;
    let pending = app.http.spawn_get("/posts/2");
    let channel = env.keys.channel(2);
    wait_until("the subscription", A_WHILE, async || {
        env.numsub(&channel).await > 0
    })
    .await;
    let counted = async || {
        app.get("/metrics")
            .await
            .text()
            .lines()
            .find_map(|l| l.strip_prefix(r#"postcache_garbage_total{kind="message"} "#))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    let garbage_before = counted().await;

    for garbage in [&b"garbage"[..], b"", &[1u8; 40]] {
        let _: () = env.redis.publish(&channel, garbage).await.unwrap();
    }
    // Counted (the recorder is shared by this binary's tests: at least
    // ours), and the waiter still waiting.
    wait_until("the garbage counted", A_WHILE, async || {
        counted().await - garbage_before >= 3.0
    })
    .await;
    assert!(!pending.is_finished(), "answered by garbage");
    // Then what a leader's finish does: store, then publish.
    let entry = Entry::new(
        Status::Found,
        br#"{"id":2}"#,
        Duration::from_secs(60),
        Duration::ZERO,
    );
    let published = Instant::now();
    // Under the item's fence: none.
    store_and_publish(&env, 2, &entry, b"").await;
    let (reply, _) = pending.await.unwrap();
    // Woken by the message, not by the lock's expiry (10 s) or the wait's
    // deadline (5 s, a 504).
    assert!(
        published.elapsed() < Duration::from_secs(2),
        "answered {:?} after the message",
        published.elapsed()
    );

    assert_eq!(
        (reply.status, reply.x_cache.as_deref()),
        (200, Some("coalesced"))
    );
    assert_eq!(&reply.body[..], br#"{"id":2}"#);
}

/// The network to PostgreSQL stalls (the host gone silent: connections
/// open, no byte passes) while many keys with fail-safe copies are read at
/// once, twenty times as many as the pool has connections: every read is
/// its copy, stale, none a 503. The loads time out on connections that are
/// all taken, by statements that hang: that is the database failing, not
/// the instance busy (whose 503 would serve no copy).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_database_stalled_a_storm_over_many_keys_is_served_from_their_copies() {
    let env = TestEnv::new(40).await;
    let (proxy, app) = env
        .spawn_proxied(&fresh_for(
            "300ms",
            &[
                "--max-stale",
                "1h",
                "--failure-ttl",
                "2s",
                "--db-max-connections",
                "2",
                "--db-acquire-timeout",
                "300ms",
                "--l1-max-bytes",
                "0",
            ],
        ))
        .await;
    for id in 1..=40 {
        assert_eq!(app.get(&format!("/posts/{id}")).await.status, 200);
    }
    tokio::time::sleep(Duration::from_millis(400)).await;

    proxy.stall(true);
    let storm: Vec<_> = (1..=40)
        .map(|id| app.http.spawn_get(&format!("/posts/{id}")))
        .collect();
    let mut answers = Vec::new();
    for (id, request) in (1..=40).zip(storm) {
        let (reply, _) = request.await.unwrap();
        answers.push((
            id,
            reply.status,
            reply.x_cache.clone().unwrap_or_default(),
            reply.text(),
        ));
    }
    proxy.stall(false);

    let not_copies: Vec<_> = answers
        .iter()
        .filter(|(_, status, x_cache, _)| (*status, x_cache.as_str()) != (200, "stale"))
        .collect();
    assert!(not_copies.is_empty(), "{not_copies:?}");
}
