//! Matrix products through the `gemm` crate.

use crate::backend::MatMul;

/// `out[m, n] (+)= op(a) · op(b)`, see [`MatMul`]. Threads split the output only, so the result
/// does not depend on their number.
pub fn matmul(out: &mut [f32], a: &[f32], b: &[f32], s: MatMul) {
    assert_eq!(out.len(), s.m * s.n, "matmul output");
    assert_eq!(a.len(), s.m * s.k, "matmul lhs");
    assert_eq!(b.len(), s.k * s.n, "matmul rhs");
    if s.m == 0 || s.n == 0 {
        return;
    }
    if s.k == 0 {
        if !s.accumulate {
            out.fill(0.0);
        }
        return;
    }
    // gemm takes (column stride, row stride) per operand.
    let (a_cs, a_rs) = if s.a_t { (s.m, 1) } else { (1, s.k) };
    let (b_cs, b_rs) = if s.b_t { (s.k, 1) } else { (1, s.n) };
    let threads = rayon::current_num_threads();
    let parallelism =
        if threads > 1 && s.flops() > 2e6 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the slices hold exactly the elements the shapes and strides address (asserted).
    unsafe {
        gemm::gemm(
            s.m,
            s.n,
            s.k,
            out.as_mut_ptr(),
            1,
            s.n as isize,
            s.accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook triple loop, in f64.
    fn naive(a: &[f32], b: &[f32], s: MatMul) -> Vec<f32> {
        let mut out = vec![0f32; s.m * s.n];
        for i in 0..s.m {
            for j in 0..s.n {
                let mut acc = 0f64;
                for p in 0..s.k {
                    let x = if s.a_t { a[p * s.m + i] } else { a[i * s.k + p] };
                    let y = if s.b_t { b[j * s.k + p] } else { b[p * s.n + j] };
                    acc += x as f64 * y as f64;
                }
                out[i * s.n + j] = acc as f32;
            }
        }
        out
    }

    #[test]
    fn all_transposes_match_the_triple_loop() {
        let (m, n, k) = (7, 5, 9);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
            let s = MatMul { m, n, k, a_t, b_t, accumulate: false };
            let mut out = vec![1f32; m * n];
            matmul(&mut out, &a, &b, s);
            let want = naive(&a, &b, s);
            for (x, y) in out.iter().zip(&want) {
                assert!((x - y).abs() < 1e-5, "{a_t} {b_t}: {x} vs {y}");
            }
            let mut acc = want.clone();
            matmul(&mut acc, &a, &b, s.accumulating());
            for (x, y) in acc.iter().zip(&want) {
                assert!((x - 2.0 * y).abs() < 1e-5);
            }
        }
    }
}
