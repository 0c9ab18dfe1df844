//! The Redis side: the Lua scripts, each with its typed edge.
//!
//! A file per script (`claim.rs`, `finish.rs`, `apply.rs`, `cutoff.rs`,
//! and `lock.rs` for the three small lock scripts) holds its Lua, one Rust type for a
//! call (its KEYS and ARGV, built from typed fields) and one for its reply
//! (parsed from what Redis returns), and a contract test that runs it on a
//! real Redis through every reply it can give. The scripts never read
//! KEYS or ARGV by position: a prologue made here from the same names the
//! Rust side fills ([`layout!`]) gives them `K.value`, `A.token` and so on,
//! so an argument cannot be read from the wrong place. `loading.rs` keeps
//! the scripts loaded on every connection.

mod apply;
mod claim;
mod cutoff;
mod finish;
mod loading;
mod lock;

use fred::{prelude::*, types::scripts::Script};

pub use apply::{ApplyFor, ApplyMany, ChangeKind};
pub use claim::{Claim, ClaimKeys, ClaimMany, Claimed};
pub use cutoff::RaiseCutoff;
pub use finish::{Finish, FinishMany, Finished, StoreFor};
pub(in crate::redis) use loading::{keep_loaded, Server};
pub use lock::{LockOp, OnLock, RETRY};

use crate::cache::entry;

/// One call of a script: what it sends and what its reply means, each
/// built or parsed here and nowhere else.
pub trait Call {
    /// The reply, parsed.
    type Reply;
    /// The script's name, for errors.
    fn name(&self) -> &'static str;
    /// The script, from the registry.
    fn script<'s>(&self, scripts: &'s Scripts) -> &'s Script;
    /// KEYS; the first routes the call (they share a hash slot).
    fn keys(&self) -> Vec<&str>;
    /// ARGV.
    fn args(&self) -> Vec<Value>;
    /// The reply, or `None` when Redis returned something the script never
    /// does (a bug, or a script of another version): the caller's error.
    fn reply(&self, value: Value) -> Option<Self::Reply>;
}

