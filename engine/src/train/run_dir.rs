//! The run directory: where a run keeps its files, who owns it, and whether a run there starts
//! fresh or continues a checkpoint.
//!
//! ```text
//! RUN_DIR/
//!   .lock               the lead process's OS lock, for the run's life (fsutil::DirLock)
//!   config.toml         the resolved configuration
//!   metrics.jsonl       one JSON record per step
//!   goodput.jsonl       the timeline of every attempt (train::goodput), appended only
//!   events.out.tfevents.*  TensorBoard
//!   trace-step-N.json   the profiled step (train.profile_step)
//!   checkpoints/        step-NNNNNN/ ... (crate::checkpoint)
//!   summary.json        written at the end: its presence marks the run complete
//! ```

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow, bail};

use crate::checkpoint::{self, Checkpoint};
use crate::config::Config;
use crate::fsutil::DirLock;

/// The metrics of every step, one JSON object per line.
pub const METRICS: &str = "metrics.jsonl";
/// The subdirectory holding the checkpoints.
pub const CHECKPOINTS: &str = "checkpoints";
/// The resolved configuration of the run.
pub const CONFIG: &str = "config.toml";
/// The run's summary, written when it completes.
pub const SUMMARY: &str = "summary.json";

/// What the user asked for: `--resume` absent, bare, `=auto` or with a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// Start a new run; the directory must hold none.
    No,
    /// Continue from the newest complete checkpoint; there must be one.
    Newest,
    /// Continue from the newest complete checkpoint if there is one, else start fresh (also over
    /// an earlier attempt that was stopped before its first checkpoint).
    Auto,
    /// Continue from this checkpoint.
    From(PathBuf),
}

impl Resume {
    /// `--resume`'s value: none, bare (`Some(None)`), `auto`, or a checkpoint path (write a
    /// checkpoint directory named `auto` as `./auto`).
    pub fn of(arg: Option<Option<&Path>>) -> Resume {
        match arg {
            None => Resume::No,
            Some(None) => Resume::Newest,
            Some(Some(p)) if p == Path::new("auto") => Resume::Auto,
            Some(Some(p)) => Resume::From(p.to_path_buf()),
        }
    }
}

/// How a run starts in its directory.
#[derive(Debug)]
pub enum Decision {
    /// From step 0. `restart`: over an earlier attempt that logged steps but saved no checkpoint
    /// (`--resume=auto`), whose records the run replaces.
    Fresh {
        /// Whether an earlier attempt's metrics are there to be replaced.
        restart: bool,
    },
    /// From a verified, compatible checkpoint.
    Resume(Box<Checkpoint>),
}

/// A run directory: its path and, on the lead process, its lock.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    lock: Option<DirLock>,
    /// `--reset-optimizer`: a resumed run may change `[optim]` ([`checkpoint::resume_point_with`]).
    reset_optimizer: bool,
}

impl RunDir {
    /// The run directory at `path`, not locked (it may not exist yet).
    pub fn at(path: impl Into<PathBuf>) -> RunDir {
        RunDir { path: path.into(), lock: None, reset_optimizer: false }
    }

    /// This run directory, resumed with `--reset-optimizer` if `reset`: the `[optim]` keys may
    /// then differ from the checkpoint's.
    pub fn resetting_optimizer(mut self, reset: bool) -> RunDir {
        self.reset_optimizer = reset;
        self
    }

    /// The default run directory of a recipe: `runs/RECIPE`.
    pub fn default_path(recipe: &str) -> PathBuf {
        Path::new("runs").join(recipe)
    }

