//! The Redis side: a leader's claim, in one round trip. Takes an item's lock
//! (`SET NX PX`) and, if taken, reads in the same step what the leader must
//! see before it loads: the value (the previous leader may have finished
//! between our first GET and our SET NX: its lock gone, its value in place)
//! and the item's change fence, which its finish must find unchanged. A
//! lock not taken reads nothing.
//!
//! The three keys share the item's hash slot. [`ClaimMany`] makes the
//! claims of many items in one call (on a single Redis, where the items'
//! keys need not share a slot).

use std::time::Duration;

use bytes::Bytes;
use fred::prelude::*;

use super::lua::{for_each_item, layout, ms, prologue, Call, ScriptName};
use crate::cache::ItemKeys;

layout! {
    /// The claim's KEYS.
    Keys { lock, value, fence }
}

layout! {
    /// The claim's ARGV.
    Argv {
        /// The leader's token.
        token,
        /// LOCK_TTL, ms.
        ttl_ms,
    }
}

/// One item's claim, K and A its KEYS and ARGV by name.
const CLAIM_ONE: &str = r#"
local function claim_one(K, A)
  if not redis.call('SET', K.lock, A.token, 'NX', 'PX', A.ttl_ms) then
    return {0}
  end
  return {1, redis.call('GET', K.value), redis.call('GET', K.fence) or ''}
end
"#;

pub(super) fn lua() -> String {
    prologue(Keys::<()>::NAMES, Argv::<()>::NAMES) + CLAIM_ONE + "return claim_one(K, A)\n"
}

/// [`CLAIM_ONE`] and the loop that calls it for each item sent: the
/// replies in the items' order.
pub(super) fn many_lua() -> String {
    for_each_item(CLAIM_ONE, "claim_one", Keys::<()>::NAMES, Argv::<()>::NAMES)
}

/// Takes `keys.lock` with `token` for `ttl`, reading the value and the
/// fence if taken.
pub struct Claim<'a> {
    pub keys: &'a ItemKeys,
    pub token: &'a str,
    pub ttl: Duration,
}

/// A claim that took the lock: the raw value (undecoded) and the fence
/// (empty when none).
#[derive(Debug, PartialEq)]
pub struct Claimed {
    pub value: Option<Bytes>,
    pub fence: String,
}

impl Call for Claim<'_> {
    /// `None` when the lock was held by someone else.
    type Reply = Option<Claimed>;

    fn name(&self) -> &'static str {
        "claim"
    }

    fn script(&self) -> ScriptName {
        ScriptName::Claim
    }

    fn keys(&self) -> Vec<&str> {
        let k = self.keys;
        Keys {
            lock: k.lock.as_str(),
            value: &k.value,
            fence: &k.fence,
        }
        .into_vec()
    }

    fn args(&self) -> Vec<Value> {
        Argv {
            token: Value::from(self.token),
            ttl_ms: Value::Integer(ms(self.ttl).max(1)),
        }
        .into_vec()
    }

    /// `{0}`, or `{1, value or nil, fence}`.
    fn reply(&self, value: Value) -> Option<Option<Claimed>> {
        one_reply(value)
    }
}

/// One item's reply: `{0}`, or `{1, value or nil, fence}`.
fn one_reply(value: Value) -> Option<Option<Claimed>> {
    let Value::Array(reply) = value else {
        return None;
    };
    match reply.as_slice() {
        [lost] if lost.as_i64()? == 0 => Some(None),
        [won, value, fence] if won.as_i64()? == 1 => Some(Some(Claimed {
            value: match value {
                Value::Null => None,
                value => Some(value.as_bytes()?.to_vec().into()),
            },
            fence: fence.as_str()?.into_owned(),
        })),
        _ => None,
    }
}

/// The claims of many items in one call (their keys on one Redis; not a
/// cluster, where an item's keys share a slot but different items' do not).
pub struct ClaimMany<'a> {
    /// Each item's keys, its leader's token and LOCK_TTL.
    pub items: &'a [(&'a ClaimKeys, &'a str, Duration)],
}

/// The keys a claim touches, owned: what a queued claim keeps.
#[derive(Debug, Clone)]
pub struct ClaimKeys {
    pub lock: String,
    pub value: String,
    pub fence: String,
}

impl ClaimKeys {
    pub fn of(keys: &ItemKeys) -> Self {
        Self {
            lock: keys.lock.clone(),
            value: keys.value.clone(),
            fence: keys.fence.clone(),
        }
    }
}

