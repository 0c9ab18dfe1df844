//! The load lab's baselines (CACHE_STRATEGY `none`, `naive`, `local`):
//! each a reader of its own in front of the read path, serving as the
//! design it stands for, so that `load/compare` measures what it says.

use postcache::testkit::TestEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_baseline_serves_as_the_design_it_stands_for() {
    let env = TestEnv::new(10).await;
    // (strategy, post, how the first and the second read are served, the
    // loads they make)
    let cases = [
        // Every request reads PostgreSQL; nothing is cached.
        ("none", 1, [("bypass", None), ("bypass", None)], 2),
        // Cache-aside in Redis, without the memory tier.
        ("naive", 2, [("miss", None), ("hit", Some("redis"))], 1),
        // Cache-aside, kept in this process's memory tier too.
        ("local", 3, [("miss", None), ("hit", Some("memory"))], 1),
    ];
    for (strategy, id, served, loads) in cases {
        let app = env.spawn(&["--cache-strategy", strategy]).await;
        let before = env.post_reads().await;
        let path = format!("/posts/{id}");
        for (x_cache, tier) in served {
            let reply = app.get(&path).await;
            assert_eq!(reply.status, 200, "{strategy}");
            assert_eq!(reply.json()["id"], id, "{strategy}");
            assert_eq!(
                (reply.x_cache.as_deref(), reply.tier()),
                (Some(x_cache), tier),
                "{strategy}"
            );
        }
        app.stop().await;
        assert_eq!(env.post_reads().await - before, loads, "{strategy}");
    }
}
