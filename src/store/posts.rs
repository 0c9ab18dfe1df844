//! The store: posts read and written in PostgreSQL, on the primary and,
//! for loads, on the read replicas (`replicas.rs`); the read path's
//! [`Source`](crate::read_path::Source) of posts.

use std::sync::Arc;

use sqlx::PgPool;

use super::{replica_floor::Suspects, replicas::Replicas};
use crate::{
    posts::Post,
    read_path::{LoadProgress, Loaded, LoadedMany, Since},
    telemetry::metrics,
};

/// Posts read past the cache at a position (see [`PostStore::read_at_least`]).
#[derive(Debug)]
pub struct ReadAt {
    pub posts: Vec<Post>,
    /// From a replica: the position it had replayed before it read, every
    /// commit up to it in `posts`. From the primary: its WAL insert
    /// position, past every commit visible to the read (and maybe some
    /// not visible yet): a client's position past it is in the future.
    pub position: u64,
    /// No post read is newer than this position (the server's, read after
    /// the read).
    pub upto: u64,
    /// Read from a replica (else the primary).
    pub replica: bool,
}

/// Reads and writes posts in PostgreSQL: the primary, and for loads the
/// read replicas when there are (see `replicas.rs`).
#[derive(Clone)]
pub struct PostStore {
    pool: PgPool,
    replicas: Option<Arc<Replicas>>,
    /// When a read on the primary last succeeded: tells a busy pool from a
    /// database that stopped answering (see [`PostStore::load_error`]).
    answered: Arc<LoadProgress>,
}

impl std::fmt::Debug for PostStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostStore")
            .field("pool", &self.pool)
            .field("replicas", &self.replicas.is_some())
            .finish()
    }
}

