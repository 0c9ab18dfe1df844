//! Slow and idle clients: header and idle deadlines, the connection cap and
//! the shutdown, on bare sockets against a real instance.

use std::time::{Duration, Instant};

use postcache::testkit::{
    free_port, metric, raw_request, wait_until, Http, RawConn, TableLock, TestEnv, A_WHILE, PATIENT,
};

/// Slack for a deadline on this shared machine: a connection closes at its
/// deadline, and no later than this after it.
const SLACK: Duration = Duration::from_millis(1500);
/// The client sees an answer a little after the server started the idle
/// deadline: a close measured from the answer may look this much early.
const EARLY: Duration = Duration::from_millis(50);

#[track_caller]
fn assert_closed_at(what: &str, closed: Option<Instant>, from: Instant, deadline: Duration) {
    let closed = closed.unwrap_or_else(|| panic!("{what}: still open"));
    let after = closed - from;
    assert!(
        after + EARLY >= deadline && after <= deadline + SLACK,
        "{what}: closed {after:?} after, the deadline was {deadline:?}"
    );
}

#[tokio::test]
async fn half_sent_headers_are_closed_at_the_header_read_timeout_however_they_trickle() {
    let env = TestEnv::new(3).await;
    let timeout = Duration::from_millis(500);
    let app = env
        .spawn(&["--header-read-timeout", "500ms", "--idle-timeout", "30s"])
        .await;
    let addr = app.http.addr();
    let before = app
        .http
        .metric(r#"postcache_connections_timed_out_total{timeout="header_read"}"#)
        .await;

    // Ten that send a request line and one header, one that sends nothing,
    // one that sends a byte every 100 ms (each would push back a deadline
    // that restarted on every byte).
    let mut half = Vec::new();
    for _ in 0..10 {
        let mut conn = RawConn::open(addr).await;
        conn.send(b"GET /posts/1 HTTP/1.1\r\nhost: postcache\r\n")
            .await
            .unwrap();
        half.push(conn);
    }
    let mut silent = RawConn::open(addr).await;
    let mut trickle = RawConn::open(addr).await;
    let trickling = async {
        for byte in b"GET /posts/1 HTTP/1.1\r\nhost: postcache\r\nx-slow: 1234567890\r\n" {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if trickle.send(&[*byte]).await.is_err() {
                break;
            }
        }
        trickle.closed_within(A_WHILE).await
    };
    let served_meanwhile = app.get("/posts/2");
    let (trickled, served) = tokio::join!(trickling, served_meanwhile);

    for (i, conn) in half.iter_mut().enumerate() {
        let closed = conn.closed_within(A_WHILE).await;
        assert_closed_at(&format!("half-sent {i}"), closed, conn.opened, timeout);
    }
    let closed = silent.closed_within(A_WHILE).await;
    assert_closed_at("silent", closed, silent.opened, timeout);
    // Its first byte went 100 ms after it opened: the deadline ran from the open.
    assert_closed_at("trickling", trickled, trickle.opened, timeout);
    assert_eq!(served.status, 200, "the instance kept serving");
    let after = app
        .http
        .metric(r#"postcache_connections_timed_out_total{timeout="header_read"}"#)
        .await;
    assert!(after - before >= 12.0, "{before} → {after}");
}

#[tokio::test]
async fn an_idle_keep_alive_is_closed_at_the_idle_timeout_a_busy_or_used_one_is_not() {
    let env = TestEnv::new(3).await;
    let idle_timeout = Duration::from_millis(800);
    let app = env
        .spawn(
            &[
                PATIENT,
                &["--idle-timeout", "800ms", "--header-read-timeout", "200ms"],
            ]
            .concat(),
        )
        .await;
    let addr = app.http.addr();

    // Idle after one answer: closed at IDLE_TIMEOUT, not at the (shorter)
    // HEADER_READ_TIMEOUT.
    let mut idle = RawConn::open(addr).await;
    assert_eq!(idle.get("/posts/1").await.status, 200);
    let answered = Instant::now();
    let idle_closed = async { idle.closed_within(A_WHILE).await };

    // Busy: its request held by a table lock for twice the idle timeout.
    let lock = TableLock::take(&env).await;
    let mut busy = RawConn::open(addr).await;
    busy.send(raw_request("/posts/2").as_bytes()).await.unwrap();
    let held = async {
        env.until_held(std::slice::from_ref(&app), 1).await;
        tokio::time::sleep(2 * idle_timeout).await;
        lock.release().await;
        let reply = busy.reply(A_WHILE).await;
        let answered = Instant::now();
        (reply, answered, busy.closed_within(A_WHILE).await)
    };

    // Used: a request at once (a new connection's headers are due within
    // HEADER_READ_TIMEOUT), then one every 400 ms for three idle timeouts.
    let mut used = RawConn::open(addr).await;
    let using = async {
        let mut statuses = Vec::new();
        for _ in 0..7 {
            statuses.push(used.get("/posts/3").await.status);
            tokio::time::sleep(idle_timeout / 2).await;
        }
        statuses
    };

    let (idle_closed, (busy_reply, busy_answered, busy_closed), used_statuses) =
        tokio::join!(idle_closed, held, using);

    assert_closed_at("idle", idle_closed, answered, idle_timeout);
    let busy_reply = busy_reply.expect("the busy connection was answered");
    assert_eq!(busy_reply.status, 200);
    assert_closed_at(
        "busy, once answered and idle",
        busy_closed,
        busy_answered,
        idle_timeout,
    );
    assert_eq!(used_statuses, vec![200; 7]);
}

#[tokio::test]
async fn past_max_connections_new_ones_get_503_at_once_and_open_ones_keep_working() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(&["--max-connections", "3"]).await;
    let addr = app.http.addr();
    let mut open = Vec::new();
    for _ in 0..3 {
        let mut conn = RawConn::open(addr).await;
        assert_eq!(conn.get("/posts/1").await.status, 200);
        open.push(conn);
    }

    // One that waits to be answered, one that sends its request first (its
    // unread request must not turn the refusal into a reset).
    let started = Instant::now();
    let mut waiting = RawConn::open(addr).await;
    let refused_waiting = waiting.reply(A_WHILE).await;
    let mut eager = RawConn::open(addr).await;
    eager
        .send(raw_request("/posts/1").as_bytes())
        .await
        .unwrap();
    let refused_eager = eager.reply(A_WHILE).await;
    let took = started.elapsed();

    for refused in [refused_waiting, refused_eager] {
        let refused = refused.expect("an answer, not a reset");
        assert_eq!(refused.status, 503);
        assert!(
            refused.body.contains("too many connections"),
            "{}",
            refused.body
        );
        assert!(refused
            .head
            .to_ascii_lowercase()
            .contains("connection: close"));
    }
    assert!(took < Duration::from_secs(1), "refused after {took:?}");
    assert!(waiting
        .closed_within(Duration::from_secs(2))
        .await
        .is_some());
    // The connections already open keep working, the metrics among them.
    assert_eq!(open[0].get("/posts/2").await.status, 200);
    let metrics = open[1].get("/metrics").await.body;
    let refused_count =
        metric(&metrics, "postcache_connections_refused_total").expect("the refusals counted");
    assert!(refused_count >= 2.0, "{refused_count}");

    // A connection that closes frees its place.
    drop(open.pop());
    wait_until("a new connection to be accepted", A_WHILE, async || {
        let mut conn = RawConn::open(addr).await;
        conn.get("/posts/3").await.status == 200
    })
    .await;
}

/// Liveness on the admin address is never shed: with the public port at
/// MAX_CONNECTIONS (new connections refused with 503), `/livez` and
/// `/readyz` there still answer 200. A liveness probe on the public port
/// would fail at peak and restart an instance that was fine.
#[tokio::test]
async fn livez_on_the_admin_address_answers_while_the_public_port_is_full() {
    let env = TestEnv::new(3).await;
    let admin_port = free_port();
    let app = env
        .spawn(&[
            "--max-connections",
            "2",
            "--admin-addr",
            &format!("127.0.0.1:{admin_port}"),
        ])
        .await;
    let addr = app.http.addr();
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut conn = RawConn::open(addr).await;
        assert_eq!(conn.get("/livez").await.status, 200);
        open.push(conn);
    }
    let mut refused = RawConn::open(addr).await;
    let refused = refused
        .reply(A_WHILE)
        .await
        .expect("an answer, not a reset");
    assert_eq!(refused.status, 503, "{}", refused.body);

    let admin = Http::new(format!("http://127.0.0.1:{admin_port}"));
    for _ in 0..20 {
        let live = admin.get("/livez").await;
        assert_eq!(
            (live.status, live.json()["status"].as_str()),
            (200, Some("ok"))
        );
        assert_eq!(admin.get("/readyz").await.status, 200);
    }
    // The public port's own connections still answer it.
    assert_eq!(open[0].get("/livez").await.status, 200);
}

#[tokio::test]
async fn a_shutdown_closes_idle_and_half_sent_connections_at_once_and_answers_the_busy_one() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(PATIENT).await;
    let addr = app.http.addr();
    let mut idle = RawConn::open(addr).await;
    assert_eq!(idle.get("/posts/1").await.status, 200);
    let mut half = RawConn::open(addr).await;
    half.send(b"GET /posts/1 HTTP/1.1\r\n").await.unwrap();
    let lock = TableLock::take(&env).await;
    let mut busy = RawConn::open(addr).await;
    busy.send(raw_request("/posts/2").as_bytes()).await.unwrap();
    env.until_held(std::slice::from_ref(&app), 1).await;

    let stopping = tokio::spawn(app.stop());

    // Far sooner than their deadlines (10 s and 60 s).
    assert!(idle.closed_within(Duration::from_secs(2)).await.is_some());
    assert!(half.closed_within(Duration::from_secs(2)).await.is_some());
    lock.release().await;
    let reply = busy.reply(A_WHILE).await.expect("the busy one answered");
    assert_eq!(reply.status, 200);
    assert!(busy.closed_within(Duration::from_secs(2)).await.is_some());
    stopping.await.unwrap();
}
