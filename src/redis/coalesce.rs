//! The Redis side: natural batching of a node's commands of one kind (its
//! lookups, its claims). While one such command is in flight on a node,
//! later ones queue; when it is answered, the queue goes out as one round
//! trip (an MGET, one script call for many items, a pipeline), up to a
//! bound per kind. At low load nothing waits: a command on an idle node is
//! sent at once, alone. Under load the round trips, and the commands Redis
//! parses and the scripts it starts, fall towards one per batch.
//!
//! Whoever holds the node's turn (a caller sending its own command, or a
//! task sending a batch) holds a [`Baton`]. Dropping it, answered or not (a
//! request that went away mid-command), hands the turn on: a task is
//! spawned for the queued commands, or the node is marked idle for the
//! kind. A queued caller waits at most [`QUEUED_LIMIT`] REDIS_TIMEOUTs: the
//! command ahead of it and its own batch, each bounded by one.

use std::{
    future::Future,
    mem,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use super::error::RedisError;

/// Longest a queued command waits, in REDIS_TIMEOUTs (see the module's comment).
pub(super) const QUEUED_LIMIT: u32 = 2;

/// A kind of command that a node batches: a queued command with the sender
/// of its reply.
///
/// Generic over where a batch goes and what sends it, so that batching
/// knows nothing of nodes or commands: the kinds are the commands' own
/// (`commands/batches.rs`).
pub(super) trait Batched: Sized + Send + 'static {
    /// What holds the kind's queue and serves the batch (a node).
    type Node: Send + Sync + 'static;
    /// What sends a batch (the commands, with their bounds).
    type Sender: Clone + Send + Sync + 'static;

    /// Most commands in one batch.
    const MAX_BATCH: usize;

    /// The kind's queue on `node`.
    fn queue(node: &Self::Node) -> &Coalescer<Self>;

    /// Whether the command's caller went away before its batch was sent:
    /// such a command is not sent (see [`Baton`]'s drop). By default every
    /// command is sent.
    fn gone(&self) -> bool {
        false
    }

    /// Sends `batch` (all served by `node`, none [`Batched::gone`]) and
    /// answers each command.
    fn send(
        sender: &Self::Sender,
        node: &Arc<Self::Node>,
        batch: Vec<Self>,
    ) -> impl Future<Output = ()> + Send;
}

/// A node's queue of one kind of command: whether its turn is held, and
/// who waits for the next.
pub(super) struct Coalescer<Q> {
    /// A std mutex: held only to queue or take commands, never across an await.
    state: Mutex<State<Q>>,
}

struct State<Q> {
    busy: bool,
    queued: Vec<Q>,
}

impl<Q> Default for Coalescer<Q> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                busy: false,
                queued: Vec::new(),
            }),
        }
    }
}

/// A caller's place: the turn (send its command now), or `T`, what it
/// keeps of the command it queued (the receiver of its reply).
pub(super) enum Turn<'a, Q: Batched, T> {
    Lead(Baton<'a, Q>),
    Queued(T),
}

impl<Q: Batched> Coalescer<Q> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State<Q>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the turn if it is free; else queues the command `queued` makes
    /// and returns what it keeps.
    pub fn turn<'a, T>(
        &self,
        commands: &'a Q::Sender,
        node: &Arc<Q::Node>,
        queued: impl FnOnce() -> (Q, T),
    ) -> Turn<'a, Q, T> {
        let mut state = self.lock();
        if !state.busy {
            state.busy = true;
            return Turn::Lead(Baton {
                commands,
                node: node.clone(),
                _kind: std::marker::PhantomData,
            });
        }
        let (command, kept) = queued();
        state.queued.push(command);
        Turn::Queued(kept)
    }

    /// The next batch, at most `Q::MAX_BATCH`, the oldest first; empty (and
    /// the turn free) when none waits.
    fn next_batch(&self) -> Vec<Q> {
        let mut state = self.lock();
        if state.queued.is_empty() {
            state.busy = false;
            return Vec::new();
        }
        if state.queued.len() <= Q::MAX_BATCH {
            return mem::take(&mut state.queued);
        }
        let rest = state.queued.split_off(Q::MAX_BATCH);
        mem::replace(&mut state.queued, rest)
    }

    /// Lets the turn go with nothing sent for those queued: each is
    /// answered with a failure (its sender dropped).
    fn abandon(&self) {
        let mut state = self.lock();
        state.busy = false;
        state.queued.clear();
    }

    /// Whether the turn is held, and how many wait (for tests).
    #[cfg(test)]
    pub fn waiting(&self) -> (bool, usize) {
        let state = self.lock();
        (state.busy, state.queued.len())
    }
}

/// The turn of a node's commands of kind `Q`; dropping it hands the turn
/// on (see the module's comment).
pub(super) struct Baton<'a, Q: Batched> {
    commands: &'a Q::Sender,
    node: Arc<Q::Node>,
    _kind: std::marker::PhantomData<fn(Q)>,
}

