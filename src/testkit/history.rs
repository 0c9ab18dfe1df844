//! Test support: the coherence checker's history and its verdict (pure,
//! no server): every version a writer committed, every read a client made,
//! the faults in force, and what the reads say against them.
//!
//! Each post's versions are numbered in commit order (the writers of the
//! checker write one post at a time, so the order they see is the
//! database's). A read is judged against the version it returned:
//!
//! - **phantom**: a version that was never committed, one whose write had
//!   not begun when the read ended, a body of another version than its
//!   title (two versions mixed), another post's row, or a 404 for a post
//!   that existed throughout the read;
//! - **staleness**: how long before the read began the first newer version
//!   had committed (0 when none had). A 404 is matched to the latest
//!   deletion it may have seen, the most favourable reading;
//! - **regression**: on one instance (one process: a restarted instance is
//!   another), a read that began after another had ended returned an older
//!   version of the post than that one had. A 404 is then read both ways
//!   in the reads' favour: as the oldest deletion the earlier read may have
//!   served within the staleness bound, and the latest for the later one.
//!   Every regression is a violation, under a fault as outside one;
//! - **resurrection**: a read marked stale (below) that returned a version
//!   of a post whose deletion had committed before the read began: a
//!   deleted post is never served again, not even from a fail-safe copy;
//! - **a position not reflected**: an answer whose `PostCache-LSN` names a
//!   position at or past the one a writer read after committing a version
//!   newer than the answer's.
//!
//! Reads the service marked stale (`X-Cache: stale`, or listed in a batch's
//! `stale`: a fail-safe copy while loads fail, or a stale-while-revalidate
//! answer) say so to their client: they are counted apart, and judged for
//! phantoms, resurrections and regressions, not staleness.
//!
//! Requests that got no answer to judge (a 5xx, a refused or cut
//! connection) are [`Unjudged`]: counted by class, inside and outside the
//! fault windows.

use std::{collections::HashMap, fmt::Write as _, time::Duration};

/// One version of a post, as its writer saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Version {
    /// Its number: 0 for the seed, then one more per write of the post.
    pub seq: u32,
    /// `false` for a deletion (a DELETE or a TRUNCATE).
    pub exists: bool,
    /// When its transaction began.
    pub began: Duration,
    /// When its COMMIT returned (or, when the COMMIT's answer was lost,
    /// when the checker saw the row had it: later, never earlier).
    pub committed: Duration,
    /// The WAL position its writer read once its COMMIT returned
    /// (`pg_current_wal_lsn()`, bytes from 0/0: at or past its commit), as
    /// an application hands it to its client; 0 when not known (the
    /// COMMIT's answer was lost, or the seed).
    pub lsn: u64,
}

/// Every committed version of every post, in commit order per post.
#[derive(Debug, Default)]
pub struct History {
    posts: HashMap<i64, Vec<Version>>,
}

impl History {
    /// Records a committed version; versions of a post come in order.
    pub fn commit(&mut self, post: i64, version: Version) {
        let versions = self.posts.entry(post).or_default();
        assert!(
            versions.last().is_none_or(|last| last.seq < version.seq),
            "versions of post {post} recorded out of order"
        );
        versions.push(version);
    }

    pub fn versions(&self, post: i64) -> &[Version] {
        self.posts.get(&post).map_or(&[], Vec::as_slice)
    }

    /// Committed versions in all, the seeds aside.
    pub fn writes(&self) -> usize {
        self.posts.values().map(|v| v.len().saturating_sub(1)).sum()
    }

    /// How many posts the transaction that committed `version` wrote (by
    /// its commit and its writer's position): 1 for a single post, every
    /// post for a TRUNCATE.
    pub fn written_with(&self, version: &Version) -> usize {
        self.posts
            .values()
            .filter(|versions| {
                versions
                    .iter()
                    .any(|v| v.lsn == version.lsn && v.committed == version.committed && v.seq > 0)
            })
            .count()
    }

    /// The last version of each post.
    pub fn finals(&self) -> impl Iterator<Item = (i64, &Version)> {
        self.posts
            .iter()
            .filter_map(|(post, v)| v.last().map(|last| (*post, last)))
    }
}

/// What a read returned for one post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// The post, in the version numbered so (title and body agree).
    Found(u32),
    /// 404, or listed in `not_found`.
    Missing,
    /// A body that cannot be a version of this post.
    Garbled(Garble),
}

/// How a body cannot be a version of the post asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Garble {
    /// Its title and body carry different versions.
    Mixed,
    /// It is another post's row.
    OtherPost,
    /// It does not read as a post of the checker's.
    Unreadable,
}

