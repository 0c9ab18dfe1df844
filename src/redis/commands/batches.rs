//! The Redis side: how each kind of command a node batches goes out (see
//! `coalesce.rs`). Lookups as an MGET (GETs sent at once on a cluster
//! node); claims and finishes as one call of their script for many items;
//! value claims as SETs sent at once. A command whose caller went away
//! before its batch was sent is not sent, and a lock taken for a caller
//! gone while its batch ran is let go.

use std::{collections::HashMap, sync::Arc, time::Duration};

use fred::types::Value;

use super::RedisCommands;
use crate::redis::{
    coalesce::{again, Batched, Coalescer},
    nodes::Node,
    queued::{QueuedClaim, QueuedFinish, QueuedGet, QueuedValueClaim},
    scripts::{ClaimKeys, FinishMany, LockOp, OnLock},
    ValueClaim,
};

/// What every kind batched on a node says alike: the node holds its queue
/// (the field named), the commands send it, and a batch holds at most
/// `max` commands.
macro_rules! queued_on_node {
    ($queue:ident, $max:expr) => {
        type Node = Node;
        type Sender = RedisCommands;

        const MAX_BATCH: usize = $max;

        fn queue(node: &Node) -> &Coalescer<Self> {
            &node.$queue
        }
    };
}

impl Batched for QueuedGet {
    queued_on_node!(gets, 256);

    /// Lookups whose callers went away meanwhile are not read at all.
    fn gone(&self) -> bool {
        self.reply.is_closed()
    }

    /// Each key once (a stampede queues the same key many times).
    async fn send(commands: &RedisCommands, node: &Arc<Node>, batch: Vec<Self>) {
        let mut names: Vec<&str> = Vec::with_capacity(batch.len());
        let mut seen: HashMap<&str, usize> = HashMap::with_capacity(batch.len());
        let at: Vec<usize> = batch
            .iter()
            .map(|q| {
                *seen.entry(q.key.as_str()).or_insert_with(|| {
                    names.push(q.key.as_str());
                    names.len() - 1
                })
            })
            .collect();
        let answers = commands.read_node(node, &names).await;
        drop((names, seen));
        for (queued, at) in batch.into_iter().zip(at) {
            let looked = match &answers[at] {
                Ok(raw) => Ok(raw.clone()),
                Err(error) => Err(again(error)),
            };
            let _ = queued.reply.send(looked);
        }
    }
}

impl Batched for QueuedClaim {
    queued_on_node!(claims, 64);

    /// A claim whose caller went away before it was sent is not sent.
    fn gone(&self) -> bool {
        self.reply.is_closed()
    }

    /// A claim whose caller went away while the batch ran lets go of the
    /// lock it took (token-checked), so that no lock is left that nobody
    /// holds (the caller's own guard may have released before the lock was
    /// taken).
    async fn send(commands: &RedisCommands, _node: &Arc<Node>, batch: Vec<Self>) {
        let items: Vec<(&ClaimKeys, &str, Duration)> = batch
            .iter()
            .map(|q| (&q.keys, q.token.as_str(), q.ttl))
            .collect();
        let answers = commands.claim_batch(&items).await;
        drop(items);
        for (queued, claimed) in batch.into_iter().zip(answers) {
            let took = matches!(claimed, Ok(Some(_)));
            if queued.reply.send(claimed).is_err() && took {
                let_go(commands, &queued.keys.lock, &queued.token).await;
            }
        }
    }
}

impl Batched for QueuedValueClaim {
    // As many as a batch of lookups: every request's first look is one.
    queued_on_node!(value_claims, QueuedGet::MAX_BATCH);

    /// As for [`QueuedClaim`]: not sent if its caller went away first.
    fn gone(&self) -> bool {
        self.reply.is_closed()
    }

    /// As for [`QueuedClaim`]: let go of (token-checked) if its caller went
    /// away while the batch ran.
    async fn send(commands: &RedisCommands, _node: &Arc<Node>, batch: Vec<Self>) {
        let items: Vec<(&str, Option<&str>, &str, Duration)> = batch
            .iter()
            .map(|q| {
                (
                    q.value.as_str(),
                    q.fence.as_deref(),
                    q.claim.as_str(),
                    q.ttl,
                )
            })
            .collect();
        let answers = commands.claim_values(&items).await;
        drop(items);
        for (queued, claimed) in batch.into_iter().zip(answers) {
            let took = matches!(claimed, Ok(ValueClaim::Won { .. }));
            if took && !queued.reply.is_closed() {
                if let Some(on_won) = queued.on_won {
                    on_won();
                }
            }
            if queued.reply.send(claimed).is_err() && took {
                let_go(commands, &queued.value, &queued.claim).await;
            }
        }
    }
}

impl Batched for QueuedFinish {
    queued_on_node!(finishes, 64);

    async fn send(commands: &RedisCommands, _node: &Arc<Node>, batch: Vec<Self>) {
        let items: Vec<(&[String], &[Value])> = batch
            .iter()
            .map(|q| (q.keys.as_slice(), q.args.as_slice()))
            .collect();
        let replies = commands.eval(&FinishMany { items: &items }).await;
        drop(items);
        match replies {
            Ok(replies) => {
                for (queued, reply) in batch.into_iter().zip(replies) {
                    let _ = queued.reply.send(Ok(reply));
                }
            }
            Err(error) => {
                for queued in batch {
                    let _ = queued.reply.send(Err(again(&error)));
                }
            }
        }
    }
}

