//! Subcommands: `postcache seed --posts N [--seed S]`: deterministic, bulk,
//! streamed, safe to rerun.

use std::{io::IsTerminal, time::Instant};

use anyhow::Context;
use indicatif::{HumanCount, ProgressBar, ProgressState, ProgressStyle};
use rand::{rngs::StdRng, seq::IndexedRandom, Rng, SeedableRng};
use sqlx::PgPool;

use crate::{
    changes::outbox,
    config::SeedArgs,
    posts::{Post, Timestamp},
    store,
    store::PostStore,
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
    // From 2024-01-01.
    let created = 1_704_067_200 + id.rem_euclid(60 * 60 * 24 * 700);
    let created_at = Timestamp::from_unix_seconds(created);
    let updated_at = Timestamp::from_unix_seconds(created + rng.random_range(0..86_400 * 30));
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
///
/// Streamed: batches are generated as they are written, PARALLEL_BATCHES
/// at a time, so memory stays bounded whatever N. Each batch is one
/// transaction. With CHANGE_FEED=trigger, a superuser's seed writes its
/// posts with the capture triggers off (`session_replication_role =
/// replica`, see `migrations/0004_replication_and_hardened_capture.sql`) and
/// records one change for every post instead: a running fleet invalidates
/// its cache once per batch rather than applying a change per post, and a
/// seed stopped midway leaves no written batch unannounced. Any other
/// role's seed is captured row by row, as any writer. With
/// CHANGE_FEED=replication a batch of BATCH_ROWS posts is past the
/// decoder's bound: one invalidation of every post per batch.
///
/// A progress bar is drawn on stderr when it is a terminal; otherwise only
/// the closing log line is written.
pub async fn run(args: &SeedArgs) -> anyhow::Result<u64> {
    store::migrate(&args.database).await?;
    let mut settings = args.database.clone();
    settings.db_statement_timeout = std::time::Duration::from_secs(600);
    settings.db_acquire_timeout = std::time::Duration::from_secs(60);
    let pool = store::connect(&settings).await?;
    let superuser: bool =
        sqlx::query_scalar("select rolsuper from pg_roles where rolname = current_user")
            .fetch_optional(&pool)
            .await?
            .unwrap_or(false);
    if !superuser {
        tracing::info!("not a superuser: the seed's rows are captured one by one, as any writer's");
    }
    let started = Instant::now();
    let seed = args.seed;
    let progress = progress_bar(args.posts);
    let batches = args.posts.div_ceil(BATCH_ROWS);
    let mut next = 0;
    let mut written = 0;
    let mut tasks = tokio::task::JoinSet::new();
    while next < batches || !tasks.is_empty() {
        while next < batches && tasks.len() < PARALLEL_BATCHES {
            let first = next * BATCH_ROWS + 1;
            let last = (first + BATCH_ROWS - 1).min(args.posts);
            let pool = pool.clone();
            tasks.spawn(async move {
                let posts: Vec<Post> = (first..=last).map(|id| generate(id as i64, seed)).collect();
                write_batch(&pool, &posts, superuser).await
            });
            next += 1;
        }
        let Some(done) = tasks.join_next().await else {
            break;
        };
        let rows = done
            .context("seed task panicked")?
            .context("failed to write posts")?;
        written += rows;
        progress.inc(rows);
    }
    progress.finish_and_clear();
    pool.close().await;
    tracing::info!(
        posts = written,
        seed,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "seeded"
    );
    Ok(written)
}

/// One batch in one transaction. A superuser writes the posts without a
/// change per post (the triggers do not fire for the `replica` role), and
/// one change for every post (`invalidate_all`, with the role back to
/// `origin` so that the outbox's own triggers fire).
async fn write_batch(pool: &PgPool, posts: &[Post], superuser: bool) -> Result<u64, sqlx::Error> {
    let mut tx = pool.begin().await?;
    if superuser {
        sqlx::query("set local session_replication_role = replica")
            .execute(&mut *tx)
            .await?;
    }
    let written = PostStore::upsert_batch_with(&mut *tx, posts).await?;
    if superuser {
        sqlx::query("set local session_replication_role = origin")
            .execute(&mut *tx)
            .await?;
        outbox::record(&mut *tx, &[]).await?;
    }
    tx.commit().await?;
    Ok(written)
}

/// Progress on stderr if it is a terminal, hidden otherwise.
fn progress_bar(posts: u64) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(posts);
    // The template is a constant: it parses.
    let style = ProgressStyle::with_template(
        "{spinner} {elapsed_precise} [{wide_bar}] {human_pos}/{human_len} posts, {rate}/s, eta {eta}",
    )
    .expect("a valid template")
    .with_key("rate", |state: &ProgressState, w: &mut dyn std::fmt::Write| {
        let _ = write!(w, "{}", HumanCount(state.per_sec() as u64));
    })
    .progress_chars("=> ");
    bar.set_style(style);
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
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
