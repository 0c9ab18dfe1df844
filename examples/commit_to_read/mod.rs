//! What the two examples that time a commit until its new version is read
//! (`change_feed` and `replicas`) share: their setting, N from the command
//! line, the update each commit makes and the read load that runs
//! meanwhile. (A folder without a `main.rs`, so Cargo does not take it for
//! an example of its own.)

use std::time::Duration;

use postcache::testkit::{Http, SteadyLoad, TestEnv, Zipf};

/// Posts seeded.
pub const POSTS: u64 = 1000;
/// The hottest posts: the updates go to them in turn.
pub const HOT: i64 = 20;
/// Instances of the fleet.
pub const INSTANCES: usize = 3;
/// One update every PACE.
pub const PACE: Duration = Duration::from_millis(10);
/// Reads after the first new one, each checked for an older version.
pub const AFTER: usize = 10;
/// Bound on one probe.
pub const PROBE_LIMIT: Duration = Duration::from_secs(5);

/// N, the updates to make: the first argument, 1,000 by default.
pub fn changes_asked() -> u64 {
    std::env::args()
        .nth(1)
        .map_or(1000, |s| s.parse().expect("N"))
}

/// Sets post `id`'s title to `v{version}`, as any other writer would: the
/// probes read the version back from the title.
pub async fn update(env: &TestEnv, id: i64, version: u64) {
    sqlx::query("update posts set title = $1 where id = $2")
        .bind(format!("v{version}"))
        .bind(id)
        .execute(&env.admin)
        .await
        .unwrap();
}

/// Starts the read load that runs while the updates are made: Zipf(1.1)
/// over every post, about 1,000 requests/s spread over `https`. Returns
/// once it has run for a second.
pub async fn read_load(https: &[Http]) -> SteadyLoad {
    let load = SteadyLoad::start(
        https,
        Zipf::new(POSTS as usize, 1.1),
        4,
        Duration::from_millis(4),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    load
}

/// A duration in milliseconds, to one decimal.
pub fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}
