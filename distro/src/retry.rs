//! The one retry policy for network operations: a few attempts with exponential backoff (capped,
//! and overridden by a server's `Retry-After`), each retry logged as a warning through
//! `tracing`, then one clear error naming what failed and how often it was tried.
//!
//! Two presets: the sources' fetches (`git fetch`, `cargo`) read `DISTRO_NET_ATTEMPTS`
//! (default 3) and `DISTRO_NET_BACKOFF_MS` (first delay, default 1000) ([`Policy::from_env`]);
//! the registry client, whose requests are many and small, retries more often and sooner
//! ([`Policy::default`]). Tests set a tiny backoff.

use crate::git::{describe, output, stderr_summary};
use anyhow::{Result, anyhow};
use std::process::Command;
use std::time::Duration;

/// The outcome of one failed attempt.
#[derive(Debug)]
pub enum Failure {
    /// Worth retrying (connection refused, timeout, a server error).
    Transient(String),
    /// Retrying cannot help (the ref or repository does not exist); fail at once.
    Permanent(String),
}

/// How many attempts and how long to wait between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Total number of attempts, at least 1.
    pub attempts: u32,
    /// Delay before the second attempt; doubled for each later one.
    pub first_backoff: Duration,
    /// Longest wait between attempts (also caps a server's `Retry-After`).
    pub max_delay: Duration,
}

impl Default for Policy {
    /// The registry client's: 5 attempts, 250 ms doubling up to 8 s.
    fn default() -> Self {
        Policy { attempts: 5, first_backoff: Duration::from_millis(250), max_delay: Duration::from_secs(8) }
    }
}

impl Policy {
    /// The policy from `DISTRO_NET_ATTEMPTS` and `DISTRO_NET_BACKOFF_MS`.
    pub fn from_env() -> Policy {
        let num = |key: &str, default: u64| {
            std::env::var(key).ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(default)
        };
        Policy {
            attempts: num("DISTRO_NET_ATTEMPTS", 3).clamp(1, 20) as u32,
            first_backoff: Duration::from_millis(num("DISTRO_NET_BACKOFF_MS", 1000)),
            max_delay: Duration::MAX,
        }
    }

    /// The wait after failed attempt number `attempt` (1-based): the first backoff doubled
    /// `attempt - 1` times, or `hint` (a server's `Retry-After`) when given; at most `max_delay`.
    pub fn delay(&self, attempt: u32, hint: Option<Duration>) -> Duration {
        let exp = self.first_backoff.saturating_mul(2u32.saturating_pow(attempt.saturating_sub(1)));
        hint.unwrap_or(exp).min(self.max_delay)
    }
}

/// Runs `op` until it succeeds, fails permanently, or the attempts of `policy` are used up.
/// `what` names the operation in progress messages and in the final error.
pub fn retry<T>(policy: Policy, what: &str, mut op: impl FnMut() -> std::result::Result<T, Failure>) -> Result<T> {
    for attempt in 1..=policy.attempts {
        match op() {
            Ok(v) => return Ok(v),
            Err(Failure::Permanent(msg)) => return Err(anyhow!("{what} failed: {msg}")),
            Err(Failure::Transient(msg)) if attempt == policy.attempts => {
                return Err(anyhow!(
                    "{what} failed after {attempt} attempt{}: {msg}; check the network and the URL, then run the command again",
                    if attempt == 1 { "" } else { "s" }
                ));
            }
            Err(Failure::Transient(msg)) => {
                let delay = policy.delay(attempt, None);
                tracing::warn!(
                    "{what} failed (attempt {attempt} of {}), retrying in {:.1}s: {msg}",
                    policy.attempts,
                    delay.as_secs_f64()
                );
                std::thread::sleep(delay);
            }
        }
    }
    unreachable!("the loop returns on its last attempt")
}

/// Runs `cmd` once, as one attempt of a [`retry`]: a failure whose stderr `is_permanent`
/// recognises (no such ref, no such repository) is permanent, any other is transient, and a
/// command that cannot be started is permanent.
pub fn command_attempt(cmd: &mut Command, is_permanent: impl Fn(&str) -> bool) -> std::result::Result<(), Failure> {
    let out = output(cmd).map_err(|e| Failure::Permanent(format!("{e:#}")))?;
    if out.status.success() {
        return Ok(());
    }
    let msg = format!("{}: {}", describe(cmd), stderr_summary(&out));
    if is_permanent(&String::from_utf8_lossy(&out.stderr)) {
        Err(Failure::Permanent(msg))
    } else {
        Err(Failure::Transient(msg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast(attempts: u32) -> Policy {
        Policy { attempts, first_backoff: Duration::from_millis(1), max_delay: Duration::MAX }
    }

    #[test]
    fn delay_doubles_caps_and_honours_retry_after() {
        let p = Policy::default();
        assert_eq!(p.delay(1, None), Duration::from_millis(250));
        assert_eq!(p.delay(2, None), Duration::from_millis(500));
        assert_eq!(p.delay(10, None), Duration::from_secs(8));
        assert_eq!(p.delay(1, Some(Duration::from_secs(3))), Duration::from_secs(3));
        assert_eq!(p.delay(1, Some(Duration::from_secs(30))), Duration::from_secs(8));
        let uncapped = Policy { max_delay: Duration::MAX, ..p };
        assert_eq!(uncapped.delay(40, None), Duration::from_millis(250).saturating_mul(u32::MAX));
    }

    #[test]
    fn transient_failures_are_retried_then_reported_once() {
        let mut calls = 0;
        let err = retry(fast(3), "fetching main", || -> std::result::Result<(), _> {
            calls += 1;
            Err(Failure::Transient(format!("refused {calls}")))
        })
        .unwrap_err();
        assert_eq!(calls, 3);
        let msg = err.to_string();
        assert!(msg.starts_with("fetching main failed after 3 attempts: refused 3"), "{msg}");
    }

    #[test]
    fn permanent_failures_are_not_retried() {
        let mut calls = 0;
        let err = retry(fast(5), "fetching x", || -> std::result::Result<(), _> {
            calls += 1;
            Err(Failure::Permanent("no such ref".into()))
        })
        .unwrap_err();
        assert_eq!(calls, 1);
        assert_eq!(err.to_string(), "fetching x failed: no such ref");
    }

    #[test]
    fn success_after_a_failure() {
        let mut calls = 0;
        let v = retry(fast(3), "x", || {
            calls += 1;
            if calls < 2 { Err(Failure::Transient("t".into())) } else { Ok(7) }
        })
        .unwrap();
        assert_eq!((v, calls), (7, 2));
    }
}
