//! FP8 operands of matrix products: the two OCP formats, their rounding, and the scaling state
//! an operand keeps on the device. Shared by the backends: the CPU reference computes with these
//! functions, and a GPU's kernels must agree with them (the parity checks compare the two).
//!
//! An FP8 product `out = a · b` multiplies operands stored scaled into the format's range:
//! `a_q = fp8(a · s_a)`, `b_q = fp8(b · s_b)`, and undoes the scales in the epilogue,
//! `out = (a_q · b_q) · (1 / s_a) · (1 / s_b)`, accumulating in f32 (as cuBLASLt's FP8 matmul
//! does with its scale pointers). Rounding is to nearest, ties to even, saturating to the
//! largest finite value (CUDA's `__NV_SATFINITE`), with subnormals.
//!
//! The scale of an operand comes from its absolute maximum (amax):
//! - tensorwise (dynamic) scaling: `s = max / amax` of the tensor being cast;
//! - delayed scaling (Transformer Engine's): `s = max / max(history) / 2^margin`, where the
//!   history holds the amaxes of the last steps; each cast records its tensor's amax, and
//!   [`delayed_update`] rolls it into the history once a step, so a step casts with scales its
//!   predecessors chose.

use crate::backend::View;

/// An FP8 format (OCP 8-bit floating point).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, no infinities: ±448 at most, 2⁻⁹ the smallest
    /// subnormal. Activations and weights.
    E4M3,
    /// 5 exponent bits, 2 mantissa bits: ±57344 at most, 2⁻¹⁶ the smallest subnormal.
    /// Gradients, which need the range more than the precision.
    E5M2,
}

impl Fp8Format {
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// `x` rounded to this format (nearest, ties to even; beyond the largest finite value,
    /// that value with `x`'s sign; NaN stays NaN), as an f32.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Fp8Format::E4M3 => float8::F8E4M3::from_f32(x).to_f32(),
            Fp8Format::E5M2 => float8::F8E5M2::from_f32(x).to_f32(),
        }
    }

    /// The value of an FP8 byte of this format (NaN for its NaN codes).
    pub fn decode(self, byte: u8) -> f32 {
        match self {
            Fp8Format::E4M3 => float8::F8E4M3::from_bits(byte).to_f32(),
            Fp8Format::E5M2 => float8::F8E5M2::from_bits(byte).to_f32(),
        }
    }

    /// Its name, as cuBLASLt's and PyTorch's dtypes say it.
    pub fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }
}

/// Where in an operand's state ([`State`]) each value is.
pub mod slot {
    /// The factor the operand is multiplied by before rounding.
    pub const SCALE: usize = 0;
    /// `1 / SCALE`: what the product's epilogue multiplies by (cuBLASLt's scale pointer).
    pub const INV_SCALE: usize = 1;
    /// The largest |x| cast since the history last rolled (delayed scaling).
    pub const AMAX: usize = 2;
    /// The format's largest finite value, so that an update needs no format of its own.
    pub const MAX: usize = 3;
    /// The amax history begins here, newest first (delayed scaling).
    pub const HISTORY: usize = 4;
}

/// An operand's scaling state in a [`crate::backend::BufKind::Scalars`] buffer: `[scale,
/// 1/scale, amax, max, history...]` (see [`slot`]), `HISTORY + history` f32 values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct State {
    /// The state's values.
    pub view: View,
    /// The format the operand is cast to.
    pub format: Fp8Format,
}

impl State {
    /// Elements of one operand's state with `history` steps of amaxes.
    pub fn len(history: usize) -> usize {
        slot::HISTORY + history
    }

    /// The state a run starts from: scale 1, nothing recorded.
    pub fn initial(format: Fp8Format, history: usize) -> Vec<f32> {
        let mut s = vec![0.0; State::len(history)];
        s[slot::SCALE] = 1.0;
        s[slot::INV_SCALE] = 1.0;
        s[slot::MAX] = format.max();
        s
    }

