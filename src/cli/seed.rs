//! `postcache seed --posts N [--seed S]`: deterministic, bulk, safe to rerun.

use std::time::Instant;

use anyhow::Context;
use rand::{rngs::StdRng, seq::IndexedRandom, Rng, SeedableRng};
use time::{Duration, OffsetDateTime};

use crate::{
    config::SeedArgs,
    db,
    posts::{Post, PostStore},
};

/// Rows per INSERT statement: large enough to amortise the round trip,
/// small enough to keep one statement's arrays to a few megabytes.
const BATCH_ROWS: u64 = 10_000;
/// Batches written at once (PostgreSQL parallelises across connections).
const PARALLEL_BATCHES: usize = 2;

const ADJECTIVES: &[&str] = &[
    "quiet", "rapid", "hidden", "bright", "careful", "distant", "honest", "simple", "strange",
    "gentle", "bold", "ancient", "modern", "curious", "steady", "lazy",
];
const NOUNS: &[&str] = &[
    "cache", "river", "stampede", "lock", "query", "harbor", "signal", "garden", "engine",
    "letter", "window", "mountain", "thread", "answer", "journey", "pattern",
];
const WORDS: &[&str] = &[
    "the", "a", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "was", "on",
    "database", "request", "redis", "waiter", "leader", "expiry", "traffic", "load", "row",
    "result", "message", "channel", "instance", "fleet", "latency", "memory", "under", "every",
];
const AUTHORS: &[&str] = &[
    "ada", "grace", "linus", "barbara", "ken", "dennis", "margaret", "edsger", "donald", "leslie",
    "radia", "frances", "john", "tony", "niklaus", "alan",
];

/// The post with this id for this seed: the same inputs always give the same post.
pub fn generate(id: i64, seed: u64) -> Post {
    // One generator per row, seeded from (seed, id), so a post does not depend
    // on the batch size or on which other posts are generated.
    let mut rng = StdRng::seed_from_u64(seed ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let pick = |rng: &mut StdRng, list: &[&'static str]| *list.choose(rng).expect("non-empty list");
    let title = format!(
        "The {} {} #{id}",
        pick(&mut rng, ADJECTIVES),
        pick(&mut rng, NOUNS)
    );
    let words = rng.random_range(20..60);
    let mut body = String::with_capacity(words * 8);
    for i in 0..words {
        if i > 0 {
            body.push(' ');
        }
        body.push_str(pick(&mut rng, WORDS));
    }
    body.push('.');
    let author = pick(&mut rng, AUTHORS).to_string();
    let base = OffsetDateTime::from_unix_timestamp(1_704_067_200).expect("valid 2024-01-01");
    let created_at = base + Duration::seconds(id.rem_euclid(60 * 60 * 24 * 700));
    let updated_at = created_at + Duration::seconds(rng.random_range(0..86_400 * 30));
    Post {
        id,
        title,
        body,
        author,
        created_at,
        updated_at,
    }
}

/// Writes posts 1..=N; returns how many rows were written.
pub async fn run(args: &SeedArgs) -> anyhow::Result<u64> {
    db::migrate(&args.database).await?;
    let mut settings = args.database.clone();
    settings.db_statement_timeout = std::time::Duration::from_secs(600);
    settings.db_acquire_timeout = std::time::Duration::from_secs(60);
    let store = PostStore::new(db::connect(&settings).await?);
    let started = Instant::now();
    let seed = args.seed;
    let batches: Vec<(u64, u64)> = (0..args.posts.div_ceil(BATCH_ROWS))
        .map(|b| {
            let first = b * BATCH_ROWS + 1;
            (first, (first + BATCH_ROWS - 1).min(args.posts))
        })
        .collect();
    let mut written = 0;
    for chunk in batches.chunks(PARALLEL_BATCHES) {
        let mut tasks = tokio::task::JoinSet::new();
        for &(first, last) in chunk {
            let store = store.clone();
            tasks.spawn(async move {
                let posts: Vec<Post> = (first..=last).map(|id| generate(id as i64, seed)).collect();
                store.upsert_batch(&posts).await
            });
        }
        while let Some(done) = tasks.join_next().await {
            written += done
                .context("seed task panicked")?
                .context("failed to write posts")?;
        }
    }
    store.pool().close().await;
    tracing::info!(
        posts = written,
        seed,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "seeded"
    );
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_post_and_another_seed_another() {
        assert_eq!(generate(17, 1), generate(17, 1));
        assert_ne!(generate(17, 1).title, generate(17, 2).title);
        assert!(generate(1, 1).updated_at >= generate(1, 1).created_at);
    }
}
