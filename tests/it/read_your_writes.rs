//! Read your writes: a read that carries the WAL position of a write
//! (`PostCache-Min-LSN`) reflects it, on any instance, at once; every
//! answer says the position it is fresh at (`PostCache-LSN`); a staleness
//! bound (`PostCache-Max-Staleness`); and without a feed that knows its
//! position, such reads go past the cache.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use postcache::{
    config::DatabaseSettings,
    http::position::{format_lsn, parse_lsn},
    store::{connect_past, PastReads},
    testkit::{
        wait_until, Http, RedisServer, Reply, TcpProxy, TestEnv, A_WHILE, REPLICATION_LONG_LIVED,
    },
};

const REPLICATION: [&str; 6] = REPLICATION_LONG_LIVED;

/// Retitles post `id` by plain SQL and returns the position the commit is
/// at, as an application would hand it to its client.
async fn write(env: &TestEnv, id: i64, title: &str) -> String {
    env.retitle(id, title).await;
    sqlx::query_scalar("select pg_current_wal_lsn()::text")
        .fetch_one(&env.admin)
        .await
        .unwrap()
}

async fn read_at(http: &Http, path: &str, headers: &[(&str, &str)]) -> Reply {
    http.send(reqwest::Method::GET, path, headers)
        .await
        .expect("a response")
}

fn title(reply: &Reply) -> String {
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["title"].as_str().unwrap().to_owned()
}

fn said_position(reply: &Reply) -> Option<u64> {
    reply
        .headers
        .get("postcache-lsn")
        .map(|v| parse_lsn(v.to_str().unwrap()).expect("PostCache-LSN parses"))
}

async fn until_positions_known(apps: &[&Http]) {
    for http in apps {
        wait_until("the feed's position known", A_WHILE, async || {
            http.get("/readyz").await.json()["read_your_writes"] == "cache"
        })
        .await;
    }
}

/// The measurement, as a test: a write by plain SQL, then at once a
/// read of that post on another instance. With the write's position, no
/// read returns the old title, and most are answered from the cache; every
/// answer says a position at or past the write's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_then_a_read_at_once_on_another_instance_with_its_position_is_never_old() {
    let env = TestEnv::new(5).await;
    let (a, b) = (env.spawn(&REPLICATION).await, env.spawn(&REPLICATION).await);
    until_positions_known(&[&a.http, &b.http]).await;
    let counted_before = position_reads(&a.http).await;
    const TRIALS: usize = 300;
    let mut from_cache = 0;
    let mut old_without = 0;
    for trial in 0..TRIALS {
        let id = 1 + (trial % 5) as i64;
        // Both instances hold the post, in memory and in Redis.
        for http in [&a.http, &b.http] {
            title(&http.get(&format!("/posts/{id}")).await);
            title(&http.get(&format!("/posts/{id}")).await);
        }
        let (reader, other) = if trial % 2 == 0 {
            (&b.http, &a.http)
        } else {
            (&a.http, &b.http)
        };
        let wanted = format!("trial {trial}");
        let at = write(&env, id, &wanted).await;
        // Without the header, the old title may come back: counted, to show
        // what the header is for.
        let plain = other.get(&format!("/posts/{id}")).await;
        if title(&plain) != wanted {
            old_without += 1;
        }
        let reply = read_at(
            reader,
            &format!("/posts/{id}"),
            &[("PostCache-Min-LSN", &at)],
        )
        .await;
        assert_eq!(
            title(&reply),
            wanted,
            "trial {trial}: the old title at {at}"
        );
        let said = said_position(&reply).expect("a PostCache-LSN");
        assert!(
            said >= parse_lsn(&at).unwrap(),
            "said {} for {at}",
            format_lsn(said)
        );
        if reply.cache_status() != Some("postcache; fwd=bypass; detail=position") {
            from_cache += 1;
        }
    }
    println!(
        "{TRIALS} writes each read at once on another instance: 0 old with the position, \
         {from_cache} from the cache; {old_without} old without it (on the writer's other instance)"
    );
    assert!(
        from_cache * 100 >= TRIALS * 80,
        "only {from_cache} of {TRIALS} from the cache"
    );
    // Both instances run in this process and share its recorder, as do the
    // other tests of this binary: a difference.
    assert_eq!(
        position_reads(&a.http).await - counted_before,
        TRIALS as f64
    );
}

