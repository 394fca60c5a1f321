//! Saving in the background: the step loop hands over a host snapshot (copying the device
//! buffers is the only part on its critical path) and goes on training while a thread writes,
//! flushes, renames and prunes. One save at a time: a new one first waits for the previous.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Result, anyhow};

use super::{Extras, Snapshot, prune, write};
use crate::config::Config;
use crate::model::Layout;

/// A finished save.
#[derive(Debug, Clone)]
pub struct SaveReport {
    /// The step saved.
    pub step: u64,
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Time the background thread took (write, flush, hash, rename, prune).
    pub write_s: f64,
}

/// Writes checkpoints on a background thread.
pub struct Saver {
    parent: PathBuf,
    config: Arc<Config>,
    layout: Arc<Layout>,
    extras: Arc<Extras>,
    keep_last: usize,
    pause: Option<u64>,
    running: Option<JoinHandle<Result<(SaveReport, Snapshot)>>>,
    /// The buffers of the last finished save, reused by the next snapshot.
    spare: Option<Snapshot>,
}

/// A run that stops early (an error, a diverged loss) still finishes the save in progress, so
/// that its last checkpoint is not lost to a half-written temporary directory.
impl Drop for Saver {
    fn drop(&mut self) {
        if let Some(handle) = self.running.take() {
            match handle.join() {
                Ok(Ok((report, _))) => println!("saved checkpoint {}", report.dir.display()),
                Ok(Err(e)) => eprintln!("warning: the last checkpoint was not saved: {e:#}"),
                Err(_) => eprintln!("warning: the checkpoint thread panicked"),
            }
        }
    }
}

impl Saver {
    /// A saver writing under `parent` (`RUN_DIR/checkpoints`). Allocates and touches the host
    /// buffers of the snapshots now, so that the first save does not page in fresh memory on
    /// the step loop's critical path.
    pub fn new(parent: &Path, config: &Config, layout: &Layout, extras: Extras) -> Saver {
        let pause = std::env::var(super::PAUSE_HOOK).ok().and_then(|v| v.trim().parse().ok());
        let warm = || {
            let mut v = vec![0f32; layout.len];
            v.fill(1.0); // calloc'd pages are only mapped when written
            v
        };
        let spare = Snapshot { params: warm(), moments: Some((warm(), warm())), ..Snapshot::default() };
        Saver {
            parent: parent.to_path_buf(),
            config: Arc::new(config.clone()),
            layout: Arc::new(layout.clone()),
            extras: Arc::new(extras),
            keep_last: config.train.keep_last,
            pause,
            running: None,
            spare: Some(spare),
        }
    }

    /// Buffers to snapshot into (those of the last finished save, or empty ones).
    pub fn take_buffers(&mut self) -> Snapshot {
        self.spare.take().unwrap_or_default()
    }

    /// Waits for the save in progress, if any, and reports it.
    pub fn wait(&mut self) -> Result<Option<SaveReport>> {
        let Some(handle) = self.running.take() else { return Ok(None) };
        let (report, snapshot) = handle.join().map_err(|_| anyhow!("the checkpoint thread panicked"))??;
        self.spare = Some(snapshot);
        Ok(Some(report))
    }

    /// Reports the save in progress if it has finished, without waiting.
    pub fn poll(&mut self) -> Result<Option<SaveReport>> {
        match &self.running {
            Some(handle) if handle.is_finished() => self.wait(),
            _ => Ok(None),
        }
    }

    /// Starts saving `snapshot` in the background, after waiting for the previous save if it
    /// is still running (whose report is returned).
    pub fn submit(&mut self, snapshot: Snapshot) -> Result<Option<SaveReport>> {
        let previous = self.wait()?;
        let (parent, config, layout, extras) =
            (self.parent.clone(), self.config.clone(), self.layout.clone(), self.extras.clone());
        let (keep, pause) = (self.keep_last, self.pause);
        self.running = Some(std::thread::spawn(move || {
            let start = Instant::now();
            let dir = write(&parent, &config, &layout, &snapshot, &extras, pause)?;
            prune(&parent, keep)?;
            Ok((SaveReport { step: snapshot.step, dir, write_s: start.elapsed().as_secs_f64() }, snapshot))
        }));
        Ok(previous)
    }
}
