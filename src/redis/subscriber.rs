//! The Redis side: one shared subscriber connection per process,
//! multiplexing every ready channel.
//!
//! Only flight owners subscribe, and there is at most one flight per key per
//! process, so a channel usually has a single local listener; the reference
//! count covers the overlap of an ending flight and the next one.
//!
//! Ordering is the subtle part. A channel must never be left unsubscribed on
//! the server while a local listener believes it is subscribed. An UNSUBSCRIBE
//! racing a new SUBSCRIBE on the same channel could do exactly that, so all
//! server-side changes of one channel are serialised by that channel's
//! `server_state` lock, and a slot leaves the map only after its UNSUBSCRIBE
//! has completed: a newcomer either finds the old slot (and re-subscribes under
//! its lock if needed) or creates a new one after the UNSUBSCRIBE is done.
//!
//! After a reconnect the server has forgotten every subscription, and what
//! was published meanwhile is lost. The order of the repair matters: first
//! subscribe again (here, not through the client library's own task, which
//! would race the re-check and, on a cluster, does not restore sharded
//! channels), then tell the listeners to re-check. A leader finishing before
//! the new SUBSCRIBE is seen by the re-check; one finishing after, by the
//! message. A SUBSCRIBE or UNSUBSCRIBE whose effect is unknown (it timed
//! out) marks its channel uncertain, and a round every second reconciles
//! it with the server.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex, PoisonError, Weak},
    time::Duration,
};

use bytes::Bytes;
use fred::{clients::SubscriberClient, prelude::*};
use tokio::sync::broadcast;

use super::{
    breaker::Breaker,
    error::{guarded, RedisError},
};
use crate::telemetry::metrics;

/// Notices buffered per channel; a flight reads them as they come, and a lagging
/// listener only loses a wake-up it then replaces by a re-check.
const CHANNEL_BUFFER: usize = 8;

/// What a listener on a ready channel is told.
#[derive(Debug, Clone)]
pub enum Notice {
    /// A message published on the channel: the leader's outcome.
    Message(Bytes),
    /// Messages may have been lost (reconnect, lag): re-check the cache.
    Recheck,
}

struct Slot {
    /// Fan-out to the local listeners of this channel. broadcast, not watch:
    /// every message matters (a Recheck must not overwrite an outcome).
    sender: broadcast::Sender<Notice>,
    /// Whether the server has this channel subscribed. A tokio mutex because
    /// it is held across the SUBSCRIBE / UNSUBSCRIBE round trip.
    server_state: tokio::sync::Mutex<bool>,
}

struct Registered {
    refs: usize,
    slot: Arc<Slot>,
}

/// The process's shared subscriber.
pub struct Subscriber {
    client: SubscriberClient,
    /// A Redis Cluster: sharded pub/sub (SSUBSCRIBE), so a ready message only
    /// travels to the shard that owns the key.
    sharded: bool,
    timeout: Duration,
    /// The subscriber connection's own breaker: its failures say nothing of
    /// the command connections (on a cluster, the library's subscriber
    /// client holds every command while one primary is unreachable).
    breaker: Breaker,
    /// Channel name → slot. A std mutex: held only for map operations, never
    /// across an await, and taken by the message dispatcher for every message.
    slots: Mutex<HashMap<String, Registered>>,
    /// Channels whose server-side state is not known: a SUBSCRIBE or
    /// UNSUBSCRIBE that failed, timed out or was cancelled may still have
    /// run (or may not). Reconciled every RECONCILE_EVERY, so that the
    /// server never keeps a subscription nobody listens to. A std mutex:
    /// held only to insert or take.
    uncertain: Mutex<HashSet<String>>,
}

/// A local listener on one channel; dropping it releases the reference.
pub struct Subscription {
    owner: Arc<Subscriber>,
    channel: String,
    slot: Arc<Slot>,
    receiver: broadcast::Receiver<Notice>,
}

impl Subscriber {
    /// Wraps a connected (or connecting) subscriber client and starts the
    /// dispatcher and the re-subscription task.
    pub fn start(client: SubscriberClient, timeout: Duration) -> Arc<Self> {
        let this = Arc::new(Self {
            sharded: client.is_clustered(),
            client,
            timeout,
            breaker: Breaker::default(),
            slots: Mutex::new(HashMap::new()),
            uncertain: Mutex::default(),
        });
        tokio::spawn(reconcile_uncertain(Arc::downgrade(&this)));
        tokio::spawn(dispatch(Arc::downgrade(&this), this.client.message_rx()));
        tokio::spawn(resubscribe_on_reconnect(
            Arc::downgrade(&this),
            this.client.reconnect_rx(),
        ));
        this
    }

