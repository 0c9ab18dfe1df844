//! HTTP: request handlers.

use std::time::Instant;

use axum::{
    body::Body,
    extract::{rejection::PathRejection, FromRequestParts, Path, State},
    http::{header, request::Parts, HeaderMap, HeaderValue, Method, Request, StatusCode},
    response::{IntoResponse, Response},
    Json,
};
use serde::Serialize;
use utoipa::ToSchema;

use super::{
    caching::CachingHeaders,
    error::{ApiError, ErrorBody},
    head, position, served, AppState,
};
use crate::{
    cache::{now_millis, Entry, Status},
    posts::{Post, PostId},
    read_path::{self, Answer, Items, ReadError, Reply, Served, Wanted},
    telemetry::metrics,
};

/// RFC 7234 warning codes, kept as the marker of stale answers for the
/// clients that read them (RFC 9111 obsoletes `Warning`; `Cache-Status`
/// says the same in its words).
pub const WARNING_STALE: &str = "110 - \"Response is Stale\"";
pub const WARNING_REVALIDATION_FAILED: &str = "111 - \"Revalidation Failed\"";

/// The `If-None-Match` values of a request: the only header a read looks
/// at (taking them alone spares a copy of every header per request).
pub struct IfNoneMatch(Vec<HeaderValue>);

impl<S: Send + Sync> FromRequestParts<S> for IfNoneMatch {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Self::from_headers(&parts.headers))
    }
}

impl IfNoneMatch {
    pub fn from_headers(headers: &HeaderMap) -> Self {
        Self(
            headers
                .get_all(header::IF_NONE_MATCH)
                .iter()
                .cloned()
                .collect(),
        )
    }

    /// The values of a read that asks for nothing else, taken in one pass
    /// over the request's headers (a lookup per name would hash each);
    /// `None` for a read that asks for a position or a staleness bound.
    pub fn of_plain_read(headers: &HeaderMap) -> Option<Self> {
        let mut values = Vec::new();
        for (name, value) in headers {
            if name == header::IF_NONE_MATCH {
                values.push(value.clone());
            } else if name == position::MIN_LSN || name == position::MAX_STALENESS {
                return None;
            }
        }
        Some(Self(values))
    }

    /// Whether one of the values names `ours` (weak comparison, RFC 9110
    /// 13.1.2), or is `*`.
    pub fn matches(&self, ours: &str) -> bool {
        self.0
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .any(|tag| tag == "*" || tag.trim_start_matches("W/") == ours)
    }

    /// The same values, copied: a request's header values share the
    /// connection's read buffer, which a read that may wait must not keep
    /// (see `Endpoint::read`).
    pub fn detached(self) -> Self {
        Self(
            self.0
                .iter()
                .filter_map(|v| HeaderValue::from_bytes(v.as_bytes()).ok())
                .collect(),
        )
    }
}

/// `GET /posts/{id}` when the memory tier holds the post, answered before
/// anything else: a memory hit awaits nothing and holds nothing, so the
/// request bounds (MAX_IN_FLIGHT, REQUEST_TIMEOUT) and the request's span
/// are spared it. Anything else (another route, a method, an id that is not
/// plain digits, a memory miss) is `None`, for the full read or the router.
///
/// A read that asks for a position or a staleness bound is never answered
/// here: it goes the full way, which decides where it can be answered from
/// (see `position.rs`).
pub fn memory_hit<B>(state: &AppState, request: &Request<B>) -> Option<Response> {
    let id = post_read(request)?;
    let validators = IfNoneMatch::of_plain_read(request.headers())?;
    let started = Instant::now();
    // One reading of the clock for the tier's judgement and the headers.
    let now = now_millis();
    let (answer, at) = state.read_path.memory_hit(&id.get(), started, now)?;
    Some(counted(state, &answer, &validators, started, now, at))
}

/// The post id of a `GET /posts/{digits}`, read past the router (see
/// `Endpoint`); `None` for anything else, for the router (another route, a
/// method, a percent-encoded or invalid id: the router's answer, or error).
pub fn post_read<B>(request: &Request<B>) -> Option<PostId> {
    if request.method() != Method::GET {
        return None;
    }
    PostId::parse(request.uri().path().strip_prefix("/posts/")?).ok()
}

