//! The operators' toolkit against the real servers: `postcache inspect`,
//! `postcache seed` over a running fleet.

use std::time::Duration;

use clap::Parser;
use futures::future::join_all;
use postcache::{
    cli::{
        inspect::{self, EntryStatus, Inspection},
        seed,
    },
    config::{Cli, Command},
    testkit::{fire, wait_until, TableLock, TestEnv, A_WHILE},
};

use crate::support::fresh_for;

async fn inspect(env: &TestEnv, id: i64) -> Inspection {
    inspect::run(&env.inspect_args(&[&id.to_string()]))
        .await
        .expect("inspect")
}

#[tokio::test]
async fn inspect_shows_a_found_entry_with_its_copy_and_ttls_a_not_found_one_and_an_absent_one() {
    let env = TestEnv::new(3).await;
    let app = env
        .spawn(&["--cache-ttl", "60s", "--l1-max-bytes", "0"])
        .await;

    let read = app.get("/posts/2").await;
    let missing = app.get("/posts/99").await;
    // (Their leaders answer before their finishes store.)
    env.stored(2).await.expect("stored");
    env.stored(99).await.expect("stored");
    let found = inspect(&env, 2).await;
    let not_found = inspect(&env, 99).await;
    let absent = inspect(&env, 3).await;

    assert_eq!((read.status, missing.status), (200, 404));
    assert_eq!(found.status, EntryStatus::Found);
    let entry = found.value.entry.as_ref().expect("an entry");
    let etag = read.headers["etag"].to_str().unwrap();
    assert_eq!(entry.etag.as_deref(), Some(etag));
    assert_eq!(entry.body_bytes, read.body.len());
    assert!((0..5_000).contains(&entry.age_ms), "{entry:?}");
    assert!((50_000..=66_000).contains(&entry.fresh_for_ms), "{entry:?}");
    // One key: fresh for TTL, then kept as the fail-safe copy.
    let ttl = found.value.ttl_ms.expect("the value expires");
    assert!(ttl > 66_000, "{ttl}");
    let copy = found.fail_safe.entry.as_ref().expect("a fail-safe copy");
    assert_eq!(copy.status, EntryStatus::Found);
    assert_eq!(found.fail_safe.key, found.value.key);
    assert!(!copy.invalidated && copy.backoff_until.is_none());
    assert!(!found.lock.held);
    assert_eq!(found.lock.holder, None);
    assert_eq!(found.ready_channel.subscribers, 0);
    assert_eq!(found.value.key, env.keys.value(2));

    assert_eq!(not_found.status, EntryStatus::NotFound);
    let ttl = not_found.value.ttl_ms.expect("a negative entry expires");
    assert!((5_000..=11_000).contains(&ttl), "{ttl}");
    assert_eq!(absent.status, EntryStatus::Absent);
    assert!(absent.value.entry.is_none() && absent.fail_safe.entry.is_none());
}

/// While a load is held back, the lock's holder and TTL show, and so do the
/// waiters of another instance, subscribed to the ready channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inspect_shows_the_lock_holder_and_the_subscribed_waiters_during_a_load() {
    let env = TestEnv::new(3).await;
    let apps = join_all((0..2).map(|_| env.spawn(&["--lock-ttl", "5s"]))).await;
    let lock = TableLock::take(&env).await;

    let requests = fire(&apps, "/posts/1", 10);
    env.until_held(&apps, 10).await;
    env.until_subscribed(1).await;
    let during = inspect(&env, 1).await;
    lock.release().await;
    let replies = postcache::testkit::answered(requests).await;
    let after = inspect(&env, 1).await;

    assert!(replies.iter().all(|(r, _)| r.status == 200));
    assert_eq!(during.status, EntryStatus::Absent);
    assert!(during.lock.held);
    let holder = during.lock.holder.as_deref().expect("a holder");
    assert_eq!(holder.len(), 8);
    assert!(holder.bytes().all(|b| b.is_ascii_hexdigit()), "{holder}");
    let ttl = during.lock.ttl_ms.expect("the lock expires");
    assert!((1..=5_000).contains(&ttl), "{ttl}");
    assert!(during.ready_channel.subscribers >= 1);
    // A post nobody had stored: the leader's claim is in its value key,
    // and there is no lock key.
    assert_eq!(during.lock.key, env.keys.value(1));
    assert_eq!(env.pttl(&env.keys.lock(1)).await, -2);
    assert_eq!(after.status, EntryStatus::Found);
    assert!(!after.lock.held);
}

