//! The protocol: one flight's fleet-wide coordination, driving the state
//! machine of `machine.rs` against Redis. Each round, try to become the
//! leader; having lost, listen, look again, and sleep until woken.
//!
//! The order is the race fix. Subscribing before the re-check means a
//! leader that finishes after our GET is heard (its PUBLISH reaches a
//! confirmed subscription); one that finished before it is seen by the GET.
//! Sleeping at most until the lock's PTTL means a leader that dies without
//! publishing costs its waiters no more than its lock's lifetime: they wake
//! when it expires and one of them takes over.

use std::{
    future::Future,
    time::{Duration, Instant},
};

use bytes::Bytes;
use tracing::Instrument;

use super::{
    answer::{Answer, Outcome, ReadError, Served},
    context::Context,
    freshness::Verdict,
    leader::{self, lock_token, Leader},
    machine::{End, Event, FlightMachine, Led, Step, WaitEnd},
    settings::Wake,
    source::Source,
};
use crate::{
    cache::{claim_of, message::Message, now_millis, Entry, ItemKeys},
    redis::{Before, LockTtl, Notice, RedisError, Subscription, ValueClaim, RETRY},
    telemetry::metrics,
};

/// What a waiter listens with, once it has lost an election.
enum Listener {
    /// A confirmed subscription to the item's ready channel.
    Channel(Subscription),
    /// Nothing: it sleeps one interval between looks.
    Interval(Duration),
}

/// The fleet-wide coordination of one flight of one key in this process
/// (the in-process part is local.rs), from its first election to its
/// outcome: leads, or waits for the leader's outcome until WAIT_TIMEOUT
/// (a hard bound, exceeded by at most one REDIS_TIMEOUT: a step begun
/// before it), driving its [`FlightMachine`].
pub(super) struct Coordinator<'a, S: Source> {
    ctx: &'a Context<S>,
    key: &'a S::Key,
    keys: ItemKeys,
    /// `keys` with the value key as the lock: the names a leader uses when
    /// the election was in the value key (a claim: see `cache/entry.rs`).
    in_value_keys: ItemKeys,
    /// This flight's lock token (a new one after its leader is fenced).
    token: String,
    /// The same token as a claim in the value key.
    claim: String,
    /// Whether the next election claims the value key (the last look found
    /// no entry there, so the claim should find it absent) rather than the
    /// lock key (an entry kept past its freshness is there).
    claim_value: bool,
    /// Whether the last election was in the value key: its leader's lock,
    /// whose lifetime bounds a wait.
    in_value: bool,
    wait: FlightMachine,
    listener: Option<Listener>,
    /// The hard bound of every Redis step.
    hard: tokio::time::Instant,
    /// The failure that made the flight fail open.
    failure: Option<RedisError>,
    /// What the claim that won the lock read, for the leader.
    claimed: Option<Before>,
    /// The item's fence as this flight's last look at the value read it
    /// (`None`: no look yet): a message published under another fence was
    /// published before a change the look saw, or after one it did not
    /// (`cache/message.rs`).
    looked_fence: Option<Bytes>,
}

impl<'a, S: Source> Coordinator<'a, S> {
    /// `absent`: the first look found no entry in the value key.
    pub fn new(ctx: &'a Context<S>, key: &'a S::Key, absent: bool) -> Self {
        let deadline = Instant::now() + ctx.settings.wait_timeout;
        let keys = ctx.keys.item(key);
        let in_value_keys = ItemKeys {
            lock: keys.value.clone(),
            ..keys.clone()
        };
        let token = lock_token();
        Self {
            ctx,
            key,
            keys,
            in_value_keys,
            claim: claim_of(&token),
            token,
            claim_value: absent,
            in_value: false,
            wait: FlightMachine::new(deadline),
            listener: None,
            hard: (deadline + ctx.settings.redis_timeout).into(),
            failure: None,
            claimed: None,
            looked_fence: None,
        }
    }

