//! HTTP: the OpenAPI 3.1 document of the HTTP API (`GET /openapi.json`).
//!
//! Generated from the code, so it cannot drift from it: each route is
//! registered with the annotation on its handler (`utoipa-axum`'s
//! `routes!`), the bodies' schemas are derived from the types the handlers
//! serialise, and the caching headers of `GET /posts/{id}` are documented
//! from the same functions that write them (`served.rs`). The tests check
//! that every header an answer can carry is documented.

use std::sync::OnceLock;

use axum::{
    http::{header, HeaderValue},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use utoipa::{
    openapi::{
        header::Header, path::Operation, ObjectBuilder, OpenApi as Document, RefOr, Schema, Type,
    },
    OpenApi,
};
use utoipa_axum::router::OpenApiRouter;

use super::{error::ErrorBody, handlers, many, position, served, AppState};
use crate::read_path::Served;

/// The document's fixed parts; the paths come from the routes.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "postcache",
        description = "Posts served from Redis in front of PostgreSQL: one load per key for the \
                       whole fleet. Hits say where they came from in `X-Cache` and `X-Cache-Tier`.",
        license(name = "MIT", identifier = "MIT")
    ),
    tags(
        (name = "posts", description = "Reading posts through the cache"),
        (name = "operations", description = "Health, readiness, metrics and this document")
    )
)]
struct Fixed;

/// The documented routes, each with its handler (see the module's doc).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(Fixed::openapi())
        .routes(utoipa_axum::routes!(handlers::get_post))
        .routes(utoipa_axum::routes!(many::get_posts))
        .routes(utoipa_axum::routes!(handlers::healthz))
        .routes(utoipa_axum::routes!(handlers::livez))
        .routes(utoipa_axum::routes!(handlers::readyz))
        .routes(utoipa_axum::routes!(handlers::metrics))
        .routes(utoipa_axum::routes!(openapi_json))
}

/// The whole document.
pub fn document() -> Document {
    let (_, mut doc) = routes().split_for_parts();
    if let Some(read) = doc
        .paths
        .paths
        .get_mut(POSTS_PATH)
        .and_then(|item| item.get.as_mut())
    {
        document_cache_headers(read);
    }
    for path in [POSTS_PATH, "/posts"] {
        if let Some(read) = doc
            .paths
            .paths
            .get_mut(path)
            .and_then(|item| item.get.as_mut())
        {
            document_position_headers(read);
        }
    }
    doc
}

/// The request headers of a read that asks for a position: strings of the
/// patterns `position.rs` parses exactly (never null: an absent header is
/// how a request asks for nothing).
fn document_position_headers(read: &mut Operation) {
    for parameter in read.parameters.iter_mut().flatten() {
        // The lengths say again what the patterns do, for a checker that
        // judges by them alone.
        let (pattern, lengths) = match parameter.name.as_str() {
            "PostCache-Min-LSN" => (position::LSN_PATTERN, (3, 17)),
            "PostCache-Max-Staleness" => (position::STALENESS_PATTERN, (2, 12)),
            _ => continue,
        };
        parameter.schema = Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some(pattern))
                .min_length(Some(lengths.0))
                .max_length(Some(lengths.1))
                .build()
                .into(),
        );
    }
}

/// The path of the post reads, as documented and routed.
pub const POSTS_PATH: &str = "/posts/{id}";

/// The statuses of a read that carry the caching headers (a 404 is a
/// cached "not found" too).
const CACHED_STATUSES: [&str; 3] = ["200", "304", "404"];

