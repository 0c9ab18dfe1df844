//! The store: what reads that need PostgreSQL's word run there, on a pool
//! of their own (PAST_READ_CONNECTIONS, named `postcache-past`), never the
//! loads'.
//!
//! A read whose ask the cache cannot vouch for (a `PostCache-Max-Staleness`
//! below what the change feed's beats prove, a `PostCache-Min-LSN` past
//! this instance's feed) first asks for the primary's WAL position, once
//! for every such read waiting on this instance, as a Raft ReadIndex does:
//! each read gets a position read by a statement that began after the read
//! arrived ([`PastReads::primary_position`]). Every commit visible when it
//! arrived is at or before that position, so once the feed has passed it
//! the cache answers for all of them. A flood of such reads then costs one
//! statement per round, whatever its size, and no row.
//!
//! Only when the feed cannot pass it in time (down, or far behind) is the
//! row read past the cache ([`PastReads::read_at_least`]). On this pool
//! too: when every connection is taken for PAST_ACQUIRE_TIMEOUT the read is
//! shed (503 with `Retry-After`), and the leaders' connections are never
//! touched.
//!
//! Each statement is bounded on the client's side too (LOAD_TIMEOUT): a
//! connection that went silent (a dead NAT entry) fails its round, and
//! every read waiting on that round, within the bound, not at
//! REQUEST_TIMEOUT one after another.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use sqlx::PgPool;

use futures::future::BoxFuture;

use super::{posts::ReadAt, replicas::Replicas, wal::wal_position, PostStore};
use crate::{
    read_path::{PastFailure, Primary, ReadPast},
    telemetry::metrics,
};

/// Longest a read waits for one of the pool's connections before it is
/// shed (or, when the pool could not connect, fails): at most
/// DB_ACQUIRE_TIMEOUT.
pub const PAST_ACQUIRE_TIMEOUT: Duration = Duration::from_millis(250);

/// The last round's result, by round number.
type Round = Option<(u64, Result<u64, PastFailure>)>;

/// Reads past the cache and the primary's position, on their own pool.
pub struct PastReads {
    pool: PgPool,
    /// The rows, read on `pool` (and on the replicas, with a position).
    store: PostStore,
    /// Rounds begun: a round numbered above the count a read saw when it
    /// arrived began after it.
    begun: AtomicU64,
    /// Held by the read whose round runs, the others wait for it (tokio's
    /// mutex is fair: they queue in order). It holds the last round's
    /// result.
    last: tokio::sync::Mutex<Round>,
    /// The highest position the primary is known to have reached.
    known: AtomicU64,
    /// The client-side bound on each statement (pool acquire and query).
    bound: Duration,
}

impl PastReads {
    /// Over `pool` (see [`super::connect_past`]), reading rows from
    /// `replicas` too where one has replayed the position asked; each
    /// statement given up on after `bound` (LOAD_TIMEOUT).
    pub fn new(pool: PgPool, replicas: Option<Arc<Replicas>>, bound: Duration) -> Self {
        let store = match replicas {
            Some(replicas) => PostStore::with_replicas(pool.clone(), replicas),
            None => PostStore::new(pool.clone()),
        };
        Self {
            pool,
            store,
            begun: AtomicU64::new(0),
            last: tokio::sync::Mutex::new(None),
            known: AtomicU64::new(0),
            bound,
        }
    }

    /// The primary's WAL insert position, read by a statement that began
    /// after this call: one statement for every call waiting meanwhile.
    ///
    /// A call dropped while its round runs lets go of the lock and leaves
    /// no result: the next waiting call begins a round of its own.
    pub async fn primary_position(&self) -> Result<u64, PastFailure> {
        let arrived = self.begun.load(Ordering::SeqCst);
        let mut last = self.last.lock().await;
        if let Some((round, result)) = *last {
            if round > arrived {
                return result;
            }
        }
        let round = self.begun.fetch_add(1, Ordering::SeqCst) + 1;
        metrics::primary_position_read();
        let result = self
            .bounded(wal_position(&self.pool))
            .await
            .map_err(|error| self.failure(&error, "the primary's position could not be read"));
        if let Ok(at) = result {
            self.saw(at);
        }
        *last = Some((round, result));
        result
    }

    /// The highest position the primary is known to have reached (0: none
    /// read yet): a position above it may be in the future, one at or
    /// below it is not.
    pub fn known_primary(&self) -> u64 {
        self.known.load(Ordering::SeqCst)
    }

    /// The primary has reached `at`.
    pub fn saw(&self, at: u64) {
        self.known.fetch_max(at, Ordering::SeqCst);
    }

    /// Reads `ids` past the cache at a position at least `min` (see
    /// [`PostStore::read_at_least`]), on this pool.
    pub async fn read_at_least(
        &self,
        ids: &[i64],
        min: Option<u64>,
    ) -> Result<ReadAt, PastFailure> {
        let read = self
            .bounded(self.store.read_at_least(ids, min))
            .await
            .map_err(|error| self.failure(&error, "a read past the cache failed"))?;
        if !read.replica {
            self.saw(read.position);
        }
        Ok(read)
    }

    /// `statement`, failed as [`sqlx::Error::Io`] (timed out) when it has
    /// not finished within the bound.
    async fn bounded<T>(
        &self,
        statement: impl std::future::Future<Output = sqlx::Result<T>>,
    ) -> sqlx::Result<T> {
        tokio::time::timeout(self.bound, statement)
            .await
            .unwrap_or_else(|_| {
                Err(sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer from PostgreSQL in {:?}", self.bound),
                )))
            })
    }

    /// A failed statement as a failure: `Full` when the pool timed out with
    /// every connection open and taken (this instance is busy), `Failed`
    /// otherwise (a pool that timed out with room left could not connect),
    /// logged with `what`.
    fn failure(&self, error: &sqlx::Error, what: &str) -> PastFailure {
        let full = self.pool.size() >= self.pool.options().get_max_connections()
            && self.pool.num_idle() == 0;
        if matches!(error, sqlx::Error::PoolTimedOut) && full {
            metrics::shed("past_pool");
            PastFailure::Full
        } else {
            tracing::warn!(%error, "{what}");
            PastFailure::Failed
        }
    }

    /// The pool these reads run on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Closes the pool (at shutdown).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// The read path's word from PostgreSQL (see `read_path/asked.rs`): posts
/// read past the cache as their JSON bodies, as loads read them.
impl Primary<i64> for PastReads {
    fn primary_position(&self) -> BoxFuture<'_, Result<u64, PastFailure>> {
        Box::pin(PastReads::primary_position(self))
    }

    fn known_primary(&self) -> u64 {
        PastReads::known_primary(self)
    }

    fn saw(&self, at: u64) {
        PastReads::saw(self, at);
    }

    fn read_at_least<'a>(
        &'a self,
        keys: &'a [i64],
        min: Option<u64>,
    ) -> BoxFuture<'a, Result<ReadPast<i64>, PastFailure>> {
        Box::pin(async move {
            let read = PastReads::read_at_least(self, keys, min).await?;
            let found = read
                .posts
                .iter()
                .map(|post| match serde_json::to_vec(post) {
                    Ok(body) => Ok((post.id, body.into())),
                    Err(error) => {
                        tracing::warn!(%error, id = post.id, "a post read past the cache does not encode");
                        Err(PastFailure::Failed)
                    }
                })
                .collect::<Result<_, _>>()?;
            Ok(ReadPast {
                found,
                position: read.position,
                upto: read.upto,
                replica: read.replica,
            })
        })
    }
}
