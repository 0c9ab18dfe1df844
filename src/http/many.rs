//! HTTP: `GET /posts?ids=1,2,3`, many posts in one request. The ids are
//! read together (`ReadPath::serve` with many keys: the memory tier, one look in Redis
//! per node, the misses' loads sharing statements); the answer lists the
//! posts found in the order asked, and the ids not found and unavailable.

use std::time::Instant;

use axum::{
    extract::{rejection::QueryRejection, Query, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
};
use serde::Serialize;
use utoipa::ToSchema;
use xxhash_rust::xxh3::Xxh3;

use super::{
    error::{ApiError, ErrorBody},
    handlers::{self, etag_value, IfNoneMatch},
    position, AppState,
};
use crate::{
    cache::{now_millis, Status},
    posts::{Post, PostId},
    read_path::{Items, Reply, Request, Served},
    telemetry::metrics,
};

/// Most ids one request may list (duplicates included).
pub const MAX_IDS: usize = 100;

/// Most digits of an id in a list: ids below 10^18, which a pattern can
/// state exactly (the OpenAPI document's), unlike i64::MAX.
const MAX_DIGITS: usize = 18;

/// The body of `GET /posts?ids=`.
#[derive(Debug, Serialize, ToSchema)]
pub struct PostBatch {
    /// The posts found, in the order their ids were asked (each once).
    pub posts: Vec<Post>,
    /// The ids asked that no post has.
    pub not_found: Vec<i64>,
    /// The ids whose load failed or timed out (ask again).
    pub unavailable: Vec<i64>,
    /// The ids of `posts` and `not_found` served stale, as `X-Cache: stale`
    /// says of one post: a fail-safe copy while loads fail, or a copy past
    /// freshness within STALE_WHILE_REVALIDATE.
    pub stale: Vec<i64>,
}

/// The distinct ids of `list` (`1,2,3`), in their order, or why it is refused.
pub fn parse_ids(list: &str) -> Result<Vec<PostId>, ApiError> {
    if list.is_empty() {
        return Err(ApiError::InvalidIds("the list is empty".into()));
    }
    let parts: Vec<&str> = list.splitn(MAX_IDS + 1, ',').collect();
    if parts.len() > MAX_IDS {
        return Err(ApiError::InvalidIds(format!("more than {MAX_IDS} ids")));
    }
    let mut ids: Vec<PostId> = Vec::with_capacity(parts.len());
    for part in parts {
        if part.starts_with('0') || part.len() > MAX_DIGITS {
            return Err(ApiError::InvalidIds(format!(
                "each id is 1 to {MAX_DIGITS} digits, the first not 0"
            )));
        }
        let id = PostId::parse(part).map_err(|e| ApiError::InvalidIds(e.to_string()))?;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// `GET /posts?ids=1,2,3`
#[utoipa::path(
    get,
    path = "/posts",
    tag = "posts",
    params(
        ("ids" = String, Query, example = "1,2,3", pattern = "^[1-9][0-9]{0,17}(,[1-9][0-9]{0,17}){0,99}$",
         description = "Up to 100 post ids, comma-separated decimal integers from 1 to 999999999999999999 (no leading zero); duplicates are answered once"),
        ("If-None-Match" = Option<String>, Header,
         description = "ETags of copies the client holds (or `*`): a match is answered 304"),
        ("PostCache-Min-LSN" = Option<String>, Header, example = "0/16B3748",
         description = "As for one post: every part reflects every commit at or before this WAL position"),
        ("PostCache-Max-Staleness" = Option<String>, Header, example = "250ms",
         description = "As for one post: every part reflects every commit visible this long before the request arrived"),
    ),
    responses(
        (status = 200, description = "The posts found, in the order asked, and the ids not found or unavailable. `Cache-Control` is the smallest freshness of the parts (`no-store` when one is unavailable); the ETag covers every part", body = PostBatch,
         headers(("Cache-Control" = String, description = "The smallest freshness of the parts, or `no-store`"),
                 ("ETag" = Option<String>, description = "Over every part; absent when one is unavailable"),
                 ("PostCache-LSN" = Option<String>, description = "The WAL position every part is known fresh at, while this instance knows one"),
                 ("X-Cache-Bypass" = Option<String>, description = "`position`: read past the cache for PostCache-Min-LSN or PostCache-Max-Staleness"),
                 ("Cache-Status" = Option<String>, description = "`postcache; fwd=bypass; detail=position` when read past the cache"))),
        (status = 304, description = "Not modified: the batch's ETag is among If-None-Match's"),
        (status = 400, description = "No ids, an empty list, an invalid id, or more than 100 ids; or an invalid or repeated PostCache-Min-LSN or PostCache-Max-Staleness, or a PostCache-Min-LSN past the database's WAL position", body = ErrorBody),
        (status = 503, description = "Overloaded (MAX_IN_FLIGHT, MAX_CONNECTIONS) or past REQUEST_TIMEOUT; or read past the cache (PostCache-Min-LSN, PostCache-Max-Staleness) and PostgreSQL failed, or no connection was free in time (then with Retry-After)", body = ErrorBody),
    )
)]
pub async fn get_posts(
    State(state): State<AppState>,
    validators: IfNoneMatch,
    headers: HeaderMap,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let read = read_batch(&state, validators, headers, query).await;
    let (outcome, ids) = match &read {
        Ok((_, ids, false)) => ("ok", *ids),
        Ok((_, ids, true)) => ("partial", *ids),
        Err(_) => ("error", 0),
    };
    metrics::batch_read(outcome, ids, started.elapsed());
    read.map(|(response, _, _)| response)
}

/// The response to a batch read, with the number of ids it asked and
/// whether some were unavailable.
async fn read_batch(
    state: &AppState,
    validators: IfNoneMatch,
    headers: HeaderMap,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<(Response, usize, bool), ApiError> {
    let wanted = position::wanted(&headers)?;
    let Query(pairs) =
        query.map_err(|_| ApiError::InvalidIds("the query string is not decodable".into()))?;
    let mut lists = pairs.iter().filter(|(name, _)| name == "ids");
    let (Some((_, list)), None) = (lists.next(), lists.next()) else {
        return Err(ApiError::InvalidIds("give the ids once: ?ids=1,2,3".into()));
    };
    let ids = parse_ids(list)?;
    let keys: Vec<i64> = ids.iter().map(|id| id.get()).collect();
    // Through the read path's one door, as one post (see
    // `read_path/asked.rs`): the cache when it has every change up to the
    // position asked (or is fresh enough), else every id read past it, at
    // one position.
    let request = Request {
        items: Items::Many(keys.clone()),
        wanted,
        started: Instant::now(),
    };
    let Reply { answers, at, past } = state.read_path.serve(request).await?;
    let now = now_millis();
    let mut posts = Vec::with_capacity(2 + keys.len() * 256);
    let (mut not_found, mut unavailable, mut stale) = (Vec::new(), Vec::new(), Vec::new());
    let mut max_age = u64::MAX;
    let mut tag = Xxh3::new();
    for (id, answer) in keys.iter().zip(answers) {
        let Ok(answer) = answer else {
            unavailable.push(*id);
            continue;
        };
        if answer.served == Served::Stale {
            stale.push(*id);
        }
        let entry = answer.entry();
        max_age = max_age.min(entry.fresh_until().saturating_sub(now) / 1000);
        tag.update(&id.to_le_bytes());
        if entry.status() == Status::Found {
            tag.update(&entry.etag().to_le_bytes());
            posts.push(if posts.is_empty() { b'[' } else { b',' });
            posts.extend_from_slice(&entry.body());
        } else {
            not_found.push(*id);
        }
    }
    if posts.is_empty() {
        posts.push(b'[');
    }
    posts.push(b']');
    let complete = unavailable.is_empty();
    let etag = complete.then(|| format!("\"{:016x}\"", tag.digest()));
    let cache_control = if complete {
        state.caching.cache_control(max_age)
    } else {
        HeaderValue::from_static("no-store")
    };
    let mut response = if etag.as_deref().is_some_and(|etag| validators.matches(etag)) {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        let mut body = Vec::with_capacity(posts.len() + 64);
        body.extend_from_slice(b"{\"posts\":");
        body.extend_from_slice(&posts);
        body.extend_from_slice(b",\"not_found\":");
        body.extend_from_slice(&serde_json::to_vec(&not_found).unwrap_or_default());
        body.extend_from_slice(b",\"unavailable\":");
        body.extend_from_slice(&serde_json::to_vec(&unavailable).unwrap_or_default());
        body.extend_from_slice(b",\"stale\":");
        body.extend_from_slice(&serde_json::to_vec(&stale).unwrap_or_default());
        body.push(b'}');
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response()
    };
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, cache_control);
    if let Some(value) = etag.and_then(etag_value) {
        headers.insert(header::ETAG, value);
    }
    if let Some(at) = at {
        headers.insert(position::LSN, position::lsn_header(at));
    }
    if past {
        handlers::past_headers(headers);
    }
    Ok((response, keys.len(), !complete))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(list: &str) -> Result<Vec<i64>, String> {
        parse_ids(list)
            .map(|ids| ids.iter().map(|id| id.get()).collect())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_list_is_decimal_ids_each_kept_once_in_order() {
        assert_eq!(ids("3,1,3,2,1"), Ok(vec![3, 1, 2]));
        assert_eq!(ids("999999999999999999"), Ok(vec![999_999_999_999_999_999]));
        let hundred = vec!["7"; MAX_IDS].join(",");
        assert_eq!(ids(&hundred), Ok(vec![7]));
    }

    #[test]
    fn empty_bad_and_long_lists_are_refused() {
        for list in [
            "",
            ",",
            "1,",
            ",1",
            "1,,2",
            "0",
            "-1",
            "1.5",
            "a",
            " 1",
            "1 ,2",
            "01",
            "1000000000000000000",
        ] {
            assert!(ids(list).is_err(), "{list:?}");
        }
        let too_many = vec!["7"; MAX_IDS + 1].join(",");
        assert!(ids(&too_many).unwrap_err().contains("more than 100"));
    }
}
