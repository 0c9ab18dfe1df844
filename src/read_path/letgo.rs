//! The protocol: letting go of a lock or a claim in the background. A
//! leader gone without finishing, a claim won at a first look that no
//! flight took, and an attempt whose answer never came each leave a lock
//! that nobody holds: it is let go, token-checked, retried with backoff
//! for up to LOCK_TTL (by then it has expired by itself), so that the
//! waiters elsewhere elect again now instead of sleeping until LOCK_TTL.

use std::time::{Duration, Instant};

use tokio_util::task::TaskTracker;

use super::{context::Context, source::Source};
use crate::redis::{with_backoff, LockOp, OnLock, RedisCommands};

/// A lock attempt until Redis answers it (see [`claim`](super::leader::claim)).
pub(super) struct Attempt<'a, S: Source> {
    pub ctx: &'a Context<S>,
    pub lock: &'a str,
    /// The ready channel its waiters listen on.
    pub channel: &'a str,
    pub token: &'a str,
    /// Redis answered (or the breaker refused: nothing went out).
    pub answered: bool,
}

impl<S: Source> Drop for Attempt<'_, S> {
    fn drop(&mut self) {
        if !self.answered {
            abandon_in_background(
                self.ctx,
                self.lock.to_owned(),
                self.channel.to_owned(),
                self.token.to_owned(),
            );
        }
    }
}

/// Lets go of `lock` if it holds `token`, publishing `retry` on `channel`
/// so that its waiters elect again now, in the background, retried with
/// backoff for up to LOCK_TTL (see `Held` in leader.rs).
pub(super) fn abandon_in_background<S: Source>(
    ctx: &Context<S>,
    lock: String,
    channel: String,
    token: String,
) {
    // Outside a runtime (it is gone): the lock expires by itself.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (redis, tasks) = (&ctx.redis, &ctx.tasks);
    abandon(
        redis,
        tasks,
        ctx.settings.lock_ttl,
        lock,
        channel,
        token,
        &runtime,
    );
}

pub(super) fn abandon(
    redis: &RedisCommands,
    tasks: &TaskTracker,
    lock_ttl: Duration,
    lock: String,
    channel: String,
    token: String,
    runtime: &tokio::runtime::Handle,
) {
    let redis = redis.clone();
    let give_up = Instant::now() + lock_ttl;
    tasks.spawn_on(
        async move {
            let abandon = OnLock {
                lock: &lock,
                token: &token,
                op: LockOp::Abandon {
                    channel: &channel,
                    sharded: redis.sharded(),
                },
            };
            match with_backoff(give_up, || redis.eval(&abandon)).await {
                Ok(true) => tracing::info!(lock, "lock let go; its waiters elect again"),
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(%error, lock, "could not let go of the lock; it expires by itself")
                }
            }
        },
        runtime,
    );
}
