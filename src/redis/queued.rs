//! The Redis side: the commands a node batches (see `coalesce.rs`), each
//! queued with the sender of its reply. How each kind's batch goes out is
//! the commands' (`commands/batches.rs`).

use std::time::Duration;

use bytes::Bytes;
use fred::types::Value;
use tokio::sync::oneshot;

use super::{
    commands::{OnWon, ValueClaim},
    error::RedisError,
    scripts::{ClaimKeys, Claimed},
};

/// A queued lookup: the value key, and where its raw value goes.
pub(super) struct QueuedGet {
    pub key: String,
    pub reply: oneshot::Sender<Result<Option<Bytes>, RedisError>>,
}

/// A queued claim: the item's keys and the leader's token, and where the
/// claim's reply goes (`None`: the lock was held).
pub(super) struct QueuedClaim {
    pub keys: ClaimKeys,
    pub token: String,
    pub ttl: Duration,
    pub reply: oneshot::Sender<Result<Option<Claimed>, RedisError>>,
}

/// A queued claim of an absent value key (see
/// [`RedisCommands::claim_value`](crate::redis::RedisCommands::claim_value)), and where its reply goes.
pub(super) struct QueuedValueClaim {
    pub value: String,
    /// The fence key, when read (see [`RedisCommands::claim_value`](crate::redis::RedisCommands::claim_value)).
    pub fence: Option<String>,
    pub claim: String,
    pub ttl: Duration,
    /// Run before the reply is sent, and before the later claims' (see
    /// [`RedisCommands::look_up_or_claim`](crate::redis::RedisCommands::look_up_or_claim)), if it won and its caller waits.
    pub on_won: Option<OnWon>,
    pub reply: oneshot::Sender<Result<ValueClaim, RedisError>>,
}

/// A queued finish: its KEYS and ARGV as its `Finish` made them, and where
/// its reply goes, unparsed (the caller's `Finish` parses it).
pub(super) struct QueuedFinish {
    pub keys: Vec<String>,
    pub args: Vec<Value>,
    pub reply: oneshot::Sender<Result<Value, RedisError>>,
}