/// How the service said it served the read (`X-Cache`, with
/// `X-Cache-Tier` for hits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Served {
    Memory,
    Redis,
    /// The existence guard's 404.
    Guard,
    Miss,
    Coalesced,
    Bypass,
    /// `X-Cache: stale`: marked stale for the client.
    Stale,
    /// None of the above (a batch read's parts).
    Other,
}

impl Served {
    /// From `X-Cache` and `X-Cache-Tier`.
    pub fn from_headers(x_cache: Option<&str>, tier: Option<&str>) -> Self {
        match (x_cache, tier) {
            (Some("hit"), Some("memory")) => Self::Memory,
            (Some("hit"), Some("guard")) => Self::Guard,
            (Some("hit"), _) => Self::Redis,
            (Some("miss"), _) => Self::Miss,
            (Some("coalesced"), _) => Self::Coalesced,
            (Some("bypass"), _) => Self::Bypass,
            (Some("stale"), _) => Self::Stale,
            _ => Self::Other,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Memory => "hit (memory)",
            Self::Redis => "hit (redis)",
            Self::Guard => "hit (guard)",
            Self::Miss => "miss",
            Self::Coalesced => "coalesced",
            Self::Bypass => "bypass",
            Self::Stale => "stale",
            Self::Other => "batch",
        }
    }
}

/// One post as one read returned it (a batch read is a read per post, with
/// the batch's times).
#[derive(Debug, Clone, Copy)]
pub struct Read {
    pub post: i64,
    /// Which instance, and which process of it (restarts count up).
    pub instance: u8,
    pub incarnation: u16,
    pub began: Duration,
    pub ended: Duration,
    pub seen: Seen,
    pub served: Served,
    pub batch: bool,
    /// The answer's `PostCache-LSN` (bytes from 0/0; 0: none).
    pub lsn: u64,
}

/// A request that got no answer to judge: a 5xx, a 504, a refused or cut
/// connection, an unreadable body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unjudged {
    /// When the request began.
    pub at: Duration,
    pub instance: u8,
    /// Why, in a few words (`status 503`, `connection failed`).
    pub class: String,
}

/// The unjudged requests, inside and outside the fault windows, by class.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnjudgedTally {
    pub outside: std::collections::BTreeMap<String, usize>,
    pub inside: std::collections::BTreeMap<String, usize>,
}

impl UnjudgedTally {
    pub fn outside_total(&self) -> usize {
        self.outside.values().sum()
    }

    pub fn inside_total(&self) -> usize {
        self.inside.values().sum()
    }
}

/// Counts `unjudged` inside and outside the windows (each window from its
/// injection until it has healed and converged, as for the reads).
pub fn tally_unjudged(unjudged: &[Unjudged], windows: &[Window], bounds: Bounds) -> UnjudgedTally {
    let mut tally = UnjudgedTally::default();
    for u in unjudged {
        let inside = windows
            .iter()
            .any(|w| w.injected <= u.at && u.at <= w.healed + bounds.converge);
        let side = if inside {
            &mut tally.inside
        } else {
            &mut tally.outside
        };
        *side.entry(u.class.clone()).or_default() += 1;
    }
    tally
}

/// A read that asked for every commit up to a WAL position
/// (`PostCache-Min-LSN`): read your writes.
#[derive(Debug, Clone, Copy)]
pub struct PositionRead {
    pub read: Read,
    pub min_lsn: u64,
    /// Sent by a writer right after its own write (else by a reader, with
    /// the position of the latest write it knew of or saw).
    pub by_writer: bool,
    /// The answer went past the cache (`Cache-Status: …detail=position`).
    pub past: bool,
}

/// A position read that returned a version older than one it was owed: a
/// version committed at or before its position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unmet {
    /// Its index among the position reads.
    pub read: usize,
    /// The newest version of the post whose position is at or before the
    /// read's.
    pub owed: u32,
}

/// Judges the answers that said a position (`PostCache-LSN`): each must
/// reflect every version whose writer's position is at or before it (as
/// [`check_positions`] judges the reads that asked for one). Returns the
/// answers that did not, as position reads.
pub fn check_said_positions(history: &History, reads: &[Read]) -> Vec<PositionRead> {
    let said: Vec<PositionRead> = reads
        .iter()
        .filter(|read| read.lsn != 0)
        .map(|read| PositionRead {
            read: *read,
            min_lsn: read.lsn,
            by_writer: false,
            past: false,
        })
        .collect();
    check_positions(history, &said)
        .into_iter()
        .map(|unmet| said[unmet.read])
        .collect()
}

