//! HTTP: the state every handler reaches, cloned per request.

use std::sync::Arc;

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
    /// Reads past the cache, for those that ask for a position it cannot
    /// vouch for (see `position.rs`).
    pub store: PostStore,
    /// MIN_LSN_WAIT.
    pub min_lsn_wait: std::time::Duration,
}