    /// Claims the first of `base`, `base-2`, `base-3`, ... that holds no run and that no other
    /// process holds: creates it and takes its lock, so that runs started at the same time take
    /// one each.
    pub fn claim(base: &Path) -> Result<RunDir> {
        for i in 1.. {
            let path = if i == 1 { base.to_path_buf() } else { PathBuf::from(format!("{}-{i}", base.display())) };
            if path.join(METRICS).exists() {
                continue;
            }
            std::fs::create_dir_all(&path)
                .map_err(|e| anyhow!("cannot create run directory {}: {e}", path.display()))?;
            let Ok(lock) = DirLock::try_acquire(&path)? else { continue };
            // Checked again under the lock: a run may have started there and ended meanwhile.
            if path.join(METRICS).exists() {
                continue;
            }
            return Ok(RunDir { path, lock: Some(lock), reset_optimizer: false });
        }
        unreachable!("some name is free")
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `RUN_DIR/NAME`.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// `RUN_DIR/metrics.jsonl`.
    pub fn metrics(&self) -> PathBuf {
        self.join(METRICS)
    }

    /// `RUN_DIR/checkpoints`.
    pub fn checkpoints(&self) -> PathBuf {
        self.join(CHECKPOINTS)
    }

    /// `RUN_DIR/trace-step-N.json`, the profiled step's Chrome trace.
    pub fn trace(&self, step: usize) -> PathBuf {
        self.join(&format!("trace-step-{step}.json"))
    }

    /// Whether this process holds the directory's lock.
    pub fn is_locked(&self) -> bool {
        self.lock.is_some()
    }

    /// Whether a run has logged steps here.
    pub fn holds_run(&self) -> bool {
        self.metrics().exists()
    }

    /// Takes the directory's lock, which it keeps for its life, unless it holds it already (the
    /// directory must exist).
    pub fn lock(&mut self) -> Result<()> {
        if self.lock.is_none() {
            self.lock = Some(DirLock::acquire(
                &self.path,
                "run directory",
                "wait for it to finish, or choose another --run-dir",
            )?);
        }
        Ok(())
    }

    /// Creates the directory if needed and takes its lock.
    pub fn create(&mut self) -> Result<()> {
        std::fs::create_dir_all(&self.path)
            .map_err(|e| anyhow!("cannot create run directory {}: {e}", self.path.display()))?;
        self.lock()
    }

    /// The same directory without the lock (for the devices that do not lead).
    pub fn unlocked(&self) -> RunDir {
        RunDir::at(&self.path).resetting_optimizer(self.reset_optimizer)
    }

    /// Gives up the lock, handing it over (to the lead's [`RunDir`]).
    pub fn take_lock(&mut self) -> Option<DirLock> {
        self.lock.take()
    }

    /// With `lock` as its lock.
    pub fn with_lock(mut self, lock: Option<DirLock>) -> RunDir {
        if lock.is_some() {
            self.lock = lock;
        }
        self
    }

    /// Refuses a directory that already holds a run.
    pub fn ensure_fresh(&self) -> Result<()> {
        if self.holds_run() {
            bail!(
                "run directory {} already holds a run ({METRICS}); continue it with --resume (or --resume=auto), or choose another --run-dir",
                self.path.display()
            );
        }
        Ok(())
    }

    /// Whether a run here starts fresh or from which checkpoint, for a run of `config` on
    /// `devices` devices. Every process of a job decides alike: they read the same directory.
    ///
    /// `--resume=auto` continues from the newest complete checkpoint if there is one, else
    /// starts fresh: over nothing, or over an earlier attempt stopped before its first
    /// checkpoint (`metrics.jsonl` without `checkpoints/step-*`), whose steps the run computes
    /// again from step 0 — if that attempt trained the same configuration. A finished run
    /// without checkpoints (`summary.json`) has nothing to continue from and is refused.
    pub fn decide(&self, resume: &Resume, config: &Config, devices: usize) -> Result<Decision> {
        let checkpoints = self.checkpoints();
        let from = |explicit: Option<&Path>| -> Result<Decision> {
            let ck = checkpoint::resume_point_with(&checkpoints, explicit, config, devices, self.reset_optimizer)?;
            Ok(Decision::Resume(Box::new(ck)))
        };
        match resume {
            Resume::No => {
                self.ensure_fresh()?;
                Ok(Decision::Fresh { restart: false })
            }
            Resume::Newest => from(None),
            Resume::From(ck) => from(Some(ck)),
            Resume::Auto if !checkpoint::list(&checkpoints)?.is_empty() => from(None),
            Resume::Auto => {
                let d = self.path.display();
                if self.join(SUMMARY).exists() {
                    bail!(
                        "--resume=auto: run directory {d} holds a finished run without checkpoints ({SUMMARY}): there is nothing to continue from; choose another --run-dir"
                    );
                }
                if !self.holds_run() {
                    return Ok(Decision::Fresh { restart: false });
                }
                if let Some(earlier) = self.config()? {
                    let differ = checkpoint::incompatible_keys(&earlier, config);
                    if !differ.is_empty() {
                        bail!(
                            "--resume=auto: run directory {d} holds an earlier attempt of another configuration (it differs in {}); choose another --run-dir",
                            differ.join(", ")
                        );
                    }
                }
                Ok(Decision::Fresh { restart: true })
            }
        }
    }

    /// What `--resume=auto` found when it starts again from step 0 over an earlier attempt: its
    /// logged steps, and the checkpoints its log records as begun (the steps that record
    /// `checkpoint_s`: a save started after them, which a kill may have cut short), none of which
    /// is in `checkpoints/` any more (removed since, say), or that it began none.
    pub fn earlier_attempt(&self) -> String {
        let text = std::fs::read_to_string(self.metrics()).unwrap_or_default();
        let saved: Vec<u64> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|r| r.get("checkpoint_s").is_some())
            .filter_map(|r| r.get("step")?.as_u64())
            .collect();
        let (d, records) = (self.path.display(), text.lines().count());
        let checkpoints = self.checkpoints();
        let what = match saved.as_slice() {
            [] => "saved no checkpoint".to_owned(),
            [step] => format!(
                "began a checkpoint after step {step}, which is not in {} (removed, or cut short)",
                checkpoints.display()
            ),
            [.., last] => format!(
                "began {} checkpoints (the last after step {last}), none of which is in {} any more (removed, or cut short)",
                saved.len(),
                checkpoints.display()
            ),
        };
        format!("{d} holds an earlier attempt of {records} logged steps that {what}")
    }

