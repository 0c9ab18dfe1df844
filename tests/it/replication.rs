//! CHANGE_FEED=replication: one decoder per fleet, elected by the slot,
//! that loses nothing when it dies; gaps (a slot dropped) closed by the
//! cutoff; a huge transaction made one cutoff. And the trigger mode's
//! hardening: no writer can forge, hide or break the feed.

use std::time::{Duration, Instant};

use futures::future::join_all;
use postcache::testkit::{
    available, eventually, redis_url, wait_until, PgServer, RedisServer, ServiceProcess, TestApp,
    TestEnv, A_WHILE, REPLICATION_LONG_LIVED,
};
use sqlx::{Connection, PgConnection};

use crate::support::until_feed;

async fn until_titled(http: &postcache::testkit::Http, id: i64, wanted: &str) {
    wait_until(
        &format!("post {id} to read {wanted:?}"),
        A_WHILE,
        async || http.title(id).await.as_deref() == Some(wanted),
    )
    .await;
}

/// The slot of `env`'s fleet, and the pid of the session streaming it.
async fn slot(env: &TestEnv) -> Option<(String, Option<i32>)> {
    sqlx::query_as(
        "select slot_name::text, active_pid from pg_replication_slots where database = $1",
    )
    .bind(&env.db_name)
    .fetch_optional(&env.admin)
    .await
    .unwrap()
}

/// Drops slot `name` as an operator would: its walsender ended first.
async fn drop_slot_by_hand(env: &TestEnv, name: &str) {
    let mut admin = PgConnection::connect(&env.db_url).await.unwrap();
    wait_until("the slot dropped", A_WHILE, async || {
        let _ = sqlx::query(
            "select pg_terminate_backend(active_pid) from pg_replication_slots
             where slot_name = $1 and active_pid is not null",
        )
        .bind(name)
        .execute(&mut admin)
        .await;
        sqlx::query("select pg_drop_replication_slot($1)")
            .bind(name)
            .execute(&mut admin)
            .await
            .is_ok()
    })
    .await;
}

/// What `postcache_change_feed_decoder` says on each process of `fleet`:
/// 1 on the one whose decoder holds the slot, 0 on the others.
async fn decoders(fleet: &[ServiceProcess]) -> Vec<f64> {
    let decoder = "postcache_change_feed_decoder";
    join_all(fleet.iter().map(|p| p.http.metric(decoder))).await
}

/// Waits until exactly one process of `fleet` holds the slot (`what` names
/// the wait if it times out): the fleet elects its decoder by the slot, at
/// start and after a death, within moments.
async fn until_one_decoder(fleet: &[ServiceProcess], what: &str) {
    wait_until(what, A_WHILE, async || {
        decoders(fleet).await.iter().sum::<f64>() == 1.0
    })
    .await;
}

/// A world of 5 posts on a private primary (its server, to be kept while
/// the world is) whose `settings` (`alter system set ...`) are in force: a
/// test that changes the server's settings must not change the shared
/// one's. `None` where initdb is missing (the test is skipped).
async fn on_a_private_primary(settings: &[&str]) -> Option<(PgServer, TestEnv)> {
    if !available("initdb", PgServer::available()) {
        return None;
    }
    let primary = PgServer::primary().await;
    let env = TestEnv::on_server(5, primary.url(), redis_url()).await;
    for sql in settings.iter().copied().chain(["select pg_reload_conf()"]) {
        sqlx::query(sql).execute(&env.admin).await.unwrap();
    }
    Some((primary, env))
}

/// Lifetimes far past the tests' bounds: a change lost would be served for
/// ten minutes, not expire within the test.
const LONG_LIVED: [(&str, &str); 2] = [("CACHE_TTL", "600s"), ("L1_TTL", "600s")];