impl PostStore {
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            replicas: None,
            answered: Arc::default(),
        }
    }

    /// Loads also read from `replicas`.
    pub fn with_replicas(pool: PgPool, replicas: Arc<Replicas>) -> Self {
        Self {
            pool,
            replicas: Some(replicas),
            answered: Arc::default(),
        }
    }

    pub fn replicas(&self) -> Option<&Arc<Replicas>> {
        self.replicas.as_ref()
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Reads `ids` at a position at least `min` (a WAL position, bytes
    /// from 0/0), past the cache: from a read replica known to have
    /// replayed it, else from the primary (always the primary when no
    /// position is given: a replica's lag is not bounded in time here).
    /// The posts found, and the position they are read at (every commit up
    /// to it is in them). For reads that ask for a position or a staleness
    /// the cache cannot vouch for (`PostCache-Min-LSN`,
    /// `PostCache-Max-Staleness`): nothing is stored.
    pub async fn read_at_least(
        &self,
        ids: &[i64],
        min: Option<u64>,
    ) -> Result<ReadAt, sqlx::Error> {
        if let (Some(replicas), Some(min)) = (&self.replicas, min) {
            if let Some(read) = replicas.read_at_least(ids, min).await {
                return Ok(ReadAt {
                    posts: read.posts,
                    position: read.before,
                    upto: read.after,
                    replica: true,
                });
            }
        }
        let read = super::replicas::read_positioned(&self.pool, ids).await?;
        Ok(ReadAt {
            posts: read.posts,
            position: read.before,
            upto: read.after,
            replica: false,
        })
    }

    /// The most connections the pool may open.
    fn connections(&self) -> u32 {
        self.pool.options().get_max_connections()
    }

    /// Whether every connection the pool may open is open and in use.
    fn exhausted(&self) -> bool {
        self.pool.size() >= self.connections() && self.pool.num_idle() == 0
    }

    /// The post with this id, if any, and a WAL position it is no newer
    /// than. One indexed query.
    pub async fn find(&self, id: i64) -> Result<(Option<Post>, u64), sqlx::Error> {
        let (posts, upto) = self.find_many(&[id]).await?;
        Ok((posts.into_iter().next(), upto))
    }

    /// The posts with these ids that exist, in one statement, and a WAL
    /// position no row is newer than: the primary's insert position, read
    /// by the statement after its snapshot was taken (a row for it comes
    /// back when no post is found too).
    pub async fn find_many(&self, ids: &[i64]) -> Result<(Vec<Post>, u64), sqlx::Error> {
        let rows = again_if_lost(
            self.connections(),
            self.pool.options().get_acquire_timeout(),
            || async {
                // Acquired here, so that the wait for a connection is
                // measured (`postcache_db_pool_wait_seconds`).
                let asked = std::time::Instant::now();
                let mut connection = self.pool.acquire().await?;
                metrics::db_pool_wait("loads", asked.elapsed());
                sqlx::query_as::<_, Positioned>(
                    "select (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint as upto,
                        p.id, p.title, p.body, p.author, p.created_at, p.updated_at
                 from (values (1)) as one (x)
                 left join posts p on p.id = any($1)",
                )
                .bind(ids)
                .fetch_all(&mut *connection)
                .await
            },
        )
        .await
        .inspect(|_| self.answered.succeeded())?;
        let upto = rows.iter().map(|row| row.upto).max().unwrap_or(0);
        let posts = rows.into_iter().filter_map(|row| row.post.post()).collect();
        Ok((posts, u64::try_from(upto).unwrap_or(0)))
    }

    /// A failed read as a load error: [`crate::read_path::Busy`] when every
    /// connection was open and taken for DB_ACQUIRE_TIMEOUT while reads
    /// kept succeeding (this instance is busy, the post did not fail). A
    /// pool that timed out with room left could not connect, and one whose
    /// connections were all taken by reads none of which succeeded in that
    /// time holds statements (or connects) that hang: PostgreSQL is down or
    /// unreachable, a failure like any other.
    fn load_error(&self, error: sqlx::Error) -> crate::read_path::LoadError {
        let waited = self.pool.options().get_acquire_timeout();
        match error {
            sqlx::Error::PoolTimedOut
                if self.exhausted() && self.answered.succeeded_within(waited) =>
            {
                crate::read_path::Busy.into()
            }
            error => error.into(),
        }
    }

    /// Inserts or replaces a batch of posts in one statement.
    pub async fn upsert_batch(&self, posts: &[Post]) -> Result<u64, sqlx::Error> {
        Self::upsert_batch_with(&self.pool, posts).await
    }

    /// [`PostStore::upsert_batch`] on `executor` (a transaction of the caller's).
    pub async fn upsert_batch_with<'e>(
        executor: impl sqlx::PgExecutor<'e>,
        posts: &[Post],
    ) -> Result<u64, sqlx::Error> {
        let mut ids = Vec::with_capacity(posts.len());
        let mut titles = Vec::with_capacity(posts.len());
        let mut bodies = Vec::with_capacity(posts.len());
        let mut authors = Vec::with_capacity(posts.len());
        let mut created = Vec::with_capacity(posts.len());
        let mut updated = Vec::with_capacity(posts.len());
        for p in posts {
            ids.push(p.id);
            titles.push(p.title.as_str());
            bodies.push(p.body.as_str());
            authors.push(p.author.as_str());
            created.push(p.created_at);
            updated.push(p.updated_at);
        }
        let done = sqlx::query(
            "insert into posts (id, title, body, author, created_at, updated_at)
             select * from unnest($1::bigint[], $2::text[], $3::text[], $4::text[],
                                  $5::timestamptz[], $6::timestamptz[])
             on conflict (id) do update set
                 title = excluded.title, body = excluded.body, author = excluded.author,
                 created_at = excluded.created_at, updated_at = excluded.updated_at",
        )
        .bind(&ids)
        .bind(&titles)
        .bind(&bodies)
        .bind(&authors)
        .bind(&created)
        .bind(&updated)
        .execute(executor)
        .await?;
        Ok(done.rows_affected())
    }
}

