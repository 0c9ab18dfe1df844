//! Subcommands: `postcache invalidate <id>... | --all`: the same
//! invalidation a change in PostgreSQL causes, by hand.
//!
//! Each id is recorded in the outbox (`post_changes`, op `invalidate`),
//! which gives it a change id and tells every instance whose change feed is
//! on, then applied to Redis here at once, with that id: deleted or marked
//! stale, whether or not an instance runs or follows the feed (the
//! instances' own applications of the same change are skipped), and fenced
//! at the primary's WAL position read after the change was recorded, which
//! a load from a read replica must include (never below a later fence).
//! `--all`
//! raises the fleet's cutoff in Redis to now (every entry read before it is
//! stale; no key is scanned), which every instance reads within a second,
//! and records `invalidate_all` in the outbox so that instances with the
//! feed raise theirs at once. Both are also appended to the fleet's change
//! stream, from which instances with CHANGE_FEED=replication learn them
//! (their memory tiers forget the posts at once).

use anyhow::Context;

use crate::{
    cache::Keys,
    changes::{
        fanout::{self, Entry},
        outbox,
    },
    config::InvalidateArgs,
    read_path::apply,
    redis::ChangeKind,
    startup, store,
};

/// What an invalidation did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalidated {
    /// Posts invalidated: (post id, its change id, whether this command
    /// applied it: false when an instance's feed had already).
    Posts(Vec<(i64, i64, bool)>),
    /// Every post read before this instant (unix milliseconds).
    All { cutoff: u64 },
}

pub async fn run(args: &InvalidateArgs) -> anyhow::Result<Invalidated> {
    args.database.validate()?;
    args.cache.validate()?;
    let pool = store::connect(&args.database).await?;
    let redis = crate::redis::connect_commands(
        &args.cache.redis_url,
        args.cache.redis_timeout,
        args.cache.redis_tcp(),
    )
    .await?;
    let keys = Keys::new(args.cache.key_prefix.clone(), "post");
    let settings = startup::read_path_settings(&args.cache, &args.database);
    let ids: &[i64] = if args.all { &[] } else { &args.ids };
    let recorded = outbox::record(&pool, ids)
        .await
        .context("failed to record the changes in post_changes (is the database migrated?)")?;
    // Where the primary's WAL is now: read replicas that have replayed it
    // have every change made before (see `store/replica_floor.rs`); 0 if unknown.
    let lsn = crate::store::wal_position(&pool).await.unwrap_or(0);
    pool.close().await;
    if args.all {
        let (change, _) = recorded[0];
        let cutoff = apply::raise_cutoff(&redis, &keys, change)
            .await
            .context("failed to raise the cutoff in Redis")?;
        tell_the_stream(&redis, &keys, Entry::All { lsn, cutoff }).await?;
        return Ok(Invalidated::All { cutoff });
    }
    let mut done = Vec::with_capacity(recorded.len());
    for (change, post) in recorded {
        let post = post.expect("recorded for an id");
        // Fenced at the WAL position read after the change was recorded,
        // as the decoder fences (a load must include it), where known: an
        // outbox id as the fence would let a load read any replica.
        let fence_at = (lsn > 0).then_some(lsn);
        let applied = apply::apply_change(
            &redis,
            &keys,
            &settings,
            post,
            (change, fence_at),
            ChangeKind::Changed,
        )
        .await
        .with_context(|| format!("failed to invalidate post {post} in Redis"))?;
        done.push((post, change, applied));
    }
    let ids = done.iter().map(|(post, _, _)| *post).collect();
    let entry = Entry::Posts {
        lsn: 0,
        ids,
        deleted: Vec::new(),
        upto: 0,
    };
    tell_the_stream(&redis, &keys, entry).await?;
    Ok(Invalidated::Posts(done))
}

/// Appends what was invalidated to the fleet's change stream (see
/// `changes/replication/fanout.rs`), once Redis has it.
async fn tell_the_stream(
    redis: &crate::redis::RedisCommands,
    keys: &Keys,
    entry: Entry,
) -> anyhow::Result<()> {
    fanout::append(redis, &keys.change_stream(), &entry)
        .await
        .context("failed to append to the change stream in Redis")
}

impl std::fmt::Display for Invalidated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Invalidated::Posts(posts) => {
                for (post, change, applied) in posts {
                    let by = if *applied { "here" } else { "by an instance's feed" };
                    writeln!(f, "post {post}: invalidated (change {change}, applied {by})")?;
                }
                Ok(())
            }
            Invalidated::All { cutoff } => writeln!(
                f,
                "every post read before {cutoff} (unix ms) is stale, on every instance within a second"
            ),
        }
    }
}