/// Reads posts 1..=n on `http` over and over until aborted, so that the
/// instance's memory tier and Redis keep the versions it is shown.
fn keep_reading(http: &postcache::testkit::Http, n: i64) -> tokio::task::JoinHandle<()> {
    let http = http.clone();
    tokio::spawn(async move {
        loop {
            for id in 1..=n {
                let _ = http
                    .send(reqwest::Method::GET, &format!("/posts/{id}"), &[])
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
}

/// Retitles posts 1 to `n` to `round {r}`, `rounds` times 50 ms apart, as a
/// plain SQL writer would, in a task of its own.
fn keep_writing(env: &TestEnv, rounds: u32, n: i64) -> tokio::task::JoinHandle<()> {
    let admin = env.admin.clone();
    tokio::spawn(async move {
        for round in 0..rounds {
            for id in 1..=n {
                sqlx::query("update posts set title = $1 where id = $2")
                    .bind(format!("round {round}"))
                    .bind(id)
                    .execute(&admin)
                    .await
                    .unwrap();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// Retitles posts `ids` once each, as a plain SQL writer would.
async fn retitle_all(env: &TestEnv, ids: std::ops::RangeInclusive<i64>, title: &str) {
    for id in ids {
        env.retitle(id, title).await;
    }
}

/// Waits at most `within` for every post `ids` on `http` to read `wanted`.
async fn titled_within(
    http: &postcache::testkit::Http,
    ids: std::ops::RangeInclusive<i64>,
    wanted: &str,
    within: Duration,
) {
    for id in ids {
        read_within(http, id, wanted, within).await;
    }
}

/// Waits at most `within` for post `id` on `http` to read `wanted`; a
/// failure names what it read last.
async fn read_within(http: &postcache::testkit::Http, id: i64, wanted: &str, within: Duration) {
    let mut last = None;
    let read = eventually(within, async || {
        last = http.title(id).await;
        last.as_deref() == Some(wanted)
    })
    .await;
    assert!(
        read,
        "timed out after {within:?} waiting for post {id} to read {wanted:?}: it read {last:?}"
    );
}

/// Waits at most `within` for every post 1..=n on `http` to read `wanted`.
async fn all_titled_within(
    http: &postcache::testkit::Http,
    n: i64,
    wanted: &str,
    within: Duration,
) {
    for id in 1..=n {
        read_within(http, id, wanted, within).await;
    }
}

/// Three processes, each reading every post all along (so that each keeps
/// caching the versions it is shown, for ten minutes); the decoder is
/// SIGKILLed while rows change, posts 1 to 20 in every round and posts 21
/// to 30 once, just after the kill (no later change hides their loss):
/// another instance takes the slot within seconds and is sent every change
/// the dead one had not confirmed, so once the feed is up again every
/// instance serves every post's last version within 3 s. (Seen failing
/// with a new session started at the server's current position.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_decoder_killed_while_rows_change_loses_no_change() {
    let env = TestEnv::new(30).await;
    let mut vars: Vec<(&str, String)> = vec![("CHANGE_FEED", "replication".to_owned())];
    vars.extend(LONG_LIVED.iter().map(|(k, v)| (*k, v.to_string())));
    let mut fleet: Vec<ServiceProcess> = join_all((0..3).map(|_| env.start_process(&vars))).await;
    until_one_decoder(&fleet, "one decoder").await;
    let held = decoders(&fleet).await;
    let holder = held.iter().position(|h| *h == 1.0).unwrap();
    let readers: Vec<_> = fleet.iter().map(|p| keep_reading(&p.http, 30)).collect();

    let writer = keep_writing(&env, 60, 20);
    tokio::time::sleep(Duration::from_millis(700)).await;
    fleet[holder].signal("KILL");
    let killed = Instant::now();
    retitle_all(&env, 21..=30, "during the takeover").await;
    let mut dead = fleet.remove(holder);
    assert!(dead.exits_within(Duration::from_secs(5)).await);
    until_one_decoder(&fleet, "another instance to hold the slot").await;
    let took_over = killed.elapsed();
    writer.await.unwrap();

    for process in &fleet {
        until_feed(&process.http, "up").await;
    }
    for process in &fleet {
        all_titled_within(&process.http, 20, "round 59", Duration::from_secs(3)).await;
        titled_within(
            &process.http,
            21..=30,
            "during the takeover",
            Duration::from_secs(3),
        )
        .await;
    }
    for reader in readers {
        reader.abort();
    }
    assert!(
        took_over < Duration::from_secs(8),
        "the slot was taken over after {took_over:?}"
    );
    println!("slot taken over {took_over:?} after the decoder's SIGKILL");
}

/// The decoder's replication connection ended (its walsender terminated,
/// as a network cut or a server-side timeout would) while rows change and
/// the instances read them all along, the slot kept: it is no gap (the slot
/// keeps every change, none is counted), and every change arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_replication_connection_cut_without_the_slot_dropped_loses_no_change() {
    let env = TestEnv::new(20).await;
    let flags = REPLICATION_LONG_LIVED;
    let apps: Vec<TestApp> = join_all((0..2).map(|_| env.spawn(&flags))).await;
    for app in &apps {
        until_feed(&app.http, "up").await;
    }
    let gaps = r#"postcache_change_feed_gaps_total{why="slot_missing"}"#;
    let gaps_before = apps[0].http.metric(gaps).await;
    let readers: Vec<_> = apps.iter().map(|app| keep_reading(&app.http, 20)).collect();
    let writer = keep_writing(&env, 40, 10);
    for cut in 0..2 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let ended: Vec<bool> = sqlx::query_scalar(
            "select pg_terminate_backend(active_pid) from pg_replication_slots
             where database = $1 and active_pid is not null",
        )
        .bind(&env.db_name)
        .fetch_all(&env.admin)
        .await
        .unwrap();
        assert_eq!(ended, [true], "the decoder's walsender ended");
        // Changed once, at once: no later change hides their loss.
        retitle_all(&env, 11 + 5 * cut..=15 + 5 * cut, "after a cut").await;
    }
    writer.await.unwrap();

    for app in &apps {
        all_titled_within(&app.http, 10, "round 39", Duration::from_secs(3)).await;
        titled_within(&app.http, 11..=20, "after a cut", Duration::from_secs(3)).await;
    }
    for reader in readers {
        reader.abort();
    }
    assert!(slot(&env).await.is_some(), "the slot kept");
    assert_eq!(apps[0].http.metric(gaps).await, gaps_before, "no gap");
}

/// PostgreSQL crashed and down for 6 s, twice (a private server): the
/// decoder asks for the slot again every 0.25 s while the server refuses
/// connections or recovers, so it holds the slot within 0.65 s of the
/// server's taking connections again each time, and a change made then is
/// served within 2 s. (Before, each attempt spent a second in the pool's
/// acquire and the pauses grew to 3 s: the slot was taken 1.94 s, 1.04 s,
/// 1.0 s, 0.72 s, 0.35 s and 27 ms after the server's return in six
/// outages, and every instance served what Redis held meanwhile.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_postgresql_comes_back_the_decoder_holds_the_slot_at_once() {
    let Some((mut primary, env)) = on_a_private_primary(&[]).await else {
        return;
    };
    let app = env.spawn(&REPLICATION_LONG_LIVED).await;
    until_feed(&app.http, "up").await;
    for outage in 1..=2 {
        primary.stop();
        tokio::time::sleep(Duration::from_secs(6)).await;
        primary.start().await;
        let back = Instant::now();
        let held = eventually(Duration::from_secs(10), async || {
            let Ok(mut admin) = PgConnection::connect(&env.db_url).await else {
                return false;
            };
            let active: Option<i32> = sqlx::query_scalar(
                "select active_pid from pg_replication_slots where database = $1",
            )
            .bind(&env.db_name)
            .fetch_optional(&mut admin)
            .await
            .ok()
            .flatten()
            .flatten();
            active.is_some()
        })
        .await;
        let held_after = back.elapsed();
        assert!(
            held,
            "outage {outage}: the slot was not held again within 10 s"
        );
        assert!(
            held_after < Duration::from_millis(650),
            "outage {outage}: the slot was held again {held_after:?} after PostgreSQL took connections"
        );
        let title = format!("made once PostgreSQL was back, {outage}");
        env.retitle(1, &title).await;
        read_within(&app.http, 1, &title, Duration::from_secs(2)).await;
    }
}

/// The change stream's connection cut, five times, and new connections
/// refused for 350 ms after each cut (a proxy ends it, then takes new ones,
/// as a restarted load balancer or a moved address does): each time the
/// instance reads the stream again as its client reconnects, so a post
/// changed at the cut is served in its new version within 300 ms of the
/// proxy's taking connections again, though the memory tier held the old
/// one. (Before, the reader retried on pauses of its own, 100 ms, then 200
/// and 400 ms, each read sent before the reconnection failing at once: the
/// change was served 350 ms or more after, every time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_stream_connection_is_read_again_as_it_reconnects() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(5, redis.url()).await;
    let proxy = postcache::testkit::TcpProxy::start(([127, 0, 0, 1], redis.port).into()).await;
    let via_proxy = format!("redis://{}", proxy.addr);
    let flags = [&REPLICATION_LONG_LIVED[..], &["--redis-url", &via_proxy]].concat();
    let app = env.spawn(&flags).await;
    until_feed(&app.http, "up").await;
    let mut took = Vec::new();
    for cut in 1..=5 {
        let title = format!("changed at cut {cut}");
        // In the memory tier.
        assert_ne!(app.http.title(2).await.as_deref(), Some(title.as_str()));
        proxy.refuse_new();
        assert!(
            proxy.cut_listeners() >= 1,
            "the stream's connection was cut"
        );
        env.retitle(2, &title).await;
        tokio::time::sleep(Duration::from_millis(350)).await;
        proxy.restore();
        let restored = Instant::now();
        read_within(&app.http, 2, &title, Duration::from_secs(5)).await;
        took.push(restored.elapsed());
        until_feed(&app.http, "up").await;
    }
    let slowest = took.iter().max().unwrap();
    assert!(
        *slowest < Duration::from_millis(300),
        "a change made at a cut was served {took:?} after the proxy took connections again"
    );
}

/// Instances say the change feed is down once the decoder's beats are 2 s
/// late (its process stopped, its connections open: nothing else tells),
/// and their memory tiers stop serving: not before 1.5 s, and by 3.5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_say_down_once_the_decoders_beats_are_2_s_late() {
    let env = TestEnv::new(5).await;
    let feed = [("CHANGE_FEED", "replication".to_owned())];
    let fleet: Vec<ServiceProcess> = join_all((0..2).map(|_| env.start_process(&feed))).await;
    until_one_decoder(&fleet, "one decoder").await;
    let held = decoders(&fleet).await;
    let (holder, watcher) = if held[0] == 1.0 { (0, 1) } else { (1, 0) };
    let watcher = &fleet[watcher].http;
    until_feed(watcher, "up").await;
    assert_eq!(watcher.metric("postcache_memory_tier_serving").await, 1.0);

    fleet[holder].signal("STOP");
    let stopped = Instant::now();
    until_feed(watcher, "down").await;
    let down_after = stopped.elapsed();
    let serving = watcher.metric("postcache_memory_tier_serving").await;
    fleet[holder].signal("CONT");

    assert!(
        (Duration::from_millis(1_500)..Duration::from_millis(3_500)).contains(&down_after),
        "down {down_after:?} after the decoder stopped"
    );
    assert_eq!(serving, 0.0, "the memory tier stopped serving");
}

/// The slot invalidated past `max_slot_wal_keep_size` while no decoder
/// read it (a private server: the fleet stopped, a change made, WAL written
/// past the slot's allowance, a checkpoint): the next instance finds it
/// invalidated, marks the gap, makes it again and raises the cutoff, so the
/// change the slot lost is served, and the gap is counted as such.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_invalidated_past_max_slot_wal_keep_size_is_a_gap_closed_by_the_cutoff() {
    let Some((_primary, env)) =
        on_a_private_primary(&["alter system set max_slot_wal_keep_size = '32MB'"]).await
    else {
        return;
    };
    let app = env.spawn(&REPLICATION_LONG_LIVED).await;
    until_feed(&app.http, "up").await;
    let before = app.http.title(3).await.expect("post 3");
    app.stop().await;

    env.retitle(3, "made while the slot fell behind").await;
    for _ in 0..4 {
        sqlx::query("create table if not exists filler (x text)")
            .execute(&env.admin)
            .await
            .unwrap();
        sqlx::query("insert into filler select repeat('x', 1000) from generate_series(1, 200)")
            .execute(&env.admin)
            .await
            .unwrap();
        sqlx::query("select pg_switch_wal()")
            .execute(&env.admin)
            .await
            .unwrap();
    }
    sqlx::query("checkpoint").execute(&env.admin).await.unwrap();
    let status: Option<String> =
        sqlx::query_scalar("select wal_status from pg_replication_slots where database = $1")
            .bind(&env.db_name)
            .fetch_one(&env.admin)
            .await
            .unwrap();
    assert_eq!(status.as_deref(), Some("lost"), "the slot is invalidated");

    let next = env.spawn(&REPLICATION_LONG_LIVED).await;
    until_titled(&next.http, 3, "made while the slot fell behind").await;
    let counted = r#"postcache_change_feed_gaps_total{why="slot_invalidated"}"#;
    assert!(next.http.metric(counted).await >= 1.0, "the gap is counted");
    assert_ne!(before, "made while the slot fell behind");
}

/// The slot dropped by hand (its walsender ended first): the changes made
/// meanwhile are unknown, so the fleet raises the cutoff once the slot is
/// made again, and says so; nothing read before is served as fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_dropped_by_hand_is_a_gap_closed_by_the_cutoff() {
    let env = TestEnv::new(5).await;
    let app = env.spawn(&["--change-feed", "replication"]).await;
    let gaps = r#"postcache_change_feed_gaps_total{why="slot_missing"}"#;
    for id in 1..=5 {
        app.http.title(id).await;
    }
    let (name, _) = slot(&env).await.expect("the fleet's slot");
    let before = app.http.metric(gaps).await;

    drop_slot_by_hand(&env, &name).await;
    // At once, before the slot is back: a change no slot records.
    env.retitle(3, "made in the gap").await;

    until_titled(&app.http, 3, "made in the gap").await;
    assert!(app.http.metric(gaps).await > before, "the gap is counted");
    assert!(slot(&env).await.is_some(), "the slot is made again");
    until_feed(&app.http, "up").await;
}

/// An instance marked the gap and made the slot, then died before it
/// raised the cutoff (played here by hand, with no instance running): the
/// next instance to hold the slot raises it before anything else, so the
/// change no slot recorded is not hidden behind the value Redis kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gap_left_open_by_a_dead_instance_is_closed_by_the_next_holder() {
    let env = TestEnv::new(5).await;
    let app = env.spawn(&["--change-feed", "replication"]).await;
    app.http.title(3).await;
    let (name, _) = slot(&env).await.expect("the fleet's slot");
    app.stop().await;

    drop_slot_by_hand(&env, &name).await;
    env.retitle(3, "made in the gap").await;
    let gap = env.keys.feed_gap();
    env.set(&gap, "slot_missing", Duration::from_secs(600))
        .await;
    sqlx::query("select pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&name)
        .execute(&env.admin)
        .await
        .unwrap();

    // A process of its own: its metrics count its own gaps only.
    let feed = [("CHANGE_FEED", "replication".to_owned())];
    let next = env.start_process(&feed).await;
    until_titled(&next.http, 3, "made in the gap").await;
    let counted = r#"postcache_change_feed_gaps_total{why="slot_missing"}"#;
    assert_eq!(next.http.metric(counted).await, 1.0, "the gap is counted");
    assert_eq!(env.pttl(&gap).await, -2, "the mark is cleared");
}

/// One transaction updates 100,000 posts: past the bound, it is one raise
/// of the cutoff, not 100,000 applications.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_of_100_000_updates_is_one_cutoff() {
    let env = TestEnv::new(100_000).await;
    let app = env.spawn(&["--change-feed", "replication"]).await;
    for id in [1, 50_000, 100_000] {
        app.http.title(id).await;
    }
    let updates = r#"postcache_changes_applied_total{op="update"}"#;
    let all = r#"postcache_changes_applied_total{op="all"}"#;
    let (updates_before, all_before) = (app.http.metric(updates).await, app.http.metric(all).await);

    sqlx::query("update posts set title = 'bulk ' || id")
        .execute(&env.admin)
        .await
        .unwrap();

    for id in [1, 50_000, 100_000] {
        until_titled(&app.http, id, &format!("bulk {id}")).await;
    }
    assert_eq!(app.http.metric(all).await - all_before, 1.0);
    assert_eq!(app.http.metric(updates).await, updates_before);
    let ready = app.get("/readyz").await.json();
    assert_eq!(ready["change_feed_mode"], "replication");
    assert!(ready["change_feed_lag_bytes"].is_u64(), "{ready}");
}

