//! Faults caused for real: Redis killed, paused and restarted, a leader
//! process killed, a slow leader, PostgreSQL cut or exhausted, shutdown,
//! overload, bad input and secrets.

mod support;

use std::time::{Duration, Instant};

use fred::prelude::*;
use futures::future::join_all;
use support::{
    blocked_loads,
    faults::{free_port, RedisServer, ServiceProcess, TcpProxy},
    scenarios::fire,
    TableLock, TestApp, TestEnv,
};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_down_at_start_requests_bypass_and_caching_resumes_when_it_returns() {
    let mut redis = RedisServer::reserve();
    let env = TestEnv::with_redis_lazy(20, redis.url()).await;
    let app = env.spawn(&["--redis-timeout", "100ms"]).await;

    let down = statuses(&app, 1..=10).await;
    redis.restart();
    let mut resumed = false;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !resumed {
        assert!(Instant::now() < deadline, "caching did not resume");
        tokio::time::sleep(Duration::from_millis(100)).await;
        resumed = app.get("/posts/11").await.x_cache.as_deref() != Some("bypass");
    }
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_redis_dies_mid_traffic_requests_fail_open_and_pubsub_resumes_after_restart() {
    let mut redis = RedisServer::start();
    let env = TestEnv::with_redis(20, redis.url()).await;
    let flags = [
        "--redis-timeout",
        "200ms",
        "--wait-timeout",
        "10s",
        "--lock-ttl",
        "15s",
        "--db-statement-timeout",
        "10s",
    ];
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;
    assert_eq!(
        apps[0].get("/posts/1").await.x_cache.as_deref(),
        Some("miss")
    );

    redis.kill();
    let down = statuses(&apps[0], 1..=8).await;
    redis.restart();
    // Wait for both instances to be back on Redis.
    for app in &apps {
        let deadline = Instant::now() + Duration::from_secs(10);
        while app.get("/posts/20").await.x_cache.as_deref() == Some("bypass") {
            assert!(Instant::now() < deadline, "caching did not resume");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // The shared subscription works again: a cross-instance stampede coalesces.
    let lock = TableLock::take(&env).await;
    let requests: Vec<_> = (0..40)
        .map(|i| {
            let app = &apps[i % 2];
            let (http, url) = (app.http.clone(), format!("{}/posts/9", app.base));
            tokio::spawn(async move {
                let r = http.get(url).send().await.unwrap();
                (
                    r.status().as_u16(),
                    r.headers()["x-cache"].to_str().unwrap().to_owned(),
                )
            })
        })
        .collect();
    wait_while!(
        "requests to arrive and the leader to block",
        apps.iter().map(TestApp::reads_in_progress).sum::<usize>() < 40
            || blocked_loads(&env).await < 1
    );
    lock.release().await;
    let stampede: Vec<_> = join_all(requests)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();

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
    let redis = RedisServer::start();
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

/// A leader in a process of its own, held inside its load of post `id` by a
/// table lock, and `n` requests waiting for it on an in-process instance.
struct HeldLeader {
    leader: ServiceProcess,
    waiter: TestApp,
    lock: TableLock,
    leader_request: tokio::task::JoinHandle<Result<u16, reqwest::Error>>,
    waiting: Vec<tokio::task::JoinHandle<(support::Reply, Instant)>>,
}

async fn held_leader(
    env: &TestEnv,
    id: i64,
    lock_ttl: &str,
    statement_timeout: &str,
    n: usize,
) -> HeldLeader {
    let leader = ServiceProcess::start(&[
        ("DATABASE_URL", env.db_url.clone()),
        ("KEY_PREFIX", env.prefix.clone()),
        ("NO_MIGRATE", "true".into()),
        ("LOCK_TTL", lock_ttl.into()),
        ("DB_STATEMENT_TIMEOUT", statement_timeout.into()),
    ])
    .await;
    let waiter = env
        .spawn(&[
            "--wait-timeout",
            "15s",
            "--lock-ttl",
            lock_ttl,
            "--db-statement-timeout",
            statement_timeout,
        ])
        .await;
    let lock = TableLock::take(env).await;
    let leader_request = tokio::spawn({
        let url = format!("{}/posts/{id}", leader.base);
        async move { reqwest::get(url).await.map(|r| r.status().as_u16()) }
    });
    wait_while!("the leader to block", blocked_loads(env).await < 1);
    let waiting = fire(std::slice::from_ref(&waiter), &format!("/posts/{id}"), n);
    wait_while!("the waiters to arrive", waiter.reads_in_progress() < n);
    HeldLeader {
        leader,
        waiter,
        lock,
        leader_request,
        waiting,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_leader_is_replaced_after_its_lock_expires_with_exactly_one_more_load() {
    let env = TestEnv::new(10).await;
    let before = env.post_reads().await;
    let HeldLeader {
        leader,
        waiter,
        lock,
        leader_request,
        waiting,
    } = held_leader(&env, 3, "1s", "900ms", 20).await;

    leader.signal("KILL");
    let killed = Instant::now();
    // The dead leader's query is cancelled by PostgreSQL (the client is gone).
    let deadline = Instant::now() + Duration::from_secs(10);
    while blocked_loads(&env).await > 0 {
        assert!(
            Instant::now() < deadline,
            "the dead leader's query kept running"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    lock.release().await;
    let answered: Vec<_> = join_all(waiting)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(
        leader_request.await.unwrap().is_err(),
        "the killed leader answered"
    );
    waiter.stop().await;

    assert!(answered.iter().all(|(r, _)| r.status == 200));
    let slowest = answered.iter().map(|(_, at)| *at - killed).max().unwrap();
    // LOCK_TTL (1 s) + one load + margin; the cancellation wait is inside it.
    assert!(
        slowest < Duration::from_millis(3_500),
        "answered {slowest:?} after the kill"
    );
    assert_eq!(env.post_reads().await - before, 1, "exactly one more load");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_but_live_leader_keeps_its_lock_and_is_not_duplicated() {
    let env = TestEnv::new(10).await;
    let before = env.post_reads().await;
    let flags = [
        "--lock-ttl",
        "300ms",
        "--db-statement-timeout",
        "5s",
        "--wait-timeout",
        "10s",
        "--redis-timeout",
        "2s",
    ];
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;
    let lock = TableLock::take(&env).await;
    let requests = fire(&apps, "/posts/4", 20);
    // The load lasts 1.2 s: four lock lifetimes.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    lock.release().await;
    let statuses: Vec<u16> = join_all(requests)
        .await
        .into_iter()
        .map(|r| r.unwrap().0.status)
        .collect();
    for app in apps {
        app.stop().await;
    }

    assert!(statuses.iter().all(|s| *s == 200));
    assert_eq!(
        env.post_reads().await - before,
        1,
        "the watchdog kept the lock: one load"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_statement_timeout_ends_a_load_that_would_run_for_ever() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&["--db-statement-timeout", "300ms", "--failure-ttl", "0s"])
        .await;
    let lock = TableLock::take(&env).await;

    let started = Instant::now();
    let reply = app.get("/posts/5").await;
    let took = started.elapsed();
    lock.release().await;

    assert_eq!(reply.status, 503);
    assert!(!reply.error().is_empty());
    assert!(took < Duration::from_millis(1_500), "{took:?}");
    assert_eq!(app.get("/posts/5").await.status, 200, "recovered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_postgres_cut_requests_get_503_fast_and_recover_without_a_restart() {
    let env = TestEnv::new(10).await;
    let pg_port: u16 = support::server_url()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let proxy = TcpProxy::start(([127, 0, 0, 1], pg_port).into()).await;
    let url = format!("postgres://postgres@{}/{}", proxy.addr, env.db_name);
    let app = env
        .spawn(&[
            "--database-url",
            &url,
            "--db-acquire-timeout",
            "300ms",
            "--failure-ttl",
            "0s",
        ])
        .await;
    assert_eq!(app.get("/posts/1").await.status, 200);

    proxy.cut();
    let down = statuses(&app, 2..=6).await;
    proxy.restore();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if app.get("/posts/7").await.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "did not recover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    for (status, _, took) in &down {
        assert_eq!(*status, 503, "{down:?}");
        assert!(*took < Duration::from_millis(1_500), "{down:?}");
    }
    let ready = app.get("/readyz").await;
    assert_eq!(ready.json()["postgres"], "up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exhausted_pool_answers_503_after_the_acquire_timeout() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&[
            "--db-max-connections",
            "1",
            "--db-acquire-timeout",
            "200ms",
            "--failure-ttl",
            "0s",
            "--db-statement-timeout",
            "5s",
        ])
        .await;
    let lock = TableLock::take(&env).await;
    let holder = {
        let (http, url) = (app.http.clone(), format!("{}/posts/1", app.base));
        tokio::spawn(async move { http.get(url).send().await.unwrap().status().as_u16() })
    };
    wait_while!(
        "requests to arrive and the leader to block",
        blocked_loads(&env).await < 1
    );

    let others = statuses(&app, 2..=4).await;
    lock.release().await;

    assert_eq!(holder.await.unwrap(), 200);
    for (status, _, took) in &others {
        assert_eq!(*status, 503);
        assert!(*took < Duration::from_millis(800), "{others:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_lets_a_leader_finish_and_publish_so_remote_waiters_answer_promptly() {
    let env = TestEnv::new(10).await;
    let HeldLeader {
        mut leader,
        waiter: _waiter,
        lock,
        leader_request,
        waiting,
    } = held_leader(&env, 6, "20s", "10s", 10).await;

    leader.signal("TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = lock.release().await;
    let answered = join_all(waiting).await;
    let took = released.elapsed();

    assert_eq!(
        leader_request.await.unwrap().unwrap(),
        200,
        "the in-flight request finished"
    );
    assert!(answered.iter().all(|r| r.as_ref().unwrap().0.status == 200));
    assert!(
        took < Duration::from_secs(2),
        "waiters answered {took:?} after the release"
    );
    assert!(
        leader.wait(Duration::from_secs(10)),
        "the leader did not exit"
    );
    assert_eq!(env.pttl(&env.keys.lock(6)).await, -2, "no lock left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_concurrency_limit_requests_get_a_fast_503() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&[
            "--max-in-flight",
            "10",
            "--wait-timeout",
            "10s",
            "--lock-ttl",
            "15s",
            "--db-statement-timeout",
            "10s",
        ])
        .await;
    let lock = TableLock::take(&env).await;
    let held: Vec<_> = (0..10)
        .map(|_| {
            let (http, url) = (app.http.clone(), format!("{}/posts/8", app.base));
            tokio::spawn(async move { http.get(url).send().await.unwrap().status().as_u16() })
        })
        .collect();
    wait_while!(
        "requests to arrive and the leader to block",
        app.reads_in_progress() < 10
    );

    let started = Instant::now();
    let shed = join_all((0..20).map(|_| app.get("/posts/8"))).await;
    let took = started.elapsed();
    lock.release().await;

    assert!(shed
        .iter()
        .all(|r| r.status == 503 && !r.error().is_empty()));
    assert!(took < Duration::from_millis(500), "{took:?}");
    assert!(join_all(held).await.into_iter().all(|s| s.unwrap() == 200));
}

/// Sends a raw HTTP/1.1 request and returns the status code (0 if the
/// server closed the connection without one).
async fn raw_status(base: &str, request: String) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(base.trim_start_matches("http://"))
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
async fn oversized_paths_and_headers_get_a_4xx() {
    let env = TestEnv::new(1).await;
    let app = env.spawn(&[]).await;

    let long_path = raw_status(
        &app.base,
        format!(
            "GET /posts/{} HTTP/1.1\r\nhost: x\r\n\r\n",
            "9".repeat(100_000)
        ),
    )
    .await;
    let long_header = raw_status(
        &app.base,
        format!(
            "GET /posts/1 HTTP/1.1\r\nhost: x\r\nx-filler: {}\r\n\r\n",
            "a".repeat(1_000_000)
        ),
    )
    .await;
    let many_headers = raw_status(
        &app.base,
        format!(
            "GET /posts/1 HTTP/1.1\r\nhost: x\r\n{}\r\n",
            "x-h: 1\r\n".repeat(500)
        ),
    )
    .await;

    for status in [long_path, long_header, many_headers] {
        assert!((400..500).contains(&status), "got {status}");
    }
    assert_eq!(app.get("/posts/1").await.status, 200, "still serving");
}

#[tokio::test]
async fn garbage_on_a_ready_channel_is_ignored_and_the_waiter_still_answers() {
    let env = TestEnv::new(10).await;
    let _: () = env
        .redis
        .set(
            env.keys.lock(2),
            "outsider",
            Some(Expiration::PX(10_000)),
            None,
            false,
        )
        .await
        .unwrap();
    let app = env.spawn(&["--wait-timeout", "5s"]).await;
    let pending = {
        let (http, url) = (app.http.clone(), format!("{}/posts/2", app.base));
        tokio::spawn(async move {
            let r = http.get(url).send().await.unwrap();
            (
                r.status().as_u16(),
                r.headers()["x-cache"].to_str().unwrap().to_owned(),
                r.bytes().await.unwrap(),
            )
        })
    };
    let channel = env.keys.channel(2);
    wait_while!("the subscription", env.numsub(&channel).await == 0);
    let counted = || async {
        let text = app.get("/metrics").await.body;
        String::from_utf8_lossy(&text)
            .lines()
            .find_map(|l| l.strip_prefix(r#"postcache_garbage_total{kind="message"} "#))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    let garbage_before = counted().await;

    for garbage in [&b"garbage"[..], b"", &[1u8; 40]] {
        let _: () = env.redis.publish(&channel, garbage).await.unwrap();
    }
    let entry = postcache::cache::Entry::new(
        postcache::cache::Status::Found,
        br#"{"id":2}"#,
        Duration::from_secs(60),
        Duration::ZERO,
    );
    let _: () = env
        .redis
        .publish(&channel, entry.raw().clone())
        .await
        .unwrap();
    let (status, x_cache, body) = pending.await.unwrap();

    assert_eq!((status, x_cache.as_str()), (200, "coalesced"));
    assert_eq!(&body[..], br#"{"id":2}"#);
    // Counted (the recorder is shared by this binary's tests: at least ours).
    assert!(
        counted().await - garbage_before >= 3.0,
        "garbage not counted"
    );
}

#[tokio::test]
async fn passwords_in_the_urls_never_reach_logs_or_responses() {
    let closed = free_port();
    let secret_db = "pg-Secret-4711";
    let secret_redis = "redis-Secret-0815";
    let service = ServiceProcess::start(&[
        (
            "DATABASE_URL",
            format!("postgres://postgres:{secret_db}@127.0.0.1:{closed}/x"),
        ),
        (
            "REDIS_URL",
            format!("redis://:{secret_redis}@127.0.0.1:{closed}"),
        ),
        ("NO_MIGRATE", "true".into()),
        ("REDIS_TIMEOUT", "100ms".into()),
        ("DB_ACQUIRE_TIMEOUT", "200ms".into()),
        ("RUST_LOG", "debug".into()),
    ])
    .await;
    let http = reqwest::Client::new();
    let mut bodies = String::new();
    for path in ["/posts/1", "/posts/2", "/readyz", "/metrics"] {
        let r = http
            .get(format!("{}{path}", service.base))
            .send()
            .await
            .unwrap();
        bodies.push_str(&r.text().await.unwrap());
    }
    let migrate = std::process::Command::new(env!("CARGO_BIN_EXE_postcache"))
        .arg("migrate")
        .env(
            "DATABASE_URL",
            format!("postgres://postgres:{secret_db}@127.0.0.1:{closed}/x"),
        )
        .output()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let logs = service.logs()
        + &String::from_utf8_lossy(&migrate.stderr)
        + &String::from_utf8_lossy(&migrate.stdout);

    assert!(!migrate.status.success());
    assert!(
        logs.contains("WARN") || logs.contains("ERROR"),
        "the failures were logged: {logs}"
    );
    for secret in [secret_db, secret_redis] {
        assert!(!logs.contains(secret), "secret in logs:\n{logs}");
        assert!(!bodies.contains(secret), "secret in a response");
    }
}

#[tokio::test]
async fn postgres_over_tls_with_sslmode_require() {
    let env = TestEnv::new(3).await;
    let ssl: String = sqlx::query_scalar("show ssl")
        .fetch_one(&env.admin)
        .await
        .unwrap();
    if ssl != "on" {
        eprintln!("PostgreSQL has ssl off here: TLS not exercised");
        return;
    }
    let url = format!("{}?sslmode=require", env.db_url);
    let app = env.spawn(&["--database-url", &url]).await;

    assert_eq!(app.get("/posts/2").await.status, 200);
    let on_tls: i64 = sqlx::query_scalar(
        "select count(*) from pg_stat_ssl s join pg_stat_activity a using (pid)
         where s.ssl and a.application_name = 'postcache' and a.datname = current_database()",
    )
    .fetch_one(&env.admin)
    .await
    .unwrap();
    assert!(on_tls >= 1, "the service's connection is not encrypted");
}

#[tokio::test]
async fn redis_over_tls_with_a_rediss_url() {
    use std::process::Command;
    let dir = std::env::temp_dir().join(format!("postcache-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sh = |script: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .current_dir(&dir)
            .status()
    };
    // A throwaway CA and a server certificate for localhost.
    let made = sh("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 -subj '/CN=postcache test CA' \
         && openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj '/CN=localhost' \
         && printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\nbasicConstraints=CA:FALSE\\n' > ext.cnf \
         && openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 -extfile ext.cnf");
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("openssl unavailable: TLS to Redis not exercised");
        return;
    }
    let port = free_port();
    let mut redis = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args([
            "--tls-cert-file",
            "server.pem",
            "--tls-key-file",
            "server.key",
            "--tls-ca-cert-file",
            "ca.pem",
        ])
        .args([
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .current_dir(&dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let env = TestEnv::new(3).await;
    let service = ServiceProcess::start(&[
        ("DATABASE_URL", env.db_url.clone()),
        ("REDIS_URL", format!("rediss://localhost:{port}")),
        ("KEY_PREFIX", env.prefix.clone()),
        ("NO_MIGRATE", "true".into()),
        // The throwaway CA, trusted through the standard variable.
        (
            "SSL_CERT_FILE",
            dir.join("ca.pem").to_string_lossy().into_owned(),
        ),
    ])
    .await;
    let http = reqwest::Client::new();
    let get = |path: &str| http.get(format!("{}{path}", service.base)).send();

    let ready = get("/readyz").await.unwrap().text().await.unwrap();
    let first = get("/posts/2").await.unwrap();
    let second = get("/posts/2").await.unwrap();
    let _ = redis.kill();
    let _ = redis.wait();
    let _ = std::fs::remove_dir_all(&dir);

    assert!(ready.contains(r#""redis":"up""#), "{ready}");
    assert_eq!(first.headers()["x-cache"], "miss");
    assert_eq!(second.headers()["x-cache"], "hit", "cached over TLS");
}

#[tokio::test]
async fn json_logs_carry_the_request_span_with_its_id_and_outcome() {
    let env = TestEnv::new(3).await;
    let service = ServiceProcess::start(&[
        ("DATABASE_URL", env.db_url.clone()),
        ("KEY_PREFIX", env.prefix.clone()),
        ("NO_MIGRATE", "true".into()),
        ("LOG_FORMAT", "json".into()),
        ("RUST_LOG", "postcache=debug".into()),
    ])
    .await;
    let reply = reqwest::get(format!("{}/posts/2", service.base))
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
    tokio::time::sleep(Duration::from_millis(200)).await;

    let logs = service.logs();
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    // The leader's load is logged at debug inside the request's span.
    let load = lines
        .iter()
        .find(|l| l["message"] == "loaded")
        .unwrap_or_else(|| panic!("no load logged:\n{logs}"));
    let spans = load["spans"]
        .as_array()
        .unwrap_or_else(|| panic!("no span list: {load}"));
    assert!(
        spans
            .iter()
            .any(|s| s["name"] == "get_post" && s["id"] == 2),
        "the request span with its id: {load}"
    );
    assert!(load["took_ms"].is_number(), "{load}");
}

#[tokio::test]
async fn sigterm_ends_the_process_even_while_redis_is_down() {
    let env = TestEnv::new(3).await;
    let mut service = ServiceProcess::start(&[
        ("DATABASE_URL", env.db_url.clone()),
        ("REDIS_URL", format!("redis://127.0.0.1:{}", free_port())),
        ("KEY_PREFIX", env.prefix.clone()),
        ("NO_MIGRATE", "true".into()),
        ("REDIS_TIMEOUT", "100ms".into()),
    ])
    .await;
    let reply = reqwest::get(format!("{}/posts/1", service.base))
        .await
        .unwrap();
    assert_eq!(reply.headers()["x-cache"], "bypass");

    service.signal("TERM");

    assert!(
        service.wait(Duration::from_secs(8)),
        "the process did not exit: {}",
        service.logs()
    );
}
