//! The checkpoint manager of a run: when to save (`train.checkpoint_every`, and the last step),
//! what to keep (the newest `train.keep_last`, plus every `train.keep_every_n_steps`-th step
//! for good, as AXLearn's keep policy does), and saving in the background.
//!
//! Every run saves the sharded format ([`crate::checkpoint::sharded`]); one device is a mesh of
//! one. A save goes through three stages, only the first on the step loop's critical path:
//!
//! 1. at the step boundary, each device copies its state into host buffers (reused from save to
//!    save, so that no fresh memory is paged in);
//! 2. a thread of each device writes its part into the shared temporary directory;
//! 3. once every part is written, the lead (rank 0) hashes them (its own part's hashes were
//!    computed while writing), seals `state.json`, renames the directory into place and
//!    prunes, on a thread of its own.
//!
//! The devices learn that every part is written by adding one number over the mesh at each
//! step boundary while a save is in flight (every device makes the same calls, as collectives
//! require). A new save waits for the previous one. A crash at any point leaves either a
//! complete `step-*` directory or a `.tmp-*` one, which the next run removes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Result, anyhow, bail};

use super::Trainer;
use crate::backend::Backend;
use crate::checkpoint::sharded::{self, DeviceState};
use crate::checkpoint::{self, Extras, FileSum, PAUSE_HOOK, Progress};
use crate::config::Config;

/// A save that has completed: its checkpoint directory is in place.
#[derive(Debug, Clone)]
pub struct SaveReport {
    /// The step saved.
    pub step: u64,
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Time from the snapshot to the sealed directory, in the background.
    pub write_s: f64,
}

/// Saves a run's checkpoints in the background and prunes the old ones.
pub struct Checkpointer {
    parent: PathBuf,
    config: Arc<Config>,
    extras: Arc<Extras>,
    lead: bool,
    rank: usize,
    devices: usize,
    /// The crash test's hook ([`PAUSE_HOOK`]): the step whose save stops after its part.
    pause: Option<u64>,
    /// The save whose parts are being written.
    writing: Option<Writing>,
    /// The lead's sealing of a save whose parts are all written.
    sealing: Option<JoinHandle<Result<SaveReport>>>,
    /// Host buffers of the last finished part, reused by the next snapshot.
    spare: Option<DeviceState>,
    /// A test's injected failure: this device's part fails with this OS error (`ENOSPC`, ...).
    #[cfg(test)]
    pub(crate) fail_with: Option<i32>,
}

/// A save in flight: this device's writer thread and what sealing needs.
struct Writing {
    progress: Progress,
    tmp: PathBuf,
    dir: PathBuf,
    started: Instant,
    /// This device's writer, until joined.
    thread: Option<JoinHandle<Result<(DeviceState, Sums)>>>,
    /// This device's part once written: its files' sizes and hashes (sealing reuses them).
    sums: Option<Sums>,
}

/// Sizes and hashes of a part's files, by name.
type Sums = BTreeMap<String, FileSum>;

/// What one device says of its part when the devices compare notes: still writing, written, or
/// failed. The sum over the mesh is `devices` exactly when every part is written, and more
/// than that when any failed, whatever the others say.
const WRITING: f32 = 0.0;
const WRITTEN: f32 = 1.0;

impl Checkpointer {
    /// A manager saving under `parent` (`RUN_DIR/checkpoints`) for the device of `trainer`; `lead`
    /// marks the device that seals checkpoints and prunes. Allocates and touches the host
    /// buffers now, so that the first save does not page in fresh memory on the step loop's
    /// critical path.
    pub fn new<B: Backend>(parent: &Path, trainer: &mut Trainer<B>, extras: Extras, lead: bool) -> Checkpointer {
        let pause = std::env::var(PAUSE_HOOK).ok().and_then(|v| v.trim().parse().ok());
        // Data-parallel replicas save nothing: no host buffers for them.
        let t = &trainer.config.train;
        let saves = t.checkpoint_every > 0 || t.checkpoint_every_minutes > 0.0;
        let spare = (saves && trainer.parallel.saves()).then(|| {
            let mut state = DeviceState::default();
            let len = trainer.parallel.master_params().len;
            // calloc'd pages are only mapped when written: fill them now.
            state.bufs.iter_mut().for_each(|b| *b = vec![1.0; len]);
            state
        });
        Checkpointer {
            parent: parent.to_path_buf(),
            config: Arc::new(trainer.config.clone()),
            extras: Arc::new(extras),
            lead,
            rank: trainer.parallel.rank,
            devices: trainer.devices(),
            pause,
            writing: None,
            sealing: None,
            spare,
            #[cfg(test)]
            fail_with: None,
        }
    }

    /// Whether the step just completed (`step` of `last`) is one to save by its number: every
    /// `train.checkpoint_every` steps, and the last step of a run that saves at all (by steps or
    /// by `train.checkpoint_every_minutes`, which the session applies).
    pub fn due(&self, step: u64, last: u64) -> bool {
        let t = &self.config.train;
        let every = t.checkpoint_every as u64;
        (every > 0 && step.is_multiple_of(every)) || ((every > 0 || t.checkpoint_every_minutes > 0.0) && step == last)
    }

