//! `postcache serve` as a process of its own: leaders killed or stopped
//! mid-load, secrets, TLS to both backends, JSON logs, shutdown.

use std::time::{Duration, Instant};

use postcache::testkit::{
    answered, available, blocked_loads, fire, free_port, wait_until, Http, RedisServer, Reply,
    ServiceProcess, TableLock, TestApp, TestEnv, A_WHILE,
};

/// A leader in a process of its own, held inside its load of post `id` by a
/// table lock, and `n` requests waiting for it on an in-process instance.
struct HeldLeader {
    leader: ServiceProcess,
    waiter: TestApp,
    lock: TableLock,
    leader_request: tokio::task::JoinHandle<Result<Reply, reqwest::Error>>,
    waiting: Vec<tokio::task::JoinHandle<(Reply, Instant)>>,
}

async fn held_leader(
    env: &TestEnv,
    id: i64,
    lock_ttl: &str,
    statement_timeout: &str,
    n: usize,
) -> HeldLeader {
    let leader = env
        .start_process(&[
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
        let (http, path) = (leader.http.clone(), format!("/posts/{id}"));
        async move { http.send(reqwest::Method::GET, &path, &[]).await }
    });
    wait_until("the leader to block", A_WHILE, async || {
        blocked_loads(env).await >= 1
    })
    .await;
    let waiting = fire(std::slice::from_ref(&waiter), &format!("/posts/{id}"), n);
    env.until_held(std::slice::from_ref(&waiter), n).await;
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
    wait_until(
        "the dead leader's query to end",
        Duration::from_secs(10),
        async || blocked_loads(&env).await == 0,
    )
    .await;
    lock.release().await;
    let replies: Vec<_> = answered(waiting).await;
    assert!(
        leader_request.await.unwrap().is_err(),
        "the killed leader answered"
    );
    waiter.stop().await;

    assert!(replies.iter().all(|(r, _)| r.status == 200));
    let slowest = replies.iter().map(|(_, at)| *at - killed).max().unwrap();
    // LOCK_TTL (1 s) + one load + margin; the cancellation wait is inside it.
    assert!(
        slowest < Duration::from_millis(3_500),
        "answered {slowest:?} after the kill"
    );
    assert_eq!(env.post_reads().await - before, 1, "exactly one more load");
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
    let replies = answered(waiting).await;
    let took = released.elapsed();

    assert_eq!(
        leader_request.await.unwrap().unwrap().status,
        200,
        "the in-flight request finished"
    );
    assert!(replies.iter().all(|(r, _)| r.status == 200));
    assert!(
        took < Duration::from_secs(2),
        "waiters answered {took:?} after the release"
    );
    assert!(
        leader.exits_within(Duration::from_secs(10)).await,
        "the leader did not exit"
    );
    assert!(!env.lock_held(6).await, "no lock left behind");
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
    let mut bodies = String::new();
    for path in ["/posts/1", "/posts/2", "/readyz", "/metrics"] {
        bodies.push_str(&service.http.get(path).await.text());
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

/// A world of 3 posts, where the PostgreSQL server has ssl on; `None`
/// where it is off (the test is skipped).
async fn on_a_server_with_ssl() -> Option<TestEnv> {
    let env = TestEnv::new(3).await;
    let ssl: String = sqlx::query_scalar("show ssl")
        .fetch_one(&env.admin)
        .await
        .unwrap();
    available("PostgreSQL with ssl on", ssl == "on").then_some(env)
}

/// The service's connections to `env`'s database that are encrypted.
async fn encrypted_connections(env: &TestEnv) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_stat_ssl s join pg_stat_activity a using (pid)
         where s.ssl and a.application_name = 'postcache' and a.datname = current_database()",
    )
    .fetch_one(&env.admin)
    .await
    .unwrap()
}

#[tokio::test]
async fn postgres_over_tls_with_sslmode_require() {
    let Some(env) = on_a_server_with_ssl().await else {
        return;
    };
    let url = format!("{}?sslmode=require", env.db_url);
    let app = env.spawn(&["--database-url", &url]).await;

    assert_eq!(app.get("/posts/2").await.status, 200);
    let on_tls = encrypted_connections(&env).await;
    assert!(on_tls >= 1, "the service's connection is not encrypted");
}

