//! This process's part in a job: the communicator that joins its processes (the plan over the
//! job's devices is [`super::plan::ParallelPlan::resolve`]). The `engine train` command calls
//! these; the trainer receives the result.

use std::time::Duration;

use anyhow::{Context, Result};

use super::engine_version;
use super::nccl::{self, Nccl};
use super::rendezvous::{self, Job};
use super::tcp::Tcp;
use crate::config::Config;
use crate::config::flat::flatten;

/// Keys that may differ from rank to rank: they change nothing the ranks compute together.
/// `description` and `extends` say where a recipe came from, not what it trains (its resolved
/// keys are compared); `train.memory_check` is each rank's check of its own device's memory.
/// docs/launch.md lists them.
pub const PER_RANK_KEYS: [&str; 3] = ["description", "extends", "train.memory_check"];

/// What every rank of a job must have alike, as `key = value` lines that the rendezvous compares
/// ([`rendezvous::meet`]): the engine's version (`engine`) and, for a training job, its resolved
/// configuration but for [`PER_RANK_KEYS`]. Ranks that differ in a recipe key would train one job
/// with two recipes: silently another curve (`optim.lr`, `train.seed`), a collective's sizes that
/// differ (the model's shape), or a rank that finishes early and leaves the others waiting
/// (`train.steps`).
pub fn terms(config: Option<&Config>) -> String {
    let mut text = format!("engine = {}\n", engine_version());
    for (key, value) in config.map(flatten).unwrap_or_default() {
        if !PER_RANK_KEYS.contains(&key.as_str()) {
            // One line a key, whatever its value holds.
            text += &format!("{key} = {}\n", value.replace('\n', "\\n"));
        }
    }
    text
}

/// How long a rendezvous waits for every rank: `asked` (a command-line flag), else the
/// `ENGINE_RENDEZVOUS_TIMEOUT` variable, else 300 seconds.
pub fn rendezvous_timeout(asked: Option<f64>) -> Result<Duration> {
    seconds(asked, "ENGINE_RENDEZVOUS_TIMEOUT", 300.0)
}

/// How long a collective waits for its peers: the `ENGINE_COLLECTIVE_TIMEOUT` variable, else
/// 600 seconds, PyTorch's default for NCCL, long enough for a slow checkpoint or evaluation on
/// one rank.
pub fn collective_timeout() -> Result<Duration> {
    seconds(None, "ENGINE_COLLECTIVE_TIMEOUT", 600.0)
}

/// `asked`, else the variable `var`, else `default`: a positive number of seconds.
fn seconds(asked: Option<f64>, var: &str, default: f64) -> Result<Duration> {
    let seconds = match (asked, std::env::var(var)) {
        (Some(s), _) => s,
        (None, Ok(v)) => v.trim().parse().with_context(|| format!("{var} = `{v}` is not a number"))?,
        (None, Err(_)) => default,
    };
    anyhow::ensure!(seconds > 0.0 && seconds.is_finite(), "{var}: the timeout must be a positive number of seconds");
    Ok(Duration::from_secs_f64(seconds))
}

/// The job's TCP collectives, for a multi-process job on CPUs training `config`: every rank
/// connects to every other after the rendezvous; collectives wait `ENGINE_COLLECTIVE_TIMEOUT`
/// seconds at most.
pub fn tcp_communicator(job: &Job, config: &Config) -> Result<Tcp> {
    Tcp::connect(job, rendezvous_timeout(None)?, collective_timeout()?, &terms(Some(config)))
}

/// The job's NCCL communicator for training `config`: rank 0 makes the unique id, the
/// rendezvous hands it to every rank, and each joins with its global rank.
pub fn nccl_communicator(job: &Job, config: &Config) -> Result<Nccl> {
    let id = if job.rank == 0 { nccl::unique_id()? } else { Vec::new() };
    let id = rendezvous::rendezvous(job, rendezvous_timeout(None)?, &terms(Some(config)), move || id)?;
    Nccl::init(&id, job.rank, job.world, collective_timeout()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_hold_the_version_and_every_key_but_the_per_rank_ones() {
        let mut config = Config::default();
        config.optim.lr = 0.001;
        let text = terms(Some(&config));
        assert!(text.starts_with(&format!("engine = {}\n", engine_version())), "{text}");
        assert!(text.contains("\noptim.lr = 0.001\n") && text.contains("\ntrain.steps = "), "{text}");
        config.description = "another".into();
        config.train.memory_check = !config.train.memory_check;
        assert_eq!(terms(Some(&config)), text, "keys that may differ per rank are left out");
        config.train.seed += 1;
        assert_ne!(terms(Some(&config)), text);
        assert_eq!(terms(None), format!("engine = {}\n", engine_version()));
        config.data.path = "two\nlines = 1".into();
        let lines = terms(Some(&config));
        assert!(lines.lines().all(|l| l.contains(" = ")) && !lines.contains("\nlines = 1"), "{lines}");
    }

    /// docs/launch.md lists the keys that may differ from rank to rank.
    #[test]
    fn the_per_rank_keys_are_documented() {
        let docs = include_str!("../../../docs/launch.md");
        let section = docs.split("### Every rank trains the same recipe").nth(1).expect("the section");
        let section = section.split("\n## ").next().unwrap();
        for key in PER_RANK_KEYS {
            assert!(section.contains(&format!("`{key}`")), "docs/launch.md does not list `{key}`");
        }
    }
}