    pub fn client(&self) -> &SubscriberClient {
        &self.client
    }

    /// Channels with at least one local listener.
    pub fn channels(&self) -> usize {
        self.lock_slots().len()
    }

    fn lock_slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Registered>> {
        // A panic while holding this lock cannot leave the map inconsistent
        // (each critical section is a single insert, update or remove).
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Listens on `channel`; returns once the server has processed the
    /// subscription (see [`Subscriber::confirm`]).
    pub async fn subscribe(self: &Arc<Self>, channel: &str) -> Result<Subscription, RedisError> {
        let subscription = self.register(channel);
        let mut subscribed = subscription.slot.server_state.lock().await;
        if !*subscribed {
            // Uncertain until confirmed: the SUBSCRIBE may fail, time out or
            // be cancelled and still reach the server.
            self.set_uncertain(channel, true);
            // Boxed: the client library's futures make it 31 KB, which
            // every flight's task would carry (and copy when spawned) for a
            // step most flights never take, or take once per channel.
            let subscribe = Box::pin(self.server_subscribe(channel));
            guarded(&self.breaker, self.timeout, subscribe).await?;
            self.set_uncertain(channel, false);
            *subscribed = true;
            metrics::subscribed_channels(1.0);
        }
        drop(subscribed);
        Ok(subscription)
    }

    /// A local listener on `channel`, without touching the server.
    fn register(self: &Arc<Self>, channel: &str) -> Subscription {
        let (slot, receiver) = {
            let mut slots = self.lock_slots();
            let entry = slots
                .entry(channel.to_owned())
                .or_insert_with(|| Registered {
                    refs: 0,
                    slot: Arc::new(Slot {
                        sender: broadcast::channel(CHANNEL_BUFFER).0,
                        server_state: tokio::sync::Mutex::new(false),
                    }),
                });
            entry.refs += 1;
            // The receiver exists before the SUBSCRIBE is sent: nothing
            // published after the confirmation can be missed.
            (entry.slot.clone(), entry.slot.sender.subscribe())
        };
        // From here on, dropping the subscription releases the reference,
        // whether a SUBSCRIBE succeeds, fails or is cancelled.
        Subscription {
            owner: self.clone(),
            channel: channel.to_owned(),
            slot,
            receiver,
        }
    }

    fn set_uncertain(&self, channel: &str, uncertain: bool) {
        let mut set = self
            .uncertain
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if uncertain {
            set.insert(channel.to_owned());
        } else {
            set.remove(channel);
        }
    }

    /// Waits until the server has processed what was sent on the channel's
    /// connection: a PING answered there comes after the SUBSCRIBE (the
    /// client library answers a SUBSCRIBE once written, not once processed).
    async fn confirm(&self, channel: &str) -> Result<(), fred::error::Error> {
        if !self.sharded {
            return self.client.ping::<()>(None).await;
        }
        let slot = fred::util::redis_keyslot(channel.as_bytes());
        let node = self
            .client
            .cached_cluster_state()
            .and_then(|state| state.get_server(slot).cloned());
        match node {
            Some(server) => {
                let options = fred::types::config::Options {
                    cluster_node: Some(server),
                    ..Default::default()
                };
                self.client.with_options(&options).ping::<()>(None).await
            }
            // No topology yet: the SUBSCRIBE alone has to do.
            None => Ok(()),
        }
    }

    /// SUBSCRIBE (SSUBSCRIBE on a cluster), confirmed: returns once the
    /// server has processed it (see [`Subscriber::confirm`]).
    async fn server_subscribe(&self, channel: &str) -> Result<(), fred::error::Error> {
        if self.sharded {
            self.client.ssubscribe(channel).await?;
        } else {
            self.client.subscribe(channel).await?;
        }
        self.confirm(channel).await
    }

    /// UNSUBSCRIBE, or SUNSUBSCRIBE on a cluster.
    async fn server_unsubscribe(&self, channel: &str) -> Result<(), fred::error::Error> {
        if self.sharded {
            self.client.sunsubscribe(channel).await
        } else {
            self.client.unsubscribe(channel).await
        }
    }

    fn release(self: &Arc<Self>, channel: &str, slot: &Arc<Slot>) {
        {
            let mut slots = self.lock_slots();
            let Some(entry) = slots.get_mut(channel) else {
                return;
            };
            entry.refs -= 1;
            if entry.refs > 0 {
                return;
            }
        }
        let this = self.clone();
        let channel = channel.to_owned();
        let slot = slot.clone();
        tokio::spawn(async move {
            let mut subscribed = slot.server_state.lock().await;
            if this.refs_of(&channel, &slot) > 0 {
                return; // a new listener arrived: keep the subscription
            }
            if *subscribed {
                this.set_uncertain(&channel, true);
                let unsubscribe = this.server_unsubscribe(&channel);
                match tokio::time::timeout(this.timeout, unsubscribe).await {
                    Ok(Ok(())) => this.set_uncertain(&channel, false),
                    // Left uncertain: reconciled later.
                    Ok(Err(e)) => tracing::debug!(error = %e, channel, "unsubscribe failed"),
                    Err(_) => tracing::debug!(channel, "unsubscribe timed out"),
                }
                // Even on failure: the next listener subscribes again.
                *subscribed = false;
                metrics::subscribed_channels(-1.0);
            }
            let mut slots = this.lock_slots();
            if slots
                .get(&channel)
                .is_some_and(|e| e.refs == 0 && Arc::ptr_eq(&e.slot, &slot))
            {
                slots.remove(&channel);
            }
        });
    }

    fn refs_of(&self, channel: &str, slot: &Arc<Slot>) -> usize {
        self.lock_slots()
            .get(channel)
            .filter(|e| Arc::ptr_eq(&e.slot, slot))
            .map_or(0, |e| e.refs)
    }

    fn notify(&self, channel: &str, notice: Notice) {
        if let Some(entry) = self.lock_slots().get(channel) {
            // No receiver left is fine: the flight has just ended.
            let _ = entry.slot.sender.send(notice);
        }
    }

    fn notify_all(&self, notice: Notice) {
        for entry in self.lock_slots().values() {
            let _ = entry.slot.sender.send(notice.clone());
        }
    }
}

impl Subscription {
    /// The next notice on this channel. A lag turns into a re-check.
    pub async fn recv(&mut self) -> Notice {
        match self.receiver.recv().await {
            Ok(notice) => notice,
            Err(broadcast::error::RecvError::Lagged(_)) => Notice::Recheck,
            // The sender lives in the slot we hold an Arc to: it cannot close
            // while this subscription exists. Park instead of spinning.
            Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.owner.release(&self.channel, &self.slot);
    }
}

/// Routes every message of the shared connection to its channel's listeners.
async fn dispatch(
    owner: std::sync::Weak<Subscriber>,
    mut messages: broadcast::Receiver<fred::types::Message>,
) {
    loop {
        let received = messages.recv().await;
        let Some(owner) = owner.upgrade() else { return };
        match received {
            Ok(message) => {
                let Some(payload) = message.value.into_bytes() else {
                    tracing::warn!(channel = %message.channel, "ignored a non-binary ready message");
                    continue;
                };
                owner.notify(&message.channel, Notice::Message(payload));
            }
            Err(broadcast::error::RecvError::Lagged(lost)) => {
                tracing::warn!(lost, "subscriber lagged; waking every listener to re-check");
                owner.notify_all(Notice::Recheck);
            }
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// How often channels whose server-side state is uncertain are reconciled.
const RECONCILE_EVERY: Duration = Duration::from_secs(1);

impl Subscriber {
    /// A confirmed SUBSCRIBE bounded by REDIS_TIMEOUT (but not refused by
    /// the breaker): whether the server now has the channel.
    async fn subscribe_confirmed(&self, channel: &str) -> bool {
        let subscribe = self.server_subscribe(channel);
        matches!(
            tokio::time::timeout(self.timeout, subscribe).await,
            Ok(Ok(()))
        )
    }

    /// Makes the server's state of an uncertain channel match ours:
    /// subscribed while it has listeners, else not. Returns whether it did.
    async fn reconcile(self: &Arc<Self>, channel: &str) -> bool {
        // A reference of our own keeps the slot while we work on it.
        let mine = self.register(channel);
        let mut subscribed = mine.slot.server_state.lock().await;
        let listening = self.refs_of(channel, &mine.slot) > 1;
        let done = if listening && *subscribed {
            // Confirmed under this lock since the channel was marked: a
            // SUBSCRIBE in progress when this round took the set. Every
            // failure leaves the state false, so there is nothing to repair,
            // and a re-check would cost each listener an election.
            true
        } else if listening {
            let done = self.subscribe_confirmed(channel).await;
            if done {
                if !*subscribed {
                    *subscribed = true;
                    metrics::subscribed_channels(1.0);
                }
                // Messages published while it was not subscribed are lost.
                let _ = mine.slot.sender.send(Notice::Recheck);
            }
            done
        } else {
            let gone = tokio::time::timeout(self.timeout, self.server_unsubscribe(channel));
            let done = matches!(gone.await, Ok(Ok(())));
            if done && *subscribed {
                *subscribed = false;
                metrics::subscribed_channels(-1.0);
            }
            done
        };
        drop(subscribed);
        done
    }

    /// After a reconnect: subscribes again to every channel the server should
    /// have, each under its lock, then has its listeners re-check the cache.
    /// A channel that cannot be subscribed again now is left uncertain: the
    /// reconciliation subscribes it, and has its listeners re-check, later.
    async fn resubscribe(&self) {
        let slots: Vec<(String, Arc<Slot>)> = self
            .lock_slots()
            .iter()
            .map(|(channel, r)| (channel.clone(), r.slot.clone()))
            .collect();
        for (channel, slot) in slots {
            let mut subscribed = slot.server_state.lock().await;
            if *subscribed && !self.subscribe_confirmed(&channel).await {
                tracing::warn!(
                    channel,
                    "re-subscribing after a reconnect failed; reconciling"
                );
                *subscribed = false;
                metrics::subscribed_channels(-1.0);
                self.set_uncertain(&channel, true);
            }
            drop(subscribed);
            let _ = slot.sender.send(Notice::Recheck);
        }
    }
}

/// Every RECONCILE_EVERY, reconciles the channels whose server-side state
/// is uncertain; those that fail stay for the next round.
async fn reconcile_uncertain(owner: Weak<Subscriber>) {
    let mut every = tokio::time::interval(RECONCILE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(owner) = owner.upgrade() else { return };
        let channels: Vec<String> = owner
            .uncertain
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .collect();
        for channel in channels {
            if !owner.reconcile(&channel).await {
                owner.set_uncertain(&channel, true);
            }
        }
    }
}

/// After a reconnect: subscribe again, then re-check (see the module doc).
async fn resubscribe_on_reconnect(
    owner: Weak<Subscriber>,
    mut reconnects: broadcast::Receiver<fred::types::config::Server>,
) {
    loop {
        let received = reconnects.recv().await;
        let Some(owner) = owner.upgrade() else { return };
        match received {
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => owner.resubscribe().await,
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use fred::{prelude::*, types::config::Config};

    use super::{Notice, Subscriber};

    async fn subscriber() -> std::sync::Arc<Subscriber> {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let client = Builder::from_config(Config::from_url(&url).unwrap())
            .build_subscriber_client()
            .unwrap();
        client.init().await.expect("the tests' Redis is up");
        Subscriber::start(client, Duration::from_secs(2))
    }

    /// The round that reconciles uncertain channels can take a channel
    /// whose SUBSCRIBE is still in progress, and get its lock once that
    /// SUBSCRIBE is confirmed. It must leave the listener alone: a re-check
    /// would send the flight back to an election the leader still holds.
    #[tokio::test]
    async fn a_round_that_met_a_subscribe_in_progress_leaves_its_listener_alone() {
        let owner = subscriber().await;
        let channel = format!("postcache:upkeep:{:016x}:ready", rand::random::<u64>());
        let mut listener = owner.subscribe(&channel).await.unwrap();
        // What the round finds: marked while the SUBSCRIBE ran, confirmed since.
        owner.set_uncertain(&channel, true);
        assert!(owner.reconcile(&channel).await);

        let publisher = Client::new(owner.client().client_config(), None, None, None);
        publisher.init().await.unwrap();
        let _: i64 = publisher.publish(&channel, "done").await.unwrap();
        let notice = tokio::time::timeout(Duration::from_secs(2), listener.recv()).await;
        match notice {
            Ok(Notice::Message(payload)) => assert_eq!(payload.as_ref(), b"done"),
            other => panic!("expected the message first, got {other:?}"),
        }
    }

    /// A channel the server lost (a re-subscription failed after a
    /// reconnect) is subscribed again, and its listeners re-check.
    #[tokio::test]
    async fn a_round_subscribes_a_lost_channel_again_and_has_its_listeners_recheck() {
        let owner = subscriber().await;
        let channel = format!("postcache:upkeep:{:016x}:ready", rand::random::<u64>());
        let mut listener = owner.subscribe(&channel).await.unwrap();
        let slot = owner.lock_slots().get(&channel).unwrap().slot.clone();
        *slot.server_state.lock().await = false;
        owner.set_uncertain(&channel, true);
        assert!(owner.reconcile(&channel).await);
        let notice = tokio::time::timeout(Duration::from_secs(2), listener.recv()).await;
        assert!(matches!(notice, Ok(Notice::Recheck)), "{notice:?}");
        assert!(*slot.server_state.lock().await);
    }
}
