//! The Redis side: keeping the server's subscriptions right, after a
//! reconnect (subscribe again, then re-check) and after a SUBSCRIBE or
//! UNSUBSCRIBE whose effect is unknown (reconcile).

use std::{
    sync::{Arc, PoisonError, Weak},
    time::Duration,
};

use tokio::sync::broadcast;

use super::{Notice, Slot, Subscriber};
use crate::telemetry::metrics;

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
pub(super) async fn reconcile_uncertain(owner: Weak<Subscriber>) {
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
pub(super) async fn resubscribe_on_reconnect(
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

    use super::super::{Notice, Subscriber};

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
