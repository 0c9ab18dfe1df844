//! The Redis side: the fleet's cutoff (`invalidate --all`, a truncate, a
//! gap in the change feed), raised once per change and never lowered.

use std::time::Duration;

use fred::prelude::*;

use super::lua::{layout, ms, prologue, Call, ScriptName};

layout! {
    /// The script's KEYS.
    Keys {
        /// The cutoff, unix ms.
        cutoff,
        /// The changes that raised it (a set).
        applied,
    }
}

layout! {
    /// The script's ARGV.
    Argv {
        /// The cutoff wanted, unix ms.
        to,
        /// The change's id ("" for none).
        change,
        /// How long a change is remembered, ms.
        remember_ms,
    }
}

/// Raises the cutoff to `A.to`, or past the one in force when that is
/// higher already (a raiser whose clock is behind the last one's), once
/// per change: a change seen again (another instance, a catch-up replayed)
/// does not raise it again. Every raise moves it: a raise that left it
/// where it was would invalidate nothing read since the last one. Returns
/// the cutoff in force.
pub(super) fn lua() -> String {
    prologue(Keys::<()>::NAMES, Argv::<()>::NAMES)
        + r#"
local current = tonumber(redis.call('GET', K.cutoff) or '0') or 0
if A.change ~= '' then
  if redis.call('SADD', K.applied, A.change) == 0 then
    return current
  end
  redis.call('PEXPIRE', K.applied, A.remember_ms)
end
local wanted = math.max(tonumber(A.to), current + 1)
redis.call('SET', K.cutoff, string.format('%.0f', wanted))
return wanted
"#
}

/// Raises the cutoff at `cutoff` to `to` (never lowers it), once per
/// `change` (remembered in `applied` for `remember`); the one in force.
pub struct RaiseCutoff<'a> {
    pub cutoff: &'a str,
    pub applied: &'a str,
    pub to: u64,
    pub change: Option<i64>,
    pub remember: Duration,
}

impl Call for RaiseCutoff<'_> {
    type Reply = u64;
    fn name(&self) -> &'static str {
        "raise_cutoff"
    }

    fn script(&self) -> ScriptName {
        ScriptName::RaiseCutoff
    }

    fn keys(&self) -> Vec<&str> {
        Keys {
            cutoff: self.cutoff,
            applied: self.applied,
        }
        .into_vec()
    }

    fn args(&self) -> Vec<Value> {
        Argv {
            to: Value::Integer(self.to as i64),
            change: self.change.map_or(Value::from(""), Value::Integer),
            remember_ms: Value::Integer(ms(self.remember).max(1)),
        }
        .into_vec()
    }

    fn reply(&self, value: Value) -> Option<u64> {
        u64::try_from(value.as_i64()?).ok()
    }
}

/// The script on a real Redis, through every reply it gives.
#[cfg(test)]
mod contract {
    use super::*;
    use crate::redis::scripts::contract::{assert_reads, clean, redis, run};

    #[test]
    fn the_script_reads_exactly_the_names_the_call_sends() {
        assert_reads(&lua(), 'K', &[Keys::<()>::NAMES]);
        assert_reads(&lua(), 'A', &[Argv::<()>::NAMES]);
    }

    #[tokio::test]
    async fn the_cutoff_rises_once_per_change_and_never_falls() {
        let (client, prefix) = redis().await;
        let (cutoff, applied) = (format!("{prefix}cutoff"), format!("{prefix}applied"));
        let raise = |to, change| RaiseCutoff {
            cutoff: &cutoff,
            applied: &applied,
            to,
            change,
            remember: Duration::from_secs(60),
        };

        assert_eq!(run(&client, &raise(1_000, Some(1))).await, 1_000);
        // Lower (a raiser whose clock is behind): it still moves, past the
        // one in force, never back.
        assert_eq!(run(&client, &raise(500, Some(2))).await, 1_001);
        assert_eq!(run(&client, &raise(2_000, None)).await, 2_000);
        // Change 1 seen again: not applied again, whatever it asks.
        assert_eq!(run(&client, &raise(3_000, Some(1))).await, 2_000);
        let stored: Option<String> = client.get(&cutoff).await.unwrap();
        assert_eq!(stored.as_deref(), Some("2000"));
        // Unix milliseconds written whole, not in Lua's exponent form.
        assert_eq!(
            run(&client, &raise(1_765_000_000_123, None)).await,
            1_765_000_000_123
        );
        assert_eq!(run(&client, &raise(5, None)).await, 1_765_000_000_124);
        let stored: Option<String> = client.get(&cutoff).await.unwrap();
        assert_eq!(stored.as_deref(), Some("1765000000124"));
        clean(&client, &prefix).await;
    }
}
