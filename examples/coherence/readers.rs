//! The checker's readers: `GET /posts/{id}` and `GET /posts?ids=` spread
//! over the instances at a steady pace, each read logged with its times,
//! the instance and process that answered, and the version it carried;
//! and the final sweep, which reads every post on every instance until
//! each serves the last version written.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use futures::{stream, StreamExt};
use postcache::{
    http::position::format_lsn,
    testkit::{
        history::{Garble, History, PositionRead, Read, Seen, Served, Unjudged},
        Zipf,
    },
};
use rand::{rngs::StdRng, Rng};
use tokio_util::sync::CancellationToken;

use crate::{
    fleet::{Fleet, Target},
    writers::{body, parse_marker},
    Clock,
};

/// Requests that got no judgeable answer: when, where and why.
#[derive(Debug, Default)]
pub struct Errors(pub Vec<Unjudged>);

impl Errors {
    fn count(&mut self, at: Duration, target: &Target, why: impl Into<String>) {
        self.0.push(Unjudged {
            at,
            instance: target.index,
            class: why.into(),
        });
    }

    pub fn merge(&mut self, other: Errors) {
        self.0.extend(other.0);
    }

    pub fn total(&self) -> u64 {
        self.0.len() as u64
    }
}

/// What one post's JSON says, against the post asked for.
fn seen(post: i64, json: &serde_json::Value) -> Seen {
    if json["id"].as_i64() != Some(post) {
        return Seen::Garbled(Garble::OtherPost);
    }
    let (Some(title), Some(text)) = (json["title"].as_str(), json["body"].as_str()) else {
        return Seen::Garbled(Garble::Unreadable);
    };
    let (Some((p, seq)), Some((q, body_seq))) = (
        parse_marker(title),
        text.split(' ').next().and_then(parse_marker),
    ) else {
        return Seen::Garbled(Garble::Unreadable);
    };
    if p != post || q != post {
        return Seen::Garbled(Garble::OtherPost);
    }
    if seq != body_seq || text != body(post, seq) {
        return Seen::Garbled(Garble::Mixed);
    }
    Seen::Found(seq)
}

/// `--read-your-writes`: what readers and writers share to read with
/// positions, and the position reads made.
#[derive(Clone)]
pub struct Ryw {
    pub targets: Vec<Target>,
    /// The latest position a writer read after its COMMIT.
    pub latest: Arc<AtomicU64>,
    pub history: Arc<Mutex<History>>,
    pub reads: Arc<Mutex<Vec<PositionRead>>>,
    pub errors: Arc<Mutex<Errors>>,
}

impl Ryw {
    pub fn new(targets: Vec<Target>, history: Arc<Mutex<History>>) -> Self {
        Self {
            targets,
            latest: Arc::default(),
            history,
            reads: Arc::default(),
            errors: Arc::default(),
        }
    }

    pub fn pick(&self, rng: &mut StdRng) -> Target {
        self.targets[rng.random_range(0..self.targets.len())].clone()
    }

    /// Keeps a position read (and the errors met on the way).
    pub fn record(
        &self,
        read: Option<(Read, bool)>,
        min_lsn: u64,
        by_writer: bool,
        errors: Errors,
    ) {
        self.errors.lock().unwrap().merge(errors);
        if let Some((read, past)) = read {
            self.reads.lock().unwrap().push(PositionRead {
                read,
                min_lsn,
                by_writer,
                past,
            });
        }
    }

    /// The position of the version `seen` of `post`, once its writer read
    /// it (0: not known yet, or a 404).
    fn position_of(&self, post: i64, seen: Seen) -> u64 {
        let Seen::Found(seq) = seen else {
            return 0;
        };
        let history = self.history.lock().unwrap();
        history
            .versions(post)
            .iter()
            .find(|v| v.seq == seq)
            .map_or(0, |v| v.lsn)
    }
}

