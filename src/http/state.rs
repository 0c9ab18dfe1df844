//! HTTP: the state every handler reaches, cloned per request.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};

use metrics_exporter_prometheus::PrometheusHandle;

use super::{caching::CachingHeaders, probe::Probe};
use crate::{changes::FeedStatus, read_path::ReadPath, store::PostStore};

/// What every handler can reach; cloned per request (one reference count).
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    pub fn new(shared: Shared) -> Self {
        Self(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The parts of [`AppState`].
pub struct Shared {
    pub read_path: Arc<ReadPath<PostStore>>,
    /// The loads' pool (closed at shutdown; `/readyz` never takes from it).
    pub db: sqlx::PgPool,
    /// What `/readyz` says of PostgreSQL and Redis, off the load path.
    pub probe: Probe,
    pub metrics: PrometheusHandle,
    /// Whether the change feed is up (for `/readyz`).
    pub feed: FeedStatus,
    /// The values of the caching headers, made once.
    pub caching: CachingHeaders,
    /// DATABASE_REPLICA_URLS (for `/readyz`).
    pub replicas: Option<Arc<crate::store::Replicas>>,
    /// The PostgreSQL pools by name, for their metrics (loads, past,
    /// probe, feed).
    pub pools: Vec<(&'static str, sqlx::PgPool)>,
    /// Set at the shutdown signal: `/readyz` then answers 503 while reads
    /// are still served for SHUTDOWN_DELAY (see [`Shared::drain`]).
    pub draining: AtomicBool,
}

impl Shared {
    /// From now on `/readyz` answers 503 `draining`; reads are served as
    /// before until the listener stops.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }
}
