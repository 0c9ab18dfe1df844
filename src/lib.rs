//! postcache serves posts (`GET /posts/{id}`) out of Redis in front of
//! PostgreSQL and never lets a cache stampede reach the database: when a key
//! is missing, exactly one request in the whole fleet loads the row, and every
//! other request, in any instance, is woken by Redis pub/sub when it lands.
//!
//! # Layout
//! A room per design part; each file's first comment names its room.
//! - [`config`] — settings, each a flag and an environment variable
//!   (`check.rs`: what clap cannot express, refused at start).
//! - [`telemetry`] — logging (its format) and the metrics (`names.rs`:
//!   every series and what it counts).
//! - [`startup`] — builds the service, binds, runs until a shutdown future.
//! - [`http`] — the endpoint (memory hits at once, reads past the router,
//!   the bounds), the state every handler reaches, routes, handlers
//!   (`http/many.rs`: `GET /posts?ids=`), the one HTTP error type, how an answer
//!   was served as headers (`served.rs`: X-Cache, X-Cache-Tier,
//!   Cache-Status), reads that ask for a position (`position.rs`:
//!   PostCache-Min-LSN, PostCache-Max-Staleness, PostCache-LSN), the
//!   OpenAPI document generated with the routes, and the server of
//!   connections (header and idle deadlines, the connection cap).
//! - [`posts`] — the post: its id (parsed wherever one arrives), its row
//!   and JSON, and every `timestamptz` PostgreSQL holds (`infinity`, BC
//!   years) as JSON.
//! - [`store`] — where posts live: the PostgreSQL pools and the embedded
//!   migrations (`pools.rs`), [`store::PostStore`] (the read path's source
//!   of posts), loads from read replicas that have replayed each key's
//!   last change (`replicas.rs`, with their probe, and after a
//!   change to every post `replica_floor.rs`), the primary's WAL position.
//! - [`cache`] — Redis key names, the entry envelope, TTL jitter.
//! - [`read_path`] — the protocol, generic over what it loads, behind one
//!   front door ([`read_path::ReadPath`], the only type of its `mod.rs`):
//!   look up (`first_look.rs`, `warm.rs`) → judge (`freshness.rs`) →
//!   in-process flight (`local.rs`) → elect → lead (`leader.rs`) or
//!   listen → sleep → re-check, as one state machine with pure
//!   transitions (`machine.rs`, driven by `waiter.rs`); each role handed
//!   the context it needs (`context.rs`), never the read path; loads
//!   batched into shared statements (`batch/`), busy told from a database
//!   that stopped answering (`progress.rs`); the memory tier, background
//!   refreshes, changes applied, and the load lab's baselines, a reader of
//!   their own chosen at startup (`lab.rs`); what it loads from is a
//!   [`read_path::Source`] (`source.rs`).
//! - [`redis`] — the Redis side: commands bounded by REDIS_TIMEOUT, a
//!   client and a circuit breaker per node, the Lua scripts each with a
//!   typed call and reply (`scripts/`), the shared subscriber, and the
//!   clients made from REDIS_URL (`connect.rs`).
//! - [`changes`] — the change feed: PostgreSQL's changes to `posts`, by any
//!   writer, invalidate the cache fleet-wide: logical replication with one
//!   decoder per fleet fanned out through a Redis Stream (`replication`,
//!   `fanout`, `pgoutput`), or the outbox trigger (`outbox`, LISTEN,
//!   catch-up).
//! - [`cli`] — `seed` (streamed, with progress), `invalidate`, `inspect`.
//! - `testkit` (feature `testkit`) — test support shared by tests and examples.
//!
//! The modules depend on each other without a cycle, between top-level
//! modules or between files, a module and its children included
//! (`load/code-shape --check` runs in CI and fails on any): `config` names the types it parses into from the modules that
//! own them (the post id from `posts`, the strategy from `read_path`, the log
//! format from `telemetry`), and `startup` turns settings into the read
//! path's; `read_path` uses `redis`, never the other way round; `read_path`,
//! `redis`, `cache`, `telemetry`, `posts` and `store` never read `config`,
//! but for the database settings the pools are made from.

pub mod cache;
pub mod changes;
pub mod cli;
pub mod config;
pub mod http;
pub mod posts;
pub mod read_path;
pub mod redis;
pub mod startup;
pub mod store;
pub mod telemetry;
#[cfg(feature = "testkit")]
pub mod testkit;
