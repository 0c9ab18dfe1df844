//! The change feed: changes made in PostgreSQL reach every instance within
//! milliseconds, deleted posts stay deleted, a leader that read the row
//! before a change stores nothing, nothing is lost while the listener's
//! connection is down, and the same by hand (`postcache invalidate`).

use std::time::{Duration, Instant};

use futures::future::join_all;
use postcache::{
    cli::invalidate::{self, Invalidated},
    testkit::{
        wait_until, HeldLoad, RedisCluster, RedisServer, Reply, TcpProxy, TestApp, TestEnv,
        A_WHILE, PATIENT,
    },
};
use tokio::task::JoinHandle;

use crate::support::until_feed;

/// Waits until every instance serves post `id` with `wanted`; how long.
async fn until_everywhere(apps: &[TestApp], id: i64, wanted: &str) -> Duration {
    let started = Instant::now();
    for app in apps {
        wait_until("the change to reach the instance", A_WHILE, async || {
            app.http.title(id).await.as_deref() == Some(wanted)
        })
        .await;
    }
    started.elapsed()
}

/// Every instance caches post `id` in its memory tier (a miss or a hit in
/// Redis, then a hit in memory): what the changes must then evict there.
async fn warm(apps: &[TestApp], id: i64) {
    for app in apps {
        app.get(&format!("/posts/{id}")).await;
        let again = app.get(&format!("/posts/{id}")).await;
        assert_eq!(
            (again.x_cache.as_deref(), again.tier()),
            (Some("hit"), Some("memory"))
        );
    }
}

