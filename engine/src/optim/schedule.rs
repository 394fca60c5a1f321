//! Learning-rate schedules.
//!
//! Linear warmup over `warmup_steps` (step s gets `lr · (s + 1) / warmup_steps`), then:
//! - `cosine`: `min + (lr - min) · (1 + cos(π · p)) / 2` with `p` going from 0 at the end of
//!   warmup to 1 at `decay_steps` (default: the run's length), and `min = lr · min_lr_ratio`
//!   after it;
//! - `constant`: `lr`.

use crate::config::{OptimConfig, Schedule};

/// Learning rate of optimizer step `step` (0-based) in a run of `total_steps`.
pub fn learning_rate(o: &OptimConfig, total_steps: usize, step: usize) -> f64 {
    if step < o.warmup_steps {
        return o.lr * (step + 1) as f64 / o.warmup_steps as f64;
    }
    match o.schedule {
        Schedule::Constant => o.lr,
        Schedule::Cosine => {
            let end = if o.decay_steps == 0 { total_steps } else { o.decay_steps };
            let span = end.saturating_sub(o.warmup_steps).max(1);
            let progress = ((step - o.warmup_steps) as f64 / span as f64).min(1.0);
            let min = o.lr * o.min_lr_ratio;
            min + (o.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let o = OptimConfig { lr: 1.0, warmup_steps: 4, min_lr_ratio: 0.1, ..OptimConfig::default() };
        let lr = |s| learning_rate(&o, 14, s);
        assert_eq!([lr(0), lr(1), lr(3)], [0.25, 0.5, 1.0]);
        assert_eq!(lr(4), 1.0);
        assert!((lr(9) - 0.55).abs() < 1e-12, "half way: {}", lr(9));
        assert!((lr(14) - 0.1).abs() < 1e-12 && (lr(100) - 0.1).abs() < 1e-12);
        let c = OptimConfig { schedule: Schedule::Constant, ..o };
        assert_eq!(learning_rate(&c, 14, 10), 1.0);
    }
}