/// The server's certificate, when it names itself as its issuer (so that it
/// can be its own root) and names `localhost`; `None` otherwise.
async fn self_signed_server_cert(env: &TestEnv) -> Option<String> {
    let path: String = sqlx::query_scalar("show ssl_cert_file")
        .fetch_one(&env.admin)
        .await
        .ok()?;
    let out = std::process::Command::new("openssl")
        .args([
            "x509",
            "-noout",
            "-subject",
            "-issuer",
            "-ext",
            "subjectAltName",
            "-in",
        ])
        .arg(&path)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim_start_matches(['=', ' ']).to_owned())
    };
    let self_signed = field("subject").is_some() && field("subject") == field("issuer");
    (out.status.success() && self_signed && text.contains("DNS:localhost")).then_some(path)
}

/// `sslmode=verify-full` with `sslrootcert`: the service trusts the server
/// only through the root it is given, and checks the name it connects to.
/// With another root, it refuses to start, naming the certificate.
#[tokio::test]
async fn postgres_over_tls_with_verify_full_and_a_root_certificate() {
    let Some(env) = on_a_server_with_ssl().await else {
        return;
    };
    let root = self_signed_server_cert(&env).await;
    if !available(
        "a self-signed server certificate naming localhost",
        root.is_some(),
    ) {
        return;
    }
    let root = root.expect("available");
    let port = postcache::testkit::postgres_port();
    let url = |root: &str| {
        format!(
            "postgres://postgres@localhost:{port}/{}?sslmode=verify-full&sslrootcert={root}",
            env.db_name
        )
    };
    let app = env.spawn(&["--database-url", &url(&root)]).await;
    assert_eq!(app.get("/posts/2").await.status, 200);
    let on_tls = encrypted_connections(&env).await;
    assert!(on_tls >= 1, "the service's connection is not encrypted");

    // Another root: a CA of its own, which signed nothing the server has.
    let dir = std::env::temp_dir().join(format!("postcache-other-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let made = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args([
            "-subj",
            "/CN=another CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(made.status.success(), "openssl failed");
    let other = dir.join("ca.pem").to_string_lossy().into_owned();
    // Its migrations at start reach PostgreSQL first: refused there.
    let refused = ServiceProcess::refused(
        &[
            ("DATABASE_URL", url(&other)),
            ("REDIS_URL", env.redis_url.clone()),
            ("KEY_PREFIX", env.prefix.clone()),
        ],
        Duration::from_secs(30),
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    let (status, output) = refused.expect("the service refused to start");
    assert!(!status.success(), "{output}");
    assert!(
        output.to_lowercase().contains("certificate"),
        "the refusal names the certificate: {output}"
    );
}

/// SIGTERM while a background refresh (stale-while-revalidate) is loading:
/// the process waits for it, so the refreshed post is stored before it
/// exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_drains_a_background_refresh() {
    let env = TestEnv::new(10).await;
    let mut service = env
        .start_process(&[
            ("CHANGE_FEED", "off".to_owned()),
            ("CACHE_TTL", "1s".to_owned()),
            ("TTL_JITTER", "0".to_owned()),
            ("STALE_WHILE_REVALIDATE", "60s".to_owned()),
            ("DB_STATEMENT_TIMEOUT", "20s".to_owned()),
            ("LOCK_TTL", "25s".to_owned()),
        ])
        .await;
    assert_eq!(service.http.get("/posts/4").await.status, 200);
    env.retitle(4, "refreshed").await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let lock = TableLock::take(&env).await;

    let stale = service.http.get("/posts/4").await;
    wait_until("the refresh to block", A_WHILE, async || {
        blocked_loads(&env).await >= 1
    })
    .await;
    service.signal("TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    lock.release().await;
    let exited = service.exits_within(Duration::from_secs(15)).await;

    assert_eq!(stale.x_cache.as_deref(), Some("stale"));
    assert!(exited, "the process did not exit");
    let post = env.stored_post(4).await.expect("an entry stored");
    assert_eq!(
        post["title"], "refreshed",
        "the refresh landed before the exit"
    );
}

#[tokio::test]
async fn redis_over_tls_with_a_rediss_url() {
    let redis = RedisServer::start_tls().await;
    if !available("openssl", redis.is_some()) {
        return;
    }
    let redis = redis.expect("available");
    let env = TestEnv::new(3).await;
    let service = env
        .start_process(&[
            ("REDIS_URL", redis.url()),
            // The throwaway CA, trusted through the standard variable.
            ("SSL_CERT_FILE", redis.ca().to_string_lossy().into_owned()),
            // The hit read from Redis, over TLS.
            ("L1_MAX_BYTES", "0".to_owned()),
        ])
        .await;

    let ready = service.http.get("/readyz").await;
    let first = service.http.get("/posts/2").await;
    let second = service.http.get("/posts/2").await;

    assert_eq!(ready.json()["redis"], "up", "{}", ready.text());
    assert_eq!(first.x_cache.as_deref(), Some("miss"));
    assert_eq!(
        (second.x_cache.as_deref(), second.tier()),
        (Some("hit"), Some("redis")),
        "cached over TLS"
    );
}

#[tokio::test]
async fn json_logs_carry_the_request_span_with_its_id_and_outcome() {
    let env = TestEnv::new(3).await;
    let service = env
        .start_process(&[
            ("LOG_FORMAT", "json".into()),
            ("RUST_LOG", "postcache=debug".into()),
        ])
        .await;
    assert_eq!(service.http.get("/posts/2").await.status, 200);
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
    let mut service = env
        .start_process(&[
            ("REDIS_URL", format!("redis://127.0.0.1:{}", free_port())),
            ("REDIS_TIMEOUT", "100ms".into()),
        ])
        .await;
    let reply = service.http.get("/posts/1").await;
    assert_eq!(reply.x_cache.as_deref(), Some("bypass"));

    service.signal("TERM");

    assert!(
        service.exits_within(Duration::from_secs(8)).await,
        "the process did not exit: {}",
        service.logs()
    );
}

/// After SIGTERM, readiness turns 503 `draining` at once (on both
/// addresses) while reads are still answered, new connections included,
/// for SHUTDOWN_DELAY: time for a load balancer to stop sending. Then the
/// listener stops and the process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_sigterm_readyz_is_503_while_reads_are_served_for_shutdown_delay() {
    let env = TestEnv::new(3).await;
    let admin_port = free_port();
    let mut service = env
        .start_process(&[
            ("SHUTDOWN_DELAY", "3s".into()),
            ("ADMIN_ADDR", format!("127.0.0.1:{admin_port}")),
        ])
        .await;
    let admin = Http::new(format!("http://127.0.0.1:{admin_port}"));
    assert_eq!(service.http.get("/readyz").await.status, 200);
    assert_eq!(admin.get("/readyz").await.status, 200);

    service.signal("TERM");
    let signalled = Instant::now();
    wait_until(
        "readiness to turn 503",
        Duration::from_secs(1),
        async || service.http.get("/readyz").await.status == 503,
    )
    .await;
    let public = service.http.get("/readyz").await;
    let on_admin = admin.get("/readyz").await;
    let mut reads = Vec::new();
    while signalled.elapsed() < Duration::from_millis(2_000) {
        // A new client each time: a new connection, as a balancer's next
        // request would be.
        let fresh = Http::new(format!("http://{}", service.http.addr()));
        reads.push(fresh.get("/posts/2").await.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let live = admin.get("/livez").await.status;
    assert!(
        service.exits_within(Duration::from_secs(10)).await,
        "the process did not exit"
    );
    let exited = signalled.elapsed();

    assert_eq!(
        (public.status, public.json()["status"].as_str()),
        (503, Some("draining")),
        "{}",
        public.text()
    );
    assert_eq!(on_admin.json()["status"], "draining");
    assert_eq!(
        on_admin.json()["postgres"],
        "up",
        "the dependencies still named"
    );
    assert!(
        reads.len() >= 10 && reads.iter().all(|s| *s == 200),
        "{reads:?}"
    );
    assert_eq!(live, 200, "alive while draining");
    assert!(
        exited >= Duration::from_secs(3),
        "exited {exited:?} after the signal, before SHUTDOWN_DELAY"
    );
}

/// `postcache healthcheck` (a container's HEALTHCHECK): 0 while the
/// instance answers `/livez` on its admin address (given as `0.0.0.0`,
/// asked on loopback) or, without one, on LISTEN_ADDR; 1 where nothing
/// answers, within its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn healthcheck_exits_0_while_the_instance_answers_and_1_where_nothing_does() {
    let env = TestEnv::new(1).await;
    let port = free_port();
    let app = env
        .spawn(&["--admin-addr", &format!("0.0.0.0:{port}")])
        .await;
    let check = |listen: String, admin: String| {
        let started = Instant::now();
        let out = std::process::Command::new(ServiceProcess::binary())
            .args(["healthcheck", "--timeout", "1s"])
            .env("LISTEN_ADDR", listen)
            .env("ADMIN_ADDR", admin)
            .output()
            .expect("the binary runs");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            started.elapsed(),
        )
    };
    let closed = format!("127.0.0.1:{}", free_port());

    let (admin, ..) = check(closed.clone(), format!("0.0.0.0:{port}"));
    let (public, ..) = check(app.http.addr().to_string(), String::new());
    let (nothing, said, took) = check(closed.clone(), String::new());

    assert_eq!(admin, Some(0), "the admin address answers /livez");
    assert_eq!(public, Some(0), "LISTEN_ADDR answers /livez");
    assert_eq!(nothing, Some(1), "nothing listens: {said}");
    assert!(said.contains("cannot connect"), "{said}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// A fleet's first start, on a database and key prefix of its own, in
/// replication mode: nothing is wrong, and nothing is logged as if it were
/// (before: an ERROR that the slot did not exist, a WARN that the change
/// stream was unreadable, a WARN that every post read before was stale).
/// The slot is made before the first session, at info level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_start_logs_no_error_and_no_warning() {
    let env = TestEnv::new(3).await;
    let service = env
        .start_process(&[("CHANGE_FEED", "replication".into())])
        .await;
    crate::support::until_feed(&service.http, "up").await;
    for id in 1..=3 {
        assert_eq!(service.http.get(&format!("/posts/{id}")).await.status, 200);
    }
    let logs = service.logs();
    let alarming: Vec<&str> = logs
        .lines()
        .filter(|line| line.contains(" WARN ") || line.contains(" ERROR "))
        .collect();
    assert!(alarming.is_empty(), "{}", alarming.join("\n"));
    assert!(
        logs.contains("the fleet's first slot is made"),
        "the first slot is said at info level: {logs}"
    );
}

/// What an OTLP/HTTP receiver got: every span, with its service's name.
#[derive(Default)]
struct Received {
    spans: Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>,
    requests: usize,
}

/// An OTLP/HTTP receiver (protobuf, `POST /v1/traces`) on a free port, as
/// a collector is: it decodes every export and keeps its spans.
async fn otlp_receiver() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::Mutex<Received>>,
) {
    use axum::{body::Bytes, extract::State, routing::post, Router};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message;
    type Shared = std::sync::Arc<std::sync::Mutex<Received>>;
    async fn export(State(received): State<Shared>, body: Bytes) -> axum::http::StatusCode {
        let Ok(request) = ExportTraceServiceRequest::decode(body) else {
            return axum::http::StatusCode::BAD_REQUEST;
        };
        let mut received = received.lock().unwrap();
        received.requests += 1;
        for resource in request.resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref())
                .map(|v| format!("{:?}", v.value))
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    received.spans.push((service.clone(), span));
                }
            }
        }
        axum::http::StatusCode::OK
    }
    let received: Shared = Default::default();
    let app = Router::new()
        .route("/v1/traces", post(export))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, received)
}

