//! Telemetry: Prometheus metrics, through the `metrics` facade; one
//! recording function per event.
//!
//! Every name is listed in `names.rs`, with what it counts, so that the
//! docs, the dashboard and the tests name the same series. The recorder is global to the
//! process (one service per process in production; tests that assert exact
//! counts run in a test binary of their own).

use std::{sync::OnceLock, time::Duration};

use ::metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

mod names;
mod process;
mod requests;

use names::describe;
pub use names::*;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder (once) and returns the handle that renders it.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .expect("static, non-empty buckets")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (a host program): then
            // this handle renders nothing, which is better than failing.
            let _ = ::metrics::set_global_recorder(recorder);
            describe();
            gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            handle
        })
        .clone()
}

/// One answered `GET /posts/{id}`: counted by this thread alone (see
/// `requests.rs`), so that a hit writes nothing another core reads or writes.
pub fn request(outcome: &'static str, tier: &'static str, took: Duration) {
    requests::record(outcome, tier, took);
}

/// The exposition: what the exporter holds, then the request series, then
/// the process's own (CPU, memory, file descriptors: `process.rs`).
pub fn render(handle: &PrometheusHandle) -> String {
    let mut text = handle.render();
    requests::render(&mut text);
    process::render(&mut text);
    text
}

/// How often the exporter's histograms fold their samples into buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(1);

/// Folds the exporter's histogram samples into their buckets every
/// UPKEEP_EVERY, for as long as it runs. The exporter keeps each sample
/// until an upkeep or a scrape: an instance nobody scraped grew by every
/// sample it recorded (measured: 57 MB in 20 s of hits, when each request
/// still recorded one there).
pub async fn upkeep(handle: PrometheusHandle) {
    let mut every = tokio::time::interval(UPKEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        handle.run_upkeep();
    }
}

pub fn memory_tier(serving: bool, bytes: u64, entries: usize) {
    gauge!(MEMORY_SERVING).set(if serving { 1.0 } else { 0.0 });
    gauge!(MEMORY_BYTES).set(bytes as f64);
    gauge!(MEMORY_ENTRIES).set(entries as f64);
}

pub fn http_error(status: u16) {
    counter!(HTTP_ERRORS, "status" => status.to_string()).increment(1);
}

/// A load statement for `keys` keys.
pub fn load_statement(keys: usize) {
    counter!(DB_STATEMENTS).increment(1);
    counter!(DB_STATEMENT_KEYS).increment(keys as u64);
}

/// The existence guard was built with `ids` ids in `bytes` bytes, in `took`.
pub fn guard(ids: u64, bytes: u64, took: Duration) {
    gauge!(GUARD_IDS).set(ids as f64);
    gauge!(GUARD_BYTES).set(bytes as f64);
    gauge!(GUARD_BUILD).set(took.as_secs_f64());
}

/// A command or script sent to Redis.
pub fn redis_call() {
    counter!(REDIS_CALLS).increment(1);
}

pub fn db_load(result: &'static str, took: Duration) {
    counter!(DB_LOADS, "result" => result).increment(1);
    histogram!(DB_LOAD_DURATION).record(took.as_secs_f64());
}

pub fn lock_election(won: bool) {
    counter!(LOCK_ELECTIONS, "result" => if won { "won" } else { "lost" }).increment(1);
}

/// A wait for another's load ended; `ended_by` is `read_path::WaitEnd`'s label.
pub fn wait_ended(ended_by: &'static str, took: Duration) {
    counter!(WAITS, "ended_by" => ended_by).increment(1);
    histogram!(WAIT_DURATION).record(took.as_secs_f64());
}

pub fn redis_error(kind: &'static str) {
    counter!(REDIS_ERRORS, "kind" => kind).increment(1);
}

/// The worst breaker state of the Redis nodes in use: 0 closed, 1 open, 2
/// half-open.
pub fn breaker_state(state: f64) {
    gauge!(BREAKER_STATE).set(state);
}

/// The breaker state of Redis node `node`.
pub fn node_breaker_state(node: String, state: f64) {
    gauge!(NODE_BREAKER_STATE, "node" => node).set(state);
}

/// A command (or a batch, or a script) that Redis answered, or that timed
/// out, after `took`.
pub fn redis_latency(took: Duration) {
    static LATENCY: OnceLock<::metrics::Histogram> = OnceLock::new();
    // Registered once, after `install`: every command records one, and a
    // lookup in the registry is a hash and a lock each time.
    match LATENCY.get() {
        Some(histogram) => histogram.record(took.as_secs_f64()),
        None if HANDLE.get().is_some() => LATENCY
            .get_or_init(|| histogram!(REDIS_COMMAND_DURATION))
            .record(took.as_secs_f64()),
        None => histogram!(REDIS_COMMAND_DURATION).record(took.as_secs_f64()),
    }
}