/// Reads that asked for a position, however answered.
async fn position_reads(http: &Http) -> f64 {
    let mut counted = 0.0;
    for answered in ["cache", "wait", "replica", "primary"] {
        let series = format!("postcache_min_lsn_reads_total{{answered=\"{answered}\"}}");
        counted += http.metric(&series).await;
    }
    counted
}

/// Every answer of a post says the position it is known fresh at while the
/// feed's position is known, and it moves on with writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_answer_says_the_position_it_is_fresh_at() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(&REPLICATION).await;
    until_positions_known(&[&app.http]).await;
    let first = said_position(&app.http.get("/posts/1").await).expect("a position on a miss");
    let memory = app.http.get("/posts/1").await;
    assert_eq!(memory.tier(), Some("memory"));
    assert!(said_position(&memory).expect("a position on a memory hit") >= first);
    let at = parse_lsn(&write(&env, 2, "moved on").await).unwrap();
    wait_until("a position past the write", A_WHILE, async || {
        said_position(&app.http.get("/posts/1").await).is_some_and(|said| said >= at)
    })
    .await;
    let batch = app.http.get("/posts?ids=1,2,3").await;
    assert_eq!(batch.status, 200);
    assert!(said_position(&batch).expect("a position on a batch") >= at);
    let ready = app.http.get("/readyz").await.json();
    let position = parse_lsn(ready["change_feed_position"].as_str().unwrap()).unwrap();
    assert!(position >= at);
}

/// Headers that do not parse, and a position no client can have seen, are
/// 400s in JSON; the first read that asks for the server's own position is
/// answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_position_or_bound_that_does_not_parse_or_is_past_the_server_is_a_400() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(&REPLICATION).await;
    until_positions_known(&[&app.http]).await;
    for path in ["/posts/1", "/posts?ids=1,2"] {
        for (name, value, says) in [
            (
                "PostCache-Min-LSN",
                "yesterday",
                "invalid PostCache-Min-LSN",
            ),
            ("PostCache-Min-LSN", "0/", "invalid PostCache-Min-LSN"),
            (
                "PostCache-Min-LSN",
                "100000000/0",
                "invalid PostCache-Min-LSN",
            ),
            (
                "PostCache-Max-Staleness",
                "250",
                "invalid PostCache-Max-Staleness",
            ),
            (
                "PostCache-Max-Staleness",
                "2h",
                "invalid PostCache-Max-Staleness",
            ),
            (
                "PostCache-Min-LSN",
                "FFFFFFFF/0",
                "past the database's WAL position",
            ),
        ] {
            let reply = read_at(&app.http, path, &[(name, value)]).await;
            assert_eq!(reply.status, 400, "{path} {name}: {value}");
            assert!(
                reply.error().contains(says),
                "{path} {name}: {value}: {}",
                reply.error()
            );
        }
        // Given twice, however valid each value: no one ask can be told.
        for (name, first, second) in [
            ("PostCache-Min-LSN", "0/1", "0/1"),
            ("PostCache-Max-Staleness", "1s", "0ms"),
        ] {
            let reply = read_at(&app.http, path, &[(name, first), (name, second)]).await;
            assert_eq!(reply.status, 400, "{path} {name} twice");
            assert!(
                reply
                    .error()
                    .contains(&format!("{name} was given more than once")),
                "{}",
                reply.error()
            );
        }
        let now = write(&env, 1, "now").await;
        let reply = read_at(&app.http, path, &[("PostCache-Min-LSN", &now)]).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text());
        let reply = read_at(&app.http, path, &[("PostCache-Min-LSN", "0/0")]).await;
        assert_eq!(reply.status, 200, "{path}");
        assert_ne!(
            reply.cache_status(),
            Some("postcache; fwd=bypass; detail=position")
        );
    }
}