/// Traces on, through the standard variables: a cold read sent with a W3C
/// `traceparent` gives, in that trace and under OTEL_SERVICE_NAME, the
/// request's span (a child of the caller's), the read's, and its load's,
/// exported over OTLP/HTTP to a receiver that decodes them as a collector
/// does. A protocol this build does not speak is refused at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_read_with_a_traceparent_is_exported_in_its_trace() {
    let env = TestEnv::new(3).await;
    let (receiver, received) = otlp_receiver().await;
    let service_name = format!("postcache-{}", env.prefix.trim_end_matches(':'));
    let service = env
        .start_process(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{receiver}")),
            ("OTEL_SERVICE_NAME", service_name.clone()),
            // Exported within 100 ms of their end (the default is 5 s).
            ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ])
        .await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller = "00f067aa0ba902b7";
    let reply = service
        .http
        .send(
            reqwest::Method::GET,
            "/posts/2",
            &[("traceparent", &format!("00-{trace_id}-{caller}-01"))],
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.x_cache.as_deref(), Some("miss"));

    let in_trace = |received: &Received| -> Vec<(String, String, String, String)> {
        received
            .spans
            .iter()
            .filter(|(_, span)| hex(&span.trace_id) == trace_id)
            .map(|(service, span)| {
                (
                    span.name.clone(),
                    hex(&span.span_id),
                    hex(&span.parent_span_id),
                    service.clone(),
                )
            })
            .collect()
    };
    wait_until("the read's spans at the receiver", A_WHILE, async || {
        let received = received.lock().unwrap();
        let names: Vec<String> = in_trace(&received).into_iter().map(|s| s.0).collect();
        ["GET /posts/{id}", "get_post", "load"]
            .iter()
            .all(|name| names.iter().any(|n| n == name))
    })
    .await;
    let spans = in_trace(&received.lock().unwrap());
    let named = |name: &str| spans.iter().find(|s| s.0 == name).unwrap().clone();
    let (_, request, request_parent, service_seen) = named("GET /posts/{id}");
    assert_eq!(
        request_parent, caller,
        "the request's span is the caller's child"
    );
    assert!(service_seen.contains(&service_name), "{service_seen}");
    let (_, read, read_parent, _) = named("get_post");
    assert_eq!(read_parent, request);
    // The load is inside the read (through its flight).
    let parents: std::collections::HashMap<String, String> = spans
        .iter()
        .map(|(_, id, parent, _)| (id.clone(), parent.clone()))
        .collect();
    let (_, load, _, _) = named("load");
    let mut up = load.clone();
    while let Some(parent) = parents.get(&up) {
        if *parent == read {
            break;
        }
        up = parent.clone();
    }
    assert_eq!(
        parents.get(&up),
        Some(&read),
        "the load descends from the read: {spans:?}"
    );
    let names: Vec<&str> = spans.iter().map(|s| s.0.as_str()).collect();
    for name in ["flight", "first_look", "finish"] {
        assert!(names.contains(&name), "{name} in {names:?}");
    }
    drop(service);

    // A collector that takes connections and answers nothing (a listener
    // that never accepts: the kernel completes the handshakes): a SIGTERM
    // still ends the process within the flush's bound (2 s), not the SDK's
    // own (5 s: measured with the bound lifted, the exit took 5.03 s).
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut silent = env
        .start_process(&[
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("http://{}", hole.local_addr().unwrap()),
            ),
            ("OTEL_BSP_SCHEDULE_DELAY", "60000".into()),
        ])
        .await;
    assert_eq!(silent.http.get("/posts/3").await.status, 200);
    silent.signal("TERM");
    let stopped = Instant::now();
    assert!(
        silent.exits_within(Duration::from_secs(4)).await,
        "{}",
        silent.logs()
    );
    println!(
        "exited {:?} after SIGTERM, its collector silent",
        stopped.elapsed()
    );
    drop((silent, hole));

    // A protocol this build does not speak: refused at start, exit 2.
    let refused = ServiceProcess::refused(
        &[
            ("DATABASE_URL", env.db_url.clone()),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{receiver}")),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".into()),
        ],
        Duration::from_secs(10),
    )
    .await
    .expect("exits");
    assert_eq!(refused.0.code(), Some(2), "{}", refused.1);
    assert!(
        refused.1.contains("OTEL_EXPORTER_OTLP_PROTOCOL=grpc"),
        "{}",
        refused.1
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
