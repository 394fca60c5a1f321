//! The local tier's save in the background ([`super::local_tier`]), on the model of the
//! persistent tier's ([`super::checkpointer`]). A save goes through three stages, only the
//! first and the exchange on the step loop:
//!
//! 1. at a due step boundary, the rank copies its part of the training state into host buffers
//!    (reused from save to save), after waiting for the previous save if it is still in flight;
//! 2. a writer thread writes and seals the part in the rank's own directory, prunes it, and
//!    packs the part's files for the peer;
//! 3. at the first later boundary where every rank's part is sealed, every rank sends its packed
//!    part to its peer and receives its source's over the collectives (which only the step
//!    loop's thread may call), and a thread writes the received copy and prunes the copies.
//!
//! The ranks learn that every part is sealed by adding one number over the mesh at each step
//! boundary while a save is in flight (every rank makes the same calls at the same boundaries,
//! as collectives require); a failed thread, on any rank, fails every rank there. A crash at any
//! point leaves complete `step-*` directories and `.tmp-*` ones, which the next run removes.
//!
//! **Test hook.** `ENGINE_TEST_LOCAL_SAVE_DELAY=SECONDS` ([`DELAY_HOOK`]) makes every rank's
//! writer thread sleep that long before writing: a slow save on purpose, which the step loop
//! must not wait for.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};

use super::Trainer;
use super::local_tier::{LocalTier, Words};
use crate::backend::Backend;
use crate::checkpoint::sharded::DeviceState;

/// The test hook's variable (see the [module documentation](self)).
pub const DELAY_HOOK: &str = "ENGINE_TEST_LOCAL_SAVE_DELAY";

/// What the step loop spent on the local tier at one boundary, and what completed there.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LocalStep {
    /// Seconds on the step loop (the snapshot, waiting for the previous save, agreeing whether
    /// the parts are sealed, exchanging the copies); none where no save was due or in flight.
    pub stall_s: Option<f64>,
    /// Seconds this rank's writer thread took to write, seal and pack its part, in the
    /// background; given at the boundary where every rank's part was found sealed.
    pub write_s: Option<f64>,
}

/// Saves a rank's part to the local tier in the background.
pub struct LocalSaver {
    tier: LocalTier,
    /// The save whose own part is being written.
    writing: Option<Writing>,
    /// The copy received at the last exchange, being written: until every rank's is written,
    /// so that every rank's state stays the same (the thread itself is joined before).
    receiving: Option<Option<JoinHandle<Result<()>>>>,
    /// Host buffers of the last part written, reused by the next snapshot.
    spare: Option<DeviceState>,
    /// The test hook's delay ([`DELAY_HOOK`]).
    delay: Option<Duration>,
}

/// A save in flight: its step, and this rank's writer until it is joined.
struct Writing {
    step: u64,
    thread: Option<JoinHandle<Result<Written>>>,
    written: Option<Written>,
}

/// What a writer thread hands back: the host buffers, the packed part (none on one device),
/// and its time.
struct Written {
    state: DeviceState,
    packed: Option<Words>,
    write_s: f64,
}

/// What one rank says of the save in flight when the ranks compare notes: its part still being
/// written, or sealed (and its last received copy written). A failure says `ranks + 1`, so that
/// the sum over the mesh is `ranks` exactly when all are sealed, more when any failed.
const WRITING: f32 = 0.0;
const SEALED: f32 = 1.0;

impl LocalSaver {
    /// The saver of `tier`.
    pub fn new(tier: LocalTier) -> LocalSaver {
        let delay = std::env::var(DELAY_HOOK).ok().and_then(|v| v.trim().parse::<f64>().ok()).filter(|s| *s > 0.0);
        LocalSaver { tier, writing: None, receiving: None, spare: None, delay: delay.map(Duration::from_secs_f64) }
    }

    /// At the boundary after `step`: moves the save in flight on and starts a save of the
    /// trainer's current step if the tier saves this one. Every rank calls it at every boundary.
    pub fn after_step<B: Backend>(&mut self, trainer: &mut Trainer<B>, step: u64) -> Result<LocalStep> {
        let due = self.tier.due(step);
        if !due && !self.in_flight() {
            return Ok(LocalStep::default());
        }
        let start = Instant::now();
        // A due save waits for the previous one; the copy that completes it is written while
        // the new part is.
        let write_s = if self.in_flight() { self.progress(trainer, due)? } else { None };
        if due {
            self.start(trainer);
        }
        Ok(LocalStep { stall_s: Some(start.elapsed().as_secs_f64()), write_s })
    }

    /// Completes the save in flight, on every rank: its part sealed, the copies exchanged and
    /// written. Every rank calls it at the same point (the end of the run, a stop); returns the
    /// writer's seconds if a save completed.
    pub fn finish<B: Backend>(&mut self, trainer: &mut Trainer<B>) -> Result<Option<f64>> {
        let mut write_s = None;
        while self.in_flight() {
            write_s = self.progress(trainer, true)?.or(write_s);
        }
        Ok(write_s)
    }

    /// Whether a save is in flight; the same on every rank, which only the ranks' agreement in
    /// [`LocalSaver::progress`] changes.
    fn in_flight(&self) -> bool {
        self.writing.is_some() || self.receiving.is_some()
    }

