//! Stragglers named, as Megatron-LM's straggler detector does: a rank that is the slowest in
//! most of a window of steps, and slower than the median rank by more than a threshold, is
//! named in one warning line and in that step's record of `metrics.jsonl`.
//!
//! **What is compared.** In a synchronous job every rank's step takes about as long as the
//! slowest's (the others wait for it in the collectives), so wall times cannot tell which rank is
//! slow. Each rank's *busy* time is its step time less the time it waited in collectives
//! (counted by [`crate::parallel::flight::Flight`], [`crate::parallel::comm::Collectives::blocked`]);
//! the step boundary's exchange brings every rank's to the lead ([`super::session`]), which
//! keeps the last `train.diagnostics.straggler_window` steps.
//!
//! **The rule** (`train.diagnostics`): over a full window, the rank most often the slowest, if it
//! was the slowest in at least `straggler_fraction` of the steps and its median busy time exceeds
//! the median over the other ranks of theirs by more than `straggler_threshold` × that median. A
//! warning starts a new window, so a lasting straggler is named once a window.
//!
//! **Test hook.** `ENGINE_TEST_STEP_DELAY=RANK:SECONDS` ([`DELAY_HOOK`]) makes rank `RANK` sleep
//! that long in each step, outside the collectives: a straggler on purpose.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::config::DiagnosticsConfig;

/// The test hook's variable (see the [module documentation](self)).
pub const DELAY_HOOK: &str = "ENGINE_TEST_STEP_DELAY";

/// The test hook's delay for `rank`, if any (a malformed value is no delay: a test hook).
pub fn test_delay(rank: usize) -> Option<std::time::Duration> {
    let value = std::env::var(DELAY_HOOK).ok()?;
    let (r, seconds) = value.split_once(':')?;
    let seconds: f64 = seconds.parse().ok()?;
    (r.parse() == Ok(rank) && seconds > 0.0).then(|| std::time::Duration::from_secs_f64(seconds))
}

/// A rank named a straggler, as the step's record in `metrics.jsonl` holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Straggler {
    /// The rank.
    pub rank: usize,
    /// The steps of the window in which it was the slowest, and the window.
    pub slowest_steps: usize,
    /// Steps in the window.
    pub window: usize,
    /// Its median busy time per step over the window, seconds.
    pub busy_s: f64,
    /// The median over the other ranks of their median busy times, seconds.
    pub median_busy_s: f64,
    /// `busy_s / median_busy_s − 1`: 0.25 is 25 % slower than the median rank.
    pub excess: f64,
}

impl Straggler {
    /// The warning line.
    pub fn line(&self) -> String {
        format!(
            "warning: straggler: rank {} was the slowest in {} of the last {} steps, {:.3} s busy per step against the other ranks' median {:.3} s (+{:.1} %, +{:.3} s): look at its host",
            self.rank,
            self.slowest_steps,
            self.window,
            self.busy_s,
            self.median_busy_s,
            100.0 * self.excess,
            self.busy_s - self.median_busy_s
        )
    }
}

/// The detector: the lead's window of every rank's busy times.
pub struct Stragglers {
    window: usize,
    fraction: f64,
    threshold: f64,
    /// The last steps' busy times, by rank.
    steps: VecDeque<Vec<f64>>,
}

impl Stragglers {
    /// A detector with the keys of `config`; `None` when `straggler_window` is 0.
    pub fn new(config: &DiagnosticsConfig) -> Option<Stragglers> {
        (config.straggler_window > 0).then(|| Stragglers {
            window: config.straggler_window,
            fraction: config.straggler_fraction,
            threshold: config.straggler_threshold,
            steps: VecDeque::with_capacity(config.straggler_window),
        })
    }

    /// Adds a step's busy times (one per rank); the straggler, when the window names one.
    pub fn step(&mut self, busy: &[f64]) -> Option<Straggler> {
        if busy.len() < 2 {
            return None;
        }
        if self.steps.len() == self.window {
            self.steps.pop_front();
        }
        self.steps.push_back(busy.to_vec());
        if self.steps.len() < self.window {
            return None;
        }
        let ranks = busy.len();
        let mut slowest = vec![0usize; ranks];
        for step in &self.steps {
            // The lowest of equals.
            let r = (0..ranks).max_by(|&a, &b| step[a].total_cmp(&step[b]).then(b.cmp(&a))).expect("ranks");
            slowest[r] += 1;
        }
        let rank = (0..ranks).max_by_key(|&r| (slowest[r], std::cmp::Reverse(r))).expect("ranks");
        if (slowest[rank] as f64) < self.fraction * self.window as f64 {
            return None;
        }
        let medians: Vec<f64> = (0..ranks).map(|r| median(self.steps.iter().map(|s| s[r]).collect())).collect();
        let others: Vec<f64> = (0..ranks).filter(|&r| r != rank).map(|r| medians[r]).collect();
        let (busy_s, median_busy_s) = (medians[rank], median(others));
        let excess = if median_busy_s > 0.0 { busy_s / median_busy_s - 1.0 } else { 0.0 };
        if excess <= self.threshold {
            return None;
        }
        self.steps.clear();
        Some(Straggler { rank, slowest_steps: slowest[rank], window: self.window, busy_s, median_busy_s, excess })
    }
}

/// The median (the mean of the middle two for an even count).
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return 0.0;
    }
    if n % 2 == 1 { xs[n / 2] } else { (xs[n / 2 - 1] + xs[n / 2]) / 2.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detector(window: usize, fraction: f64, threshold: f64) -> Stragglers {
        let config = DiagnosticsConfig {
            straggler_window: window,
            straggler_fraction: fraction,
            straggler_threshold: threshold,
            ..Default::default()
        };
        Stragglers::new(&config).unwrap()
    }

    /// A rank slower in most steps by more than the threshold is named once its window is full,
    /// once a window; a rank slowest by chance, or slower by less, is not.
    #[test]
    fn a_rank_slowest_most_of_the_window_and_past_the_threshold_is_named() {
        let mut d = detector(4, 0.5, 0.1);
        let slow = [0.10, 0.13, 0.10, 0.10];
        assert_eq!(d.step(&slow), None);
        assert_eq!(d.step(&slow), None);
        assert_eq!(d.step(&[0.11, 0.10, 0.10, 0.10]), None);
        let found = d.step(&slow).expect("named at the window's end");
        assert_eq!((found.rank, found.slowest_steps, found.window), (1, 3, 4));
        assert!((found.excess - 0.3).abs() < 1e-9, "{found:?}");
        assert!(found.line().starts_with("warning: straggler: rank 1 was the slowest in 3 of the last 4 steps"));
        // A new window: not named again before it is full.
        for _ in 0..3 {
            assert_eq!(d.step(&slow), None);
        }
        assert!(d.step(&slow).is_some());
        // 5 % slower: under the threshold.
        let mut d = detector(4, 0.5, 0.1);
        assert!((0..10).all(|_| d.step(&[0.100, 0.105, 0.1, 0.1]).is_none()));
        // Slowest by turns: nobody in half the steps.
        let mut d = detector(4, 0.75, 0.1);
        let turns = [[0.2, 0.1, 0.1], [0.1, 0.2, 0.1], [0.1, 0.1, 0.2], [0.2, 0.1, 0.1]];
        assert!(turns.iter().all(|t| d.step(t).is_none()));
        // One device: nothing to compare.
        assert_eq!(detector(1, 0.5, 0.0).step(&[1.0]), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0, 10.0]), 2.5);
    }
}