/// Updates and a delete, on `env`'s Redis, with CHANGE_FEED=`mode`: the
/// scenario of the single server and of the cluster.
async fn updates_and_deletes_reach_every_instance(env: &TestEnv, mode: &str) {
    let flags = ["--negative-ttl", "1s", "--change-feed", mode];
    let apps = join_all((0..3).map(|_| env.spawn(&flags))).await;
    for app in &apps {
        let ready = app.get("/readyz").await.json();
        assert_eq!(ready["change_feed"], "up");
        assert_eq!(ready["change_feed_mode"], mode);
    }
    for id in 1..=4 {
        warm(&apps, id).await;
    }

    for id in 1..=4 {
        env.retitle(id, &format!("edited {id}")).await;
    }
    let mut took = Duration::ZERO;
    for id in 1..=4 {
        took = took.max(until_everywhere(&apps, id, &format!("edited {id}")).await);
    }
    sqlx::query("delete from posts where id = 2")
        .execute(&env.admin)
        .await
        .unwrap();
    for app in &apps {
        wait_until("the delete to reach the instance", A_WHILE, async || {
            app.get("/posts/2").await.status == 404
        })
        .await;
    }
    // Loads fail from now on; the tombstone the delete left is what is
    // kept, after its value (NEGATIVE_TTL, 1 s) has gone.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    env.break_posts(true).await;
    let during: Vec<_> = join_all(apps.iter().map(|app| app.get("/posts/2"))).await;
    env.break_posts(false).await;

    assert!(took < Duration::from_secs(2), "changes took {took:?}");
    for reply in during {
        assert_eq!(
            reply.status,
            404,
            "never the deleted post: {}",
            reply.text()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn updates_and_deletes_made_by_sql_reach_every_instance() {
    let env = TestEnv::new(10).await;
    updates_and_deletes_reach_every_instance(&env, "replication").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn updates_and_deletes_made_by_sql_reach_every_instance_in_trigger_mode() {
    let env = TestEnv::new(10).await;
    updates_and_deletes_reach_every_instance(&env, "trigger").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn updates_and_deletes_reach_every_instance_on_a_redis_cluster() {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(10, cluster.url()).await;
    updates_and_deletes_reach_every_instance(&env, "replication").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn updates_and_deletes_reach_every_instance_on_a_redis_cluster_in_trigger_mode() {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(10, cluster.url()).await;
    updates_and_deletes_reach_every_instance(&env, "trigger").await;
}

/// A post deleted and inserted again in one transaction, applied as one
/// change: applied as a delete (its copy gives way to the tombstone, never
/// served as stale), and the post exists (each instance's existence guard
/// admits it). Applied as an update, post 6's copy from before the delete
/// was served as stale; applied as a bare delete, the guards, built while
/// post 5 was gone, answered 404 for it for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_post_deleted_and_inserted_again_in_one_transaction_is_served_everywhere() {
    let env = TestEnv::new(10).await;
    let run = async |sql: &str| {
        sqlx::query(sql).execute(&env.admin).await.unwrap();
    };
    run("create table kept as select * from posts where id in (5, 6)").await;
    run("delete from posts where id = 5").await;
    // A short NEGATIVE_TTL: a read of post 5 before the guard was built
    // caches its absence, and the guard answers once that entry is gone
    // (10 s by default: the test took 10 s, and timed out under load).
    let flags = [
        "--change-feed",
        "replication",
        "--stale-while-revalidate",
        "60s",
        "--existence-guard",
        "on",
        "--negative-ttl",
        "1s",
    ];
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;
    for app in &apps {
        wait_until("the guard built without post 5", A_WHILE, async || {
            app.get("/posts/5").await.tier() == Some("guard")
        })
        .await;
    }
    warm(&apps, 6).await;
    let old = apps[0].http.title(6).await.expect("post 6");

    let mut tx = env.admin.begin().await.unwrap();
    for sql in [
        "insert into posts select * from kept where id = 5",
        "delete from posts where id in (5, 6)",
        "insert into posts select * from kept",
        "update posts set title = 'again' where id in (5, 6)",
    ] {
        sqlx::query(sql).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();

    for app in &apps {
        wait_until("post 6 served again", A_WHILE, async || {
            let reply = app.get("/posts/6").await;
            let title = reply.json()["title"].as_str().map(str::to_owned);
            assert!(
                !(reply.x_cache.as_deref() == Some("stale") && title.as_deref() == Some(&old)),
                "the copy from before the delete served as stale"
            );
            title.as_deref() == Some("again")
        })
        .await;
    }
    until_everywhere(&apps, 5, "again").await;
    run("drop table kept").await;
}

/// Post 7's leader held after its SELECT, and a request for post 7 on
/// another instance waiting for it: the window in which the tests of
/// fencing change the row.
struct FencingRace {
    leader: TestApp,
    other: TestApp,
    load: HeldLoad,
    /// The leader's `postcache_fenced_total` before the race.
    fenced_before: f64,
    leading: JoinHandle<(Reply, Instant)>,
    waiting: JoinHandle<(Reply, Instant)>,
}

impl FencingRace {
    /// The leader with `flags`, the other instance with [`PATIENT`]'s, and
    /// both requests sent: the leader's load held, the waiter subscribed.
    async fn start(env: &TestEnv, flags: &[&str]) -> Self {
        let load = HeldLoad::first();
        let leader = env.spawn_with_hooks(flags, load.hooks()).await;
        let other = env.spawn(PATIENT).await;
        let fenced_before = leader.http.metric("postcache_fenced_total").await;

        let leading = leader.http.spawn_get("/posts/7");
        load.until_held().await;
        let waiting = other.http.spawn_get("/posts/7");
        env.until_subscribed(7).await;
        Self {
            leader,
            other,
            load,
            fenced_before,
            leading,
            waiting,
        }
    }

    /// Lets the leader's load go on to its finish: the leader's reply, then
    /// the waiter's. Called once (a request's task is awaited once).
    async fn release(&mut self) -> (Reply, Reply) {
        self.load.release();
        let (lead, _) = (&mut self.leading).await.unwrap();
        let (wait, _) = (&mut self.waiting).await.unwrap();
        (lead, wait)
    }

    /// The leader's finishes fenced since the race began.
    async fn fenced(&self) -> f64 {
        self.leader.http.metric("postcache_fenced_total").await - self.fenced_before
    }
}

/// Whatever the leader answered, the waiter elsewhere read the new row,
/// and the new row is what Redis stores.
async fn the_new_row_reached_the_waiter_and_redis(env: &TestEnv, wait: &Reply) {
    assert_eq!(
        wait.json()["title"],
        "after the change",
        "a waiter elsewhere"
    );
    let body = env.stored_post(7).await.expect("the new row is stored");
    assert_eq!(body["title"], "after the change");
}

/// A leader held after its SELECT; the row changes and the change is
/// applied, in Redis and in the leader's process; then the leader finishes.
/// Its old row is neither stored nor served: its flight and the waiters
/// elsewhere elect again and read the new row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_that_read_before_a_change_stores_nothing_and_no_one_gets_the_old_row() {
    let env = TestEnv::new(10).await;
    let mut race = FencingRace::start(&env, PATIENT).await;
    let read_path = &race.leader.state.read_path;

    let evictions = read_path.evictions(&7);
    env.retitle(7, "after the change").await;
    wait_until("the change to be applied", A_WHILE, async || {
        env.pttl(&env.keys.fence(7)).await > 0 && read_path.evictions(&7) > evictions
    })
    .await;
    let (lead, wait) = race.release().await;

    assert_eq!(lead.status, 200);
    assert_eq!(
        lead.json()["title"],
        "after the change",
        "the leader's own request"
    );
    the_new_row_reached_the_waiter_and_redis(&env, &wait).await;
    assert_eq!(
        race.other.http.title(7).await.as_deref(),
        Some("after the change")
    );
    let fenced = race.fenced().await;
    assert!(fenced >= 1.0, "fenced {fenced} times");
}

/// The same race where the change has not reached the leader's process
/// (its feed is off; another instance applies the change in Redis): the
/// leader answers its request with the row it read, which was current when
/// read, before its finish. The finish is fenced: it stores nothing, and
/// the waiter elsewhere elects again and gets the new row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_answers_the_row_it_read_before_its_finish_which_a_change_fences() {
    let env = TestEnv::new(10).await;
    let feed_off = [PATIENT, &["--change-feed", "off"]].concat();
    let mut race = FencingRace::start(&env, &feed_off).await;

    env.retitle(7, "after the change").await;
    wait_until("the change to be applied", A_WHILE, async || {
        env.pttl(&env.keys.fence(7)).await > 0
    })
    .await;
    let (lead, wait) = race.release().await;

    assert_eq!((lead.status, lead.x_cache.as_deref()), (200, Some("miss")));
    assert_ne!(
        lead.json()["title"],
        "after the change",
        "the leader's own request gets the row it read"
    );
    the_new_row_reached_the_waiter_and_redis(&env, &wait).await;
    wait_until("the leader's finish to be fenced", A_WHILE, async || {
        race.fenced().await > 0.0
    })
    .await;
}

/// The listener's connection is terminated, again and again, while rows
/// change: every change still arrives, read from the outbox on reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_change_arrives_though_the_listeners_connection_is_cut() {
    let env = TestEnv::new(20).await;
    let app = env.spawn(&["--change-feed", "trigger"]).await;
    let apps = std::slice::from_ref(&app);
    for id in 1..=20 {
        warm(apps, id).await;
    }
    let reconnects_before = app
        .http
        .metric("postcache_change_feed_reconnects_total")
        .await;

    let feed_up = async || app.get("/readyz").await.json()["change_feed"] == "up";
    let listener = async || -> Option<i32> {
        sqlx::query_scalar(
            "select pid from pg_stat_activity
             where datname = current_database() and application_name = 'postcache-feed'
               and (query ilike 'listen%' or query = 'select 1')",
        )
        .fetch_optional(&env.admin)
        .await
        .unwrap()
    };
    let mut cut = Vec::new();
    for id in 1..=20 {
        if id % 4 == 1 {
            // A live feed each time, listening on a new connection: up,
            // then that connection cut, then the row changed at once,
            // while it reconnects.
            let mut pid = None;
            wait_until("the feed to listen anew, and be up", A_WHILE, async || {
                pid = listener().await.filter(|p| !cut.contains(p));
                pid.is_some() && feed_up().await
            })
            .await;
            let pid = pid.expect("a listener");
            let killed: bool = sqlx::query_scalar("select pg_terminate_backend($1)")
                .bind(pid)
                .fetch_one(&env.admin)
                .await
                .unwrap();
            assert!(killed);
            cut.push(pid);
        }
        env.retitle(id, &format!("v2 of {id}")).await;
    }

    for id in 1..=20 {
        until_everywhere(apps, id, &format!("v2 of {id}")).await;
    }
    wait_until("the feed to be back up", A_WHILE, feed_up).await;
    let reconnects = app
        .http
        .metric("postcache_change_feed_reconnects_total")
        .await
        - reconnects_before;
    assert_eq!(cut.len(), 5);
    assert!(reconnects >= 5.0, "{reconnects} reconnects");
}

/// With stale-while-revalidate, a changed post is served once more, marked
/// stale, while one refresh reloads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_stale_while_revalidate_a_changed_post_is_served_stale_while_it_reloads() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(&["--stale-while-revalidate", "30s"]).await;
    warm(std::slice::from_ref(&app), 3).await;
    let before = app.get("/posts/3").await.json()["title"].clone();

    env.retitle(3, "refreshed").await;
    wait_until("the change to be applied", A_WHILE, async || {
        env.pttl(&env.keys.fence(3)).await > 0
    })
    .await;
    // In replication mode the memory tier forgets the post when the
    // decoder's stream entry arrives, a moment after Redis has the change.
    let mut stale = app.get("/posts/3").await;
    let deadline = Instant::now() + A_WHILE;
    while stale.tier() == Some("memory") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
        stale = app.get("/posts/3").await;
    }

    assert_eq!(stale.x_cache.as_deref(), Some("stale"));
    assert_eq!(stale.cache_status(), Some("postcache; hit; detail=stale"));
    assert_eq!(stale.json()["title"], before, "the old body, marked stale");
    wait_until("the refresh", A_WHILE, async || {
        app.http.title(3).await.as_deref() == Some("refreshed")
    })
    .await;
    assert_eq!(app.get("/posts/3").await.x_cache.as_deref(), Some("hit"));
}

/// Writes made with the triggers off are invisible to the feed: `postcache
/// invalidate` applies the same invalidation by hand, by id or for all,
/// with the feed on or off.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn invalidate_by_id_or_all_applies_what_a_change_would() {
    let env = TestEnv::new(10).await;
    // The trigger mode: its capture can be switched off by the table's
    // owner, to change rows behind the feed's back.
    let on = env.spawn(&["--change-feed", "trigger"]).await;
    // Without a feed, an invalidation by id reaches the memory tier only
    // through L1_TTL, its bound.
    let off = env.spawn(&["--change-feed", "off", "--l1-ttl", "1s"]).await;
    let apps = [on, off];
    assert_eq!(apps[1].get("/readyz").await.json()["change_feed"], "off");
    for id in [3, 4, 5] {
        warm(&apps, id).await;
    }
    sqlx::query("alter table posts disable trigger user")
        .execute(&env.admin)
        .await
        .unwrap();
    for id in [3, 4, 5] {
        env.retitle(id, "behind the feed's back").await;
    }
    sqlx::query("alter table posts enable trigger user")
        .execute(&env.admin)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for app in &apps {
        assert_ne!(
            app.http.title(3).await.as_deref(),
            Some("behind the feed's back")
        );
    }

    let by_id = invalidate::run(&env.invalidate_args(&["3"])).await.unwrap();
    let Invalidated::Posts(posts) = &by_id else {
        panic!("{by_id:?}")
    };
    assert_eq!(posts.len(), 1);
    // Redis at once; the memory tiers through the feeds, within milliseconds.
    until_everywhere(&apps, 3, "behind the feed's back").await;
    for app in &apps {
        assert_ne!(
            app.http.title(4).await.as_deref(),
            Some("behind the feed's back")
        );
    }

    let all = invalidate::run(&env.invalidate_args(&["--all"]))
        .await
        .unwrap();
    assert!(matches!(all, Invalidated::All { .. }), "{all:?}");
    // The instance without the feed reads the cutoff within a second.
    until_everywhere(&apps, 4, "behind the feed's back").await;
    until_everywhere(&apps, 5, "behind the feed's back").await;
}

