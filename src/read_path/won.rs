//! The protocol: claims won at a request's first look, on their way to the
//! key's flight.
//!
//! A request's first look in Redis claims the item if nobody has stored it
//! (`RedisCommands::look_up_or_claim`: a miss and its election in one
//! command). The request that won should lead, but another request of this
//! process, whose look came back after it (finding the claim), may start
//! the key's flight first: replies wake their tasks in any order. So the
//! won claim is put here where its reply is read, before any later reply of
//! the node's value claims is handed out, and a flight's election takes it
//! from here ([`WonClaims::take`]): whichever request starts the flight,
//! the flight leads with the claim. The first look itself, and the guard
//! that lets go of a claim no flight took, are `first_look.rs`.

use std::{
    collections::HashMap,
    hash::Hash,
    sync::{Mutex, PoisonError},
};

/// The claims won at first looks in this process and not yet taken by a
/// flight, by key: the winner's lock token.
pub(super) struct WonClaims<K> {
    /// A std mutex: held only to insert or remove, never across an await.
    won: Mutex<HashMap<K, String>>,
}

impl<K> Default for WonClaims<K> {
    fn default() -> Self {
        Self {
            won: Mutex::default(),
        }
    }
}

impl<K: Eq + Hash> WonClaims<K> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, String>> {
        self.won.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A claim for `key` was won with `token` (replacing any older one:
    /// a claim is won only where none is held, so that one is gone).
    pub fn put(&self, key: K, token: String) {
        self.lock().insert(key, token);
    }

    /// The token of a claim won for `key`, for a flight to lead with.
    pub fn take(&self, key: &K) -> Option<String> {
        self.lock().remove(key)
    }

    /// Whether `token`'s claim was still here (it is not any longer).
    pub fn take_if(&self, key: &K, token: &str) -> bool {
        let mut won = self.lock();
        let ours = won.get(key).is_some_and(|held| held == token);
        if ours {
            won.remove(key);
        }
        ours
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_taken_once_and_only_by_its_own_token_when_checked() {
        let claims = WonClaims::<u64>::default();
        claims.put(7, "a".into());
        assert!(!claims.take_if(&7, "b"), "another token's claim");
        assert!(claims.take_if(&7, "a"));
        assert!(!claims.take_if(&7, "a"), "taken already");
        claims.put(7, "a".into());
        // A newer claim replaces an older one (which is gone from Redis).
        claims.put(7, "c".into());
        assert!(!claims.take_if(&7, "a"));
        assert_eq!(claims.take(&7).as_deref(), Some("c"));
        assert_eq!(claims.take(&7), None);
        assert_eq!(claims.len(), 0);
    }
}
