//! The cache: redis key and channel names.
//!
//! The id sits inside a hash tag (`{42}`) so that one item's value (which
//! keeps the fail-safe copy too, see `entry.rs`), lock, fence and channel
//! always land in the same Redis Cluster slot.

use std::fmt::Display;

/// The names of one item's keys and channel, built together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemKeys {
    pub value: String,
    pub lock: String,
    pub fence: String,
    pub applied: String,
    pub channel: String,
}

/// Builds the names of one item's value, lock and ready channel.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
    kind: &'static str,
}

impl Keys {
    /// `kind` names what is cached (`post`), `prefix` is KEY_PREFIX.
    pub fn new(prefix: impl Into<String>, kind: &'static str) -> Self {
        Self {
            prefix: prefix.into(),
            kind,
        }
    }

    /// Every name of one item, the id rendered once (the read path and the
    /// change feed's decoder make these for every item they touch; a
    /// `format!` each was a visible share of the decoder's CPU).
    pub fn item(&self, id: impl Display) -> ItemKeys {
        let id = id.to_string();
        ItemKeys {
            value: self.named("", &id),
            lock: self.named("lock:", &id),
            fence: self.named("fence:", &id),
            applied: self.named("applied:", &id),
            channel: self.named("ready:", &id),
        }
    }

    /// `P` + `role` + `post:{` + `id` + `}`, put together from its pieces.
    fn named(&self, role: &str, id: &str) -> String {
        let pieces = [self.prefix.as_str(), role, self.kind, ":{", id, "}"];
        let mut name = String::with_capacity(pieces.iter().map(|p| p.len()).sum());
        for piece in pieces {
            name.push_str(piece);
        }
        name
    }

    /// `P` + `post:{42}`
    pub fn value(&self, id: impl Display) -> String {
        self.named("", &id.to_string())
    }

    /// `P` + `lock:post:{42}`
    pub fn lock(&self, id: impl Display) -> String {
        self.named("lock:", &id.to_string())
    }

    /// `P` + `fence:post:{42}`: the last change applied to the item, for a
    /// short while: a leader that read the row before it stores nothing.
    pub fn fence(&self, id: impl Display) -> String {
        self.named("fence:", &id.to_string())
    }

    /// `P` + `applied:post:{42}`: the changes applied to the item lately
    /// (as long as its fence lives), so that each is applied once.
    pub fn applied(&self, id: impl Display) -> String {
        self.named("applied:", &id.to_string())
    }

    /// `P` + `ready:post:{42}`
    pub fn channel(&self, id: impl Display) -> String {
        self.named("ready:", &id.to_string())
    }

    /// `P` + `{post-changes}:cutoff`: unix milliseconds before which every
    /// read is invalid (`invalidate --all`, a truncate).
    pub fn cutoff(&self) -> String {
        format!("{}{{{}-changes}}:cutoff", self.prefix, self.kind)
    }

    /// `P` + `{post-changes}:cutoffs-applied`: the changes that raised the
    /// cutoff (same slot as the cutoff), so that each raises it once.
    pub fn cutoffs_applied(&self) -> String {
        format!("{}{{{}-changes}}:cutoffs-applied", self.prefix, self.kind)
    }

    /// `P` + `{post-changes}:stream`: the Redis Stream on which the
    /// decoder of CHANGE_FEED=replication tells every instance what changed
    /// (see `changes/replication/fanout.rs`).
    pub fn change_stream(&self) -> String {
        format!("{}{{{}-changes}}:stream", self.prefix, self.kind)
    }

    /// `P` + `{post-changes}:gap`: set while the replication slot is being
    /// made again and the cutoff not yet raised for the changes no slot
    /// kept; its value says why. The next decoder raises the cutoff if the
    /// one that set it died first.
    pub fn feed_gap(&self) -> String {
        format!("{}{{{}-changes}}:gap", self.prefix, self.kind)
    }

    /// `P` + `{post-changes}:position`: the outbox snapshot the fleet has
    /// applied, where a starting instance catches up from.
    pub fn feed_position(&self) -> String {
        format!("{}{{{}-changes}}:position", self.prefix, self.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_contract_and_share_a_hash_tag() {
        let keys = Keys::new("t1:", "post");
        assert_eq!(keys.value(42), "t1:post:{42}");
        assert_eq!(keys.lock(42), "t1:lock:post:{42}");
        assert_eq!(keys.channel(42), "t1:ready:post:{42}");
        assert_eq!(keys.fence(42), "t1:fence:post:{42}");
        assert_eq!(keys.applied(42), "t1:applied:post:{42}");
        assert_eq!(keys.cutoff(), "t1:{post-changes}:cutoff");
        assert_eq!(Keys::new("", "post").value(7), "post:{7}");
        // `item` puts the same names together another way.
        for (prefix, id) in [("t1:", 42), ("", 7), ("a{b}:", -9), ("t1:", i64::MAX)] {
            let keys = Keys::new(prefix, "post");
            let item = keys.item(id);
            assert_eq!(
                [
                    item.value,
                    item.lock,
                    item.fence,
                    item.applied,
                    item.channel
                ],
                [
                    keys.value(id),
                    keys.lock(id),
                    keys.fence(id),
                    keys.applied(id),
                    keys.channel(id)
                ]
            );
        }
    }
}
