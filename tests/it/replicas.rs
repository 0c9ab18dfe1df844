//! Loads from read replicas (DATABASE_REPLICA_URLS): a private primary and
//! streaming standby per test, started here. A replica that has not
//! replayed a key's last change never gives its old row; a replica down or
//! lagging past REPLICA_MAX_LAG leaves the rotation and loads go to the
//! primary; batch loads follow the rule per key; a promoted standby goes on
//! serving.

use std::time::Duration;

use fred::interfaces::{KeysInterface, StreamsInterface};
use postcache::testkit::{
    available, redis_url, wait_until, PgServer, TcpProxy, TestApp, TestEnv, A_WHILE,
};

/// A private primary, its standby, and a world on the primary. Dropped in
/// this order: the world's database first, the servers last.
struct Replicated {
    env: TestEnv,
    standby: PgServer,
    primary: PgServer,
}

impl Replicated {
    /// `None` (the test skipped) where PostgreSQL's programs are missing,
    /// outside CI.
    async fn start(posts: u64, standby_conf: &[&str]) -> Option<Self> {
        if !available("initdb and pg_basebackup", PgServer::available()) {
            return None;
        }
        let primary = PgServer::primary().await;
        let env = TestEnv::on_server(posts, primary.url(), redis_url()).await;
        let standby = PgServer::standby_of(&primary, standby_conf).await;
        Some(Self {
            env,
            standby,
            primary,
        })
    }

    fn replica_url(&self) -> String {
        format!("{}/{}", self.standby.url(), self.env.db_name)
    }

    /// An instance reading the standby, the feed in replication mode.
    async fn spawn(&self, max_lag: &str) -> TestApp {
        self.spawn_with(max_lag, &[]).await
    }

    /// [`Replicated::spawn`] with `extra` flags.
    async fn spawn_with(&self, max_lag: &str, extra: &[&str]) -> TestApp {
        self.spawn_reading(&self.replica_url(), max_lag, extra)
            .await
    }

    /// An instance reading `replicas` (DATABASE_REPLICA_URLS), the feed in
    /// replication mode, with `extra` flags; once the first replica is up.
    async fn spawn_reading(&self, replicas: &str, max_lag: &str, extra: &[&str]) -> TestApp {
        let mut flags = vec![
            "--change-feed",
            "replication",
            "--database-replica-urls",
            replicas,
            "--replica-max-lag",
            max_lag,
        ];
        flags.extend_from_slice(extra);
        let app = self.env.spawn(&flags).await;
        until_replica(&app, "up").await;
        app
    }

    /// A proxy in front of the standby, whose network a test can stall.
    async fn proxy(&self) -> TcpProxy {
        TcpProxy::start(format!("127.0.0.1:{}", self.standby.port).parse().unwrap()).await
    }

    /// The standby's URL through `proxy`.
    fn url_through(&self, proxy: &TcpProxy) -> String {
        format!("postgres://postgres@{}/{}", proxy.addr, self.env.db_name)
    }

