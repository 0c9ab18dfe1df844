//! The checker's writers: plain SQL on `posts`, as any program writes it.
//! Every write gives each post it touches a new version, in its title
//! (`c<post>.<version>`) and at the head of its body, and the history
//! records when its transaction began and when its COMMIT returned.
//!
//! A post is written by one transaction at a time (each writer locks the
//! posts it writes, in id order), so the order in which the writers see
//! their commits is the database's order for that post. Writes to
//! different posts run at once. A COMMIT whose answer is lost (PostgreSQL
//! restarted under it) is settled by reading the rows back once the
//! writer's session is gone: the row says whether it committed.

use std::{
    collections::BTreeMap,
    sync::{atomic::Ordering, Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context};
use postcache::testkit::{
    history::{History, Version},
    Zipf,
};
use rand::{rngs::StdRng, Rng};
use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;

use crate::{
    fleet::Fleet,
    readers::{read_one_at, Errors, Ryw},
    Clock,
};

/// Longest the checker tries to settle a COMMIT whose answer was lost.
const SETTLE_LIMIT: Duration = Duration::from_secs(120);

/// A post's title in version `seq`.
pub fn title(post: i64, seq: u32) -> String {
    format!("c{post}.{seq}")
}

/// A post's body in version `seq`: the title, then a filler whose length
/// varies with the version.
pub fn body(post: i64, seq: u32) -> String {
    let filler = "lorem ipsum dolor sit amet ".repeat(4 + (seq as usize * 7) % 40);
    format!("{} {filler}", title(post, seq))
}

/// Reads a version marker (`c<post>.<version>`) back.
pub fn parse_marker(marker: &str) -> Option<(i64, u32)> {
    let (post, seq) = marker.strip_prefix('c')?.split_once('.')?;
    Some((post.parse().ok()?, seq.parse().ok()?))
}

/// What the writers know of a post: its last version, and whether it
/// exists.
#[derive(Debug, Clone, Copy)]
struct PostState {
    seq: u32,
    exists: bool,
}

/// The posts, each behind a lock its writer holds for the whole
/// transaction; a TRUNCATE takes them all.
pub struct Posts {
    n: i64,
    states: Vec<tokio::sync::Mutex<PostState>>,
    all: tokio::sync::RwLock<()>,
}

impl Posts {
    /// Writes posts 1..=n in version 0 (before any reader starts).
    pub async fn seed(
        fleet: &Fleet,
        n: i64,
        history: &Mutex<History>,
        clock: Clock,
    ) -> anyhow::Result<Self> {
        let mut conn = fleet.connect("coherence-seed").await?;
        let began = clock.now();
        let rows: Vec<Change> = (1..=n)
            .map(|post| Change {
                post,
                seq: 0,
                exists: true,
            })
            .collect();
        copy(&mut conn, &rows).await?;
        let committed = clock.now();
        let mut history = history.lock().unwrap();
        for change in &rows {
            history.commit(change.post, change.version(began, committed, 0));
        }
        Ok(Self {
            n,
            states: (0..n)
                .map(|_| {
                    tokio::sync::Mutex::new(PostState {
                        seq: 0,
                        exists: true,
                    })
                })
                .collect(),
            all: tokio::sync::RwLock::new(()),
        })
    }
}

/// A post's state after a transaction.
#[derive(Debug, Clone, Copy)]
struct Change {
    post: i64,
    seq: u32,
    exists: bool,
}

impl Change {
    fn version(&self, began: Duration, committed: Duration, lsn: u64) -> Version {
        Version {
            seq: self.seq,
            exists: self.exists,
            began,
            committed,
            lsn,
        }
    }
}

/// The writes made, by kind: committed, and rolled back (their COMMIT
/// failed and the rows said so), and how many were settled by reading the
/// rows back.
#[derive(Default)]
pub struct Tally {
    kinds: Mutex<BTreeMap<&'static str, (u64, u64)>>,
    settled: Mutex<u64>,
}

impl Tally {
    fn count(&self, kind: &'static str, committed: bool) {
        let mut kinds = self.kinds.lock().unwrap();
        let entry = kinds.entry(kind).or_default();
        if committed {
            entry.0 += 1;
        } else {
            entry.1 += 1;
        }
    }

    /// (kind, committed, rolled back), by kind.
    pub fn kinds(&self) -> Vec<(&'static str, u64, u64)> {
        let kinds = self.kinds.lock().unwrap();
        kinds.iter().map(|(k, (c, r))| (*k, *c, *r)).collect()
    }

    pub fn settled(&self) -> u64 {
        *self.settled.lock().unwrap()
    }
}

/// One statement of a transaction.
enum Statement {
    /// UPDATE of one row or of many (one statement).
    Update(Vec<(i64, u32)>),
    Delete(Vec<i64>),
    Insert(i64, u32),
    Copy(Vec<(i64, u32)>),
    Truncate,
}

/// A transaction the writer is about to run: its statements, and what it
/// leaves of each post.
struct Plan {
    kind: &'static str,
    statements: Vec<Statement>,
    after: Vec<Change>,
}

/// What the writers and the reseeder share: the fleet they write to, the
/// posts' states they write by, the history and the tally they record
/// their writes in, and the clock that times them.
#[derive(Clone)]
pub struct Shared {
    pub fleet: Arc<Fleet>,
    pub posts: Arc<Posts>,
    pub history: Arc<Mutex<History>>,
    pub tally: Arc<Tally>,
    pub clock: Clock,
}

pub struct Writer {
    name: String,
    shared: Shared,
    rng: StdRng,
    zipf: Zipf,
    pause: Duration,
    conn: Option<PgConnection>,
    /// `--read-your-writes`: each write is read at once with its position.
    ryw: Option<Ryw>,
}

impl Writer {
    pub fn new(
        index: usize,
        shared: Shared,
        rng: StdRng,
        pause: Duration,
        ryw: Option<Ryw>,
    ) -> Self {
        let zipf = Zipf::new(shared.posts.n as usize, 1.0);
        Self {
            name: format!("coherence-writer-{index}"),
            shared,
            rng,
            zipf,
            pause,
            conn: None,
            ryw,
        }
    }

    pub async fn run(mut self, stop: CancellationToken) -> anyhow::Result<()> {
        while !stop.is_cancelled() {
            self.write_once(&stop).await?;
            let pause = self.pause.mul_f64(self.rng.random_range(0.0..2.0));
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        Ok(())
    }

    /// Distinct posts, Zipf-drawn, in id order.
    fn pick(&mut self, how_many: usize) -> Vec<i64> {
        let mut posts: Vec<i64> = (0..how_many)
            .map(|_| self.zipf.sample(&mut self.rng))
            .collect();
        posts.sort_unstable();
        posts.dedup();
        posts
    }

    async fn write_once(&mut self, stop: &CancellationToken) -> anyhow::Result<()> {
        let roll = self.rng.random_range(0..100);
        let picked = match roll {
            0..40 => self.pick(1),
            40..55 => {
                let n = self.rng.random_range(2..=8);
                self.pick(n)
            }
            55..65 => self.pick(1),
            65..85 => {
                let n = self.rng.random_range(2..=4);
                self.pick(n)
            }
            85..95 => {
                let n = self.rng.random_range(1..=5);
                self.pick(n)
            }
            _ => self.pick(1),
        };
        let posts = self.shared.posts.clone();
        let _writing = posts.all.read().await;
        let mut guards = Vec::with_capacity(picked.len());
        for &post in &picked {
            guards.push(posts.states[post as usize - 1].lock().await);
        }
        let states: Vec<(i64, PostState)> =
            picked.iter().zip(&guards).map(|(p, g)| (*p, **g)).collect();
        let plan = self.plan(roll, &states);
        let Some((after, lsn)) = self.run_plan(&plan, stop).await? else {
            return Ok(());
        };
        for change in &after {
            let i = picked.iter().position(|p| *p == change.post);
            let guard = &mut guards[i.expect("a post picked")];
            guard.seq = change.seq;
            guard.exists = change.exists;
        }
        drop(guards);
        drop(_writing);
        // Read your writes: one post written, read at once on an instance
        // with the write's position (the posts are let go first: the read
        // may wait for the feed, and other writers must not).
        if let (Some(ryw), true) = (&self.ryw, lsn != 0) {
            let post = after[self.rng.random_range(0..after.len())].post;
            let target = ryw.pick(&mut self.rng);
            let mut errors = Errors::default();
            let read = read_one_at(&target, post, Some(lsn), self.shared.clock, &mut errors).await;
            ryw.record(read, lsn, true, errors);
        }
        Ok(())
    }

    /// What to write, given the posts' states: the kind rolled, or what
    /// the state allows (an absent post is inserted).
    fn plan(&mut self, roll: u32, states: &[(i64, PostState)]) -> Plan {
        let next = |(post, s): (i64, PostState), exists: bool| Change {
            post,
            seq: s.seq + 1,
            exists,
        };
        let upsert = |c: Change| {
            if states.iter().any(|(p, s)| *p == c.post && s.exists) {
                Statement::Update(vec![(c.post, c.seq)])
            } else {
                Statement::Insert(c.post, c.seq)
            }
        };
        match roll {
            // An UPDATE of one row (an INSERT where it is deleted).
            0..40 => {
                let c = next(states[0], true);
                Plan {
                    kind: if states[0].1.exists {
                        "update"
                    } else {
                        "insert"
                    },
                    statements: vec![upsert(c)],
                    after: vec![c],
                }
            }
            // One UPDATE of many rows (those that exist).
            40..55 => {
                let after: Vec<Change> = states
                    .iter()
                    .filter(|(_, s)| s.exists)
                    .map(|&st| next(st, true))
                    .collect();
                Plan {
                    kind: "update many",
                    statements: vec![Statement::Update(
                        after.iter().map(|c| (c.post, c.seq)).collect(),
                    )],
                    after,
                }
            }
            // A DELETE (an INSERT of a deleted id).
            55..65 => {
                let st = states[0];
                let c = next(st, !st.1.exists);
                Plan {
                    kind: if st.1.exists { "delete" } else { "insert" },
                    statements: vec![if st.1.exists {
                        Statement::Delete(vec![st.0])
                    } else {
                        Statement::Insert(st.0, c.seq)
                    }],
                    after: vec![c],
                }
            }
            // A transaction of several statements, one per post: updates,
            // deletes, inserts of deleted ids.
            65..85 => {
                let mut statements = Vec::new();
                let mut after = Vec::new();
                for &st in states {
                    let delete = st.1.exists && self.rng.random_bool(0.3);
                    let c = next(st, !delete);
                    statements.push(if delete {
                        Statement::Delete(vec![st.0])
                    } else {
                        upsert(c)
                    });
                    after.push(c);
                }
                Plan {
                    kind: "transaction",
                    statements,
                    after,
                }
            }
            // COPY of the deleted ids among those picked; a DELETE of them
            // all when none is.
            85..95 => {
                let absent: Vec<Change> = states
                    .iter()
                    .filter(|(_, s)| !s.exists)
                    .map(|&st| next(st, true))
                    .collect();
                if absent.is_empty() {
                    let after: Vec<Change> = states.iter().map(|&st| next(st, false)).collect();
                    Plan {
                        kind: "delete many",
                        statements: vec![Statement::Delete(states.iter().map(|s| s.0).collect())],
                        after,
                    }
                } else {
                    Plan {
                        kind: "copy",
                        statements: vec![Statement::Copy(
                            absent.iter().map(|c| (c.post, c.seq)).collect(),
                        )],
                        after: absent,
                    }
                }
            }
            // One row written twice in one transaction: the first version
            // is never committed, and must never be seen.
            _ => {
                let st = states[0];
                let first = next(st, true);
                let second = Change {
                    seq: first.seq + 1,
                    ..first
                };
                Plan {
                    kind: "written twice",
                    statements: vec![upsert(first), Statement::Update(vec![(st.0, second.seq)])],
                    after: vec![second],
                }
            }
        }
    }

    /// Runs a plan as one transaction: what it left of each post when it
    /// committed (versions recorded), and the position read after its
    /// COMMIT returned (0: not known); `None` when it did not commit.
    async fn run_plan(
        &mut self,
        plan: &Plan,
        stop: &CancellationToken,
    ) -> anyhow::Result<Option<(Vec<Change>, u64)>> {
        if plan.after.is_empty() {
            return Ok(None);
        }
        let clock = self.shared.clock;
        let Some(conn) = self.connection(stop).await else {
            return Ok(None);
        };
        let began = clock.now();
        let done = transaction(conn, &plan.statements).await;
        let mut lsn = 0;
        let committed = match done {
            Ok(()) => {
                let committed = clock.now();
                lsn = position_now(conn).await;
                Some(committed)
            }
            Err(error) => {
                tracing::debug!(%error, writer = self.name, "a write failed; settling it");
                self.conn = None;
                *self.shared.tally.settled.lock().unwrap() += 1;
                settle(&self.shared.fleet, &self.name, &plan.after, clock).await?
            }
        };
        self.shared.tally.count(plan.kind, committed.is_some());
        let Some(committed) = committed else {
            return Ok(None);
        };
        let mut history = self.shared.history.lock().unwrap();
        for change in &plan.after {
            history.commit(change.post, change.version(began, committed, lsn));
        }
        drop(history);
        if let Some(ryw) = &self.ryw {
            ryw.latest.fetch_max(lsn, Ordering::SeqCst);
        }
        Ok(Some((plan.after.clone(), lsn)))
    }

    /// The writer's connection, made again after a failure (while
    /// PostgreSQL restarts, say); `None` once stopped.
    async fn connection(&mut self, stop: &CancellationToken) -> Option<&mut PgConnection> {
        while self.conn.is_none() {
            match self.shared.fleet.connect(&self.name).await {
                Ok(conn) => self.conn = Some(conn),
                Err(_) => {
                    tokio::select! {
                        _ = stop.cancelled() => return None,
                        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    }
                }
            }
        }
        self.conn.as_mut()
    }
}

/// Runs the statements in one transaction.
async fn transaction(conn: &mut PgConnection, statements: &[Statement]) -> anyhow::Result<()> {
    let mut tx = conn.begin().await?;
    for statement in statements {
        match statement {
            Statement::Update(rows) if rows.len() == 1 => {
                let (post, seq) = rows[0];
                sqlx::query(
                    "update posts set title = $2, body = $3, updated_at = now() where id = $1",
                )
                .bind(post)
                .bind(title(post, seq))
                .bind(body(post, seq))
                .execute(&mut *tx)
                .await?;
            }
            Statement::Update(rows) => {
                let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
                let titles: Vec<String> = rows.iter().map(|&(p, s)| title(p, s)).collect();
                let bodies: Vec<String> = rows.iter().map(|&(p, s)| body(p, s)).collect();
                sqlx::query(
                    "update posts p set title = u.title, body = u.body, updated_at = now()
                     from unnest($1::bigint[], $2::text[], $3::text[]) as u(id, title, body)
                     where p.id = u.id",
                )
                .bind(ids)
                .bind(titles)
                .bind(bodies)
                .execute(&mut *tx)
                .await?;
            }
            Statement::Delete(ids) => {
                sqlx::query("delete from posts where id = any($1)")
                    .bind(ids)
                    .execute(&mut *tx)
                    .await?;
            }
            Statement::Insert(post, seq) => {
                sqlx::query(
                    "insert into posts (id, title, body, author) values ($1, $2, $3, 'coherence')",
                )
                .bind(post)
                .bind(title(*post, *seq))
                .bind(body(*post, *seq))
                .execute(&mut *tx)
                .await?;
            }
            Statement::Copy(rows) => {
                let rows: Vec<Change> = rows
                    .iter()
                    .map(|&(post, seq)| Change {
                        post,
                        seq,
                        exists: true,
                    })
                    .collect();
                copy(&mut tx, &rows).await?;
            }
            Statement::Truncate => {
                sqlx::query("truncate posts").execute(&mut *tx).await?;
            }
        }
    }
    tx.commit().await?;
    Ok(())
}

/// COPY of rows into `posts`.
async fn copy(conn: &mut PgConnection, rows: &[Change]) -> anyhow::Result<()> {
    let mut data = String::new();
    for c in rows {
        data.push_str(&format!(
            "{}\t{}\t{}\tcoherence\n",
            c.post,
            title(c.post, c.seq),
            body(c.post, c.seq)
        ));
    }
    let mut copy = conn
        .copy_in_raw("copy posts (id, title, body, author) from stdin")
        .await?;
    copy.send(data.into_bytes()).await?;
    copy.finish().await?;
    Ok(())
}

/// Whether a transaction whose COMMIT's answer was lost committed: once
/// the writer's session is gone (ended by PostgreSQL, or here), the rows
/// say. When it did, the instant the rows were read (its commit was
/// earlier).
async fn settle(
    fleet: &Fleet,
    writer: &str,
    after: &[Change],
    clock: Clock,
) -> anyhow::Result<Option<Duration>> {
    let started = Instant::now();
    loop {
        match settle_once(fleet, writer, after).await {
            Ok(committed) => return Ok(committed.then(|| clock.now())),
            Err(error) if started.elapsed() < SETTLE_LIMIT => {
                tracing::debug!(%error, "could not settle a write yet");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => return Err(error.context("a write could not be settled")),
        }
    }
}

async fn settle_once(fleet: &Fleet, writer: &str, after: &[Change]) -> anyhow::Result<bool> {
    let mut conn = fleet.connect("coherence-settle").await?;
    // The session that ran it ends first: then its transaction is over.
    sqlx::query(
        "select pg_terminate_backend(pid) from pg_stat_activity
         where application_name = $1 and pid <> pg_backend_pid()",
    )
    .bind(writer)
    .execute(&mut conn)
    .await?;
    let gone: bool = sqlx::query_scalar(
        "select not exists (select 1 from pg_stat_activity where application_name = $1)",
    )
    .bind(writer)
    .fetch_one(&mut conn)
    .await?;
    if !gone {
        bail!("the writer's session has not ended yet");
    }
    let ids: Vec<i64> = after.iter().map(|c| c.post).collect();
    let rows: Vec<(i64, String)> = sqlx::query_as("select id, title from posts where id = any($1)")
        .bind(&ids)
        .fetch_all(&mut conn)
        .await?;
    let shows = |c: &Change| {
        let row = rows.iter().find(|(id, _)| *id == c.post);
        match row {
            Some((_, t)) => c.exists && *t == title(c.post, c.seq),
            None => !c.exists,
        }
    };
    let committed = after.iter().filter(|c| shows(c)).count();
    if committed != 0 && committed != after.len() {
        bail!(
            "a transaction half committed: {committed} of {} rows",
            after.len()
        );
    }
    Ok(committed == after.len())
}

/// Now and then (once in a short run, midway; every 2 minutes in a long
/// one), every post at once: a TRUNCATE, then a re-seed by COPY in a
/// transaction of its own, every writer held off meanwhile.
pub async fn reseed_now_and_then(
    shared: Shared,
    run: Duration,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let Shared {
        fleet,
        posts,
        history,
        tally,
        clock,
    } = shared;
    let every = if run < Duration::from_secs(240) {
        run / 2
    } else {
        Duration::from_secs(120)
    };
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = tokio::time::sleep(every) => {}
        }
        let _all = posts.all.write().await;
        let mut guards = Vec::new();
        for state in &posts.states {
            guards.push(state.lock().await);
        }
        const NAME: &str = "coherence-reseed";
        let mut conn = connect_patiently(&fleet, NAME).await?;
        for (kind, deleting) in [("truncate", true), ("reseed", false)] {
            let after: Vec<Change> = guards
                .iter()
                .enumerate()
                .filter(|(_, g)| g.exists == deleting)
                .map(|(i, g)| Change {
                    post: i as i64 + 1,
                    seq: g.seq + 1,
                    exists: !deleting,
                })
                .collect();
            let statement = if deleting {
                Statement::Truncate
            } else {
                Statement::Copy(after.iter().map(|c| (c.post, c.seq)).collect())
            };
            let began = clock.now();
            let mut lsn = 0;
            let committed = match transaction(&mut conn, &[statement]).await {
                Ok(()) => {
                    let committed = clock.now();
                    lsn = position_now(&mut conn).await;
                    Some(committed)
                }
                Err(_) => {
                    let settled = settle(&fleet, NAME, &after, clock).await?;
                    conn = connect_patiently(&fleet, NAME).await?;
                    settled
                }
            };
            tally.count(kind, committed.is_some());
            if let Some(committed) = committed {
                let mut history = history.lock().unwrap();
                for change in &after {
                    history.commit(change.post, change.version(began, committed, lsn));
                    let guard = &mut guards[change.post as usize - 1];
                    guard.seq = change.seq;
                    guard.exists = change.exists;
                }
            }
            // Long enough for readers to see the empty table.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The primary's WAL position, read on the writer's connection once its
/// COMMIT returned, as an application hands it to its client (0: the
/// connection failed meanwhile: not known).
async fn position_now(conn: &mut PgConnection) -> u64 {
    sqlx::query_scalar::<_, i64>("select (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
        .fetch_one(conn)
        .await
        .map_or(0, |lsn| u64::try_from(lsn).unwrap_or(0))
}

/// A connection to the primary, waiting out a restart (at most SETTLE_LIMIT).
async fn connect_patiently(fleet: &Fleet, name: &str) -> anyhow::Result<PgConnection> {
    let started = Instant::now();
    loop {
        match fleet.connect(name).await {
            Ok(conn) => return Ok(conn),
            Err(_) if started.elapsed() < SETTLE_LIMIT => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(error) => return Err(error).context("no connection to PostgreSQL"),
        }
    }
}
