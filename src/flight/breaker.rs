//! A circuit breaker in front of Redis: while Redis is down, requests stop
//! paying REDIS_TIMEOUT on every command and fail open at once.
//!
//! Closed: commands pass; BREAKER_FAILURES consecutive connection failures or
//! timeouts open it. Open: commands are refused without touching Redis for
//! BREAKER_COOLDOWN. Half-open: one command (the probe) passes; its success
//! closes the breaker, its failure opens it for another cooldown.
//!
//! The probe is a [`Permit`]: a command's future may be dropped at any await
//! (its client went away), and a probe that ends without a verdict must not
//! keep every later command from probing. Dropping an unsettled probe permit
//! gives the probe back.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
        Arc, PoisonError, RwLock,
    },
    time::{Duration, Instant},
};

use fred::types::{
    cluster::{ClusterRouting, SlotRange},
    config::Server,
};

use crate::telemetry::metrics;

/// Consecutive failures that open the breaker.
pub const BREAKER_FAILURES: u32 = 3;
/// How long an open breaker refuses commands before letting a probe through.
pub const BREAKER_COOLDOWN: Duration = Duration::from_millis(500);

/// Lock-free: it sits on the path of every Redis command. Atomics rather than
/// a mutex because the common case (closed) is a single relaxed load.
pub struct Breaker {
    epoch: Instant,
    failures: AtomicU32,
    /// Milliseconds since `epoch` until which the breaker is open; 0 = closed.
    open_until: AtomicU64,
    /// A half-open probe is in flight.
    probing: AtomicBool,
}

/// The breaker's state, as exported in metrics (0, 1, 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed = 0,
    Open = 1,
    HalfOpen = 2,
}

impl Default for Breaker {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
        }
    }
}

impl Breaker {
    fn now_ms(&self) -> u64 {
        // +1 so that 0 always means "closed".
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    pub fn state(&self) -> State {
        match self.open_until.load(Ordering::Acquire) {
            0 => State::Closed,
            until if self.now_ms() < until => State::Open,
            _ => State::HalfOpen,
        }
    }

    /// Leave for one command to go to Redis now, `None` when refused.
    pub fn permit(&self) -> Option<Permit<'_>> {
        let probe = match self.state() {
            State::Closed => false,
            State::Open => return None,
            // Exactly one caller gets to probe.
            State::HalfOpen => {
                self.probing
                    .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                    .ok()?;
                true
            }
        };
        Some(Permit {
            breaker: self,
            probe,
        })
    }

    /// A connection to Redis was (re)established and answered: close at once
    /// rather than wait for the next probe after the cooldown.
    pub fn reconnected(&self) {
        self.record_success();
    }

    fn record_success(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self.open_until.swap(0, Ordering::AcqRel) != 0 {
            tracing::info!("redis answers again; circuit breaker closed");
        }
        self.probing.store(false, Ordering::Release);
    }

    fn record_failure(&self) {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        let probe_failed = self.probing.swap(false, Ordering::AcqRel);
        if probe_failed || failures >= BREAKER_FAILURES {
            let was = self.open_until.swap(
                self.now_ms() + BREAKER_COOLDOWN.as_millis() as u64,
                Ordering::AcqRel,
            );
            if was == 0 {
                tracing::warn!(failures, "redis failing; circuit breaker opened");
            }
        }
    }
}

/// The breakers of one process. One for a single Redis. On a Redis Cluster,
/// one per primary node, found from a key's hash slot, so that one shard's
/// outage bypasses that shard's keys only, and a failover, which moves the
/// slots to another node, moves them to that node's breaker (closed) as soon
/// as the client sees the new topology.
pub struct Breakers {
    /// A single Redis; on a cluster, keys whose node is not known yet.
    default: Arc<Breaker>,
    clustered: bool,
    /// A std lock: read on every command, written on a topology change.
    routes: RwLock<Routes>,
}