    /// The title of post `id` as the standby has it now.
    async fn standby_title(&self, id: i64) -> String {
        let pool = sqlx::PgPool::connect(&self.replica_url()).await.unwrap();
        let title = sqlx::query_scalar("select title from posts where id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
        pool.close().await;
        title
    }

    /// Waits until the change feed has applied a change to post `id`
    /// (every change is fenced in replication mode, cached or not).
    async fn until_fenced(&self, id: i64) {
        let fence = self.env.keys.fence(id);
        wait_until("the change feed to fence the post", A_WHILE, async || {
            self.env.pttl(&fence).await > 0
        })
        .await;
    }
}

async fn readyz(app: &TestApp) -> serde_json::Value {
    app.get("/readyz").await.json()
}

async fn until_replica(app: &TestApp, state: &str) {
    wait_until(&format!("the replica to be {state}"), A_WHILE, async || {
        let ready = readyz(app).await;
        ready["change_feed"] == "up" && ready["replicas"][0]["state"] == state
    })
    .await;
}

async fn routed(app: &TestApp, to: &str, reason: &str) -> f64 {
    app.http
        .metric(&format!(
            "postcache_replica_routed_total{{to=\"{to}\",reason=\"{reason}\"}}"
        ))
        .await
}

async fn title(app: &TestApp, path: &str) -> String {
    let reply = app.get(path).await;
    assert_eq!(reply.status, 200, "{path}: {}", reply.text());
    reply.json()["title"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lagging_replica_never_gives_a_changed_post_its_old_row() {
    let Some(r) = Replicated::start(20, &["recovery_min_apply_delay = '2s'"]).await else {
        return;
    };
    // No memory tier: the end reads a key again through Redis at once.
    let app = r.spawn_with("5s", &["--l1-max-bytes", "0"]).await;
    // Keys with no recent change: read from the replica.
    let served = routed(&app, "replica", "caught_up").await;
    let original = title(&app, "/posts/1").await;
    assert_eq!(app.get("/posts/3").await.status, 200);
    assert_eq!(routed(&app, "replica", "caught_up").await, served + 2.0);
    assert_ne!(original, "changed-1");

    // Post 1 is cached, post 2 is not: both change, and the feed fences
    // both while the standby still holds the old rows.
    r.env.retitle(1, "changed-1").await;
    r.env.retitle(2, "changed-2").await;
    r.until_fenced(1).await;
    r.until_fenced(2).await;
    assert_ne!(r.standby_title(1).await, "changed-1", "the standby lags");
    assert_ne!(r.standby_title(2).await, "changed-2", "the standby lags");

    let behind = routed(&app, "primary", "behind").await;
    assert_eq!(title(&app, "/posts/1").await, "changed-1");
    assert_eq!(title(&app, "/posts/2").await, "changed-2");
    assert_eq!(routed(&app, "primary", "behind").await, behind + 2.0);
    // What was stored is the new row: served again, from the cache.
    for id in [1, 2] {
        let body = r.env.stored_post(id).await.expect("stored");
        assert_eq!(body["title"], format!("changed-{id}"));
    }

    // Once the standby has replayed the change, the fenced key is read
    // there again.
    r.standby.until_replayed(&r.primary, &r.env.db_name).await;
    let served = routed(&app, "replica", "caught_up").await;
    wait_until(
        "a fenced key to be read from the replica",
        A_WHILE,
        async || {
            let _: i64 = r.env.redis.del(r.env.keys.value(1)).await.unwrap();
            assert_eq!(title(&app, "/posts/1").await, "changed-1");
            routed(&app, "replica", "caught_up").await > served
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_to_every_post_is_not_read_from_a_replica_behind_it() {
    // Past the feed's bound on rows per transaction (10,000): the feed
    // raises the cutoff rather than fencing each post.
    let Some(r) = Replicated::start(10_001, &["recovery_min_apply_delay = '2s'"]).await else {
        return;
    };
    let app = r.spawn("5s").await;
    let original = title(&app, "/posts/1").await;
    sqlx::query("update posts set title = 'after'")
        .execute(&r.env.admin)
        .await
        .unwrap();
    let committed = std::time::Instant::now();
    wait_until("the new row to be served", A_WHILE, async || {
        let now = title(&app, "/posts/1").await;
        assert!(now == original || now == "after", "{now}");
        now == "after"
    })
    .await;
    let served_after = committed.elapsed();
    assert_ne!(
        r.standby_title(1).await,
        "after",
        "the standby lags (served {served_after:?} after the commit)"
    );
    assert_eq!(title(&app, "/posts/2").await, "after");
}

/// The race the fleet's stream leaves after a change to every post: an
/// instance reads a post from a lagging replica after the decoder raised the
/// cutoff, before the stream brings the news. Simulated by appending the
/// decoder's entry (with the position and a cutoff before that read) only
/// after the read: the post is fenced with the change, and read again where
/// the change is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_post_read_from_a_lagging_replica_before_news_of_a_change_to_every_post_is_fenced() {
    let Some(r) = Replicated::start(20, &["recovery_min_apply_delay = '2s'"]).await else {
        return;
    };
    let app = r.spawn("5s").await;
    // A commit the standby has not replayed, and the WAL position after it.
    r.env.retitle(7, "changed-7").await;
    let lsn = postcache::store::wal_position(&r.env.admin).await.unwrap();
    let cutoff = postcache::cache::now_millis();
    r.until_fenced(7).await;

    let served = routed(&app, "replica", "caught_up").await;
    assert_eq!(app.get("/posts/3").await.status, 200);
    assert_eq!(routed(&app, "replica", "caught_up").await, served + 1.0);
    assert!(r.env.stored(3).await.is_some());
    let fence = r.env.keys.fence(3);
    assert!(
        r.env.pttl(&fence).await < 0,
        "post 3 has no change of its own"
    );

    let _: String = r
        .env
        .redis
        .xadd(
            r.env.keys.change_stream(),
            false,
            None,
            "*",
            vec![
                ("lsn", lsn.to_string()),
                ("all", "1".to_owned()),
                ("cutoff", cutoff.to_string()),
            ],
        )
        .await
        .unwrap();
    wait_until("post 3 to be fenced with the change", A_WHILE, async || {
        let fenced: Option<String> = r.env.redis.get(&fence).await.unwrap();
        fenced == Some(lsn.to_string())
    })
    .await;
    let now = postcache::cache::now_millis();
    assert!(
        r.env
            .stored(3)
            .await
            .is_none_or(|e| e.is_invalidated() || !e.is_fresh(now)),
        "the value read from the lagging replica is no longer served"
    );
    let behind = routed(&app, "primary", "behind").await;
    assert_eq!(app.get("/posts/3").await.status, 200);
    assert_eq!(routed(&app, "primary", "behind").await, behind + 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_loads_follow_the_rule_per_key() {
    let Some(r) = Replicated::start(20, &["recovery_min_apply_delay = '2s'"]).await else {
        return;
    };
    let app = r.spawn("5s").await;
    r.env.retitle(3, "changed-3").await;
    r.env.retitle(7, "changed-7").await;
    r.until_fenced(3).await;
    r.until_fenced(7).await;
    assert_ne!(r.standby_title(7).await, "changed-7", "the standby lags");

    let (served, behind) = (
        routed(&app, "replica", "caught_up").await,
        routed(&app, "primary", "behind").await,
    );
    let reply = app.get("/posts?ids=1,2,3,4,5,6,7,8,9,10").await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let posts = reply.json()["posts"].as_array().unwrap().clone();
    assert_eq!(posts.len(), 10);
    for post in &posts {
        let id = post["id"].as_i64().unwrap();
        if id == 3 || id == 7 {
            assert_eq!(post["title"], format!("changed-{id}"));
        } else {
            assert_ne!(post["title"].as_str().unwrap(), format!("changed-{id}"));
        }
    }
    assert_eq!(routed(&app, "primary", "behind").await, behind + 2.0);
    assert_eq!(routed(&app, "replica", "caught_up").await, served + 8.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_that_goes_down_leaves_the_rotation_and_comes_back() {
    let Some(mut r) = Replicated::start(60, &[]).await else {
        return;
    };
    let app = r.spawn("5s").await;
    let served = routed(&app, "replica", "caught_up").await;
    assert_eq!(app.get("/posts/1").await.status, 200);
    assert_eq!(routed(&app, "replica", "caught_up").await, served + 1.0);

    r.standby.stop();
    // Every load is answered, from the primary, while the replica is down.
    for id in 2..=30 {
        let reply = app.get(&format!("/posts/{id}")).await;
        assert_eq!(reply.status, 200, "post {id}: {}", reply.text());
    }
    until_replica(&app, "down").await;
    let primary = routed(&app, "primary", "no_replica").await;
    assert_eq!(app.get("/posts/31").await.status, 200);
    assert_eq!(routed(&app, "primary", "no_replica").await, primary + 1.0);

    r.standby.start().await;
    until_replica(&app, "up").await;
    let served = routed(&app, "replica", "caught_up").await;
    assert_eq!(app.get("/posts/40").await.status, 200);
    assert_eq!(routed(&app, "replica", "caught_up").await, served + 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_lagging_past_the_bound_leaves_the_rotation() {
    let Some(r) = Replicated::start(100, &["recovery_min_apply_delay = '3s'"]).await else {
        return;
    };
    let app = r.spawn("1s").await;
    // Commits keep coming: the standby trails them by its 3 s delay.
    let writer = {
        let admin = r.env.admin.clone();
        tokio::spawn(async move {
            for n in 0..200 {
                sqlx::query("update posts set title = $1 where id = 100")
                    .bind(format!("write {n}"))
                    .execute(&admin)
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    until_replica(&app, "lagging").await;
    let ready = readyz(&app).await;
    assert!(
        ready["replicas"][0]["lag_seconds"].as_f64().unwrap() > 1.0,
        "{ready}"
    );
    assert!(
        ready["replicas"][0]["lag_bytes"].as_u64().unwrap() > 0,
        "{ready}"
    );
    let served = routed(&app, "replica", "caught_up").await;
    for id in 1..=20 {
        assert_eq!(app.get(&format!("/posts/{id}")).await.status, 200);
    }
    assert_eq!(
        routed(&app, "replica", "caught_up").await,
        served,
        "nothing read from a replica out of the rotation"
    );
    writer.abort();
    // The writes stop: it catches up and comes back.
    until_replica(&app, "up").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_promoted_standby_goes_on_serving() {
    let Some(r) = Replicated::start(20, &[]).await else {
        return;
    };
    let app = r.spawn("5s").await;
    assert_eq!(app.get("/posts/1").await.status, 200);
    let before = readyz(&app).await;

    r.standby.promote().await;
    let served = routed(&app, "replica", "caught_up").await;
    for id in 2..=20 {
        let reply = app.get(&format!("/posts/{id}")).await;
        assert_eq!(reply.status, 200, "post {id}: {}", reply.text());
    }
    // Read as a primary: its position is its WAL insert position, past
    // what it replayed, so it never went backwards and it stays in the
    // rotation while the old primary writes nothing.
    assert_eq!(routed(&app, "replica", "caught_up").await, served + 19.0);
    let after = readyz(&app).await;
    assert_eq!(after["replicas"][0]["state"], "up", "{before} → {after}");
}

/// The network to a replica stalls (no answer, not even the statement
/// timeout's): a load that meets it goes on to the primary after half of
/// LOAD_TIMEOUT, and is served, instead of timing out whole; the probe then
/// takes the replica out of the rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_whose_network_stalls_costs_a_load_half_its_timeout_not_the_load() {
    let Some(r) = Replicated::start(60, &[]).await else {
        return;
    };
    let proxy = r.proxy().await;
    let app = r
        .spawn_reading(&r.url_through(&proxy), "5s", &["--load-timeout", "2s"])
        .await;
    let served = routed(&app, "replica", "caught_up").await;
    assert_eq!(app.get("/posts/1").await.status, 200);
    assert_eq!(routed(&app, "replica", "caught_up").await, served + 1.0);

    proxy.stall(true);
    let mut answers = Vec::new();
    for id in 2..=4 {
        let started = std::time::Instant::now();
        let reply = app.get(&format!("/posts/{id}")).await;
        answers.push((id, reply.status, started.elapsed()));
    }
    until_replica(&app, "down").await;
    proxy.stall(false);

    for (id, status, took) in &answers {
        assert_eq!(*status, 200, "post {id}: {answers:?}");
        assert!(
            *took < Duration::from_millis(1_800),
            "post {id}: {answers:?}"
        );
    }
}

/// A replica whose one connection is taken by a read that hangs: the next
/// load finds none free within its short wait, goes to the primary, and is
/// counted there as `busy`, not as a key the replica was `behind` on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_with_no_connection_free_sends_loads_to_the_primary_counted_as_busy() {
    let Some(r) = Replicated::start(60, &[]).await else {
        return;
    };
    let proxy = r.proxy().await;
    let app = r
        .spawn_reading(
            &r.url_through(&proxy),
            "5s",
            &["--load-timeout", "2s", "--db-max-connections", "1"],
        )
        .await;
    assert_eq!(app.get("/posts/1").await.status, 200);

    proxy.stall(true);
    let (busy, behind) = (
        routed(&app, "primary", "busy").await,
        routed(&app, "primary", "behind").await,
    );
    // The first read takes the replica's one connection and stalls on it
    // for half of LOAD_TIMEOUT. The second (one connection: one statement
    // at a time) comes after it and finds that connection, abandoned
    // mid-query over a stalled network, not yet free.
    let first = app.get("/posts/2");
    let second = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        app.get("/posts/3").await
    };
    let (first, second) = tokio::join!(first, second);
    proxy.stall(false);
    assert_eq!(first.status, 200);
    assert_eq!(second.status, 200);
    assert!(
        routed(&app, "primary", "busy").await > busy,
        "the second load was not counted busy"
    );
    assert_eq!(routed(&app, "primary", "behind").await, behind);
}

/// Two replicas whose networks stall at once: the load's time for replicas
/// (half of LOAD_TIMEOUT) is one budget for both, so the primary still has
/// the other half and the load is served, instead of each replica taking
/// half and the load timing out before it reaches the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_stalled_replicas_share_half_the_load_timeout_and_the_primary_serves() {
    let Some(r) = Replicated::start(60, &[]).await else {
        return;
    };
    let (a, b) = (r.proxy().await, r.proxy().await);
    let replicas = format!("{},{}", r.url_through(&a), r.url_through(&b));
    let app = r
        .spawn_reading(&replicas, "5s", &["--load-timeout", "1s"])
        .await;
    wait_until("both replicas to be up", A_WHILE, async || {
        let ready = readyz(&app).await;
        ready["change_feed"] == "up"
            && ready["replicas"][0]["state"] == "up"
            && ready["replicas"][1]["state"] == "up"
    })
    .await;
    // Loads take turns at the replicas: each has a connection open after
    // these, used under a second ago when the stalled load reaches it (a
    // connection idle for a second is pinged first, and a replica whose
    // ping stalls is given up after its short wait for a connection).
    let served = routed(&app, "replica", "caught_up").await;
    for id in 10..14 {
        assert_eq!(app.get(&format!("/posts/{id}")).await.status, 200);
    }
    assert_eq!(routed(&app, "replica", "caught_up").await, served + 4.0);

    a.stall(true);
    b.stall(true);
    let started = std::time::Instant::now();
    let reply = app.get("/posts/2").await;
    let took = started.elapsed();
    a.stall(false);
    b.stall(false);
    assert_eq!(reply.status, 200, "after {took:?}");
    assert!(took < Duration::from_millis(900), "took {took:?}");
}