    /// At a step boundary: moves the save in flight on (every device calls this at every step)
    /// and starts a save of the trainer's current step if it is `due`. Returns the saves that
    /// completed meanwhile (on the lead) and, when a save started, the seconds the step loop
    /// spent on it (waiting for the previous save, copying the state to the host).
    pub fn after_step<B: Backend>(
        &mut self,
        trainer: &mut Trainer<B>,
        due: bool,
    ) -> Result<(Vec<SaveReport>, Option<f64>)> {
        let mut done = Vec::new();
        if !due {
            self.progress(trainer, false)?;
            done.extend(self.sealed(false)?);
            return Ok((done, None));
        }
        let start = Instant::now();
        done.extend(self.finish(trainer)?);
        self.start(trainer)?;
        Ok((done, Some(start.elapsed().as_secs_f64())))
    }

    /// Waits for the save in flight, on every device, and for its sealing; returns what
    /// completed. Every device calls it at the same point (the end of the run).
    ///
    /// Every device also waits for the lead's sealing: a process must not end (or say that it
    /// stopped with a checkpoint) while the checkpoint is not yet in place, and a scheduler that
    /// sees the other ranks end may stop the lead mid-seal.
    pub fn finish<B: Backend>(&mut self, trainer: &mut Trainer<B>) -> Result<Vec<SaveReport>> {
        self.progress(trainer, true)?;
        let sealed = self.sealed(true);
        let failed = trainer.parallel.sum_over_world(&mut trainer.backend, if sealed.is_err() { 1.0 } else { 0.0 });
        let report = sealed?;
        if failed > 0.0 {
            bail!("the lead (rank 0) could not seal the checkpoint: its error says why");
        }
        Ok(report.into_iter().collect())
    }

    /// Snapshots the trainer's state and starts writing this device's part.
    fn start<B: Backend>(&mut self, trainer: &mut Trainer<B>) -> Result<()> {
        let progress = trainer.progress();
        let name = checkpoint::dir_name(progress.step);
        let (tmp, dir) = (self.parent.join(format!(".tmp-{name}-sharded")), self.parent.join(&name));
        let state = trainer.device_state(self.spare.take().unwrap_or_default());
        let (rank, devices, pause, step) = (self.rank, self.devices, self.pause, progress.step);
        let part_dir = tmp.clone();
        #[cfg(test)]
        let fail_with = self.fail_with;
        let thread = std::thread::spawn(move || -> Result<(DeviceState, Sums)> {
            std::fs::create_dir_all(&part_dir).map_err(|e| anyhow!("cannot create {}: {e}", part_dir.display()))?;
            #[cfg(test)]
            if let Some(errno) = fail_with {
                let e = anyhow::Error::new(std::io::Error::from_raw_os_error(errno));
                return Err(e.context(format!("cannot write {}", part_dir.join(format!("shard-{rank}")).display())));
            }
            let sums =
                if state.is_empty() { Sums::new() } else { sharded::write_part(&part_dir, rank, devices, &state)? };
            if pause == Some(step) {
                crate::say!("{PAUSE_HOOK}: the save of step {step} stops after writing its part");
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                }
            }
            Ok((state, sums))
        });
        self.writing = Some(Writing { progress, tmp, dir, started: Instant::now(), thread: Some(thread), sums: None });
        Ok(())
    }

    /// Compares notes with the other devices on the save in flight (waiting for this device's
    /// part first when `wait`); once every part is written, the lead starts sealing.
    fn progress<B: Backend>(&mut self, trainer: &mut Trainer<B>, wait: bool) -> Result<()> {
        let Some(writing) = &mut self.writing else { return Ok(()) };
        let mut failure = None;
        if let Some(thread) = writing.thread.take_if(|t| wait || t.is_finished()) {
            match thread.join() {
                Ok(Ok((state, sums))) => {
                    writing.sums = Some(sums);
                    self.spare = Some(state);
                }
                Ok(Err(e)) => failure = Some(e),
                Err(_) => failure = Some(anyhow!("the checkpoint thread panicked")),
            }
        }
        let devices = self.devices as f32;
        let mine = match (&failure, &writing.sums) {
            (Some(_), _) => devices + 1.0,
            (None, Some(_)) => WRITTEN,
            (None, None) => WRITING,
        };
        let everyone = trainer.parallel.sum_over_world(&mut trainer.backend, mine);
        let dir = writing.dir.display().to_string();
        if everyone > devices {
            // Some device failed: every device learns which and why, so that each can say so
            // (one more exchange, on every device, only when a save failed).
            let mine = failure.as_ref().map_or(0, failure_code);
            let codes = trainer.parallel.gather_from_world(&mut trainer.backend, mine);
            if let Some(e) = failure {
                return Err(e.context(format!("cannot write checkpoint {dir}")));
            }
            let failed: Vec<String> = (codes.iter().enumerate())
                .filter(|(_, c)| **c != 0)
                .map(|(rank, &c)| format!("device {rank} of {} could not write its part: {}", self.devices, cause(c)))
                .collect();
            bail!("cannot write checkpoint {dir}: {}", failed.join("; "));
        }
        if everyone == devices {
            let writing = self.writing.take().expect("a save in flight");
            if self.lead {
                self.seal(writing)?;
            }
        }
        Ok(())
    }

    /// Starts sealing a save whose parts are all written (the lead), after the previous sealing.
    fn seal(&mut self, writing: Writing) -> Result<()> {
        let previous = self.sealed(true)?;
        debug_assert!(previous.is_none(), "a sealing left unreported");
        let (config, extras, parent, devices) =
            (self.config.clone(), self.extras.clone(), self.parent.clone(), self.devices);
        let keep = Keep::of(&config);
        self.sealing = Some(std::thread::spawn(move || {
            let known = writing.sums.unwrap_or_default();
            sharded::commit(&writing.tmp, &writing.dir, &config, writing.progress.clone(), devices, &extras, &known)
                .map_err(|e| e.context(format!("cannot write checkpoint {}", writing.dir.display())))?;
            checkpoint::prune(&parent, keep.last, keep.every)?;
            Ok(SaveReport {
                step: writing.progress.step,
                dir: writing.dir,
                write_s: writing.started.elapsed().as_secs_f64(),
            })
        }));
        Ok(())
    }

    /// The lead's sealing, once it has finished (or waiting for it when `wait`).
    fn sealed(&mut self, wait: bool) -> Result<Option<SaveReport>> {
        match self.sealing.take() {
            Some(handle) if wait || handle.is_finished() => {
                Ok(Some(handle.join().map_err(|_| anyhow!("the checkpoint thread panicked"))??))
            }
            other => {
                self.sealing = other;
                Ok(None)
            }
        }
    }
}

