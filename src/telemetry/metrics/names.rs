//! Telemetry: every metric's name, with what it counts, its labels and
//! buckets, and its description in the exposition.

/// Requests of `GET /posts/{id}` by outcome: hit, negative_hit, miss,
/// coalesced_local, coalesced_remote, stale, bypass, error.
pub const REQUESTS: &str = "postcache_requests_total";
/// Latency of `GET /posts/{id}` by outcome, seconds.
pub const REQUEST_DURATION: &str = "postcache_request_duration_seconds";
/// HTTP error responses by status code.
pub const HTTP_ERRORS: &str = "postcache_http_errors_total";
/// Loads from PostgreSQL by result: found, not_found, failed.
pub const DB_LOADS: &str = "postcache_db_loads_total";
/// Load statements sent to PostgreSQL (a batch of keys counts once).
pub const DB_STATEMENTS: &str = "postcache_db_statements_total";
/// Keys read by those statements (÷ statements: the mean batch).
pub const DB_STATEMENT_KEYS: &str = "postcache_db_statement_keys_total";
/// Duration of loads from PostgreSQL, seconds.
pub const DB_LOAD_DURATION: &str = "postcache_db_load_duration_seconds";
/// Lock elections by result: won, lost.
pub const LOCK_ELECTIONS: &str = "postcache_lock_elections_total";
/// Ended waits by what ended them: message, recheck, takeover, failure, timeout.
pub const WAITS: &str = "postcache_waits_total";
/// Duration of waits for another's load, seconds.
pub const WAIT_DURATION: &str = "postcache_wait_duration_seconds";
/// Commands and scripts sent to Redis by the read path and the feed's
/// applications (each a round trip; not the subscriber's).
pub const REDIS_CALLS: &str = "postcache_redis_calls_total";
/// Redis command failures (errors and timeouts) and breaker rejections, by kind.
pub const REDIS_ERRORS: &str = "postcache_redis_errors_total";
/// Redis circuit breaker (on a cluster, the worst of the nodes'): 0 closed,
/// 1 open, 2 half-open; set when the metrics are rendered.
pub const BREAKER_STATE: &str = "postcache_redis_breaker_state";
/// Each Redis node's circuit breaker, by `node` (its address, or `cluster`
/// for the cluster client before the nodes are known): 0 closed, 1 open, 2
/// half-open; set when the metrics are rendered.
pub const NODE_BREAKER_STATE: &str = "postcache_redis_node_breaker_state";
/// Duration of the commands and scripts sent to Redis by the read path and
/// the feed (a batch of keys counts once), seconds.
pub const REDIS_COMMAND_DURATION: &str = "postcache_redis_command_duration_seconds";
/// The build: `version`; always 1.
pub const BUILD_INFO: &str = "postcache_build_info";
/// Batch reads (`GET /posts?ids=`), by outcome: ok (every id answered),
/// partial (some unavailable), error (a 4xx or 5xx for the whole batch).
pub const BATCH_READS: &str = "postcache_batch_reads_total";
/// Distinct ids asked by batch reads (÷ batch reads: the mean batch).
pub const BATCH_READ_IDS: &str = "postcache_batch_read_ids_total";
/// Duration of batch reads, seconds.
pub const BATCH_READ_DURATION: &str = "postcache_batch_read_duration_seconds";
/// PostgreSQL connections of each pool, by `pool` (loads, past, probe,
/// feed) and `state` (idle, busy); set when the metrics are rendered.
pub const DB_POOL_CONNECTIONS: &str = "postcache_db_pool_connections";
/// The most connections each pool may open, by `pool`.
pub const DB_POOL_MAX: &str = "postcache_db_pool_max_connections";
/// How long statements waited for a connection of their pool, by `pool`
/// (loads, past), seconds.
pub const DB_POOL_WAIT: &str = "postcache_db_pool_wait_seconds";
/// Ready channels this process is subscribed to.
pub const SUBSCRIBED_CHANNELS: &str = "postcache_subscribed_channels";
/// In-process flights in progress.
pub const FLIGHTS: &str = "postcache_flights_in_progress";
/// Reads of `GET /posts/{id}` not yet answered (waiting requests included).
pub const READS: &str = "postcache_reads_in_progress";
/// Undecodable bytes met, by where: entry, message.
pub const GARBAGE: &str = "postcache_garbage_total";
/// Background refreshes by result: refreshed, lost (another holds the lock), failed.
pub const REFRESHES: &str = "postcache_refreshes_total";
/// Loads whose post was over MAX_ENTRY_BYTES: a too-large marker was
/// stored in its place.
pub const TOO_LARGE: &str = "postcache_too_large_total";
/// Flights whose task panicked (answered 503; the lock let go at once).
pub const FLIGHT_PANICS: &str = "postcache_flight_panics_total";
/// Leader locks let go by their guard, not by a finish: the leader's task
/// panicked or was dropped (the lock released, its waiters told to elect
/// again at once).
pub const LOCKS_ABANDONED: &str = "postcache_locks_abandoned_total";

