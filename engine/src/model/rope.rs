//! RoPE frequencies, with Llama 3.1, YaRN or linear scaling, computed as Hugging Face computes
//! them (in f32), so imported models see the same rotations. A model with a local base (Gemma
//! 3's `rope_local_theta`) has a second, unscaled table for its sliding layers.

use crate::config::ModelConfig;
pub use crate::config::Yarn;

/// Inverse frequencies `θ^(-2i / Dh)` for `i < Dh / 2`, scaled as Llama 3.1 does when
/// `rope_scaling` is set: long wavelengths are divided by `factor`, short ones kept, and the band
/// between interpolates smoothly.
pub fn inv_freq(m: &ModelConfig) -> Vec<f32> {
    let dim = m.rope_dim();
    if let Some(y) = &m.yarn {
        return yarn_inv_freq(dim, m.rope_theta, y);
    }
    let freqs = plain_inv_freq(dim, m.rope_theta).into_iter();
    if m.rope_linear_factor != 1.0 {
        // transformers' `linear`: `inv_freq /= factor`, in f32.
        let factor = m.rope_linear_factor as f32;
        return freqs.map(|f| f / factor).collect();
    }
    let Some(s) = &m.rope_scaling else {
        return freqs.collect();
    };
    let (factor, low, high, old) =
        (s.factor as f32, s.low_freq_factor as f32, s.high_freq_factor as f32, s.original_max_seq_len as f32);
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    freqs
        .map(|f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

/// `base^(-2i / dim)` for `i < dim / 2`, in f32 (`1 / base ** (arange(0, dim, 2) / dim)`).
fn plain_inv_freq(dim: usize, base: f64) -> Vec<f32> {
    let base = base as f32;
    (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32)).collect()
}

/// `(cos, sin)` of `t · inv_freq[i]` for positions `t < seq`, laid out `[seq, Dh / 2, 2]`.
pub fn table(m: &ModelConfig, seq: usize) -> Vec<f32> {
    table_at(m, &(0..seq).collect::<Vec<_>>())
}

/// [`table`] for the given positions, one row each (a sequence-parallel rank's chunks).
pub fn table_at(m: &ModelConfig, positions: &[usize]) -> Vec<f32> {
    let factor = m.yarn.as_ref().map_or(1.0, |y| yarn_attention_factor(y) as f32);
    table_for(&inv_freq(m), factor, positions)
}

/// The sliding layers' table of a model with a local base (`rope_local_theta`), unscaled, for
/// the given positions; none without one.
pub fn local_table_at(m: &ModelConfig, positions: &[usize]) -> Option<Vec<f32>> {
    (m.rope_local_theta > 0.0).then(|| table_for(&plain_inv_freq(m.rope_dim(), m.rope_local_theta), 1.0, positions))
}

/// `(cos, sin)` of `t · inv_freq[i]` for the given positions, both multiplied by
/// `attention_factor` (YaRN's, [`yarn_attention_factor`]; 1 otherwise), laid out
/// `[positions, inv_freq.len(), 2]` as [`table`].
pub fn table_for(inv_freq: &[f32], attention_factor: f32, positions: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(positions.len() * inv_freq.len() * 2);
    for &t in positions {
        for &f in inv_freq {
            // The angle is rounded to f32 as in Hugging Face; its cos and sin are then exact,
            // rounded to f32 and multiplied by the factor in f32 (`emb.cos() * attention_scaling`).
            let angle = (t as f32 * f) as f64;
            out.push(angle.cos() as f32 * attention_factor);
            out.push(angle.sin() as f32 * attention_factor);
        }
    }
    out
}

/// YaRN's `mscale` (the paper's Eq. 21, Hugging Face's `yarn_get_mscale`):
/// `0.1 · mscale · ln(factor) + 1`, and 1 for a factor of at most 1.
pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 { 1.0 } else { 0.1 * mscale * factor.ln() + 1.0 }
}

/// The factor YaRN multiplies cos and sin by: the configured one, else
/// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are nonzero, else
/// `mscale(factor, 1)`.
pub fn yarn_attention_factor(y: &Yarn) -> f64 {
    y.attention_factor.unwrap_or_else(|| {
        if y.mscale != 0.0 && y.mscale_all_dim != 0.0 {
            yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
        } else {
            yarn_mscale(y.factor, 1.0)
        }
    })
}

