//! The Redis side: where the commands on a key go, and the circuit breaker
//! that guards them.
//!
//! A single Redis: one client, one breaker. A Redis Cluster: a client and a
//! breaker per primary, found from the key's hash slot. Per breaker, so that
//! one shard's outage bypasses that shard's keys only. Per client, because
//! the client library's cluster client re-initialises every connection when
//! one drops, and holds every command until all its primaries answer: while
//! a dead master waits for its replica's promotion, the healthy shards would
//! be unreachable too. A client of its own per primary keeps each shard's
//! commands independent of the others'. The cluster client stays for what
//! it does well: reading the topology, and following it (after a failover,
//! on a MOVED); the nodes follow its view, and a failover moves the failed
//! slots to the promoted node's client and breaker (closed).

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, PoisonError, RwLock, Weak,
    },
    time::Duration,
};

use fred::{
    prelude::*,
    types::{
        cluster::{ClusterRouting, SlotRange},
        config::Server,
    },
};
use tokio::sync::broadcast;
use tokio_util::task::AbortOnDropHandle;

use super::{
    breaker::{Breaker, State},
    coalesce::Coalescer,
    queued::{QueuedClaim, QueuedFinish, QueuedGet, QueuedValueClaim},
    replicas::Durable,
    scripts::{self, Scripts},
};
use crate::telemetry::metrics;

/// Longest a client of a node that left the topology is given to QUIT, and
/// a re-read of the topology to finish.
const QUIT_LIMIT: Duration = Duration::from_secs(2);

/// One destination of commands: a client and its breaker.
pub struct Node {
    pub client: Client,
    pub breaker: Breaker,
    /// Its lookups, claims and finishes, each batched (see `coalesce.rs`).
    pub(super) gets: Coalescer<QueuedGet>,
    pub(super) claims: Coalescer<QueuedClaim>,
    pub(super) value_claims: Coalescer<QueuedValueClaim>,
    pub(super) finishes: Coalescer<QueuedFinish>,
    /// Tasks that stop with the node: the upkeep (the scripts loaded on each
    /// of the client's new connections, then the breaker closed) and, for a
    /// cluster node's own client, its connection (aborted even while it
    /// reconnects to a node that is gone).
    tasks: std::sync::Mutex<Vec<AbortOnDropHandle<()>>>,
    connection: std::sync::Mutex<Option<AbortOnDropHandle<Result<(), fred::error::Error>>>>,
    /// Its connection for WAIT (`replicas.rs`), made when first needed:
    /// only the decoding instance has one.
    durable: tokio::sync::OnceCell<Durable>,
}

impl Node {
    fn new(client: Client) -> Arc<Self> {
        Arc::new(Self {
            client,
            breaker: Breaker::default(),
            gets: Coalescer::default(),
            claims: Coalescer::default(),
            value_claims: Coalescer::default(),
            finishes: Coalescer::default(),
            tasks: std::sync::Mutex::default(),
            connection: std::sync::Mutex::default(),
            durable: tokio::sync::OnceCell::new(),
        })
    }

    fn hold(&self, task: AbortOnDropHandle<()>) {
        self.tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(task);
    }

    /// Whether every write this process made to this node before the call
    /// has reached one of its replicas (see `replicas.rs`), waiting at most
    /// `limit`.
    pub(super) async fn replicated(
        &self,
        key: &str,
        limit: Duration,
        timeout: Duration,
    ) -> Result<bool, fred::error::Error> {
        let durable = self
            .durable
            .get_or_try_init(|| Durable::connect(&self.client, timeout))
            .await?;
        durable.replicated(key, limit, timeout).await
    }

