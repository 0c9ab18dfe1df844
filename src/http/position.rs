//! HTTP: the headers of reads that ask for a position (read your writes).
//!
//! A client that wrote to PostgreSQL reads `pg_current_wal_lsn()` after its
//! commit and sends it back as `PostCache-Min-LSN: 0/16B3748`: the answer
//! then reflects every commit at or before that position.
//! `PostCache-Max-Staleness: 250ms` asks that the answer reflect every
//! commit visible that long before the request arrived. Where such a read
//! is answered from (the cache, the cache after a wait for the change feed,
//! or past the cache) is the read path's decision (`read_path/asked.rs`);
//! this file parses the asks and renders the position.
//!
//! Every answer of a post says `PostCache-LSN`, the position it is known
//! fresh at (every commit up to it is reflected), while this instance
//! knows one: send it as `PostCache-Min-LSN` to read at least as fresh
//! elsewhere. Without a change feed in replication mode, or with it down,
//! no position is known: reads that ask for one go past the cache.

use std::{cell::RefCell, time::Duration};

use axum::http::{HeaderMap, HeaderName, HeaderValue};

use super::error::ApiError;
use crate::read_path::{PastFailure, Refused, Wanted};

pub const MIN_LSN: HeaderName = HeaderName::from_static("postcache-min-lsn");
pub const MAX_STALENESS: HeaderName = HeaderName::from_static("postcache-max-staleness");
pub const LSN: HeaderName = HeaderName::from_static("postcache-lsn");

/// The request's asks, or a 400 for a header that does not parse or is
/// given twice. `None` when it asks for nothing (the common case, one
/// lookup each).
pub fn wanted(headers: &HeaderMap) -> Result<Option<Wanted>, ApiError> {
    let max_staleness = once(headers, &MAX_STALENESS, "PostCache-Max-Staleness")?;
    let min_lsn = once(headers, &MIN_LSN, "PostCache-Min-LSN")?;
    if min_lsn.is_none() && max_staleness.is_none() {
        return Ok(None);
    }
    // 0/0: every commit up to nothing, which any answer reflects.
    let min_lsn = parsed(min_lsn, parse_lsn, ApiError::InvalidMinLsn)?.filter(|&lsn| lsn > 0);
    let max_staleness = parsed(
        max_staleness,
        parse_staleness,
        ApiError::InvalidMaxStaleness,
    )?;
    if min_lsn.is_none() && max_staleness.is_none() {
        return Ok(None);
    }
    Ok(Some(Wanted {
        min_lsn,
        max_staleness,
    }))
}

/// A read refused by the read path: a position in the future is a 400
/// (that does not say the server's), PostgreSQL's word not given a 503.
impl From<Refused> for ApiError {
    fn from(refused: Refused) -> Self {
        match refused {
            Refused::Future { asked } => ApiError::MinLsnAhead {
                asked: format_lsn(asked),
            },
            Refused::Past(PastFailure::Full) => ApiError::Busy,
            Refused::Past(PastFailure::Failed) => ApiError::Unavailable,
        }
    }
}

/// A header's value read by `parse`, if given; `invalid` where it does not
/// parse (or is not visible ASCII).
fn parsed<T>(
    value: Option<&HeaderValue>,
    parse: impl FnOnce(&str) -> Option<T>,
    invalid: ApiError,
) -> Result<Option<T>, ApiError> {
    value
        .map(|value| value.to_str().ok().and_then(parse).ok_or(invalid))
        .transpose()
}

/// The value of `name`, if given: given twice (two lines, or one line
/// that a proxy folded with a comma) it is a 400, as no single ask can be
/// told from it.
fn once<'h>(
    headers: &'h HeaderMap,
    name: &HeaderName,
    said: &'static str,
) -> Result<Option<&'h HeaderValue>, ApiError> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(None),
        (Some(value), None) => Ok(Some(value)),
        (Some(_), Some(_)) => Err(ApiError::RepeatedHeader(said)),
    }
}

/// What `PostCache-Min-LSN` holds, as the OpenAPI document states it.
pub const LSN_PATTERN: &str = "^[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$";
/// What `PostCache-Max-Staleness` holds, as the OpenAPI document states it.
pub const STALENESS_PATTERN: &str = "^[0-9]{1,10}(ms|s)$";

/// A WAL position as PostgreSQL prints it (`16/B374D848`: two hexadecimal
/// numbers of at most 8 digits), as bytes from 0/0.
pub fn parse_lsn(text: &str) -> Option<u64> {
    let (high, low) = text.split_once('/')?;
    let part = |part: &str| {
        (!part.is_empty() && part.len() <= 8 && part.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(part, 16).ok())
            .flatten()
    };
    Some((u64::from(part(high)?) << 32) | u64::from(part(low)?))
}

/// A WAL position as PostgreSQL prints it.
pub fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

/// A staleness bound: a number of milliseconds or seconds, at most 10
/// digits (`250ms`, `2s`).
fn parse_staleness(text: &str) -> Option<Duration> {
    let (number, millis) = match text.strip_suffix("ms") {
        Some(number) => (number, true),
        None => (text.strip_suffix('s')?, false),
    };
    if number.is_empty() || number.len() > 10 || !number.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // At most 10 digits: any of them fits in a u64 of seconds.
    let number: u64 = number.parse().ok()?;
    Some(if millis {
        Duration::from_millis(number)
    } else {
        Duration::from_secs(number)
    })
}