    /// Runs the flight to its outcome.
    pub async fn run(mut self) -> Outcome {
        let mut event = Event::Start;
        loop {
            let step = self.wait.next(event, Instant::now());
            if let Some((how, took)) = self.wait.take_ended() {
                wait_ended(self.ctx, how, took);
            }
            event = match step {
                Step::Elect => {
                    let hard = self.hard;
                    match bounded(hard, self.elect()).await {
                        Ok(claimed) => {
                            let won = claimed.is_some();
                            if !won {
                                self.ctx.loader.not_loading(self.key);
                            }
                            self.claimed = claimed;
                            Event::Elected(won)
                        }
                        Err(failed) => self.failed(failed),
                    }
                }
                Step::Lead => {
                    // A new wait, if this flight waits again, listens anew.
                    self.listener = None;
                    tracing::Span::current().record("role", "leader");
                    // Always set: the machine leads only after a won claim.
                    let before = self.claimed.take().unwrap_or(Before {
                        entry: None,
                        fence: String::new(),
                    });
                    let (keys, token) = if self.in_value {
                        (&self.in_value_keys, &self.claim)
                    } else {
                        (&self.keys, &self.token)
                    };
                    let led = Leader::elected(self.ctx, self.key, keys, token)
                        .lead(before, None, true)
                        .await;
                    if matches!(led, Led::Fenced(_)) {
                        self.token = lock_token();
                        self.claim = claim_of(&self.token);
                    }
                    Event::Led(led)
                }
                Step::Listen => match bounded(self.hard, listen(self.ctx, &self.keys)).await {
                    Ok(listener) => {
                        self.listener = Some(listener);
                        Event::Listening
                    }
                    Err(failed) => self.failed(failed),
                },
                Step::Look => {
                    let keys = &self.keys;
                    match bounded(
                        self.hard,
                        self.ctx.redis.lookup_fenced(&keys.value, &keys.fence),
                    )
                    .await
                    {
                        Ok((entry, fence)) => {
                            self.looked_fence = Some(fence);
                            self.claim_value = entry.is_none();
                            Event::Looked(self.judge(entry))
                        }
                        Err(failed) => self.failed(failed),
                    }
                }
                Step::Sleep => match bounded(self.hard, self.sleep())
                    .instrument(tracing::debug_span!("wait"))
                    .await
                {
                    Ok(Some(entry)) => Event::Heard(self.judge(Some(entry))),
                    Ok(None) => Event::Woken,
                    Err(failed) => self.failed(failed),
                },
                Step::End(end) => return self.end(end).await,
            };
        }
    }

    /// One election: in the value key if the last look found it empty (one
    /// command, no script), else, or if an entry landed there meanwhile,
    /// in the lock key. `Some` with what the leader must see when won.
    ///
    /// A claim won for the key at a request's first look (see `won.rs` and `first_look.rs`) is
    /// taken first: this flight leads with it, no command sent.
    async fn elect(&mut self) -> Result<Option<Before>, RedisError> {
        if let Some(token) = self.ctx.won.take(self.key) {
            self.claim = claim_of(&token);
            self.token = token;
            self.in_value = true;
            let fence = String::new();
            return Ok(Some(Before { entry: None, fence }));
        }
        if self.claim_value {
            let claimed = leader::claim_value(self.ctx, &self.in_value_keys, &self.claim).await?;
            match claimed {
                ValueClaim::Won { fence } => {
                    self.in_value = true;
                    return Ok(Some(Before { entry: None, fence }));
                }
                ValueClaim::Held => {
                    self.in_value = true;
                    return Ok(None);
                }
                // Looked at again before the next election.
                ValueClaim::Stored(_) => self.claim_value = false,
            }
        }
        self.in_value = false;
        leader::claim(self.ctx, &self.keys, &self.token).await
    }

    /// The event a failed step makes: fail open, or (past the hard bound)
    /// time out.
    fn failed(&mut self, failed: Failed) -> Event {
        match failed {
            Failed::Redis(error) => {
                self.failure = Some(error);
                Event::RedisFailed
            }
            Failed::Overran => Event::Overran,
        }
    }

    fn judge(&self, entry: Option<Entry>) -> Verdict {
        self.ctx.judge(entry, now_millis(), Duration::ZERO)
    }