/// Leader finishes that stored nothing: a change was applied during the load.
pub const FENCED: &str = "postcache_fenced_total";
/// Whether the change feed is connected and caught up (1) or not (0).
pub const FEED_UP: &str = "postcache_change_feed_up";
/// Changes applied by this process, by op: insert, update, delete, truncate,
/// invalidate, invalidate_all (skipped ones, applied already by another
/// instance, included).
pub const CHANGES_APPLIED: &str = "postcache_changes_applied_total";
/// From a change's write in PostgreSQL (its clock) to its application here.
pub const CHANGE_LAG: &str = "postcache_change_lag_seconds";
/// Times the change feed lost its connection and caught up from the outbox.
pub const FEED_RECONNECTS: &str = "postcache_change_feed_reconnects_total";
/// Changes the feed could not read (a row of the outbox it cannot decode),
/// skipped, by why.
pub const CHANGES_SKIPPED: &str = "postcache_changes_skipped_total";
/// Times the change feed's task ended (a panic) and was started again.
pub const FEED_RESTARTS: &str = "postcache_change_feed_restarts_total";
/// CHANGE_FEED=replication: whether this instance holds the slot (1: it
/// decodes for the fleet).
pub const DECODER_HELD: &str = "postcache_change_feed_decoder";
/// Answers found older than a version this process had served (its floor
/// for the item: see `read_path/floor.rs`), loaded from the primary instead.
pub const FLOOR_MISSES: &str = "postcache_floor_misses_total";
/// CHANGE_FEED=replication: changes applied to a Redis primary that no
/// replica acknowledged within REDIS_REPLICA_WAIT, applied again later.
pub const CHANGES_UNREPLICATED: &str = "postcache_changes_unreplicated_total";
/// CHANGE_FEED=replication: times this instance's decoder gave up the slot
/// because it could not vouch for its connection (PostgreSQL did not hear
/// it, what was sent did not arrive, the primary could not be asked).
pub const DECODER_GAVE_UP: &str = "postcache_change_feed_decoder_gave_up_total";
/// CHANGE_FEED=replication: times this instance ended the walsender of a
/// decoder that stopped beating, to take the slot.
pub const DECODER_TAKEOVERS: &str = "postcache_change_feed_takeovers_total";
/// Gaps in the change feed (the slot missing or invalidated), each closed
/// by a raise of the cutoff, by why.
pub const FEED_GAPS: &str = "postcache_change_feed_gaps_total";
/// How much WAL the slot holds back: the server's end past what the fleet
/// has applied, in bytes.
pub const FEED_LAG_BYTES: &str = "postcache_change_feed_lag_bytes";
/// How stale this instance may be: seconds since the commits the fleet's
/// decoder last proved applied were visible (a tenth or two while it keeps
/// up; it grows while the decoder is behind, or none runs).
pub const FEED_LAG_SECONDS: &str = "postcache_change_feed_lag_seconds";

/// The memory tier: bytes kept (envelopes plus a fixed overhead per entry,
/// the measure L1_MAX_BYTES bounds), entries, and whether it serves (0 while
/// the change feed is down, or when it is off); set when rendered.
pub const MEMORY_BYTES: &str = "postcache_memory_tier_bytes";
pub const MEMORY_ENTRIES: &str = "postcache_memory_tier_entries";
pub const MEMORY_SERVING: &str = "postcache_memory_tier_serving";

/// Client connections open.
pub const CONNECTIONS_OPEN: &str = "postcache_connections_open";
/// Connections refused (answered 503 and closed) past MAX_CONNECTIONS.
pub const CONNECTIONS_REFUSED: &str = "postcache_connections_refused_total";
/// Connections closed by a deadline, by timeout: header_read, idle.
pub const CONNECTIONS_TIMED_OUT: &str = "postcache_connections_timed_out_total";
/// Requests answered 503 at once for want of capacity, by reason: `db_pool`
/// (no database connection free within DB_ACQUIRE_TIMEOUT; nothing stored
/// for the key), `in_flight` (MAX_IN_FLIGHT), `past_pool` (a read past the
/// cache found every PAST_READ_CONNECTIONS taken).
pub const SHED: &str = "postcache_shed_total";