/// The `PostCache-LSN` value of `lsn`. Made once per position per thread:
/// the position changes with writes, and every answer of a post says it.
pub fn lsn_header(lsn: u64) -> HeaderValue {
    thread_local! {
        static LAST: RefCell<Option<(u64, HeaderValue)>> = const { RefCell::new(None) };
    }
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        match &*last {
            Some((at, value)) if *at == lsn => value.clone(),
            _ => {
                let value = HeaderValue::try_from(format_lsn(lsn))
                    .expect("hexadecimal digits and a slash are a header value");
                *last = Some((lsn, value.clone()));
                value
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted(pairs: &[(&HeaderName, &str)]) -> Result<Option<Wanted>, String> {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, HeaderValue::from_str(value).unwrap());
        }
        super::wanted(&headers).map_err(|e| e.to_string())
    }

    #[test]
    fn the_asks_read_from_the_headers() {
        assert_eq!(wanted(&[]), Ok(None));
        assert_eq!(
            wanted(&[(&MIN_LSN, "1/0")]),
            Ok(Some(Wanted {
                min_lsn: Some(1 << 32),
                max_staleness: None
            }))
        );
        // Given twice, an ask is refused, whatever its values.
        for pairs in [
            &[(&MIN_LSN, "0/10"), (&MIN_LSN, "1/0")][..],
            &[(&MIN_LSN, "0/10"), (&MIN_LSN, "0/10")],
            &[(&MAX_STALENESS, "1s"), (&MAX_STALENESS, "0ms")],
        ] {
            let refused = wanted(pairs).unwrap_err();
            assert!(refused.contains("more than once"), "{refused}");
        }
        // One line folded by a proxy is no position.
        assert!(wanted(&[(&MIN_LSN, "0/10, 1/0")]).is_err());
        // 0/0 asks for nothing past what any answer reflects.
        assert_eq!(wanted(&[(&MIN_LSN, "0/0")]), Ok(None));
        assert_eq!(
            wanted(&[(&MIN_LSN, "0/0"), (&MAX_STALENESS, "2s")]),
            Ok(Some(Wanted {
                min_lsn: None,
                max_staleness: Some(Duration::from_secs(2))
            }))
        );
        assert!(wanted(&[(&MIN_LSN, "x")]).is_err());
        // Oversized: no more digits than PostgreSQL prints.
        assert!(wanted(&[(&MIN_LSN, &format!("0/{}", "1".repeat(4096)))]).is_err());
        assert!(wanted(&[(&MAX_STALENESS, &"9".repeat(4096))]).is_err());
        assert!(wanted(&[(&MAX_STALENESS, "soon")]).is_err());
    }

    #[test]
    fn positions_read_back_as_postgresql_prints_them() {
        for (text, lsn) in [
            ("0/0", 0),
            ("0/16B3748", 0x16B_3748),
            ("16/B374D848", 0x16_B374_D848),
            ("FFFFFFFF/FFFFFFFF", u64::MAX),
            ("1/0", 1 << 32),
        ] {
            assert_eq!(parse_lsn(text), Some(lsn), "{text}");
            assert_eq!(format_lsn(lsn), text);
        }
        assert_eq!(parse_lsn("0/16b3748"), Some(0x16B_3748));
    }

    #[test]
    fn a_position_that_is_not_one_does_not_parse() {
        for text in [
            "",
            "/",
            "0/",
            "/0",
            "0",
            "0/0/0",
            "x/1",
            "1/-1",
            "+1/1",
            "100000000/0",
            "0/1 2",
            "0x1/1",
        ] {
            assert_eq!(parse_lsn(text), None, "{text:?}");
        }
    }

    #[test]
    fn a_staleness_bound_is_milliseconds_or_seconds() {
        assert_eq!(parse_staleness("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_staleness("2s"), Some(Duration::from_secs(2)));
        assert_eq!(parse_staleness("0s"), Some(Duration::ZERO));
        assert_eq!(
            parse_staleness("9999999999s"),
            Some(Duration::from_secs(9_999_999_999))
        );
        assert_eq!(
            parse_staleness("4810530588ms"),
            Some(Duration::from_millis(4_810_530_588))
        );
        for text in [
            "",
            "250",
            "-1s",
            "2h",
            "soon",
            "ms",
            "s",
            "1.5s",
            " 1s",
            "1 s",
            "12345678901s",
            "+1s",
        ] {
            assert_eq!(parse_staleness(text), None, "{text:?}");
        }
    }

    /// What parses is what the OpenAPI document's patterns say (the API
    /// fuzzer holds the service to both: nothing they allow refused,
    /// nothing else accepted): each string below is marked by whether the
    /// pattern, read by hand, matches it.
    #[test]
    fn the_patterns_say_what_parses() {
        assert_eq!(LSN_PATTERN, "^[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$");
        for (text, matches) in [
            ("0/0", true),
            ("aBc/0", true),
            ("FFFFFFFF/FFFFFFFF", true),
            ("00000000/00000001", true),
            ("123456789/0", false),
            ("0/123456789", false),
            ("0", false),
            ("g/0", false),
            ("0/0 ", false),
            ("/", false),
        ] {
            assert_eq!(parse_lsn(text).is_some(), matches, "{text:?}");
        }
        assert_eq!(STALENESS_PATTERN, "^[0-9]{1,10}(ms|s)$");
        for (text, matches) in [
            ("0s", true),
            ("0000000000ms", true),
            ("9999999999s", true),
            ("12345678901ms", false),
            ("1", false),
            ("1m", false),
            ("1 s", false),
            ("s", false),
            ("1sms", false),
        ] {
            assert_eq!(parse_staleness(text).is_some(), matches, "{text:?}");
        }
    }

    #[test]
    fn the_header_value_follows_the_position() {
        assert_eq!(lsn_header(0x16B_3748), "0/16B3748");
        assert_eq!(lsn_header(0x16B_3748), "0/16B3748");
        assert_eq!(lsn_header(1 << 32), "1/0");
    }
}