/// A post kept past its freshness (its copy in the value key) is reloaded
/// under the lock key, the copy staying in place while it loads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_copy_is_reloaded_under_the_lock_key_and_stays_meanwhile() {
    let env = TestEnv::new(3).await;
    // No memory tier: the second read must go to Redis.
    let app = env
        .spawn(&["--lock-ttl", "5s", "--l1-max-bytes", "0"])
        .await;
    assert_eq!(app.get("/posts/2").await.status, 200);
    env.expire_freshness(2).await;
    let lock = TableLock::take(&env).await;

    let request = app.http.spawn_get("/posts/2");
    env.until_held(std::slice::from_ref(&app), 1).await;
    let during = inspect(&env, 2).await;
    lock.release().await;
    let (reply, _) = request.await.unwrap();

    assert_eq!(reply.status, 200);
    assert_eq!(reply.x_cache.as_deref(), Some("miss"));
    assert!(during.lock.held);
    assert_eq!(during.lock.key, env.keys.lock(2));
    let copy = during.fail_safe.entry.as_ref().expect("the copy stays");
    assert_eq!(copy.status, EntryStatus::Found);
    // The finish lets go after the answer went out (a moment later on a
    // busy machine).
    wait_until("the leader to let go of the lock", A_WHILE, async || {
        !env.lock_held(2).await
    })
    .await;
}

/// When loads fail: a stale post is re-served as a backoff copy, and a post
/// with nothing to re-serve gets a failure marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inspect_shows_a_backoff_copy_and_a_failure_marker_while_loads_fail() {
    let env = TestEnv::new(10).await;
    let app = env
        .spawn(&fresh_for(
            "300ms",
            &["--failure-ttl", "5s", "--l1-max-bytes", "0"],
        ))
        .await;
    assert_eq!(app.get("/posts/5").await.status, 200);
    tokio::time::sleep(Duration::from_millis(400)).await;
    env.break_posts(true).await;
    app.stop_pool_connections().await;

    let stale = app.get("/posts/5").await;
    let cold = app.get("/posts/6").await;
    let backoff = inspect(&env, 5).await;
    let failed = inspect(&env, 6).await;
    env.break_posts(false).await;

    assert_eq!(stale.x_cache.as_deref(), Some("stale"));
    assert_eq!(cold.status, 503);
    assert_eq!(backoff.status, EntryStatus::Backoff);
    let entry = backoff.value.entry.as_ref().expect("the copy re-served");
    assert!(entry.fresh_for_ms < 0, "{entry:?}");
    assert_eq!(failed.status, EntryStatus::Failed);
    assert!(failed.value.ttl_ms.expect("a marker expires") <= 5_500);
}

/// The binary's `--json`, as scripts read it: the status by name.
#[tokio::test]
async fn the_inspect_command_prints_json_naming_the_status() {
    let env = TestEnv::new(3).await;
    let app = env.spawn(&[]).await;
    assert_eq!(app.get("/posts/1").await.status, 200);

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_postcache"))
        .args(["inspect", "1", "--json"])
        .env("REDIS_URL", &env.redis_url)
        .env("KEY_PREFIX", &env.prefix)
        .output()
        .await
        .unwrap();
    let words = tokio::process::Command::new(env!("CARGO_BIN_EXE_postcache"))
        .args(["inspect", "1"])
        .env("REDIS_URL", &env.redis_url)
        .env("KEY_PREFIX", &env.prefix)
        .output()
        .await
        .unwrap();
    let bad = tokio::process::Command::new(env!("CARGO_BIN_EXE_postcache"))
        .args(["inspect", "0"])
        .output()
        .await
        .unwrap();

    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["status"], "found");
    assert_eq!(json["value"]["entry"]["status"], "found");
    assert_eq!(json["lock"]["held"], false);
    assert!(json["value"]["ttl_ms"].as_u64().unwrap() > 0);
    let words = String::from_utf8(words.stdout).unwrap();
    assert!(words.starts_with("post 1: found\n"), "{words}");
    assert!(
        words.contains("lock") && words.contains("0 subscribers"),
        "{words}"
    );
    assert!(!bad.status.success(), "an invalid id is refused");
}

