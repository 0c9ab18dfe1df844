//! The Redis side of the read path and of the change feed: commands bounded
//! by REDIS_TIMEOUT (`commands/`: their replies, lookups, the change
//! feed's, and how each batched kind goes out), routed per key to a node
//! and its circuit breaker (`nodes.rs`, `breaker.rs`), batched per node
//! (`coalesce.rs`, generic over nodes and commands, and the queued
//! commands `queued.rs`), the replicas' acknowledgement of the change
//! feed's writes (`replicas.rs`), the Lua scripts with their
//! typed calls and replies (`scripts/`), the shared subscriber
//! (`subscriber.rs`), what a failure says of the server (`error.rs`), and
//! the clients made from REDIS_URL (`connect.rs`).
//! It knows the entry envelope and the key names (`cache`), and nothing of
//! the protocol that uses it (`read_path`).

mod breaker;
mod coalesce;
mod commands;
mod connect;
mod error;
mod inspect;
mod nodes;
mod queued;
mod replicas;
pub mod scripts;
mod subscriber;

pub use commands::{Before, FirstLook, LockTtl, OnWon, RedisCommands, ValueClaim};
pub use connect::{config_from_url, connect, connect_commands, Tcp};
pub use error::{with_backoff, RedisError, RETRY_FIRST};
pub use inspect::{snapshot, ItemSnapshot};
pub use nodes::Nodes;
pub use scripts::{
    ApplyFor, ApplyMany, ChangeKind, Claim, Claimed, Finish, Finished, LockOp, OnLock, RaiseCutoff,
    StoreFor, RETRY,
};
pub use subscriber::{Notice, Subscriber, Subscription};
