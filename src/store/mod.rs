//! The store: where posts live. The PostgreSQL pools, database creation
//! and the embedded migrations (`pools.rs`); [`PostStore`], the read path's
//! source of posts (`posts.rs`); the read replicas loads may read
//! (`replicas.rs`, with their probe), the floor their loads must
//! include after a change to every post (`replica_floor.rs`), the
//! primary's WAL position (`wal.rs`), and reads that need PostgreSQL's
//! word, on a pool of their own (`past.rs`).

mod past;
mod pools;
mod posts;
mod replica_floor;
mod replicas;
mod wal;

pub use past::{PastReads, PAST_ACQUIRE_TIMEOUT};
pub use pools::{
    connect, connect_feed, connect_past, connect_probe, connect_replica, ensure_database, migrate,
    socket_options, MIGRATOR, PING_IDLE_AFTER,
};
pub use posts::{PostStore, ReadAt};
pub use replicas::{check_replica_lag, ReplicaReport, Replicas, PROBE_FRESH};
pub use wal::wal_position;
