//! The checker's faults: a seeded schedule, one fault at a time, each
//! logged as a window from its injection until the fleet was seen healthy
//! again (every instance ready, its change feed up), with the staleness
//! documented for reads while it is in force (docs/design/consistency.md).

use std::{
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::bail;
use postcache::testkit::{history::Window, ServiceProcess};
use rand::{rngs::StdRng, seq::SliceRandom, Rng};

use crate::{
    fleet::{Fleet, RedisReplica},
    Args, Clock,
};

/// Before the first fault: the caches warm.
const WARMUP: Duration = Duration::from_secs(3);
/// Longest a fault may take to heal before the run reports it.
const HEAL_LIMIT: Duration = Duration::from_secs(60);
/// How long a killed instance stays down, a process stays stopped, Redis
/// stays down or paused, a replica stays paused.
const DOWN: Duration = Duration::from_secs(1);
const STOPPED: Duration = Duration::from_secs(2);
const PAUSED: Duration = Duration::from_secs(2);
/// How long Redis's replica gets nothing before its primary dies.
const REPLICA_STALLED: Duration = Duration::from_millis(500);
const REPLICA_PAUSED: Duration = Duration::from_secs(3);
/// How long the decoding instance's PostgreSQL connections stay silent:
/// past REPLICATION_TIMEOUT (4 s), so that nothing but the service's own
/// deadlines ends them.
const SILENCED: Duration = Duration::from_secs(6);
/// How long a leader stays stopped: past LOCK_TTL (5 s), so that its claim
/// expires and another leads before it resumes and finishes.
const LEADER_STOPPED: Duration = Duration::from_secs(6);
/// Rows of another table's bulk write (about 70 MB of WAL), which the
/// walsender decodes for seconds before the changes behind it.
const BULK_ROWS: u64 = 500_000;
/// How long the instances' clocks stay skewed, and by how much at most
/// (each instance by its own whole seconds, ahead or behind).
const SKEWED: Duration = Duration::from_secs(6);
const MAX_SKEW_SECONDS: i64 = 3;
/// libfaketime reads its file again after this long.
const SKEW_TAKES: Duration = Duration::from_millis(1500);
/// A fault is not begun unless this much of the run is left.
const ROOM: Duration = Duration::from_secs(8);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    DecoderKilled,
    InstanceKilled,
    InstanceStopped,
    RedisRestarted,
    RedisPaused,
    ListenersCut,
    PostgresRestarted,
    ReplicaLagging,
    SlotDropped,
    InvalidateAll,
    DecoderSilenced,
    LeaderStopped,
    SlowWalsender,
    RedisFailover,
    ClockSkew,
}