    /// Starts the upkeep of this node's connections; before the client
    /// connects, so that its first connection is seen too.
    fn keep(self: &Arc<Self>, scripts: &Scripts, timeout: Duration, of_cluster: bool) {
        let node = Arc::downgrade(self);
        let reconnects = self.client.reconnect_rx();
        let client = self.client.clone();
        let kind = if of_cluster {
            scripts::Server::ClusterNode
        } else {
            scripts::Server::Single
        };
        let task = scripts::keep_loaded(
            scripts.clone(),
            client,
            kind,
            reconnects,
            timeout,
            move |_| {
                if let Some(node) = node.upgrade() {
                    node.breaker.reconnected();
                }
            },
        );
        self.hold(AbortOnDropHandle::new(tokio::spawn(task)));
    }

    /// Connects this node's own client, reconnecting until the node stops.
    fn connect(&self) {
        let connection = AbortOnDropHandle::new(self.client.connect());
        *self
            .connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(connection);
    }

    /// QUIT, bounded, then stops the node's tasks (a client still
    /// reconnecting to a node that is gone would never read the QUIT).
    async fn stop(&self) {
        if let Some(durable) = self.durable.get() {
            durable.stop(QUIT_LIMIT).await;
        }
        let _ = tokio::time::timeout(QUIT_LIMIT, self.client.quit()).await;
        self.connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        self.tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

/// Makes the client of a newly seen primary.
type Connect = Box<dyn Fn(&Server) -> anyhow::Result<Client> + Send + Sync>;

/// The destinations of one process's commands.
pub struct Nodes {
    /// A single Redis; on a cluster, the cluster client (it routes by
    /// itself), for keys whose node is not known yet.
    default: Arc<Node>,
    /// On a cluster: makes a client for a primary.
    connect: Option<Connect>,
    /// A std lock: read on every command, written on a topology change.
    routes: RwLock<Routes>,
    /// A re-read of the topology asked for after a MOVED is running.
    resyncing: Arc<AtomicBool>,
    /// The nodes whose breaker the metrics reported last (see `report`).
    reported: std::sync::Mutex<Vec<String>>,
}

#[derive(Default)]
struct Routes {
    /// (first slot, last slot, its primary), sorted.
    ranges: Vec<(u16, u16, Arc<Node>)>,
    /// Kept across topology changes, so that a node keeps its connection
    /// and its breaker's state.
    nodes: HashMap<Server, Arc<Node>>,
}

impl Nodes {
    /// A single Redis.
    pub fn single(client: Client) -> Self {
        Self {
            default: Node::new(client),
            connect: None,
            routes: RwLock::default(),
            resyncing: Arc::default(),
            reported: std::sync::Mutex::default(),
        }
    }

    /// A Redis Cluster: `cluster` reads the topology, `connect` makes the
    /// client of each primary.
    pub fn cluster(
        cluster: Client,
        connect: impl Fn(&Server) -> anyhow::Result<Client> + Send + Sync + 'static,
    ) -> Self {
        Self {
            default: Node::new(cluster),
            connect: Some(Box::new(connect)),
            routes: RwLock::default(),
            resyncing: Arc::default(),
            reported: std::sync::Mutex::default(),
        }
    }

    fn routes(&self) -> std::sync::RwLockReadGuard<'_, Routes> {
        self.routes.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Where the commands on `key` go.
    pub fn for_key(&self, key: &str) -> Arc<Node> {
        if self.connect.is_none() {
            return self.default.clone();
        }
        let slot = ClusterRouting::hash_key(key.as_bytes());
        let routes = self.routes();
        let i = routes.ranges.partition_point(|(_, last, _)| *last < slot);
        match routes.ranges.get(i) {
            Some((first, _, node)) if *first <= slot => node.clone(),
            _ => self.default.clone(),
        }
    }

    /// A node answered MOVED: its slot has moved (a resharding, or a
    /// failover not seen yet). Has the cluster client re-read the topology,
    /// one re-read at a time; the nodes follow it (see [`keep`]).
    pub fn moved(&self) {
        if self.connect.is_none() || self.resyncing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (client, resyncing) = (self.default.client.clone(), self.resyncing.clone());
        tokio::spawn(async move {
            let _ = tokio::time::timeout(QUIT_LIMIT, client.sync_cluster()).await;
            resyncing.store(false, Ordering::Release);
        });
    }

    /// The cluster client (the one client of a single Redis).
    pub fn default_client(&self) -> &Client {
        &self.default.client
    }

    /// The clients of a cluster's primaries, as last seen (none for a
    /// single Redis, or before the topology is known).
    pub fn primary_clients(&self) -> Vec<Client> {
        self.routes()
            .nodes
            .values()
            .map(|node| node.client.clone())
            .collect()
    }

    /// Follows a new cluster topology: each slot range to its primary, with
    /// a new client for a primary not seen before. Returns the nodes it
    /// made, and those that left (their clients are the caller's to QUIT).
    fn route(&self, slots: &[SlotRange]) -> (Vec<Arc<Node>>, Vec<Arc<Node>>) {
        let Some(connect) = &self.connect else {
            return (Vec::new(), Vec::new());
        };
        let mut routes = self.routes.write().unwrap_or_else(PoisonError::into_inner);
        let mut old = std::mem::take(&mut routes.nodes);
        let mut made = Vec::new();
        let mut ranges = Vec::with_capacity(slots.len());
        for range in slots {
            let node = match routes.nodes.get(&range.primary) {
                Some(node) => node.clone(),
                None => {
                    let node = match old.remove(&range.primary) {
                        Some(node) => node,
                        None => match connect(&range.primary) {
                            Ok(client) => {
                                let node = Node::new(client);
                                made.push(node.clone());
                                node
                            }
                            Err(error) => {
                                tracing::warn!(%error, server = %range.primary, "cannot make a client for a cluster node");
                                continue;
                            }
                        },
                    };
                    routes.nodes.insert(range.primary.clone(), node.clone());
                    node
                }
            };
            ranges.push((range.start, range.end, node));
        }
        ranges.sort_by_key(|(first, _, _)| *first);
        routes.ranges = ranges;
        (made, old.into_values().collect())
    }

    /// The worst state among the breakers in use: open, else half-open,
    /// else closed.
    pub fn state(&self) -> State {
        let routes = self.routes();
        // Once the nodes are known, the default one carries almost nothing.
        let in_use: Vec<&Arc<Node>> = if routes.nodes.is_empty() {
            vec![&self.default]
        } else {
            routes.nodes.values().collect()
        };
        in_use
            .into_iter()
            .map(|node| node.breaker.state())
            .max_by_key(|state| match state {
                State::Closed => 0,
                State::HalfOpen => 1,
                State::Open => 2,
            })
            .unwrap_or(State::Closed)
    }

    /// At shutdown: stops the clients of a cluster's nodes (the cluster
    /// client, or the one client of a single Redis, is the caller's).
    pub async fn stop(&self) {
        let nodes: Vec<Arc<Node>> = self.routes().nodes.values().cloned().collect();
        for node in nodes {
            node.stop().await;
        }
    }

    /// Reports [`Nodes::state`] in the metrics, and each node's breaker by
    /// its address (a single Redis's, or each cluster primary's once they
    /// are known; `cluster` before). A node gone from the topology is
    /// reported closed once, so that its last state does not stand for
    /// ever.
    pub fn report(&self) {
        metrics::breaker_state(self.state() as u8 as f64);
        let routes = self.routes();
        let mut states: HashMap<String, State> = HashMap::new();
        if routes.nodes.is_empty() {
            let name = match self.default.client.client_config().server {
                fred::types::config::ServerConfig::Centralized { server } => server.to_string(),
                _ => "cluster".to_owned(),
            };
            states.insert(name, self.default.breaker.state());
        } else {
            for (server, node) in &routes.nodes {
                states.insert(server.to_string(), node.breaker.state());
            }
        }
        drop(routes);
        let mut reported = self.reported.lock().unwrap_or_else(PoisonError::into_inner);
        for gone in reported.iter().filter(|name| !states.contains_key(*name)) {
            metrics::node_breaker_state(gone.clone(), State::Closed as u8 as f64);
        }
        reported.clear();
        for (name, state) in states {
            metrics::node_breaker_state(name.clone(), state as u8 as f64);
            reported.push(name);
        }
    }
}

/// Starts the nodes' upkeep: the scripts loaded on every new connection
/// (each node's task stops with it) and, on a cluster, the nodes following
/// the cluster client's view of the topology (a failover, a resharding),
/// until the returned handle is dropped.
pub fn keep(
    nodes: &Arc<Nodes>,
    scripts: Scripts,
    timeout: Duration,
) -> Option<AbortOnDropHandle<()>> {
    if nodes.connect.is_none() {
        nodes.default.keep(&scripts, timeout, false);
        return None;
    }
    let follow = follow_topology(Arc::downgrade(nodes), scripts, timeout);
    Some(AbortOnDropHandle::new(tokio::spawn(follow)))
}

async fn follow_topology(nodes: Weak<Nodes>, scripts: Scripts, timeout: Duration) {
    let Some(mut changes) = nodes
        .upgrade()
        .map(|n| n.default.client.cluster_change_rx())
    else {
        return;
    };
    loop {
        let Some(strong) = nodes.upgrade() else {
            return;
        };
        if let Some(state) = strong.default.client.cached_cluster_state() {
            let (made, left) = strong.route(state.slots());
            for node in made {
                node.keep(&scripts, timeout, true);
                node.connect();
            }
            for node in left {
                tokio::spawn(async move { node.stop().await });
            }
        }
        drop(strong);
        match changes.recv().await {
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(first: u16, last: u16, port: u16) -> SlotRange {
        SlotRange {
            start: first,
            end: last,
            primary: Server::new("127.0.0.1", port),
            id: port.to_string().into(),
        }
    }

    fn open(b: &Breaker) {
        for _ in 0..super::super::breaker::BREAKER_FAILURES {
            b.permit().expect("closed").failed();
        }
    }

    /// Nodes whose clients are never connected.
    fn unconnected() -> Nodes {
        Nodes::cluster(Builder::default_centralized().build().unwrap(), |_| {
            Ok(Builder::default_centralized().build()?)
        })
    }

    #[test]
    fn on_a_cluster_each_node_has_its_own_breaker_and_a_failover_moves_its_slots_to_a_closed_one() {
        let slot = |key: &str| ClusterRouting::hash_key(key.as_bytes());
        let (low, high) = if slot("{a}") < slot("{b}") {
            ("{a}", "{b}")
        } else {
            ("{b}", "{a}")
        };
        let split = slot(high);
        let nodes = unconnected();
        let topology = [range(0, split - 1, 7000), range(split, 16383, 7001)];
        let (made, left) = nodes.route(&topology);
        assert_eq!((made.len(), left.len()), (2, 0));

        open(&nodes.for_key(low).breaker);
        assert_eq!(nodes.for_key(low).breaker.state(), State::Open);
        assert_eq!(
            nodes.for_key(high).breaker.state(),
            State::Closed,
            "the other node is unaffected"
        );
        assert_eq!(nodes.state(), State::Open, "the worst is reported");

        // The same topology read again: the nodes are kept, with their state.
        let (made, left) = nodes.route(&topology);
        assert_eq!((made.len(), left.len()), (0, 0));
        assert_eq!(nodes.for_key(low).breaker.state(), State::Open);

        // A replica on 7002 took over 7000's slots.
        let (made, left) = nodes.route(&[range(0, split - 1, 7002), range(split, 16383, 7001)]);
        assert_eq!((made.len(), left.len()), (1, 1), "7002 made, 7000 left");
        assert_eq!(nodes.for_key(low).breaker.state(), State::Closed);
        assert_eq!(nodes.state(), State::Closed, "the dead node is forgotten");
    }

    #[test]
    fn a_single_redis_has_one_node() {
        let nodes = Nodes::single(Builder::default_centralized().build().unwrap());
        open(&nodes.for_key("x").breaker);
        assert_eq!(nodes.for_key("y").breaker.state(), State::Open);
        assert_eq!(nodes.state(), State::Open);
    }
}