/// The caching headers of a read, with their schemas: the values of
/// `X-Cache` and `X-Cache-Tier` are those `served.rs` writes.
fn cache_headers() -> Vec<(&'static str, Header)> {
    let values = |header: fn(Served) -> Option<&'static str>| {
        let mut values: Vec<&str> = served::ALL.into_iter().filter_map(header).collect();
        values.sort_unstable();
        values.dedup();
        values
    };
    let x_cache = values(|s| Some(served::header(s)));
    let tiers = values(served::hit_tier);
    let mut bypass_reasons = values(served::bypass_reason);
    bypass_reasons.push(served::PAST_BYPASS);
    let mut cache_status = values(|s| Some(served::cache_status(s)));
    cache_status.push(served::PAST_CACHE_STATUS);
    let one_of = |values: Vec<&str>| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(values))
            .build()
    };
    let header = |schema: Schema, description: &str| {
        let mut header = Header::new(schema);
        header.description = Some(description.to_string());
        header
    };
    vec![
        (
            "X-Cache",
            header(
                one_of(x_cache).into(),
                "How it was served: `hit` from the cache, `miss` loaded by this request, \
                 `coalesced` served by another request's load (in this process or another \
                 instance), `stale` a stale copy (refreshing in the background, or a fail-safe \
                 copy while loads fail), `bypass` Redis skipped (down, or strategy `none`, or \
                 the post too large to cache: see `X-Cache-Bypass`).",
            ),
        ),
        (
            "Cache-Status",
            header(
                one_of(cache_status).into(),
                "How it was served, in the words of RFC 9211: `hit` answered without a load \
                 (`detail`: `memory`, `redis`, `stale`, or `existence-guard` for a post known \
                 not to exist, told without a load and never cached), `fwd=miss` loaded from \
                 PostgreSQL (`collapsed` when not by this request's own load: `detail=local` \
                 it joined a flight of this process, `detail=fleet` its flight was answered \
                 by another instance's load), `fwd=bypass` loaded without the cache (Redis \
                 skipped, `detail=too-large`, or `detail=position`: read past the cache for \
                 PostCache-Min-LSN or PostCache-Max-Staleness).",
            ),
        ),
        (
            "X-Cache-Bypass",
            header(
                one_of(bypass_reasons).into(),
                "Why a bypass skipped the cache, when not because Redis failed: `too-large`, \
                 the post's JSON is over MAX_ENTRY_BYTES (served from PostgreSQL, never cached); \
                 `position`, read past the cache for PostCache-Min-LSN or \
                 PostCache-Max-Staleness.",
            ),
        ),
        (
            "X-Cache-Tier",
            header(
                one_of(tiers).into(),
                "On hits only: `memory` from this instance's memory tier, `redis` from Redis.",
            ),
        ),
        (
            "ETag",
            header(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some("^\"[0-9a-f]{16}\"$"))
                    .build()
                    .into(),
                "Strong validator of the body, the same on every instance (not on a 404).",
            ),
        ),
        (
            "Cache-Control",
            header(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some(
                        "^public, max-age=[0-9]+(, stale-while-revalidate=[0-9]+)?$",
                    ))
                    .build()
                    .into(),
                "`max-age`: seconds left of freshness; `stale-while-revalidate`: the grace \
                 window, when on.",
            ),
        ),
        (
            "Age",
            header(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(0))
                    .build()
                    .into(),
                "Seconds since the entry was stored.",
            ),
        ),
        (
            "PostCache-LSN",
            header(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some("^[0-9A-F]{1,8}/[0-9A-F]{1,8}$"))
                    .build()
                    .into(),
                "The WAL position the answer is known fresh at (every commit up to it is \
                 reflected), while this instance knows one (the change feed up in replication \
                 mode, or a read past the cache; never on a stale copy): send it as \
                 PostCache-Min-LSN to read at least as fresh elsewhere.",
            ),
        ),
        (
            "Warning",
            header(
                one_of(vec![
                    handlers::WARNING_STALE,
                    handlers::WARNING_REVALIDATION_FAILED,
                ])
                .into(),
                "On stale answers only: 110 while it refreshes, 111 when its loads are failing \
                 (a fail-safe copy). Obsoleted by RFC 9111 (5.5) and kept for the clients that \
                 read it; Cache-Status says the same in the current standard's words.",
            ),
        ),
    ]
}

fn document_cache_headers(read: &mut Operation) {
    for status in CACHED_STATUSES {
        if let Some(RefOr::T(response)) = read.responses.responses.get_mut(status) {
            for (name, header) in cache_headers() {
                response.headers.insert(name.to_string(), header);
            }
        }
    }
}

/// The document as served, rendered once.
fn rendered() -> Bytes {
    static RENDERED: OnceLock<Bytes> = OnceLock::new();
    RENDERED
        .get_or_init(|| {
            // Serialising a document of plain maps and strings cannot fail.
            Bytes::from(
                document()
                    .to_pretty_json()
                    .expect("a serialisable document"),
            )
        })
        .clone()
}