/// Redis restarted (empty) while rows change and two instances read them
/// all along (each keeping what it is shown, for ten minutes). Posts 11 to
/// 20 change once, while Redis is away; the second instance reaches Redis
/// through a proxy that stays cut a second longer, so that the decoder (the
/// first) has applied and announced those changes before it reads the
/// stream again, from its end. What its memory tier held is forgotten then
/// (the stream may have lost entries), so every instance serves every
/// post's last version within 2 s of the last change. (Seen failing with
/// the memory tier kept, neither emptied nor its beats forgotten, when the
/// stream is read again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_restarted_while_rows_change_loses_no_change() {
    let mut redis = RedisServer::start().await;
    let env = TestEnv::with_redis(20, redis.url()).await;
    let proxy = postcache::testkit::TcpProxy::start(([127, 0, 0, 1], redis.port).into()).await;
    let flags = [
        "--change-feed",
        "replication",
        "--redis-timeout",
        "200ms",
        "--cache-ttl",
        "600s",
        "--l1-ttl",
        "600s",
    ];
    let decoder = env.spawn(&flags).await;
    until_feed(&decoder.http, "up").await;
    let through_proxy = format!("redis://{}", proxy.addr);
    let late = env
        .spawn(&[&flags[..], &["--redis-url", &through_proxy]].concat())
        .await;
    until_feed(&late.http, "up").await;
    let apps = [decoder, late];
    let readers: Vec<_> = apps.iter().map(|app| keep_reading(&app.http, 20)).collect();
    let writer = keep_writing(&env, 30, 10);
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.cut();
    redis.kill();
    // Changed once, while Redis is away: no later change hides their loss.
    retitle_all(&env, 11..=20, "while redis was away").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.restart().await;
    // The decoder applies and announces them; the late instance, still
    // cut off, hears nothing of it (its last beat is under 2 s old).
    tokio::time::sleep(Duration::from_millis(700)).await;
    proxy.restore();
    writer.await.unwrap();
    let last_change = Instant::now();

    for app in &apps {
        all_titled_within(&app.http, 10, "round 29", Duration::from_secs(2)).await;
        titled_within(
            &app.http,
            11..=20,
            "while redis was away",
            Duration::from_secs(2),
        )
        .await;
    }
    let converged = last_change.elapsed();
    for reader in readers {
        reader.abort();
    }
    println!("every instance served every last version {converged:?} after the last change");
}