/// `GET /posts/{id}` through the router: a HEAD, or an id to decode first.
/// (Its annotation documents every read: those past the router answer the
/// same, through [`read_post`].)
#[utoipa::path(
    get,
    path = "/posts/{id}",
    tag = "posts",
    params(
        ("id" = i64, Path, minimum = 1, maximum = 9223372036854775807_i64, example = 1,
         description = "The post's id: a decimal integer in 1..=9223372036854775807, digits only"),
        ("If-None-Match" = Option<String>, Header,
         description = "ETags of copies the client holds (or `*`): a match is answered 304"),
        ("PostCache-Min-LSN" = Option<String>, Header, example = "0/16B3748",
         description = "Read your writes: a WAL position (`pg_current_wal_lsn()` after the client's commit); the answer reflects every commit at or before it. From the cache once this instance's change feed has passed it, after a wait of at most MIN_LSN_WAIT for it, else read past the cache (a replica that has replayed it, or the primary). A position past the database's WAL is a 400 at once; given twice, a 400"),
        ("PostCache-Max-Staleness" = Option<String>, Header, example = "250ms",
         description = "Bounded staleness: milliseconds or seconds (`250ms`, `2s`); the answer reflects every commit visible that long before the request arrived. From the cache while this instance heard its change feed say, within it, that it was level with the server; else once the feed has passed the primary's position, asked once for every such read waiting; else read past the cache. Given twice, a 400"),
    ),
    responses(
        (status = 200, description = "The post", body = Post),
        (status = 304, description = "Not modified: the post's ETag is among If-None-Match's"),
        (status = 400, description = "Invalid id (also `GET /posts/`, an empty id), or an invalid or repeated PostCache-Min-LSN or PostCache-Max-Staleness, or a PostCache-Min-LSN past the database's WAL position", body = ErrorBody),
        (status = 404, description = "No such post (cached as such for NEGATIVE_TTL, or known missing by the existence guard: X-Cache-Tier guard)", body = ErrorBody),
        (status = 503, description = "The backend failed (PostgreSQL, with no fail-safe copy), or overloaded (MAX_IN_FLIGHT, MAX_CONNECTIONS, or no database connection free within DB_ACQUIRE_TIMEOUT, or none of PAST_READ_CONNECTIONS for a read that needs PostgreSQL's word: then with Retry-After), or past REQUEST_TIMEOUT", body = ErrorBody,
         headers(("Retry-After" = Option<String>, description = "Seconds to wait, when no database connection was free in time"))),
        (status = 504, description = "Waited WAIT_TIMEOUT for another request's load", body = ErrorBody),
    )
)]
pub async fn get_post(
    State(state): State<AppState>,
    validators: IfNoneMatch,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let Path(segment) = path.map_err(|_| ApiError::InvalidPath)?;
    let id = PostId::parse(&segment)?;
    let wanted = position::wanted(&headers)?.map(Box::new);
    Ok(read_post(&state, id, validators, wanted).await)
}

/// Reads post `id` through the read path's one door (`ReadPath::serve`,
/// which decides where a read that asked for `wanted` is answered from),
/// and answers it, or its error. Its span is at debug level: one per
/// request costs the hit path more than the rest of it. (`wanted` is
/// boxed: the span's future keeps every argument for the whole read, and
/// most reads ask for nothing.)
#[tracing::instrument(name = "get_post", level = "debug", skip_all, fields(id = id.get(), outcome, role, load_ms))]
pub async fn read_post(
    state: &AppState,
    id: PostId,
    validators: IfNoneMatch,
    wanted: Option<Box<Wanted>>,
) -> Response {
    let started = Instant::now();
    let request = read_path::Request {
        items: Items::One(id.get()),
        wanted: wanted.map(|wanted| *wanted),
        started,
    };
    let reply = state.read_path.serve(request).await;
    let (answer, at, past) = match reply {
        Ok(Reply {
            mut answers,
            at,
            past,
        }) => {
            let answer = answers.pop().unwrap_or(Err(ReadError::Unavailable));
            (answer.map_err(ApiError::from), at, past)
        }
        Err(refused) => (Err(ApiError::from(refused)), None, false),
    };
    match answer {
        Ok(answer) => {
            let mut response = counted(state, &answer, &validators, started, now_millis(), at);
            if past {
                past_headers(response.headers_mut());
            }
            response
        }
        Err(error) => {
            if tracing::level_enabled!(tracing::Level::DEBUG) {
                tracing::Span::current().record("outcome", error.to_string());
            }
            metrics::request("error", "none", started.elapsed());
            error.into_response()
        }
    }
}

/// What a read past the cache says of itself, beside a bypass's headers.
pub(super) fn past_headers(headers: &mut HeaderMap) {
    headers.insert(
        served::X_CACHE_BYPASS,
        const { HeaderValue::from_static(served::PAST_BYPASS) },
    );
    headers.insert(
        served::CACHE_STATUS,
        const { HeaderValue::from_static(served::PAST_CACHE_STATUS) },
    );
}

