//! Telemetry: the request series (`postcache_requests_total` and
//! `postcache_request_duration_seconds`), counted per thread and summed
//! when `/metrics` is scraped.
//!
//! Every request, hits included, is counted here. Through the exporter's
//! handles each one wrote to memory shared by every core: a counter's two
//! atomics, and a sample appended to the histogram's lock-free list, kept
//! until a scrape or an upkeep folds it into the buckets. Here each thread
//! counts into a shard of its own, which only it writes: a bucket and a sum
//! per series, on cache lines no other core writes. A scrape reads every
//! shard (a shard outlives its thread: the counts are cumulative) and
//! renders the two families in the exporter's text format.

use std::{
    fmt::Write,
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};

use super::names::{REQUESTS, REQUEST_DURATION, REQUEST_LABELS, SECONDS_BUCKETS};

const SERIES: usize = REQUEST_LABELS.len();
/// The buckets' upper bounds, and +Inf.
const SLOTS: usize = SECONDS_BUCKETS.len() + 1;

/// One thread's counts. Aligned so that no two shards share a cache line
/// (nor a pair of them: adjacent-line prefetching).
#[repr(align(128))]
struct Shard {
    /// Per series, requests by the first bucket they fall in (not
    /// cumulative; the last slot is past every bound).
    slots: [[AtomicU64; SLOTS]; SERIES],
    /// Per series, the durations' sum in nanoseconds.
    nanos: [AtomicU64; SERIES],
}