/// A script's KEYS or ARGV by name: a struct whose fields are the names in
/// the order they are sent. `NAMES` gives the Lua side its table of them
/// ([`table`]), and `into_vec` the values in that same order.
macro_rules! layout {
    ($(#[$meta:meta])* $name:ident { $($(#[$fmeta:meta])* $field:ident),* $(,)? }) => {
        $(#[$meta])*
        pub struct $name<T> {
            $($(#[$fmeta])* pub $field: T,)*
        }

        impl<T> $name<T> {
            pub const NAMES: &'static [&'static str] = &[$(stringify!($field)),*];

            pub fn into_vec(self) -> Vec<T> {
                vec![$(self.$field),*]
            }
        }
    };
}
pub(crate) use layout;

/// A duration as a script's milliseconds: 0 stays 0 (off), anything else
/// at least 1.
pub fn ms(d: std::time::Duration) -> i64 {
    if d.is_zero() {
        0
    } else {
        d.as_millis().max(1) as i64
    }
}

/// A Lua table constructor naming `array`'s elements: `{value = KEYS[1],
/// ...}`, the element of name `names[i]` at Lua index `index(i)`.
fn table(array: &str, names: &[&str], index: impl Fn(usize) -> String) -> String {
    let fields: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, name)| format!("{name} = {array}[{}]", index(i)))
        .collect();
    format!("{{{}}}", fields.join(", "))
}

/// `local K = {…} local A = {…}` over the whole of KEYS and ARGV.
fn prologue(keys: &[&str], argv: &[&str]) -> String {
    format!(
        "local K = {}\nlocal A = {}\n",
        table("KEYS", keys, |i| (i + 1).to_string()),
        table("ARGV", argv, |i| (i + 1).to_string()),
    )
}

/// `body`, which defines `local function {one}(K, A)`, then the loop that
/// calls it for each item sent, each with its own KEYS and ARGV laid out as
/// a single call's (`keys` and `argv` by name): the replies in the items'
/// order.
fn for_each_item(body: &str, one: &str, keys: &[&str], argv: &[&str]) -> String {
    let (k, a) = (keys.len(), argv.len());
    let keys = table("KEYS", keys, |i| format!("i*{k}+{}", i + 1));
    let args = table("ARGV", argv, |i| format!("i*{a}+{}", i + 1));
    format!(
        r#"{body}
local replies = {{}}
for i = 0, (#KEYS / {k}) - 1 do
  replies[i + 1] = {one}({keys}, {args})
end
return replies
"#
    )
}

/// A Lua script with the envelope's layout filled in.
fn with_layout(lua: &str) -> String {
    // Lua's string.byte counts from 1.
    let at = |offset: usize| (offset + 1).to_string();
    lua.replace("$VERSION_AT", &at(0))
        .replace("$VERSION", &entry::VERSION.to_string())
        .replace("$HEADER", &entry::HEADER_LEN.to_string())
        .replace("$STATUS", &at(entry::STATUS_AT))
        .replace("$FLAGS", &at(entry::FLAGS_AT))
        .replace("$STORED_AT", &at(entry::STORED_AT))
        .replace("$FRESH_UNTIL", &at(entry::FRESH_UNTIL_AT))
        .replace("$LOAD_AT", &at(entry::LOAD_AT))
        .replace("$FOUND", &entry::STATUS_FOUND.to_string())
        .replace("$NOT_FOUND", &entry::STATUS_NOT_FOUND.to_string())
        .replace("$FAILED", &entry::STATUS_FAILED.to_string())
        .replace("$BACKOFF_UNTIL", &at(entry::BACKOFF_UNTIL_AT))
        .replace("$BACKOFF", &entry::FLAG_BACKOFF.to_string())
        .replace("$INVALIDATED", &entry::FLAG_INVALIDATED.to_string())
}

/// The scripts, loaded on every connection.
#[derive(Clone)]
pub struct Scripts {
    claim: Script,
    claim_many: Script,
    finish: Script,
    finish_many: Script,
    release: Script,
    abandon: Script,
    extend: Script,
    apply_many: Script,
    raise_cutoff: Script,
}

impl Scripts {
    pub fn new() -> Self {
        Self {
            claim: Script::from_lua(claim::lua()),
            claim_many: Script::from_lua(claim::many_lua()),
            finish: Script::from_lua(finish::lua()),
            finish_many: Script::from_lua(finish::many_lua()),
            release: Script::from_lua(lock::release_lua()),
            abandon: Script::from_lua(lock::abandon_lua()),
            extend: Script::from_lua(lock::extend_lua()),
            apply_many: Script::from_lua(apply::lua()),
            raise_cutoff: Script::from_lua(cutoff::lua()),
        }
    }

    fn all(&self) -> [&Script; 9] {
        [
            &self.claim,
            &self.claim_many,
            &self.finish,
            &self.finish_many,
            &self.release,
            &self.abandon,
            &self.extend,
            &self.apply_many,
            &self.raise_cutoff,
        ]
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Self::new()
    }
}

/// Runs calls on the shared Redis for the contract tests: each script's
/// file checks every reply its script can give against a real server.
#[cfg(test)]
mod contract {
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
        let value: Value = call
            .script(&scripts)
            .evalsha_with_reload(client, call.keys(), call.args())
            .await
            .unwrap_or_else(|e| panic!("{} failed: {e}", call.name()));
        call.reply(value)
            .unwrap_or_else(|| panic!("{} gave a reply it never gives", call.name()))
    }

    /// The names `lua` reads from its K and A tables.
    pub fn names_read(lua: &str, table: char) -> BTreeSet<String> {
        let needle = format!("{table}.");
        lua.match_indices(&needle)
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
            .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every placeholder of the scripts is filled from `cache/entry.rs`.
    #[test]
    fn the_scripts_read_the_envelope_layout_from_its_constants() {
        for lua in [finish::lua(), apply::lua()] {
            assert!(!lua.contains('$'), "{lua}");
        }
        let lua = finish::lua();
        let status_byte = format!("string.byte(s, {})", entry::STATUS_AT + 1);
        assert!(lua.contains(&status_byte), "{lua}");
        assert!(lua.contains(&format!("== {}", entry::VERSION)));
    }

    #[test]
    fn a_prologue_names_keys_and_arguments_in_order() {
        assert_eq!(
            prologue(&["value", "lock"], &["token"]),
            "local K = {value = KEYS[1], lock = KEYS[2]}\nlocal A = {token = ARGV[1]}\n"
        );
    }
}
