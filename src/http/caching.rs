//! HTTP: the values of the caching headers a read repeats (`Cache-Control`,
//! `Age`), made once per process for the first hour of seconds: a hit looks
//! them up instead of formatting a string and allocating a header value.
//!
//! The values are `'static` (leaked once, a few hundred KB at most), so a
//! copy of one is a pointer copy: a shared, reference-counted value would
//! instead bounce its count between the cores serving hits.

use std::{
    sync::{LazyLock, Mutex},
    time::Duration,
};

use axum::http::HeaderValue;

/// Seconds covered by the tables; larger values are formatted per response.
const TABLE_SECONDS: u64 = 3600;

/// `Age: 0` to `Age: 3600`.
static AGES: LazyLock<&'static [HeaderValue]> = LazyLock::new(|| table(|s| s.to_string()));

/// One `Cache-Control` table per stale-while-revalidate window in use (one
/// per process in production; a few in the tests). Locked only when an
/// instance is built.
static CACHE_CONTROLS: Mutex<Vec<(u64, &'static [HeaderValue])>> = Mutex::new(Vec::new());

fn table(value: impl Fn(u64) -> String) -> &'static [HeaderValue] {
    let values: Vec<HeaderValue> = (0..=TABLE_SECONDS)
        .map(|s| HeaderValue::from_static(Box::leak(value(s).into_boxed_str())))
        .collect();
    Box::leak(values.into_boxed_slice())
}

/// The caching headers of one instance (its grace window).
#[derive(Debug, Clone, Copy)]
pub struct CachingHeaders {
    grace: u64,
    cache_controls: &'static [HeaderValue],
}

impl CachingHeaders {
    /// For a stale-while-revalidate window of `grace` (zero: off).
    pub fn new(grace: Duration) -> Self {
        let grace = grace.as_secs();
        // A poisoned lock only means another instance's build panicked
        // while holding it; the tables it guards are complete or absent.
        let mut tables = CACHE_CONTROLS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let cache_controls = match tables.iter().find(|(g, _)| *g == grace) {
            Some((_, table)) => table,
            None => {
                let made = table(|max_age| cache_control(max_age, grace));
                tables.push((grace, made));
                made
            }
        };
        Self {
            grace,
            cache_controls,
        }
    }

    /// `public, max-age=<max_age>[, stale-while-revalidate=<grace>]`
    pub fn cache_control(&self, max_age: u64) -> HeaderValue {
        match self.cache_controls.get(max_age as usize) {
            Some(value) => value.clone(),
            None => formatted(cache_control(max_age, self.grace)),
        }
    }

    /// `Age`, in seconds.
    pub fn age(&self, seconds: u64) -> HeaderValue {
        match AGES.get(seconds as usize) {
            Some(value) => value.clone(),
            None => formatted(seconds.to_string()),
        }
    }
}

fn cache_control(max_age: u64, grace: u64) -> String {
    if grace == 0 {
        format!("public, max-age={max_age}")
    } else {
        format!("public, max-age={max_age}, stale-while-revalidate={grace}")
    }
}

fn formatted(value: String) -> HeaderValue {
    // Digits, letters, commas, spaces and '=' only: always a valid value.
    HeaderValue::try_from(value).expect("a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looked_up_and_formatted_values_are_the_same() {
        for grace in [Duration::ZERO, Duration::from_secs(30)] {
            let headers = CachingHeaders::new(grace);
            for seconds in [0, 1, 59, TABLE_SECONDS, TABLE_SECONDS + 1, 86_400] {
                let expected = cache_control(seconds, grace.as_secs());
                assert_eq!(headers.cache_control(seconds), expected.as_str());
                assert_eq!(headers.age(seconds), seconds.to_string().as_str());
            }
        }
        assert_eq!(
            CachingHeaders::new(Duration::from_secs(30)).cache_control(5),
            "public, max-age=5, stale-while-revalidate=30"
        );
    }
}
