//! Any row PostgreSQL accepts is served: timestamps no calendar type holds,
//! empty and odd text, bodies past MAX_ENTRY_BYTES; a load that panics frees
//! its key at once; settings that would overflow are refused at start.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use futures::future::join_all;
use postcache::{
    cli::inspect::{self, EntryStatus},
    read_path::Hooks,
    testkit::{
        answered, fire, wait_until, ServiceProcess, TableLock, TestApp, TestEnv, A_WHILE, PATIENT,
    },
};

/// A row with values a calendar type or a careless encoder would choke on.
struct EdgeRow {
    /// title, body, author, created_at, updated_at, as SQL literals.
    sql: [&'static str; 5],
    /// created_at and updated_at as served.
    times: [&'static str; 2],
    /// title, body and author as served, a JSON array.
    text: &'static str,
}

const EDGE_ROWS: &[EdgeRow] = &[
    EdgeRow {
        sql: ["''", "''", "''", "'-infinity'", "'infinity'"],
        times: ["-infinity", "infinity"],
        text: r#"["","",""]"#,
    },
    EdgeRow {
        sql: [
            r"E'tab\there\x01\x1f end'",
            "'𝄞 clef, 🎉 and 中文'",
            r#"E'line\nbreak \\ "quoted"'"#,
            "'4713-01-01 00:00:00+00 BC'",
            "'294276-12-31 23:59:59.999999+00'",
        ],
        times: ["-4712-01-01T00:00:00Z", "+294276-12-31T23:59:59.999999Z"],
        text: r#"["tab\there\u0001\u001f end","𝄞 clef, 🎉 and 中文","line\nbreak \\ \"quoted\""]"#,
    },
    EdgeRow {
        sql: [
            "'Ides'",
            "'of March'",
            "'Brutus'",
            "'0044-03-15 00:00:00+00 BC'",
            "'10000-01-01 00:00:00+00'",
        ],
        times: ["-0043-03-15T00:00:00Z", "+10000-01-01T00:00:00Z"],
        text: r#"["Ides","of March","Brutus"]"#,
    },
    EdgeRow {
        sql: [
            "'edges'",
            "'of the calendar'",
            "'a'",
            "'0001-01-01 00:00:00+00'",
            "'9999-12-31 23:59:59.999999+00'",
        ],
        times: ["0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999999Z"],
        text: r#"["edges","of the calendar","a"]"#,
    },
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_value_the_schema_allows_is_served_as_200_json_from_every_tier() {
    let env = TestEnv::new(10).await;
    let apps = join_all((0..2).map(|_| env.spawn(&[]))).await;
    for (i, row) in EDGE_ROWS.iter().enumerate() {
        let sql = format!(
            "insert into posts (id, title, body, author, created_at, updated_at)
             values ({}, {})",
            100 + i,
            row.sql.join(", ")
        );
        sqlx::query(&sql).execute(&env.admin).await.unwrap();
    }
    // A post already cached, changed by plain SQL to a value no calendar
    // type holds (the change feed evicts it).
    assert_eq!(apps[0].get("/posts/9").await.status, 200);
    sqlx::query("update posts set updated_at = 'infinity' where id = 9")
        .execute(&env.admin)
        .await
        .unwrap();

    for (i, row) in EDGE_ROWS.iter().enumerate() {
        let path = format!("/posts/{}", 100 + i);
        // A miss, a hit in memory, and a hit in Redis on the other instance
        // once the miss's finish has stored it (its leader answers first,
        // and a read that comes before the finish waits for it: coalesced).
        let miss = apps[0].get(&path).await;
        let memory = apps[0].get(&path).await;
        assert!(env.stored(100 + i as i64).await.is_some(), "{path} stored");
        let replies = [miss, memory, apps[1].get(&path).await];
        let tiers: Vec<_> = replies.iter().map(|r| r.x_cache.clone()).collect();
        assert_eq!(
            tiers,
            [Some("miss".into()), Some("hit".into()), Some("hit".into())]
        );
        let expected: serde_json::Value = serde_json::from_str(row.text).unwrap();
        for reply in &replies {
            assert_eq!(reply.status, 200, "{path}: {}", reply.text());
            let post = reply.json();
            assert_eq!(post["created_at"], row.times[0], "{path}");
            assert_eq!(post["updated_at"], row.times[1], "{path}");
            let texts = serde_json::json!([post["title"], post["body"], post["author"]]);
            assert_eq!(texts, expected, "{path}");
            assert_eq!(
                reply.body, replies[0].body,
                "every tier serves the same bytes"
            );
        }
    }
    wait_until("the update to infinity to be served", A_WHILE, async || {
        let reply = apps[0].get("/posts/9").await;
        reply.status == 200 && reply.json()["updated_at"] == "infinity"
    })
    .await;
}

/// The body of post `id` made `bytes` long by plain SQL, on a connection
/// of its own, closed after: its backend exits, so its read of the row (an
/// index scan) is in the statistics at once.
async fn grow(env: &TestEnv, id: i64, bytes: usize) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&env.db_url).await.unwrap();
    sqlx::query("update posts set body = repeat('x', $1) where id = $2")
        .bind(bytes as i32)
        .bind(id)
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_post_over_max_entry_bytes_is_served_uncached_and_every_instance_loads_it_at_once() {
    let env = TestEnv::new(5).await;
    grow(&env, 3, 5_000).await;
    let before = env.post_reads().await;
    let flags = [PATIENT, &["--max-entry-bytes", "2000"]].concat();
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;

    // A stampede over two instances: the first holds the lock and loads,
    // the other waits for it.
    let lock = TableLock::take(&env).await;
    let mut requests = fire(&apps[..1], "/posts/3", 10);
    env.until_held(&apps[..1], 10).await;
    requests.extend(fire(&apps[1..], "/posts/3", 10));
    env.until_subscribed(3).await;
    wait_until("every request to arrive", A_WHILE, async || {
        apps[1].reads_in_progress() == 10
    })
    .await;
    lock.release().await;
    let replies = answered(requests).await;
    let inspected = inspect::run(&env.inspect_args(&["3"])).await.unwrap();
    // Later reads go straight to PostgreSQL, with no lock.
    let later = apps[1].get("/posts/3").await;
    let lock_after = env.lock_held(3).await;
    // The post shrinks: the change feed removes the marker, and it is cached.
    grow(&env, 3, 100).await;
    wait_until(
        "the change feed to remove the marker",
        A_WHILE,
        async || env.stored(3).await.is_none(),
    )
    .await;
    let shrunk = [apps[0].get("/posts/3").await, apps[0].get("/posts/3").await];
    for app in apps {
        app.stop().await;
    }

    for reply in replies.iter().map(|(reply, _)| reply).chain([&later]) {
        assert_eq!(reply.status, 200);
        assert_eq!(reply.x_cache.as_deref(), Some("bypass"));
        let bypass = reply
            .headers
            .get("x-cache-bypass")
            .map(|v| v.to_str().unwrap());
        assert_eq!(bypass, Some("too-large"));
        assert_eq!(reply.json()["body"].as_str().unwrap().len(), 5_000);
    }
    // Neither the body nor a fail-safe copy of it is in Redis: a marker.
    assert_eq!(inspected.status, EntryStatus::TooLarge);
    let marker = inspected.value.entry.expect("the marker");
    assert_eq!(marker.body_bytes, 0);
    assert!(inspected.fail_safe.entry.is_none());
    assert!(!lock_after, "no lock taken for a marked post");
    let shrunk: Vec<_> = shrunk.iter().map(|r| r.x_cache.as_deref()).collect();
    assert_eq!(shrunk, [Some("miss"), Some("hit")]);
    // One load per instance in the stampede (the leader's, and the other
    // instance's own once told), one for the read after, the update that
    // shrank it (an index scan too), then the shrunk post's load.
    assert_eq!(env.post_reads().await - before, 2 + 1 + 1 + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_that_panics_answers_503_and_its_waiters_elsewhere_are_served_at_once() {
    let env = TestEnv::new(5).await;
    let panicked_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let armed = Arc::new(AtomicBool::new(true));
    let hooks = Hooks {
        after_load: Some(Arc::new({
            let (panicked_at, armed) = (panicked_at.clone(), armed.clone());
            move |_key| {
                let (panicked_at, armed) = (panicked_at.clone(), armed.clone());
                Box::pin(async move {
                    if armed.swap(false, Ordering::SeqCst) {
                        *panicked_at.lock().unwrap() = Some(Instant::now());
                        panic!("a load hook that panics");
                    }
                })
            }
        })),
        ..Hooks::default()
    };
    // LOCK_TTL 25 s: a lock left to expire would keep the waiters 25 s.
    let leader = env.spawn_with_hooks(PATIENT, hooks).await;
    let waiter = env.spawn(PATIENT).await;
    let panics_before = leader.http.metric("postcache_flight_panics_total").await;

    let lock = TableLock::take(&env).await;
    let own = fire(std::slice::from_ref(&leader), "/posts/2", 5);
    env.until_held(std::slice::from_ref(&leader), 5).await;
    let waiting = fire(std::slice::from_ref(&waiter), "/posts/2", 5);
    env.until_subscribed(2).await;
    wait_until("the waiters to arrive", A_WHILE, async || {
        waiter.reads_in_progress() == 5
    })
    .await;
    lock.release().await;
    let own = answered(own).await;
    let waiting = answered(waiting).await;
    let panicked_at = panicked_at.lock().unwrap().expect("the hook panicked");

    for (reply, _) in &own {
        assert_eq!(reply.status, 503, "{}", reply.text());
    }
    for (reply, arrived) in &waiting {
        assert_eq!(reply.status, 200, "{}", reply.text());
        // At once, not after LOCK_TTL (25 s); the bound leaves room for a
        // debug build on two cores shared with the rest of the suite (a
        // run took 131 ms).
        let after = arrived.duration_since(panicked_at);
        assert!(
            after < Duration::from_millis(300),
            "served {after:?} after the panic"
        );
    }
    let panics = leader.http.metric("postcache_flight_panics_total").await - panics_before;
    assert_eq!(panics, 1.0, "counted once");
    let abandoned = leader.http.metric("postcache_locks_abandoned_total").await;
    assert!(abandoned >= 1.0);
    // The key works on the instance whose load panicked.
    assert_eq!(leader.get("/posts/2").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outbox_row_with_an_infinite_time_does_not_stop_the_change_feed() {
    let env = TestEnv::new(5).await;
    let app: TestApp = env.spawn(&[]).await;
    assert_eq!(app.get("/posts/1").await.status, 200);
    assert_eq!(app.get("/posts/2").await.status, 200);

    sqlx::query(
        "insert into post_changes (post_id, op, changed_at) values (1, 'update', 'infinity'),
                                                                  (1, 'update', '-infinity')",
    )
    .execute(&env.admin)
    .await
    .unwrap();
    sqlx::query("update posts set title = 'after the odd rows' where id = 2")
        .execute(&env.admin)
        .await
        .unwrap();

    wait_until("the later change to be applied", A_WHILE, async || {
        app.get("/posts/2").await.json()["title"] == "after the odd rows"
    })
    .await;
    assert_eq!(app.get("/readyz").await.json()["change_feed"], "up");
}

#[tokio::test]
async fn settings_that_would_overflow_are_refused_at_start_with_a_clear_error() {
    let env = TestEnv::new(0).await;
    let world = [
        ("DATABASE_URL", env.db_url.clone()),
        ("REDIS_URL", env.redis_url.clone()),
        ("KEY_PREFIX", env.prefix.clone()),
    ];
    for (name, value) in [
        ("CACHE_TTL", "1000000000h"),
        ("LOCK_TTL", "500000000000000000h"),
        ("TTL_JITTER", "1.5"),
        ("TTL_JITTER", "NaN"),
        ("KEY_PREFIX", "app{1}:"),
        ("MAX_CONNECTIONS", "18446744073709551615"),
        ("MAX_ENTRY_BYTES", "0"),
    ] {
        let mut vars: Vec<(&str, String)> = world.to_vec();
        vars.retain(|(n, _)| *n != name);
        vars.push((name, value.to_owned()));

        let (status, output) = ServiceProcess::refused(&vars, Duration::from_secs(20))
            .await
            .unwrap_or_else(|| panic!("{name}={value} was accepted"));

        assert!(!status.success(), "{name}={value}: {output}");
        let named =
            output.contains(name) || output.contains(&name.to_lowercase().replace('_', "-"));
        assert!(named, "{name}={value} is not named: {output}");
        assert!(!output.contains("panicked"), "{name}={value}: {output}");
    }
}
