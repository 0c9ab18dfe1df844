//! The Redis side: a leader's claim, in one round trip. Takes an item's lock
//! (`SET NX PX`) and, if taken, reads in the same step what the leader must
//! see before it loads: the value (the previous leader may have finished
//! between our first GET and our SET NX: its lock gone, its value in place)
//! and the item's change fence, which its finish must find unchanged. A
//! lock not taken reads nothing.
//!
//! The three keys share the item's hash slot.

use std::time::Duration;

use bytes::Bytes;
use fred::{prelude::*, types::scripts::Script};

use super::{layout, prologue, Call, Scripts};
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

pub(super) fn lua() -> String {
    prologue(Keys::<()>::NAMES, Argv::<()>::NAMES)
        + r#"
if not redis.call('SET', K.lock, A.token, 'NX', 'PX', A.ttl_ms) then
  return {0}
end
return {1, redis.call('GET', K.value), redis.call('GET', K.fence) or ''}
"#
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

    fn script<'s>(&self, scripts: &'s Scripts) -> &'s Script {
        &scripts.claim
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
            ttl_ms: Value::Integer(super::ms(self.ttl).max(1)),
        }
        .into_vec()
    }

    /// `{0}`, or `{1, value or nil, fence}`.
    fn reply(&self, value: Value) -> Option<Option<Claimed>> {
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
}

/// The claim on a real Redis, through every reply it gives.
#[cfg(test)]
mod contract {
    use super::*;
    use crate::{
        cache::Keys as Names,
        redis::scripts::contract::{clean, names_read, redis, run},
    };

    #[test]
    fn the_script_reads_exactly_the_names_the_call_sends() {
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect();
        assert_eq!(names_read(&lua(), 'K'), names(Keys::<()>::NAMES));
        assert_eq!(names_read(&lua(), 'A'), names(Argv::<()>::NAMES));
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
}
