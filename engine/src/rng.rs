//! Counter-based random numbers: the value at (seed, stream, counter) is a pure function, so
//! initialisation and data order are reproducible whatever the threads, and any element can be
//! regenerated without replaying a sequence.

/// SplitMix64's finaliser: a bijective mix of 64 bits.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 64 random bits for `(seed, stream, counter)`.
pub fn bits(seed: u64, stream: u64, counter: u64) -> u64 {
    mix(mix(mix(seed) ^ stream) ^ counter)
}

/// Uniform in `[0, 1)` with 53 random bits.
pub fn uniform(seed: u64, stream: u64, counter: u64) -> f64 {
    (bits(seed, stream, counter) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Two independent standard normals (Box-Muller) for `(seed, stream, pair)`, from the two 32-bit
/// halves of one draw: plenty of resolution for initialisation (tails reach 6.7 σ), and one hash
/// per pair keeps initialising a billion parameters quick.
pub fn normal_pair(seed: u64, stream: u64, pair: u64) -> (f32, f32) {
    let b = bits(seed, stream, pair);
    let u1 = ((b >> 32) as f32 + 1.0) * (1.0 / 4_294_967_296.0); // (0, 1]: keeps ln finite
    let u2 = (b as u32) as f32 * (1.0 / 4_294_967_296.0);
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
    (r * c, r * s)
}

/// A uniformly random permutation of `0..n` (Fisher-Yates driven by [`bits`]).
pub fn permutation(n: usize, seed: u64, stream: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = (bits(seed, stream, i as u64) % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normals_have_the_right_moments() {
        let n = 200_000u64;
        let (mut sum, mut sq) = (0.0, 0.0);
        for i in 0..n / 2 {
            let (a, b) = normal_pair(7, 1, i);
            let (a, b) = (a as f64, b as f64);
            sum += a + b;
            sq += a * a + b * b;
        }
        let mean = sum / n as f64;
        let var = sq / n as f64 - mean * mean;
        assert!(mean.abs() < 0.01 && (var - 1.0).abs() < 0.01, "mean {mean} var {var}");
    }

    #[test]
    fn permutations_are_permutations_and_depend_on_the_seed() {
        let mut p = permutation(1000, 3, 0);
        assert_ne!(p, permutation(1000, 4, 0));
        p.sort();
        assert!(p.iter().enumerate().all(|(i, &x)| i as u32 == x));
    }
}