/// `postcache invalidate` fences with a position of the primary's WAL, read
/// after its change is recorded, and never below a later fence: in the
/// replication mode a fence is the position a load must include, and an
/// outbox id there (a small number) would let a load read any replica,
/// however far behind the post's last change, and store its old row.
#[tokio::test]
async fn invalidate_fences_with_a_wal_position_and_never_lowers_a_later_one() {
    let env = TestEnv::new(5).await;
    let post = env.keys.item(3);
    let wal = async || -> u64 {
        let at: i64 = sqlx::query_scalar("select (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
            .fetch_one(&env.admin)
            .await
            .unwrap();
        at as u64
    };
    let fence = async || -> u64 {
        let fence: Option<String> = fred::prelude::KeysInterface::get(&env.redis, &post.fence)
            .await
            .unwrap();
        fence.expect("fenced").parse().expect("a position")
    };
    // Something cached, for the invalidation to fence.
    env.set(&post.value, "cached", Duration::from_secs(60))
        .await;

    // A fence older than now: moved up to where the WAL is.
    env.set(&post.fence, "1", Duration::from_secs(60)).await;
    let before = wal().await;
    invalidate::run(&env.invalidate_args(&["3"])).await.unwrap();
    assert!(fence().await >= before, "{} < {before}", fence().await);

    // A fence past it (a change the decoder applied meanwhile): kept.
    env.set(&post.value, "cached", Duration::from_secs(60))
        .await;
    let later = wal().await + (1 << 40);
    env.set(&post.fence, later.to_string(), Duration::from_secs(60))
        .await;
    invalidate::run(&env.invalidate_args(&["3"])).await.unwrap();
    assert_eq!(fence().await, later);
}

/// Redis paused while a row changes: the feed cannot apply it and keeps it
/// in the outbox; once Redis answers, the change is applied, and the entry
/// cached before the pause is not served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_made_while_redis_is_paused_is_applied_once_it_answers() {
    // Replication's feed is down once the decoder's beats are 2 s late.
    for (mode, pause) in [("trigger", 1500), ("replication", 3000)] {
        a_change_made_while_redis_is_paused_in(mode, pause).await;
    }
}

