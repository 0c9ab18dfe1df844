//! The test support itself: what the other tests rely on.

use std::time::Duration;

use postcache::testkit::{eventually, TestEnv};

#[tokio::test]
async fn extra_flags_replace_the_base_ones_booleans_included() {
    let env = TestEnv::new(0).await;

    // The base flags hold `--no-migrate` already: clap refuses a flag given
    // twice, so these parse only if each replaces the one before.
    let args = env.serve_args(&[
        "--no-migrate",
        "--lock-ttl",
        "9s",
        "--key-prefix=other:",
        "--lock-ttl",
        "7s",
    ]);

    assert_eq!(
        args.cache.lock_ttl,
        Duration::from_secs(7),
        "the last one wins"
    );
    assert_eq!(args.cache.key_prefix, "other:");
    assert_eq!(args.database.database_url, env.db_url, "the rest is kept");
}

#[tokio::test]
async fn a_wait_ends_at_its_bound() {
    let started = std::time::Instant::now();

    let held = eventually(Duration::from_millis(50), async || false).await;

    assert!(!held);
    assert!(started.elapsed() >= Duration::from_millis(50));
    assert!(eventually(Duration::from_millis(50), async || true).await);
}