/// A role that may write `posts` and nothing else, connected directly.
struct Writer {
    role: String,
    conn: PgConnection,
    env_admin: sqlx::PgPool,
}

impl Writer {
    async fn new(env: &TestEnv) -> Self {
        let role = format!(
            "writer_{}",
            env.db_name.trim_start_matches("postcache_test_")
        );
        for sql in [
            format!("create role {role} login"),
            format!("grant usage on schema public to {role}"),
            format!("grant select, insert, update, delete on posts to {role}"),
        ] {
            sqlx::query(&sql).execute(&env.admin).await.unwrap();
        }
        let url = env
            .db_url
            .replacen("postgres@", &format!("{role}@"), 1)
            .replacen("://postgres", &format!("://{role}"), 1);
        let conn = PgConnection::connect(&url)
            .await
            .expect("the writer connects");
        Self {
            role,
            conn,
            env_admin: env.admin.clone(),
        }
    }

    async fn execute(&mut self, sql: &str) -> Result<(), String> {
        sqlx::query(sql)
            .execute(&mut self.conn)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    async fn drop_role(self) {
        let Self {
            role,
            conn,
            env_admin,
        } = self;
        let _ = conn.close().await;
        for sql in [format!("drop owned by {role}"), format!("drop role {role}")] {
            sqlx::query(&sql).execute(&env_admin).await.unwrap();
        }
    }
}

/// The trigger mode: an ordinary writer needs no grant on the outbox, cannot
/// write it (no forged `invalidate_all`, no far-future xid), and cannot turn
/// the capture off; a row written by its owner gets its xid and time from
/// the trigger, whatever the insert said.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_trigger_mode_no_writer_can_forge_or_hide_a_change() {
    let env = TestEnv::new(5).await;
    let app = env.spawn(&["--change-feed", "trigger"]).await;
    for id in 1..=5 {
        app.http.title(id).await;
    }
    let mut writer = Writer::new(&env).await;

