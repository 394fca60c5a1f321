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
                let holder = match holder.trim() {
                    "" => "another process".to_owned(),
                    pid => format!("process {pid}"),
                };
                anyhow::bail!("{what} {} is in use by {holder}; {advice}", dir.display());
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()));
            }
        }
        file.set_len(0)?;
        file.write_all(std::process::id().to_string().as_bytes())?;
        file.sync_all()?;
        Ok(DirLock { _file: file })
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