    /// Snapshots the trainer's part and starts its writer thread.
    fn start<B: Backend>(&mut self, trainer: &mut Trainer<B>) {
        let progress = trainer.progress();
        let state = trainer.part_state(self.spare.take().unwrap_or_default());
        let (tier, delay, step) = (self.tier.clone(), self.delay, progress.step);
        let thread = std::thread::spawn(move || -> Result<Written> {
            let started = Instant::now();
            if let Some(delay) = delay {
                std::thread::sleep(delay);
            }
            let packed = tier.write_part(progress, &state)?;
            Ok(Written { state, packed, write_s: started.elapsed().as_secs_f64() })
        });
        self.writing = Some(Writing { step, thread: Some(thread), written: None });
    }

    /// Compares notes with the other ranks on the save in flight (waiting for this rank's
    /// threads first when `wait`); once every part is sealed, exchanges the copies and starts
    /// writing the one received. Returns the writer's seconds when the parts were found sealed.
    fn progress<B: Backend>(&mut self, trainer: &mut Trainer<B>, wait: bool) -> Result<Option<f64>> {
        let mut failure = None;
        if let Some(thread) = self.receiving.as_mut().and_then(|r| r.take_if(|t| wait || t.is_finished())) {
            failure = joined(thread).err();
        }
        if let Some(writing) = &mut self.writing
            && let Some(thread) = writing.thread.take_if(|t| wait || t.is_finished())
        {
            match joined(thread) {
                Ok(written) => writing.written = Some(written),
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        let ranks = trainer.devices() as f32;
        let mine = match (&failure, &self.writing, &self.receiving) {
            (Some(_), _, _) => ranks + 1.0,
            (None, Some(Writing { written: None, .. }), _) | (None, _, Some(Some(_))) => WRITING,
            _ => SEALED,
        };
        let everyone = trainer.parallel.sum_over_world(&mut trainer.backend, mine);
        let step = self.writing.as_ref().map(|w| w.step);
        let what =
            step.map_or("the last copy of the local tier".to_owned(), |s| format!("local checkpoint of step {s}"));
        if everyone > ranks {
            // Some rank failed: each learns which (one more exchange, on every rank, only then).
            let failed = trainer.parallel.gather_from_world(&mut trainer.backend, failure.is_some() as u64);
            if let Some(e) = failure {
                return Err(e.context(format!("cannot write the {what}")));
            }
            let ranks: Vec<usize> = (0..failed.len()).filter(|&r| failed[r] != 0).collect();
            bail!("cannot write the {what}: ranks {ranks:?} could not write theirs (their errors say why)");
        }
        if everyone < ranks {
            return Ok(None);
        }
        self.receiving = None;
        let Some(writing) = self.writing.take() else { return Ok(None) };
        let written = writing.written.expect("a sealed part");
        self.spare = Some(written.state);
        if let Some(packed) = written.packed {
            let got = self.tier.swap_parts(trainer, &packed)?;
            let tier = self.tier.clone();
            self.receiving = Some(Some(std::thread::spawn(move || tier.keep_copy(writing.step, got))));
        }
        Ok(Some(written.write_s))
    }
}

/// A thread's result, its panic as an error.
fn joined<T>(thread: JoinHandle<Result<T>>) -> Result<T> {
    thread.join().map_err(|_| anyhow!("the local checkpoint's thread panicked"))?
}

/// A run that ends early (an error, a diverged loss) lets its threads finish what they write,
/// so that the process does not exit in the middle of a file; what they leave is either sealed
/// or a `.tmp-*` directory the next run removes, and a rank's own part sealed without its
/// peer's copy is restored only if every rank can restore that step.
impl Drop for LocalSaver {
    fn drop(&mut self) {
        let threads = self.writing.take().and_then(|w| w.thread.map(|t| joined(t).map(drop)));
        for result in threads.into_iter().chain(self.receiving.take().flatten().map(joined)) {
            if let Err(e) = result {
                crate::say!("warning: the local checkpoint in flight was not saved: {e:#}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::devices;
    use crate::train::session::tests::config;

    /// Rank 1 cannot write its part (its directory of the tier is a file): the save fails on
    /// both ranks at the boundary that waits for it, rank 1 with its error, rank 0 naming rank 1.
    #[test]
    fn a_rank_that_cannot_write_its_part_fails_every_rank_and_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let local = tmp.path().join("tier");
        let dir = format!("train.local_checkpoint_dir={}", local.display());
        let c = config(&["mesh.ici_data=1", "mesh.ici_fsdp=2", "train.local_checkpoint_every=1", &dir]);
        let run = tmp.path().join("run");
        let errors = devices::run(&c, 2, |rank, t| {
            let tier = LocalTier::open(t, &run, 2)?.expect("the tier is on");
            if rank == 1 {
                let own = local.join("rank-00001");
                std::fs::remove_dir_all(&own)?;
                std::fs::write(&own, b"not a directory")?;
            }
            let mut saver = LocalSaver::new(tier);
            t.train_step(0.0);
            let started = saver.after_step(t, 1)?;
            assert!(started.stall_s.is_some() && started.write_s.is_none());
            Ok(format!("{:#}", saver.finish(t).unwrap_err()))
        })
        .unwrap();
        assert!(errors[1].starts_with("cannot write the local checkpoint of step 1"), "{}", errors[1]);
        assert!(errors[1].contains("rank-00001"), "{}", errors[1]);
        assert_eq!(
            errors[0],
            "cannot write the local checkpoint of step 1: ranks [1] could not write theirs (their errors say why)"
        );
    }
}