/// A batch read of `ids` ids ended with `outcome` (ok, partial, error)
/// after `took`.
pub fn batch_read(outcome: &'static str, ids: usize, took: Duration) {
    counter!(BATCH_READS, "outcome" => outcome).increment(1);
    counter!(BATCH_READ_IDS).increment(ids as u64);
    histogram!(BATCH_READ_DURATION).record(took.as_secs_f64());
}

/// Pool `pool` has `size` connections open, `idle` of them idle, of at
/// most `max`.
pub fn db_pool(pool: &'static str, size: u32, idle: usize, max: u32) {
    let idle = (idle as u32).min(size);
    gauge!(DB_POOL_CONNECTIONS, "pool" => pool, "state" => "idle").set(f64::from(idle));
    gauge!(DB_POOL_CONNECTIONS, "pool" => pool, "state" => "busy").set(f64::from(size - idle));
    gauge!(DB_POOL_MAX, "pool" => pool).set(f64::from(max));
}

/// A statement waited `waited` for a connection of pool `pool`.
pub fn db_pool_wait(pool: &'static str, waited: Duration) {
    histogram!(DB_POOL_WAIT, "pool" => pool).record(waited.as_secs_f64());
}

pub fn subscribed_channels(delta: f64) {
    gauge!(SUBSCRIBED_CHANNELS).increment(delta);
}

pub fn flights(delta: f64) {
    gauge!(FLIGHTS).increment(delta);
}

pub fn reads(delta: f64) {
    static READS_GAUGE: OnceLock<::metrics::Gauge> = OnceLock::new();
    // Registered once, after `install` (before it, each call looks it up).
    match READS_GAUGE.get() {
        Some(gauge) => gauge.increment(delta),
        None if HANDLE.get().is_some() => {
            READS_GAUGE.get_or_init(|| gauge!(READS)).increment(delta)
        }
        None => gauge!(READS).increment(delta),
    }
}

pub fn garbage(kind: &'static str) {
    counter!(GARBAGE, "kind" => kind).increment(1);
}

pub fn refresh(result: &'static str) {
    counter!(REFRESHES, "result" => result).increment(1);
}

pub fn too_large() {
    counter!(TOO_LARGE).increment(1);
}

pub fn flight_panicked() {
    counter!(FLIGHT_PANICS).increment(1);
}

pub fn lock_abandoned() {
    counter!(LOCKS_ABANDONED).increment(1);
}

pub fn change_skipped(why: &'static str) {
    counter!(CHANGES_SKIPPED, "why" => why).increment(1);
}

pub fn fenced() {
    counter!(FENCED).increment(1);
}

pub fn feed_up(up: bool) {
    gauge!(FEED_UP).set(if up { 1.0 } else { 0.0 });
}

pub fn change_applied(op: &'static str, lag: Duration) {
    counter!(CHANGES_APPLIED, "op" => op).increment(1);
    histogram!(CHANGE_LAG).record(lag.as_secs_f64());
}

/// Whether this instance holds the replication slot (decodes for the fleet).
pub fn decoder_held(held: bool) {
    gauge!(DECODER_HELD).set(if held { 1.0 } else { 0.0 });
}

/// Changes applied to a Redis primary that no replica acknowledged in time.
pub fn changes_unreplicated(n: usize) {
    counter!(CHANGES_UNREPLICATED).increment(n as u64);
}

/// An answer older than this process's floor for the item, loaded again.
pub fn floor_miss() {
    counter!(FLOOR_MISSES).increment(1);
}

/// This instance's decoder gave up the slot (see `DECODER_GAVE_UP`).
pub fn decoder_gave_up() {
    counter!(DECODER_GAVE_UP).increment(1);
}

/// This instance ended a silent decoder's walsender to take the slot.
pub fn decoder_taken_over() {
    counter!(DECODER_TAKEOVERS).increment(1);
}

/// A gap in the change feed (the slot missing or invalidated), closed by a
/// raise of the cutoff.
pub fn feed_gap(why: &'static str) {
    counter!(FEED_GAPS, "why" => why).increment(1);
}

/// How far the replication slot is behind the server's WAL, in bytes.
pub fn feed_lag_bytes(bytes: u64) {
    gauge!(FEED_LAG_BYTES).set(bytes as f64);
}

/// How long since the fleet's decoder last said it keeps up.
pub fn feed_lag_seconds(seconds: f64) {
    gauge!(FEED_LAG_SECONDS).set(seconds);
}

