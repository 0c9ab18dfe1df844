//! The checker's report: the verdict in markdown, with the command that
//! reproduces the run, and the first violations with their histories.

use std::{collections::BTreeMap, fmt::Write as _, path::PathBuf, time::Duration};

use postcache::{
    http::position::format_lsn,
    testkit::{
        history::{
            explain, tally_unjudged, Bounds, History, PositionRead, Problem, Read, UnjudgedTally,
            Unmet, Verdict, Window,
        },
        quantile,
    },
};

use crate::{faults::Kind, readers::Convergence, readers::Errors, writers::Tally, Args};

pub struct Report<'a> {
    pub args: &'a Args,
    pub seed: u64,
    pub history: &'a History,
    pub reads: &'a [Read],
    pub windows: &'a [Window],
    pub unhealed: &'a [String],
    /// Faults that caused what they must not.
    pub broken: &'a [String],
    pub verdict: &'a Verdict,
    pub errors: &'a Errors,
    pub writes: &'a Tally,
    pub convergence: Convergence,
    pub healthy: bool,
    pub logs: PathBuf,
    /// `--read-your-writes`: the reads that carried a position, and those
    /// that returned a version older than one they were owed.
    pub positions: Option<Positions<'a>>,
    /// Answers whose `PostCache-LSN` named a version they do not reflect.
    pub said_unmet: &'a [PositionRead],
    pub bounds: Bounds,
}

/// Unjudged answers outside fault windows above this share of the reads
/// there fail the run.
const UNJUDGED_SHARE: f64 = 0.001;

pub struct Positions<'a> {
    pub reads: &'a [PositionRead],
    pub unmet: &'a [Unmet],
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

