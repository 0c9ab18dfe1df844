//! The coherence checker: writers, readers and faults against a fleet of
//! real postcache processes, and every read judged against the history of
//! what was committed (`postcache::testkit::history`).
//!
//! ```text
//! load/coherence [--seconds 600] [--seed 7] [--faults all] …   (the release build)
//! cargo run --example coherence -- --help
//! ```
//!
//! - A private PostgreSQL (`initdb` in a temp dir, `wal_level = logical`;
//!   with `--replicas`, a streaming standby read by the loads) and a
//!   private `redis-server`; N instances (default 3) as processes on fixed
//!   ports, each reaching Redis through a TCP proxy of the checker's.
//! - **Writers** (`writers.rs`): plain SQL on the database, as any other
//!   program would write: single and multi-row UPDATEs, DELETEs, INSERTs of
//!   deleted ids, multi-statement transactions, COPY, and now and then a
//!   TRUNCATE and a re-seed. Each write puts a new version of each post it
//!   touches into the row's title and body; its start and the moment its
//!   COMMIT returned are logged.
//! - **Readers** (`readers.rs`): `GET /posts/{id}` and `GET /posts?ids=`
//!   spread over the instances, each logged with its times, the instance
//!   and the version seen.
//! - **Faults** (`faults.rs`): a seeded schedule, one at a time, each logged
//!   as a window from its injection until the fleet is healthy again.
//! - **The verdict** (`report.rs`): phantoms, staleness against the bound
//!   in force, regressions on one process, and the fleet's convergence once
//!   the writes stop. The exit status is 1 on any violation.
//!
//! With `--lose-changes N` or `--defect` the instances are this program
//! itself, running the service with a deliberate defect through the
//! testkit's hooks (the decoder loses one change in N; no floors; a decoder
//! that beats unproven; a changed entry judged by two hosts' clocks): the
//! checker must report it.

mod faults;
mod fleet;
mod readers;
mod report;
mod writers;

use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use clap::Parser;
use postcache::testkit::history::{self, Bounds, History};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The checker's settings.
#[derive(Parser, Debug, Clone)]
#[command(about = "Writers, readers and faults against a postcache fleet; every read checked")]
pub struct Args {
    /// How long writers and readers run, in seconds.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// The seed of every random choice (ids, writes, faults); random when
    /// not given, and printed either way.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Instances in the fleet.
    #[arg(long, default_value_t = 3)]
    pub instances: usize,
    /// Writer tasks, each one transaction at a time.
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// Pause after each write, on average, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub write_pause_ms: u64,
    /// Reader tasks.
    #[arg(long, default_value_t = 16)]
    pub readers: usize,
    /// Reads per second, all readers together.
    #[arg(long, default_value_t = 2000)]
    pub reads_per_second: u64,
    /// Posts 1..=N, read and written with Zipf(1) frequencies.
    #[arg(long, default_value_t = 200)]
    pub posts: i64,
    /// Faults to inject, comma-separated, `all` or `none` (see `--list-faults`).
    #[arg(long, default_value = "all")]
    pub faults: String,
    /// Prints the faults and their documented bounds, and exits.
    #[arg(long)]
    pub list_faults: bool,
    /// Quiet time after each fault has healed, in seconds.
    #[arg(long, default_value_t = 3)]
    pub quiet: u64,
    /// CHANGE_FEED of the instances.
    #[arg(long, default_value = "replication")]
    pub change_feed: String,
    /// CACHE_TTL of the instances.
    #[arg(long, default_value = "60s")]
    pub cache_ttl: String,
    /// A streaming standby as the instances' read replica.
    #[arg(long)]
    pub replicas: bool,
    /// Another setting of the instances, `NAME=value` (repeatable).
    #[arg(long = "set")]
    pub set: Vec<String>,
    /// Read your writes: half the single reads carry a position
    /// (PostCache-Min-LSN), the latest a writer read after its COMMIT or
    /// the latest of the versions the reader saw, and each write is read
    /// at once on an instance with its position; a read older than a
    /// version at or before its position is a violation.
    #[arg(long)]
    pub read_your_writes: bool,
    /// A deliberate defect: the decoder loses one change in N.
    #[arg(long)]
    pub lose_changes: Option<u64>,
    /// A deliberate defect of the instances (repeatable): `no-floors` (a
    /// process may go back in time), `blind-decoder` (the decoder beats
    /// "nothing behind" unproven), `changed-unflagged` (an entry a change
    /// made stale with STALE_WHILE_REVALIDATE on is judged by the
    /// applier's clock against the reader's). The checker must fail.
    #[arg(long = "defect", value_parser = ["no-floors", "blind-decoder", "changed-unflagged"])]
    pub defects: Vec<String>,
    /// The share of single reads that ask for no staleness at all
    /// (`PostCache-Max-Staleness: 0ms`, answered past the cache).
    #[arg(long, default_value_t = 0.1)]
    pub max_staleness_share: f64,
    /// The staleness allowed outside faults.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    pub bound: Duration,
    /// After a fault heals (and after the last write), how soon every read
    /// must be within the normal bound again.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub converge: Duration,
    /// Violations printed with their histories.
    #[arg(long, default_value_t = 5)]
    pub explain: usize,
    /// Writes the report (markdown) here too.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// The postcache binary (default: beside this program, or POSTCACHE_BIN).
    #[arg(long)]
    pub binary: Option<PathBuf>,
}

/// The run's clock: every time logged is a `Duration` since its start.
#[derive(Clone, Copy)]
pub struct Clock(Instant);