/// The change feed's task ended (a panic) and was started again.
/// A load (or batch) read from a replica.
pub fn routed_to_replica(keys: usize) {
    counter!(REPLICA_ROUTED, "to" => "replica", "reason" => "caught_up").increment(keys as u64);
}

/// A read that asked for a position or a staleness bound, and how it was
/// answered: `cache`, `wait`, `replica` or `primary`.
pub fn position_read(answered: &'static str) {
    counter!(POSITION_READS, "answered" => answered).increment(1);
}

/// A statement read the primary's position for the reads waiting.
pub fn primary_position_read() {
    counter!(PRIMARY_POSITION_READS).increment(1);
}

/// What `GET /readyz` answered: ready (200) or not (503).
pub fn ready(ready: bool) {
    gauge!(READY).set(if ready { 1.0 } else { 0.0 });
}

/// How long a read waited for the change feed to pass its position.
pub fn position_wait(waited: Duration) {
    histogram!(POSITION_WAIT).record(waited.as_secs_f64());
}

/// Keys loaded from the primary although replicas are set, and why.
pub fn routed_to_primary(reason: &'static str, keys: usize) {
    counter!(REPLICA_ROUTED, "to" => "primary", "reason" => reason).increment(keys as u64);
}

/// A replica's state, as its probe saw it.
pub fn replica(name: &str, up: bool, lag_seconds: Option<f64>, lag_bytes: Option<u64>) {
    let name = name.to_owned();
    gauge!(REPLICA_UP, "replica" => name.clone()).set(if up { 1.0 } else { 0.0 });
    if let Some(seconds) = lag_seconds {
        gauge!(REPLICA_LAG_SECONDS, "replica" => name.clone()).set(seconds);
    }
    if let Some(bytes) = lag_bytes {
        gauge!(REPLICA_LAG_BYTES, "replica" => name).set(bytes as f64);
    }
}

pub fn feed_restarted() {
    counter!(FEED_RESTARTS).increment(1);
}

pub fn feed_reconnected() {
    counter!(FEED_RECONNECTS).increment(1);
}

pub fn connections_open(delta: f64) {
    gauge!(CONNECTIONS_OPEN).increment(delta);
}

pub fn connection_refused() {
    counter!(CONNECTIONS_REFUSED).increment(1);
}

/// A request refused for want of capacity (`db_pool`, `in_flight`).
pub fn shed(reason: &'static str) {
    counter!(SHED, "reason" => reason).increment(1);
}

pub fn connection_timed_out(timeout: &'static str) {
    counter!(CONNECTIONS_TIMED_OUT, "timeout" => timeout).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The provisioned dashboard is valid JSON and every query names metrics
    /// that this service exports.
    #[test]
    fn the_dashboard_queries_only_metrics_that_exist() {
        let raw = include_str!("../../../deploy/grafana/dashboards/postcache.json");
        let dashboard: serde_json::Value = serde_json::from_str(raw).expect("valid JSON");
        let panels = dashboard["panels"].as_array().expect("panels");
        assert!(panels.len() >= 5);
        let mut queries = 0;
        for panel in panels {
            for target in panel["targets"].as_array().expect("targets") {
                let expr = target["expr"].as_str().expect("an expr");
                queries += 1;
                assert!(exported(expr) > 0, "{expr:?} names no postcache metric");
            }
        }
        assert!(queries >= 10);
    }

    /// Every alert rule names metrics that this service exports (what the
    /// rules do is tested by `promtool test rules`: see deploy/check).
    #[test]
    fn the_alert_rules_query_only_metrics_that_exist() {
        let raw = include_str!("../../../deploy/prometheus/alerts.yml");
        let mut rules = 0;
        for line in raw.lines().map(str::trim_start) {
            if line.starts_with("- alert:") {
                rules += 1;
            }
        }
        assert!(rules >= 7, "{rules} alert rules");
        let expressions: Vec<&str> = raw
            .split("expr:")
            .skip(1)
            .map(|rest| rest.split("labels:").next().unwrap())
            .collect();
        assert_eq!(expressions.len(), rules);
        for expr in expressions {
            assert!(exported(expr) > 0, "{expr:?} names no postcache metric");
        }
    }

    /// How many postcache metrics `expr` names, each asserted exported.
    fn exported(expr: &str) -> usize {
        let mut named = 0;
        for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if !word.starts_with("postcache_") {
                continue;
            }
            named += 1;
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| word.strip_suffix(s))
                .unwrap_or(word);
            assert!(ALL.contains(&base), "{word} in {expr:?} is not exported");
        }
        named
    }
}
