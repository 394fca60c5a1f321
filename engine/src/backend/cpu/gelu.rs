//! GELU, tanh approximation (GPT-2's `gelu_new`, Pax's `approximate=True`) or exact (erf).
//!
//! tanh:  h = ½u(1 + t),  t = tanh(c(u + a·u³)),  c = √(2/π), a = 0.044715
//!        dh/du = ½(1 + t) + ½u(1 - t²) · c(1 + 3a·u²)
//! erf:   h = u · Φ(u),  Φ(u) = ½(1 + erf(u/√2))
//!        dh/du = Φ(u) + u · φ(u),  φ(u) = exp(-u²/2) / √(2π)
//! Computed in f64, stored in f32.

use rayon::prelude::*;

const CHUNK: usize = 4096;
const C: f64 = 0.797_884_560_802_865_4; // √(2/π)
const A: f64 = 0.044_715;

/// `erf(x)` to about 1e-7 relative (Numerical Recipes' `erfc` Chebyshev fit), in f64: below an
/// f32's resolution, which is what the values are stored in.
pub fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98 + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 { 1.0 - erfc } else { erfc - 1.0 }
}

pub(super) fn value(u: f64, tanh: bool) -> f64 {
    if tanh {
        0.5 * u * (1.0 + (C * (u + A * u * u * u)).tanh())
    } else {
        0.5 * u * (1.0 + erf(u * std::f64::consts::FRAC_1_SQRT_2))
    }
}

pub(super) fn derivative(u: f64, tanh: bool) -> f64 {
    if tanh {
        let t = (C * (u + A * u * u * u)).tanh();
        0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * C * (1.0 + 3.0 * A * u * u)
    } else {
        let cdf = 0.5 * (1.0 + erf(u * std::f64::consts::FRAC_1_SQRT_2));
        let pdf = (-0.5 * u * u).exp() / (2.0 * std::f64::consts::PI).sqrt();
        cdf + u * pdf
    }
}

/// `h = gelu(u)` element-wise.
pub fn forward(h: &mut [f32], u: &[f32], tanh: bool) {
    assert_eq!(h.len(), u.len());
    h.par_chunks_mut(CHUNK).zip(u.par_chunks(CHUNK)).for_each(|(h, u)| {
        for (h, &u) in h.iter_mut().zip(u) {
            *h = value(u as f64, tanh) as f32;
        }
    });
}

/// `du = dh · gelu'(u)` element-wise (`=`).
pub fn backward(du: &mut [f32], dh: &[f32], u: &[f32], tanh: bool) {
    assert_eq!((du.len(), dh.len()), (u.len(), u.len()));
    du.par_chunks_mut(CHUNK).zip(dh.par_chunks(CHUNK)).zip(u.par_chunks(CHUNK)).for_each(|((du, dh), u)| {
        for ((du, &dh), &u) in du.iter_mut().zip(dh).zip(u) {
            *du = (dh as f64 * derivative(u as f64, tanh)) as f32;
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn erf_matches_known_values() {
        // erf(0.5), erf(1), erf(2), erf(-1.5) to 10 digits.
        for (x, e) in [(0.5, 0.520_499_877_8), (1.0, 0.842_700_792_9), (2.0, 0.995_322_265_0), (-1.5, -0.966_105_146_5)]
        {
            assert!((super::erf(x) - e).abs() < 2e-7, "erf({x}) = {}", super::erf(x));
        }
        assert!(super::erf(0.0).abs() < 1e-6);
    }
}