    /// The view of `1 / scale`, which a product reads.
    pub fn inv_scale(&self) -> View {
        self.view.at(slot::INV_SCALE, 1)
    }
}

/// How a cast chooses its scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scaling {
    /// Tensorwise: the state's scale is set from this tensor's own amax first.
    Current,
    /// Delayed: the state's scale as the last update left it; this tensor's amax is recorded.
    Delayed,
    /// The state's scale as it is, and no amax taken: the same tensor cast again (in another
    /// layout), whose scale the first cast set or whose amax it recorded.
    Again,
}

/// A weight `W [rows, cols]` whose FP8 casts an optimizer step writes
/// ([`crate::backend::Backend::adamw_fp8`]) for the passes to read instead of casting it: `q`
/// (`[rows, cols]`) and `qt` (`[cols, rows]`), with the delayed recipe's scale of `state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightCast {
    /// Where the weight starts in the parameters.
    pub offset: usize,
    /// Its rows (the layer's output width) and columns (its input width).
    pub rows: usize,
    /// See `rows`.
    pub cols: usize,
    /// The cast `[rows, cols]`, [`crate::backend::BufKind::Fp8`].
    pub q: View,
    /// The cast transposed, `[cols, rows]`.
    pub qt: View,
    /// The weight's scaling state: the scale the casts take, the amax they record.
    pub state: State,
}

impl WeightCast {
    /// The weight in `params`.
    pub fn weight(&self, params: View) -> View {
        params.at(self.offset, self.rows * self.cols)
    }

    /// Casts the weight as it is in `params` into both layouts, as the passes would (the state's
    /// scale, the amax recorded): the reference's way, and the refresh of a weight changed
    /// outside the fused update.
    pub fn cast<B: crate::backend::Backend + ?Sized>(&self, be: &mut B, params: View) {
        be.fp8_quantize_both(self.q, self.qt, self.weight(params), self.state, Scaling::Delayed, self.cols);
    }
}

/// The larger of `m` and |v|, NaN sticking (a diverged tensor is not scaled as a finite one).
fn nan_max(m: f32, v: f32) -> f32 {
    if v.is_nan() || m.is_nan() { f32::NAN } else { m.max(v.abs()) }
}

/// The largest |x| (NaN if any element is NaN).
pub fn amax(x: &[f32]) -> f32 {
    use rayon::prelude::*;
    // The maximum does not depend on the order: any split gives the same value.
    x.par_chunks(1 << 14).map(|c| c.iter().fold(0f32, |m, &v| nan_max(m, v))).reduce(|| 0.0, nan_max)
}

/// Records `x`'s amax in `state` as a delayed cast does (the larger, NaN sticking).
pub fn record_amax(state: &mut [f32], x: &[f32]) {
    state[slot::AMAX] = nan_max(state[slot::AMAX], amax(x));
}

/// The scale that maps `amax` onto the format's largest value `max`, divided by `2^margin`;
/// `None` when the amax gives none (zero, infinite or NaN): the scale then stays as it was.
pub fn scale_for(amax: f32, max: f32, margin: u32) -> Option<f32> {
    let scale = max / amax / (2f32).powi(margin as i32);
    (amax > 0.0 && amax.is_finite() && scale.is_finite() && scale > 0.0).then_some(scale)
}