impl Call for ClaimMany<'_> {
    /// Each item's claim, in the items' order.
    type Reply = Vec<Option<Claimed>>;

    fn name(&self) -> &'static str {
        "claim"
    }

    fn script(&self) -> ScriptName {
        ScriptName::ClaimMany
    }

    fn keys(&self) -> Vec<&str> {
        let mut keys = Vec::with_capacity(self.items.len() * Keys::<()>::NAMES.len());
        for (k, ..) in self.items {
            keys.extend(
                Keys {
                    lock: k.lock.as_str(),
                    value: &k.value,
                    fence: &k.fence,
                }
                .into_vec(),
            );
        }
        keys
    }

    fn args(&self) -> Vec<Value> {
        self.items
            .iter()
            .flat_map(|&(_, token, ttl)| {
                Argv {
                    token: Value::from(token),
                    ttl_ms: Value::Integer(ms(ttl).max(1)),
                }
                .into_vec()
            })
            .collect()
    }

    fn reply(&self, value: Value) -> Option<Vec<Option<Claimed>>> {
        let Value::Array(replies) = value else {
            return None;
        };
        if replies.len() != self.items.len() {
            return None;
        }
        replies.into_iter().map(one_reply).collect()
    }
}

/// The claim on a real Redis, through every reply it gives.
#[cfg(test)]
mod contract {
    use super::*;
    use crate::{
        cache::Keys as Names,
        redis::scripts::contract::{assert_reads, clean, redis, run},
    };

    #[test]
    fn the_script_reads_exactly_the_names_the_call_sends() {
        assert_reads(&lua(), 'K', &[Keys::<()>::NAMES]);
        assert_reads(&lua(), 'A', &[Argv::<()>::NAMES]);
    }

    #[tokio::test]
    async fn a_claim_takes_a_free_lock_and_reads_the_value_and_fence() {
        let (client, prefix) = redis().await;
        let keys = Names::new(prefix.clone(), "post").item(7);
        let claim = |token| Claim {
            keys: &keys,
            token,
            ttl: Duration::from_secs(60),
        };

        // Nothing stored: taken, with no value and no fence.
        let taken = run(&client, &claim("a")).await;
        assert_eq!(
            taken,
            Some(Claimed {
                value: None,
                fence: String::new()
            })
        );
        let holder: Option<String> = client.get(&keys.lock).await.unwrap();
        assert_eq!(holder.as_deref(), Some("a"));
        let pttl: i64 = client.pttl(&keys.lock).await.unwrap();
        assert!((50_000..=60_000).contains(&pttl), "{pttl}");

        // Held: not taken, the holder's lock untouched.
        assert_eq!(run(&client, &claim("b")).await, None);
        let holder: Option<String> = client.get(&keys.lock).await.unwrap();
        assert_eq!(holder.as_deref(), Some("a"));

        // Free again, with a value and a fence in place: both read.
        let _: i64 = client.del(&keys.lock).await.unwrap();
        let _: () = client
            .set(&keys.value, &b"\xff\x00entry"[..], None, None, false)
            .await
            .unwrap();
        let _: () = client
            .set(&keys.fence, "17", None, None, false)
            .await
            .unwrap();
        assert_eq!(
            run(&client, &claim("c")).await,
            Some(Claimed {
                value: Some(Bytes::from_static(b"\xff\x00entry")),
                fence: "17".into()
            })
        );
        clean(&client, &prefix).await;
    }

    #[tokio::test]
    async fn many_claims_in_one_call_each_take_a_free_lock_or_read_nothing() {
        let (client, prefix) = redis().await;
        let names = Names::new(prefix.clone(), "post");
        let (free, held, stored) = (names.item(1), names.item(2), names.item(3));
        let _: () = client
            .set(&held.lock, "other", None, None, false)
            .await
            .unwrap();
        let _: () = client
            .set(&stored.value, &b"\xff\x00entry"[..], None, None, false)
            .await
            .unwrap();
        let _: () = client
            .set(&stored.fence, "42", None, None, false)
            .await
            .unwrap();
        let keys = [
            ClaimKeys::of(&free),
            ClaimKeys::of(&held),
            ClaimKeys::of(&stored),
        ];
        let minute = Duration::from_secs(60);
        let items = [
            (&keys[0], "a", minute),
            (&keys[1], "b", minute),
            (&keys[2], "c", minute),
        ];
        let claims = ClaimMany { items: &items };
        assert_eq!(
            run(&client, &claims).await,
            vec![
                Some(Claimed {
                    value: None,
                    fence: String::new()
                }),
                None,
                Some(Claimed {
                    value: Some(Bytes::from_static(b"\xff\x00entry")),
                    fence: "42".into()
                }),
            ]
        );
        for (keys, holder) in [(&free, "a"), (&held, "other"), (&stored, "c")] {
            let got: Option<String> = client.get(&keys.lock).await.unwrap();
            assert_eq!(got.as_deref(), Some(holder));
        }
        let pttl: i64 = client.pttl(&free.lock).await.unwrap();
        assert!((50_000..=60_000).contains(&pttl), "{pttl}");
        // Taken now: a second call takes none of them.
        assert_eq!(run(&client, &claims).await, vec![None, None, None]);
        clean(&client, &prefix).await;
    }
}
