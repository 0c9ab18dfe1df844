//! The HTTP interface: routes, handlers and the error type.

mod error;
mod handlers;
mod id;

use std::sync::Arc;

use axum::{routing::get, Router};

pub use error::ApiError;
pub use id::PostId;

use crate::{flight::ReadPath, posts::PostSource};

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub read_path: Arc<ReadPath<PostSource>>,
    pub db: sqlx::PgPool,
}

/// The router, without the listener: tests can drive it directly.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/posts/{id}", get(handlers::get_post))
        // `/posts/` (an empty id) is a bad id, not an unknown route.
        .route("/posts/", get(handlers::empty_id))
        .route("/healthz", get(handlers::healthz))
        .route("/readyz", get(handlers::readyz))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .with_state(state)
}
