//! GPT-OSS's experts as its checkpoints store them, and as the engine lays them out.
//!
//! transformers' `GptOssExperts` holds a layer's experts stacked and transposed relative to
//! `nn.Linear`, with gate and up interleaved by column:
//!
//! ```text
//! mlp.experts.gate_up_proj       [E, D, 2F]   column 2j: gate j, column 2j + 1: up j
//! mlp.experts.gate_up_proj_bias  [E, 2F]      interleaved the same way
//! mlp.experts.down_proj          [E, F, D]
//! mlp.experts.down_proj_bias     [E, D]
//! ```
//!
//! The engine lays each expert out as the other families do (`mlp.experts.E.gate_proj.weight`
//! `[F, D]`, `up_proj`, `down_proj` `[D, F]`, then the three biases: see
//! [`crate::model::MlpOffsets::Moe`]), so that expert axes, tensor axes and the grouped
//! products treat every family alike; import and export convert.
//!
//! The published checkpoints store the two weight matrices in MXFP4 (`gate_up_proj_blocks` /
//! `_scales`, `down_proj_blocks` / `_scales`), decoded here exactly as transformers' dequantizer
//! decodes them ([`mxfp4_decode`]).

use anyhow::{Result, bail};

/// Where expert `x`'s tensors lie in the engine's flat buffer, relative to the layer's first
/// expert block: gate `[F, D]`, up `[F, D]`, down `[D, F]`, gate's bias `[F]`, up's `[F]`,
/// down's `[D]`.
struct Block {
    f: usize,
    d: usize,
}

impl Block {
    fn gate(&self) -> usize {
        0
    }
    fn up(&self) -> usize {
        self.f * self.d
    }
    fn down(&self) -> usize {
        2 * self.f * self.d
    }
    fn gate_bias(&self) -> usize {
        3 * self.f * self.d
    }
    fn up_bias(&self) -> usize {
        3 * self.f * self.d + self.f
    }
    fn down_bias(&self) -> usize {
        3 * self.f * self.d + 2 * self.f
    }
}

/// One layer's stacked tensors, as the checkpoint holds them (the weights dequantized).
pub struct Stacked {
    /// `[E, D, 2F]`.
    pub gate_up: Vec<f32>,
    /// `[E, 2F]`.
    pub gate_up_bias: Vec<f32>,
    /// `[E, F, D]`.
    pub down: Vec<f32>,
    /// `[E, D]`.
    pub down_bias: Vec<f32>,
}

/// The stacked tensors' names under a layer's prefix (`model.layers.i.mlp.experts`) and shapes.
pub fn names(prefix: &str, e: usize, f: usize, d: usize) -> [(String, Vec<usize>); 4] {
    [
        (format!("{prefix}.gate_up_proj"), vec![e, d, 2 * f]),
        (format!("{prefix}.gate_up_proj_bias"), vec![e, 2 * f]),
        (format!("{prefix}.down_proj"), vec![e, f, d]),
        (format!("{prefix}.down_proj_bias"), vec![e, d]),
    ]
}

/// Writes the stacked tensors of `experts` experts into the engine's blocks
/// (`out[first + x · stride ..]` for expert x).
pub fn unstack(s: &Stacked, experts: usize, (f, d): (usize, usize), out: &mut [f32], first: usize, stride: usize) {
    let b = Block { f, d };
    for x in 0..experts {
        let block = &mut out[first + x * stride..first + (x + 1) * stride];
        let gu = &s.gate_up[x * d * 2 * f..(x + 1) * d * 2 * f];
        for j in 0..f {
            for k in 0..d {
                block[b.gate() + j * d + k] = gu[k * 2 * f + 2 * j];
                block[b.up() + j * d + k] = gu[k * 2 * f + 2 * j + 1];
            }
        }
        let down = &s.down[x * f * d..(x + 1) * f * d];
        for k in 0..d {
            for j in 0..f {
                block[b.down() + k * f + j] = down[j * d + k];
            }
        }
        let gub = &s.gate_up_bias[x * 2 * f..(x + 1) * 2 * f];
        for j in 0..f {
            block[b.gate_bias() + j] = gub[2 * j];
            block[b.up_bias() + j] = gub[2 * j + 1];
        }
        block[b.down_bias()..b.down_bias() + d].copy_from_slice(&s.down_bias[x * d..(x + 1) * d]);
    }
}