/// Lets go of a lock (or a claim in a value key) that a batch took for a
/// caller gone meanwhile, token-checked, so that none is left that nobody
/// holds (the caller's own guard may have released before it was taken).
async fn let_go(commands: &RedisCommands, lock: &str, token: &str) {
    let release = OnLock {
        lock,
        token,
        op: LockOp::Release,
    };
    if let Ok(true) = commands.eval(&release).await {
        tracing::info!(lock, "released a lock taken after its caller gave up");
    }
}

/// Against the Redis the tests use (REDIS_URL, else the local one), under
/// a key prefix of this test's own.
#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use std::time::Duration;
    use tokio::sync::oneshot;

    use fred::prelude::*;

    use super::*;
    use crate::{
        cache::{ItemKeys, Keys},
        redis::{
            coalesce::{queued_reply, Turn},
            scripts::contract::redis,
        },
    };

    /// The answer of a command queued behind a turn the test holds.
    fn queued<Q: Batched, T>(turn: Turn<'_, Q, T>) -> T {
        match turn {
            Turn::Queued(answer) => answer,
            Turn::Lead(_) => panic!("the turn is held"),
        }
    }

    #[tokio::test]
    async fn a_claim_whose_caller_went_away_before_it_was_sent_takes_no_lock() {
        let (client, prefix) = redis().await;
        let commands = RedisCommands::new(client.clone(), Duration::from_secs(1));
        let names = Keys::new(prefix, "post");
        let (gone, kept) = (names.item(1), names.item(2));
        let node = commands.node_of(&gone.lock);
        // The turn held, as by a claim in flight: the next ones queue.
        let Turn::Lead(baton) = node.claims.turn::<()>(&commands, &node, || unreachable!()) else {
            panic!("the turn was free");
        };
        let queue = |keys: &ItemKeys, token: &str| {
            queued(node.claims.turn(&commands, &node, || {
                let (reply, answer) = oneshot::channel();
                let claim = QueuedClaim {
                    keys: ClaimKeys::of(keys),
                    token: token.to_owned(),
                    ttl: Duration::from_secs(60),
                    reply,
                };
                (claim, answer)
            }))
        };
        let gone_answer = queue(&gone, "a");
        let kept_answer = queue(&kept, "b");
        drop(gone_answer);
        // The claim in flight is answered: the queued ones go out.
        drop(baton);
        let claimed = queued_reply(commands.timeout(), kept_answer).await.unwrap();
        assert!(claimed.is_some());
        let holder: Option<String> = client.get(&kept.lock).await.unwrap();
        assert_eq!(holder.as_deref(), Some("b"));
        let holder: Option<String> = client.get(&gone.lock).await.unwrap();
        assert_eq!(holder, None, "a claim nobody waits for took a lock");
        let _: i64 = client.del(&kept.lock).await.unwrap();
    }

    #[tokio::test]
    async fn queued_value_claims_go_in_one_pipeline_and_one_whose_caller_left_takes_nothing() {
        // Which claims' `on_won` ran, in order.
        let ran = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (client, prefix) = redis().await;
        let commands = RedisCommands::new(client.clone(), Duration::from_secs(1));
        let names = Keys::new(prefix, "post");
        let (gone, kept, held, stored) =
            (names.item(1), names.item(2), names.item(3), names.item(4));
        let _: () = client
            .set(&held.value, "\0claim:other", None, None, false)
            .await
            .unwrap();
        let _: () = client
            .set(&stored.value, "an entry", None, None, false)
            .await
            .unwrap();
        let node = commands.node_of(&gone.value);
        let Turn::Lead(baton) = node
            .value_claims
            .turn::<()>(&commands, &node, || unreachable!())
        else {
            panic!("the turn was free");
        };
        let queue = |keys: &ItemKeys, claim: &str| {
            queued(node.value_claims.turn(&commands, &node, || {
                let (reply, answer) = oneshot::channel();
                let (ran, name) = (ran.clone(), claim.to_owned());
                let claim = QueuedValueClaim {
                    value: keys.value.clone(),
                    fence: Some(keys.fence.clone()),
                    claim: claim.to_owned(),
                    ttl: Duration::from_secs(60),
                    on_won: Some(Box::new(move || ran.lock().unwrap().push(name))),
                    reply,
                };
                (claim, answer)
            }))
        };
        let gone_answer = queue(&gone, "\0claim:a");
        let kept_answer = queue(&kept, "\0claim:b");
        let held_answer = queue(&held, "\0claim:c");
        let stored_answer = queue(&stored, "\0claim:d");
        drop(gone_answer);
        drop(baton);
        let claimed = queued_reply(commands.timeout(), kept_answer).await.unwrap();
        assert_eq!(
            claimed,
            ValueClaim::Won {
                fence: String::new()
            }
        );
        let claimed = queued_reply(commands.timeout(), held_answer).await.unwrap();
        assert_eq!(claimed, ValueClaim::Held);
        let claimed = queued_reply(commands.timeout(), stored_answer)
            .await
            .unwrap();
        assert_eq!(claimed, ValueClaim::Stored(Bytes::from_static(b"an entry")));
        // Only the won claim whose caller waited ran its hook.
        assert_eq!(*ran.lock().unwrap(), ["\0claim:b"]);
        let value: Option<String> = client.get(&kept.value).await.unwrap();
        assert_eq!(value.as_deref(), Some("\0claim:b"));
        let value: Option<String> = client.get(&gone.value).await.unwrap();
        assert_eq!(value, None, "a claim nobody waits for was taken");
        let _: i64 = client
            .del(vec![
                kept.value.clone(),
                held.value.clone(),
                stored.value.clone(),
            ])
            .await
            .unwrap();
    }
}