impl Report<'_> {
    /// When the last version committed.
    fn last_commit(&self) -> Duration {
        self.history
            .finals()
            .map(|(_, v)| v.committed)
            .max()
            .unwrap_or_default()
    }

    /// How long after the last commit every instance served every post's
    /// last version.
    fn converged_after(&self) -> Option<Duration> {
        self.convergence
            .at
            .map(|at| at.saturating_sub(self.last_commit()))
    }

    /// The unjudged requests, inside and outside the fault windows.
    fn unjudged(&self) -> UnjudgedTally {
        tally_unjudged(&self.errors.0, self.windows, self.bounds)
    }

    /// Why the run fails, if it does.
    pub fn failures(&self) -> Vec<String> {
        let v = self.verdict;
        let mut why = Vec::new();
        if v.reads == 0 || self.history.writes() == 0 {
            why.push("nothing was read or written".to_owned());
        }
        for (n, what) in [
            (v.phantoms(), "phantoms"),
            (v.stale(), "reads staler than the bound in force"),
            (v.regressions(), "regressions"),
            (
                v.resurrections(),
                "reads marked stale that served a deleted post",
            ),
            (
                self.said_unmet.len(),
                "answers whose PostCache-LSN named a version they do not reflect",
            ),
        ] {
            if n > 0 {
                why.push(format!("{n} {what}"));
            }
        }
        let unjudged = self.unjudged();
        let outside = unjudged.outside_total();
        let allowed = (v.normal_reads as f64 * UNJUDGED_SHARE).floor() as usize;
        if outside > allowed {
            why.push(format!(
                "{outside} requests outside fault windows got no answer to judge (at most {allowed}: 0.1% of {} reads there)",
                v.normal_reads
            ));
        }
        match self.converged_after() {
            Some(after) if after <= self.args.converge => {}
            Some(after) => why.push(format!(
                "the fleet converged {} after the last write (bound {})",
                ms(after),
                ms(self.args.converge)
            )),
            None => why.push("the fleet did not converge within 30 s of the last write".into()),
        }
        if let Some(positions) = &self.positions {
            if positions.reads.is_empty() {
                why.push("no read carried a position".to_owned());
            }
            if !positions.unmet.is_empty() {
                why.push(format!(
                    "{} reads with a position returned a version older than one committed at or before it",
                    positions.unmet.len()
                ));
            }
        }
        for fault in self.unhealed {
            why.push(format!("not healed: {fault}"));
        }
        for fault in self.broken {
            why.push(format!("caused what it must not: {fault}"));
        }
        if !self.healthy {
            why.push("the fleet was not healthy at the end".into());
        }
        why
    }

    pub fn passed(&self) -> bool {
        self.failures().is_empty()
    }

    /// The command that makes this run again.
    fn command(&self) -> String {
        let a = self.args;
        let mut c = format!(
            "load/coherence --seconds {} --seed {} --instances {} --writers {} --readers {} --reads-per-second {} --posts {} --faults {} --change-feed {} --cache-ttl {}",
            a.seconds, self.seed, a.instances, a.writers, a.readers, a.reads_per_second, a.posts, a.faults, a.change_feed, a.cache_ttl
        );
        if a.replicas {
            c.push_str(" --replicas");
        }
        if let Some(n) = a.lose_changes {
            let _ = write!(c, " --lose-changes {n}");
        }
        for d in &a.defects {
            let _ = write!(c, " --defect {d}");
        }
        let _ = write!(c, " --max-staleness-share {}", a.max_staleness_share);
        for s in &a.set {
            let _ = write!(c, " --set {s}");
        }
        if a.read_your_writes {
            c.push_str(" --read-your-writes");
        }
        c
    }

    /// The read-your-writes section: position reads, how they were
    /// answered, their latency beside plain reads', and what was unmet.
    fn render_positions(&self, w: &mut String, positions: &Positions) {
        let _ = writeln!(w, "\n## Read your writes\n");
        let reads = positions.reads;
        let latency = |of: &mut dyn Iterator<Item = &Read>| {
            let mut took: Vec<Duration> = of.map(|r| r.ended.saturating_sub(r.began)).collect();
            took.sort_unstable();
            took
        };
        let _ = writeln!(
            w,
            "| reads with a position | sent by | answered from the cache | past the cache | older than a version at or before the position | latency p50 | p99 |"
        );
        let _ = writeln!(w, "|---|---|---|---|---|---|---|");
        for (by_writer, who) in [
            (true, "writers, at once after their write"),
            (false, "readers"),
        ] {
            let of: Vec<&PositionRead> =
                reads.iter().filter(|p| p.by_writer == by_writer).collect();
            let past = of.iter().filter(|p| p.past).count();
            let unmet = positions
                .unmet
                .iter()
                .filter(|u| reads[u.read].by_writer == by_writer)
                .count();
            let took = latency(&mut of.iter().map(|p| &p.read));
            let _ = writeln!(
                w,
                "| {} | {who} | {} | {past} | {unmet} | {} | {} |",
                of.len(),
                of.len() - past,
                ms(quantile(&took, 0.5)),
                ms(quantile(&took, 0.99)),
            );
        }
        // Plain single reads served from the memory tier, for the latency
        // a position adds; and position reads served from it.
        let plain = latency(
            &mut self
                .reads
                .iter()
                .filter(|r| !r.batch && r.served == postcache::testkit::history::Served::Memory),
        );
        let _ = writeln!(
            w,
            "\nAll single reads served from the memory tier (with and without a position): latency p50 {}, p99 {}, over {} reads.",
            ms(quantile(&plain, 0.5)),
            ms(quantile(&plain, 0.99)),
            plain.len()
        );
        for unmet in positions.unmet.iter().take(self.args.explain) {
            let p = &reads[unmet.read];
            let r = &p.read;
            let _ = writeln!(
                w,
                "- post {} at position {}, read {}–{} on instance {}: saw {:?}, owed version {} ({}; {})",
                r.post,
                format_lsn(p.min_lsn),
                ms(r.began),
                ms(r.ended),
                r.instance,
                r.seen,
                unmet.owed,
                r.served.as_str(),
                if p.past { "past the cache" } else { "from the cache" },
            );
        }
    }

    pub fn render(&self) -> String {
        let (v, a) = (self.verdict, self.args);
        let mut out = String::new();
        let w = &mut out;
        let _ = writeln!(w, "# Coherence, seed {}\n", self.seed);
        let _ = writeln!(w, "`{}`\n", self.command());
        let _ = writeln!(
            w,
            "{} instances (CHANGE_FEED={}, CACHE_TTL={}{}{}), posts 1 to {}, {} writers, {} readers at {} reads/s, {} s.\n",
            a.instances,
            a.change_feed,
            a.cache_ttl,
            if a.replicas { ", a streaming standby as replica" } else { "" },
            match (a.lose_changes, a.defects.is_empty()) {
                (Some(n), _) => format!(", **a deliberate defect: the decoder loses one change in {n}**"),
                (None, false) => format!(", **a deliberate defect: {}**", a.defects.join(", ")),
                (None, true) => String::new(),
            },
            a.posts,
            a.writers,
            a.readers,
            a.reads_per_second,
            a.seconds
        );
        let batch = self.reads.iter().filter(|r| r.batch).count();
        let (committed, rolled_back) = self
            .writes
            .kinds()
            .iter()
            .fold((0, 0), |(c, r), k| (c + k.1, r + k.2));
        let _ = writeln!(w, "| reads | of them in batches | writes committed | rolled back | settled by reading the rows | faults | requests unanswered |");
        let _ = writeln!(w, "|---|---|---|---|---|---|---|");
        let _ = writeln!(
            w,
            "| {} | {batch} | {committed} | {rolled_back} | {} | {} | {} |\n",
            v.reads,
            self.writes.settled(),
            self.windows.len(),
            self.errors.total()
        );

        let failures = self.failures();
        if failures.is_empty() {
            let _ = writeln!(w, "**Verdict: pass.**\n");
        } else {
            let _ = writeln!(w, "**Verdict: FAIL**: {}.\n", failures.join("; "));
        }
        let outside = v.stale()
            - v.violations
                .iter()
                .filter(|x| x.window.is_some() && matches!(x.problem, Problem::Stale { .. }))
                .count();
        let _ = writeln!(w, "- phantoms: {}", v.phantoms());
        let _ = writeln!(
            w,
            "- reads staler than the bound in force: {} ({outside} outside fault windows)",
            v.stale()
        );
        let _ = writeln!(
            w,
            "- regressions (every one a violation, in a fault window or not): {}",
            v.regressions()
        );
        let _ = writeln!(
            w,
            "- reads marked stale that served a deleted post: {}",
            v.resurrections()
        );
        let said = self.reads.iter().filter(|r| r.lsn != 0).count();
        let _ = writeln!(
            w,
            "- answers that said a position (`PostCache-LSN`): {said}, of them naming a version they do not reflect: {}",
            self.said_unmet.len()
        );
        let unjudged = self.unjudged();
        let _ = writeln!(
            w,
            "- requests with no answer to judge: {} outside fault windows, {} inside",
            unjudged.outside_total(),
            unjudged.inside_total()
        );
        let _ = writeln!(
            w,
            "- convergence: every instance served every post's last version {} after the last write ({} sweeps; bound {})",
            self.converged_after().map_or("never (30 s)".into(), ms),
            self.convergence.sweeps,
            ms(a.converge)
        );
        for wrong in &self.convergence.wrong {
            let _ = writeln!(w, "  - still wrong: {wrong}");
        }
        for fault in self.unhealed {
            let _ = writeln!(w, "- not healed: {fault}");
        }
        for fault in self.broken {
            let _ = writeln!(w, "- caused what it must not: {fault}");
        }

        if let Some(positions) = &self.positions {
            self.render_positions(w, positions);
        }

        let _ = writeln!(w, "\n## Outside fault windows\n");
        let s = &v.normal_staleness;
        let nines = match v.nines() {
            Some(n) => format!("{n:.2}"),
            None => format!("at least {:.2} (none stale)", v.nines_at_least()),
        };
        let _ = writeln!(
            w,
            "{} reads; {} staler than {}; nines: {nines}. Staleness p50 {}, p99 {}, p99.9 {}, max {}.",
            v.normal_reads,
            v.normal_stale,
            ms(a.bound),
            ms(quantile(s, 0.5)),
            ms(quantile(s, 0.99)),
            ms(quantile(s, 0.999)),
            ms(s.last().copied().unwrap_or_default()),
        );

        if !self.windows.is_empty() {
            let _ = writeln!(w, "\n## Faults\n");
            let _ = writeln!(w, "| fault | times | reads in its windows | largest staleness | bound | stale past the normal bound after healing, until | regressions (violations) | stale past the normal bound, by X-Cache |");
            let _ = writeln!(w, "|---|---|---|---|---|---|---|---|");
            for kind in Kind::ALL {
                let of: Vec<usize> = (0..self.windows.len())
                    .filter(|&i| self.windows[i].kind == kind.name())
                    .collect();
                if of.is_empty() {
                    continue;
                }
                let figures = |f: fn(&postcache::testkit::history::WindowFigures) -> Duration| {
                    of.iter()
                        .map(|&i| f(&v.windows[i]))
                        .max()
                        .unwrap_or_default()
                };
                let mut stale_by: BTreeMap<&str, usize> = BTreeMap::new();
                for &i in &of {
                    for (served, n) in &v.windows[i].stale_by {
                        *stale_by.entry(served.as_str()).or_default() += n;
                    }
                }
                let stale_by = stale_by
                    .iter()
                    .map(|(s, n)| format!("{s}: {n}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                let _ = writeln!(
                    w,
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    kind.name(),
                    of.len(),
                    of.iter().map(|&i| v.windows[i].reads).sum::<usize>(),
                    ms(figures(|f| f.max_staleness)),
                    ms(of
                        .iter()
                        .map(|&i| self.windows[i].bound)
                        .max()
                        .unwrap_or_default()),
                    ms(figures(|f| f.converged_after)),
                    of.iter().map(|&i| v.windows[i].regressions).sum::<usize>(),
                    stale_by,
                );
            }
            let _ = writeln!(w, "\nEach fault, in order:\n");
            let _ = writeln!(
                w,
                "| at | fault | what | healthy after | reads | largest staleness |"
            );
            let _ = writeln!(w, "|---|---|---|---|---|---|");
            for (window, figures) in self.windows.iter().zip(&v.windows) {
                let _ = writeln!(
                    w,
                    "| {:.1} s | {} | {} | {:.1} s | {} | {} |",
                    window.injected.as_secs_f64(),
                    window.kind,
                    window.what,
                    (window.healed - window.injected).as_secs_f64(),
                    figures.reads,
                    ms(figures.max_staleness)
                );
            }
        }

        let _ = writeln!(w, "\n## How reads were served\n");
        let _ = writeln!(
            w,
            "| X-Cache | reads | older than the latest version (any staleness) |"
        );
        let _ = writeln!(w, "|---|---|---|");
        for (served, n, old) in &v.by_served {
            let _ = writeln!(w, "| {} | {n} | {old} |", served.as_str());
        }
        let _ = writeln!(
            w,
            "\nMarked stale (`X-Cache: stale`, judged for phantoms and deleted posts only): {} reads, {} of them older than the latest version.",
            v.marked_stale, v.marked_stale_old
        );

        let _ = writeln!(w, "\n## Writes\n");
        let _ = writeln!(w, "| kind | committed | rolled back |");
        let _ = writeln!(w, "|---|---|---|");
        for (kind, c, r) in self.writes.kinds() {
            let _ = writeln!(w, "| {kind} | {c} | {r} |");
        }
        if self.errors.total() > 0 {
            let _ = writeln!(w, "\n## Requests with no answer to judge\n");
            let _ = writeln!(w, "| why | outside fault windows | inside |");
            let _ = writeln!(w, "|---|---|---|");
            let classes: std::collections::BTreeSet<&String> = unjudged
                .outside
                .keys()
                .chain(unjudged.inside.keys())
                .collect();
            for class in classes {
                let _ = writeln!(
                    w,
                    "| {class} | {} | {} |",
                    unjudged.outside.get(class).copied().unwrap_or(0),
                    unjudged.inside.get(class).copied().unwrap_or(0)
                );
            }
        }
        if !self.said_unmet.is_empty() {
            let _ = writeln!(
                w,
                "\n## Answers that named a position they do not reflect\n"
            );
            for p in self.said_unmet.iter().take(a.explain) {
                let r = &p.read;
                let _ = writeln!(
                    w,
                    "- post {} on instance {}, read {}–{}: saw {:?}, served {}, said {}",
                    r.post,
                    r.instance,
                    ms(r.began),
                    ms(r.ended),
                    r.seen,
                    r.served.as_str(),
                    format_lsn(p.min_lsn)
                );
                // The versions around it: which one it owed, and when.
                for v in self.history.versions(r.post) {
                    if v.committed + Duration::from_secs(2) < r.began || v.began > r.ended {
                        continue;
                    }
                    let _ = writeln!(
                        w,
                        "  - v{} {}: began {}, committed {}, writer's position {}, {} post(s) in its transaction",
                        v.seq,
                        if v.exists { "written" } else { "deleted" },
                        ms(v.began),
                        ms(v.committed),
                        format_lsn(v.lsn),
                        self.history.written_with(v)
                    );
                }
            }
        }
        if !v.violations.is_empty() {
            let _ = writeln!(w, "\n## Violations by kind\n");
            let _ = writeln!(
                w,
                "| problem | served | after a read served | in a fault window | reads |"
            );
            let _ = writeln!(w, "|---|---|---|---|---|");
            let mut kinds: BTreeMap<(String, &str, &str, &str), usize> = BTreeMap::new();
            for x in &v.violations {
                let read = &self.reads[x.read];
                let (problem, after) = match x.problem {
                    Problem::Phantom(p) => (format!("phantom: {p:?}"), ""),
                    Problem::Stale { .. } => ("stale".to_owned(), ""),
                    Problem::Regression { after } => {
                        ("regression".to_owned(), self.reads[after].served.as_str())
                    }
                    Problem::Resurrected { .. } => ("a deleted post served stale".to_owned(), ""),
                };
                let window = x.window.map_or("", |w| self.windows[w].kind);
                *kinds
                    .entry((problem, read.served.as_str(), after, window))
                    .or_default() += 1;
            }
            for ((problem, served, after, window), n) in kinds {
                let _ = writeln!(w, "| {problem} | {served} | {after} | {window} | {n} |");
            }
            let _ = writeln!(
                w,
                "\n## The first {} of {} violations, with their histories\n",
                v.violations.len().min(a.explain),
                v.violations.len()
            );
            let _ = writeln!(w, "```text");
            for violation in v.violations.iter().take(a.explain) {
                let _ = writeln!(
                    w,
                    "{}",
                    explain(self.history, self.reads, self.windows, violation, 4)
                );
            }
            let _ = writeln!(w, "```");
            let _ = writeln!(w, "\nThe instances' logs: {}", self.logs.display());
        }
        out
    }
}