    /// Sleeps until something worth a look happens, or the deadline: the
    /// entry a message carried, or `None` to look again.
    async fn sleep(&mut self) -> Result<Option<Entry>, RedisError> {
        let deadline = self.wait.deadline();
        let subscription = match self.listener.as_mut() {
            Some(Listener::Interval(interval)) => {
                let wake_at = (Instant::now() + *interval).min(deadline);
                tokio::time::sleep_until(wake_at.into()).await;
                return Ok(None);
            }
            Some(Listener::Channel(subscription)) => subscription,
            // Never: the machine listens before it sleeps.
            None => return Ok(None),
        };
        let (ctx, keys) = (self.ctx, &self.keys);
        // Sleep no longer than the lock lives: a leader that dies without
        // publishing is replaced once its lock expires (+1 ms to be past it).
        // A claim in the value key lives as long as its leader's lock (and
        // an entry there, stored meanwhile, sends its message).
        // The value key's lifetime is a leader's only while it holds a
        // claim: once the last look found an entry there (one this flight
        // cannot serve: invalidated, another's backoff copy), its TTL may
        // be an hour, and the next election is in the lock key.
        let lock = if self.in_value && self.claim_value {
            &keys.value
        } else {
            &keys.lock
        };
        let lock_left = match ctx.redis.pttl(lock).await? {
            // Released meanwhile: look and try again now.
            LockTtl::Absent => return Ok(None),
            LockTtl::Expires(left) => left + Duration::from_millis(1),
            // Set from outside without expiry: look again after a lock's lifetime.
            LockTtl::NoExpiry => ctx.settings.lock_ttl,
        };
        let wake_at = (Instant::now() + lock_left).min(deadline);
        let notice = tokio::time::timeout_at(wake_at.into(), subscription.recv()).await;
        Ok(match notice {
            // The leader was fenced or gone: elect again.
            Ok(Notice::Message(payload)) if payload.as_ref() == RETRY => None,
            Ok(Notice::Message(payload)) => {
                let message = Message::parse(payload);
                match Entry::decode(message.entry.clone()) {
                    Err(error) => {
                        metrics::garbage("message");
                        tracing::warn!(%error, channel = keys.channel, "undecodable ready message ignored");
                        None
                    }
                    // Published under another fence than this flight's last
                    // look read: before a change the look saw (the entry was
                    // stored, then a change took it away: served, it would
                    // be older than the change, and older than a version
                    // this process may have served meanwhile; a message the
                    // shared subscription dispatched late, or one published
                    // before this flight subscribed to a channel other
                    // flights of this process kept, is such a message), or
                    // after a change the look did not see. Look again
                    // instead (one more GET). No clock is compared: the
                    // fence is Redis's, read atomically with the store and
                    // with the look.
                    Ok(_)
                        if self
                            .looked_fence
                            .as_ref()
                            .is_some_and(|looked| !message.published_under(looked)) =>
                    {
                        tracing::debug!(
                            channel = keys.channel,
                            "a ready message under another fence than the last look's; looking again"
                        );
                        None
                    }
                    Ok(entry) => Some(entry),
                }
            }
            // Messages may have been lost (reconnect, lag).
            Ok(Notice::Recheck) => None,
            // The lock's expiry (look, maybe lead) or the deadline.
            Err(_elapsed) => None,
        })
    }

    async fn end(self, end: End) -> Outcome {
        let loader = &self.ctx.loader;
        match end {
            End::Answer(outcome) => outcome,
            End::Pass => loader.pass(self.key).await,
            End::Unstored(entry) => {
                let served = if loader.too_large(&entry) {
                    Served::TooLarge
                } else {
                    Served::Miss
                };
                Answer::new(entry, served)
            }
            End::TimedOut => Err(ReadError::Timeout),
            // The failure is always kept by `failed` before it ends here.
            End::FailOpen => match self.failure {
                Some(error) => loader.fail_open(self.key, error).await,
                None => loader.bypass(self.key).await,
            },
        }
    }
}

/// Why a step of a flight produced no reply.
enum Failed {
    Redis(RedisError),
    /// Past the hard bound.
    Overran,
}

/// A Redis step under the hard bound.
async fn bounded<T>(
    hard: tokio::time::Instant,
    step: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, Failed> {
    match tokio::time::timeout_at(hard, step).await {
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(error)) => Err(Failed::Redis(error)),
        Err(_elapsed) => Err(Failed::Overran),
    }
}

/// Starts listening as the wake mode says; with pub/sub, returns once the
/// server has confirmed the subscription.
async fn listen<S: Source>(ctx: &Context<S>, keys: &ItemKeys) -> Result<Listener, RedisError> {
    Ok(match ctx.settings.wake {
        Wake::Poll(interval) => Listener::Interval(interval),
        Wake::Message => {
            let subscription = ctx.subscriber.subscribe(&keys.channel).await?;
            #[cfg(feature = "testkit")]
            if let Some(hook) = &ctx.settings.hooks.before_recheck {
                hook(keys.value.clone()).await;
            }
            Listener::Channel(subscription)
        }
    })
}

/// Counts a wait that ended (and tells the test hook).
#[cfg_attr(not(feature = "testkit"), allow(unused_variables))]
fn wait_ended<S: Source>(ctx: &Context<S>, how: WaitEnd, took: Duration) {
    tracing::debug!(
        how = how.as_str(),
        took_ms = took.as_secs_f64() * 1e3,
        "wait ended"
    );
    metrics::wait_ended(how.as_str(), took);
    #[cfg(feature = "testkit")]
    if let Some(hook) = &ctx.settings.hooks.wait_ended {
        hook(how);
    }
}
