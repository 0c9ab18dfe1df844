//! The protocol: loads from the source, shared by the leader, the
//! waiters that pass, the bypass of a failing Redis and the baselines.
//! Bounded by LOAD_TIMEOUT; an item over MAX_ENTRY_BYTES is served but
//! never stored. The protocol's loads are batched (`batch.rs`); the load
//! lab's baselines make a statement per request.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use super::{
    answer::Outcome,
    batch::{Batches, Expected},
    source::Loaded,
    Answer, Busy, Served, Settings, Since, Source,
};
use crate::{
    cache::{Entry, Jitter, Status},
    redis::RedisError,
    telemetry::metrics,
};

/// The source and the bounds of each load.
pub(super) struct Loader<S: Source> {
    source: Arc<Batches<S>>,
    /// Whether loads go through the batches (the protocol's strategies).
    batched: bool,
    cache_ttl: Duration,
    negative_ttl: Duration,
    jitter: Jitter,
    load_timeout: Duration,
    max_entry_bytes: usize,
}

impl<S: Source> Loader<S> {
    pub fn new(source: S, s: &Settings) -> Self {
        Self {
            source: Batches::new(
                source,
                s.load_batch_max,
                s.load_statements,
                s.load_queue_timeout,
            ),
            batched: s.batch_loads,
            cache_ttl: s.cache_ttl,
            negative_ttl: s.negative_ttl,
            jitter: s.jitter,
            load_timeout: s.load_timeout,
            max_entry_bytes: s.max_entry_bytes,
        }
    }

    /// The source itself.
    pub fn source(&self) -> &S {
        self.source.source()
    }

    /// Every item's ordinal, for the existence guard (see existence.rs).
    pub async fn ordinals(&self) -> Result<Option<roaring::RoaringTreemap>, super::LoadError> {
        self.source.source().ordinals().await
    }

    /// Whether a load statement of this process succeeded within `window`,
    /// and none failed since.
    pub fn answered_within(&self, window: Duration) -> bool {
        self.source.answered_within(window)
    }

    /// A batch read is about to load `key` (see [`Batches::expect`]).
    pub fn expect(&self, key: &S::Key) -> Expected<S> {
        self.source.expect(key)
    }

    /// No load of `key` will come from this flight (see
    /// [`Batches::not_loading`]).
    pub fn not_loading(&self, key: &S::Key) {
        self.source.not_loading(key);
    }

    /// Loads with Redis skipped (it failed, or its breaker is open).
    pub async fn bypass(&self, key: &S::Key) -> Outcome {
        tracing::Span::current().record("role", "bypass");
        Answer::new(self.entry(key, Since::PRIMARY).await?, Served::Bypass)
    }

    /// Loads an item a too-large marker names, straight from the source:
    /// nothing is stored (the marker stays until a change or its expiry).
    pub async fn pass(&self, key: &S::Key) -> Outcome {
        tracing::Span::current().record("role", "pass");
        let entry = self.entry(key, Since::PRIMARY).await?;
        let served = self.served_uncached(&entry);
        Answer::new(entry, served)
    }

    /// How a loaded entry that is not stored is served: too large, or (it
    /// shrank, or is gone) a plain bypass.
    pub fn served_uncached(&self, entry: &Entry) -> Served {
        if self.too_large(entry) {
            Served::TooLarge
        } else {
            Served::Bypass
        }
    }

    /// Whether `entry`'s body is over MAX_ENTRY_BYTES.
    pub fn too_large(&self, entry: &Entry) -> bool {
        entry.status() == Status::Found && entry.body().len() > self.max_entry_bytes
    }

    /// What a leader stores and publishes for what it loaded: the entry
    /// itself, or, for a body over MAX_ENTRY_BYTES, a too-large marker
    /// (fresh as long as the entry) with the entry kept aside to answer
    /// this flight.
    pub fn to_store(&self, loaded: Entry) -> (Entry, Option<Entry>) {
        if !self.too_large(&loaded) {
            return (loaded, None);
        }
        metrics::too_large();
        let marker = Entry::stamped(
            Status::TooLarge,
            &[],
            loaded.stored_at(),
            loaded.fresh_until(),
            loaded.load_time(),
        );
        (marker, Some(loaded))
    }

    pub async fn fail_open(&self, key: &S::Key, error: RedisError) -> Outcome {
        tracing::warn!(%error, "redis failed; failing open to the source");
        self.bypass(key).await
    }

    /// Loads and builds the entry, fresh for the (jittered) CACHE_TTL or
    /// NEGATIVE_TTL; a failed load gives a `Failed` entry, a load the source
    /// had no capacity for [`Busy`] (counted as shed).
    ///
    /// `since`: the last change the load must see (see [`Since`]).
    pub async fn entry(&self, key: &S::Key, since: Since) -> Result<Entry, Busy> {
        let started = Instant::now();
        let load = async {
            if self.batched {
                self.source.load(key, since).await
            } else {
                self.source.source().load(key, since).await
            }
        };
        let loaded = tokio::time::timeout(self.load_timeout, load)
            .await
            .unwrap_or_else(|_| {
                Err(anyhow::anyhow!(
                    "no answer within LOAD_TIMEOUT ({:?})",
                    self.load_timeout
                ))
            });
        let took = started.elapsed();
        let took_ms = took.as_secs_f64() * 1e3;
        tracing::Span::current().record("load_ms", took_ms);
        let jitter = self.jitter;
        Ok(match loaded {
            Ok(Loaded {
                body: Some(body),
                upto,
            }) => {
                metrics::db_load("found", took);
                tracing::debug!(%key, took_ms, "loaded");
                let ttl = jitter.apply(self.cache_ttl);
                Entry::from_load(Status::Found, &body, ttl, took, started, upto)
            }
            Ok(Loaded { body: None, upto }) => {
                metrics::db_load("not_found", took);
                tracing::debug!(%key, took_ms, "loaded: not found");
                let ttl = jitter.apply(self.negative_ttl);
                Entry::from_load(Status::NotFound, &[], ttl, took, started, upto)
            }
            Err(error) if error.is::<Busy>() => {
                metrics::shed("db_pool");
                tracing::debug!(%key, took_ms, "no connection free in time: shed");
                return Err(Busy);
            }
            Err(error) => {
                metrics::db_load("failed", took);
                tracing::warn!(error = format!("{error:#}"), %key, "load failed");
                Entry::new(Status::Failed, &[], Duration::ZERO, took)
            }
        })
    }
}
