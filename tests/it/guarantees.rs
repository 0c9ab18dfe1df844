//! Guarantees that must hold under faults: the breaker recovers whatever
//! happens to its probe, a deleted post never comes back, a failed refresh
//! never degrades a servable entry, and a stale leader never overwrites a
//! newer value.

use std::time::{Duration, Instant};

use futures::future::join_all;
use postcache::{
    cache::{Entry, ItemKeys, Status},
    redis::{Finish, RedisCommands, StoreFor},
    testkit::{
        answered, fire, wait_until, HeldLoad, RedisServer, TableLock, TcpProxy, TestEnv, A_WHILE,
        PATIENT,
    },
};

/// The breaker's cooldown (500 ms) and a margin.
const PAST_THE_COOLDOWN: Duration = Duration::from_millis(600);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_probe_cancelled_by_its_client_does_not_keep_the_breaker_open() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(20, redis.url()).await;
    let app = env.spawn(&["--redis-timeout", "250ms"]).await;
    assert_eq!(app.get("/posts/1").await.x_cache.as_deref(), Some("miss"));

    redis.cli(&["client", "pause", "2500", "all"]);
    let paused = Instant::now();
    for id in 2..=6 {
        let reply = app.get(&format!("/posts/{id}")).await;
        assert_eq!(
            reply.x_cache.as_deref(),
            Some("bypass"),
            "the breaker opens"
        );
    }
    // The next request after the cooldown is the half-open probe; its client
    // gives up after 80 ms, so its future is dropped mid-command.
    tokio::time::sleep(PAST_THE_COOLDOWN).await;
    let cancelled = tokio::time::timeout(Duration::from_millis(80), app.get("/posts/7")).await;
    assert!(cancelled.is_err(), "the probe returned within 80 ms");
    tokio::time::sleep_until((paused + Duration::from_millis(2_600)).into()).await;

    // Redis answers again; nothing has passed the breaker since.
    let ready = app.get("/readyz").await;
    assert_eq!(ready.json()["redis"], "circuit_open", "{}", ready.text());
    wait_until("caching to resume", Duration::from_secs(5), async || {
        app.get("/posts/8").await.x_cache.as_deref() != Some("bypass")
    })
    .await;
    assert_eq!(app.get("/readyz").await.json()["redis"], "up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_redis_opens_the_breaker_instead_of_counting_as_up() {
    let redis = RedisServer::start().await;
    redis.cli(&["config", "set", "lua-time-limit", "50"]);
    let env = TestEnv::with_redis(10, redis.url()).await;
    let app = env.spawn(&["--redis-timeout", "250ms"]).await;
    assert_eq!(app.get("/posts/1").await.x_cache.as_deref(), Some("miss"));

    // A script that never ends: past lua-time-limit, every other command
    // gets a BUSY error reply at once.
    let mut script = std::process::Command::new("redis-cli")
        .args([
            "-p",
            &redis.port.to_string(),
            "eval",
            "while true do end",
            "0",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_until("Redis to answer BUSY", A_WHILE, async || {
        redis.cli(&["ping"]).starts_with("BUSY")
    })
    .await;
    for id in 2..=6 {
        let reply = app.get(&format!("/posts/{id}")).await;
        assert_eq!(
            (reply.status, reply.x_cache.as_deref()),
            (200, Some("bypass"))
        );
        assert_eq!(reply.cache_status(), Some("postcache; fwd=bypass"));
    }
    redis.cli(&["script", "kill"]);
    let ready = app.get("/readyz").await;
    let _ = script.kill();
    let _ = script.wait();

    // Within the cooldown, Redis answers PING but the breaker is open.
    assert_eq!(ready.json()["redis"], "circuit_open", "{}", ready.text());
}

/// The load that finds a post gone (here with the change feed off, so that
/// only the load can tell) turns its fail-safe copy into a tombstone: when
/// loads fail afterwards, the answer is 404, never the deleted post.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_post_never_comes_back_from_the_fail_safe_copy() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&[
            "--failure-ttl",
            "5s",
            "--max-stale",
            "1h",
            "--change-feed",
            "off",
            // Without a feed, the memory tier would serve the deleted post
            // for L1_TTL; what is tested is Redis's copy.
            "--l1-max-bytes",
            "0",
        ])
        .await;
    assert_eq!(app.get("/posts/3").await.x_cache.as_deref(), Some("miss"));
    env.stored(3).await.expect("stored");
    let hour = 3_600_000;
    assert!(
        env.pttl(&env.keys.value(3)).await > hour,
        "the entry is kept as the copy"
    );

    sqlx::query("delete from posts where id = 3")
        .execute(&env.admin)
        .await
        .unwrap();
    env.expire_freshness(3).await;
    let gone = app.get("/posts/3").await;
    assert_eq!((gone.status, gone.x_cache.as_deref()), (404, Some("miss")));
    let copy = env
        .stored(3)
        .await
        .expect("a tombstone in place of the copy");
    assert_eq!(
        copy.status(),
        Status::NotFound,
        "the not-found replaced the copy"
    );
    assert!(
        env.pttl(&env.keys.value(3)).await > hour,
        "kept as long as the copy would have been"
    );
    env.expire_freshness(3).await;
    env.break_posts(true).await;
    let failed = app.get("/posts/3").await;
    env.break_posts(false).await;

    assert_eq!(
        (failed.status, failed.x_cache.as_deref()),
        (404, Some("stale")),
        "not the deleted post: {}",
        failed.text()
    );
    assert!(!failed.text().contains("title"), "{}", failed.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_not_found_entry_is_never_refreshed_early() {
    let env = TestEnv::new(1).await;
    let before = env.post_reads().await;
    let app = env
        .spawn(&["--negative-ttl", "3s", "--early-refresh-beta", "1000000"])
        .await;
    assert_eq!(app.get("/posts/42").await.status, 404);
    let stored = env.stored(42).await.expect("a not-found entry");

    for _ in 0..30 {
        assert_eq!(app.get("/posts/42").await.x_cache.as_deref(), Some("hit"));
    }
    app.stop().await;

    assert_eq!(
        env.stored(42).await,
        Some(stored),
        "the same entry, no reload"
    );
    assert_eq!(env.post_reads().await - before, 1, "one load: the miss");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_early_refresh_leaves_a_fresh_entry_as_it_is() {
    let env = TestEnv::new(5).await;
    // β so large that every hit refreshes: the refresh after the break fails.
    let app = env
        .spawn(&["--cache-ttl", "60s", "--early-refresh-beta", "1000000"])
        .await;
    assert_eq!(app.get("/posts/2").await.x_cache.as_deref(), Some("miss"));
    let failed_loads = async || {
        let metrics = app.get("/metrics").await.text();
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(r#"postcache_db_loads_total{result="failed"} "#))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    let failed_before = failed_loads().await;
    env.break_posts(true).await;
    let stored = env.stored(2).await.expect("stored");

    assert_eq!(app.get("/posts/2").await.x_cache.as_deref(), Some("hit"));
    wait_until("the refresh to fail", A_WHILE, async || {
        failed_loads().await > failed_before
    })
    .await;
    let after = app.get("/posts/2").await;
    env.break_posts(false).await;

    assert_eq!((after.status, after.x_cache.as_deref()), (200, Some("hit")));
    assert!(
        after.headers.get("warning").is_none(),
        "not served as stale"
    );
    let kept = env.stored(2).await.expect("still stored");
    assert_eq!(kept.stored_at(), stored.stored_at(), "left as it was");
    assert!(!kept.is_backoff());
}

/// A found entry loaded now, fresh for a minute.
fn found(body: &[u8]) -> Entry {
    Entry::new(Status::Found, body, Duration::from_secs(60), Duration::ZERO)
}

/// Two leaders of one key: the first's lock expired and the second took it.
async fn two_leaders(env: &TestEnv) -> (RedisCommands, Entry, Entry) {
    let commands = RedisCommands::new(env.redis.clone(), Duration::from_secs(1));
    let keys = env.keys.item(9);
    assert!(commands
        .claim(&keys, "old-leader", Duration::from_millis(50))
        .await
        .unwrap()
        .is_some());
    let older = found(br#"{"v":"old"}"#);
    tokio::time::sleep(Duration::from_millis(80)).await;
    assert!(commands
        .claim(&keys, "new-leader", Duration::from_secs(10))
        .await
        .unwrap()
        .is_some());
    let newer = found(br#"{"v":"new"}"#);
    (commands, older, newer)
}

const STORE: StoreFor = StoreFor {
    value: Duration::from_secs(60),
    tombstone: Duration::from_secs(120),
    failure: Duration::from_secs(5),
};

/// A finish with STORE, no fence seen, and no cutoff.
fn finish<'a>(keys: &'a ItemKeys, token: &'a str, entry: &'a Entry) -> Finish<'a> {
    Finish {
        keys,
        token,
        entry,
        store: STORE,
        fence: "",
        cutoff: 0,
        sharded: false,
    }
}

#[tokio::test]
async fn a_stale_leader_finishing_last_does_not_overwrite_the_newer_value() {
    let env = TestEnv::new(0).await;
    let (commands, older, newer) = two_leaders(&env).await;
    let keys = env.keys.item(9);

    commands
        .eval(&finish(&keys, "new-leader", &newer))
        .await
        .unwrap();
    let stale = commands
        .eval(&finish(&keys, "old-leader", &older))
        .await
        .unwrap();
    let failed = Entry::new(Status::Failed, b"", Duration::ZERO, Duration::ZERO);
    let stale_failure = commands
        .eval(&finish(&keys, "old-leader", &failed))
        .await
        .unwrap();

    assert_eq!(env.stored(9).await, Some(newer.clone()));
    assert_eq!(
        stale.published,
        Some(newer.clone()),
        "it publishes what is stored"
    );
    assert_eq!(stale_failure.published, Some(newer.clone()));
}

#[tokio::test]
async fn a_stale_leader_finishing_first_does_not_store_over_the_new_leaders_load() {
    let env = TestEnv::new(0).await;
    let (commands, older, newer) = two_leaders(&env).await;
    let keys = env.keys.item(9);

    let stale = commands
        .eval(&finish(&keys, "old-leader", &older))
        .await
        .unwrap();
    let stored_meanwhile = env.stored(9).await;

    let fresh = commands
        .eval(&finish(&keys, "new-leader", &newer))
        .await
        .unwrap();

    assert!(
        !stale.released,
        "the new leader's lock is not the stale one's"
    );
    assert_eq!(stored_meanwhile, None, "the stale leader stored nothing");
    assert!(fresh.released);
    assert_eq!(env.stored(9).await, Some(newer));
    assert_eq!(env.pttl(&keys.lock).await, -2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_finish_blocked_by_a_write_pause_is_retried_and_every_waiter_answered() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(10, redis.url()).await;
    let flags = [PATIENT, &["--redis-timeout", "250ms"]].concat();
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;
    let lock = TableLock::take(&env).await;
    let requests = fire(&apps, "/posts/5", 40);
    env.until_held(&apps, 40).await;
    env.until_subscribed(5).await;

    // Writes stall just as the load returns: the finish script times out.
    let pause = Duration::from_millis(800);
    redis.cli(&["client", "pause", &pause.as_millis().to_string(), "write"]);
    let released = lock.release().await;
    let replies: Vec<_> = answered(requests).await;

    let statuses: Vec<u16> = replies.iter().map(|(r, _)| r.status).collect();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let slowest = replies.iter().map(|(_, at)| *at - released).max().unwrap();
    assert!(
        slowest < pause + Duration::from_millis(500),
        "the last waiter answered {slowest:?} after the load"
    );
    wait_until("the lock to go", Duration::from_secs(2), async || {
        !env.lock_held(5).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_on_a_connection_that_stops_answering_ends_at_load_timeout() {
    let env = TestEnv::new(10).await;
    let (proxy, app) = env
        .spawn_proxied(&[
            "--db-statement-timeout",
            "1s",
            "--load-timeout",
            "1500ms",
            "--db-acquire-timeout",
            "30s",
            "--wait-timeout",
            "800ms",
            "--failure-ttl",
            "0s",
        ])
        .await;
    // A pooled connection through the proxy, which then stops forwarding:
    // the server never sees the query, so its statement timeout never fires.
    assert_eq!(app.get("/readyz").await.status, 200);
    proxy.stall(true);
    let started = Instant::now();
    let owner = app.http.spawn_get("/posts/3");
    wait_until("the load to start", A_WHILE, async || {
        app.reads_in_progress() >= 1
    })
    .await;
    let joiners = join_all(fire(std::slice::from_ref(&app), "/posts/3", 5)).await;
    let (owner, owner_at) = owner.await.unwrap();
    proxy.stall(false);

    for joined in joiners {
        let (reply, at) = joined.unwrap();
        assert_eq!(reply.status, 504, "a joiner waits WAIT_TIMEOUT at most");
        assert!(
            at - started < Duration::from_millis(1_400),
            "{:?}",
            at - started
        );
    }
    assert_eq!(owner.status, 503, "the load gave up");
    let took = owner_at - started;
    assert!(
        took >= Duration::from_millis(1_400) && took < Duration::from_millis(3_000),
        "the load ended {took:?} after it began"
    );
    assert!(!env.lock_held(3).await, "no lock left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_past_its_deadline_neither_leads_nor_loads() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(10, redis.url()).await;
    env.claim(4, "stuck", Duration::from_secs(10)).await;
    let before = env.post_reads().await;
    let app = env
        .spawn(&["--wait-timeout", "1s", "--redis-timeout", "400ms"])
        .await;

    let started = Instant::now();
    let request = app.http.spawn_get("/posts/4");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Writes stall from before the deadline to well after it: a lock
    // attempt past the deadline would time out and fail open to the database.
    redis.cli(&["client", "pause", "3000", "write"]);
    let (reply, at) = request.await.unwrap();
    app.stop().await;

    assert_eq!(reply.status, 504, "{}", reply.text());
    let took = at - started;
    assert!(
        took < Duration::from_millis(1_300),
        "answered after {took:?}"
    );
    assert_eq!(
        env.post_reads().await - before,
        0,
        "no load past the deadline"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_whose_pubsub_connection_is_killed_subscribe_again_and_are_woken() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(10, redis.url()).await;
    crate::scenarios::waiters_survive_a_killed_pubsub_connection(&env, || {
        redis.cli(&["client", "kill", "type", "pubsub"]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_subscribe_that_timed_out_leaves_no_subscription_behind() {
    let env = TestEnv::new(10).await;
    let redis: std::net::SocketAddr = env
        .redis_url
        .trim_start_matches("redis://")
        .parse()
        .expect("a host:port Redis URL");
    let proxy = TcpProxy::start(redis).await;
    env.claim(2, "outsider", Duration::from_secs(10)).await;
    let app = env
        .spawn(&[
            "--redis-url",
            &format!("redis://{}", proxy.addr),
            "--redis-timeout",
            "200ms",
        ])
        .await;

    // The waiter's SUBSCRIBE is held past REDIS_TIMEOUT: it fails open...
    proxy.hold_subscribes(true);
    let reply = app.get("/posts/2").await;
    // ...and then reaches Redis after all, for a listener long gone.
    proxy.hold_subscribes(false);
    tokio::time::sleep(Duration::from_millis(300)).await;

    assert_eq!(
        (reply.status, reply.x_cache.as_deref()),
        (200, Some("bypass"))
    );
    let channel = env.keys.channel(2);
    wait_until("no subscription left", Duration::from_secs(5), async || {
        env.numsub(&channel).await == 0 && app.state.read_path.subscriber().channels() == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_whose_resubscription_is_held_still_hears_of_the_finish() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(10, redis.url()).await;
    let proxy = TcpProxy::start(([127, 0, 0, 1], redis.port).into()).await;
    let via_proxy = format!("redis://{}", proxy.addr);
    let flags = [
        PATIENT,
        &["--redis-url", &via_proxy, "--redis-timeout", "200ms"],
    ]
    .concat();
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;
    let lock = TableLock::take(&env).await;
    let requests = fire(&apps, "/posts/6", 20);
    env.until_held(&apps, 20).await;
    env.until_subscribed(6).await;

    // The waiting instance's pub/sub connection drops; it reconnects, but
    // its SUBSCRIBE is held until after the leader has published.
    proxy.hold_subscribes(true);
    redis.cli(&["client", "kill", "type", "pubsub"]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let released = lock.release().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.hold_subscribes(false);
    let replies = answered(requests).await;

    assert!(replies.iter().all(|(r, _)| r.status == 200));
    let slowest = replies.iter().map(|(_, at)| *at - released).max().unwrap();
    assert!(
        slowest < Duration::from_millis(2_500),
        "the last waiter answered {slowest:?} after the release"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_attempt_that_timed_out_leaves_no_lock_behind() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(10, redis.url()).await;
    let apps = join_all((0..2).map(|_| env.spawn(&["--redis-timeout", "200ms"]))).await;

    // Both the GET and the SET NX time out: the request fails open. The SET
    // still runs when the pause ends, taking a lock nobody will finish.
    redis.cli(&["client", "pause", "1000", "all"]);
    let stalled = apps[0].get("/posts/3").await;
    assert_eq!(redis.cli(&["ping"]), "PONG", "the pause is over");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let after = apps[1].get("/posts/3").await;
    let took = started.elapsed();

    assert_eq!(
        (stalled.status, stalled.x_cache.as_deref()),
        (200, Some("bypass"))
    );
    assert_eq!(
        (after.status, after.x_cache.as_deref()),
        (200, Some("miss"))
    );
    assert!(took < Duration::from_secs(1), "answered after {took:?}");
    assert!(!env.lock_held(3).await, "no lock left");
}

/// A leader's finish is never refused by its instance's open breaker:
/// between its load and its finish, that instance's Redis connections
/// stall long enough for its breaker to open, then answer again; the
/// finish goes through at once (no probe, no cooldown), so the waiter on
/// another instance is answered within milliseconds, and the post is
/// stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_finish_is_never_refused_by_an_open_breaker() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(10, redis.url()).await;
    let proxy = TcpProxy::start(([127, 0, 0, 1], redis.port).into()).await;
    let load = HeldLoad::first();
    let through_proxy = format!("redis://{}", proxy.addr);
    let leader_flags = [
        PATIENT,
        &["--redis-url", &through_proxy, "--redis-timeout", "200ms"],
    ]
    .concat();
    let leader = env.spawn_with_hooks(&leader_flags, load.hooks()).await;
    let other = env.spawn(PATIENT).await;

    let leading = leader.http.spawn_get("/posts/7");
    load.until_held().await;
    let waiting = other.http.spawn_get("/posts/7");
    env.until_subscribed(7).await;
    // The leader's instance loses Redis until its breaker opens.
    proxy.stall(true);
    let breaker = "postcache_redis_breaker_state";
    for id in 1..=4 {
        assert_eq!(
            leader.get(&format!("/posts/{id}")).await.x_cache.as_deref(),
            Some("bypass")
        );
    }
    let open = leader.http.metric(breaker).await;
    proxy.stall(false);
    load.release();
    let released = Instant::now();
    let (waited, answered_at) = waiting.await.unwrap();
    let (led, _) = leading.await.unwrap();

    assert_eq!(open, 1.0, "the breaker was open at the finish");
    assert_eq!(led.status, 200);
    assert_eq!(waited.status, 200, "{}", waited.text());
    let took = answered_at - released;
    assert!(
        took < Duration::from_millis(300),
        "the waiter was answered {took:?} after the finish could run"
    );
    assert!(env.stored(7).await.is_some(), "the finish stored the post");
}

/// A leader whose claim in the value key a change deleted finds, at its
/// finish, another leader's entry in its place, and a later change has
/// invalidated that entry since. The finish hands that entry back; the
/// leader must not answer with it (it did: the finish's reply was served
/// without being judged). It elects again and loads the row anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_never_answers_with_another_leaders_entry_that_a_change_invalidated() {
    use fred::prelude::*;
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };
    let env = TestEnv::new(5).await;
    env.retitle(2, "before").await;
    // What another leader stored, which a change then marked invalidated
    // (made in the hook: an entry read before the cutoff the feed's first
    // start raises would be refused for that alone).
    let body: &'static [u8] = br#"{"id":2,"title":"stored by another, then invalidated","body":"b","author":"a","created_at":"2026-01-01T00:00:00Z","updated_at":"2026-01-01T00:00:00Z"}"#;
    let armed = Arc::new(AtomicBool::new(true));
    let hooks = postcache::read_path::Hooks {
        after_load: Some(Arc::new({
            let (admin, redis, value) = (env.admin.clone(), env.redis.clone(), env.keys.value(2));
            let armed = armed.clone();
            move |_key| {
                let (admin, redis, value) = (admin.clone(), redis.clone(), value.clone());
                let armed = armed.clone();
                Box::pin(async move {
                    if !armed.swap(false, Ordering::SeqCst) {
                        return;
                    }
                    // A change, applied by the feed: it deletes this
                    // leader's claim, and this instance forgets the post.
                    sqlx::query("update posts set title = 'after' where id = 2")
                        .execute(&admin)
                        .await
                        .unwrap();
                    // Until the claim is deleted by the change (bounded).
                    for _ in 0..3000 {
                        let raw: Option<bytes::Bytes> = redis.get(&value).await.unwrap();
                        if raw.is_none_or(|raw| !postcache::cache::is_claim(&raw)) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let _: () = redis
                        .set(&value, theirs(body).raw().clone(), None, None, false)
                        .await
                        .unwrap();
                })
            }
        })),
        ..postcache::read_path::Hooks::default()
    };
    let app = env
        .spawn_with_hooks(
            &["--change-feed", "replication", "--l1-max-bytes", "0"],
            hooks,
        )
        .await;
    crate::support::until_feed(&app.http, "up").await;

    let reply = app.get("/posts/2").await;

    assert!(!armed.load(Ordering::SeqCst), "the hook ran");
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["title"], "after", "{}", reply.text());
}

/// An entry another leader stored, with `body`, which a change then marked
/// invalidated.
fn theirs(body: &[u8]) -> Entry {
    Entry::new(
        Status::Found,
        body,
        Duration::from_secs(600),
        Duration::ZERO,
    )
    .as_invalidated()
}

/// A waiter that lost the election in the value key (another leader's
/// claim there), then finds in its place an entry it cannot serve (here
/// one a change invalidated; an instance whose loads succeed takes another
/// instance's backoff copy so too). It slept on the value key's lifetime,
/// an hour for such an entry, and answered 504 at WAIT_TIMEOUT; it now
/// waits on the lock key, finds none, and leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_that_finds_an_entry_it_cannot_serve_leads_instead_of_sleeping_on_it() {
    use fred::prelude::*;
    use std::sync::Arc;
    let env = TestEnv::new(5).await;
    let value = env.keys.value(3);
    // Another leader's claim, as a first look would find it.
    let claim = postcache::cache::claim_of("another");
    let _: () = env
        .redis
        .set(
            &value,
            claim.as_str(),
            Some(Expiration::PX(5_000)),
            None,
            false,
        )
        .await
        .unwrap();
    let hooks = postcache::read_path::Hooks {
        before_recheck: Some(Arc::new({
            let (redis, value) = (env.redis.clone(), value.clone());
            move |_key| {
                let (redis, value) = (redis.clone(), value.clone());
                Box::pin(async move {
                    // That leader stored since, and a change invalidated
                    // what it stored (kept an hour as the fail-safe copy).
                    let body: &'static [u8] = br#"{"id":3}"#;
                    let _: () = redis
                        .set(
                            &value,
                            theirs(body).raw().clone(),
                            Some(Expiration::PX(3_600_000)),
                            None,
                            false,
                        )
                        .await
                        .unwrap();
                })
            }
        })),
        ..postcache::read_path::Hooks::default()
    };
    let app = env.spawn_with_hooks(&["--change-feed", "off"], hooks).await;

    let started = Instant::now();
    let reply = app.get("/posts/3").await;

    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered {:?} after",
        started.elapsed()
    );
}