impl<Q: Batched> Drop for Baton<'_, Q> {
    fn drop(&mut self) {
        let queue = Q::queue(&self.node);
        if std::thread::panicking() {
            queue.abandon();
            return;
        }
        let batch = queue.next_batch();
        if batch.is_empty() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let (commands, node) = (self.commands.clone(), self.node.clone());
                runtime.spawn(async move {
                    let _baton = Baton::<Q> {
                        commands: &commands,
                        node: node.clone(),
                        _kind: std::marker::PhantomData,
                    };
                    // The commands whose callers went away are dropped
                    // here, under the baton above, which hands the turn on
                    // whether anything is sent or not.
                    let mut batch = batch;
                    batch.retain(|queued| !queued.gone());
                    if !batch.is_empty() {
                        Q::send(&commands, &node, batch).await;
                    }
                });
            }
            // No runtime to send them from (it is shutting down).
            Err(_) => queue.abandon(),
        }
    }
}

/// `error` again, for each command of a batch that met it.
pub(super) fn again(error: &RedisError) -> RedisError {
    match error {
        RedisError::Timeout(limit) => RedisError::Timeout(*limit),
        RedisError::CircuitOpen => RedisError::CircuitOpen,
        RedisError::Command(e) => RedisError::Command(e.clone()),
        RedisError::Reply(name) => RedisError::Reply(name),
        RedisError::Abandoned => RedisError::Abandoned,
    }
}

/// A queued command's reply, waited for at most [`QUEUED_LIMIT`]
/// REDIS_TIMEOUTs.
/// `timeout` is REDIS_TIMEOUT.
pub(super) async fn queued_reply<R>(
    timeout: Duration,
    reply: tokio::sync::oneshot::Receiver<Result<R, RedisError>>,
) -> Result<R, RedisError> {
    let limit = timeout * QUEUED_LIMIT;
    match tokio::time::timeout(limit, reply).await {
        Ok(Ok(reply)) => reply,
        // The batch's task ended without answering (shutdown).
        Ok(Err(_)) => Err(RedisError::Abandoned),
        Err(_) => {
            crate::telemetry::metrics::redis_error("timeout");
            Err(RedisError::Timeout(limit))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use fred::prelude::*;
    use tokio::sync::oneshot;

    use super::*;
    use crate::redis::{queued::QueuedGet, RedisCommands};

    fn commands() -> RedisCommands {
        let client = Builder::default_centralized().build().unwrap();
        RedisCommands::new(client, Duration::from_millis(50))
    }

    fn get(
        key: &str,
    ) -> impl FnOnce() -> (
        QueuedGet,
        oneshot::Receiver<Result<Option<bytes::Bytes>, RedisError>>,
    ) {
        let key = key.to_owned();
        move || {
            let (reply, answer) = oneshot::channel();
            (QueuedGet { key, reply }, answer)
        }
    }

    #[tokio::test]
    async fn the_first_command_leads_and_the_rest_queue_until_it_lets_go() {
        let commands = commands();
        let node = commands.node_of("k");
        let first = node.gets.turn(&commands, &node, get("a"));
        assert!(matches!(first, Turn::Lead(_)));
        let Turn::Queued(answer) = node.gets.turn(&commands, &node, get("b")) else {
            panic!("a second lookup must queue");
        };
        assert_eq!(node.gets.waiting(), (true, 1));
        // The leader goes away unanswered: the queued key is sent by a task
        // of its own (to a client never connected: it fails, but it is
        // answered, within the bound).
        drop(first);
        let looked = queued_reply(commands.timeout(), answer).await;
        assert!(looked.is_err());
        // The turn is free again.
        tokio::time::timeout(Duration::from_secs(5), async {
            while node.gets.waiting() != (false, 0) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap();
        assert!(matches!(
            node.gets.turn(&commands, &node, get("c")),
            Turn::Lead(_)
        ));
    }

    #[test]
    fn a_long_queue_goes_out_in_bounded_batches_oldest_first() {
        let gets = Coalescer::<QueuedGet>::default();
        let max = QueuedGet::MAX_BATCH;
        let mut answers = Vec::new();
        {
            let mut state = gets.lock();
            state.busy = true;
            for at in 0..(max + 10) {
                let (command, answer) = get(&at.to_string())();
                answers.push(answer);
                state.queued.push(command);
            }
        }
        let first = gets.next_batch();
        assert_eq!(first.len(), max);
        assert_eq!(first[0].key, "0");
        let second = gets.next_batch();
        assert_eq!(second.len(), 10);
        assert_eq!(second[0].key, max.to_string());
        assert!(gets.next_batch().is_empty());
        assert_eq!(gets.waiting(), (false, 0));
    }

    #[test]
    fn errors_are_repeated_for_each_command_of_a_batch() {
        for error in [
            RedisError::Timeout(Duration::from_millis(5)),
            RedisError::CircuitOpen,
            RedisError::Reply("claim"),
            RedisError::Abandoned,
        ] {
            assert_eq!(again(&error).to_string(), error.to_string());
        }
    }
}
