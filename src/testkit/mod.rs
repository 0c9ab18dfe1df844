//! Test support, shared by the tests and the examples (the `testkit`
//! feature; never part of a release build).
//!
//! Each test gets its own world — a fresh, migrated, seeded database and a
//! KEY_PREFIX ([`TestEnv`]) — and runs the real service against the real
//! PostgreSQL and Redis: in-process on 127.0.0.1:0 ([`TestApp`]) or as a
//! child process that can be killed ([`ServiceProcess`]). Faults are real
//! too: a private `redis-server` ([`RedisServer`], [`RedisCluster`]) and a
//! TCP proxy that cuts or stalls a connection ([`TcpProxy`]), and bare
//! client sockets that misbehave ([`RawConn`]).
//!
//! Every request goes through one client ([`Http`]); every wait goes through
//! [`wait_until`], its bound in the call (`support.rs`, with the servers'
//! addresses and free ports). The coherence checker
//! (`examples/coherence`) judges what its clients read with [`history`].

mod database;
mod held;
pub mod history;
mod http;
mod load;
mod postgres;
mod process;
mod redis;
mod socket;
mod support;
mod world;

pub use database::{blocked_loads, TableLock};
pub use held::HeldLoad;
pub use http::{answered, fire, in_progress, metric, Http, Reply, TestApp};
pub use load::{quantile, Record, Sample, SteadyLoad, Zipf};
pub use postgres::PgServer;
pub use process::{ServiceProcess, TcpProxy};
pub use redis::{RedisCluster, RedisServer};
pub use socket::{raw_request, RawConn, RawReply};
pub(crate) use support::kill;
pub use support::{
    available, eventually, free_port, init_tracing, numeric_arg, postgres_port, redis_url,
    server_url, wait_until, A_WHILE, PATIENT, REPLICATION_LONG_LIVED,
};
pub use world::TestEnv;
