//! Weighted mixtures of datasets: which source each sequence is read from.
//!
//! Sequence `g` (counted over all data-parallel ranks, as the loader counts samples: row `k` of
//! rank `r` of `w` is `g = k·w + r`) takes the source whose slice of `[0, 2^64)` holds
//!
//! ```text
//! x_g = offset + g · ⌊2^64 / φ⌋   (mod 2^64),   offset = rng::bits(seed, stream, 0)
//! ```
//!
//! the slices being consecutive, in `data.mixture`'s order, each as wide as its share of the
//! weights. Multiples of the golden ratio modulo 1 are the most evenly spread sequence there is
//! (the three-gap theorem), so after `n` sequences every source's count is within a few
//! sequences of `n · share` (a random draw per sequence would be off by `√n`). The choice is a
//! pure function of `(seed, g)`: every rank computes the same decisions with no communication,
//! and a resumed run needs only `g` and each source's own read position.

use crate::rng;

/// `⌊2^64 / φ⌋`: the golden ratio in 64-bit fixed point.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// [`rng::bits`] stream of the training sequences' offset.
pub const TRAIN_STREAM: u64 = 0x313c_0001;
/// [`rng::bits`] stream of the validation samples' offset (another sequence than training's).
pub const VALIDATION_STREAM: u64 = 0x313c_0002;

/// The source of every sequence index, for fixed weights and seed.
#[derive(Debug, Clone)]
pub struct Mixture {
    /// The upper end (exclusive) of each source's slice; the last slice ends at 2^64.
    bounds: Vec<u64>,
    offset: u64,
}

impl Mixture {
    /// The choice for `weights` (positive and finite, any sum) from `(seed, stream)`. The
    /// weights are divided by the largest first: two weights of 1e308 sum to infinity, which
    /// made every share 0 and sent every sequence to the last source.
    pub fn new(weights: &[f64], seed: u64, stream: u64) -> Mixture {
        let largest = weights.iter().copied().fold(0.0, f64::max);
        let total: f64 = weights.iter().map(|w| w / largest).sum();
        let mut sum = 0.0;
        let bounds = weights
            .iter()
            .map(|w| {
                sum += w / largest;
                // 2^64 · share, rounded down; `as` saturates at u64::MAX for the last.
                (sum / total * 18_446_744_073_709_551_616.0) as u64
            })
            .collect();
        Mixture { bounds, offset: rng::bits(seed, stream, 0) }
    }

    /// The source of sequence `g`.
    pub fn source(&self, g: u64) -> usize {
        let x = self.offset.wrapping_add(g.wrapping_mul(GOLDEN));
        self.bounds.iter().position(|&b| x < b).unwrap_or(self.bounds.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(m: &Mixture, n: u64, sources: usize) -> Vec<u64> {
        let mut c = vec![0; sources];
        for g in 0..n {
            c[m.source(g)] += 1;
        }
        c
    }

    /// Every prefix of the sequence keeps each source within a few sequences of its share, for
    /// any seed; a random draw per sequence would stray by about √n.
    #[test]
    fn every_prefix_follows_the_weights_closely() {
        for seed in 0..20 {
            let m = Mixture::new(&[0.75, 0.25], seed, TRAIN_STREAM);
            let mut c = [0u64; 2];
            for g in 0..10_000u64 {
                c[m.source(g)] += 1;
                let off = (c[0] as f64 - 0.75 * (g + 1) as f64).abs();
                assert!(off < 4.0, "seed {seed}: {c:?} after {} sequences", g + 1);
            }
        }
        let c = counts(&Mixture::new(&[5.0, 3.0, 2.0], 9, TRAIN_STREAM), 1000, 3);
        assert!(c.iter().zip([500.0, 300.0, 200.0]).all(|(&n, want)| (n as f64 - want).abs() < 4.0), "{c:?}");
    }

    /// The seed and the stream move the sequence: other seeds, another order.
    #[test]
    fn the_seed_decides_the_order() {
        let order = |seed, stream| (0..64).map(|g| Mixture::new(&[1.0, 1.0], seed, stream).source(g)).collect();
        let a: Vec<usize> = order(1, TRAIN_STREAM);
        assert_eq!(a, order(1, TRAIN_STREAM));
        assert_ne!(a, order(2, TRAIN_STREAM));
        assert_ne!(a, order(1, VALIDATION_STREAM));
        assert_eq!(counts(&Mixture::new(&[1.0], 3, TRAIN_STREAM), 100, 1), [100]);
    }

    /// Weights whose sum overflows to infinity keep their shares (two of 1e308 sent every
    /// sequence to the last source); so do weights too small for their shares to be computed
    /// from their sum directly.
    #[test]
    fn extreme_weights_keep_their_shares() {
        for (weights, want) in
            [([1e308, 1e308], [320, 320]), ([3e-320, 1e-320], [480, 160]), ([f64::MAX, f64::MAX / 3.0], [480, 160])]
        {
            let c = counts(&Mixture::new(&weights, 4, TRAIN_STREAM), 640, 2);
            assert!(c.iter().zip(want).all(|(&n, want)| n.abs_diff(want) <= 4), "{weights:?}: {c:?}");
        }
    }
}