/// The response to an answer at `now` (unix ms), counted in the request
/// metrics (and its span); `at`: the position it is known fresh at, for
/// `PostCache-LSN`.
fn counted(
    state: &AppState,
    answer: &Answer,
    validators: &IfNoneMatch,
    started: Instant,
    now: u64,
    at: Option<u64>,
) -> Response {
    let label = served::label(answer.served, answer.entry().status());
    // The request's span is at debug level: below it there is none to
    // record in, and looking for it costs a hit more than its metrics.
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        tracing::Span::current().record("outcome", label);
    }
    metrics::request(label, served::tier_label(answer.served), started.elapsed());
    respond(answer, validators, &state.caching, now, at)
}

/// The response for an entry: body or 404, with the HTTP caching headers
/// (RFC 9111 / RFC 5861) and a 304 for a matching `If-None-Match`; `at`:
/// the position it is known fresh at, for `PostCache-LSN`.
pub(super) fn respond(
    answer: &Answer,
    validators: &IfNoneMatch,
    caching: &CachingHeaders,
    now: u64,
    at: Option<u64>,
) -> Response {
    let entry = answer.entry();
    let found = entry.status() == Status::Found;
    let max_age = entry.fresh_until().saturating_sub(now) / 1000;
    let age = now.saturating_sub(entry.stored_at()) / 1000;
    let matched = found && if_none_match(validators, entry);
    // A hit: its head is kept, rendered (see `head.rs`).
    if found && !matched {
        let changing = head::Changing {
            cache_control: caching.cache_control(max_age),
            age: caching.age(age),
            lsn: at.map(position::lsn_header),
        };
        if let Some(headers) = head::hit(entry.etag(), answer.served, changing) {
            let mut response = Response::new(Body::from(entry.body()));
            *response.headers_mut() = headers;
            return response;
        }
    }
    // An answer is found or not found, never a failure (`Answer::new`).
    let mut response = if !found {
        with_room(ApiError::PostNotFound.into_response())
    } else if matched {
        with_room(StatusCode::NOT_MODIFIED.into_response())
    } else {
        let mut response = Response::new(Body::from(entry.body()));
        *response.headers_mut() = HeaderMap::with_capacity(head::HEADERS);
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, head::JSON);
        response
    };
    let headers = response.headers_mut();
    head::tier_headers(headers, answer.served);
    headers.insert(header::CACHE_CONTROL, caching.cache_control(max_age));
    headers.insert(header::AGE, caching.age(age));
    if found {
        headers.insert(header::ETAG, head::etag_value(entry.etag()));
    }
    if answer.served == Served::Stale {
        let warning = if entry.is_backoff() {
            const { HeaderValue::from_static(WARNING_REVALIDATION_FAILED) }
        } else {
            const { HeaderValue::from_static(WARNING_STALE) }
        };
        headers.insert(header::WARNING, warning);
    }
    if let Some(at) = at {
        headers.insert(position::LSN, position::lsn_header(at));
    }
    response
}

/// `response` with its headers moved into a map with room for every header
/// an answer carries.
fn with_room(mut response: Response) -> Response {
    let small = std::mem::replace(
        response.headers_mut(),
        HeaderMap::with_capacity(head::HEADERS),
    );
    response.headers_mut().extend(small);
    response
}

/// An ETag as a header value (hex digits in quotes: always valid).
pub(super) fn etag_value(etag: String) -> Option<HeaderValue> {
    HeaderValue::try_from(etag).ok()
}

/// The strong validator of an entry's body, as the `ETag` header shows it.
pub fn etag(entry: &Entry) -> String {
    String::from_utf8_lossy(&head::quoted_hex(entry.etag())).into_owned()
}

/// Whether `If-None-Match` names this entry (weak comparison, RFC 9110 13.1.2).
fn if_none_match(validators: &IfNoneMatch, entry: &Entry) -> bool {
    !validators.0.is_empty() && validators.matches(&etag(entry))
}

/// `GET /posts/`: an empty id, a bad request rather than an unknown route
/// (documented with `GET /posts/{id}`, whose id is empty here).
pub async fn empty_id() -> ApiError {
    ApiError::InvalidId(crate::posts::InvalidId::Empty)
}

/// The body of `GET /healthz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// Always `ok`: the process answers.
    #[schema(value_type = String, pattern = "^ok$")]
    status: &'static str,
}