/// Casts `x` to `format` with its state, the scale chosen as `scaling` says. Writes
/// `fp8(x · scale)` to `q`, or with `transpose = Some(cols)` its transpose: `x` is then
/// `[len / cols, cols]` and `q` `[cols, len / cols]` (cuBLASLt's FP8 products take one layout,
/// so the backward pass's operands are cast transposed).
pub fn quantize(
    q: &mut [f32],
    x: &[f32],
    state: &mut [f32],
    format: Fp8Format,
    scaling: Scaling,
    transpose: Option<usize>,
) {
    use rayon::prelude::*;
    assert_eq!(q.len(), x.len(), "fp8 cast: output and input lengths differ");
    match scaling {
        Scaling::Current => {
            let scale = scale_for(amax(x), format.max(), 0).unwrap_or(1.0);
            state[slot::SCALE] = scale;
            state[slot::INV_SCALE] = 1.0 / scale;
        }
        Scaling::Delayed => record_amax(state, x),
        Scaling::Again => {}
    }
    let scale = state[slot::SCALE];
    match transpose {
        None => q.par_chunks_mut(1 << 14).zip(x.par_chunks(1 << 14)).for_each(|(q, x)| {
            for (o, &v) in q.iter_mut().zip(x) {
                *o = format.round(v * scale);
            }
        }),
        Some(cols) => {
            let rows = x.len() / cols;
            assert_eq!(rows * cols, x.len(), "fp8 cast: {} elements are not rows of {cols}", x.len());
            q.par_chunks_mut(rows.max(1)).enumerate().for_each(|(c, q)| {
                for (r, o) in q.iter_mut().enumerate() {
                    *o = format.round(x[r * cols + c] * scale);
                }
            });
        }
    }
}

