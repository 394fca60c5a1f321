//! Element-wise fills, copies and adds, and deterministic sums.

use rayon::prelude::*;

/// Elements per task; also the granularity of partial sums, so sums do not depend on threads.
const CHUNK: usize = 1 << 14;

/// Number of partial sums [`sum`] needs for `n` elements.
pub fn partial_count(n: usize) -> usize {
    n.div_ceil(CHUNK)
}

/// `x[i] = value`.
pub fn fill(x: &mut [f32], value: f32) {
    x.par_chunks_mut(CHUNK).for_each(|c| c.fill(value));
}

/// `dst = src`.
pub fn copy(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| d.copy_from_slice(s));
}

/// `x *= s`.
pub fn scale(x: &mut [f32], s: f32) {
    x.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|x| *x *= s));
}

/// `dst += src`.
pub fn add(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| {
        d.iter_mut().zip(s).for_each(|(d, s)| *d += s);
    });
}

/// `Σ f(x[i])` in f64: fixed chunks summed into `partials` in parallel, then added in order.
pub fn sum(x: &[f32], partials: &mut [f64], f: impl Fn(f32) -> f64 + Sync) -> f64 {
    assert_eq!(partials.len(), partial_count(x.len()));
    partials.par_iter_mut().zip(x.par_chunks(CHUNK)).for_each(|(p, c)| *p = lanes_sum(c, &f));
    partials.iter().sum()
}

/// Sum of a chunk with eight independent accumulators (vectorisable, and still a fixed order).
pub fn lanes_sum(c: &[f32], f: &impl Fn(f32) -> f64) -> f64 {
    let mut acc = [0f64; 8];
    let mut blocks = c.chunks_exact(8);
    for b in &mut blocks {
        for (a, &v) in acc.iter_mut().zip(b) {
            *a += f(v);
        }
    }
    let tail: f64 = blocks.remainder().iter().map(|&v| f(v)).sum();
    acc.iter().sum::<f64>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_exact_on_integers_and_independent_of_threads() {
        let x: Vec<f32> = (0..100_003).map(|i| (i % 7) as f32 - 3.0).collect();
        let expected: f64 = x.iter().map(|&v| v as f64).sum();
        let mut partials = vec![0.0; partial_count(x.len())];
        assert_eq!(sum(&x, &mut partials, |v| v as f64), expected);
        let y: Vec<f32> = (0..50_000).map(|i| ((i * 7919) % 1000) as f32 * 1e-3).collect();
        let mut p = vec![0.0; partial_count(y.len())];
        let one =
            rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| sum(&y, &mut p, |v| v as f64));
        let many =
            rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap().install(|| sum(&y, &mut p, |v| v as f64));
        assert_eq!(one.to_bits(), many.to_bits());
    }
}