/// `GET /openapi.json`: this document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses(
        (status = 200, description = "The OpenAPI 3.1 document of this API", content_type = "application/json", body = Object),
        (status = 503, description = "Overloaded (MAX_IN_FLIGHT, MAX_CONNECTIONS) or past REQUEST_TIMEOUT", body = ErrorBody),
    )
)]
/// Sent `no-store`: it changes with the instance's version, and a cache
/// that kept it would describe a fleet mid-rollout by its old half.
pub async fn openapi_json() -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
        ],
        rendered(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::http::{HeaderMap, StatusCode};
    use serde_json::Value;

    use super::*;
    use crate::{
        cache::{Entry, Status},
        read_path::Answer,
    };

    fn document_json() -> Value {
        serde_json::from_slice(&rendered()).expect("the document is JSON")
    }

    /// The headers documented on a status of `GET /posts/{id}`, with their
    /// documented values where they are enumerated.
    fn documented(doc: &Value, status: StatusCode) -> &serde_json::Map<String, Value> {
        doc["paths"][POSTS_PATH]["get"]["responses"][status.as_str()]["headers"]
            .as_object()
            .unwrap_or_else(|| panic!("no headers documented for {status}"))
    }

    #[test]
    fn the_document_is_openapi_3_1_with_every_route() {
        let doc = document_json();
        assert_eq!(doc["openapi"], "3.1.0");
        let mut paths: Vec<&str> = doc["paths"]
            .as_object()
            .expect("paths")
            .keys()
            .map(String::as_str)
            .collect();
        paths.sort_unstable();
        assert_eq!(
            paths,
            [
                "/healthz",
                "/livez",
                "/metrics",
                "/openapi.json",
                "/posts",
                "/posts/{id}",
                "/readyz"
            ]
        );
        for schema in [
            "Post",
            "PostBatch",
            "Timestamp",
            "ErrorBody",
            "Readiness",
            "Health",
        ] {
            assert!(doc["components"]["schemas"][schema].is_object(), "{schema}");
        }
    }

    /// Every header a read's answer can carry, whichever way it was served,
    /// is documented on its status, with its value among the documented ones.
    #[test]
    fn every_header_of_every_answer_is_documented() {
        let doc = document_json();
        let found = Entry::new(
            Status::Found,
            br#"{"id":1}"#,
            Duration::from_secs(60),
            Duration::from_millis(3),
        );
        let not_found = Entry::new(
            Status::NotFound,
            b"",
            Duration::from_secs(10),
            Duration::ZERO,
        );
        let mut matching = HeaderMap::new();
        matching.insert(
            header::IF_NONE_MATCH,
            HeaderValue::from_str(&handlers::etag(&found)).expect("ascii"),
        );
        let mut seen = 0;
        for served in served::ALL {
            for entry in [&found, &found.as_backoff(u64::MAX), &not_found] {
                for validators in [HeaderMap::new(), matching.clone()] {
                    let answer = Answer::new(entry.clone(), served).expect("not a failure");
                    let validators = handlers::IfNoneMatch::from_headers(&validators);
                    for grace in [Duration::ZERO, Duration::from_secs(30)] {
                        let caching = super::super::CachingHeaders::new(grace);
                        let response = handlers::respond(
                            &answer,
                            &validators,
                            &caching,
                            crate::cache::now_millis(),
                            Some(0x16B_3748),
                        );
                        let headers = documented(&doc, response.status());
                        for (name, value) in response.headers() {
                            if name == header::CONTENT_TYPE {
                                continue;
                            }
                            let (_, spec) = headers
                                .iter()
                                .find(|(n, _)| n.eq_ignore_ascii_case(name.as_str()))
                                .unwrap_or_else(|| {
                                    panic!("{name} of a {} is not documented", response.status())
                                });
                            if let Some(values) = spec["schema"]["enum"].as_array() {
                                let value = value.to_str().expect("ascii");
                                assert!(
                                    values.iter().any(|v| v == value),
                                    "{name}: {value} is not among {values:?}"
                                );
                            }
                            seen += 1;
                        }
                    }
                }
            }
        }
        assert!(seen > 100, "only {seen} headers looked at");
    }
}
