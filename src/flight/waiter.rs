//! The wait loop: fleet-wide coordination of one flight. Each round, try to
//! become the leader; having lost, listen, look again, and sleep until woken.
//!
//! ```text
//!  ┌► try the lock ──won──► lead (leader.rs)
//!  │      │ lost
//!  │      ▼
//!  │   first time: start listening (SUBSCRIBE, confirmed) ── Waiting
//!  │      ▼
//!  │   look again (GET) ──an answer──► done ("recheck")
//!  │      ▼
//!  │   deadline passed? ──► 504 ("timeout")
//!  │      ▼
//!  └── sleep until woken: a message (answer? done, "message"), the lock's
//!      expiry, a re-check notice, or the poll interval
//! ```
//!
//! The order is the race fix. Subscribing before the re-check means a
//! leader that finishes after our GET is heard (its PUBLISH reaches a
//! confirmed subscription); one that finished before it is seen by the GET.
//! Sleeping at most until the lock's PTTL means a leader that dies without
//! publishing costs its waiters no more than its lock's lifetime: they wake
//! when it expires and one of them takes over.

use std::time::{Duration, Instant};

use super::{
    freshness::{judge, Verdict},
    leader::{lock_token, Led},
    redis::LockTtl,
    scripts::RETRY,
    subscriber::{Notice, Subscription},
    Answer, Outcome, ReadError, ReadPath, Served, Source,
};
use crate::{
    cache::{now_millis, Entry, ItemKeys},
    telemetry::metrics,
};

/// How a waiter learns that the leader is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The leader's ready message on the item's channel (pub/sub, the default).
    Message,
    /// A re-read of the value every interval (the load lab's `poll`).
    Poll(Duration),
}

/// What a waiter listens with, once it has lost an election.
enum Listener {
    /// A confirmed subscription to the item's ready channel.
    Channel(Subscription),
    /// Nothing: it sleeps one interval between looks.
    Interval(Duration),
}

/// Why a sleeping waiter woke.
enum Woken {
    /// The leader's outcome, published on the channel.
    Message(Entry),
    /// Anything else: look again (the lock expired or was released, the
    /// leader was fenced by a change, a message may have been lost, an
    /// interval passed, the deadline came).
    LookAgain,
}

/// How many times in a row a flight's own leader may be fenced by changes
/// before it answers with what it read last (not storing it): a post
/// changed faster than it can be read would otherwise never be answered.
const FENCED_ROUNDS: u32 = 3;

/// A wait in progress, from the first lost election to its end.
struct Waiting {
    since: Instant,
    listener: Listener,
}

impl<S: Source> ReadPath<S> {
    /// Leads, or waits for the leader's outcome until WAIT_TIMEOUT: a hard
    /// bound, exceeded by at most one REDIS_TIMEOUT (a step begun before it).
    pub(super) async fn coordinate(&self, key: &S::Key) -> Outcome {
        let deadline = Instant::now() + self.settings.wait_timeout;
        let keys = self.keys.item(key);
        let mut token = lock_token();
        let mut fenced = 0;
        // None until an election is lost: winning the first one is a plain
        // miss, not the end of a wait.
        let mut waiting: Option<Waiting> = None;
        // The hard bound of a wait: a Redis step begun just before the
        // deadline may end one REDIS_TIMEOUT after it, never later.
        let hard = (deadline + self.settings.redis_timeout).into();
        loop {
            // Past the deadline a waiter gives up: it neither leads nor loads.
            if let Some(w) = &waiting {
                if Instant::now() >= deadline {
                    return self.timed_out(w);
                }
            }
            match tokio::time::timeout_at(hard, self.try_lock(&keys, &token)).await {
                Ok(Ok(true)) => {
                    if let Some(w) = waiting.take() {
                        self.wait_ended(&w, "takeover");
                    }
                    tracing::Span::current().record("role", "leader");
                    match self.lead(key, &keys, &token, None).await {
                        Led::Done(outcome) => return outcome,
                        // What we read may predate a change: elect again,
                        // like our waiters, and read the row anew.
                        Led::Fenced(entry) => {
                            fenced += 1;
                            if fenced >= FENCED_ROUNDS || Instant::now() >= deadline {
                                let served = if self.too_large(&entry) {
                                    Served::TooLarge
                                } else {
                                    Served::Miss
                                };
                                return Answer::new(entry, served);
                            }
                            token = lock_token();
                            continue;
                        }
                    }
                }
                Ok(Ok(false)) => {}
                Ok(Err(error)) => return self.fail_open(key, error).await,
                Err(_elapsed) => return Err(ReadError::Timeout),
            }
            let w = match &mut waiting {
                Some(w) => w,
                None => match tokio::time::timeout_at(hard, self.start_waiting(&keys)).await {
                    Ok(Ok(w)) => waiting.insert(w),
                    Ok(Err(error)) => return self.fail_open(key, error).await,
                    Err(_elapsed) => return Err(ReadError::Timeout),
                },
            };
            // Look again: the leader may have finished (and published)
            // before our subscription existed, or since our last look.
            match tokio::time::timeout_at(hard, self.redis.lookup(&keys.value)).await {
                Ok(Ok(entry)) => {
                    let verdict = judge(entry, now_millis(), Duration::ZERO, self.cutoff());
                    if verdict == Verdict::TooLarge {
                        self.wait_ended(w, "too_large");
                        return self.pass(key).await;
                    }
                    if let Some(outcome) = verdict.settle(Served::CoalescedRemote) {
                        self.wait_ended(w, ended_by(&outcome, "recheck"));
                        return outcome;
                    }
                }
                Ok(Err(error)) => return self.fail_open(key, error).await,
                Err(_elapsed) => return self.timed_out(w),
            }
            if Instant::now() >= deadline {
                return self.timed_out(w);
            }
            let woken = self.sleep(&mut w.listener, &keys, deadline);
            match tokio::time::timeout_at(hard, woken).await {
                Ok(Ok(Woken::Message(entry))) => {
                    let verdict = judge(Some(entry), now_millis(), Duration::ZERO, self.cutoff());
                    // The leader found the item too large to cache: load it
                    // here, at once (one load per instance, not one per
                    // waiter through the lock in turn).
                    if verdict == Verdict::TooLarge {
                        self.wait_ended(w, "too_large");
                        return self.pass(key).await;
                    }
                    if let Some(outcome) = verdict.settle(Served::CoalescedRemote) {
                        self.wait_ended(w, ended_by(&outcome, "message"));
                        return outcome;
                    }
                    // A stale entry published: keep waiting for a fresh one.
                }
                Ok(Ok(Woken::LookAgain)) => {}
                Ok(Err(error)) => return self.fail_open(key, error).await,
                Err(_elapsed) => return self.timed_out(w),
            }
        }
    }

