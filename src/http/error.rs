//! HTTP: the one error type of the HTTP layer and its mapping to status
//! codes.

use axum::{
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Json,
};

use serde::Serialize;
use utoipa::ToSchema;

use crate::posts::InvalidId;
use crate::read_path::ReadError;

/// The body of every error: `{"error": "..."}`, a short message (5xx
/// bodies never carry internals).
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong, for people.
    pub error: String,
}

/// Every error a client can see. Bodies are `{"error": "..."}`; 5xx bodies
/// never carry internals (those are logged where they happen).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("invalid id: {0}")]
    InvalidId(#[from] InvalidId),
    #[error("invalid path")]
    InvalidPath,
    #[error("invalid ids: {0}")]
    InvalidIds(String),
    #[error("post not found")]
    PostNotFound,
    #[error("no such route")]
    RouteNotFound,
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("the backend is unavailable")]
    Unavailable,
    #[error("timed out waiting for the post to load")]
    WaitTimeout,
    #[error("overloaded, try again")]
    Overloaded,
    #[error("too many connections, try again")]
    TooManyConnections,
    #[error("the request took too long")]
    RequestTimeout,
    #[error("no database connection was free in time, try again")]
    Busy,
    #[error(
        "invalid PostCache-Min-LSN: a WAL position as PostgreSQL prints it, such as 0/16B3748"
    )]
    InvalidMinLsn,
    #[error(
        "invalid PostCache-Max-Staleness: a number of milliseconds or seconds, such as 250ms or 2s"
    )]
    InvalidMaxStaleness,
    #[error("{0} was given more than once: give it once")]
    RepeatedHeader(&'static str),
    /// The server's own position is not said: it is no business of a
    /// client's.
    #[error("PostCache-Min-LSN {asked} is past the database's WAL position: not a position a client can have seen")]
    MinLsnAhead { asked: String },
}

impl ApiError {
    pub fn status_code(&self) -> StatusCode {
        match self {
            ApiError::InvalidId(_)
            | ApiError::InvalidPath
            | ApiError::InvalidIds(_)
            | ApiError::InvalidMinLsn
            | ApiError::InvalidMaxStaleness
            | ApiError::RepeatedHeader(_)
            | ApiError::MinLsnAhead { .. } => StatusCode::BAD_REQUEST,
            ApiError::PostNotFound | ApiError::RouteNotFound => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Unavailable
            | ApiError::Overloaded
            | ApiError::TooManyConnections
            | ApiError::RequestTimeout
            | ApiError::Busy => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::WaitTimeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }
}

impl From<ReadError> for ApiError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Unavailable => ApiError::Unavailable,
            ReadError::Timeout => ApiError::WaitTimeout,
            ReadError::Busy => ApiError::Busy,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status_code(),
            Json(ErrorBody {
                error: self.to_string(),
            }),
        )
            .into_response();
        match self {
            ApiError::MethodNotAllowed => {
                response
                    .headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
            }
            // Busy for a moment: the connections free up as loads end.
            ApiError::Busy => {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        response
    }
}