    let forged = writer
        .execute("insert into post_changes (post_id, op) values (null, 'invalidate_all')")
        .await;
    let hidden = async {
        writer.execute("set postcache.capture = off").await.unwrap();
        writer
            .execute("update posts set title = 'unseen?' where id = 1")
            .await
    }
    .await;
    let replica = writer
        .execute("set session_replication_role = replica")
        .await;
    until_titled(&app.http, 1, "unseen?").await;
    writer
        .execute("update posts set title = 'by the writer' where id = 2")
        .await
        .unwrap();
    until_titled(&app.http, 2, "by the writer").await;
    writer.drop_role().await;

    // The owner's own insert, claiming a far-future xid and an odd time.
    sqlx::query(
        "insert into post_changes (post_id, op, xid, changed_at)
         values (4, 'update', '99999999999', 'infinity')",
    )
    .execute(&env.admin)
    .await
    .unwrap();
    let (xid_ok, time_ok): (bool, bool) = sqlx::query_as(
        "select xid::text::bigint < 99999999999, changed_at < 'infinity'
         from post_changes order by id desc limit 1",
    )
    .fetch_one(&env.admin)
    .await
    .unwrap();
    // And the feed goes on.
    env.retitle(5, "after the odd row").await;
    until_titled(&app.http, 5, "after the odd row").await;

