//! File writes that never leave something half-written that later looks valid.
use anyhow::{Context, Result};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temporary path beside `path` (same directory, so the final rename is atomic).
pub fn temp_beside(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

/// Writes `bytes` to `path` through a temporary file, fsync and rename; creates parent dirs.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    let tmp = temp_beside(path);
    let result = (|| -> Result<()> {
        let mut f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(bytes).with_context(|| format!("writing {}", tmp.display()))?;
        f.sync_all().with_context(|| format!("syncing {}", tmp.display()))?;
        drop(f);
        fs::rename(&tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
        sync_dir(path.parent())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Moves a finished temporary file into place (fsynced first) and syncs the directory.
pub fn commit_temp(tmp: &Path, path: &Path) -> Result<()> {
    File::open(tmp)?.sync_all().with_context(|| format!("syncing {}", tmp.display()))?;
    fs::rename(tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
    sync_dir(path.parent())
}

/// Writes `bytes` only when the file's content differs, so unchanged files keep their mtime
/// (cargo's fingerprints are mtime-based).
pub fn write_if_changed(path: &Path, bytes: &[u8]) -> Result<bool> {
    if let Ok(old) = fs::read(path)
        && old == bytes
    {
        return Ok(false);
    }
    write_atomic(path, bytes)?;
    Ok(true)
}

fn sync_dir(dir: Option<&Path>) -> Result<()> {
    if let Some(dir) = dir {
        let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
        File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("syncing {}", dir.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_and_unchanged_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a/b/file");
        write_atomic(&p, b"one").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"one");
        assert!(!write_if_changed(&p, b"one").unwrap());
        assert!(write_if_changed(&p, b"two").unwrap());
        assert_eq!(fs::read(&p).unwrap(), b"two");
        // No temporary files are left behind.
        let names: Vec<_> = fs::read_dir(p.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("file")]);
    }
}
