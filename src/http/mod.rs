//! The HTTP interface: routes, handlers, the error type, and the tower layers
//! that bound every request.

mod error;
mod handlers;
mod id;
mod served;
mod server;

use std::{sync::Arc, time::Duration};

use axum::{
    error_handling::HandleErrorLayer, middleware::map_response, response::Response, routing::get,
    BoxError, Router,
};
use metrics_exporter_prometheus::PrometheusHandle;
use tower::ServiceBuilder;

pub use error::ApiError;
pub use id::{InvalidId, PostId};
pub use server::{connection_cap, serve, ConnectionLimits};

use crate::{changes::FeedStatus, flight::ReadPath, posts::PostStore, telemetry::metrics};

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
    pub db: sqlx::PgPool,
    pub metrics: PrometheusHandle,
    /// Whether the change feed is up (for `/readyz`).
    pub feed: FeedStatus,
}

/// Bounds applied to every request.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Requests handled at once; past it, 503 at once instead of queueing.
    pub max_in_flight: usize,
    /// Longest a request may take.
    pub request_timeout: Duration,
}

/// What answers each request: a memory hit of `GET /posts/{id}` at once
/// ([`handlers::memory_hit`]), anything else through the router.
#[derive(Clone)]
pub struct Endpoint {
    state: AppState,
    router: Router,
}

impl Endpoint {
    pub fn new(state: AppState, limits: Limits) -> Self {
        Self {
            router: app(state.clone(), limits),
            state,
        }
    }

    /// The answer to `request`; never an error (errors are responses).
    pub fn answer(
        &self,
        request: axum::http::Request<hyper::body::Incoming>,
    ) -> impl std::future::Future<Output = Result<Response, std::convert::Infallible>> + Send + 'static
    {
        use futures::future::{ready, Either};
        use tower::ServiceExt;
        match handlers::memory_hit(&self.state, &request) {
            Some(response) => Either::Left(ready(Ok(response))),
            None => Either::Right(
                self.router
                    .clone()
                    .oneshot(request.map(axum::body::Body::new)),
            ),
        }
    }
}

/// The router, without the listener: tests can drive it directly.
pub fn app(state: AppState, limits: Limits) -> Router {
    Router::new()
        .route("/posts/{id}", get(handlers::get_post))
        // `/posts/` (an empty id) is a bad id, not an unknown route.
        .route("/posts/", get(handlers::empty_id))
        .route("/healthz", get(handlers::healthz))
        .route("/readyz", get(handlers::readyz))
        .route("/metrics", get(handlers::metrics))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .with_state(state)
        .layer(
            ServiceBuilder::new()
                // Outermost: counts every error response, the layers' own included.
                .layer(map_response(count_errors))
                .layer(HandleErrorLayer::new(|error: BoxError| async move {
                    ApiError::from_layer(error.as_ref())
                }))
                // Load shedding turns "no capacity" into an immediate error
                // instead of an unbounded queue of waiting requests.
                .load_shed()
                .concurrency_limit(limits.max_in_flight)
                .timeout(limits.request_timeout),
        )
}

/// Counts error responses by status code.
async fn count_errors(response: Response) -> Response {
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        metrics::http_error(status.as_u16());
    }
    response
}