    assert!(
        forged
            .as_ref()
            .is_err_and(|e| e.contains("permission denied")),
        "{forged:?}"
    );
    assert!(hidden.is_ok(), "the writer's update itself succeeds");
    assert!(
        replica
            .as_ref()
            .is_err_and(|e| e.contains("permission denied")),
        "{replica:?}"
    );
    assert!(xid_ok && time_ok, "the trigger sets xid and changed_at");
}

/// Replication: writers are untouched (no capture trigger fires, no outbox
/// row is written), and a writer's session settings hide nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_replication_mode_writers_are_untouched_and_cannot_hide_a_change() {
    let env = TestEnv::new(5).await;
    let app = env.spawn(&["--change-feed", "replication"]).await;
    for id in 1..=5 {
        app.http.title(id).await;
    }
    let outbox = async || -> i64 {
        sqlx::query_scalar("select count(*) from post_changes")
            .fetch_one(&env.admin)
            .await
            .unwrap()
    };
    let rows_before = outbox().await;
    let mut writer = Writer::new(&env).await;
    writer.execute("set postcache.capture = off").await.unwrap();
    writer
        .execute("update posts set title = 'seen' where id = 1")
        .await
        .unwrap();
    writer
        .execute("delete from posts where id = 2")
        .await
        .unwrap();
    until_titled(&app.http, 1, "seen").await;
    wait_until("the delete", A_WHILE, async || {
        app.get("/posts/2").await.status == 404
    })
    .await;
    let enabled: i64 = sqlx::query_scalar(
        "select count(*) from pg_trigger
         where tgrelid = 'posts'::regclass and tgname like 'posts_capture_%' and tgenabled <> 'D'",
    )
    .fetch_one(&env.admin)
    .await
    .unwrap();
    let rows_after = outbox().await;
    writer.drop_role().await;

    assert_eq!(enabled, 0, "no capture trigger fires in replication mode");
    assert_eq!(rows_after, rows_before, "no outbox row is written");
}

