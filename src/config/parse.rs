//! Settings: the parsers of single values clap calls (durations, β,
//! jitter, addresses, URL lists), the types they parse into, and the
//! bounds every setting of a kind shares.

use std::{net::SocketAddr, time::Duration};

/// A listen address that may be empty (off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionalAddr(pub Option<SocketAddr>);

/// A comma-separated list of URLs (empty: none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UrlList(pub Vec<String>);

/// Parses `250ms`, `5s`, `2m` (any humantime duration).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("invalid duration {s:?}: {e}"))
}

/// An address, or nothing for an empty value (a setting that is off).
pub(super) fn parse_optional_addr(s: &str) -> Result<OptionalAddr, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(OptionalAddr(None));
    }
    s.parse()
        .map(|addr| OptionalAddr(Some(addr)))
        .map_err(|e| format!("invalid address {s:?}: {e}"))
}

/// Comma-separated PostgreSQL URLs; empty for none.
pub(super) fn parse_url_list(s: &str) -> Result<UrlList, String> {
    let mut urls = Vec::new();
    for url in s.split(',').map(str::trim) {
        if url.is_empty() {
            continue;
        }
        let parsed = url::Url::parse(url).map_err(|e| format!("invalid URL in the list: {e}"))?;
        if !matches!(parsed.scheme(), "postgres" | "postgresql") {
            return Err(format!(
                "a replica URL must be postgres:// or postgresql://, got {}://",
                parsed.scheme()
            ));
        }
        urls.push(url.to_owned());
    }
    Ok(UrlList(urls))
}

/// `on` or `off`.
pub(super) fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?} is neither on nor off")),
    }
}

pub(super) fn parse_beta(s: &str) -> Result<f64, String> {
    let b: f64 = s
        .trim()
        .parse()
        .map_err(|e| format!("invalid beta {s:?}: {e}"))?;
    if b.is_finite() && b >= 0.0 {
        Ok(b)
    } else {
        Err(format!("beta must be a finite number >= 0, got {b}"))
    }
}

pub(super) fn parse_jitter(s: &str) -> Result<f64, String> {
    let j: f64 = s
        .trim()
        .parse()
        .map_err(|e| format!("invalid jitter {s:?}: {e}"))?;
    if (0.0..1.0).contains(&j) {
        Ok(j)
    } else {
        Err(format!("jitter must be in [0, 1), got {j}"))
    }
}

/// The longest any duration setting may be: far above any sensible TTL or
/// timeout, and far enough below the limits of the arithmetic done with
/// them (deadlines, jitter, fences, TTLs in milliseconds) that none overflows.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);
/// The largest count settings (connections, requests in flight): far above
/// what one process can hold, far below what overflows a semaphore or a sum.
pub const MAX_COUNT: usize = 10_000_000;
/// The largest MAX_ENTRY_BYTES: Redis refuses bulk strings over 512 MiB.
pub const MAX_ENTRY_BYTES_LIMIT: usize = 512 << 20;
