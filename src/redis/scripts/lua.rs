//! The Redis side: what every script shares. The [`Call`] trait (a
//! script's typed edge), the layout of KEYS and ARGV by name ([`layout!`])
//! and the prologue made from it, the loop of a script run for many
//! items, and the entry envelope's offsets filled into the Lua.

use fred::prelude::*;

use crate::cache::entry;

/// Every script, by name: what a call names, and the registry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptName {
    Claim,
    ClaimMany,
    Finish,
    FinishMany,
    Release,
    Abandon,
    Extend,
    ApplyMany,
    RaiseCutoff,
}

/// One call of a script: what it sends and what its reply means, each
/// built or parsed here and nowhere else.
pub trait Call {
    /// The reply, parsed.
    type Reply;
    /// The script's name, for errors.
    fn name(&self) -> &'static str;
    /// Which script it calls (see [`Scripts`](super::Scripts)).
    fn script(&self) -> ScriptName;
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
pub(super) fn table(array: &str, names: &[&str], index: impl Fn(usize) -> String) -> String {
    let fields: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, name)| format!("{name} = {array}[{}]", index(i)))
        .collect();
    format!("{{{}}}", fields.join(", "))
}

/// `local K = {…} local A = {…}` over the whole of KEYS and ARGV.
pub(super) fn prologue(keys: &[&str], argv: &[&str]) -> String {
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
pub(super) fn for_each_item(body: &str, one: &str, keys: &[&str], argv: &[&str]) -> String {
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

/// A Lua script with the envelope's layout (and the ready messages' frame)
/// filled in.
pub(super) fn with_layout(lua: &str) -> String {
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
        .replace("$CHANGED", &entry::FLAG_CHANGED.to_string())
        .replace("$FRAMED", &crate::cache::message::FRAMED.to_string())
}

#[cfg(test)]
mod tests {
    use super::{
        super::{apply, finish},
        *,
    };

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