async fn a_change_made_while_redis_is_paused_in(mode: &str, pause_ms: u64) {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(3, redis.url()).await;
    let app = env
        .spawn(&["--redis-timeout", "100ms", "--change-feed", mode])
        .await;
    warm(std::slice::from_ref(&app), 2).await;

    redis.cli(&["client", "pause", &pause_ms.to_string(), "all"]);
    env.retitle(2, "changed during the pause").await;
    let paused = Instant::now();
    until_feed(&app.http, "down").await;
    tokio::time::sleep(Duration::from_millis(pause_ms).saturating_sub(paused.elapsed())).await;

    until_feed(&app.http, "up").await;
    let after = app.get("/posts/2").await;
    assert_eq!(after.json()["title"], "changed during the pause");
    assert_ne!(
        after.x_cache.as_deref(),
        Some("hit"),
        "not the entry cached before"
    );
}

/// Redis paused for 2 s while a post changes (replication): the decoder
/// keeps its session, the same walsender throughout (its beats and the
/// change wait in vain meanwhile, and are not a reason to give up the
/// slot), and applies the change within moments of Redis's return, not
/// after a new session is made (found: the session ended on the first
/// beat that timed out, and a change made during a pause waited up to
/// 880 ms past its end, past the fault's bound in a 30-minute soak).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_decoder_keeps_its_session_through_a_redis_pause_and_applies_at_its_end() {
    let redis = RedisServer::start().await;
    let env = TestEnv::with_redis(3, redis.url()).await;
    // The memory tier off: every read asks Redis, which holds the entry
    // cached before the pause until the change is applied.
    let app = env
        .spawn(&["--change-feed", "replication", "--l1-max-bytes", "0"])
        .await;
    wait_until("the post cached in Redis", A_WHILE, async || {
        app.get("/posts/2").await.x_cache.as_deref() == Some("hit")
    })
    .await;
    let walsender = async || -> Option<i32> {
        sqlx::query_scalar(
            "select active_pid from pg_replication_slots where database = current_database()",
        )
        .fetch_one(&env.admin)
        .await
        .unwrap()
    };
    let before = walsender().await.expect("the slot is held");

    const PAUSE: Duration = Duration::from_millis(2000);
    redis.cli(&["client", "pause", &PAUSE.as_millis().to_string(), "all"]);
    let paused = Instant::now();
    let new = "changed during the pause";
    env.retitle(2, new).await;
    tokio::time::sleep(PAUSE.saturating_sub(paused.elapsed())).await;

    // Within moments of the pause's end (a try every 50 ms): every read
    // from 400 ms on answers the change.
    tokio::time::sleep(Duration::from_millis(400)).await;
    for _ in 0..10 {
        let read = app.get("/posts/2").await;
        assert_eq!(
            read.json()["title"],
            new,
            "{:?} after the pause's end",
            paused.elapsed().saturating_sub(PAUSE)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        walsender().await,
        Some(before),
        "the decoder's session went on through the pause"
    );
}