pub struct Reader {
    targets: Vec<Target>,
    zipf: Zipf,
    clock: Clock,
    rng: StdRng,
    /// Between two reads of this reader.
    every: Duration,
    /// `--read-your-writes`: half the single reads carry a position, the
    /// latest written (as if this client had just written) or the latest
    /// of the versions this reader has seen, half and half.
    ryw: Option<Ryw>,
    /// The latest position of a version this reader has seen.
    session: u64,
    /// The share of single reads asking for no staleness at all.
    max_staleness_share: f64,
}

impl Reader {
    pub fn new(
        targets: Vec<Target>,
        posts: i64,
        clock: Clock,
        rng: StdRng,
        per_second: f64,
        ryw: Option<Ryw>,
        max_staleness_share: f64,
    ) -> Self {
        Self {
            targets,
            zipf: Zipf::new(posts as usize, 1.0),
            clock,
            rng,
            every: Duration::from_secs_f64(1.0 / per_second.max(0.1)),
            ryw,
            session: 0,
            max_staleness_share: max_staleness_share.clamp(0.0, 1.0),
        }
    }

    /// Reads at its pace until stopped.
    pub async fn run(mut self, stop: CancellationToken) -> (Vec<Read>, Errors) {
        let mut reads = Vec::new();
        let mut errors = Errors::default();
        let mut next = Instant::now() + self.every.mul_f64(self.rng.random_range(0.0..1.0));
        while !stop.is_cancelled() {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep_until(next.into()) => {}
            }
            // No burst to catch up after a stall: the pace resumes.
            next = (next + self.every).max(Instant::now());
            let target = &self.targets[self.rng.random_range(0..self.targets.len())];
            if self.rng.random_bool(0.1) {
                let n = self.rng.random_range(2..=8);
                let mut ids: Vec<i64> = (0..n).map(|_| self.zipf.sample(&mut self.rng)).collect();
                ids.sort_unstable();
                ids.dedup();
                // With read your writes, half the batches carry a position
                // too (the latest written).
                let min_lsn = self
                    .ryw
                    .as_ref()
                    .filter(|_| self.rng.random_bool(0.5))
                    .map(|ryw| ryw.latest.load(Ordering::SeqCst))
                    .filter(|&lsn| lsn > 0);
                read_batch(target, &ids, min_lsn, self.clock, &mut reads, &mut errors).await;
            } else if let Some(ryw) = self.ryw.clone().filter(|_| self.rng.random_bool(0.5)) {
                let id = self.zipf.sample(&mut self.rng);
                let min_lsn = if self.rng.random_bool(0.5) {
                    ryw.latest.load(Ordering::SeqCst)
                } else {
                    self.session
                };
                let mut met = Errors::default();
                let read = read_one_at(target, id, Some(min_lsn), self.clock, &mut met).await;
                if let Some((read, _)) = &read {
                    reads.push(*read);
                    self.session = self.session.max(ryw.position_of(id, read.seen));
                }
                ryw.record(read, min_lsn, false, met);
            } else if self.rng.random_bool(self.max_staleness_share) {
                // No staleness at all: past the cache, and what this
                // instance serves after it must be no older.
                let id = self.zipf.sample(&mut self.rng);
                let path = format!("/posts/{id}");
                let headers = [("PostCache-Max-Staleness", "0ms")];
                if let Some(a) =
                    get_with(target, &path, None, &headers, self.clock, &mut errors).await
                {
                    if let Some(read) = judged(target, id, a, &mut errors) {
                        reads.push(read);
                    }
                }
            } else {
                let id = self.zipf.sample(&mut self.rng);
                if let Some(read) = read_one(target, id, self.clock, &mut errors).await {
                    reads.push(read);
                }
            }
        }
        (reads, errors)
    }
}