/// A seed writes without a change per post: one `invalidate_all` per batch,
/// in the batch's transaction, which the running fleet follows at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reseed_records_one_change_per_batch_and_the_fleet_serves_the_new_posts() {
    let env = TestEnv::new(3).await;
    let apps = join_all((0..2).map(|_| env.spawn(&["--cache-ttl", "1h"]))).await;
    for app in &apps {
        assert_eq!(app.get("/posts/2").await.status, 200);
        assert_eq!(app.get("/posts/2").await.tier(), Some("memory"));
    }
    let changes = |op: &'static str| {
        let admin = env.admin.clone();
        async move {
            sqlx::query_scalar::<_, i64>("select count(*) from post_changes where op = $1")
                .bind(op)
                .fetch_one(&admin)
                .await
                .unwrap()
        }
    };
    let (inserts, updates) = (changes("insert").await, changes("update").await);
    let argv = [
        "postcache",
        "seed",
        "--database-url",
        &env.db_url,
        "--posts",
        "25000",
    ];
    let Command::Seed(args) = Cli::try_parse_from(argv.into_iter().chain(["--seed", "99"]))
        .unwrap()
        .command
    else {
        unreachable!("seed was asked for")
    };

    let written = seed::run(&args).await.unwrap();

    assert_eq!(written, 25_000);
    let expected = seed::generate(2, 99).title;
    for app in &apps {
        wait_until("the new post 2", A_WHILE, async || {
            app.get("/posts/2").await.json()["title"] == expected.as_str()
        })
        .await;
    }
    assert_eq!(
        changes("invalidate_all").await,
        3,
        "one per batch of 10,000"
    );
    assert_eq!(changes("insert").await, inserts, "no change per post");
    assert_eq!(changes("update").await, updates, "no change per post");
}

/// `postcache slot` with the fleet's settings, as an operator runs it:
/// (whether it exited 0, stdout, stderr).
async fn slot(env: &TestEnv, prefix: &str, args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_postcache"))
        .arg("slot")
        .args(args)
        .env("DATABASE_URL", &env.db_url)
        .env("KEY_PREFIX", prefix)
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// This fleet's slot as `slot list --json` shows it.
async fn listed(env: &TestEnv, prefix: &str) -> Option<serde_json::Value> {
    let (ok, out, err) = slot(env, prefix, &["list", "--json"]).await;
    assert!(ok, "{err}");
    let list: serde_json::Value = serde_json::from_str(&out).unwrap();
    list["slots"]
        .as_array()
        .unwrap()
        .iter()
        .find(|slot| slot["this_fleet"] == true)
        .cloned()
}

/// A fleet's slot listed with the WAL it holds, a drop refused while its
/// decoder reads it, a fleet of another KEY_PREFIX warned at start of the
/// slot left idle, then the slot dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retired_fleets_slot_is_listed_warned_of_and_dropped() {
    let env = TestEnv::new(2).await;
    let app = env.spawn(&["--change-feed", "replication"]).await;
    crate::support::until_feed(&app.http, "up").await;
    let read = listed(&env, &env.prefix).await.expect("the fleet's slot");
    assert_eq!(read["active"], true, "{read}");
    assert_eq!(read["database"], env.db_name.as_str());
    assert!(read["retained_bytes"].as_i64().is_some(), "{read}");

    let (ok, _, err) = slot(&env, &env.prefix, &["drop"]).await;
    assert!(!ok && err.contains("read by a decoder"), "{err}");

    // The fleet retired: its slot is read by nobody, and holds WAL.
    drop(app);
    wait_until("the slot to be let go", A_WHILE, async || {
        listed(&env, &env.prefix)
            .await
            .is_some_and(|slot| slot["active"] == false)
    })
    .await;
    let other = format!("{}other:", env.prefix);
    let service = env
        .start_process(&[
            ("KEY_PREFIX", other.clone()),
            ("CHANGE_FEED", "replication".into()),
        ])
        .await;
    crate::support::until_feed(&service.http, "up").await;
    let name = read["name"].as_str().unwrap();
    assert!(
        service
            .logs()
            .lines()
            .any(|line| line.contains(" WARN ") && line.contains(name)),
        "the idle slot is warned of: {}",
        service.logs()
    );
    drop(service);

    let (ok, out, err) = slot(&env, &env.prefix, &["drop"]).await;
    assert!(ok, "{err}");
    assert!(out.starts_with(&format!("dropped {name}")), "{out}");
    assert!(listed(&env, &env.prefix).await.is_none());
    let (ok, _, err) = slot(&env, &env.prefix, &["drop"]).await;
    assert!(!ok && err.contains("no slot named"), "{err}");
    let (ok, _, err) = slot(&env, &env.prefix, &["drop", "pg_other"]).await;
    assert!(!ok && err.contains("not a postcache slot"), "{err}");
    // The other fleet's slot goes with the database.
    let (ok, out, _) = slot(&env, &other, &["list"]).await;
    assert!(ok && out.contains("(this fleet)"), "{out}");
}
