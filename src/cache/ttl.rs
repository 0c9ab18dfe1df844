//! The cache: TTL jitter: scatter expiries so that keys written together do
//! not expire together.

use std::time::Duration;

use rand::Rng;

/// Multiplies TTLs by a uniform random factor in `[1 - j, 1 + j]`.
#[derive(Debug, Clone, Copy)]
pub struct Jitter(f64);

impl Jitter {
    /// `j` must lie in `[0, 1)`; the settings parser enforces it.
    pub fn new(j: f64) -> Self {
        debug_assert!((0.0..1.0).contains(&j));
        Self(j)
    }

    /// `ttl` scaled by a fresh random factor, at least one millisecond.
    pub fn apply(&self, ttl: Duration) -> Duration {
        self.apply_with(ttl, &mut rand::rng())
    }

    /// As [`Jitter::apply`] with the caller's random source (tests fix a seed).
    pub fn apply_with(&self, ttl: Duration, rng: &mut impl Rng) -> Duration {
        let factor = if self.0 == 0.0 {
            1.0
        } else {
            rng.random_range(1.0 - self.0..=1.0 + self.0)
        };
        ttl.mul_f64(factor).max(Duration::from_millis(1))
    }

    /// The smallest and largest TTL that [`Jitter::apply`] can return for `ttl`.
    pub fn window(&self, ttl: Duration) -> (Duration, Duration) {
        (ttl.mul_f64(1.0 - self.0), ttl.mul_f64(1.0 + self.0))
    }
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, SeedableRng};

    use super::*;

    #[test]
    fn jittered_ttls_stay_inside_the_window_and_spread_over_it() {
        let jitter = Jitter::new(0.1);
        let ttl = Duration::from_secs(60);
        let (lo, hi) = jitter.window(ttl);
        let mut rng = StdRng::seed_from_u64(7);
        let samples: Vec<_> = (0..10_000)
            .map(|_| jitter.apply_with(ttl, &mut rng))
            .collect();
        assert!(samples.iter().all(|d| *d >= lo && *d <= hi));
        let below = samples.iter().filter(|d| **d < ttl).count();
        // Uniform: about half below the nominal TTL.
        assert!((4_500..5_500).contains(&below), "{below} of 10000 below");
        let span = *samples.iter().max().unwrap() - *samples.iter().min().unwrap();
        assert!(span > Duration::from_secs(11), "spread {span:?}");
    }

    #[test]
    fn zero_jitter_keeps_the_ttl() {
        let ttl = Duration::from_millis(1500);
        assert_eq!(Jitter::new(0.0).apply(ttl), ttl);
    }
}
