//! Test support: a steady read load over a fleet, recorded per request, and
//! what the fault tests read from the record: the status mix and the hit
//! ratio over time, and how long the hit ratio took to come back after a
//! fault.

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use rand::Rng;
use tokio::{sync::watch, task::JoinHandle};

use super::Http;

/// One answered (or failed) request.
#[derive(Debug, Clone)]
pub struct Sample {
    pub sent: Instant,
    pub instance: usize,
    pub id: i64,
    /// The HTTP status; 0 when no response came.
    pub status: u16,
    pub x_cache: String,
}

/// Ids 1..=n drawn with Zipf(s) frequencies, the shape of real read traffic.
pub struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Self {
        let mut total = 0.0;
        let cumulative = (1..=n)
            .map(|k| {
                total += 1.0 / (k as f64).powf(s);
                total
            })
            .collect();
        Self { cumulative }
    }

    pub fn sample(&self, rng: &mut impl Rng) -> i64 {
        let total = self.cumulative.last().copied().unwrap_or(0.0);
        let x = rng.random::<f64>() * total;
        self.cumulative.partition_point(|&c| c < x) as i64 + 1
    }
}

/// `workers` loops, each sending one GET every `pace` to the instances in
/// turn, until stopped. Requests are bounded by the service's own
/// REQUEST_TIMEOUT; a response that never comes is recorded as status 0.
pub struct SteadyLoad {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    samples: Arc<Mutex<Vec<Sample>>>,
}

impl SteadyLoad {
    pub fn start(fleet: &[Http], ids: Zipf, workers: usize, pace: Duration) -> Self {
        let (stop, stopped) = watch::channel(false);
        let samples = Arc::new(Mutex::new(Vec::new()));
        let ids = Arc::new(ids);
        let tasks = (0..workers)
            .map(|w| {
                let (fleet, ids, samples) = (fleet.to_vec(), ids.clone(), samples.clone());
                let mut stopped = stopped.clone();
                tokio::spawn(async move {
                    let mut every = tokio::time::interval(pace);
                    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    for n in w.. {
                        tokio::select! {
                            _ = every.tick() => {}
                            _ = stopped.changed() => return,
                        }
                        let instance = n % fleet.len();
                        let id = ids.sample(&mut rand::rng());
                        let sent = Instant::now();
                        let path = format!("/posts/{id}");
                        let reply = fleet[instance].send(reqwest::Method::GET, &path, &[]);
                        let (status, x_cache) =
                            match tokio::time::timeout(Duration::from_secs(30), reply).await {
                                Ok(Ok(r)) => (r.status, r.x_cache.unwrap_or_default()),
                                _ => (0, String::new()),
                            };
                        let sample = Sample {
                            sent,
                            instance,
                            id,
                            status,
                            x_cache,
                        };
                        samples
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(sample);
                    }
                })
            })
            .collect();
        Self {
            stop,
            tasks,
            samples,
        }
    }

    /// Stops the workers and returns every sample, in the order sent.
    pub async fn stop(self) -> Record {
        let _ = self.stop.send(true);
        for task in self.tasks {
            task.await.expect("a load worker");
        }
        let mut samples =
            std::mem::take(&mut *self.samples.lock().unwrap_or_else(PoisonError::into_inner));
        samples.sort_by_key(|s| s.sent);
        Record { samples }
    }
}

/// What a steady load recorded.
pub struct Record {
    pub samples: Vec<Sample>,
}

impl Record {
    /// Samples sent in `[from, to)`.
    pub fn between(&self, from: Instant, to: Instant) -> &[Sample] {
        let a = self.samples.partition_point(|s| s.sent < from);
        let b = self.samples.partition_point(|s| s.sent < to);
        &self.samples[a..b]
    }

    /// Responses that were not a 200 (a 5xx, a 4xx, or none at all).
    pub fn failures(&self) -> Vec<&Sample> {
        self.samples.iter().filter(|s| s.status != 200).collect()
    }

    /// The share of `hit` among the samples sent in `[from, to)`; `None` when
    /// fewer than `min` were sent.
    pub fn hit_ratio(&self, from: Instant, to: Instant, min: usize) -> Option<f64> {
        let window = self.between(from, to);
        let hits = window.iter().filter(|s| s.x_cache == "hit").count();
        (window.len() >= min.max(1)).then(|| hits as f64 / window.len() as f64)
    }

    /// How long after `from` the hit ratio came back to `level`: the start
    /// of the first `window` (sliding by 10 ms, ending by `until`) whose
    /// ratio reaches it; `None` if none did.
    pub fn recovery(
        &self,
        from: Instant,
        until: Instant,
        level: f64,
        window: Duration,
    ) -> Option<Duration> {
        let step = Duration::from_millis(10);
        let mut at = from;
        while at + window <= until {
            if self
                .hit_ratio(at, at + window, 10)
                .is_some_and(|r| r >= level)
            {
                return Some(at - from);
            }
            at += step;
        }
        None
    }

    /// `x-cache` values counted, for messages.
    pub fn mix(&self, from: Instant, to: Instant) -> Vec<(String, usize)> {
        let mut mix = std::collections::BTreeMap::new();
        for s in self.between(from, to) {
            *mix.entry(format!("{} {}", s.status, s.x_cache))
                .or_insert(0) += 1;
        }
        mix.into_iter().collect()
    }
}

/// The `q` quantile (0 to 1, nearest rank) of `sorted`; zero when empty.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let at = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, SeedableRng};

    use super::Zipf;

    /// The shares of the hottest ids among a million draws are Zipf's exact
    /// ones, k^-s / H(n, s): 13.5% for id 1 and 36.1% for ids 1..=10 at
    /// s = 1.1 over 100,000 ids (a continuous approximation gives 9.8% and
    /// 31.2%). `load/zipf-check` checks the k6 and wrk samplers the same way.
    #[test]
    fn draws_follow_the_exact_zipf_shares() {
        let (n, s) = (100_000, 1.1);
        let zipf = Zipf::new(n, s);
        let harmonic: f64 = (1..=n).map(|k| (k as f64).powf(-s)).sum();
        let exact = |k: usize| (k as f64).powf(-s) / harmonic;
        let mut rng = StdRng::seed_from_u64(7);
        let draws = 1_000_000;
        let mut top = [0u32; 10];
        for _ in 0..draws {
            let id = zipf.sample(&mut rng);
            assert!((1..=n as i64).contains(&id), "{id}");
            if id <= 10 {
                top[id as usize - 1] += 1;
            }
        }
        let share = |count: u32| f64::from(count) / f64::from(draws);
        let (first, ten) = (share(top[0]), share(top.iter().sum()));
        let (first_exact, ten_exact) = (exact(1), (1..=10).map(exact).sum::<f64>());
        assert!(
            (first - first_exact).abs() < 0.003,
            "{first} vs {first_exact}"
        );
        assert!((ten - ten_exact).abs() < 0.004, "{ten} vs {ten_exact}");
    }
}
