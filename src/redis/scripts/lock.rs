//! The Redis side: the lock's scripts, each checking the holder's token,
//! so that only the leader that holds a lock extends it, releases it, or
//! lets go of it. (Taking a lock is a plain `SET NX PX`: `commands.rs`.)

use std::time::Duration;

use bytes::Bytes;
use fred::prelude::*;

use super::lua::{layout, ms, prologue, Call, ScriptName};

/// The message that tells waiters to elect a leader again (a fenced
/// finish, an abandoned lock): too short to be an entry, so never taken
/// for one.
pub const RETRY: &[u8] = b"retry";

layout! {
    /// The lock scripts' KEYS.
    Keys { lock }
}

layout! {
    /// Release's ARGV.
    ReleaseArgv { token }
}

layout! {
    /// Extend's ARGV.
    ExtendArgv {
        token,
        /// The new TTL, ms.
        ttl_ms,
    }
}

layout! {
    /// Abandon's ARGV.
    AbandonArgv {
        token,
        /// The ready channel.
        channel,
        /// PUBLISH, or SPUBLISH on a Redis Cluster.
        publish,
        /// [`RETRY`].
        retry,
    }
}

/// Releases a lock only if it still holds the token. Returns 1 when released.
pub(super) fn release_lua() -> String {
    prologue(Keys::<()>::NAMES, ReleaseArgv::<()>::NAMES)
        + r#"
if redis.call('GET', K.lock) == A.token then
  return redis.call('DEL', K.lock)
end
return 0
"#
}

/// A leader gone without finishing (its task panicked, or was dropped): its
/// lock is released if it still holds the token, and [`RETRY`] published so
/// that its waiters elect a new leader now rather than at the lock's expiry.
/// Returns 1 when released (and published).
pub(super) fn abandon_lua() -> String {
    prologue(Keys::<()>::NAMES, AbandonArgv::<()>::NAMES)
        + r#"
if redis.call('GET', K.lock) == A.token then
  redis.call('DEL', K.lock)
  redis.call(A.publish, A.channel, A.retry)
  return 1
end
return 0
"#
}

/// Extends a lock only if it still holds the token (the watchdog). Returns
/// 1 when extended.
pub(super) fn extend_lua() -> String {
    prologue(Keys::<()>::NAMES, ExtendArgv::<()>::NAMES)
        + r#"
if redis.call('GET', K.lock) == A.token then
  return redis.call('PEXPIRE', K.lock, A.ttl_ms)
end
return 0
"#
}

/// What a token-checked script does to the lock.
#[derive(Debug, Clone, Copy)]
pub enum LockOp<'a> {
    /// Release it.
    Release,
    /// Extend it to this TTL (the watchdog).
    Extend(Duration),
    /// Let go of it without finishing: released, and [`RETRY`] published
    /// on `channel` (with SPUBLISH on a Redis Cluster: `sharded`).
    Abandon { channel: &'a str, sharded: bool },
}

/// `op` on `lock` if it holds `token`; whether it did.
pub struct OnLock<'a> {
    pub lock: &'a str,
    pub token: &'a str,
    pub op: LockOp<'a>,
}

impl Call for OnLock<'_> {
    type Reply = bool;

    fn name(&self) -> &'static str {
        match self.op {
            LockOp::Release => "release",
            LockOp::Extend(_) => "extend",
            LockOp::Abandon { .. } => "abandon",
        }
    }

    fn script(&self) -> ScriptName {
        match self.op {
            LockOp::Release => ScriptName::Release,
            LockOp::Extend(_) => ScriptName::Extend,
            LockOp::Abandon { .. } => ScriptName::Abandon,
        }
    }

    fn keys(&self) -> Vec<&str> {
        Keys { lock: self.lock }.into_vec()
    }

    fn args(&self) -> Vec<Value> {
        let token = Value::from(self.token);
        match self.op {
            LockOp::Release => ReleaseArgv { token }.into_vec(),
            LockOp::Extend(ttl) => ExtendArgv {
                token,
                ttl_ms: Value::Integer(ms(ttl).max(1)),
            }
            .into_vec(),
            LockOp::Abandon { channel, sharded } => AbandonArgv {
                token,
                channel: Value::from(channel),
                publish: Value::from(if sharded { "SPUBLISH" } else { "PUBLISH" }),
                retry: Value::Bytes(Bytes::from_static(RETRY)),
            }
            .into_vec(),
        }
    }

    /// 1 or 0: whether the script acted.
    fn reply(&self, value: Value) -> Option<bool> {
        match value.as_i64()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
}

/// The lock scripts on a real Redis, through every reply they give.
#[cfg(test)]
mod contract {
    use super::*;
    use crate::redis::scripts::contract::{assert_reads, clean, heard, redis, run};

    #[test]
    fn each_script_reads_only_names_its_call_sends() {
        for lua in [release_lua(), extend_lua(), abandon_lua()] {
            assert_reads(&lua, 'K', &[Keys::<()>::NAMES]);
        }
        assert_reads(&release_lua(), 'A', &[ReleaseArgv::<()>::NAMES]);
        assert_reads(&extend_lua(), 'A', &[ExtendArgv::<()>::NAMES]);
        assert_reads(&abandon_lua(), 'A', &[AbandonArgv::<()>::NAMES]);
    }

    #[tokio::test]
    async fn only_the_holder_releases_extends_or_abandons() {
        let (client, prefix) = redis().await;
        let lock = format!("{prefix}lock");
        let channel = format!("{prefix}ready");
        let set = |token: &'static str| {
            let (client, lock) = (client.clone(), lock.clone());
            async move {
                let _: () = client
                    .set(&lock, token, Some(Expiration::PX(10_000)), None, false)
                    .await
                    .unwrap();
            }
        };
        let ttl = Duration::from_secs(60);

        let ours = "ours";
        let on = |op| OnLock {
            lock: &lock,
            token: ours,
            op,
        };
        let (release, extend) = (on(LockOp::Release), on(LockOp::Extend(ttl)));
        let abandon = on(LockOp::Abandon {
            channel: &channel,
            sharded: false,
        });

        set("theirs").await;
        assert!(!run(&client, &release).await);
        assert!(!run(&client, &extend).await);
        assert!(!run(&client, &abandon).await);
        let left: i64 = client.pttl(&lock).await.unwrap();
        assert!(left <= 10_000, "not extended: {left}");

        set("ours").await;
        assert!(run(&client, &extend).await);
        let left: i64 = client.pttl(&lock).await.unwrap();
        assert!(left > 10_000, "extended: {left}");
        assert!(run(&client, &release).await);
        let held: Option<String> = client.get(&lock).await.unwrap();
        assert_eq!(held, None);

        // Abandoned: released, and RETRY published for the waiters.
        set("ours").await;
        let mut abandoned = false;
        let message = heard(&client, &channel, async {
            abandoned = run(&client, &abandon).await;
        })
        .await;
        assert!(abandoned);
        assert_eq!(message.as_deref(), Some(RETRY));
        let held: Option<String> = client.get(&lock).await.unwrap();
        assert_eq!(held, None);
        clean(&client, &prefix).await;
    }
}