#[derive(Default)]
struct Routes {
    /// (first slot, last slot, its node's breaker), sorted.
    ranges: Vec<(u16, u16, Arc<Breaker>)>,
    /// Kept across topology changes, so that a node keeps its state.
    nodes: HashMap<Server, Arc<Breaker>>,
}

impl Breakers {
    pub fn new(clustered: bool) -> Self {
        Self {
            default: Arc::default(),
            clustered,
            routes: RwLock::default(),
        }
    }

    fn routes(&self) -> std::sync::RwLockReadGuard<'_, Routes> {
        self.routes.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The breaker that guards the commands on `key`.
    pub fn for_key(&self, key: &str) -> Arc<Breaker> {
        if !self.clustered {
            return self.default.clone();
        }
        let slot = ClusterRouting::hash_key(key.as_bytes());
        let routes = self.routes();
        let i = routes.ranges.partition_point(|(_, last, _)| *last < slot);
        match routes.ranges.get(i) {
            Some((first, _, breaker)) if *first <= slot => breaker.clone(),
            _ => self.default.clone(),
        }
    }

    /// The breaker of the node `server` (the default one when not known).
    pub fn for_node(&self, server: &Server) -> Arc<Breaker> {
        let known = self.routes().nodes.get(server).cloned();
        known.unwrap_or_else(|| self.default.clone())
    }

    /// Follows a new cluster topology: each slot range to its primary's
    /// breaker, new for a node not seen before.
    pub fn route(&self, slots: &[SlotRange]) {
        let mut routes = self.routes.write().unwrap_or_else(PoisonError::into_inner);
        let mut nodes = HashMap::new();
        let mut ranges: Vec<_> = slots
            .iter()
            .map(|range| {
                let breaker = nodes
                    .entry(range.primary.clone())
                    .or_insert_with(|| {
                        routes
                            .nodes
                            .get(&range.primary)
                            .cloned()
                            .unwrap_or_default()
                    })
                    .clone();
                (range.start, range.end, breaker)
            })
            .collect();
        ranges.sort_by_key(|(first, _, _)| *first);
        *routes = Routes { ranges, nodes };
    }

    /// The worst state among the breakers in use: open, else half-open,
    /// else closed.
    pub fn state(&self) -> State {
        let routes = self.routes();
        // Once the nodes are known, the default breaker guards nothing.
        let in_use: Vec<&Arc<Breaker>> = if routes.nodes.is_empty() {
            vec![&self.default]
        } else {
            routes.nodes.values().collect()
        };
        in_use
            .into_iter()
            .map(|breaker| breaker.state())
            .max_by_key(|state| match state {
                State::Closed => 0,
                State::HalfOpen => 1,
                State::Open => 2,
            })
            .unwrap_or(State::Closed)
    }

    /// Reports [`Breakers::state`] in the metrics.
    pub fn report(&self) {
        metrics::breaker_state(self.state() as u8 as f64);
    }
}

/// Leave for one command; tell the breaker how it went with
/// [`Permit::succeeded`] or [`Permit::failed`].
pub struct Permit<'a> {
    breaker: &'a Breaker,
    /// This command is the half-open probe.
    probe: bool,
}

