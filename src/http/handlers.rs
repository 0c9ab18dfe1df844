//! Request handlers.

use std::time::{Duration, Instant};

use axum::{
    extract::{rejection::PathRejection, Path, State},
    http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Json,
};
use serde_json::json;

use super::{error::ApiError, id::PostId, served, AppState};
use crate::{
    cache::{now_millis, Entry, Status},
    flight::{Answer, Served},
    telemetry::metrics,
};

/// Bound on each readiness probe.
const READINESS_TIMEOUT: Duration = Duration::from_secs(1);

const X_CACHE: HeaderName = HeaderName::from_static("x-cache");
/// RFC 7234 warning codes, kept as the marker of stale answers.
const WARNING_STALE: &str = "110 - \"Response is Stale\"";
const WARNING_REVALIDATION_FAILED: &str = "111 - \"Revalidation Failed\"";

/// `GET /posts/{id}`
#[tracing::instrument(skip_all, fields(id, outcome, role, load_ms))]
pub async fn get_post(
    State(state): State<AppState>,
    request_headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let Path(segment) = path.map_err(|_| ApiError::InvalidPath)?;
    let id = PostId::parse(&segment)?;
    tracing::Span::current().record("id", id.get());
    let answer = match state.read_path.read(id.get()).await {
        Ok(answer) => answer,
        Err(e) => {
            tracing::Span::current().record("outcome", e.to_string());
            metrics::request("error", started.elapsed());
            return Err(e.into());
        }
    };
    let label = served::label(answer.served, answer.entry().status());
    tracing::Span::current().record("outcome", label);
    metrics::request(label, started.elapsed());
    let grace = state.read_path.settings().stale_while_revalidate;
    Ok(respond(&answer, &request_headers, grace))
}

/// The response for an entry: body or 404, with the HTTP caching headers
/// (RFC 9111 / RFC 5861) and a 304 for a matching `If-None-Match`.
fn respond(answer: &Answer, request_headers: &HeaderMap, grace: Duration) -> Response {
    let entry = answer.entry();
    let now = now_millis();
    let found = entry.status() == Status::Found;
    // An answer is found or not found, never a failure (`Answer::new`).
    let mut response = if !found {
        ApiError::PostNotFound.into_response()
    } else if if_none_match(request_headers, entry) {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            entry.body(),
        )
            .into_response()
    };
    let headers = response.headers_mut();
    headers.insert(
        X_CACHE,
        HeaderValue::from_static(served::header(answer.served)),
    );
    let max_age = entry.fresh_until().saturating_sub(now) / 1000;
    let cache_control = if grace.is_zero() {
        format!("public, max-age={max_age}")
    } else {
        format!(
            "public, max-age={max_age}, stale-while-revalidate={}",
            grace.as_secs()
        )
    };
    let age = now.saturating_sub(entry.stored_at()) / 1000;
    insert(headers, header::CACHE_CONTROL, cache_control);
    insert(headers, header::AGE, age.to_string());
    if found {
        insert(headers, header::ETAG, etag(entry));
    }
    if answer.served == Served::Stale {
        let warning = if entry.is_backoff() {
            WARNING_REVALIDATION_FAILED
        } else {
            WARNING_STALE
        };
        headers.insert(header::WARNING, HeaderValue::from_static(warning));
    }
    response
}

fn insert(headers: &mut HeaderMap, name: HeaderName, value: String) {
    if let Ok(value) = HeaderValue::try_from(value) {
        headers.insert(name, value);
    }
}

/// The strong validator of an entry's body.
fn etag(entry: &Entry) -> String {
    format!("\"{:016x}\"", entry.etag())
}

/// Whether `If-None-Match` names this entry (weak comparison, RFC 9110 13.1.2).
fn if_none_match(request_headers: &HeaderMap, entry: &Entry) -> bool {
    let ours = etag(entry);
    request_headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .any(|tag| tag == "*" || tag.trim_start_matches("W/") == ours)
}

/// `GET /posts/`
pub async fn empty_id() -> ApiError {
    ApiError::InvalidId(super::id::InvalidId::Empty)
}

/// `GET /healthz`: the process is alive.
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// `GET /readyz`: PostgreSQL and Redis both answer (`"redis": "circuit_open"`
/// while the breaker still bypasses a Redis that answers again). The change
/// feed is reported (`up`, `down`, `off`) but does not decide: an instance
/// whose feed is down still serves, with freshness from the TTLs.
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
            // Up but bypassed: the service fails open until a probe succeeds.
            "redis": if redis_up && !state.read_path.redis().breaker_closed() {
                "circuit_open"
            } else {
                word(redis_up)
            },
            "change_feed": state.feed.get().as_str(),
        })),
    )
        .into_response()
}

/// `GET /metrics`: Prometheus text format.
pub async fn metrics(State(state): State<AppState>) -> Response {
    state.read_path.redis().report_breakers();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        state.metrics.render(),
    )
        .into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::RouteNotFound
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}