/// Runs a read, and again while its connection turns out to be gone, at
/// most `connections` times more (each failed connection is closed, not
/// returned, so the pool runs out of dead ones) and not once `within` has
/// passed since the first try (the pool's acquire timeout, so a database
/// that fails fast this way still costs a load a bounded time): the
/// loads' pool pings only
/// connections idle for a while (see `store::PING_IDLE_AFTER`), so one whose
/// server process was ended moments ago (a restart, `pg_terminate_backend`)
/// fails its statement instead. A read is safe to run twice.
async fn again_if_lost<T, F, Fut>(
    connections: u32,
    within: std::time::Duration,
    mut read: F,
) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let started = std::time::Instant::now();
    let mut left = connections;
    loop {
        match read().await {
            Err(error) if left > 0 && started.elapsed() < within && connection_lost(&error) => {
                tracing::debug!(%error, "a load's connection was gone; reading again on another");
                left -= 1;
            }
            done => return done,
        }
    }
}

/// Whether a statement failed for want of its connection, not for anything
/// in the statement: the socket failed, or the server ended the session
/// (SQLSTATE class 08, or 57P01/57P02: shut down or crashed).
fn connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(e) => e
            .code()
            .is_some_and(|code| code.starts_with("08") || code == "57P01" || code == "57P02"),
        _ => false,
    }
}

/// A row of [`PostStore::find_many`]: the position, and a post or nulls.
#[derive(sqlx::FromRow)]
struct Positioned {
    upto: i64,
    #[sqlx(flatten)]
    post: crate::posts::PostColumns,
}

/// The read path loads a post as its JSON body, `None` when absent.
impl crate::read_path::Source for PostStore {
    type Key = i64;

    fn reads_copies(&self) -> bool {
        self.replicas.is_some()
    }

    async fn load(&self, id: &i64, since: Since) -> Result<Loaded, crate::read_path::LoadError> {
        if let Some(replicas) = &self.replicas {
            let routed = replicas.read(&[(*id, since)]).await;
            if routed.primary.is_empty() {
                let body = match routed.found.first() {
                    Some(post) => Some(serde_json::to_vec(post)?.into()),
                    None => None,
                };
                return Ok(Loaded {
                    body,
                    upto: routed.upto,
                });
            }
        }
        match self.find(*id).await {
            Ok((post, upto)) => Ok(Loaded {
                body: match post {
                    Some(post) => Some(serde_json::to_vec(&post)?.into()),
                    None => None,
                },
                upto,
            }),
            Err(error) => Err(self.load_error(error)),
        }
    }

    fn all_changed(&self, since: Since, cutoff: u64) -> Option<Vec<i64>> {
        match self.replicas.as_ref().map(|r| r.all_changed(since, cutoff)) {
            None => Some(Vec::new()),
            Some(Suspects::Keys(keys)) => Some(keys),
            Some(Suspects::Unknown) => None,
        }
    }

    fn ordinal(id: &i64) -> Option<u64> {
        u64::try_from(*id).ok()
    }

    /// Every id, streamed (one pass over the primary key's index).
    async fn ordinals(
        &self,
    ) -> Result<Option<roaring::RoaringTreemap>, crate::read_path::LoadError> {
        use futures::TryStreamExt;
        let mut ids = sqlx::query_scalar::<_, i64>("select id from posts").fetch(&self.pool);
        let mut set = roaring::RoaringTreemap::new();
        while let Some(id) = ids.try_next().await? {
            if let Ok(id) = u64::try_from(id) {
                set.insert(id);
            }
        }
        Ok(Some(set))
    }

    async fn load_many(
        &self,
        keys: &[(i64, Since)],
    ) -> Result<LoadedMany<i64>, crate::read_path::LoadError> {
        let (mut posts, primary, mut upto) = match &self.replicas {
            Some(replicas) => {
                let routed = replicas.read(keys).await;
                (routed.found, routed.primary, routed.upto)
            }
            None => (Vec::new(), keys.iter().map(|(id, _)| *id).collect(), 0),
        };
        if !primary.is_empty() {
            let (read, at) = self
                .find_many(&primary)
                .await
                .map_err(|error| self.load_error(error))?;
            posts.extend(read);
            // A replica is never ahead of the primary's later position.
            upto = upto.max(at);
        }
        let found = posts
            .into_iter()
            .map(|post| Ok((post.id, serde_json::to_vec(&post)?.into())))
            .collect::<Result<_, crate::read_path::LoadError>>()?;
        Ok(LoadedMany { found, upto })
    }
}