impl Kind {
    pub const ALL: [Kind; 15] = [
        Kind::DecoderKilled,
        Kind::InstanceKilled,
        Kind::InstanceStopped,
        Kind::RedisRestarted,
        Kind::RedisPaused,
        Kind::ListenersCut,
        Kind::PostgresRestarted,
        Kind::ReplicaLagging,
        Kind::SlotDropped,
        Kind::InvalidateAll,
        Kind::DecoderSilenced,
        Kind::LeaderStopped,
        Kind::SlowWalsender,
        Kind::RedisFailover,
        Kind::ClockSkew,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::DecoderKilled => "decoder-killed",
            Kind::InstanceKilled => "instance-killed",
            Kind::InstanceStopped => "instance-stopped",
            Kind::RedisRestarted => "redis-restarted",
            Kind::RedisPaused => "redis-paused",
            Kind::ListenersCut => "listeners-cut",
            Kind::PostgresRestarted => "postgres-restarted",
            Kind::ReplicaLagging => "replica-lagging",
            Kind::SlotDropped => "slot-dropped",
            Kind::InvalidateAll => "invalidate-all",
            Kind::DecoderSilenced => "decoder-silenced",
            Kind::LeaderStopped => "leader-stopped",
            Kind::SlowWalsender => "slow-walsender",
            Kind::RedisFailover => "redis-failover",
            Kind::ClockSkew => "clock-skew",
        }
    }

    pub fn what(self) -> &'static str {
        match self {
            Kind::DecoderKilled => "SIGKILL of the instance that decodes, restarted 1 s later",
            Kind::InstanceKilled => {
                "SIGKILL of another instance while it loads, restarted 1 s later"
            }
            Kind::InstanceStopped => "SIGSTOP of an instance, SIGCONT 2 s later",
            Kind::RedisRestarted => "Redis SIGKILLed, restarted empty 1 s later",
            Kind::RedisPaused => "CLIENT PAUSE ALL for 2 s",
            Kind::ListenersCut => {
                "each instance's subscriber and change stream connections cut at its proxy"
            }
            Kind::PostgresRestarted => {
                "PostgreSQL stopped at once (-m immediate), started again 0.5 s later (the bound counts from its taking connections again)"
            }
            Kind::ReplicaLagging => "the standby's replay paused for 3 s (--replicas)",
            Kind::SlotDropped => "the replication slot dropped by hand",
            Kind::InvalidateAll => "postcache invalidate --all",
            Kind::DecoderSilenced => {
                "the decoding instance's replication connection silenced by its proxy (nothing forwarded, nothing closed) for 6 s; its other connections work"
            }
            Kind::LeaderStopped => {
                "SIGSTOP of another instance while it loads, past LOCK_TTL (6 s), then SIGCONT"
            }
            Kind::SlowWalsender => {
                "another table's bulk write (500,000 rows in one transaction): the walsender decodes it before the changes behind it"
            }
            Kind::RedisFailover => {
                "Redis's replica stalled (its link forwards nothing, closes nothing) for 0.5 s, then the primary SIGKILLed and the replica promoted behind every instance's address (a moved virtual IP)"
            }
            Kind::ClockSkew => {
                "every instance's wall clock stepped 1 to 3 s ahead or behind, each its own way (libfaketime), for 6 s, then stepped back; no decoder may give up the slot for it"
            }
        }
    }

    /// The staleness documented for reads while the fault is in force
    /// (docs/design/consistency.md): what the design bounds it by, with
    /// room for a loaded machine. Past the fault's heal (and the
    /// convergence allowance, 1 s), the normal bound holds again.
    pub fn bound(self, args: &Args) -> Duration {
        let ms = Duration::from_millis;
        match self {
            // The fleet's beats are late after 2 s; a standby polls every
            // 0.5 s, takes the slot, and is sent what was not confirmed.
            Kind::DecoderKilled => ms(3000),
            // Another instance: nothing of the fleet's coherence changes.
            Kind::InstanceKilled | Kind::InvalidateAll | Kind::ReplicaLagging => args.bound,
            // Coherence reads no clock of another host (docs/design/
            // consistency.md): nothing changes.
            Kind::ClockSkew => args.bound,
            // A stopped decoder applies nothing while it is stopped: the
            // stop's length, and its catch-up.
            Kind::InstanceStopped => STOPPED + ms(1000),
            // Reads go to PostgreSQL while Redis is down; the memory tier
            // is emptied as the change stream's read fails.
            Kind::RedisRestarted => DOWN + ms(1000),
            // Changes wait for Redis; the memory tier serves until the
            // beats are 2 s late.
            Kind::RedisPaused => ms(2500),
            // The stream reader reads the stream again (from its end, its
            // memory tier forgotten) as its connection is made again.
            Kind::ListenersCut => ms(500),
            // Past PostgreSQL's taking connections again (its downtime, with
            // a crash's recovery, is added where it heals: see
            // `run_schedule`): the decoder asks for the slot again within
            // 0.4 s and is sent what was not confirmed.
            Kind::PostgresRestarted => ms(1500),
            // The gap is closed by a raise of the cutoff once the slot is
            // made again.
            Kind::SlotDropped => ms(2000),
            // No beat is level from 0.5 s on; the decoder gives up (or a
            // standby ends its walsender) and a standby decodes within
            // about 3 s of the silence.
            Kind::DecoderSilenced => ms(4000),
            // Another instance: its stale leader's finish is fenced by its
            // lost claim; nothing of the fleet's coherence changes.
            Kind::LeaderStopped => args.bound,
            // Set when it heals (see `run_schedule`): the feed is blind while
            // the walsender decodes the bulk write, a bound no design of the
            // consumer can shorten.
            Kind::SlowWalsender => ms(0),
            // The changes no replica acknowledged are applied again on the
            // promoted one once the instances reach it; the memory tiers are
            // emptied as the change stream's read fails.
            Kind::RedisFailover => DOWN + ms(1000),
        }
    }

    /// Whether the fault means something in this setup.
    fn applies(self, args: &Args) -> bool {
        match self {
            Kind::DecoderKilled
            | Kind::SlotDropped
            | Kind::DecoderSilenced
            | Kind::SlowWalsender
            | Kind::RedisFailover => args.change_feed == "replication",
            Kind::ReplicaLagging => args.replicas,
            _ => true,
        }
    }

    /// Whether `all` includes the fault on this machine: the clock skew
    /// needs libfaketime, which CI installs (with CI set, `all` includes it
    /// regardless, and a machine without it fails the run at start).
    fn available(self) -> bool {
        match self {
            Kind::ClockSkew => {
                crate::fleet::libfaketime().is_some() || std::env::var_os("CI").is_some()
            }
            _ => true,
        }
    }

    /// `all`, `none`, or names separated by commas.
    pub fn parse_list(list: &str, args: &Args) -> anyhow::Result<Vec<Kind>> {
        match list {
            "all" => {
                for kind in Self::ALL.into_iter().filter(|k| !k.available()) {
                    println!(
                        "note: no fault {}: libfaketime is not installed",
                        kind.name()
                    );
                }
                Ok(Self::ALL
                    .into_iter()
                    .filter(|k| k.applies(args) && k.available())
                    .collect())
            }
            "none" | "" => Ok(Vec::new()),
            list => list
                .split(',')
                .map(|name| {
                    let Some(kind) = Self::ALL.into_iter().find(|k| k.name() == name.trim()) else {
                        bail!("no fault named {name:?} (see --list-faults)");
                    };
                    if !kind.applies(args) {
                        bail!("the fault {name} needs replication mode (or --replicas)");
                    }
                    Ok(kind)
                })
                .collect(),
        }
    }
}

