//! File-system helpers for files that must never be seen half-written.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, flushed to
/// disk, then renamed over `path`. Readers see the old file or the new one, never a part.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().context("no file name")?.to_string_lossy();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.with_context(|| format!("cannot write {}", path.display()))
}

/// Flushes a directory's entries (a rename is durable only once its directory is).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Removes the entries of `dir` whose names start with `prefix` and end in `.tmp-<pid>`
/// (temporary files and directories of [`write_atomic`] and of exports) of a process that no
/// longer runs: what a killed process left. A temporary of a process still running is left alone.
pub fn remove_stale_temporaries(dir: &Path, prefix: &str) -> Result<()> {
    let Ok(entries) = fs::read_dir(dir) else { return Ok(()) };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(prefix) {
            continue;
        }
        let Some(pid) = name.rsplit_once(".tmp-").and_then(|(_, p)| p.parse::<i32>().ok()) else { continue };
        // SAFETY: signal 0 only asks whether the process exists.
        let alive = pid == std::process::id() as i32 || unsafe { libc::kill(pid, 0) } == 0;
        if !alive {
            let path = entry.path();
            let removed = if path.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
            removed.with_context(|| format!("cannot remove {}, left by a killed process", path.display()))?;
        }
    }
    Ok(())
}

/// An exclusive hold on a directory for this process's life: an OS lock on `DIR/.lock`, so a
/// process that dies, however it dies, releases it. The file names the holder's PID for the
/// message a second process gets.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

impl DirLock {
    /// Takes the lock of `dir` (which must exist) without waiting. `what` names the directory
    /// in the error (`run directory`), `advice` says what to do instead.
    pub fn acquire(dir: &Path, what: &str, advice: &str) -> Result<DirLock> {
        match DirLock::try_acquire(dir)? {
            Ok(lock) => Ok(lock),
            Err(holder) => {
                let holder = match holder {
                    Some(pid) => format!("process {pid}"),
                    None => "another process".to_owned(),
                };
                anyhow::bail!("{what} {} is in use by {holder}; {advice}", dir.display())
            }
        }
    }

    /// Takes the lock of `dir` (which must exist) without waiting: the lock, or, when another
    /// process holds it, that process's PID as it wrote it (none if it has not yet). An error
    /// is a failure to open or lock the file, not a lock held elsewhere.
    pub fn try_acquire(dir: &Path) -> Result<std::result::Result<DirLock, Option<String>>> {
        let path = dir.join(".lock");
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                let holder = fs::read_to_string(&path).unwrap_or_default();
                let holder = Some(holder.trim().to_owned()).filter(|h| !h.is_empty());
                return Ok(Err(holder));
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()));
            }
        }
        file.set_len(0)?;
        file.write_all(std::process::id().to_string().as_bytes())?;
        file.sync_all()?;
        Ok(Ok(DirLock { _file: file }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_files_and_leaves_no_temporaries() {
        let dir = std::env::temp_dir().join(format!("engine-fsutil-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.json");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        assert!(write_atomic(&dir.join("missing/x"), b"").is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn temporaries_of_dead_processes_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        // PID 2^22 + 1 is above Linux's pid_max limit: no such process can exist.
        let dead = dir.path().join(".metrics.jsonl.tmp-4194305");
        let live = dir.path().join(format!(".config.toml.tmp-{}", std::process::id()));
        let dead_dir = dir.path().join(".out.tmp-4194305");
        for f in [&dead, &live] {
            fs::write(f, b"x").unwrap();
        }
        fs::create_dir(&dead_dir).unwrap();
        fs::write(dir.path().join("keep.tmp-4194305"), b"x").unwrap();
        remove_stale_temporaries(dir.path(), ".").unwrap();
        assert!(!dead.exists() && !dead_dir.exists() && live.exists());
        assert!(dir.path().join("keep.tmp-4194305").exists(), "only hidden names are temporaries");
    }

    #[test]
    fn a_locked_directory_names_its_holder_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let held = DirLock::acquire(dir.path(), "run directory", "wait").unwrap();
        // A second open file description conflicts even within one process.
        let e = DirLock::acquire(dir.path(), "run directory", "wait for it").unwrap_err().to_string();
        assert!(e.contains(&format!("is in use by process {}; wait for it", std::process::id())), "{e}");
        drop(held);
        DirLock::acquire(dir.path(), "run directory", "wait").unwrap();
    }
}
