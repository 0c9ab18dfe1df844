//! Metrics: a stampede and a fail-open episode move the counters exactly as
//! they should. The recorder is process-wide, so this binary holds one test.

use std::{collections::HashMap, time::Duration};

use futures::future::join_all;
use postcache::testkit::{
    available, fire, wait_until, RedisServer, TableLock, TestApp, TestEnv, PATIENT,
};

/// Parses the Prometheus text format into `name{labels}` → value.
fn parse(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

async fn scrape(app: &TestApp) -> (String, HashMap<String, f64>) {
    let reply = app.get("/metrics").await;
    assert_eq!(reply.status, 200);
    let text = reply.text();
    let parsed = parse(&text);
    (text, parsed)
}

fn get(m: &HashMap<String, f64>, series: &str) -> f64 {
    m.get(series).copied().unwrap_or(0.0)
}

fn delta(before: &HashMap<String, f64>, after: &HashMap<String, f64>, series: &str) -> f64 {
    get(after, series) - get(before, series)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stampede_and_a_fail_open_episode_move_the_counters_exactly() {
    let env = TestEnv::new(10).await;
    let apps = join_all((0..3).map(|_| env.spawn(PATIENT))).await;
    let (_, before) = scrape(&apps[0]).await;

    // A stampede: 1,000 requests over 3 instances, the leader held back.
    let lock = TableLock::take(&env).await;
    let requests = fire(&apps, "/posts/7", 1000);
    env.until_held(&apps, 1000).await;
    lock.release().await;
    for reply in join_all(requests).await {
        assert_eq!(reply.unwrap().0.status, 200);
    }
    let (text, after) = scrape(&apps[0]).await;

    let d = |s: &str| delta(&before, &after, s);
    assert_eq!(
        d(r#"postcache_requests_total{outcome="miss",tier="none"}"#),
        1.0
    );
    assert_eq!(
        d(r#"postcache_requests_total{outcome="coalesced_local",tier="none"}"#)
            + d(r#"postcache_requests_total{outcome="coalesced_remote",tier="none"}"#),
        999.0
    );
    // Two other instances learnt the outcome from the leader's message.
    assert_eq!(
        d(r#"postcache_requests_total{outcome="coalesced_remote",tier="none"}"#),
        2.0
    );
    assert_eq!(d(r#"postcache_db_loads_total{result="found"}"#), 1.0);
    assert_eq!(d(r#"postcache_lock_elections_total{result="won"}"#), 1.0);
    assert_eq!(d(r#"postcache_lock_elections_total{result="lost"}"#), 2.0);
    assert_eq!(d(r#"postcache_waits_total{ended_by="message"}"#), 2.0);
    assert_eq!(d(r#"postcache_waits_total{ended_by="timeout"}"#), 0.0);
    assert_eq!(d("postcache_wait_duration_seconds_count"), 2.0);
    assert_eq!(
        d(r#"postcache_request_duration_seconds_count{outcome="miss",tier="none"}"#),
        1.0
    );
    assert_eq!(d(r#"postcache_http_errors_total{status="504"}"#), 0.0);
    assert_eq!(get(&after, "postcache_flights_in_progress"), 0.0);
    // What operators expect beside: the build, Redis' latency (every
    // command the stampede sent timed), the pools, and the process.
    assert_eq!(
        get(
            &after,
            &format!(
                r#"postcache_build_info{{version="{}"}}"#,
                env!("CARGO_PKG_VERSION")
            )
        ),
        1.0
    );
    assert!(d("postcache_redis_command_duration_seconds_count") >= 2.0);
    assert_eq!(
        d(r#"postcache_db_pool_wait_seconds_count{pool="loads"}"#),
        1.0,
        "the one load statement waited for its connection once"
    );
    for pool in ["loads", "past", "probe"] {
        let open = get(
            &after,
            &format!(r#"postcache_db_pool_connections{{pool="{pool}",state="idle"}}"#),
        ) + get(
            &after,
            &format!(r#"postcache_db_pool_connections{{pool="{pool}",state="busy"}}"#),
        );
        let max = get(
            &after,
            &format!(r#"postcache_db_pool_max_connections{{pool="{pool}"}}"#),
        );
        assert!(max >= 1.0 && open <= max, "{pool}: {open} of {max}");
    }
    assert!(get(&after, "process_open_fds") > 0.0);
    assert!(get(&after, "process_max_fds") >= get(&after, "process_open_fds"));
    assert!(get(&after, "process_resident_memory_bytes") > 0.0);
    assert!(get(&after, "process_cpu_seconds_total") > 0.0);
    promtool_accepts(&text);

    // A batch read, counted with its ids and timed.
    let (_, before_batch) = scrape(&apps[1]).await;
    assert_eq!(apps[1].get("/posts?ids=1,2,3").await.status, 200);
    assert_eq!(apps[1].get("/posts?ids=1,x").await.status, 400);
    let (_, after_batch) = scrape(&apps[1]).await;
    let b = |s: &str| delta(&before_batch, &after_batch, s);
    assert_eq!(b(r#"postcache_batch_reads_total{outcome="ok"}"#), 1.0);
    assert_eq!(b(r#"postcache_batch_reads_total{outcome="error"}"#), 1.0);
    assert_eq!(b("postcache_batch_read_ids_total"), 3.0);
    assert_eq!(b("postcache_batch_read_duration_seconds_count"), 2.0);

    // The stampede's answer is kept in memory: the next read is a memory hit.
    let reply = apps[0].get("/posts/7").await;
    assert_eq!(reply.tier(), Some("memory"));
    let (_, kept) = scrape(&apps[0]).await;
    assert_eq!(
        delta(
            &after,
            &kept,
            r#"postcache_requests_total{outcome="hit",tier="memory"}"#
        ),
        1.0
    );
    assert_eq!(get(&kept, "postcache_memory_tier_entries"), 1.0);
    assert_eq!(get(&kept, "postcache_memory_tier_serving"), 1.0);

    // A fail-open episode: an instance whose Redis is gone.
    let down = env.spawn_without_redis().await;
    let (_, before) = scrape(&down).await;
    for id in 1..=10 {
        let reply = down.get(&format!("/posts/{id}")).await;
        assert_eq!(
            (reply.status, reply.x_cache.as_deref()),
            (200, Some("bypass"))
        );
    }
    let (text, after) = scrape(&down).await;
    let d = |s: &str| delta(&before, &after, s);
    assert_eq!(
        d(r#"postcache_requests_total{outcome="bypass",tier="none"}"#),
        10.0
    );
    assert_eq!(d(r#"postcache_db_loads_total{result="found"}"#), 10.0);
    assert!(
        d(r#"postcache_redis_errors_total{kind="circuit_open"}"#) >= 1.0,
        "the breaker opened"
    );
    assert_eq!(get(&after, "postcache_redis_breaker_state"), 1.0);
    promtool_accepts(&text);

    // Half-open: Redis stalls, the breaker opens, and once the cooldown is
    // over it lets one probe through (whichever command comes first: a
    // request, or the cutoff's follower, which reads Redis every second), a
    // probe that hangs up to REDIS_TIMEOUT and opens it again. The gauge
    // says 2 from the end of the cooldown to the probe's failure.
    let redis = RedisServer::start().await;
    let stalling = env
        .spawn(&["--redis-url", &redis.url(), "--redis-timeout", "1s"])
        .await;
    assert_eq!(stalling.get("/posts/1").await.status, 200);
    redis.cli(&["client", "pause", "8000", "all"]);
    for id in 2..=4 {
        let reply = stalling.get(&format!("/posts/{id}")).await;
        assert_eq!(reply.x_cache.as_deref(), Some("bypass"));
    }
    let (_, opened) = scrape(&stalling).await;
    let mut states = vec![get(&opened, "postcache_redis_breaker_state")];
    // Each node's breaker, by its address.
    let node = opened
        .iter()
        .find(|(series, _)| {
            series.starts_with("postcache_redis_node_breaker_state{")
                && series.ends_with(&format!(":{}\"}}", redis.port))
        })
        .map(|(_, state)| *state);
    assert_eq!(node, Some(1.0), "the stalled node's breaker is open");
    wait_until(
        "the breaker to be half-open",
        Duration::from_secs(5),
        async || {
            let (_, now) = scrape(&stalling).await;
            states.push(get(&now, "postcache_redis_breaker_state"));
            states.last() == Some(&2.0)
        },
    )
    .await;
    let reply = stalling.get("/posts/5").await;

    assert_eq!(states[0], 1.0, "open after the failures: {states:?}");
    assert_eq!(reply.x_cache.as_deref(), Some("bypass"));
}

/// `promtool check metrics` (CI installs promtool).
fn promtool_accepts(text: &str) {
    use std::{io::Write, process::Command, process::Stdio};
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    if !available("promtool", child.is_ok()) {
        return;
    }
    let mut child = child.expect("available");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool rejected the metrics:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
