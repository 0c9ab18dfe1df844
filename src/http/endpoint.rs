//! HTTP: the endpoint. What answers each request (a memory hit at once, a
//! read of a post past the router, the routes for the rest), and the bounds
//! every request but a memory hit is held to.

use std::{convert::Infallible, future::Future, sync::Arc, time::Duration};

use axum::{
    body::Body,
    http::Request,
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use futures::{
    future::{ready, Either},
    FutureExt,
};
use hyper::body::Incoming;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use super::{error::ApiError, handlers, openapi, position, state::AppState};
use crate::{
    posts::PostId,
    read_path::Wanted,
    telemetry::{metrics, traces},
};

/// Bounds applied to every request but a memory hit (see [`Endpoint`]).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Requests handled at once; past it, 503 at once instead of queueing.
    pub max_in_flight: usize,
    /// Longest a request may take.
    pub request_timeout: Duration,
}

/// What answers each request, and the bounds every request but a memory
/// hit is held to.
///
/// A memory hit of `GET /posts/{id}` is answered at once
/// ([`handlers::memory_hit`]): it awaits nothing and holds nothing. Any
/// other `GET /posts/{digits}` is read directly ([`handlers::read_post`]),
/// the rest goes through the router. Reading posts past axum's router and
/// the tower layers the bounds used to be is worth a seventh of the
/// throughput of hits in Redis (A/B: 78k against 68k requests/s).
#[derive(Clone)]
pub struct Endpoint {
    state: AppState,
    router: Router,
    /// MAX_IN_FLIGHT: past it, 503 at once instead of a queue.
    in_flight: Arc<Semaphore>,
    request_timeout: Duration,
}

impl Endpoint {
    pub fn new(state: AppState, limits: Limits) -> Self {
        Self {
            router: app(state.clone()),
            state,
            in_flight: Arc::new(Semaphore::new(limits.max_in_flight)),
            request_timeout: limits.request_timeout,
        }
    }

    /// The answer to `request`; never an error (errors are responses).
    ///
    /// What can be decided at once is decided here, before the future is
    /// made: the future of a read keeps nothing of the request (see
    /// [`Endpoint::read`]), and no value is held both by the future and by
    /// what it awaits (an async block's captures are kept beside the future
    /// it awaits, so each such layer would double the size of every waiting
    /// request).
    pub fn answer(
        &self,
        request: Request<Incoming>,
    ) -> impl Future<Output = Result<Response, Infallible>> + Send + 'static {
        // While traces are on, every request has its span: memory hits too
        // go the full way (`traced`).
        let traced = traces::on();
        if !traced {
            if let Some(response) = handlers::memory_hit(&self.state, &request) {
                return Either::Left(ready(Ok(counted(response))));
            }
        }
        let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
            metrics::shed("in_flight");
            return Either::Left(ready(Ok(counted(ApiError::Overloaded.into_response()))));
        };
        let answer = if traced {
            Either::Right(self.traced(request))
        } else {
            match handlers::post_read(&request) {
                Some(id) => match position::wanted(request.headers()) {
                    Ok(None) => Either::Left(self.read(request, id)),
                    // Boxed, as the routes: a read that asks for a position is
                    // rarer and its future larger.
                    Ok(Some(wanted)) => Either::Right(self.read_wanted(request, id, wanted)),
                    Err(error) => return Either::Left(ready(Ok(counted(error.into_response())))),
                },
                // Boxed: the routes' futures are larger than a read's, and rarer.
                None => Either::Right(Box::pin(
                    self.router.clone().oneshot(request.map(Body::new)).map(
                        |routed| match routed {
                            Ok(response) => response,
                            Err(infallible) => match infallible {},
                        },
                    ),
                ) as Rare),
            }
        };
        Either::Right(
            tokio::time::timeout(self.request_timeout, answer).map(move |bounded| {
                drop(permit);
                Ok(counted(bounded.unwrap_or_else(|_| {
                    ApiError::RequestTimeout.into_response()
                })))
            }),
        )
    }

    /// The read of post `id` for `request`, which is dropped before the read
    /// starts: its head (path, headers) shares hyper's read buffer, and a
    /// request kept while it waits for a load would make hyper allocate a
    /// new buffer for the connection's next read.
    fn read(
        &self,
        request: Request<Incoming>,
        id: PostId,
    ) -> impl Future<Output = Response> + Send + 'static {
        let validators = handlers::IfNoneMatch::from_headers(request.headers()).detached();
        drop(request);
        let state = self.state.clone();
        async move { handlers::read_post(&state, id, validators, None).await }
    }

    /// As [`Endpoint::read`], for a read that asked for `wanted`.
    fn read_wanted(&self, request: Request<Incoming>, id: PostId, wanted: Wanted) -> Rare {
        let validators = handlers::IfNoneMatch::from_headers(request.headers()).detached();
        drop(request);
        let state = self.state.clone();
        Box::pin(async move {
            handlers::read_post(&state, id, validators, Some(Box::new(wanted))).await
        })
    }
}