/// The existence guard: ids in its set, and its bytes (0 while it stands
/// aside).
pub const GUARD_IDS: &str = "postcache_guard_ids";
pub const GUARD_BYTES: &str = "postcache_guard_bytes";
/// How long the existence guard's last build took, seconds.
pub const GUARD_BUILD: &str = "postcache_guard_build_seconds";

/// DATABASE_REPLICA_URLS: loads by where they were read, `to`: `replica`
/// (`reason` `caught_up`: it had replayed the key's last change),
/// or `primary` with why (`reason`: `behind`, the key changed past what
/// every replica in rotation had replayed; `no_replica`, none in rotation
/// or the change feed not up in replication mode; `failed`, the replicas
/// tried failed; `busy`, no connection of theirs was free in time).
pub const REPLICA_ROUTED: &str = "postcache_replica_routed_total";
/// Per replica (`replica`): whether it is in the rotation (1) or not.
pub const REPLICA_UP: &str = "postcache_replica_up";
/// Per replica: seconds of commits on the primary it has not replayed
/// (measured every second against the primary's WAL position).
pub const REPLICA_LAG_SECONDS: &str = "postcache_replica_lag_seconds";
/// Per replica: bytes of WAL between the primary's position and its replay.
pub const REPLICA_LAG_BYTES: &str = "postcache_replica_lag_bytes";

/// Reads that asked for a position (`PostCache-Min-LSN`) or a bound on
/// staleness (`PostCache-Max-Staleness`), by how they were answered
/// (`answered`): `cache`, at once; `wait`, from the cache once the change
/// feed passed the position; `replica` or `primary`, read past the cache.
pub const POSITION_READS: &str = "postcache_min_lsn_reads_total";
/// How long reads asking for a position waited for the change feed to
/// pass it (those that waited, whether it passed in time or not).
pub const POSITION_WAIT: &str = "postcache_min_lsn_wait_seconds";
/// Statements that read the primary's WAL position for reads the cache
/// could not vouch for: one per round, shared by every read waiting.
pub const PRIMARY_POSITION_READS: &str = "postcache_primary_position_reads_total";
/// What the last `GET /readyz` answered: 1 (200: ready or degraded) or 0
/// (503: draining or unavailable). Its changes are the readiness flaps
/// `deploy/prometheus/alerts.yml` watches.
pub const READY: &str = "postcache_ready";

/// Every metric name, for checks that dashboards name only what exists.
pub const ALL: &[&str] = &[
    REQUESTS,
    REQUEST_DURATION,
    HTTP_ERRORS,
    DB_LOADS,
    DB_LOAD_DURATION,
    DB_STATEMENTS,
    DB_STATEMENT_KEYS,
    LOCK_ELECTIONS,
    WAITS,
    WAIT_DURATION,
    REDIS_CALLS,
    REDIS_ERRORS,
    BREAKER_STATE,
    NODE_BREAKER_STATE,
    REDIS_COMMAND_DURATION,
    BUILD_INFO,
    BATCH_READS,
    BATCH_READ_IDS,
    BATCH_READ_DURATION,
    DB_POOL_CONNECTIONS,
    DB_POOL_MAX,
    DB_POOL_WAIT,
    SUBSCRIBED_CHANNELS,
    FLIGHTS,
    READS,
    GARBAGE,
    REFRESHES,
    TOO_LARGE,
    FLIGHT_PANICS,
    LOCKS_ABANDONED,
    CONNECTIONS_OPEN,
    CONNECTIONS_REFUSED,
    CONNECTIONS_TIMED_OUT,
    SHED,
    GUARD_IDS,
    GUARD_BYTES,
    GUARD_BUILD,
    MEMORY_BYTES,
    MEMORY_ENTRIES,
    MEMORY_SERVING,
    FENCED,
    FEED_UP,
    CHANGES_APPLIED,
    CHANGE_LAG,
    FEED_RECONNECTS,
    CHANGES_SKIPPED,
    FEED_RESTARTS,
    DECODER_HELD,
    DECODER_GAVE_UP,
    DECODER_TAKEOVERS,
    FLOOR_MISSES,
    CHANGES_UNREPLICATED,
    FEED_GAPS,
    FEED_LAG_BYTES,
    FEED_LAG_SECONDS,
    REPLICA_ROUTED,
    REPLICA_UP,
    REPLICA_LAG_SECONDS,
    REPLICA_LAG_BYTES,
    POSITION_READS,
    POSITION_WAIT,
    PRIMARY_POSITION_READS,
    READY,
];