/// Judges reads that asked for a position: each must return the newest
/// version whose writer's position is at or before the read's, or a newer
/// one (a 404 must match a deletion that new or newer, begun before the
/// read ended). Versions whose position is not known owe nothing.
pub fn check_positions(history: &History, reads: &[PositionRead]) -> Vec<Unmet> {
    let mut unmet = Vec::new();
    for (index, position_read) in reads.iter().enumerate() {
        let read = &position_read.read;
        let versions = history.versions(read.post);
        let Some(owed) = versions
            .iter()
            .filter(|v| v.lsn != 0 && v.lsn <= position_read.min_lsn)
            .map(|v| v.seq)
            .max()
        else {
            continue;
        };
        let met = match read.seen {
            Seen::Found(seq) => seq >= owed,
            Seen::Missing => versions
                .iter()
                .any(|v| !v.exists && v.seq >= owed && v.began < read.ended),
            // Judged as phantoms with the other reads.
            Seen::Garbled(_) => true,
        };
        if !met {
            unmet.push(Unmet { read: index, owed });
        }
    }
    unmet
}

/// A fault, from its injection until the fleet was seen healthy again.
#[derive(Debug, Clone)]
pub struct Window {
    pub kind: &'static str,
    /// What exactly was done (which instance, how long).
    pub what: String,
    pub injected: Duration,
    pub healed: Duration,
    /// The staleness documented for reads while it is in force.
    pub bound: Duration,
}

/// What the reads are judged by.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Staleness allowed outside any fault.
    pub normal: Duration,
    /// After a fault heals, how long its bound still holds: the fleet must
    /// serve within the normal bound again after that.
    pub converge: Duration,
}

