//! Logit soft-capping (Gemma's `final_logit_softcapping`), element-wise in f32 as transformers
//! computes it (`tanh(x / c) · c`).
//!
//! forward:  y = c · tanh(x / c)
//! backward: dx = dy · (1 − tanh²(x / c))     (dy/dx; `x` the values before capping)

use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// `x = cap · tanh(x / cap)`, in place.
pub fn forward(x: &mut [f32], cap: f32) {
    x.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap));
}

/// `dx = dx · (1 − tanh²(x / cap))`, in place, from the uncapped `x`.
pub fn backward(dx: &mut [f32], x: &[f32], cap: f32) {
    assert_eq!(dx.len(), x.len());
    dx.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(d, x)| {
        for (d, &x) in d.iter_mut().zip(x) {
            let t = (x / cap).tanh();
            *d *= 1.0 - t * t;
        }
    });
}