/// `GET /healthz`: the process is alive.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses(
        (status = 200, description = "The process is alive", body = Health),
        (status = 503, description = "Overloaded (MAX_IN_FLIGHT, MAX_CONNECTIONS) or past REQUEST_TIMEOUT", body = ErrorBody),
    )
)]
pub async fn healthz() -> impl IntoResponse {
    (NOT_STORED, Json(Health { status: "ok" }))
}

/// `Cache-Control: no-store`, for what says the state of one process now
/// (the probes): no cache may keep it, heuristically or otherwise.
pub const NOT_STORED: [(header::HeaderName, HeaderValue); 1] =
    [(header::CACHE_CONTROL, HeaderValue::from_static("no-store"))];

/// `GET /livez`: the process is responsive (Kubernetes' liveness probe).
/// Also served on ADMIN_ADDR, where no cap sheds it: a restart is for a
/// process that stopped answering, not for one at its limits.
#[utoipa::path(
    get,
    path = "/livez",
    tag = "operations",
    responses(
        (status = 200, description = "The process is responsive", body = Health),
        (status = 503, description = "Overloaded (MAX_IN_FLIGHT, MAX_CONNECTIONS) or past REQUEST_TIMEOUT, on the public address only", body = ErrorBody),
    )
)]
pub async fn livez() -> impl IntoResponse {
    (NOT_STORED, Json(Health { status: "ok" }))
}

/// Whether the instance takes reads, from what it knows of itself and its
/// dependencies (the `status` of `GET /readyz`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadyState {
    /// PostgreSQL and Redis answer.
    Ready,
    /// One of them does not, and reads are still answered: Redis down
    /// (reads fail open to PostgreSQL) or PostgreSQL down (copies in Redis
    /// and the memory tier are served; misses get 503).
    Degraded,
    /// After the shutdown signal, for SHUTDOWN_DELAY: reads are still
    /// served, new ones should go elsewhere.
    Draining,
    /// Neither answers: nothing but the memory tier's copies could be
    /// served.
    Unavailable,
}

impl ReadyState {
    /// The rule: an instance that can answer reads is ready, degraded or
    /// not. Taking it out of rotation for a dependency it fails open on
    /// would take the whole fleet out at once, since every instance shares
    /// that dependency.
    pub fn of(draining: bool, postgres_up: bool, redis_up: bool) -> Self {
        match (draining, postgres_up, redis_up) {
            (true, _, _) => Self::Draining,
            (false, true, true) => Self::Ready,
            (false, false, false) => Self::Unavailable,
            (false, _, _) => Self::Degraded,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Degraded => "degraded",
            Self::Draining => "draining",
            Self::Unavailable => "unavailable",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            Self::Ready | Self::Degraded => StatusCode::OK,
            Self::Draining | Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// The body of `GET /readyz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    /// `ready` (200): PostgreSQL and Redis answer; `degraded` (200): one of
    /// them does not and reads are still answered; `draining` (503): after
    /// the shutdown signal, for SHUTDOWN_DELAY, reads still served;
    /// `unavailable` (503): neither answers.
    #[schema(value_type = String, pattern = "^(ready|degraded|draining|unavailable)$")]
    status: &'static str,
    /// `up` or `down`.
    #[schema(value_type = String, pattern = "^(up|down)$")]
    postgres: &'static str,
    /// `up`, `down`, or `circuit_open` (up, but still bypassed until a
    /// probe succeeds).
    #[schema(value_type = String, pattern = "^(up|down|circuit_open)$")]
    redis: &'static str,
    /// `up`, `down` or `off` (CHANGE_FEED=off); does not decide readiness.
    #[schema(value_type = String, pattern = "^(up|down|off)$")]
    change_feed: &'static str,
    /// The change feed's mode: `replication`, `trigger` or `off`; `null`
    /// until told (CHANGE_FEED=auto asks PostgreSQL for its `wal_level`).
    #[schema(value_type = Option<String>, pattern = "^(replication|trigger|off)$")]
    change_feed_mode: Option<&'static str>,
    /// Replication: the WAL the fleet's slot holds back past what is
    /// applied, in bytes (`null` in the other modes, or not known yet).
    change_feed_lag_bytes: Option<u64>,
    /// Replication: seconds since the fleet's decoder last said it keeps up
    /// (at most about 0.1 while it does).
    change_feed_lag_seconds: Option<f64>,
    /// How reads asking for a position (PostCache-Min-LSN) are answered
    /// now: `cache`, this instance knows the feed's position (replication,
    /// up); `primary`, it does not (another mode, or the feed down): they
    /// read past the cache, correct but slower.
    #[schema(value_type = String, pattern = "^(cache|primary)$")]
    read_your_writes: &'static str,
    /// The WAL position this instance has applied every change up to, as
    /// PostgreSQL prints it (`null` when not known).
    change_feed_position: Option<String>,
    /// DATABASE_REPLICA_URLS, each with its state and lag (empty when none
    /// is set); they do not decide readiness: loads fail over to the
    /// primary.
    replicas: Vec<crate::store::ReplicaReport>,
}

/// `GET /readyz`: 200 while the instance can answer reads, degraded or
/// not (see [`ReadyState`]); 503 while draining after the shutdown signal,
/// or when neither PostgreSQL nor Redis answers. The body names each
/// dependency's state (`"redis": "circuit_open"` while the breaker still
/// bypasses a Redis that answers again). The change feed is reported (`up`,
/// `down`, `off`) but does not decide: an instance whose feed is down still
/// serves, with freshness from the TTLs.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "Reads are answered: `ready`, or `degraded` (Redis or PostgreSQL down)", body = Readiness),
        (status = 503, description = "`draining` after the shutdown signal, or `unavailable`: neither PostgreSQL nor Redis answers (or overloaded, or past REQUEST_TIMEOUT: then the body is an error)", body = Readiness),
    )
)]
pub async fn readyz(State(state): State<AppState>) -> Response {
    let seen = state.probe.seen().await;
    let (postgres_up, redis_up) = (seen.postgres, seen.redis);
    let word = |up: bool| if up { "up" } else { "down" };
    let readiness = ReadyState::of(state.is_draining(), postgres_up, redis_up);
    let report = state.feed.report();
    let position = state.feed.beats().position();
    let body = Readiness {
        status: readiness.as_str(),
        postgres: word(postgres_up),
        // Up but bypassed: the service fails open until a probe succeeds.
        redis: if redis_up && !state.read_path.redis().breaker_closed() {
            "circuit_open"
        } else {
            word(redis_up)
        },
        change_feed: state.feed.get().as_str(),
        change_feed_mode: report.mode.map(|m| m.as_str()),
        change_feed_lag_bytes: report.lag_bytes,
        change_feed_lag_seconds: report.lag_seconds,
        read_your_writes: if position.is_some() {
            "cache"
        } else {
            "primary"
        },
        change_feed_position: position.map(position::format_lsn),
        replicas: state
            .replicas
            .as_ref()
            .map(|replicas| replicas.report())
            .unwrap_or_default(),
    };
    metrics::ready(readiness.status() == StatusCode::OK);
    (readiness.status(), NOT_STORED, Json(body)).into_response()
}