impl Endpoint {
    /// A request while traces are on: the server's span (`request`), joined
    /// to the trace an incoming W3C `traceparent` names, around the answer
    /// it would have without (the read's own span, `get_post`, is its
    /// child); boxed, as what is rare.
    fn traced(&self, request: Request<Incoming>) -> Rare {
        use tracing::Instrument;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let path = request.uri().path();
        let route = if path.starts_with("/posts/") {
            "/posts/{id}"
        } else if KNOWN_ROUTES.contains(&path) {
            path
        } else {
            "other"
        };
        let span = tracing::debug_span!(
            "request",
            otel.name = %format_args!("{} {route}", request.method()),
            otel.kind = "server",
            http.request.method = %request.method(),
            http.route = route,
            url.path = %path,
            http.response.status_code = tracing::field::Empty,
        );
        if let Some(parent) = traces::remote_parent(request.headers()) {
            let _ = span.set_parent(parent);
        }
        let answer: Rare =
            match handlers::post_read(&request) {
                Some(id) => match position::wanted(request.headers()) {
                    Ok(wanted) => {
                        let validators =
                            handlers::IfNoneMatch::from_headers(request.headers()).detached();
                        drop(request);
                        let state = self.state.clone();
                        Box::pin(async move {
                            handlers::read_post(&state, id, validators, wanted.map(Box::new)).await
                        })
                    }
                    Err(error) => Box::pin(ready(error.into_response())),
                },
                None => Box::pin(self.router.clone().oneshot(request.map(Body::new)).map(
                    |routed| match routed {
                        Ok(response) => response,
                        Err(infallible) => match infallible {},
                    },
                )),
            };
        let recorded = span.clone();
        Box::pin(answer.instrument(span).map(move |response| {
            recorded.record("http.response.status_code", response.status().as_u16());
            response
        }))
    }
}

/// The routes a span names as they are (any other path is `other`, so
/// that a scan of random paths does not make a span name per path).
const KNOWN_ROUTES: &[&str] = &[
    "/posts",
    "/healthz",
    "/livez",
    "/readyz",
    "/metrics",
    "/openapi.json",
];

/// The future of a rarer request (a route, a read that asks for a
/// position), boxed.
type Rare = std::pin::Pin<Box<dyn Future<Output = Response> + Send + 'static>>;

/// The routes, without the bounds (see [`Endpoint`]).
/// Each route is registered with its documentation (see [`openapi`]).
pub fn app(state: AppState) -> Router {
    let (router, _) = openapi::routes().split_for_parts();
    router
        // `/posts/` (an empty id) is a bad id, not an unknown route.
        .route("/posts/", get(handlers::empty_id))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .with_state(state)
}

/// The admin routes (ADMIN_ADDR): `/livez`, `/readyz` and `/metrics` only,
/// without the bounds of the public endpoint (a monitoring port is not the
/// load's: no cap sheds its probes).
pub fn admin_app(state: AppState) -> Router {
    Router::new()
        .route("/livez", get(handlers::livez))
        .route("/readyz", get(handlers::readyz))
        .route("/metrics", get(handlers::metrics))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .with_state(state)
}

/// Counts error responses by status code.
fn counted(response: Response) -> Response {
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        metrics::http_error(status.as_u16());
    }
    response
}
