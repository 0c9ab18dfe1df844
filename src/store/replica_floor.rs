//! The post: what loads from read replicas must include after a change to
//! every post, and what was read from them just before this process knew.
//!
//! A change to every post (a transaction past the feed's bound on rows,
//! TRUNCATE, a gap) fences no key: the decoder raises the fleet's cutoff
//! and appends the change, with its LSN and the cutoff, to the fleet's
//! stream. From then on, for the fence's lifetime, every load from a
//! replica must include that LSN (the floor). Entries read before the
//! cutoff are stale by it. What is left is the few milliseconds between
//! the raise and the moment an instance other than the decoder reads the
//! stream: a load in them may read a replica that has not replayed the
//! change and store the old row, read after the cutoff. So every key served
//! from a replica is remembered for a while with the position it was read
//! at, and the floor's arrival names those read at or after the cutoff from
//! a position before it: the caller fences them with the change, as the
//! feed fences a changed post. The check of a replica's rows against the
//! floor and their recording happen under one lock with the floor's
//! arrival, so a load is either checked against the floor or recorded in
//! time to be named.

use std::{
    collections::{HashSet, VecDeque},
    time::{Duration, Instant},
};

use crate::read_path::Since;

/// How long keys served from replicas are remembered: far longer than the
/// fleet's stream takes to reach an instance (milliseconds).
pub const REMEMBERED_FOR: Duration = Duration::from_secs(5);
/// At most this many are remembered (24 bytes each); past it, the oldest
/// go, and a floor that arrives while one read after its cutoff has gone
/// cannot name them all (see [`Suspects::Unknown`]).
pub const REMEMBERED_MAX: usize = 200_000;

/// The floor and the keys served from replicas lately.
#[derive(Debug)]
pub struct Floor {
    /// The floor and when it came.
    floor: Option<(Since, Instant)>,
    /// (key, the replica's replay position, unix ms), oldest first.
    served: VecDeque<(i64, u64, u64)>,
    /// The newest read forgotten for room rather than age (unix ms).
    dropped: Option<u64>,
    fence_ttl: Duration,
}

/// Keys read from a replica that may have stored a row older than a floor.
#[derive(Debug, PartialEq, Eq)]
pub enum Suspects {
    /// These (none, mostly).
    Keys(Vec<i64>),
    /// Not known: some were forgotten for room, or the floor's LSN is not
    /// known. The caller raises the cutoff again.
    Unknown,
}

impl Floor {
    pub fn new(fence_ttl: Duration) -> Self {
        Self {
            floor: None,
            served: VecDeque::new(),
            dropped: None,
            fence_ttl,
        }
    }

    /// What every load must include now, whatever its key's fence.
    pub fn get(&self) -> Since {
        match self.floor {
            Some((since, at)) if at.elapsed() < self.fence_ttl => since,
            _ => Since::ANY,
        }
    }

    /// Every post changed at `since` ([`Since::PRIMARY`]: at an unknown
    /// position), and the fleet's cutoff for it raised to `cutoff` (unix
    /// ms): the floor from now on, and the keys served from a replica at or
    /// after `cutoff` from a position before `since`.
    pub fn all_changed(&mut self, since: Since, cutoff: u64, now: u64) -> Suspects {
        let held = self.get();
        self.floor = Some((held.max(since), Instant::now()));
        self.forget_old(now);
        if self.dropped.is_some_and(|at| at >= cutoff) {
            return Suspects::Unknown;
        }
        let mut named = HashSet::new();
        let mut keys = Vec::new();
        for &(key, replayed, at) in &self.served {
            if at >= cutoff && Since(replayed) < since && named.insert(key) {
                keys.push(key);
            }
        }
        if since == Since::PRIMARY && !keys.is_empty() {
            // No LSN to fence them with.
            return Suspects::Unknown;
        }
        Suspects::Keys(keys)
    }