/// A private PostgreSQL with `wal_level = replica`, run as the `postgres`
/// user in a temporary directory on a free port; stopped when dropped.
struct ReplicaLevelServer {
    dir: std::path::PathBuf,
    port: u16,
}

impl ReplicaLevelServer {
    const BIN: &str = "/usr/lib/postgresql/15/bin";

    fn as_postgres(args: &[&str]) -> std::process::Output {
        let as_root = std::process::Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
        let mut command = if as_root {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]);
            c
        } else {
            std::process::Command::new("env")
        };
        command.args(args).output().expect("runs")
    }

    fn start() -> Option<Self> {
        if !std::path::Path::new(Self::BIN).exists() {
            return None;
        }
        let dir =
            std::env::temp_dir().join(format!("postcache-pg-{}", postcache::testkit::free_port()));
        std::fs::create_dir_all(&dir).unwrap();
        let _ = std::process::Command::new("chown")
            .args(["postgres:postgres", dir.to_str().unwrap()])
            .status();
        let data = dir.join("data");
        let initdb = format!("{}/initdb", Self::BIN);
        let out = Self::as_postgres(&[
            &initdb,
            "-D",
            data.to_str().unwrap(),
            "-U",
            "postgres",
            "--auth=trust",
        ]);
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = postcache::testkit::free_port();
        let conf = format!(
            "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nwal_level = replica\nfsync = off\n",
            dir.display()
        );
        let settings = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&settings).unwrap();
        text.push_str(&conf);
        std::fs::write(&settings, text).unwrap();
        let pg_ctl = format!("{}/pg_ctl", Self::BIN);
        let log = dir.join("log");
        let out = Self::as_postgres(&[
            &pg_ctl,
            "-D",
            data.to_str().unwrap(),
            "-l",
            log.to_str().unwrap(),
            "-w",
            "start",
        ]);
        assert!(
            out.status.success(),
            "pg_ctl start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(Self { dir, port })
    }

    fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }
}

impl Drop for ReplicaLevelServer {
    fn drop(&mut self) {
        let pg_ctl = format!("{}/pg_ctl", Self::BIN);
        let data = self.dir.join("data");
        Self::as_postgres(&[
            &pg_ctl,
            "-D",
            data.to_str().unwrap(),
            "-m",
            "immediate",
            "stop",
        ]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// On a server whose `wal_level` is `replica`, CHANGE_FEED=auto follows
/// the outbox trigger, and says so; CHANGE_FEED=replication is refused
/// (the feed stays down, the service serves).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_server_without_logical_decoding_auto_is_the_trigger_mode() {
    let Some(server) = ReplicaLevelServer::start() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "PostgreSQL 15's binaries are needed in CI"
        );
        eprintln!("skipped: no PostgreSQL 15 binaries");
        return;
    };
    let env = TestEnv::new(3).await;
    let url = server.url("postcache");
    let settings = postcache::config::DatabaseSettings {
        database_url: url.clone(),
        db_max_connections: 2,
        db_acquire_timeout: Duration::from_secs(10),
        db_statement_timeout: Duration::from_secs(30),
        db_tcp_keepalive: Duration::from_secs(5),
        db_tcp_user_timeout: Duration::from_secs(10),
    };
    postcache::store::migrate(&settings).await.unwrap();
    sqlx::query("insert into posts (id, title, body, author) values (1, 'one', 'b', 'a')")
        .execute(&mut PgConnection::connect(&url).await.unwrap())
        .await
        .unwrap();

    let auto = env.spawn(&["--database-url", &url]).await;
    let ready = auto.get("/readyz").await.json();
    assert_eq!(ready["change_feed_mode"], "trigger", "{ready}");
    assert_eq!(ready["change_feed"], "up", "{ready}");
    auto.http.title(1).await;
    sqlx::query("update posts set title = 'changed' where id = 1")
        .execute(&mut PgConnection::connect(&url).await.unwrap())
        .await
        .unwrap();
    until_titled(&auto.http, 1, "changed").await;

    let asked = env
        .spawn(&["--database-url", &url, "--change-feed", "replication"])
        .await;
    let ready = asked.get("/readyz").await.json();
    assert_eq!(ready["change_feed"], "down", "{ready}");
    assert!(ready["change_feed_mode"].is_null(), "{ready}");
    assert_eq!(asked.get("/posts/1").await.status, 200);
}

/// A synchronous standby that never comes: a session that asks for it
/// waits at its commit, written and not visible; every other session
/// commits without waiting for it.
const WAITING_FOR_NOBODY: [&str; 2] = [
    "alter system set synchronous_standby_names = 'nobody'",
    "alter system set synchronous_commit = 'local'",
];