/// `GET /metrics`: Prometheus text format.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses(
        (status = 200, description = "The metrics, in Prometheus' text format", content_type = "text/plain", body = String),
        (status = 503, description = "Overloaded (MAX_IN_FLIGHT, MAX_CONNECTIONS) or past REQUEST_TIMEOUT", body = ErrorBody),
    )
)]
pub async fn metrics(State(state): State<AppState>) -> Response {
    state.read_path.redis().report_breakers();
    for (name, pool) in &state.pools {
        metrics::db_pool(
            name,
            pool.size(),
            pool.num_idle(),
            pool.options().get_max_connections(),
        );
    }
    let (serving, bytes, entries) = state.read_path.memory_usage();
    metrics::memory_tier(serving, bytes, entries);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        metrics::render(&state.metrics),
    )
        .into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::RouteNotFound
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_etag_is_the_quoted_hex_of_the_entry_s_validator() {
        let entry = Entry::new(
            Status::Found,
            br#"{"id":1}"#,
            std::time::Duration::from_secs(60),
            std::time::Duration::ZERO,
        );
        let expected = format!("\"{:016x}\"", entry.etag());
        assert_eq!(etag(&entry), expected);
        assert_eq!(head::etag_value(entry.etag()), expected.as_str());
    }

    #[test]
    fn readiness_is_lost_only_to_draining_or_to_both_dependencies_down() {
        use ReadyState::*;
        let cases = [
            ((false, true, true), Ready, 200),
            ((false, true, false), Degraded, 200),
            ((false, false, true), Degraded, 200),
            ((false, false, false), Unavailable, 503),
            ((true, true, true), Draining, 503),
            ((true, false, false), Draining, 503),
        ];
        for ((draining, postgres, redis), readiness, status) in cases {
            let got = ReadyState::of(draining, postgres, redis);
            assert_eq!(
                (got, got.status().as_u16()),
                (readiness, status),
                "draining {draining}, postgres {postgres}, redis {redis}"
            );
        }
    }
}
