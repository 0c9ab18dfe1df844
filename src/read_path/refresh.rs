//! The protocol: background refreshes (stale-while-revalidate and XFetch
//! early refresh).
//!
//! One lock-guarded refresh for the whole fleet, without anyone waiting: the
//! instance that wins `SET NX` reloads (as a leader: double-check, watchdog,
//! finish); the others do nothing and keep serving what they have. Each runs
//! as a task of its own, so it completes even if the request that triggered
//! it is gone, and shutdown waits for it.

use std::{
    collections::HashSet,
    hash::Hash,
    sync::{Arc, Mutex, PoisonError},
};

use rand::Rng;
use tracing::Instrument;

use super::{
    context::Context,
    freshness::xfetch_fires,
    leader::{self, lock_token, Leader},
    machine::Led,
    source::Source,
};
use crate::{
    cache::{Entry, Status},
    telemetry::metrics,
};

/// A key's place in the set of refreshes running in this process, left
/// however the refresh ends (done, panicked, or dropped at shutdown).
struct Refreshing<K: Eq + Hash> {
    set: Arc<Mutex<HashSet<K>>>,
    key: K,
}

impl<K: Eq + Hash + Clone> Refreshing<K> {
    /// `None` when this process already refreshes `key`.
    fn enter(set: &Arc<Mutex<HashSet<K>>>, key: &K) -> Option<Self> {
        let inserted = set
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.clone());
        inserted.then(|| Self {
            set: set.clone(),
            key: key.clone(),
        })
    }
}

impl<K: Eq + Hash> Drop for Refreshing<K> {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.key);
    }
}

/// The background refreshes running in this process: one per key.
pub(super) struct Refreshes<S: Source> {
    /// A std mutex: held only to insert or remove.
    running: Arc<Mutex<HashSet<S::Key>>>,
}

impl<S: Source> Default for Refreshes<S> {
    fn default() -> Self {
        Self {
            running: Arc::default(),
        }
    }
}

impl<S: Source> Refreshes<S> {
    /// XFetch on a fresh hit: the closer to expiry, the likelier one
    /// request starts the refresh, so that a hot key never expires.
    pub fn maybe_early(&self, ctx: &Arc<Context<S>>, key: &S::Key, entry: &Entry, now: u64) {
        let beta = ctx.settings.early_refresh_beta;
        // A not-found entry is not refreshed early: it expires after
        // NEGATIVE_TTL, and a refresh could only turn it into a failure.
        if beta <= 0.0 || entry.status() != Status::Found {
            return;
        }
        // (0, 1]: ln(0) would be −∞.
        let u = 1.0 - rand::rng().random::<f64>();
        if xfetch_fires(now, entry.fresh_until(), entry.load_time(), beta, u) {
            self.start(ctx, key.clone(), Some(entry.stored_at()));
        }
    }

    /// Starts one refresh of `key` unless this process runs one already.
    /// `seen` is the stored_at of the entry that triggered it.
    ///
    /// The refresh is a leader as a miss's is ([`leader::claim`], then
    /// [`Leader::lead`]), with nobody waiting on it: a claim lost means
    /// another instance refreshes, and nothing is awaited.
    pub fn start(&self, ctx: &Arc<Context<S>>, key: S::Key, seen: Option<u64>) {
        let Some(refreshing) = Refreshing::enter(&self.running, &key) else {
            return;
        };
        let ctx = ctx.clone();
        ctx.tasks.clone().spawn(
            async move {
                let _refreshing = refreshing;
                let keys = ctx.keys.item(&key);
                let token = lock_token();
                let ticket = ctx.memory.ticket(&key);
                match leader::claim(&ctx, &keys, &token).await {
                    Ok(Some(before)) => {
                        let leader = Leader::elected(&ctx, &key, &keys, &token);
                        let result = match leader.lead(before, seen, false).await {
                            Led::Done(Err(_)) => "failed",
                            Led::Done(Ok(answer)) => {
                                ctx.keep_in_memory(&key, &answer, &ticket);
                                "refreshed"
                            }
                            // The next reader starts another refresh.
                            Led::Fenced(_) => "fenced",
                        };
                        metrics::refresh(result);
                    }
                    Ok(None) => metrics::refresh("lost"),
                    Err(error) => {
                        tracing::debug!(%error, "background refresh skipped");
                        metrics::refresh("failed");
                    }
                }
            }
            .instrument(tracing::info_span!(
                "refresh",
                load_ms = tracing::field::Empty
            )),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_refresh_that_panics_leaves_its_key_refreshable() {
        let set: Arc<Mutex<HashSet<u32>>> = Arc::default();
        let refreshing = Refreshing::enter(&set, &7).expect("not refreshing yet");
        assert!(Refreshing::enter(&set, &7).is_none(), "one refresh per key");

        let task = tokio::spawn(async move {
            let _refreshing = refreshing;
            panic!("the refresh exploded");
        });

        assert!(task.await.is_err());
        assert!(
            Refreshing::enter(&set, &7).is_some(),
            "the key can be refreshed again"
        );
    }
}