impl Clock {
    pub fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

fn main() -> anyhow::Result<()> {
    // The instances of a run with a defect are this program: `instance`.
    if std::env::args().nth(1).as_deref() == Some("instance") {
        return fleet::run_instance();
    }
    let args = Args::parse();
    if args.list_faults {
        for kind in faults::Kind::ALL {
            println!(
                "{:<24} {:>6} ms  {}",
                kind.name(),
                kind.bound(&args).as_millis(),
                kind.what()
            );
        }
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let passed = runtime.block_on(run(args))?;
    std::process::exit(if passed { 0 } else { 1 });
}

async fn run(args: Args) -> anyhow::Result<bool> {
    postcache::startup::install_tls_provider();
    let seed = args
        .seed
        .unwrap_or_else(|| rand::rng().random_range(0..1_000_000));
    let kinds = faults::Kind::parse_list(&args.faults, &args)?;
    println!(
        "coherence: seed {seed}, {} s, faults: {}",
        args.seconds,
        faults::names(&kinds)
    );

    let clock = Clock(Instant::now());
    println!(
        "the run's clock starts at {} (unix ms), for the instances' logs",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis()
    );
    let history = Arc::new(Mutex::new(History::default()));
    let skewed = kinds.contains(&faults::Kind::ClockSkew);
    let fleet = Arc::new(fleet::Fleet::start(&args, skewed).await?);
    let posts = Arc::new(writers::Posts::seed(&fleet, args.posts, &history, clock).await?);
    fleet.start_instances().await?;
    fleet.until_healthy(Duration::from_secs(60)).await?;
    println!(
        "fleet up: {} instances, {} posts, CHANGE_FEED={}{}",
        args.instances,
        args.posts,
        args.change_feed,
        if args.replicas {
            ", a streaming standby as replica"
        } else {
            ""
        }
    );

    let stop = tokio_util::sync::CancellationToken::new();
    let deadline = Duration::from_secs(args.seconds);
    let write_log = Arc::new(writers::Tally::default());
    let ryw = args
        .read_your_writes
        .then(|| readers::Ryw::new(fleet.targets(), history.clone()));
    let shared = writers::Shared {
        fleet: fleet.clone(),
        posts,
        history: history.clone(),
        tally: write_log.clone(),
        clock,
    };
    let writer_tasks: Vec<_> = (0..args.writers)
        .map(|w| {
            let writer = writers::Writer::new(
                w,
                shared.clone(),
                StdRng::seed_from_u64(seed ^ (0x5772_6974 + w as u64)),
                Duration::from_millis(args.write_pause_ms),
                ryw.clone(),
            );
            tokio::spawn(writer.run(stop.clone()))
        })
        .collect();
    let reseeds = tokio::spawn(writers::reseed_now_and_then(shared, deadline, stop.clone()));
    let reader_tasks: Vec<_> = (0..args.readers)
        .map(|r| {
            let reader = readers::Reader::new(
                fleet.targets(),
                args.posts,
                clock,
                StdRng::seed_from_u64(seed ^ (0x5265_6164 + r as u64)),
                args.reads_per_second as f64 / args.readers as f64,
                ryw.clone(),
                args.max_staleness_share,
            );
            tokio::spawn(reader.run(stop.clone()))
        })
        .collect();
    // On this task: the testkit's servers wait with closures that are not
    // Send. The faults end first (the one in force heals), then the writes.
    let (schedule, ()) = tokio::join!(
        faults::run_schedule(
            fleet.clone(),
            kinds,
            args.clone(),
            clock,
            deadline,
            StdRng::seed_from_u64(seed ^ 0x4661_756c),
        ),
        tokio::time::sleep(deadline)
    );
    let schedule = schedule?;
    stop.cancel();
    for task in writer_tasks {
        task.await??;
    }
    reseeds.await??;
    let mut reads = Vec::new();
    let mut errors = readers::Errors::default();
    for task in reader_tasks {
        let (r, e) = task.await?;
        reads.extend(r);
        errors.merge(e);
    }
    let healthy = fleet.until_healthy(Duration::from_secs(30)).await.is_ok();
    let convergence = readers::converge(&fleet, &history, clock, Duration::from_secs(30)).await;

    if let Some(ryw) = &ryw {
        errors.merge(std::mem::take(&mut *ryw.errors.lock().unwrap()));
    }
    let position_reads: Vec<history::PositionRead> = ryw
        .as_ref()
        .map(|ryw| std::mem::take(&mut *ryw.reads.lock().unwrap()))
        .unwrap_or_default();
    // The writers' position reads are judged as reads too.
    reads.extend(
        position_reads
            .iter()
            .filter(|p| p.by_writer)
            .map(|p| p.read),
    );
    let history = history.lock().unwrap();
    let unmet = history::check_positions(&history, &position_reads);
    let said_unmet = history::check_said_positions(&history, &reads);
    let bounds = Bounds {
        normal: args.bound,
        converge: args.converge,
    };
    let verdict = history::check(&history, &reads, &schedule.windows, bounds);
    let report = report::Report {
        args: &args,
        seed,
        history: &history,
        reads: &reads,
        windows: &schedule.windows,
        unhealed: &schedule.unhealed,
        broken: &schedule.broken,
        verdict: &verdict,
        errors: &errors,
        writes: &write_log,
        convergence,
        healthy,
        logs: fleet.log_dir(),
        positions: args.read_your_writes.then_some(report::Positions {
            reads: &position_reads,
            unmet: &unmet,
        }),
        said_unmet: &said_unmet,
        bounds,
    };
    let text = report.render();
    println!("{text}");
    if let Some(path) = &args.report {
        std::fs::write(path, &text)?;
    }
    let passed = report.passed();
    fleet.stop();
    Ok(passed)
}