/// A Redis failover to a replica that missed a change: the replica's
/// replication stalled (a proxy between it and its primary forwards
/// nothing and closes nothing), a post changed, then the primary killed
/// and the replica promoted (`REPLICAOF NO ONE`) behind the address the
/// instances use, as a moved virtual IP. No replica acknowledged the
/// change's application, so the decoder applies it again on the promoted
/// replica, which still holds the post's old entry: an instance that
/// never served the new version (its floor cannot help) serves it soon
/// after the failover, and never the old one after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_a_stalled_replica_missed_is_applied_again_after_its_promotion() {
    let mut primary = RedisServer::start().await;
    let link = TcpProxy::start(([127, 0, 0, 1], primary.port).into()).await;
    let link_port = link.addr.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &link_port]).await;
    let address = TcpProxy::start(([127, 0, 0, 1], primary.port).into()).await;
    let env = TestEnv::with_redis(3, format!("redis://{}", address.addr)).await;
    // The memory tier off: every read asks Redis.
    let flags = [
        "--change-feed",
        "replication",
        "--cache-ttl",
        "600s",
        "--l1-max-bytes",
        "0",
    ];
    let (writer_side, other) = (env.spawn(&flags).await, env.spawn(&flags).await);
    for app in [&writer_side, &other] {
        app.get("/posts/1").await;
        assert_eq!(app.get("/posts/1").await.x_cache.as_deref(), Some("hit"));
    }
    wait_until("the replica to have the entry", A_WHILE, async || {
        primary.cli(&["wait", "1", "100"]) == "1"
            && replica.cli(&["exists", &env.keys.value(1)]) == "1"
    })
    .await;

    link.stall(true);
    let new = "changed while the replica stalled";
    env.retitle(1, new).await;
    until_everywhere(std::slice::from_ref(&writer_side), 1, new).await;
    // The decoder has waited for the replica, in vain, at least once.
    wait_until("a change unacknowledged", A_WHILE, async || {
        writer_side
            .http
            .metric("postcache_changes_unreplicated_total")
            .await
            + other
                .http
                .metric("postcache_changes_unreplicated_total")
                .await
            >= 1.0
    })
    .await;

    primary.kill();
    assert_eq!(replica.cli(&["replicaof", "no", "one"]), "OK");
    address.retarget(([127, 0, 0, 1], replica.port).into());
    let promoted = Instant::now();
    // The other instance reads once Redis answers it again (a read that
    // fell back to PostgreSQL meanwhile would raise its floor).
    tokio::time::sleep(Duration::from_millis(500)).await;
    wait_until(
        "the other instance to reach Redis again",
        A_WHILE,
        async || {
            let ready = other.get("/readyz").await.json();
            ready["redis"] == "up" && ready["change_feed"] == "up"
        },
    )
    .await;
    let mut served = Vec::new();
    while promoted.elapsed() < Duration::from_secs(4) {
        let reply = other.get("/posts/1").await;
        let title = (reply.status == 200).then(|| reply.json()["title"].to_string());
        served.push((promoted.elapsed(), reply.x_cache.clone(), title));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let new = Some(format!("{new:?}"));
    let Some(first_new) = served.iter().position(|(_, _, title)| *title == new) else {
        panic!(
            "the change was never served after the failover (the first of {} reads: {:?})",
            served.len(),
            &served[..served.len().min(5)]
        );
    };
    assert!(
        served[first_new].0 < Duration::from_secs(2),
        "the change was served only {:?} after the failover: {served:?}",
        served[first_new].0
    );
    let after: Vec<_> = served[first_new..]
        .iter()
        .filter(|(_, _, title)| *title != new)
        .collect();
    assert!(
        after.is_empty(),
        "served other than the change after it: {after:?}"
    );
    drop(link);
}