/// Without a feed that knows its position (CHANGE_FEED=off here; the
/// trigger mode and a feed down are the same), reads with a position go to
/// the primary, correct but slower, and `/readyz` says so; no answer says
/// a position (the primary's may name a commit it does not show yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_feeds_position_reads_with_one_go_to_the_primary() {
    let env = TestEnv::new(3).await;
    let app = env
        .spawn(&["--change-feed", "off", "--cache-ttl", "600s"])
        .await;
    assert_eq!(
        app.http.get("/readyz").await.json()["read_your_writes"],
        "primary"
    );
    title(&app.http.get("/posts/1").await);
    let plain = app.http.get("/posts/1").await;
    assert_eq!(plain.x_cache.as_deref(), Some("hit"));
    assert_eq!(said_position(&plain), None);

    let at = write(&env, 1, "written").await;
    // The cache still holds the old title (no feed): the position goes past it.
    assert_ne!(title(&app.http.get("/posts/1").await), "written");
    let before = app
        .http
        .metric("postcache_min_lsn_reads_total{answered=\"primary\"}")
        .await;
    let reply = read_at(&app.http, "/posts/1", &[("PostCache-Min-LSN", &at)]).await;
    assert_eq!(title(&reply), "written");
    assert_eq!(reply.x_cache.as_deref(), Some("bypass"));
    assert_eq!(
        reply.cache_status(),
        Some("postcache; fwd=bypass; detail=position")
    );
    // The primary's WAL position may name commits it does not show yet:
    // without a feed that vouches for one, a read of the primary says none.
    assert_eq!(said_position(&reply), None);
    let batch = read_at(
        &app.http,
        "/posts?ids=1,2,99",
        &[("PostCache-Min-LSN", &at)],
    )
    .await;
    assert_eq!(batch.status, 200);
    let body = batch.json();
    assert_eq!(body["posts"][0]["title"], "written");
    assert_eq!(body["not_found"], serde_json::json!([99]));
    let missing = read_at(&app.http, "/posts/99", &[("PostCache-Min-LSN", &at)]).await;
    assert_eq!(missing.status, 404);
    let bounded = read_at(&app.http, "/posts/1", &[("PostCache-Max-Staleness", "10s")]).await;
    assert_eq!(title(&bounded), "written");
    let after = app
        .http
        .metric("postcache_min_lsn_reads_total{answered=\"primary\"}")
        .await;
    assert_eq!(after - before, 4.0);
    // Nothing read past the cache was stored: another instance still reads
    // the old title from Redis. This one never goes back to it
    // (read_path/floor.rs).
    let other = env
        .spawn(&["--change-feed", "off", "--cache-ttl", "600s"])
        .await;
    assert_ne!(title(&other.http.get("/posts/1").await), "written");
    assert_eq!(title(&app.http.get("/posts/1").await), "written");
}

