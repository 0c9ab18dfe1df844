//! Read your writes, end to end: an application writes a post by plain
//! SQL, reads `pg_current_wal_lsn()` once its COMMIT returned, and hands
//! that position to its client; the client's next read, on any instance,
//! carries it as `PostCache-Min-LSN` and reflects the write.
//!
//! ```text
//! cargo run --release --example read_your_writes [-- --trials 100000]
//! ```
//!
//! Two instances (CHANGE_FEED=replication) share a private database and
//! KEY_PREFIX. Each trial writes one post, then at once reads it on the
//! other instance: every other trial without the header (how often the
//! old version comes back), the rest with it (never, and how it was
//! answered). Beside them, plain memory-tier hits of a post nobody
//! writes, for the latency the header adds. Prints one markdown table.

use std::time::{Duration, Instant};

use postcache::testkit::{numeric_arg, quantile, Http, TestEnv, REPLICATION_LONG_LIVED};

/// The title a reply shows, and how it was answered.
async fn read(http: &Http, id: i64, min_lsn: Option<&str>) -> (String, String, Duration) {
    let headers: Vec<(&str, &str)> = min_lsn
        .map(|lsn| vec![("PostCache-Min-LSN", lsn)])
        .unwrap_or_default();
    let started = Instant::now();
    let reply = http
        .send(reqwest::Method::GET, &format!("/posts/{id}"), &headers)
        .await
        .expect("an answer");
    let took = started.elapsed();
    assert_eq!(reply.status, 200, "{}", reply.text());
    let title = reply.json()["title"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let how = reply.cache_status().unwrap_or_default().to_owned();
    (title, how, took)
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let trials = numeric_arg("--trials", 2000) as usize;
    const POSTS: i64 = 20;
    let env = TestEnv::new(POSTS as u64 + 1).await;
    let flags = REPLICATION_LONG_LIVED;
    let fleet = [env.spawn(&flags).await, env.spawn(&flags).await];
    for app in &fleet {
        let started = Instant::now();
        while app.http.get("/readyz").await.json()["read_your_writes"] != "cache" {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the feed never came up"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for id in 1..=POSTS + 1 {
            read(&app.http, id, None).await;
        }
    }
    let (mut plain, mut plain_old) = (0usize, 0usize);
    let (mut asked, mut asked_old, mut from_cache) = (0usize, 0usize, 0usize);
    let (mut asked_took, mut hit_took) = (Vec::new(), Vec::new());
    for trial in 0..trials {
        let id = 1 + (trial as i64 % POSTS);
        let (writer, reader) = (&fleet[trial % 2].http, &fleet[1 - trial % 2].http);
        // The post is in both instances' memory tiers before the write.
        read(writer, id, None).await;
        read(reader, id, None).await;
        let title = format!("trial {trial}");
        env.retitle(id, &title).await;
        // Once the COMMIT returned (above, autocommit): the position.
        let lsn: String = sqlx::query_scalar("select pg_current_wal_lsn()::text")
            .fetch_one(&env.admin)
            .await
            .expect("a position");
        if trial % 2 == 0 {
            plain += 1;
            if read(reader, id, None).await.0 != title {
                plain_old += 1;
            }
        } else {
            asked += 1;
            let (seen, how, took) = read(reader, id, Some(&lsn)).await;
            if seen != title {
                asked_old += 1;
            }
            if !how.ends_with("detail=position") {
                from_cache += 1;
            }
            asked_took.push(took);
            // A plain memory hit of a post nobody writes, on the same
            // instance, just after: the latency the header is judged by.
            hit_took.push(read(reader, POSTS + 1, None).await.2);
        }
    }
    asked_took.sort_unstable();
    hit_took.sort_unstable();
    println!("{trials} trials: a write by plain SQL, then at once a read of that post on the other instance (2 instances in one process, CHANGE_FEED=replication)\n");
    println!("| read | trials | old version | from the cache | p50 ms | p99 ms |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| without a position | {plain} | {plain_old} ({:.1}%) | | | |",
        100.0 * plain_old as f64 / plain.max(1) as f64
    );
    println!(
        "| with `PostCache-Min-LSN` | {asked} | {asked_old} | {from_cache} ({:.1}%) | {} | {} |",
        100.0 * from_cache as f64 / asked.max(1) as f64,
        ms(quantile(&asked_took, 0.5)),
        ms(quantile(&asked_took, 0.99)),
    );
    println!(
        "| plain memory hit (a post not written) | {} | | | {} | {} |",
        hit_took.len(),
        ms(quantile(&hit_took, 0.5)),
        ms(quantile(&hit_took, 0.99)),
    );
    println!(
        "\nadded p99 of a read with the position over a plain hit: {} ms",
        ms(quantile(&asked_took, 0.99).saturating_sub(quantile(&hit_took, 0.99)))
    );
    if asked_old > 0 {
        std::process::exit(1);
    }
}
