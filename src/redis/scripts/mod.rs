//! The Redis side: the Lua scripts, each with its typed edge.
//!
//! A file per script (`claim.rs`, `finish.rs`, `apply.rs`, `cutoff.rs`,
//! and `lock.rs` for the three small lock scripts) holds its Lua, one Rust type for a
//! call (its KEYS and ARGV, built from typed fields) and one for its reply
//! (parsed from what Redis returns), and a contract test that runs it on a
//! real Redis through every reply it can give. The scripts never read
//! KEYS or ARGV by position: a prologue made here from the same names the
//! Rust side fills (`layout!`, in `lua.rs`) gives them `K.value`, `A.token` and so on,
//! so an argument cannot be read from the wrong place (`lua.rs`, what every
//! script shares). `registry.rs` holds them, and `loading.rs` keeps them
//! loaded on every connection.

mod apply;
mod claim;
mod cutoff;
mod finish;
mod loading;
mod lock;
mod lua;
mod registry;

pub use apply::{ApplyFor, ApplyMany, ChangeKind};
pub use claim::{Claim, ClaimKeys, ClaimMany, Claimed};
pub use cutoff::RaiseCutoff;
pub use finish::{Finish, FinishMany, Finished, StoreFor};
pub(in crate::redis) use loading::{keep_loaded, Server};
pub use lock::{LockOp, OnLock, RETRY};
pub use lua::{ms, Call, ScriptName};
pub use registry::Scripts;

/// Runs calls on the shared Redis for the contract tests: each script's
/// file checks every reply its script can give against a real server. The
/// batching tests of `commands` take their Redis from here too.
#[cfg(test)]
pub(super) mod contract {
    use std::collections::BTreeSet;

    use fred::prelude::*;

    use super::{Call, Scripts};

    /// A client of the Redis the tests use (REDIS_URL, else the local one),
    /// and a key prefix of this test's own.
    pub async fn redis() -> (Client, String) {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let client = Client::new(Config::from_url(&url).unwrap(), None, None, None);
        client.init().await.expect("the tests' Redis is up");
        let prefix = format!("postcache:contract:{:016x}:", rand::random::<u64>());
        (client, prefix)
    }

    /// Runs `call` as the read path does (EVALSHA, loaded on NOSCRIPT).
    pub async fn run<C: Call>(client: &Client, call: &C) -> C::Reply {
        let scripts = Scripts::new();
        let value: Value = scripts
            .get(call.script())
            .evalsha_with_reload(client, call.keys(), call.args())
            .await
            .unwrap_or_else(|e| panic!("{} failed: {e}", call.name()));
        call.reply(value)
            .unwrap_or_else(|| panic!("{} gave a reply it never gives", call.name()))
    }

    /// Fails unless the names `lua` reads from its `table` (`K` or `A`) are
    /// exactly those of `sent`: a script reading a name its call does not
    /// send would read nil, and one sent but never read is a leftover.
    #[track_caller]
    pub fn assert_reads(lua: &str, table: char, sent: &[&[&str]]) {
        let needle = format!("{table}.");
        let read: BTreeSet<String> = lua
            .match_indices(&needle)
            .filter(|(at, _)| {
                // `K.` as a name of its own, not the end of another name.
                lua[..*at]
                    .chars()
                    .last()
                    .is_none_or(|c| !c.is_alphanumeric() && c != '_')
            })
            .map(|(at, _)| {
                lua[at + 2..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect()
            })
            .collect();
        let sent: BTreeSet<String> = sent
            .iter()
            .flat_map(|names| names.iter().map(|n| n.to_string()))
            .collect();
        assert_eq!(read, sent, "the names the script reads from {table}");
    }

    /// A message on `channel` within a second, from a subscription taken
    /// before `act` runs.
    pub async fn heard(
        client: &Client,
        channel: &str,
        act: impl std::future::Future,
    ) -> Option<bytes::Bytes> {
        let listener = client.clone_new();
        listener.init().await.unwrap();
        let mut messages = listener.message_rx();
        listener.subscribe(channel).await.unwrap();
        act.await;
        let message =
            tokio::time::timeout(std::time::Duration::from_secs(1), messages.recv()).await;
        let _ = listener.quit().await;
        message
            .ok()
            .and_then(|m| m.ok())
            .and_then(|m| m.value.into_bytes())
    }

    /// Stores `entry` under `key` for `ttl_ms`, as a finish would.
    pub async fn put_for(client: &Client, key: &str, entry: &crate::cache::Entry, ttl_ms: i64) {
        let _: () = client
            .set(
                key,
                entry.raw().clone(),
                Some(fred::types::Expiration::PX(ttl_ms)),
                None,
                false,
            )
            .await
            .unwrap();
    }

    /// Deletes the test's keys.
    pub async fn clean(client: &Client, prefix: &str) {
        let list = fred::types::CustomCommand::new_static("KEYS", None::<u16>, false);
        let keys: Vec<String> = client
            .custom(list, vec![format!("{prefix}*")])
            .await
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: i64 = client.del(keys).await.unwrap_or(0);
        }
    }
}