/// A staleness bound the feed meets is served from the cache; one it does
/// not (the decoder's beats stopped, as when no decoder keeps up) goes past.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_staleness_bound_is_served_from_the_cache_while_the_feed_keeps_up() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(&REPLICATION).await;
    until_positions_known(&[&app.http]).await;
    title(&app.http.get("/posts/1").await);
    // Keeping up: the decoder's last level beat is recent, and a bound of
    // 1 s is then served from memory. On a server shared with other work
    // (CI runs the suite's tests side by side) a decoder may fall behind a
    // moment between the probe and the read: such a read goes past, and
    // the next try is made. A read path that never serves a bound from
    // the cache fails here.
    wait_until(
        "a bounded read served from the cache",
        A_WHILE,
        async || {
            let keeping_up = app.http.get("/readyz").await.json()["change_feed_lag_seconds"]
                .as_f64()
                .is_some_and(|lag| lag < 0.5);
            if !keeping_up {
                return false;
            }
            let reply = read_at(&app.http, "/posts/1", &[("PostCache-Max-Staleness", "1s")]).await;
            title(&reply);
            if reply.tier() != Some("memory") {
                return false;
            }
            assert!(
                said_position(&reply).is_some(),
                "{:?}",
                reply.cache_status()
            );
            true
        },
    )
    .await;
    // Beats come every 100 ms: a bound of 1 ms is met by them only by
    // chance. The primary's position is asked instead, after the read
    // arrived, and the read is answered from the cache once the feed has
    // passed it: every commit visible when it arrived is reflected (its
    // PostCache-LSN is at or past the primary's position before it).
    let rounds_before = app
        .http
        .metric("postcache_primary_position_reads_total")
        .await;
    for _ in 0..20 {
        let before = primary_position(&env).await;
        let reply = read_at(&app.http, "/posts/1", &[("PostCache-Max-Staleness", "1ms")]).await;
        title(&reply);
        assert_ne!(
            reply.cache_status(),
            Some("postcache; fwd=bypass; detail=position"),
            "a bound of 1 ms with the feed up is answered from the cache"
        );
        let said = said_position(&reply).expect("a position");
        assert!(
            said >= before,
            "{} before the read, {} said",
            format_lsn(before),
            format_lsn(said)
        );
    }
    let rounds = app
        .http
        .metric("postcache_primary_position_reads_total")
        .await
        - rounds_before;
    assert!((1.0..=20.0).contains(&rounds), "{rounds} rounds");
}

/// The primary's WAL insert position now.
async fn primary_position(env: &TestEnv) -> u64 {
    let lsn: i64 =
        sqlx::query_scalar("select (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
            .fetch_one(&env.admin)
            .await
            .unwrap();
    u64::try_from(lsn).unwrap()
}

/// The flood, smaller: 32 clients ask `PostCache-Max-Staleness:
/// 0ms` of one post for 3 s. Every read is answered 200 from the cache
/// once the feed has passed the primary's position, which is asked once
/// for every read waiting: no row is read per request (before, each read
/// was a query of its own: 5,400 rows/s for one post).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_max_staleness_flood_on_one_post_costs_a_statement_per_round_and_no_row() {
    const CLIENTS: usize = 32;
    const FOR: Duration = Duration::from_secs(3);
    let env = TestEnv::new(3).await;
    let app = env.spawn(&REPLICATION).await;
    until_positions_known(&[&app.http]).await;
    title(&app.http.get("/posts/1").await);
    title(&app.http.get("/posts/1").await);
    app.stop_pool_connections().await;
    let rows_before = env.post_reads().await;
    let rounds_before = app
        .http
        .metric("postcache_primary_position_reads_total")
        .await;

    let until = std::time::Instant::now() + FOR;
    let clients = (0..CLIENTS).map(|_| {
        let http = app.http.clone();
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            while std::time::Instant::now() < until {
                let reply = read_at(&http, "/posts/1", &[("PostCache-Max-Staleness", "0ms")]).await;
                statuses.push(reply.status);
            }
            statuses
        })
    });
    let statuses: Vec<u16> = futures::future::join_all(clients)
        .await
        .into_iter()
        .flat_map(Result::unwrap)
        .collect();
    let rounds = app
        .http
        .metric("postcache_primary_position_reads_total")
        .await
        - rounds_before;
    app.stop().await;
    let rows = env.post_reads().await - rows_before;

    let total = statuses.len();
    let ok = statuses.iter().filter(|s| **s == 200).count();
    println!("{total} reads, {ok} answered 200, {rounds} rounds, {rows} rows read");
    assert!(total >= 100, "{total} reads in {FOR:?}");
    assert!(ok * 100 >= total * 99, "{ok} of {total} answered 200");
    assert!(
        rows <= 50 * FOR.as_secs() as i64,
        "{rows} rows read for {total} reads"
    );
    assert!(
        (rounds + rows as f64) * 5.0 <= total as f64,
        "{rounds} rounds and {rows} rows for {total} reads"
    );
}