pub(super) fn describe() {
    use ::metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    // REQUESTS and REQUEST_DURATION: rendered by `requests.rs`.
    describe_counter!(HTTP_ERRORS, "HTTP error responses by status code.");
    describe_counter!(DB_LOADS, "Loads from PostgreSQL by result.");
    describe_histogram!(
        DB_LOAD_DURATION,
        Unit::Seconds,
        "Duration of loads from PostgreSQL."
    );
    describe_counter!(
        DB_STATEMENTS,
        "Load statements sent to PostgreSQL (a batch of keys counts once)."
    );
    describe_counter!(DB_STATEMENT_KEYS, "Keys read by the load statements.");
    describe_gauge!(
        GUARD_IDS,
        "Ids in the existence guard's set at its last build."
    );
    describe_gauge!(
        GUARD_BYTES,
        Unit::Bytes,
        "Bytes of the existence guard's set at its last build."
    );
    describe_gauge!(
        GUARD_BUILD,
        Unit::Seconds,
        "How long the existence guard's last build took."
    );
    describe_counter!(LOCK_ELECTIONS, "Leader lock elections by result.");
    describe_counter!(WAITS, "Waits for another's load, by what ended them.");
    describe_histogram!(
        WAIT_DURATION,
        Unit::Seconds,
        "Duration of waits for another's load."
    );
    describe_counter!(
        REDIS_CALLS,
        "Commands and scripts sent to Redis (round trips), the subscriber's aside."
    );
    describe_counter!(REDIS_ERRORS, "Redis failures by kind.");
    describe_gauge!(
        BREAKER_STATE,
        "Redis circuit breaker (on a cluster, the worst of the nodes'): 0 closed, 1 open, 2 half-open."
    );
    describe_gauge!(
        SUBSCRIBED_CHANNELS,
        "Ready channels this process is subscribed to."
    );
    describe_gauge!(FLIGHTS, "In-process flights in progress.");
    describe_gauge!(READS, "Reads not yet answered, waiting ones included.");
    describe_counter!(GARBAGE, "Undecodable cache entries or ready messages met.");
    describe_counter!(REFRESHES, "Background refreshes by result.");
    describe_counter!(
        TOO_LARGE,
        "Loads over MAX_ENTRY_BYTES: a too-large marker stored in their place."
    );
    describe_counter!(
        FLIGHT_PANICS,
        "Flights whose task panicked (answered 503, the lock let go at once)."
    );
    describe_counter!(
        LOCKS_ABANDONED,
        "Leader locks let go by their guard after a panic or a drop, not by a finish."
    );
    describe_gauge!(CONNECTIONS_OPEN, "Client connections open.");
    describe_gauge!(
        MEMORY_BYTES,
        Unit::Bytes,
        "Bytes kept by the memory tier (envelopes plus a fixed overhead per entry)."
    );
    describe_gauge!(MEMORY_ENTRIES, "Entries kept by the memory tier.");
    describe_gauge!(
        MEMORY_SERVING,
        "Whether the memory tier serves (1) or not (0: off, or the change feed is down)."
    );
    describe_counter!(
        FENCED,
        "Leader finishes that stored nothing: a change was applied during the load."
    );
    describe_gauge!(
        FEED_UP,
        "Whether the change feed is connected and caught up (1) or not (0)."
    );
    describe_counter!(CHANGES_APPLIED, "Changes applied by this process, by op.");
    describe_histogram!(
        CHANGE_LAG,
        Unit::Seconds,
        "From a change's write in PostgreSQL to its application here."
    );
    describe_counter!(
        FEED_RECONNECTS,
        "Times the change feed lost its connection and caught up from the outbox."
    );
    describe_counter!(
        CHANGES_SKIPPED,
        "Changes the feed could not read, skipped, by why."
    );
    describe_counter!(
        FEED_RESTARTS,
        "Times the change feed's task ended (a panic) and was started again."
    );
    describe_counter!(
        REPLICA_ROUTED,
        "Loads by where they were read: a replica, or the primary and why."
    );
    describe_gauge!(
        READY,
        "What the last GET /readyz answered: 1 (200: ready or degraded) or 0 (503: draining or unavailable)."
    );
    describe_counter!(
        PRIMARY_POSITION_READS,
        "Statements that read the primary's WAL position for reads the cache could not vouch for (one per round, shared by every read waiting)."
    );
    describe_counter!(
        POSITION_READS,
        "Reads asking for a position or a staleness bound, by how they were answered: cache, wait, replica, primary."
    );
    describe_histogram!(
        POSITION_WAIT,
        Unit::Seconds,
        "How long reads asking for a position waited for the change feed to pass it."
    );
    describe_gauge!(
        REPLICA_UP,
        "Whether the replica is in the rotation (1) or not (0)."
    );
    describe_gauge!(
        REPLICA_LAG_SECONDS,
        Unit::Seconds,
        "Seconds of the primary's commits the replica has not replayed."
    );
    describe_gauge!(
        REPLICA_LAG_BYTES,
        Unit::Bytes,
        "Bytes of WAL between the primary's position and the replica's replay."
    );
    describe_gauge!(
        DECODER_HELD,
        "Whether this instance holds the replication slot and decodes for the fleet."
    );
    describe_counter!(
        FLOOR_MISSES,
        "Answers found older than a version this process had served, loaded from the primary instead."
    );
    describe_counter!(
        CHANGES_UNREPLICATED,
        "Changes applied to a Redis primary that no replica acknowledged in time, applied again later."
    );
    describe_counter!(
        DECODER_GAVE_UP,
        "Times this instance's decoder gave up the slot: it could not vouch for its replication connection."
    );
    describe_counter!(
        DECODER_TAKEOVERS,
        "Times this instance ended the walsender of a decoder that stopped beating, to take the slot."
    );
    describe_counter!(
        FEED_GAPS,
        "Gaps in the change feed (slot missing or invalidated), each a raise of the cutoff."
    );
    describe_gauge!(
        FEED_LAG_BYTES,
        Unit::Bytes,
        "WAL the replication slot holds back past what the fleet applied."
    );
    describe_gauge!(
        FEED_LAG_SECONDS,
        Unit::Seconds,
        "Seconds since the commits the fleet's decoder last proved applied were visible: how stale this instance may be."
    );
    describe_counter!(
        CONNECTIONS_REFUSED,
        "Connections answered 503 and closed past MAX_CONNECTIONS."
    );
    describe_counter!(
        CONNECTIONS_TIMED_OUT,
        "Connections closed by HEADER_READ_TIMEOUT or IDLE_TIMEOUT, by timeout."
    );
    describe_counter!(
        SHED,
        "Requests answered 503 at once for want of capacity, by reason."
    );
    describe_histogram!(
        REDIS_COMMAND_DURATION,
        Unit::Seconds,
        "Duration of the commands and scripts sent to Redis (a batch counts once)."
    );
    describe_gauge!(BUILD_INFO, "The build, by version; always 1.");
    describe_gauge!(
        NODE_BREAKER_STATE,
        "Each Redis node's circuit breaker, by node: 0 closed, 1 open, 2 half-open."
    );
    describe_counter!(BATCH_READS, "Batch reads (GET /posts?ids=) by outcome.");
    describe_counter!(BATCH_READ_IDS, "Distinct ids asked by batch reads.");
    describe_histogram!(
        BATCH_READ_DURATION,
        Unit::Seconds,
        "Duration of batch reads."
    );
    describe_gauge!(
        DB_POOL_CONNECTIONS,
        "PostgreSQL connections of each pool, by pool and state (idle, busy)."
    );
    describe_gauge!(
        DB_POOL_MAX,
        "The most connections each PostgreSQL pool may open."
    );
    describe_histogram!(
        DB_POOL_WAIT,
        Unit::Seconds,
        "How long statements waited for a connection of their pool."
    );
}

/// Buckets for request, load and wait durations: 0.5 ms to 10 s.
pub(super) const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Every (outcome, tier) a request can end with (see `http/served.rs`).
pub(crate) const REQUEST_LABELS: &[(&str, &str)] = &[
    ("hit", "memory"),
    ("negative_hit", "memory"),
    ("hit", "redis"),
    ("negative_hit", "redis"),
    ("stale", "redis"),
    ("miss", "none"),
    ("coalesced_local", "none"),
    ("coalesced_remote", "none"),
    ("bypass", "none"),
    ("too_large", "none"),
    ("negative_hit", "guard"),
    ("error", "none"),
];
