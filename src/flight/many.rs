//! The protocol: many keys read at once (a batch read). The memory tier
//! first, then one look in Redis per node for the rest (`lookup_many`),
//! then each key as a single read goes on from its look: a hit served, a
//! miss through this process's flight for the key, with its own fleet-wide
//! election, fence, finish and wake-up. The misses' loads run together, so
//! they share statements (`batch.rs`).

use std::sync::Arc;

use futures::future::join_all;

use super::{
    freshness::Verdict, strategy::InProgress, Answer, ReadError, ReadPath, Source, Strategy,
};
use crate::cache::now_millis;

impl<S: Source> ReadPath<S> {
    /// Reads `keys` (distinct), answering each in their order.
    pub async fn read_many(self: &Arc<Self>, keys: Vec<S::Key>) -> Vec<Result<Answer, ReadError>> {
        if !matches!(self.settings.strategy, Strategy::Pubsub | Strategy::Poll) {
            // The load lab's baselines: a read per key, as they stand.
            return join_all(keys.into_iter().map(|key| self.read(key))).await;
        }
        let _in_progress = InProgress::enter(&self.reads_in_progress);
        let now = now_millis();
        let mut answers: Vec<Option<Result<Answer, ReadError>>> =
            keys.iter().map(|key| self.from_memory(key, now)).collect();
        let rest: Vec<usize> = (0..keys.len())
            .filter(|&at| answers[at].is_none())
            .collect();
        if !rest.is_empty() {
            // Taken before anything is read (see memory.rs).
            let tickets: Vec<_> = rest
                .iter()
                .map(|&at| self.memory.ticket(&keys[at]))
                .collect();
            let names: Vec<String> = rest.iter().map(|&at| self.keys.value(&keys[at])).collect();
            let looked = Box::pin(self.redis.lookup_many(&names)).await;
            let grace = self.settings.stale_while_revalidate;
            let reads = rest
                .iter()
                .zip(looked)
                .zip(tickets)
                .map(|((&at, looked), ticket)| {
                    let (verdict, looked) = self.judge_look_up(looked, now, grace);
                    let key = keys[at].clone();
                    // A miss: its load is about to queue; a statement waits
                    // for it and the read's other misses (see batch.rs).
                    let expected = (matches!(verdict, Verdict::Miss)
                        && !self.guard_says_missing(&key))
                    .then(|| self.loader.expect(&key));
                    let read = self.after_look_up(key, now, verdict, looked, ticket, None);
                    async move {
                        let answer = read.await;
                        drop(expected);
                        answer
                    }
                });
            for (&at, answer) in rest.iter().zip(join_all(reads).await) {
                answers[at] = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or(Err(ReadError::Unavailable)))
            .collect()
    }
}