/// Why a read is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    Phantom(Phantom),
    /// Staler than the bound in force, by this much.
    Stale {
        by: Duration,
        bound: Duration,
    },
    /// Older than what read `after` returned, on the same process, which
    /// had ended before this one began.
    Regression {
        after: usize,
    },
    /// Marked stale, a version of a post whose deletion (version
    /// `deleted`) had committed before the read began.
    Resurrected {
        deleted: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phantom {
    Garbled(Garble),
    /// A version no transaction committed.
    NeverCommitted(u32),
    /// A version whose write began after the read ended.
    FromTheFuture(u32),
    /// 404 for a post that existed throughout the read.
    MissingThroughout,
}

/// One read judged wrong.
#[derive(Debug, Clone, Copy)]
pub struct Violation {
    pub read: usize,
    pub problem: Problem,
    /// The fault window in force at the read's start, if any.
    pub window: Option<usize>,
}

/// Per fault window: how stale its reads were, and how soon after it
/// healed the fleet was within the normal bound again.
#[derive(Debug, Clone, Default)]
pub struct WindowFigures {
    pub reads: usize,
    pub max_staleness: Duration,
    /// Reads staler than the normal bound, by how they were served.
    pub stale_by: std::collections::BTreeMap<Served, usize>,
    /// Regressions begun in the window (each a violation).
    pub regressions: usize,
    /// The last read begun after the heal that was staler than the normal
    /// bound: how long after the heal it began (zero: none).
    pub converged_after: Duration,
}

/// The verdict on a history.
#[derive(Debug, Default)]
pub struct Verdict {
    pub reads: usize,
    pub violations: Vec<Violation>,
    /// Reads outside every fault window, and how stale they were.
    pub normal_reads: usize,
    pub normal_staleness: Vec<Duration>,
    /// Reads staler than the normal bound outside fault windows.
    pub normal_stale: usize,
    pub windows: Vec<WindowFigures>,
    /// Reads marked stale by the service (`X-Cache: stale`), and those of
    /// them that were older than the latest version.
    pub marked_stale: usize,
    pub marked_stale_old: usize,
    /// How each read was served, and how many of each were stale at all.
    pub by_served: Vec<(Served, usize, usize)>,
}

impl Verdict {
    pub fn phantoms(&self) -> usize {
        self.count(|p| matches!(p, Problem::Phantom(_)))
    }

    pub fn stale(&self) -> usize {
        self.count(|p| matches!(p, Problem::Stale { .. }))
    }

    pub fn regressions(&self) -> usize {
        self.count(|p| matches!(p, Problem::Regression { .. }))
    }

    pub fn resurrections(&self) -> usize {
        self.count(|p| matches!(p, Problem::Resurrected { .. }))
    }

    fn count(&self, which: impl Fn(&Problem) -> bool) -> usize {
        self.violations.iter().filter(|v| which(&v.problem)).count()
    }

    /// Reads within the normal bound outside fault windows, as nines
    /// (−log10 of the share that was not); `None` with no stale read
    /// (then at least this many: see [`Verdict::nines_at_least`]).
    pub fn nines(&self) -> Option<f64> {
        (self.normal_stale > 0)
            .then(|| -(self.normal_stale as f64 / self.normal_reads.max(1) as f64).log10())
    }

    /// With no stale read, the nines the count of reads proves.
    pub fn nines_at_least(&self) -> f64 {
        (self.normal_reads.max(1) as f64).log10()
    }
}

/// Which version of `versions` a read that saw `seen` returned, most
/// favourably: its index, or the phantom it is.
fn matched(versions: &[Version], seen: Seen, ended: Duration) -> Result<usize, Phantom> {
    match seen {
        Seen::Garbled(g) => Err(Phantom::Garbled(g)),
        Seen::Found(seq) => {
            let i = versions
                .binary_search_by_key(&seq, |v| v.seq)
                .map_err(|_| Phantom::NeverCommitted(seq))?;
            if !versions[i].exists {
                return Err(Phantom::NeverCommitted(seq));
            }
            if versions[i].began > ended {
                return Err(Phantom::FromTheFuture(seq));
            }
            Ok(i)
        }
        // The latest deletion whose write had begun when the read ended.
        Seen::Missing => versions
            .iter()
            .rposition(|v| !v.exists && v.began <= ended)
            .ok_or(Phantom::MissingThroughout),
    }
}

/// The oldest version a read that saw `seen` may have returned, given
/// version `i` is the latest (see [`matched`]): for a 404, the oldest
/// deletion it may have served within `bound` of staleness.
fn earliest(versions: &[Version], seen: Seen, began: Duration, i: usize, bound: Duration) -> usize {
    if seen != Seen::Missing {
        return i;
    }
    (0..=i)
        .find(|&j| !versions[j].exists && staleness(versions, j, began) <= bound)
        .unwrap_or(i)
}

/// How stale a read of version `i` that began at `began` was: how long
/// before it the next version had committed.
fn staleness(versions: &[Version], i: usize, began: Duration) -> Duration {
    versions
        .get(i + 1)
        .map_or(Duration::ZERO, |next| began.saturating_sub(next.committed))
}

/// Judges every read against the history and the fault windows.
pub fn check(history: &History, reads: &[Read], windows: &[Window], bounds: Bounds) -> Verdict {
    let mut verdict = Verdict {
        reads: reads.len(),
        windows: vec![WindowFigures::default(); windows.len()],
        ..Verdict::default()
    };
    // The window in force at an instant: the one with the largest bound
    // among those begun and not yet converged.
    let in_force = |at: Duration| -> Option<usize> {
        windows
            .iter()
            .enumerate()
            .filter(|(_, w)| w.injected <= at && at <= w.healed + bounds.converge)
            .max_by_key(|(_, w)| w.bound)
            .map(|(i, _)| i)
    };
    let mut served: HashMap<Served, (usize, usize)> = HashMap::new();
    // Each read's matched versions (the oldest and the latest it may have
    // returned), for the regressions.
    let mut index: Vec<Option<(usize, usize)>> = vec![None; reads.len()];
    for (r, read) in reads.iter().enumerate() {
        let versions = history.versions(read.post);
        let window = in_force(read.began);
        let i = match matched(versions, read.seen, read.ended) {
            Ok(i) => i,
            Err(phantom) => {
                verdict.violations.push(Violation {
                    read: r,
                    problem: Problem::Phantom(phantom),
                    window,
                });
                continue;
            }
        };
        let stale = staleness(versions, i, read.began);
        let tally = served.entry(read.served).or_default();
        tally.0 += 1;
        tally.1 += usize::from(stale > Duration::ZERO);
        if read.served == Served::Stale {
            verdict.marked_stale += 1;
            verdict.marked_stale_old += usize::from(stale > Duration::ZERO);
            // Older, but never a deleted post's old body once the deletion
            // is past the staleness bound in force (until then the cache
            // may not have heard of it).
            let bound = window.map_or(bounds.normal, |w| windows[w].bound);
            let deleted = versions[i + 1..]
                .iter()
                .find(|v| !v.exists && read.began.saturating_sub(v.committed) > bound);
            if let (Seen::Found(_), Some(deletion)) = (read.seen, deleted) {
                verdict.violations.push(Violation {
                    read: r,
                    problem: Problem::Resurrected {
                        deleted: deletion.seq,
                    },
                    window,
                });
            }
            // Stale, but never older than what the process served before.
            index[r] = Some((earliest(versions, read.seen, read.began, i, bound), i));
            continue;
        }
        let bound = match window {
            Some(w) => {
                let figures = &mut verdict.windows[w];
                figures.reads += 1;
                figures.max_staleness = figures.max_staleness.max(stale);
                if stale > bounds.normal {
                    *figures.stale_by.entry(read.served).or_default() += 1;
                }
                let since_heal = read.began.saturating_sub(windows[w].healed);
                if read.began > windows[w].healed && stale > bounds.normal {
                    figures.converged_after = figures.converged_after.max(since_heal);
                }
                windows[w].bound
            }
            None => {
                verdict.normal_reads += 1;
                verdict.normal_staleness.push(stale);
                verdict.normal_stale += usize::from(stale > bounds.normal);
                bounds.normal
            }
        };
        index[r] = Some((earliest(versions, read.seen, read.began, i, bound), i));
        if stale > bound {
            verdict.violations.push(Violation {
                read: r,
                problem: Problem::Stale { by: stale, bound },
                window,
            });
        }
    }
    regressions(reads, &index, |r| in_force(reads[r].began), &mut verdict);
    verdict.violations.sort_by_key(|v| reads[v.read].began);
    let mut by_served: Vec<_> = served.into_iter().map(|(s, (n, o))| (s, n, o)).collect();
    by_served.sort();
    verdict.by_served = by_served;
    verdict.normal_staleness.sort();
    verdict
}

/// Per process, in order of the reads' starts: a read older than what an
/// earlier read of the same post on the same process, ended before it
/// began, returned.
fn regressions(
    reads: &[Read],
    index: &[Option<(usize, usize)>],
    in_force: impl Fn(usize) -> Option<usize>,
    verdict: &mut Verdict,
) {
    let mut processes: HashMap<(u8, u16), Vec<usize>> = HashMap::new();
    for (r, read) in reads.iter().enumerate() {
        if index[r].is_some() {
            processes
                .entry((read.instance, read.incarnation))
                .or_default()
                .push(r);
        }
    }
    for (_, mut by_start) in processes {
        let mut by_end = by_start.clone();
        by_start.sort_by_key(|&r| reads[r].began);
        by_end.sort_by_key(|&r| reads[r].ended);
        // Per post: the newest version index returned so far, and by which read.
        let mut newest: HashMap<i64, (usize, usize)> = HashMap::new();
        let mut ended = by_end.iter().peekable();
        for &r in &by_start {
            while let Some(&&e) = ended.peek() {
                if reads[e].ended >= reads[r].began {
                    break;
                }
                let (seen, _) = index[e].expect("only matched reads");
                let best = newest.entry(reads[e].post).or_insert((seen, e));
                if seen > best.0 {
                    *best = (seen, e);
                }
                ended.next();
            }
            let (_, i) = index[r].expect("only matched reads");
            if let Some(&(before, after)) = newest.get(&reads[r].post) {
                if i < before {
                    let window = in_force(r);
                    if let Some(w) = window {
                        verdict.windows[w].regressions += 1;
                    }
                    verdict.violations.push(Violation {
                        read: r,
                        problem: Problem::Regression { after },
                        window,
                    });
                }
            }
        }
    }
}

/// A violation with its history: the read, the post's versions around the
/// one it returned, and the other reads of the post on that instance
/// around it (at most `around` each side).
pub fn explain(
    history: &History,
    reads: &[Read],
    windows: &[Window],
    violation: &Violation,
    around: usize,
) -> String {
    let read = &reads[violation.read];
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1e3);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:?}: post {} on instance {} (process {}), {} read from {} to {}, saw {:?}, served {}",
        violation.problem,
        read.post,
        read.instance,
        read.incarnation,
        if read.batch { "batch" } else { "single" },
        ms(read.began),
        ms(read.ended),
        read.seen,
        read.served.as_str(),
    );
    if let Problem::Regression { after } = violation.problem {
        let o = &reads[after];
        let _ = writeln!(
            out,
            "  after a read from {} to {} that saw {:?}, served {}",
            ms(o.began),
            ms(o.ended),
            o.seen,
            o.served.as_str()
        );
    }
    if let Some(w) = violation.window {
        let w = &windows[w];
        let _ = writeln!(
            out,
            "  in force: {} ({}), injected at {}, healed at {}, bound {}",
            w.kind,
            w.what,
            ms(w.injected),
            ms(w.healed),
            ms(w.bound)
        );
    }
    let versions = history.versions(read.post);
    // From the version the read returned (or the one before the newest it
    // may have seen) to the first that committed after it ended.
    let newest = versions
        .iter()
        .rposition(|v| v.began <= read.ended)
        .unwrap_or(0);
    let from = matched(versions, read.seen, read.ended)
        .unwrap_or(newest)
        .min(newest)
        .saturating_sub(1);
    let to = (newest + 2).min(versions.len());
    let _ = writeln!(out, "  versions of post {} around it:", read.post);
    if to - from > 12 {
        let _ = writeln!(out, "    ({} versions, the first and last 6)", to - from);
    }
    for (i, v) in versions[from..to].iter().enumerate() {
        if to - from > 12 && (6..to - from - 6).contains(&i) {
            continue;
        }
        let _ = writeln!(
            out,
            "    v{} {}: began {}, committed {}",
            v.seq,
            if v.exists { "written" } else { "deleted" },
            ms(v.began),
            ms(v.committed)
        );
    }
    let mut same: Vec<&Read> = reads
        .iter()
        .filter(|o| o.post == read.post && o.instance == read.instance)
        .collect();
    same.sort_by_key(|o| o.began);
    let at = same
        .iter()
        .position(|o| std::ptr::eq(*o, read))
        .unwrap_or(0);
    let _ = writeln!(
        out,
        "  reads of post {} on that instance around it:",
        read.post
    );
    for o in &same[at.saturating_sub(around)..(at + around + 1).min(same.len())] {
        let _ = writeln!(
            out,
            "    {}{} to {} (process {}): {:?}, {}",
            if std::ptr::eq(*o, read) { "> " } else { "  " },
            ms(o.began),
            ms(o.ended),
            o.incarnation,
            o.seen,
            o.served.as_str()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn version(seq: u32, exists: bool, began: u64, committed: u64) -> Version {
        Version {
            seq,
            exists,
            began: ms(began),
            committed: ms(committed),
            // Positions in step with the commit times, for the position
            // reads' checks (the seed's is not known).
            lsn: committed * 1000,
        }
    }

    fn at(min_lsn: u64, read: Read) -> PositionRead {
        PositionRead {
            read,
            min_lsn,
            by_writer: false,
            past: false,
        }
    }

    #[test]
    fn a_position_read_owes_the_newest_version_at_or_before_its_position() {
        let h = history();
        let reads = [
            // Position before v1's: nothing owed past the seed (unknown).
            at(109_000, read(120, 130, Seen::Found(0))),
            // v1 owed: v1 met, the seed not.
            at(110_000, read(120, 130, Seen::Found(1))),
            at(110_000, read(120, 130, Seen::Found(0))),
            // The deletion (v2) owed: a 404 meets it, v1 does not, v3 does.
            at(250_000, read(250, 260, Seen::Missing)),
            at(250_000, read(250, 260, Seen::Found(1))),
            at(400_000, read(400, 410, Seen::Found(3))),
            // v1 owed, and a 404 read after the deletion began meets it.
            at(110_000, read(205, 215, Seen::Missing)),
            // v3 owed: a 404 (the deletion v2 is older) does not meet it.
            at(310_000, read(320, 330, Seen::Missing)),
        ];
        let unmet = check_positions(&h, &reads);
        assert_eq!(
            unmet,
            vec![
                Unmet { read: 2, owed: 1 },
                Unmet { read: 4, owed: 2 },
                Unmet { read: 7, owed: 3 },
            ]
        );
    }

    /// Post 1: seeded at 0, v1 written 100–110, deleted (v2) 200–210,
    /// written again (v3) 300–310.
    fn history() -> History {
        let mut h = History::default();
        h.commit(1, version(0, true, 0, 0));
        h.commit(1, version(1, true, 100, 110));
        h.commit(1, version(2, false, 200, 210));
        h.commit(1, version(3, true, 300, 310));
        h
    }

    fn read(began: u64, ended: u64, seen: Seen) -> Read {
        Read {
            post: 1,
            instance: 0,
            incarnation: 0,
            began: ms(began),
            ended: ms(ended),
            seen,
            served: Served::Redis,
            batch: false,
            lsn: 0,
        }
    }

    const BOUNDS: Bounds = Bounds {
        normal: Duration::from_millis(100),
        converge: Duration::from_millis(1000),
    };

    /// Redis paused from `injected` to `healed` (ms), with a 3 s bound.
    fn paused(injected: u64, healed: u64) -> Window {
        Window {
            kind: "redis paused",
            what: String::new(),
            injected: ms(injected),
            healed: ms(healed),
            bound: ms(3000),
        }
    }

    fn problems(reads: &[Read], windows: &[Window]) -> Vec<Problem> {
        check(&history(), reads, windows, BOUNDS)
            .violations
            .iter()
            .map(|v| v.problem)
            .collect()
    }

    #[test]
    fn a_read_of_the_latest_version_or_of_one_being_replaced_is_fresh() {
        let reads = [
            read(50, 60, Seen::Found(0)),
            // Began before v1's commit returned: v0 may still be current.
            read(105, 120, Seen::Found(0)),
            read(105, 120, Seen::Found(1)),
            read(400, 401, Seen::Found(3)),
        ];
        let verdict = check(&history(), &reads, &[], BOUNDS);
        assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
        assert_eq!(verdict.normal_stale, 0);
        assert_eq!(verdict.normal_staleness.last(), Some(&ms(0)));
    }

    #[test]
    fn staleness_runs_from_the_next_versions_commit_to_the_reads_start() {
        let verdict = check(&history(), &[read(180, 181, Seen::Found(0))], &[], BOUNDS);
        assert_eq!(verdict.normal_staleness, [ms(70)], "v1 committed at 110");
        assert!(verdict.violations.is_empty(), "70 ms is within 100 ms");

        let problems = problems(&[read(250, 251, Seen::Found(0))], &[]);
        assert_eq!(
            problems,
            [Problem::Stale {
                by: ms(140),
                bound: ms(100)
            }]
        );
    }

    #[test]
    fn a_404_is_matched_to_the_latest_deletion_it_may_have_seen() {
        // Between the delete and the re-insert: fresh.
        assert!(problems(&[read(250, 260, Seen::Missing)], &[]).is_empty());
        // The re-insert committed at 310: 404 at 500 is 190 ms stale.
        assert_eq!(
            problems(&[read(500, 501, Seen::Missing)], &[]),
            [Problem::Stale {
                by: ms(190),
                bound: ms(100)
            }]
        );
        // Before any deletion had begun: the post existed throughout.
        assert_eq!(
            problems(&[read(120, 150, Seen::Missing)], &[]),
            [Problem::Phantom(Phantom::MissingThroughout)]
        );
    }

    #[test]
    fn phantoms_are_versions_never_committed_from_the_future_or_garbled() {
        let reads = [
            read(500, 501, Seen::Found(7)),
            // v2 is the deletion: no body carries it.
            read(500, 501, Seen::Found(2)),
            read(50, 60, Seen::Found(3)),
            read(50, 60, Seen::Garbled(Garble::Mixed)),
        ];
        assert_eq!(
            problems(&reads, &[]),
            [
                Problem::Phantom(Phantom::FromTheFuture(3)),
                Problem::Phantom(Phantom::Garbled(Garble::Mixed)),
                Problem::Phantom(Phantom::NeverCommitted(7)),
                Problem::Phantom(Phantom::NeverCommitted(2)),
            ]
        );
    }

    #[test]
    fn a_fault_window_lends_its_bound_until_it_has_converged() {
        let windows = [paused(120, 600)];
        // 140 ms stale in the window: within its bound, and counted for it.
        let reads = [read(250, 251, Seen::Found(0))];
        let verdict = check(&history(), &reads, &windows, BOUNDS);
        assert!(verdict.violations.is_empty());
        assert_eq!(verdict.windows[0].max_staleness, ms(140));
        assert_eq!(verdict.normal_reads, 0);

        // Begun 500 ms after the heal and stale: it converged no sooner.
        let late = [read(1100, 1101, Seen::Found(1))];
        let verdict = check(&history(), &late, &windows, BOUNDS);
        assert!(verdict.violations.is_empty());
        assert_eq!(verdict.windows[0].converged_after, ms(500));

        // Past the heal and the convergence allowance: the normal bound.
        let after = [read(1700, 1701, Seen::Found(1))];
        let verdict = check(&history(), &after, &windows, BOUNDS);
        assert_eq!(verdict.stale(), 1);
        assert_eq!(verdict.normal_stale, 1);
    }

    #[test]
    fn an_older_version_after_a_newer_one_on_the_same_process_is_a_regression() {
        let newer = read(115, 120, Seen::Found(1));
        // Began after `newer` ended, and returned v0: within the staleness
        // bound (v1 committed at 110), but a step back.
        let older = read(121, 125, Seen::Found(0));
        assert_eq!(
            problems(&[newer, older], &[]),
            [Problem::Regression { after: 0 }]
        );
        // Overlapping reads may return either.
        let overlapping = read(119, 125, Seen::Found(0));
        assert!(problems(&[newer, overlapping], &[]).is_empty());
        // A 404 seen before is the oldest deletion it may have served
        // within the bound: the one current when it began (v2).
        let mut h = history();
        h.commit(1, version(4, false, 400, 401));
        h.commit(1, version(5, true, 500, 501));
        let missing = read(250, 450, Seen::Missing);
        let after = read(460, 470, Seen::Found(3));
        let verdict = check(&h, &[missing, after], &[], BOUNDS);
        assert_eq!(verdict.regressions(), 0, "{:?}", verdict.violations);
        let later = read(600, 610, Seen::Found(3));
        let verdict = check(&h, &[missing, later], &[], BOUNDS);
        assert_eq!(verdict.stale(), 1);
        assert_eq!(verdict.regressions(), 0, "the 404 may have been v2");
        // Another process of the instance (restarted) is not bound by it.
        let restarted = Read {
            incarnation: 1,
            ..older
        };
        assert!(problems(&[newer, restarted], &[]).is_empty());
    }

    #[test]
    fn reads_marked_stale_are_counted_apart_and_judged_for_phantoms_and_deletions() {
        // v0 at 150, when v1 had committed (110): stale, allowed marked.
        let marked = Read {
            served: Served::Stale,
            ..read(150, 151, Seen::Found(0))
        };
        let verdict = check(&history(), &[marked], &[], BOUNDS);
        assert!(verdict.violations.is_empty());
        assert_eq!((verdict.marked_stale, verdict.marked_stale_old), (1, 1));
        // v1 at 900: its deletion (v2) committed at 210, before the read:
        // a deleted post's old body, marked stale or not.
        let resurrected = Read {
            served: Served::Stale,
            ..read(900, 901, Seen::Found(1))
        };
        assert_eq!(
            problems(&[resurrected], &[]),
            [Problem::Resurrected { deleted: 2 }]
        );
        let garbled = Read {
            seen: Seen::Found(9),
            ..marked
        };
        assert_eq!(verdict.normal_reads, 0);
        assert_eq!(
            problems(&[garbled], &[]),
            [Problem::Phantom(Phantom::NeverCommitted(9))]
        );
    }

    #[test]
    fn a_regression_under_a_fault_is_a_violation_too() {
        let windows = [paused(100, 600)];
        let newer = read(115, 120, Seen::Found(1));
        let older = read(121, 125, Seen::Found(0));
        let verdict = check(&history(), &[newer, older], &windows, BOUNDS);
        assert_eq!(verdict.regressions(), 1, "{:?}", verdict.violations);
        assert_eq!(verdict.windows[0].regressions, 1);
    }

    #[test]
    fn an_answer_that_said_a_position_owes_what_committed_up_to_it() {
        // v1's writer read 110,000 after its commit; v3's 310,000.
        let said = |lsn: u64, seen: Seen| Read {
            lsn,
            ..read(400, 410, seen)
        };
        let reads = [
            said(110_000, Seen::Found(1)),
            said(110_000, Seen::Found(0)),
            said(310_000, Seen::Found(3)),
            said(320_000, Seen::Missing),
            said(0, Seen::Found(0)),
        ];
        let unmet = check_said_positions(&history(), &reads);
        let unmet: Vec<(u64, Seen)> = unmet.iter().map(|p| (p.min_lsn, p.read.seen)).collect();
        assert_eq!(unmet, [(110_000, Seen::Found(0)), (320_000, Seen::Missing)]);
    }

    #[test]
    fn unjudged_requests_are_told_apart_by_window_and_class() {
        let windows = [paused(100, 600)];
        let at = |t: u64, class: &str| Unjudged {
            at: ms(t),
            instance: 0,
            class: class.to_owned(),
        };
        let tally = tally_unjudged(
            &[
                at(50, "status 503"),
                at(700, "status 503"),
                at(1700, "connection failed"),
            ],
            &windows,
            BOUNDS,
        );
        assert_eq!(tally.inside_total(), 1, "within the heal and convergence");
        assert_eq!(tally.outside_total(), 2);
        assert_eq!(tally.outside["status 503"], 1);
    }

    #[test]
    fn nines_count_the_stale_share_outside_faults() {
        let mut reads = vec![read(400, 401, Seen::Found(3)); 999];
        reads.push(read(400, 401, Seen::Found(1)));
        let verdict = check(&history(), &reads, &[], BOUNDS);
        assert_eq!(verdict.normal_stale, 1);
        assert!((verdict.nines().unwrap() - 3.0).abs() < 1e-9);
    }
}