/// The delayed recipe's step: each operand's recorded amax enters its history (newest first,
/// the oldest leaves), and its scale becomes `max / max(history) / 2^margin` (unchanged when the
/// history gives none); a state without history takes `max / amax / 2^margin` from the amax
/// recorded (FSDP's tensorwise weights, whose pieces' amaxes the group maxed). `states` holds
/// operands of `stride` elements each.
pub fn delayed_update(states: &mut [f32], stride: usize, margin: u32) {
    for s in states.chunks_exact_mut(stride) {
        let amax = s[slot::AMAX];
        let history = &mut s[slot::HISTORY..];
        if !history.is_empty() {
            history.copy_within(..history.len() - 1, 1);
            history[0] = amax;
        }
        s[slot::AMAX] = 0.0;
        // A state without history takes its scale from the amax recorded (tensorwise weights
        // whose amax FSDP's pieces recorded: the whole weight's, once the group maxed it).
        let largest = |m: f32, &v: &f32| if v.is_nan() { m } else { m.max(v) };
        let newest =
            if s.len() == slot::HISTORY { largest(0.0, &amax) } else { s[slot::HISTORY..].iter().fold(0f32, largest) };
        if let Some(scale) = scale_for(newest, s[slot::MAX], margin) {
            s[slot::SCALE] = scale;
            s[slot::INV_SCALE] = 1.0 / scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_rounds_to_nearest_even_saturates_and_keeps_subnormals() {
        let f = Fp8Format::E4M3;
        // Representable values come back unchanged: 1, 1.125 (one mantissa step), the largest.
        for v in [0.0, 1.0, 1.125, -1.125, 448.0, -448.0, 240.0] {
            assert_eq!(f.round(v), v, "{v}");
        }
        // Halfway between 1 and 1.125 ties to the even mantissa (1); between 1.125 and 1.25 to 1.25.
        assert_eq!(f.round(1.0625), 1.0);
        assert_eq!(f.round(1.1875), 1.25);
        assert_eq!(f.round(1.07), 1.125);
        // Past the largest finite value: saturated, with the sign (E4M3 has no infinity).
        assert_eq!(f.round(1e6), 448.0);
        assert_eq!(f.round(f32::INFINITY), 448.0);
        assert_eq!(f.round(-500.0), -448.0);
        // Subnormals: the smallest is 2^-9; below half of it, zero.
        let tiny = (2f32).powi(-9);
        assert_eq!(f.round(tiny), tiny);
        assert_eq!(f.round(3.0 * tiny), 3.0 * tiny);
        assert_eq!(f.round(tiny * 0.49), 0.0);
        assert!(f.round(f32::NAN).is_nan());
    }

    #[test]
    fn e5m2_trades_precision_for_range() {
        let f = Fp8Format::E5M2;
        assert_eq!(f.round(57344.0), 57344.0);
        assert_eq!(f.round(1e9), 57344.0);
        // Two mantissa bits: 1.25 is representable, 1.125 ties to even (1.0), 1.2 rounds to 1.25.
        assert_eq!(f.round(1.25), 1.25);
        assert_eq!(f.round(1.125), 1.0);
        assert_eq!(f.round(1.2), 1.25);
        let tiny = (2f32).powi(-16);
        assert_eq!(f.round(tiny), tiny);
        assert_eq!(f.round(tiny * 0.4), 0.0);
    }

    #[test]
    fn tensorwise_maps_the_amax_onto_the_largest_value() {
        let x = [0.5, -2.0, 1.0, 0.0];
        let (mut q, mut s) = ([0f32; 4], State::initial(Fp8Format::E4M3, 0));
        quantize(&mut q, &x, &mut s, Fp8Format::E4M3, Scaling::Current, None);
        assert_eq!(s[slot::SCALE], 224.0);
        assert_eq!(s[slot::INV_SCALE], 1.0 / 224.0);
        assert_eq!(q, [112.0, -448.0, 224.0, 0.0]);
        // All zeros keep a scale of one (nothing to map), and cast to zeros.
        quantize(&mut q, &[0.0; 4], &mut s, Fp8Format::E4M3, Scaling::Current, None);
        assert_eq!((s[slot::SCALE], q), (1.0, [0.0; 4]));
    }

    #[test]
    fn a_transposed_cast_writes_the_transpose() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // [2, 3]
        let (mut q, mut s) = ([0f32; 6], State::initial(Fp8Format::E4M3, 0));
        quantize(&mut q, &x, &mut s, Fp8Format::E4M3, Scaling::Delayed, Some(3));
        assert_eq!(q, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    }

    #[test]
    fn delayed_scaling_uses_the_history_of_earlier_steps() {
        let f = Fp8Format::E5M2;
        let mut s = State::initial(f, 3);
        let mut q = [0f32; 2];
        // Step 1 casts with the initial scale (1) and records its amax (4).
        quantize(&mut q, &[4.0, -1.0], &mut s, f, Scaling::Delayed, None);
        assert_eq!((q, s[slot::AMAX]), ([4.0, -1.0], 4.0));
        quantize(&mut q, &[-3.0, 2.0], &mut s, f, Scaling::Delayed, None);
        assert_eq!(s[slot::AMAX], 4.0, "the step's amax is the largest of its casts");
        delayed_update(&mut s, State::len(3), 1);
        assert_eq!(&s[slot::HISTORY..], &[4.0, 0.0, 0.0]);
        assert_eq!(s[slot::SCALE], 57344.0 / 4.0 / 2.0, "max / amax / 2^margin");
        assert_eq!(s[slot::AMAX], 0.0);
        // Steps with smaller amaxes keep the largest of the history until it leaves it.
        for (step, amax) in [1.0f32, 2.0, 2.0].into_iter().enumerate() {
            quantize(&mut q, &[amax, 0.0], &mut s, f, Scaling::Delayed, None);
            delayed_update(&mut s, State::len(3), 0);
            let expected = if step < 2 { 4.0 } else { 2.0 };
            assert_eq!(s[slot::SCALE], 57344.0 / expected, "step {step}");
        }
        // A step with no amax (zeros) leaves the scale as it was once the history is all zeros.
        let mut z = State::initial(f, 1);
        z[slot::SCALE] = 8.0;
        delayed_update(&mut z, State::len(1), 0);
        assert_eq!(z[slot::SCALE], 8.0);
    }

    #[test]
    fn a_nan_amax_never_becomes_a_scale() {
        assert!(amax(&[1.0, f32::NAN, 2.0]).is_nan());
        assert_eq!(scale_for(f32::NAN, 448.0, 0), None);
        assert_eq!(scale_for(f32::INFINITY, 448.0, 0), None);
        assert_eq!(scale_for(0.0, 448.0, 0), None);
        let mut s = State::initial(Fp8Format::E4M3, 2);
        let mut q = [0f32; 1];
        quantize(&mut q, &[f32::NAN], &mut s, Fp8Format::E4M3, Scaling::Delayed, None);
        delayed_update(&mut s, State::len(2), 0);
        assert_eq!(s[slot::SCALE], 1.0);
    }
}
