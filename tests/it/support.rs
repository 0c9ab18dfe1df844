//! What several test modules share that only these tests need: the flags
//! of an exact freshness, the wait for what `/readyz` says of the change
//! feed, and a stampede's replies counted by how they were served.

use std::time::Instant;

use postcache::testkit::{answered, wait_until, Http, Reply, A_WHILE};
use tokio::task::JoinHandle;

/// The flags of an instance whose entries are fresh for exactly `ttl` (no
/// jitter, so that a test can sleep past their freshness), then `extra`.
pub fn fresh_for<'a>(ttl: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    ["--cache-ttl", ttl, "--ttl-jitter", "0"]
        .into_iter()
        .chain(extra.iter().copied())
        .collect()
}

/// Waits until the instance behind `http` says on `/readyz` that its change
/// feed is `state` (`up`, `down`): a feed takes a moment to come up, and
/// to notice it is down.
pub async fn until_feed(http: &Http, state: &str) {
    wait_until(&format!("the feed {state}"), A_WHILE, async || {
        http.get("/readyz").await.json()["change_feed"] == state
    })
    .await;
}

/// The replies of requests fired together (`testkit::fire`), once all are
/// answered, without when each arrived.
pub async fn replies(requests: Vec<JoinHandle<(Reply, Instant)>>) -> Vec<Reply> {
    answered(requests)
        .await
        .into_iter()
        .map(|(reply, _)| reply)
        .collect()
}

/// How many of `replies` were served as `how` (their X-Cache: `miss`,
/// `coalesced`, ...).
pub fn served_as<'a>(replies: impl IntoIterator<Item = &'a Reply>, how: &str) -> usize {
    replies
        .into_iter()
        .filter(|r| r.x_cache.as_deref() == Some(how))
        .count()
}
