//! What step times come to: the median, the 90th percentile, and the rates at the median. One
//! computation for the run's summary (`summary.json`, its last line), `engine bench` and the
//! per-device figures of `engine bench --devices`.

/// Step times summarised. The rates are taken at the median, which one slow step (a checkpoint
/// write, another process on the machine) does not move.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    /// Median step time, seconds (the upper median of an even count).
    pub median_s: f64,
    /// 90th percentile of the step time, seconds (nearest rank).
    pub p90_s: f64,
    /// Tokens per second at the median.
    pub tokens_per_s: f64,
    /// TFLOP/s per device at the median.
    pub tflops_per_device: f64,
    /// Model FLOP utilisation at the median: the TFLOP/s over the device's peak; 0 when the
    /// peak is unknown.
    pub mfu: f64,
}

impl StepTimes {
    /// Summarises `times` (seconds, in any order, at least one) of steps that each train
    /// `tokens` tokens and do `flops` FLOPs on a device whose peak is `peak_tflops` (0 when
    /// unknown).
    pub fn of(times: &[f64], flops: f64, tokens: f64, peak_tflops: f64) -> StepTimes {
        assert!(!times.is_empty(), "no step times to summarise");
        let mut sorted = times.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median_s = sorted[n / 2];
        let p90_s = sorted[((n as f64 * 0.9).ceil() as usize).clamp(1, n) - 1];
        let tflops_per_device = flops / median_s / 1e12;
        StepTimes {
            median_s,
            p90_s,
            tokens_per_s: tokens / median_s,
            tflops_per_device,
            mfu: if peak_tflops > 0.0 { tflops_per_device / peak_tflops } else { 0.0 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::StepTimes;

    #[test]
    fn median_percentile_and_rates() {
        let s = StepTimes::of(&[0.5, 0.1, 0.4, 0.2, 0.3], 2e12, 1000.0, 100.0);
        assert_eq!((s.median_s, s.p90_s), (0.3, 0.5));
        assert!((s.tokens_per_s - 1000.0 / 0.3).abs() < 1e-9);
        assert!((s.tflops_per_device - 2.0 / 0.3).abs() < 1e-9);
        assert!((s.mfu - 2.0 / 0.3 / 100.0).abs() < 1e-12);
        // Ten times: the 90th percentile is the ninth, the median the upper of the middle two.
        let ten: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        let s = StepTimes::of(&ten, 0.0, 0.0, 0.0);
        assert_eq!((s.median_s, s.p90_s, s.mfu), (6.0, 9.0, 0.0));
        assert_eq!(StepTimes::of(&[2.0], 0.0, 0.0, 0.0).p90_s, 2.0);
    }
}