/// A truncate is every post changed at once: the cutoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_truncate_makes_every_post_gone_everywhere() {
    for mode in ["replication", "trigger"] {
        a_truncate_in(mode).await;
    }
}

async fn a_truncate_in(mode: &str) {
    let env = TestEnv::new(5).await;
    let flags = ["--change-feed", mode];
    let apps = join_all((0..2).map(|_| env.spawn(&flags))).await;
    for id in 1..=5 {
        warm(&apps, id).await;
    }

    sqlx::query("truncate posts")
        .execute(&env.admin)
        .await
        .unwrap();

    for app in &apps {
        for id in 1..=5 {
            wait_until("the truncate to reach the instance", A_WHILE, async || {
                app.get(&format!("/posts/{id}")).await.status == 404
            })
            .await;
        }
    }
}

/// Change ids are handed out before commit: a change with a lower id can
/// commit after one with a higher id (here `invalidate`, by hand). It is
/// applied all the same, and the row read before it is not kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_that_commits_after_a_later_numbered_one_is_still_applied() {
    let env = TestEnv::new(10).await;
    let app = env.spawn(&[]).await;
    warm(std::slice::from_ref(&app), 5).await;

    // The update takes its change id, then waits to commit.
    let mut slow = env.admin.begin().await.unwrap();
    sqlx::query("update posts set title = 'committed last' where id = 5")
        .execute(&mut *slow)
        .await
        .unwrap();
    invalidate::run(&env.invalidate_args(&["5"])).await.unwrap();
    // A reader loads the row as it was before the update, and caches it
    // (once the instance's feed has evicted its memory tier: milliseconds).
    let mut before = None;
    wait_until("the memory tier to be evicted", A_WHILE, async || {
        let reply = app.get("/posts/5").await;
        let miss = reply.x_cache.as_deref() == Some("miss");
        before = Some(reply);
        miss
    })
    .await;
    let before = before.unwrap();
    assert_ne!(before.json()["title"], "committed last");
    slow.commit().await.unwrap();

    until_everywhere(std::slice::from_ref(&app), 5, "committed last").await;
}