/// A position past the primary's is a 400 at once, without the wait for
/// the feed (MIN_LSN_WAIT is 3 s here), and the body says only the
/// position asked, never the server's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_future_position_is_a_400_at_once_that_does_not_say_the_servers() {
    let env = TestEnv::new(3).await;
    let app = env
        .spawn(&[&REPLICATION[..], &["--min-lsn-wait", "3s"]].concat())
        .await;
    until_positions_known(&[&app.http]).await;
    let future = format_lsn(primary_position(&env).await + (1 << 32));
    for path in ["/posts/1", "/posts?ids=1,2"] {
        let started = std::time::Instant::now();
        let reply = read_at(&app.http, path, &[("PostCache-Min-LSN", &future)]).await;
        let took = started.elapsed();
        assert_eq!(reply.status, 400, "{path}: {}", reply.text());
        let error = reply.error();
        assert!(error.contains(&future), "{error}");
        assert_eq!(error.matches('/').count(), 1, "one position in {error:?}");
        assert!(
            took < Duration::from_secs(1),
            "{path}: answered after {took:?}"
        );
    }
}

/// The fail-safe copy a failed load serves may be the version from before
/// a change: it says no position, and a read with the change's position
/// never gets it (it reads past the cache, and fails while the database
/// does).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_copy_is_never_the_answer_to_a_position() {
    let env = TestEnv::new(3).await;
    let app = env
        .spawn(&[
            "--change-feed",
            "replication",
            "--max-stale",
            "1h",
            "--failure-ttl",
            "30s",
        ])
        .await;
    until_positions_known(&[&app.http]).await;
    let before = title(&app.http.get("/posts/1").await);
    let at = write(&env, 1, "after the copy").await;
    let lsn = parse_lsn(&at).unwrap();
    wait_until("the feed past the write", A_WHILE, async || {
        let ready = app.http.get("/readyz").await.json();
        ready["change_feed_position"]
            .as_str()
            .and_then(parse_lsn)
            .is_some_and(|at| at >= lsn)
    })
    .await;
    env.break_posts(true).await;
    app.stop_pool_connections().await;
    let plain = app.http.get("/posts/1").await;
    let counted_before = position_reads(&app.http).await;
    let asked = read_at(&app.http, "/posts/1", &[("PostCache-Min-LSN", &at)]).await;
    let counted = position_reads(&app.http).await - counted_before;
    env.break_posts(false).await;

    assert_eq!(plain.x_cache.as_deref(), Some("stale"), "{}", plain.text());
    assert_eq!(title(&plain), before, "the copy from before the write");
    assert_eq!(said_position(&plain), None);
    assert_eq!(asked.status, 503, "{}", asked.text());
    // Not counted as answered from the cache: it was not, nor answered.
    assert_eq!(counted, 0.0);
}

/// The primary's position asked over a connection gone silent (a proxy
/// that forwards nothing and closes nothing, as a dead NAT entry does):
/// the round fails within its bound (LOAD_TIMEOUT), and every read that
/// waited on it fails with it (a 503), instead of each holding its place
/// in line until REQUEST_TIMEOUT.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_position_round_on_a_silent_connection_fails_with_its_waiters_within_the_bound() {
    let env = TestEnv::new(1).await;
    let (proxy, url) = env.proxied_database().await;
    let settings = DatabaseSettings {
        database_url: url,
        db_max_connections: 1,
        db_acquire_timeout: Duration::from_secs(1),
        db_statement_timeout: Duration::from_secs(30),
        db_tcp_keepalive: Duration::ZERO,
        db_tcp_user_timeout: Duration::ZERO,
    };
    let bound = Duration::from_millis(500);
    let past = Arc::new(PastReads::new(
        connect_past(&settings, 1).unwrap(),
        None,
        bound,
    ));
    past.primary_position()
        .await
        .expect("a position before the stall");

    proxy.stall(true);
    let started = Instant::now();
    let reads: Vec<_> = (0..20)
        .map(|_| {
            let past = past.clone();
            tokio::spawn(async move { past.primary_position().await })
        })
        .collect();
    for read in reads {
        let answer = tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("a read waiting on a silent round was not answered in 10 s")
            .unwrap();
        // Failed, or Full for a read that arrived after the round began:
        // its own round finds the one connection still held by the last.
        assert!(
            answer.is_err(),
            "a position over a silent connection: {answer:?}"
        );
    }
    let took = started.elapsed();
    assert!(
        took < bound * 3,
        "20 reads on a silent connection took {took:?}: one round's bound is {bound:?}"
    );
}