impl Permit<'_> {
    pub fn succeeded(mut self) {
        self.probe = false;
        self.breaker.record_success();
    }

    pub fn failed(mut self) {
        self.probe = false;
        self.breaker.record_failure();
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.probe {
            // Dropped before its verdict (the command's future was
            // cancelled): the next command probes instead.
            self.breaker.probing.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_opens_after_consecutive_failures_and_probes_once_after_the_cooldown() {
        let b = Breaker::default();
        for _ in 0..BREAKER_FAILURES - 1 {
            b.permit().expect("still closed").failed();
        }
        b.permit().expect("still closed").failed();
        assert_eq!(b.state(), State::Open);
        assert!(b.permit().is_none());

        std::thread::sleep(BREAKER_COOLDOWN + Duration::from_millis(20));
        assert_eq!(b.state(), State::HalfOpen);
        let probe = b.permit().expect("one probe");
        assert!(b.permit().is_none(), "only one probe");
        probe.failed();
        assert_eq!(b.state(), State::Open, "a failed probe reopens");

        std::thread::sleep(BREAKER_COOLDOWN + Duration::from_millis(20));
        b.permit().expect("a probe").succeeded();
        assert_eq!(b.state(), State::Closed);
        assert!(b.permit().is_some() && b.permit().is_some());
    }

    #[test]
    fn a_probe_dropped_without_a_verdict_lets_the_next_command_probe() {
        let b = Breaker::default();
        for _ in 0..BREAKER_FAILURES {
            b.permit().expect("closed").failed();
        }
        std::thread::sleep(BREAKER_COOLDOWN + Duration::from_millis(20));

        drop(b.permit().expect("the probe"));

        let next = b.permit().expect("the probe was given back");
        next.succeeded();
        assert_eq!(b.state(), State::Closed);
    }

    fn range(first: u16, last: u16, port: u16) -> SlotRange {
        SlotRange {
            start: first,
            end: last,
            primary: Server::new("127.0.0.1", port),
            id: port.to_string().into(),
        }
    }

    fn open(b: &Breaker) {
        for _ in 0..BREAKER_FAILURES {
            b.permit().expect("closed").failed();
        }
    }

    /// Two keys on different slots; which is lower is found at run time.
    const LOW: &str = "{a}";
    const HIGH: &str = "{b}";

    #[test]
    fn on_a_cluster_each_node_has_its_own_breaker_and_a_failover_moves_its_slots_to_a_closed_one() {
        let slot = |key: &str| ClusterRouting::hash_key(key.as_bytes());
        let (low, high) = if slot(LOW) < slot(HIGH) {
            (LOW, HIGH)
        } else {
            (HIGH, LOW)
        };
        let split = slot(high);
        assert!(slot(low) < split);
        let breakers = Breakers::new(true);
        breakers.route(&[range(0, split - 1, 7000), range(split, 16383, 7001)]);

        open(&breakers.for_key(low));
        assert_eq!(breakers.for_key(low).state(), State::Open);
        assert_eq!(
            breakers.for_key(high).state(),
            State::Closed,
            "the other node is unaffected"
        );
        assert_eq!(breakers.state(), State::Open, "the worst is reported");

        // The same topology read again: the node keeps its state.
        breakers.route(&[range(0, split - 1, 7000), range(split, 16383, 7001)]);
        assert_eq!(breakers.for_key(low).state(), State::Open);

        // A replica on 7002 took over 7000's slots.
        breakers.route(&[range(0, split - 1, 7002), range(split, 16383, 7001)]);
        assert_eq!(breakers.for_key(low).state(), State::Closed);
        assert_eq!(
            breakers.state(),
            State::Closed,
            "the dead node is forgotten"
        );
        breakers
            .for_node(&Server::new("127.0.0.1", 7002))
            .permit()
            .expect("closed")
            .failed();
        assert_eq!(
            breakers.for_key(low).state(),
            State::Closed,
            "one failure is not enough"
        );
    }

    #[test]
    fn a_single_redis_has_one_breaker() {
        let breakers = Breakers::new(false);
        open(&breakers.for_key("x"));
        assert_eq!(breakers.for_key("y").state(), State::Open);
        assert_eq!(breakers.state(), State::Open);
    }

    #[test]
    fn a_success_resets_the_count() {
        let b = Breaker::default();
        for _ in 0..BREAKER_FAILURES - 1 {
            b.record_failure();
        }
        b.record_success();
        for _ in 0..BREAKER_FAILURES - 1 {
            b.record_failure();
        }
        // Without the reset, these failures would add up past the threshold.
        assert_eq!(
            b.state(),
            State::Closed,
            "the count restarted at the success"
        );
        b.record_failure();
        assert_eq!(b.state(), State::Open, "and counts on from there");
    }
}