/// A run that stops early (an error, a diverged loss) on one device still completes the save in
/// progress, so that its last checkpoint is not lost to a temporary directory; on a mesh it
/// cannot know that the other parts were written, and the next run removes the temporary one.
impl Drop for Checkpointer {
    fn drop(&mut self) {
        if let Some(mut writing) = self.writing.take() {
            if let Some(Ok(Ok((_, sums)))) = writing.thread.take().map(JoinHandle::join) {
                writing.sums = Some(sums);
            }
            if writing.sums.is_some() && self.lead && self.devices == 1 {
                let _ = self.seal(writing);
            }
        }
        match self.sealed(true) {
            Ok(Some(report)) => crate::out!("saved checkpoint {}", report.dir.display()),
            Ok(None) => {}
            Err(e) => crate::say!("warning: the last checkpoint was not saved: {e:#}"),
        }
    }
}

/// What a device that could not write its part tells the others: its OS error number plus one
/// (`ENOSPC` is 28), or [`OTHER_FAILURE`] when the error is not the operating system's.
fn failure_code(e: &anyhow::Error) -> u64 {
    e.chain()
        .find_map(|c| c.downcast_ref::<std::io::Error>()?.raw_os_error())
        .map_or(OTHER_FAILURE, |errno| errno.clamp(0, 0xffff) as u64 + 1)
}

/// The failure code of an error that is not an OS error.
const OTHER_FAILURE: u64 = 1 << 20;

/// The cause a failure code stands for.
fn cause(code: u64) -> String {
    match code {
        OTHER_FAILURE => "an error that is not the file system's (its own message says which)".into(),
        c => std::io::Error::from_raw_os_error(c as i32 - 1).to_string(),
    }
}

/// Which complete checkpoints pruning keeps.
#[derive(Debug, Clone, Copy)]
struct Keep {
    /// The newest this many (0 keeps all).
    last: usize,
    /// And every step that is a multiple of this, for good (0: none).
    every: usize,
}

impl Keep {
    fn of(config: &Config) -> Keep {
        Keep { last: config.train.keep_last, every: config.train.keep_every_n_steps }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::devices;
    use crate::train::session::tests::config;

    /// FSDP × 4 where device 2's disk is full: every device fails the save, and the others say
    /// which device failed and why (its OS error), not only that one did.
    #[test]
    fn the_others_learn_which_device_could_not_write_its_part_and_why() {
        let tmp = tempfile::tempdir().unwrap();
        let c = config(&["mesh.ici_data=1", "mesh.ici_fsdp=4"]);
        let errors = devices::run(&c, 4, |rank, t| {
            let mut saver = Checkpointer::new(tmp.path(), t, Extras::default(), rank == 0);
            if rank == 2 {
                saver.fail_with = Some(libc::ENOSPC);
            }
            t.train_step(0.0);
            saver.after_step(t, true)?;
            Ok(format!("{:#}", saver.finish(t).unwrap_err()))
        })
        .unwrap();
        let enospc = std::io::Error::from_raw_os_error(libc::ENOSPC).to_string();
        for (rank, e) in errors.iter().enumerate() {
            assert!(e.starts_with("cannot write checkpoint") && e.contains(&enospc), "rank {rank}: {e}");
            if rank != 2 {
                assert!(e.contains("device 2 of 4 could not write its part: No space left on device"), "{e}");
            }
        }
        assert!(checkpoint::list(tmp.path()).unwrap().is_empty());
    }
}