/// An instance whose change stream stalled while every post was truncated
/// takes the stream up again from its end, past the truncate's entry (and
/// the cutoff it carried): it reads the fleet's cutoff before it vouches
/// for any position, so that no answer names a position past the truncate
/// while it serves a post from before it (found by the 30-minute soak: 19
/// answers on an instance resumed after SIGSTOP named the truncate's
/// position and served the rows it deleted, from Redis, judged by the
/// cutoff before it, until the background read of the cutoff, a second
/// apart, caught up).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_truncate_skipped_as_the_stream_is_taken_up_is_heard_before_any_position() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(5, redis.url()).await;
    let decoder = env.spawn(&REPLICATION).await;
    until_positions_known(&[&decoder.http]).await;
    let proxy = TcpProxy::start(([127, 0, 0, 1], redis.port).into()).await;
    let via_proxy = format!("redis://{}", proxy.addr);
    let flags = [&REPLICATION[..], &["--redis-url", &via_proxy]].concat();
    let reader = env.spawn(&flags).await;
    until_positions_known(&[&reader.http]).await;
    sqlx::query("create table kept as select * from posts")
        .execute(&env.admin)
        .await
        .unwrap();
    // A round loses the race it tests now and then (the background read
    // of the cutoff first): four of them.
    for round in 0..4 {
        if round > 0 {
            sqlx::query("insert into posts select * from kept")
                .execute(&env.admin)
                .await
                .unwrap();
            until_positions_known(&[&reader.http]).await;
        }
        wait_until("every post served by the reader", A_WHILE, async || {
            let mut all = true;
            for id in 1..=5 {
                all &= reader.http.get(&format!("/posts/{id}")).await.status == 200;
            }
            all
        })
        .await;
        a_truncate_while_the_stream_stalls(&env, &decoder.http, &reader.http, &proxy).await;
    }
}

/// See `a_truncate_skipped_as_the_stream_is_taken_up_is_heard_before_any_position`.
async fn a_truncate_while_the_stream_stalls(
    env: &TestEnv,
    decoder: &Http,
    reader: &Http,
    proxy: &TcpProxy,
) {
    // The reader's stream read fails (a block of 1 s, then its timeout).
    proxy.stall(true);
    wait_until("the reader's feed down", A_WHILE, async || {
        reader.get("/readyz").await.json()["change_feed"] == "down"
    })
    .await;
    sqlx::query("truncate posts")
        .execute(&env.admin)
        .await
        .unwrap();
    let truncated: String = sqlx::query_scalar("select pg_current_wal_lsn()::text")
        .fetch_one(&env.admin)
        .await
        .unwrap();
    let truncated = parse_lsn(&truncated).unwrap();
    wait_until("the decoder past the truncate", A_WHILE, async || {
        let ready = decoder.get("/readyz").await.json();
        ready["change_feed_position"]
            .as_str()
            .and_then(parse_lsn)
            .is_some_and(|p| p >= truncated)
    })
    .await;
    proxy.stall(false);

    // Every answer that names a position past the truncate reflects it.
    let mut past = 0;
    let started = Instant::now();
    while past < 50 && started.elapsed() < A_WHILE {
        for id in 1..=5 {
            let reply = reader.get(&format!("/posts/{id}")).await;
            if said_position(&reply).is_some_and(|p| p >= truncated) {
                assert_eq!(
                    reply.status,
                    404,
                    "post {id} served from before the truncate at a position past it ({:?} after the stall): {}",
                    started.elapsed(),
                    reply.text()
                );
                past += 1;
            }
        }
    }
    assert!(
        past >= 50,
        "the reader vouched for no position past the truncate"
    );
}