/// After `invalidate --all`, a load that fails serves no entry read before
/// it, and the cutoff is raised once per change however often the change
/// is seen (every instance applies it, a catch-up may replay it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_invalidate_all_no_old_body_is_served_and_the_cutoff_moves_once() {
    let env = TestEnv::new(5).await;
    let apps =
        join_all((0..2).map(|_| env.spawn(&["--failure-ttl", "0s", "--change-feed", "trigger"])))
            .await;
    warm(&apps, 1).await;
    let applied = r#"postcache_changes_applied_total{op="invalidate_all"}"#;
    let before = apps[0].http.metric(applied).await;

    let Invalidated::All { cutoff } = invalidate::run(&env.invalidate_args(&["--all"]))
        .await
        .unwrap()
    else {
        panic!("every post")
    };
    // Both instances apply the same change from the feed (their metrics
    // are the process's, shared).
    wait_until("both instances to apply the change", A_WHILE, async || {
        apps[0].http.metric(applied).await - before >= 2.0
    })
    .await;
    let stored: Option<String> = fred::prelude::KeysInterface::get(&env.redis, env.keys.cutoff())
        .await
        .unwrap();
    env.break_posts(true).await;
    let during: Vec<_> = join_all(apps.iter().map(|app| app.get("/posts/1"))).await;
    env.break_posts(false).await;
    // The change seen once more, later (a catch-up replayed).
    let change: i64 =
        sqlx::query_scalar("select max(id) from post_changes where op = 'invalidate_all'")
            .fetch_one(&env.admin)
            .await
            .unwrap();
    let replayed = apps[0]
        .state
        .read_path
        .invalidate_all(change)
        .await
        .unwrap();

    assert_eq!(
        stored,
        Some(cutoff.to_string()),
        "raised once, by the command or an instance, whichever came first"
    );
    assert_eq!(replayed, cutoff, "a change seen again raises nothing");
    for reply in during {
        assert_eq!(
            reply.status,
            503,
            "not the body read before: {}",
            reply.text()
        );
    }
}