/// One response, as the readers judge it.
struct Answered {
    status: u16,
    served: Served,
    bytes: bytes::Bytes,
    incarnation: u16,
    began: Duration,
    ended: Duration,
    /// It went past the cache (`Cache-Status: …detail=position`).
    past: bool,
    /// Its `PostCache-LSN` (0: none).
    lsn: u64,
}

/// A response, with the process that answered it, asking for every commit
/// up to `min_lsn` when given; `None` (counted) when none came, or when the
/// instance was restarted meanwhile (which process answered is then
/// unknown).
async fn get_with(
    target: &Target,
    path: &str,
    min_lsn: Option<u64>,
    headers: &[(&str, &str)],
    clock: Clock,
    errors: &mut Errors,
) -> Option<Answered> {
    let incarnation = target.incarnation.load(Ordering::SeqCst);
    let began = clock.now();
    let mut request = target.client.get(format!("{}{path}", target.base));
    if let Some(lsn) = min_lsn {
        request = request.header("PostCache-Min-LSN", format_lsn(lsn));
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) => {
            errors.count(
                began,
                target,
                if error.is_timeout() {
                    "no answer within 10 s"
                } else {
                    "connection failed"
                },
            );
            return None;
        }
    };
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let served = Served::from_headers(
        header("x-cache").as_deref(),
        header("x-cache-tier").as_deref(),
    );
    let past = header("cache-status").is_some_and(|s| s.ends_with("detail=position"));
    let lsn = header("postcache-lsn")
        .as_deref()
        .and_then(postcache::http::position::parse_lsn)
        .unwrap_or(0);
    let Ok(bytes) = response.bytes().await else {
        errors.count(began, target, "answer cut");
        return None;
    };
    let ended = clock.now();
    if target.incarnation.load(Ordering::SeqCst) != incarnation {
        errors.count(began, target, "instance restarted during the read");
        return None;
    }
    if status == 400 && min_lsn.is_some() {
        errors.count(
            began,
            target,
            format!("400 for a position: {}", String::from_utf8_lossy(&bytes)),
        );
        return None;
    }
    Some(Answered {
        status,
        served,
        bytes,
        incarnation,
        began,
        ended,
        past,
        lsn,
    })
}

async fn read_one(target: &Target, id: i64, clock: Clock, errors: &mut Errors) -> Option<Read> {
    read_one_at(target, id, None, clock, errors)
        .await
        .map(|(read, _)| read)
}

/// Reads post `id` asking for every commit up to `min_lsn` (read your
/// writes): the read, and whether it went past the cache.
pub async fn read_one_at(
    target: &Target,
    id: i64,
    min_lsn: Option<u64>,
    clock: Clock,
    errors: &mut Errors,
) -> Option<(Read, bool)> {
    let a = get_with(target, &format!("/posts/{id}"), min_lsn, &[], clock, errors).await?;
    let past = a.past;
    Some((judged(target, id, a, errors)?, past))
}

/// The read of post `id` an answer is, or `None` (counted) for an answer
/// that cannot be judged.
fn judged(target: &Target, id: i64, a: Answered, errors: &mut Errors) -> Option<Read> {
    let seen = match a.status {
        200 => match serde_json::from_slice(&a.bytes) {
            Ok(json) => seen(id, &json),
            Err(_) => Seen::Garbled(Garble::Unreadable),
        },
        404 => Seen::Missing,
        other => {
            errors.count(a.began, target, format!("status {other}"));
            return None;
        }
    };
    Some(Read {
        post: id,
        instance: target.index,
        incarnation: a.incarnation,
        began: a.began,
        ended: a.ended,
        seen,
        served: a.served,
        batch: false,
        lsn: a.lsn,
    })
}