    fn timed_out(&self, waiting: &Waiting) -> Outcome {
        self.wait_ended(waiting, "timeout");
        Err(ReadError::Timeout)
    }

    /// Starts listening as the wake mode says; with pub/sub, returns once
    /// the server has confirmed the subscription.
    async fn start_waiting(&self, keys: &ItemKeys) -> Result<Waiting, super::RedisError> {
        let since = Instant::now();
        let listener = match self.settings.wake {
            Wake::Poll(interval) => Listener::Interval(interval),
            Wake::Message => {
                let subscription = self.subscriber.subscribe(&keys.channel).await?;
                #[cfg(feature = "testkit")]
                if let Some(hook) = &self.settings.hooks.before_recheck {
                    hook(keys.value.clone()).await;
                }
                Listener::Channel(subscription)
            }
        };
        Ok(Waiting { since, listener })
    }

    /// Sleeps until something worth a look happens, or the deadline.
    async fn sleep(
        &self,
        listener: &mut Listener,
        keys: &ItemKeys,
        deadline: Instant,
    ) -> Result<Woken, super::RedisError> {
        let subscription = match listener {
            Listener::Interval(interval) => {
                let wake_at = (Instant::now() + *interval).min(deadline);
                tokio::time::sleep_until(wake_at.into()).await;
                return Ok(Woken::LookAgain);
            }
            Listener::Channel(subscription) => subscription,
        };
        // Sleep no longer than the lock lives: a leader that dies without
        // publishing is replaced once its lock expires (+1 ms to be past it).
        let lock_left = match self.redis.pttl(&keys.lock).await? {
            // Released meanwhile: look and try again now.
            LockTtl::Absent => return Ok(Woken::LookAgain),
            LockTtl::Expires(left) => left + Duration::from_millis(1),
            // Set from outside without expiry: look again after a lock's lifetime.
            LockTtl::NoExpiry => self.settings.lock_ttl,
        };
        let wake_at = (Instant::now() + lock_left).min(deadline);
        let notice = tokio::time::timeout_at(wake_at.into(), subscription.recv()).await;
        Ok(match notice {
            // The leader was fenced: elect again.
            Ok(Notice::Message(payload)) if payload.as_ref() == RETRY => Woken::LookAgain,
            Ok(Notice::Message(payload)) => match Entry::decode(payload) {
                Ok(entry) => Woken::Message(entry),
                Err(error) => {
                    metrics::garbage("message");
                    tracing::warn!(%error, channel = keys.channel, "undecodable ready message ignored");
                    Woken::LookAgain
                }
            },
            // Messages may have been lost (reconnect, lag).
            Ok(Notice::Recheck) => Woken::LookAgain,
            // The lock's expiry (look, maybe lead) or the deadline.
            Err(_elapsed) => Woken::LookAgain,
        })
    }

    fn wait_ended(&self, waiting: &Waiting, ended_by: &'static str) {
        metrics::wait_ended(ended_by, waiting.since.elapsed());
        #[cfg(feature = "testkit")]
        if let Some(hook) = &self.settings.hooks.wait_ended {
            hook(ended_by);
        }
    }
}

/// The `ended_by` label of a wait that settled with `outcome` through `how`.
fn ended_by(outcome: &Outcome, how: &'static str) -> &'static str {
    if outcome.is_err() {
        "failure"
    } else {
        how
    }
}

/// Observation points for tests and benchmarks that must act or measure at
/// an exact step of the protocol (the `testkit` feature only).
#[cfg(feature = "testkit")]
#[derive(Clone, Default)]
pub struct Hooks {
    /// Runs after a waiter's subscription is confirmed, before its re-check.
    pub before_recheck: Option<Hook>,
    /// Called the moment a wait ends, with what ended it.
    pub wait_ended: Option<std::sync::Arc<dyn Fn(&'static str) + Send + Sync>>,
    /// Runs after a leader's load, before its finish.
    pub after_load: Option<Hook>,
}

/// An async callback run at a point of the protocol, given the value key.
#[cfg(feature = "testkit")]
pub type Hook = std::sync::Arc<
    dyn Fn(String) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync,
>;

#[cfg(feature = "testkit")]
impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("before_recheck", &self.before_recheck.is_some())
            .field("wait_ended", &self.wait_ended.is_some())
            .field("after_load", &self.after_load.is_some())
            .finish()
    }
}