/// The inverse of [`unstack`]: a layer's stacked tensors from the engine's blocks.
pub fn stack(values: &[f32], experts: usize, (f, d): (usize, usize), first: usize, stride: usize) -> Stacked {
    let b = Block { f, d };
    let mut s = Stacked {
        gate_up: vec![0.0; experts * d * 2 * f],
        gate_up_bias: vec![0.0; experts * 2 * f],
        down: vec![0.0; experts * f * d],
        down_bias: vec![0.0; experts * d],
    };
    for x in 0..experts {
        let block = &values[first + x * stride..first + (x + 1) * stride];
        let gu = &mut s.gate_up[x * d * 2 * f..(x + 1) * d * 2 * f];
        for j in 0..f {
            for k in 0..d {
                gu[k * 2 * f + 2 * j] = block[b.gate() + j * d + k];
                gu[k * 2 * f + 2 * j + 1] = block[b.up() + j * d + k];
            }
        }
        let down = &mut s.down[x * f * d..(x + 1) * f * d];
        for k in 0..d {
            for j in 0..f {
                down[j * d + k] = block[b.down() + k * f + j];
            }
        }
        for j in 0..f {
            s.gate_up_bias[x * 2 * f + 2 * j] = block[b.gate_bias() + j];
            s.gate_up_bias[x * 2 * f + 2 * j + 1] = block[b.up_bias() + j];
        }
        s.down_bias[x * d..(x + 1) * d].copy_from_slice(&block[b.down_bias()..b.down_bias() + d]);
    }
    s
}

/// FP4 E2M1 values by their 4-bit code (bit 3 the sign).
const FP4: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Decodes an MXFP4 matrix stored as transformers' GPT-OSS checkpoints store it: `blocks`
/// `[E, rows, G, 16]` bytes (two FP4 codes each, the low nibble first: 32 values of the input
/// dimension per block) and `scales` `[E, rows, G]` (E8M0 exponents, bias 127), into
/// `[E, G·32, rows]`: transposed, as transformers' dequantizer returns it (`[E, in, out]`).
///
/// ```text
/// w[e, 32g + 2j,     r] = FP4[blocks[e, r, g, j] & 0xF] · 2^(scales[e, r, g] − 127)
/// w[e, 32g + 2j + 1, r] = FP4[blocks[e, r, g, j] >> 4]  · 2^(scales[e, r, g] − 127)
/// ```
///
/// A scale of 255 is not special-cased (transformers multiplies by 2^128 as well, which no
/// finite weight survives: the import's finiteness check then names the tensor).
pub fn mxfp4_decode(
    name: &str,
    blocks: &[u8],
    scales: &[u8],
    experts: usize,
    rows: usize,
    groups: usize,
) -> Result<Vec<f32>> {
    if blocks.len() != experts * rows * groups * 16 || scales.len() != experts * rows * groups {
        bail!(
            "{name}: {} bytes of blocks and {} scales, but [{experts}, {rows}, {groups}, 16] and [{experts}, {rows}, {groups}] are expected",
            blocks.len(),
            scales.len()
        );
    }
    let cols = groups * 32;
    let mut out = vec![0f32; experts * cols * rows];
    for e in 0..experts {
        for r in 0..rows {
            for g in 0..groups {
                let at = (e * rows + r) * groups + g;
                let scale = (2f64).powi(scales[at] as i32 - 127) as f32;
                for (j, &byte) in blocks[at * 16..at * 16 + 16].iter().enumerate() {
                    let c = 32 * g + 2 * j;
                    out[(e * cols + c) * rows + r] = FP4[(byte & 0xF) as usize] * scale;
                    out[(e * cols + c + 1) * rows + r] = FP4[(byte >> 4) as usize] * scale;
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacking_inverts_unstacking() {
        let (e, f, d) = (3, 2, 4);
        let stride = 3 * f * d + 2 * f + d + 5; // a wider stride than the block: gaps stay untouched
        let values: Vec<f32> = (0..e * stride + 7).map(|i| i as f32).collect();
        let s = stack(&values, e, (f, d), 7, stride);
        let mut back = vec![-1f32; values.len()];
        unstack(&s, e, (f, d), &mut back, 7, stride);
        for x in 0..e {
            let r = 7 + x * stride..7 + x * stride + 3 * f * d + 2 * f + d;
            assert_eq!(back[r.clone()], values[r]);
        }
        // Gate j is column 2j of [D, 2F]: expert 1's gate row 1, input 2.
        let b = Block { f, d };
        assert_eq!(s.gate_up[d * 2 * f + 2 * 2 * f + 2], values[7 + stride + b.gate() + d + 2]);
    }

    #[test]
    fn mxfp4_decodes_low_nibbles_first_and_scales_by_powers_of_two() {
        // One expert, one row, one group: bytes 0x21 (codes 1, 2: 0.5, 1.0), 0xF7 (6.0, -6.0).
        let mut blocks = vec![0u8; 16];
        blocks[0] = 0x21;
        blocks[1] = 0xF7;
        let out = mxfp4_decode("t", &blocks, &[128], 1, 1, 1).unwrap();
        assert_eq!(&out[..4], &[1.0, 2.0, 12.0, -12.0]);
        assert!(mxfp4_decode("t", &blocks, &[128, 1], 1, 1, 1).unwrap_err().to_string().contains("t: 16 bytes"));
    }
}