/// A Redis Cluster master stalls: changes to its posts wait in the retry
/// list (its keys are read from PostgreSQL meanwhile, once its breaker is
/// open), and a change to another shard's post committed later is applied
/// at once, not after the stalled one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_cluster_node_does_not_hold_back_the_other_shards_changes() {
    let cluster = RedisCluster::start(3, 0).await;
    let env = TestEnv::with_redis(30, cluster.url()).await;
    let app = env.spawn(&["--redis-timeout", "100ms"]).await;
    let apps = std::slice::from_ref(&app);
    let stalled = cluster.master_of(&env.keys.value(1));
    let other = (2..=30)
        .find(|id| cluster.master_of(&env.keys.value(*id)) != stalled)
        .expect("a post on another shard");
    warm(apps, 1).await;
    warm(apps, other).await;

    cluster.cli(stalled, &["client", "pause", "4000", "write"]);
    let paused = Instant::now();
    env.retitle(1, "on the stalled shard").await;
    // The stalled change has failed for a while (a feed that gave up on
    // the whole catch-up would be in its backoff by now).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let committed = Instant::now();
    env.retitle(other, "on a healthy shard").await;
    until_everywhere(apps, other, "on a healthy shard").await;
    let healthy_after = committed.elapsed();
    let during_pause = paused.elapsed() < Duration::from_millis(3500);

    until_everywhere(apps, 1, "on the stalled shard").await;
    assert!(
        healthy_after < Duration::from_millis(400),
        "the healthy shard's change waited {healthy_after:?}"
    );
    assert!(during_pause, "measured while the node was stalled");
    until_feed(&app.http, "up").await;
}

/// CHANGE_FEED=off: today's behaviour, a change waits for the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_change_feed_off_a_change_waits_for_the_ttl() {
    let env = TestEnv::new(3).await;
    let app = env
        .spawn(&["--change-feed", "off", "--cache-ttl", "2s"])
        .await;
    warm(std::slice::from_ref(&app), 1).await;

    env.retitle(1, "later").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before_ttl = app.http.title(1).await;

    assert_ne!(before_ttl.as_deref(), Some("later"));
    assert_eq!(
        env.pttl(&env.keys.fence(1)).await,
        -2,
        "no fence: nothing applied"
    );
    until_everywhere(std::slice::from_ref(&app), 1, "later").await;
}