/// Retitles post 3 to "held by the standby" in a session whose commit waits
/// for a synchronous standby that never comes (the server's
/// `synchronous_standby_names = 'nobody'`): returns once the commit waits,
/// written and not visible.
async fn hold_a_commit(env: &TestEnv) -> tokio::task::JoinHandle<sqlx::Result<()>> {
    let mut writer = PgConnection::connect(&env.db_url).await.unwrap();
    let held = tokio::spawn(async move {
        sqlx::query("set synchronous_commit = on")
            .execute(&mut writer)
            .await?;
        sqlx::query("update posts set title = 'held by the standby' where id = 3")
            .execute(&mut writer)
            .await
            .map(drop)
    });
    wait_until("the commit to wait for the standby", A_WHILE, async || {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pg_stat_activity where wait_event = 'SyncRep'",
        )
        .fetch_one(&env.admin)
        .await
        .unwrap()
            == 1
    })
    .await;
    held
}

/// Cancels the wait of [`hold_a_commit`]'s session: its commit stands
/// (PostgreSQL warns that it is not replicated) and becomes visible.
async fn release_held(env: &TestEnv, held: tokio::task::JoinHandle<sqlx::Result<()>>) {
    sqlx::query("select pg_cancel_backend(pid) from pg_stat_activity where wait_event = 'SyncRep'")
        .execute(&env.admin)
        .await
        .unwrap();
    held.await.unwrap().expect("the update commits locally");
}

/// PostgreSQL hands a commit to logical decoding once its record is
/// flushed, a moment before new snapshots see it; a synchronous standby
/// holds it there until it confirms. Played here with a standby that never
/// comes (`synchronous_standby_names = 'nobody'`): the write's session
/// waits, committed but not visible, while a read misses and loads the
/// post. Were the change applied meanwhile, that load would read the old
/// row after it and store it, and the post would read old until
/// CACHE_TTL; the decoder applies it only once it is visible, so the post
/// reads new soon after the wait is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_decoded_before_it_is_visible_is_not_hidden_by_a_load_of_the_old_row() {
    let Some((_primary, env)) = on_a_private_primary(&WAITING_FOR_NOBODY).await else {
        return;
    };
    // No memory tier: every read after the change goes to Redis.
    let mut args = REPLICATION_LONG_LIVED.to_vec();
    args.extend(["--l1-max-bytes", "0"]);
    let app = env.spawn(&args).await;
    until_feed(&app.http, "up").await;
    let old = app.http.title(3).await.expect("post 3");

    let held = hold_a_commit(&env).await;
    // Time for the decoder to read the commit, then reads while it is not
    // visible: the old title, and whatever they load is stored.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..3 {
        assert_eq!(app.http.title(3).await.as_deref(), Some(old.as_str()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Cancelled, the commit stands (PostgreSQL warns that it is not
    // replicated) and becomes visible.
    release_held(&env, held).await;
    let visible: String = sqlx::query_scalar("select title from posts where id = 3")
        .fetch_one(&env.admin)
        .await
        .unwrap();
    assert_eq!(visible, "held by the standby");
    read_within(&app.http, 3, "held by the standby", Duration::from_secs(2)).await;
}

/// A read past the cache says in `PostCache-LSN` only a position whose
/// commits it reflects. With a commit held by a synchronous standby that
/// never comes (written, not visible), a read asking for no staleness at
/// all reads the primary and gets the old row: its position must come
/// before the held commit. (It was the primary's WAL insert position, past
/// the held commit: a client sending it back elsewhere as
/// `PostCache-Min-LSN` was owed a version this answer did not have.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_past_the_cache_names_no_commit_it_does_not_reflect() {
    let Some((_primary, env)) = on_a_private_primary(&WAITING_FOR_NOBODY).await else {
        return;
    };
    let app = env.spawn(&REPLICATION_LONG_LIVED).await;
    until_feed(&app.http, "up").await;
    let old = app.http.title(3).await.expect("post 3");

    let held = hold_a_commit(&env).await;
    // Past the held commit's record.
    let written: i64 =
        sqlx::query_scalar("select (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
            .fetch_one(&env.admin)
            .await
            .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let reply = app
        .http
        .send(
            reqwest::Method::GET,
            "/posts/3",
            &[("PostCache-Max-Staleness", "0ms")],
        )
        .await
        .unwrap();
    assert_eq!(reply.json()["title"], old.as_str(), "not visible yet");
    assert_eq!(reply.x_cache.as_deref(), Some("bypass"));
    let said = reply
        .headers
        .get("postcache-lsn")
        .map(|v| postcache::http::position::parse_lsn(v.to_str().unwrap()).unwrap());
    assert!(
        said.is_none_or(|lsn| lsn < written as u64),
        "PostCache-LSN {said:?} names the held commit (written by {written})"
    );

    release_held(&env, held).await;
    read_within(&app.http, 3, "held by the standby", Duration::from_secs(2)).await;
}