/// The ends `(low, high)` of YaRN's ramp over the `dim / 2` frequencies, as Hugging Face's
/// `find_correction_range` (in f64, as Python's floats), with its guard against an empty ramp.
fn yarn_ramp_ends(dim: usize, base: f64, y: &Yarn) -> (f64, f64) {
    let corr_dim = |rotations: f64| {
        dim as f64 * (y.original_max_seq_len as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let (mut low, mut high) = (corr_dim(y.beta_fast), corr_dim(y.beta_slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        high += 0.001;
    }
    (low, high)
}

/// YaRN's inverse frequencies for `dim` rotary dimensions and base `base` (`rope_theta`),
/// computed in f32 where Hugging Face's `_compute_yarn_parameters` is: frequencies past the
/// ramp's high end (long wavelengths) are divided by the factor, those before its low end kept,
/// and the ramp between blends them linearly.
pub fn yarn_inv_freq(dim: usize, base: f64, y: &Yarn) -> Vec<f32> {
    let (low, high) = yarn_ramp_ends(dim, base, y);
    let (base32, factor) = (base as f32, y.factor as f32);
    // `(arange(dim // 2) - low) / (high - low)`: the tensor in f32, the Python numbers rounded to
    // f32 (the difference taken in f64 first).
    let (low32, span32) = (low as f32, (high - low) as f32);
    (0..dim / 2)
        .map(|i| {
            // `base ** (arange(0, dim, 2).float() / dim)`
            let pos = base32.powf((2 * i) as f32 / dim as f32);
            let (extrapolation, interpolation) = (1.0 / pos, 1.0 / (factor * pos));
            let ramp = ((i as f32 - low32) / span32).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeScaling;

    #[test]
    fn llama3_scaling_divides_low_frequencies_and_keeps_high_ones() {
        let m = ModelConfig { head_dim: 128, rope_theta: 500000.0, ..ModelConfig::default() };
        let plain = inv_freq(&m);
        let scaled = inv_freq(&ModelConfig { rope_scaling: Some(RopeScaling::default()), ..m });
        assert_eq!(plain[0], scaled[0]);
        assert_eq!(scaled[63], plain[63] / 8.0);
        assert!(scaled.iter().zip(&plain).all(|(s, p)| s <= p && *s >= p / 8.0));
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// DeepSeek-V3's `rope_scaling`: rotary width 64, θ 10000, factor 40 over 4096 positions.
    fn deepseek_v3() -> Yarn {
        Yarn { factor: 40.0, original_max_seq_len: 4096, mscale: 1.0, mscale_all_dim: 1.0, ..Yarn::default() }
    }

    #[test]
    fn yarn_mscale_is_one_below_a_factor_of_one() {
        assert_eq!(yarn_mscale(1.0, 1.0), 1.0);
        assert_eq!(yarn_mscale(0.5, 0.7), 1.0);
        assert!((yarn_mscale(40.0, 1.0) - (0.1 * 40f64.ln() + 1.0)).abs() < 1e-15);
        // Equal mscale and mscale_all_dim cancel (DeepSeek-V3: the softmax scale takes mscale²).
        assert_eq!(yarn_attention_factor(&deepseek_v3()), 1.0);
        // Without mscale_all_dim: mscale(factor) alone, whatever mscale is.
        let y = Yarn { factor: 8.0, mscale: 0.707, ..Yarn::default() };
        assert_eq!(yarn_attention_factor(&y), 0.1 * 8f64.ln() + 1.0);
        assert_eq!(yarn_attention_factor(&Yarn { attention_factor: Some(0.5), ..y }), 0.5);
    }

    #[test]
    fn yarn_ramp_of_deepseek_v3_runs_from_dimension_10_to_23() {
        assert_eq!(yarn_ramp_ends(64, 10000.0, &deepseek_v3()), (10.0, 23.0));
        // A ramp cut to one point gets Hugging Face's 0.001 of width.
        let y = Yarn { factor: 4.0, original_max_seq_len: 8, mscale_all_dim: 1.0, ..Yarn::default() };
        assert_eq!(yarn_ramp_ends(4, 10000.0, &y), (0.0, 1.0));
    }

    /// Against transformers 5.25's `_compute_yarn_parameters` (torch 2.15, CPU), run on
    /// `DeepseekV3Config(qk_rope_head_dim=dim, rope_parameters={"rope_type": "yarn", ...})`:
    /// the f32 bit patterns it returned, and its attention factor.
    #[test]
    fn yarn_inv_freq_is_hugging_faces_bit_for_bit() {
        // dim 4, θ 10000, factor 4 over 8 positions, mscale = mscale_all_dim = 1.
        let tiny = Yarn { factor: 4.0, original_max_seq_len: 8, mscale_all_dim: 1.0, ..Yarn::default() };
        assert_eq!(yarn_inv_freq(4, 10000.0, &tiny), [1.0, 0.0025]);
        assert_eq!(yarn_attention_factor(&tiny), 1.0);
        // DeepSeek-V3.
        let want: [u32; 32] = [
            0x3f800000, 0x3f3ff911, 0x3f0ff59a, 0x3ed7e89b, 0x3ea1e89b, 0x3e72d423, 0x3e361887, 0x3e088d77, 0x3dcccccd,
            0x3d99940d, 0x3d6655c2, 0x3d1fc5ba, 0x3cdc321b, 0x3c968dc3, 0x3c4bf283, 0x3c088d77, 0x3bb43959, 0x3b697066,
            0x3b136a16, 0x3ab3a2cd, 0x3a4f3e37, 0x39d99312, 0x393a7753, 0x380bd471, 0x37d1b717, 0x379d43a3, 0x376bdcf0,
            0x3730df51, 0x3704a2b3, 0x36c6ecdd, 0x36952c42, 0x365fba4f,
        ];
        assert_eq!(bits(&yarn_inv_freq(64, 10000.0, &deepseek_v3())), want);
        // Untruncated ramp ends, other betas, θ 50000; mscale without mscale_all_dim (ignored).
        let y = Yarn {
            factor: 8.0,
            original_max_seq_len: 2048,
            beta_fast: 16.0,
            beta_slow: 2.0,
            mscale: 0.707,
            truncate: false,
            ..Yarn::default()
        };
        let want: [u32; 16] = [
            0x3f800000, 0x3f022edb, 0x3e84673d, 0x3e06a951, 0x3d88f541, 0x3ceb9002, 0x3c1ef4ab, 0x3b1f55b1, 0x3a128aff,
            0x39950acf, 0x39179588, 0x389a2b5b, 0x381ccc77, 0x379f790d, 0x37223151, 0x36a4f575,
        ];
        assert_eq!(bits(&yarn_inv_freq(32, 50000.0, &y)), want);
        assert_eq!(yarn_attention_factor(&y), 1.2079441541679836);
        // mscale 1 over mscale_all_dim 0.8.
        let y = Yarn { factor: 16.0, original_max_seq_len: 1024, mscale_all_dim: 0.8, ..Yarn::default() };
        let want: [u32; 8] =
            [0x3f800000, 0x3ea1e89b, 0x3d9ccccd, 0x3c899f51, 0x3b428f5c, 0x394f3e38, 0x3883126f, 0x37a5cb60];
        assert_eq!(bits(&yarn_inv_freq(16, 10000.0, &y)), want);
        assert_eq!(yarn_attention_factor(&y), 1.0453850485445595);
    }

    #[test]
    fn table_for_scales_cos_and_sin_and_table_at_is_it_at_factor_one() {
        let m = ModelConfig { head_dim: 8, rope_theta: 10000.0, ..ModelConfig::default() };
        let positions = [0, 5, 3];
        let plain = table_at(&m, &positions);
        assert_eq!(bits(&table_for(&inv_freq(&m), 1.0, &positions)), bits(&plain));
        let scaled = table_for(&inv_freq(&m), 1.25, &positions);
        assert_eq!(bits(&scaled), bits(&plain.iter().map(|x| x * 1.25).collect::<Vec<_>>()));
        assert_eq!(&plain[..2], [1.0, 0.0]);
    }
}