    /// Whether a key whose change is `since` may be served from a replica
    /// that has replayed to `replayed`, by its fence and the floor; if so,
    /// the key is remembered as served at `now` (unix ms).
    pub fn serve(&mut self, key: i64, since: Since, replayed: u64, now: u64) -> bool {
        if since.max(self.get()).0 > replayed {
            return false;
        }
        self.forget_old(now);
        self.served.push_back((key, replayed, now));
        if self.served.len() > REMEMBERED_MAX {
            if let Some((_, _, at)) = self.served.pop_front() {
                self.dropped = Some(self.dropped.map_or(at, |d| d.max(at)));
            }
        }
        true
    }

    fn forget_old(&mut self, now: u64) {
        let oldest = now.saturating_sub(REMEMBERED_FOR.as_millis() as u64);
        while self.served.front().is_some_and(|&(_, _, at)| at < oldest) {
            self.served.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(15);

    #[test]
    fn a_floor_keeps_behind_replicas_from_serving_until_it_expires() {
        let mut floor = Floor::new(TTL);
        assert!(floor.serve(1, Since::ANY, 10, 1_000));
        floor.all_changed(Since(50), 2_000, 2_000);
        assert!(!floor.serve(2, Since::ANY, 49, 2_001));
        assert!(floor.serve(2, Since::ANY, 50, 2_001));
        assert!(
            !floor.serve(3, Since(60), 50, 2_001),
            "a key's own fence still counts"
        );
        let mut expired = Floor::new(Duration::ZERO);
        expired.all_changed(Since(50), 2_000, 2_000);
        assert!(expired.serve(2, Since::ANY, 49, 2_001));
    }

    #[test]
    fn a_floor_names_keys_read_behind_it_after_its_cutoff_once_each() {
        let mut floor = Floor::new(TTL);
        assert!(floor.serve(1, Since::ANY, 10, 1_000)); // before the cutoff
        assert!(floor.serve(2, Since::ANY, 10, 2_000));
        assert!(floor.serve(2, Since::ANY, 20, 2_001));
        assert!(floor.serve(3, Since::ANY, 50, 2_002)); // replayed it
        assert_eq!(
            floor.all_changed(Since(50), 2_000, 2_010),
            Suspects::Keys(vec![2])
        );
    }

    #[test]
    fn a_floor_keeps_the_higher_of_two_changes() {
        let mut floor = Floor::new(TTL);
        floor.all_changed(Since(50), 0, 0);
        floor.all_changed(Since(40), 0, 0);
        assert_eq!(floor.get(), Since(50));
    }

    #[test]
    fn keys_forgotten_for_room_after_the_cutoff_make_the_suspects_unknown() {
        let mut floor = Floor::new(TTL);
        for key in 0..=REMEMBERED_MAX as i64 {
            assert!(floor.serve(key, Since::ANY, 10, 2_000));
        }
        assert_eq!(
            floor.all_changed(Since(50), 2_500, 2_600),
            Suspects::Keys(vec![])
        );
        assert_eq!(
            floor.all_changed(Since(50), 2_000, 2_600),
            Suspects::Unknown
        );
    }

    #[test]
    fn keys_older_than_remembered_are_forgotten() {
        let mut floor = Floor::new(TTL);
        assert!(floor.serve(1, Since::ANY, 10, 1_000));
        let later = 1_000 + REMEMBERED_FOR.as_millis() as u64 + 1;
        assert_eq!(
            floor.all_changed(Since(50), 0, later),
            Suspects::Keys(vec![])
        );
    }

    #[test]
    fn an_unknown_position_with_keys_to_name_is_unknown() {
        let mut floor = Floor::new(TTL);
        assert_eq!(
            floor.all_changed(Since::PRIMARY, 0, 0),
            Suspects::Keys(vec![])
        );
        let mut floor = Floor::new(TTL);
        assert!(floor.serve(1, Since::ANY, 10, 1_000));
        assert_eq!(
            floor.all_changed(Since::PRIMARY, 0, 1_000),
            Suspects::Unknown
        );
    }
}