impl Shard {
    fn new() -> Self {
        Self {
            slots: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            nanos: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// Every shard made, for the scrape.
static SHARDS: Mutex<Vec<Arc<Shard>>> = Mutex::new(Vec::new());

thread_local! {
    static MINE: Arc<Shard> = {
        let shard = Arc::new(Shard::new());
        SHARDS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(shard.clone());
        shard
    };
}

/// Adds to a counter only this thread writes: a plain load and store, no
/// locked instruction. Relaxed: a scrape needs each count to be whole, not
/// ordered against the others.
fn bump(counter: &AtomicU64, by: u64) {
    counter.store(counter.load(Relaxed).wrapping_add(by), Relaxed);
}

/// The series of a pair, `None` for one not in `REQUEST_LABELS` (a test in
/// `http/served.rs` shows every answer's pair is).
fn series(outcome: &str, tier: &str) -> Option<usize> {
    REQUEST_LABELS
        .iter()
        .position(|&(o, t)| o == outcome && t == tier)
}

/// The slot a duration falls in: the first bound at or above it.
fn slot(seconds: f64) -> usize {
    SECONDS_BUCKETS
        .iter()
        .position(|&bound| seconds <= bound)
        .unwrap_or(SECONDS_BUCKETS.len())
}

/// Counts one request of `(outcome, tier)` that took `took`.
pub(super) fn record(outcome: &'static str, tier: &'static str, took: Duration) {
    let Some(series) = series(outcome, tier) else {
        debug_assert!(false, "({outcome}, {tier}) is not a request series");
        tracing::warn!(
            outcome,
            tier,
            "a request of an unknown series was not counted"
        );
        return;
    };
    let slot = slot(took.as_secs_f64());
    let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
    // During a thread's teardown its shard is gone: a request answered then
    // is not counted (no request is answered then).
    let _ = MINE.try_with(|shard| {
        bump(&shard.slots[series][slot], 1);
        bump(&shard.nanos[series], nanos);
    });
}

/// The sums over every shard: per series, the slots and the nanoseconds.
fn totals() -> ([[u64; SLOTS]; SERIES], [u64; SERIES]) {
    let mut slots = [[0u64; SLOTS]; SERIES];
    let mut nanos = [0u64; SERIES];
    for shard in SHARDS.lock().unwrap_or_else(PoisonError::into_inner).iter() {
        for s in 0..SERIES {
            for (total, count) in slots[s].iter_mut().zip(&shard.slots[s]) {
                *total = total.wrapping_add(count.load(Relaxed));
            }
            nanos[s] = nanos[s].wrapping_add(shard.nanos[s].load(Relaxed));
        }
    }
    (slots, nanos)
}

/// Appends both families to `out`, in the exporter's text format (each
/// family a block ending in a blank line).
pub(super) fn render(out: &mut String) {
    let (slots, nanos) = totals();
    let labels = |s: usize| {
        let (outcome, tier) = REQUEST_LABELS[s];
        format!(r#"outcome="{outcome}",tier="{tier}""#)
    };
    let _ = writeln!(
        out,
        "# HELP {REQUESTS} Requests of GET /posts/{{id}} by outcome."
    );
    let _ = writeln!(out, "# TYPE {REQUESTS} counter");
    for (s, counts) in slots.iter().enumerate() {
        let count: u64 = counts.iter().sum();
        let _ = writeln!(out, "{REQUESTS}{{{}}} {count}", labels(s));
    }
    out.push('\n');
    let _ = writeln!(
        out,
        "# HELP {REQUEST_DURATION} Latency of GET /posts/{{id}} by outcome."
    );
    let _ = writeln!(out, "# TYPE {REQUEST_DURATION} histogram");
    for (s, counts) in slots.iter().enumerate() {
        let labels = labels(s);
        let mut cumulative = 0;
        for (i, count) in counts.iter().enumerate() {
            cumulative += count;
            let le = match SECONDS_BUCKETS.get(i) {
                Some(bound) => bound.to_string(),
                None => "+Inf".to_owned(),
            };
            let _ = writeln!(
                out,
                r#"{REQUEST_DURATION}_bucket{{{labels},le="{le}"}} {cumulative}"#
            );
        }
        let sum = Duration::from_nanos(nanos[s]).as_secs_f64();
        let _ = writeln!(out, "{REQUEST_DURATION}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{REQUEST_DURATION}_count{{{labels}}} {cumulative}");
    }
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{series} not in:\n{text}"))
    }

    fn scrape() -> String {
        let mut out = String::new();
        render(&mut out);
        out
    }

    /// Counts made on many threads at once are all in the next scrape,
    /// each in its bucket, with the sum of the durations. The shards are
    /// process-wide, so this looks at differences over its own counts.
    #[test]
    fn counts_from_many_threads_are_summed_into_the_scrape() {
        let count = r#"postcache_request_duration_seconds_count{outcome="stale",tier="redis"}"#;
        let total = r#"postcache_requests_total{outcome="stale",tier="redis"}"#;
        let fast =
            r#"postcache_request_duration_seconds_bucket{outcome="stale",tier="redis",le="0.001"}"#;
        let slow =
            r#"postcache_request_duration_seconds_bucket{outcome="stale",tier="redis",le="0.5"}"#;
        let inf =
            r#"postcache_request_duration_seconds_bucket{outcome="stale",tier="redis",le="+Inf"}"#;
        let sum = r#"postcache_request_duration_seconds_sum{outcome="stale",tier="redis"}"#;
        let before = scrape();
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    for _ in 0..1000 {
                        record("stale", "redis", Duration::from_micros(800));
                    }
                    record("stale", "redis", Duration::from_millis(300));
                    record("stale", "redis", Duration::from_secs(60));
                });
            }
        });
        let after = scrape();
        let d = |series: &str| value(&after, series) - value(&before, series);
        assert_eq!(d(count), 8.0 * 1002.0);
        assert_eq!(d(total), 8.0 * 1002.0);
        assert_eq!(d(fast), 8000.0);
        assert_eq!(d(slow), 8008.0);
        assert_eq!(d(inf), 8016.0);
        let expected = 8.0 * (1000.0 * 0.0008 + 0.3 + 60.0);
        assert!((d(sum) - expected).abs() < 1e-6, "{} != {expected}", d(sum));
    }

    /// Every pair is rendered, with every bucket, whether counted or not.
    #[test]
    fn every_series_is_rendered_with_every_bucket() {
        let text = scrape();
        for (outcome, tier) in REQUEST_LABELS {
            let labels = format!(r#"outcome="{outcome}",tier="{tier}""#);
            value(&text, &format!("postcache_requests_total{{{labels}}}"));
            value(
                &text,
                &format!("postcache_request_duration_seconds_count{{{labels}}}"),
            );
            for bound in SECONDS_BUCKETS
                .iter()
                .map(ToString::to_string)
                .chain(["+Inf".into()])
            {
                value(
                    &text,
                    &format!(
                        r#"postcache_request_duration_seconds_bucket{{{labels},le="{bound}"}}"#
                    ),
                );
            }
        }
        assert_eq!(text.matches("# TYPE ").count(), 2);
        assert!(text.ends_with("\n\n"));
    }

    #[test]
    fn a_duration_falls_in_the_first_bucket_at_or_above_it() {
        assert_eq!(slot(0.0), 0);
        assert_eq!(slot(0.0005), 0);
        assert_eq!(slot(0.0006), 1);
        assert_eq!(slot(10.0), SECONDS_BUCKETS.len() - 1);
        assert_eq!(slot(10.5), SECONDS_BUCKETS.len());
        assert_eq!(slot(f64::NAN), SECONDS_BUCKETS.len());
    }
}