pub fn names(kinds: &[Kind]) -> String {
    if kinds.is_empty() {
        return "none".into();
    }
    kinds
        .iter()
        .map(|k| k.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the schedule did: the windows, the faults that did not heal, and
/// those that caused what they must not.
#[derive(Debug, Default)]
pub struct Schedule {
    pub windows: Vec<Window>,
    pub unhealed: Vec<String>,
    pub broken: Vec<String>,
}

/// Injects the faults one after another, each kind in turn (in a seeded
/// order, shuffled again for each round), until too little of the run is
/// left; each is healed before the next.
pub async fn run_schedule(
    fleet: Arc<Fleet>,
    kinds: Vec<Kind>,
    args: Args,
    clock: Clock,
    run: Duration,
    mut rng: StdRng,
) -> anyhow::Result<Schedule> {
    let mut schedule = Schedule::default();
    if kinds.is_empty() {
        return Ok(schedule);
    }
    tokio::time::sleep(WARMUP).await;
    let mut order = kinds.clone();
    order.shuffle(&mut rng);
    let mut turn = 0;
    while clock.now() + ROOM < run {
        if turn == order.len() {
            order.shuffle(&mut rng);
            turn = 0;
        }
        let kind = order[turn];
        turn += 1;
        let injected = clock.now();
        // A clock step is no fault of the change feed: no decoder may give
        // up the slot for it (found: one whose clock stepped ahead took its
        // last status for old, and a change waited 163 ms, bound 100 ms).
        let gave_up = match kind {
            Kind::ClockSkew => Some(fleet.decoders_gave_up().await),
            _ => None,
        };
        // How long PostgreSQL took connections from no one, where it was
        // restarted: while it is down, nothing can learn of the changes
        // it committed last, and its recovery is its own.
        let (what, primary_down) = match kind {
            Kind::PostgresRestarted => restart_primary(&fleet).await,
            _ => (inject(kind, &fleet, &args, &mut rng).await?, Duration::ZERO),
        };
        let healthy = fleet.until_healthy(HEAL_LIMIT).await;
        let healed = clock.now();
        println!(
            "{:>7.1} s  {:<18} {what}; healthy {:.1} s later",
            injected.as_secs_f64(),
            kind.name(),
            (healed - injected).as_secs_f64()
        );
        if let Err(why) = healthy {
            schedule
                .unhealed
                .push(format!("{} ({what}): {why:#}", kind.name()));
        }
        if let Some(before) = gave_up {
            // Per instance, where both reads were answered (a process
            // restarted since counts from 0 again: none is, in this fault).
            let after = fleet.decoders_gave_up().await;
            let more: u64 = before
                .iter()
                .zip(&after)
                .filter_map(|(before, after)| {
                    Some(after.as_ref()?.saturating_sub(*before.as_ref()?))
                })
                .sum();
            if more > 0 {
                schedule.broken.push(format!(
                    "{} at {:.1} s ({what}): a decoder gave up the slot {more} time(s)",
                    kind.name(),
                    injected.as_secs_f64(),
                ));
            }
        }
        let bound = match kind {
            // The walsender's decoding time, as it was: from the write's
            // start until the fleet served a change made after it, and the
            // normal bound past that.
            Kind::SlowWalsender => healed.saturating_sub(injected) + args.bound,
            _ => primary_down + kind.bound(&args),
        };
        schedule.windows.push(Window {
            kind: kind.name(),
            what,
            injected,
            healed,
            bound,
        });
        tokio::time::sleep(Duration::from_secs(args.quiet)).await;
    }
    Ok(schedule)
}

/// Crashes PostgreSQL (`-m immediate`) and starts it again 0.5 s later:
/// what was done, and how long it took no connection (the pause, and its
/// recovery from the crash, which replays the WAL since the last
/// checkpoint: tenths of a second at rest, seconds after a bulk write).
async fn restart_primary(fleet: &Fleet) -> (String, Duration) {
    let mut primary = fleet.primary.lock().await;
    let crashed = Instant::now();
    primary.stop();
    tokio::time::sleep(Duration::from_millis(500)).await;
    primary.start().await;
    let down = crashed.elapsed();
    (
        format!(
            "crashed, started again; connections taken again {:.1} s after the crash",
            down.as_secs_f64()
        ),
        down,
    )
}

/// Causes one fault and undoes what must be undone (a process restarted,
/// a server started); says what was done.
async fn inject(
    kind: Kind,
    fleet: &Fleet,
    args: &Args,
    rng: &mut StdRng,
) -> anyhow::Result<String> {
    let instances = fleet.instances.len();
    Ok(match kind {
        Kind::DecoderKilled => {
            let mut decoder = None;
            let started = Instant::now();
            while decoder.is_none() && started.elapsed() < Duration::from_secs(10) {
                decoder = fleet.decoder().await;
            }
            let Some(i) = decoder else {
                return Ok("no instance decodes: nothing killed".into());
            };
            fleet.kill(i);
            tokio::time::sleep(DOWN).await;
            fleet.start_instance(i).await?;
            format!("instance {i}, the decoder")
        }
        Kind::InstanceKilled => {
            let Some((i, loading)) = loading_other(fleet, rng).await else {
                return Ok("no instance but the decoder: nothing killed".into());
            };
            fleet.kill(i);
            tokio::time::sleep(DOWN).await;
            fleet.start_instance(i).await?;
            format!("instance {i}{}", if loading { ", loading" } else { "" })
        }
        Kind::InstanceStopped => {
            let i = rng.random_range(0..instances);
            let decoder = fleet.decoder().await;
            fleet.signal(i, "STOP");
            tokio::time::sleep(STOPPED).await;
            fleet.signal(i, "CONT");
            format!(
                "instance {i}{}",
                if decoder == Some(i) {
                    ", the decoder"
                } else {
                    ""
                }
            )
        }
        Kind::RedisRestarted => {
            let mut redis = fleet.redis.lock().await;
            redis.kill();
            tokio::time::sleep(DOWN).await;
            redis.restart().await;
            // Its replica syncs again at once (see `RedisReplica::of`).
            redis.cli(&["config", "set", "repl-diskless-sync-delay", "0"]);
            "restarted empty".into()
        }
        Kind::RedisFailover => {
            let mut redis = fleet.redis.lock().await;
            let mut standby = fleet.redis_replica.lock().await;
            let Some(replica) = standby.take() else {
                return Ok("no replica: nothing failed over".into());
            };
            replica.link.stall(true);
            tokio::time::sleep(REPLICA_STALLED).await;
            redis.kill();
            let promoted = replica.server.cli(&["replicaof", "no", "one"]);
            anyhow::ensure!(promoted == "OK", "REPLICAOF NO ONE: {promoted}");
            for instance in &fleet.instances {
                instance
                    .proxy
                    .retarget(([127, 0, 0, 1], replica.server.port).into());
            }
            *redis = replica.server;
            // A replica for the next time.
            *standby = Some(RedisReplica::of(&redis).await);
            format!(
                "replica stalled {:.1} s, primary killed, replica promoted",
                REPLICA_STALLED.as_secs_f64()
            )
        }
        Kind::RedisPaused => {
            let redis = fleet.redis.lock().await;
            let ms = PAUSED.as_millis().to_string();
            redis.cli(&["client", "pause", &ms, "all"]);
            tokio::time::sleep(PAUSED).await;
            format!("{} s", PAUSED.as_secs())
        }
        Kind::ListenersCut => {
            let cut: usize = fleet
                .instances
                .iter()
                .map(|i| i.proxy.cut_listeners())
                .sum();
            format!("{cut} connections cut")
        }
        Kind::PostgresRestarted => restart_primary(fleet).await.0,
        Kind::ReplicaLagging => {
            let standby = fleet.standby.as_ref().expect("--replicas");
            let url = format!("{}/{}", standby.url(), fleet.env.db_name);
            replay(&url, false).await?;
            tokio::time::sleep(REPLICA_PAUSED).await;
            replay(&url, true).await?;
            format!("replay paused {} s", REPLICA_PAUSED.as_secs())
        }
        Kind::SlotDropped => {
            let slot = fleet.slot();
            let admin = fleet.env.admin.clone();
            let started = Instant::now();
            loop {
                let _ = sqlx::query(
                    "select pg_terminate_backend(active_pid) from pg_replication_slots
                     where slot_name = $1 and active_pid is not null",
                )
                .bind(&slot)
                .execute(&admin)
                .await;
                let dropped = sqlx::query("select pg_drop_replication_slot($1)")
                    .bind(&slot)
                    .execute(&admin)
                    .await;
                if dropped.is_ok() {
                    // Healed once the fleet holds a slot again (the canary
                    // alone may pass before any instance noticed).
                    let held = Instant::now();
                    while held.elapsed() < HEAL_LIMIT {
                        let active: Option<bool> = sqlx::query_scalar(
                            "select active from pg_replication_slots where slot_name = $1",
                        )
                        .bind(&slot)
                        .fetch_optional(&admin)
                        .await
                        .ok()
                        .flatten();
                        if active == Some(true) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    break format!(
                        "dropped; held again after {:.1} s",
                        held.elapsed().as_secs_f64()
                    );
                }
                if started.elapsed() > Duration::from_secs(10) {
                    break "could not be dropped within 10 s".into();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Kind::DecoderSilenced => {
            let Some(i) = fleet.decoder().await else {
                return Ok("no instance decodes: nothing silenced".into());
            };
            let proxy = &fleet.instances[i].pg_proxy;
            proxy.stall_replication(true);
            tokio::time::sleep(SILENCED).await;
            proxy.stall_replication(false);
            format!(
                "instance {i}, the decoder: its replication connection, for {} s",
                SILENCED.as_secs()
            )
        }
        Kind::LeaderStopped => {
            let Some((i, loading)) = loading_other(fleet, rng).await else {
                return Ok("no instance but the decoder: nothing stopped".into());
            };
            fleet.signal(i, "STOP");
            tokio::time::sleep(LEADER_STOPPED).await;
            fleet.signal(i, "CONT");
            format!(
                "instance {i}{} for {} s",
                if loading { ", loading," } else { "" },
                LEADER_STOPPED.as_secs()
            )
        }
        Kind::SlowWalsender => {
            let started = Instant::now();
            sqlx::query("create table if not exists coherence_bulk (id bigint, pad text)")
                .execute(&fleet.env.admin)
                .await?;
            sqlx::query(
                "insert into coherence_bulk
                 select n, repeat('x', 100) from generate_series(1, $1) n",
            )
            .bind(BULK_ROWS as i64)
            .execute(&fleet.env.admin)
            .await?;
            // Kept small: the next one writes as much again.
            sqlx::query("truncate coherence_bulk")
                .execute(&fleet.env.admin)
                .await?;
            format!(
                "{BULK_ROWS} rows written in {:.1} s",
                started.elapsed().as_secs_f64()
            )
        }
        Kind::ClockSkew => {
            let mut skews = Vec::new();
            for i in 0..instances {
                let seconds = rng.random_range(1..=MAX_SKEW_SECONDS)
                    * if rng.random_bool(0.5) { 1 } else { -1 };
                fleet.skew(i, seconds)?;
                skews.push(format!("{seconds:+} s"));
            }
            tokio::time::sleep(SKEWED).await;
            for i in 0..instances {
                fleet.skew(i, 0)?;
            }
            tokio::time::sleep(SKEW_TAKES).await;
            format!(
                "instances' clocks {} for {} s",
                skews.join(", "),
                SKEWED.as_secs()
            )
        }
        Kind::InvalidateAll => {
            let binary = args.binary.clone().unwrap_or_else(ServiceProcess::binary);
            let redis_url = fleet.redis.lock().await.url();
            let out = Command::new(binary)
                .args(["invalidate", "--all"])
                .env("DATABASE_URL", fleet.db_url())
                .env("REDIS_URL", redis_url)
                .env("KEY_PREFIX", &fleet.env.prefix)
                .env("RUST_LOG", "warn")
                .output()?;
            if out.status.success() {
                "done".into()
            } else {
                format!("failed: {}", String::from_utf8_lossy(&out.stderr).trim())
            }
        }
    })
}

/// An instance other than the decoder, one with a load in flight if one
/// comes within a second (and whether it had one); `None` when the decoder
/// is the only instance.
async fn loading_other(fleet: &Fleet, rng: &mut StdRng) -> Option<(usize, bool)> {
    let decoder = fleet.decoder().await;
    let others: Vec<usize> = (0..fleet.instances.len())
        .filter(|i| Some(*i) != decoder)
        .collect();
    let fallback = *others.get(rng.random_range(0..others.len().max(1)))?;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(1) {
        for &i in &others {
            if fleet.metric(i, "postcache_flights_in_progress").await > Some(0.0) {
                return Some((i, true));
            }
        }
    }
    Some((fallback, false))
}

/// Pauses or resumes a standby's replay.
async fn replay(url: &str, resume: bool) -> anyhow::Result<()> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let sql = if resume {
        "select pg_wal_replay_resume()"
    } else {
        "select pg_wal_replay_pause()"
    };
    sqlx::query(sql).execute(&mut conn).await?;
    Ok(())
}