    /// The configuration an earlier run here wrote, if it wrote one that reads.
    fn config(&self) -> Result<Option<Config>> {
        let Ok(text) = std::fs::read_to_string(self.join(CONFIG)) else { return Ok(None) };
        Ok(toml::from_str(&text).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_arguments_read_as_the_user_means_them() {
        assert_eq!(Resume::of(None), Resume::No);
        assert_eq!(Resume::of(Some(None)), Resume::Newest);
        assert_eq!(Resume::of(Some(Some(Path::new("auto")))), Resume::Auto);
        assert_eq!(Resume::of(Some(Some(Path::new("./auto")))), Resume::From("./auto".into()));
    }

    /// Runs started at once take `runs/RECIPE`, `-2` and `-3`, whichever comes first; a
    /// directory that holds a run is skipped, one that holds only an abandoned lock is taken.
    #[test]
    fn concurrent_claims_take_one_directory_each() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("runs/tiny");
        let barrier = std::sync::Barrier::new(3);
        let claimed: Vec<RunDir> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        RunDir::claim(&base).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut names: Vec<String> =
            claimed.iter().map(|r| r.path().file_name().unwrap().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(names, ["tiny", "tiny-2", "tiny-3"]);
        assert!(claimed.iter().all(RunDir::is_locked));
        // The first holds a run now; the second is released without one.
        let named = |n: &str| claimed.iter().find(|r| r.path().ends_with(n)).unwrap();
        std::fs::write(named("tiny").metrics(), "").unwrap();
        let second = named("tiny-2").path().to_path_buf();
        drop(claimed);
        assert_eq!(RunDir::claim(&base).unwrap().path(), second);
    }

    /// `--resume=auto` over an attempt whose checkpoints were deleted said it "saved no
    /// checkpoint"; it says what it found.
    #[test]
    fn an_earlier_attempt_is_described_as_found() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::at(tmp.path());
        let step = |n: u64, saved: bool| {
            let checkpoint = if saved { r#", "checkpoint_s": 0.1"# } else { "" };
            format!("{{\"step\": {n}, \"loss\": 5.0{checkpoint}}}\n")
        };
        let d = tmp.path().display();
        std::fs::write(run.metrics(), step(1, false) + &step(2, false)).unwrap();
        assert_eq!(
            run.earlier_attempt(),
            format!("{d} holds an earlier attempt of 2 logged steps that saved no checkpoint")
        );
        std::fs::write(run.metrics(), step(1, false) + &step(2, true) + &step(3, false)).unwrap();
        assert_eq!(
            run.earlier_attempt(),
            format!(
                "{d} holds an earlier attempt of 3 logged steps that began a checkpoint after step 2, which is not in {d}/checkpoints (removed, or cut short)"
            )
        );
        std::fs::write(run.metrics(), step(1, false) + &step(2, true) + &step(3, false) + &step(4, true)).unwrap();
        assert_eq!(
            run.earlier_attempt(),
            format!(
                "{d} holds an earlier attempt of 4 logged steps that began 2 checkpoints (the last after step 4), none of which is in {d}/checkpoints any more (removed, or cut short)"
            )
        );
    }
}