/// Reads `ids` in one batch, asking for every commit up to `min_lsn` when
/// given: a read per post, each with the batch's times and position.
async fn read_batch(
    target: &Target,
    ids: &[i64],
    min_lsn: Option<u64>,
    clock: Clock,
    reads: &mut Vec<Read>,
    errors: &mut Errors,
) {
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let Some(a) = get_with(
        target,
        &format!("/posts?ids={list}"),
        min_lsn,
        &[],
        clock,
        errors,
    )
    .await
    else {
        return;
    };
    if a.status != 200 {
        errors.count(a.began, target, format!("batch status {}", a.status));
        return;
    }
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(&a.bytes) else {
        errors.count(a.began, target, "batch body unreadable");
        return;
    };
    let stale: Vec<i64> = json["stale"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_i64)
        .collect();
    let read = |post: i64, seen: Seen| Read {
        post,
        instance: target.index,
        incarnation: a.incarnation,
        began: a.began,
        ended: a.ended,
        seen,
        served: if stale.contains(&post) {
            Served::Stale
        } else if a.past {
            Served::Bypass
        } else {
            Served::Other
        },
        batch: true,
        lsn: a.lsn,
    };
    for post in json["posts"].as_array().into_iter().flatten() {
        let id = post["id"].as_i64().unwrap_or(0);
        if ids.contains(&id) {
            reads.push(read(id, seen(id, post)));
        } else {
            errors.count(a.began, target, "batch answered a post not asked for");
        }
    }
    for id in json["not_found"].as_array().into_iter().flatten() {
        if let Some(id) = id.as_i64() {
            reads.push(read(id, Seen::Missing));
        }
    }
    for _ in json["unavailable"].as_array().into_iter().flatten() {
        errors.count(a.began, target, "unavailable in a batch");
    }
}

/// How the fleet converged once the writes stopped.
#[derive(Debug)]
pub struct Convergence {
    /// When the first sweep that found every post in its last version on
    /// every instance began; `None` if none did within the limit.
    pub at: Option<Duration>,
    pub sweeps: usize,
    /// What the last sweep still found wrong (at most a few).
    pub wrong: Vec<String>,
}

/// Reads every post on every instance, sweep after sweep, until one sweep
/// finds each in its last version (bounded by `limit`).
pub async fn converge(
    fleet: &Fleet,
    history: &Mutex<History>,
    clock: Clock,
    limit: Duration,
) -> Convergence {
    let finals: Vec<(i64, Seen)> = {
        let history = history.lock().unwrap();
        let mut finals: Vec<(i64, Seen)> = history
            .finals()
            .map(|(post, v)| {
                (
                    post,
                    if v.exists {
                        Seen::Found(v.seq)
                    } else {
                        Seen::Missing
                    },
                )
            })
            .collect();
        finals.sort_by_key(|f| f.0);
        finals
    };
    let started = Instant::now();
    let mut sweeps = 0;
    loop {
        sweeps += 1;
        let began = clock.now();
        let errors = Mutex::new(Errors::default());
        let checks = fleet.targets().into_iter().flat_map(|t| {
            finals
                .iter()
                .map(move |&(post, wanted)| (t.clone(), post, wanted))
        });
        let wrong: Vec<String> = stream::iter(checks)
            .map(|(target, post, wanted)| {
                let errors = &errors;
                async move {
                    let mut mine = Errors::default();
                    let read = read_one(&target, post, clock, &mut mine).await;
                    errors.lock().unwrap().merge(mine);
                    match read {
                        Some(read) if read.seen == wanted => None,
                        Some(read) => Some(format!(
                            "instance {} post {post}: {:?}, {} (last written {wanted:?})",
                            target.index,
                            read.seen,
                            read.served.as_str()
                        )),
                        None => Some(format!("instance {} post {post}: no answer", target.index)),
                    }
                }
            })
            .buffer_unordered(32)
            .filter_map(|w| async move { w })
            .collect()
            .await;
        if wrong.is_empty() {
            return Convergence {
                at: Some(began),
                sweeps,
                wrong,
            };
        }
        if started.elapsed() > limit {
            return Convergence {
                at: None,
                sweeps,
                wrong: wrong.into_iter().take(10).collect(),
            };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
