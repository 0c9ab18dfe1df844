//! Request handlers.

use std::time::Duration;

use axum::{
    extract::{rejection::PathRejection, Path, State},
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Json,
};
use serde_json::json;

use super::{error::ApiError, id::PostId, AppState};
use crate::cache::Status;

/// Bound on each readiness probe.
const READINESS_TIMEOUT: Duration = Duration::from_secs(1);

/// `GET /posts/{id}`
#[tracing::instrument(skip_all, fields(id, outcome, role, load_ms))]
pub async fn get_post(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let Path(segment) = path.map_err(|_| ApiError::InvalidPath)?;
    let id = PostId::parse(&segment)?;
    tracing::Span::current().record("id", id.get());
    let answer = state.read_path.get(id.get()).await.map_err(|e| {
        tracing::Span::current().record("outcome", e.to_string());
        ApiError::from(e)
    })?;
    let served = answer.served.as_str();
    tracing::Span::current().record("outcome", served);
    match answer.entry.status() {
        Status::Found => Ok((
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (
                    header::HeaderName::from_static("x-cache"),
                    HeaderValue::from_static(served),
                ),
            ],
            answer.entry.body(),
        )
            .into_response()),
        Status::NotFound => Err(ApiError::PostNotFound(answer.served)),
        Status::Failed => Err(ApiError::Unavailable),
    }
}

/// `GET /posts/`
pub async fn empty_id() -> ApiError {
    ApiError::InvalidId(super::id::InvalidId::Empty)
}

/// `GET /healthz`: the process is alive.
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// `GET /readyz`: PostgreSQL and Redis both answer.
pub async fn readyz(State(state): State<AppState>) -> Response {
    let postgres = tokio::time::timeout(
        READINESS_TIMEOUT,
        sqlx::query("select 1").execute(&state.db),
    )
    .await;
    let postgres_up = matches!(postgres, Ok(Ok(_)));
    let redis_up = tokio::time::timeout(READINESS_TIMEOUT, state.read_path.redis().ping())
        .await
        .is_ok_and(|r| r.is_ok());
    let word = |up: bool| if up { "up" } else { "down" };
    let status = if postgres_up && redis_up {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({
            "status": if status == StatusCode::OK { "ready" } else { "unavailable" },
            "postgres": word(postgres_up),
            "redis": word(redis_up),
        })),
    )
        .into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::RouteNotFound
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}
