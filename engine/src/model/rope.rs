//! RoPE frequencies, with Llama 3.1 scaling, computed as Hugging Face computes them (in f32), so
//! imported models see the same rotations.

use crate::config::ModelConfig;

/// Inverse frequencies `θ^(-2i / Dh)` for `i < Dh / 2`, scaled as Llama 3.1 does when
/// `rope_scaling` is set: long wavelengths are divided by `factor`, short ones kept, and the band
/// between interpolates smoothly.
pub fn inv_freq(m: &ModelConfig) -> Vec<f32> {
    let dim = m.head_dim;
    let base = m.rope_theta as f32;
    let freqs = (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32));
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

/// `(cos, sin)` of `t · inv_freq[i]` for positions `t < seq`, laid out `[seq, Dh / 2, 2]`.
pub fn table(m: &ModelConfig, seq: usize) -> Vec<f32> {
    table_at(m, &(0..seq).collect::<Vec<_>>())
}

/// [`table`] for the given positions, one row each (a sequence-parallel rank's chunks).
pub fn table_at(m: &ModelConfig, positions: &[usize]) -> Vec<f32> {
    let inv = inv_freq(m);
    let mut out = Vec::with_capacity(positions.len() * inv.len() * 2);
    for &t in positions {
        for &f in &inv {
            // The angle is rounded to f32 as in Hugging Face; its cos and sin are then exact.
            let angle = (t as f32 * f) as f64;
            out.push(angle.cos() as f32);
            out.push(angle.sin() as f32);
        }
    }
    out
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
}
