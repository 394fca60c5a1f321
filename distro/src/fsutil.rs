//! File-system helpers shared by every part of the crate: writes that never leave something
//! half-written that later looks valid (atomic replacement, temporary files committed by
//! rename), and copies and removals of trees.

use anyhow::{Context, Result};
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temporary path beside `path` (same directory, so the final rename is atomic), for writers
/// that stream into a file and commit it with [`commit_temp`].
pub fn temp_beside(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

/// Moves a finished temporary file into place (fsynced first) and syncs the directory.
pub fn commit_temp(tmp: &Path, path: &Path) -> Result<()> {
    File::open(tmp)?.sync_all().with_context(|| format!("syncing {}", tmp.display()))?;
    fs::rename(tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
    sync_dir(path.parent())
}

fn sync_dir(dir: Option<&Path>) -> Result<()> {
    if let Some(dir) = dir {
        let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
        File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("syncing {}", dir.display()))?;
    }
    Ok(())
}

/// Replaces `path` with `bytes` atomically: a temporary file in the same directory is written,
/// synced and renamed over `path`, so readers see the old or the new file, never half of one.
/// The file keeps the permissions of the file it replaces (0644 for a new file).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mode = fs::metadata(path).map(|m| m.permissions().mode() & 0o7777).unwrap_or(0o644);
    let mut tmp = tempfile::Builder::new()
        .prefix(".distro-")
        .suffix(".tmp")
        .tempfile_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    tmp.write_all(bytes)
        .and_then(|_| tmp.as_file().set_permissions(fs::Permissions::from_mode(mode)))
        .and_then(|_| tmp.as_file().sync_all())
        .with_context(|| format!("writing {}", path.display()))?;
    tmp.persist(path).map_err(|e| e.error).with_context(|| format!("replacing {}", path.display()))?;
    // The rename is durable only once the directory entry is on disk.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Writes `bytes` to `path` only when its content differs; returns whether it wrote.
/// Unchanged files keep their bytes and their modification time.
pub fn write_if_changed(path: &Path, bytes: &[u8]) -> Result<bool> {
    if fs::read(path).ok().as_deref() == Some(bytes) {
        return Ok(false);
    }
    write_atomic(path, bytes)?;
    Ok(true)
}

/// Copies the directory tree `src` to `dst` (which must not exist), keeping symbolic links as
/// links and the executable bits of files.
pub fn copy_tree(src: &Path, dst: &Path) -> Result<()> {
    fs::create_dir(dst).with_context(|| format!("creating {}", dst.display()))?;
    let mut entries: Vec<_> = fs::read_dir(src)
        .with_context(|| format!("reading {}", src.display()))?
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("reading {}", src.display()))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let from = entry.path();
        let to = dst.join(entry.file_name());
        let kind = entry.file_type()?;
        if kind.is_symlink() {
            let target = fs::read_link(&from)?;
            std::os::unix::fs::symlink(&target, &to).with_context(|| format!("creating link {}", to.display()))?;
        } else if kind.is_dir() {
            copy_tree(&from, &to)?;
        } else {
            fs::copy(&from, &to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        }
    }
    Ok(())
}

/// Removes `path` (file or directory tree) if it exists.
pub fn remove_all(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Err(_) => Ok(()),
        Ok(m) if m.is_dir() => fs::remove_dir_all(path).with_context(|| format!("removing {}", path.display())),
        Ok(_) => fs::remove_file(path).with_context(|| format!("removing {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_and_keeps_mode() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.toml");
        fs::write(&p, "old").unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o640)).unwrap();
        write_atomic(&p, b"new").unwrap();
        assert_eq!(fs::read_to_string(&p).unwrap(), "new");
        assert_eq!(fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o640);
        // No temporary file is left behind.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn atomic_write_creates_parents_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a/b/file");
        write_atomic(&p, b"one").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"one");
        let names: Vec<_> = fs::read_dir(p.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("file")]);
    }

    #[test]
    fn write_if_changed_leaves_identical_files_alone() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        assert!(write_if_changed(&p, b"x").unwrap());
        assert!(!write_if_changed(&p, b"x").unwrap());
        assert!(write_if_changed(&p, b"y").unwrap());
    }

    #[test]
    fn copy_tree_keeps_links_and_modes() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        fs::create_dir_all(src.join("sub")).unwrap();
        fs::write(src.join("sub/run.sh"), "#!/bin/sh\n").unwrap();
        fs::set_permissions(src.join("sub/run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink("sub/run.sh", src.join("link")).unwrap();
        let dst = dir.path().join("dst");
        copy_tree(&src, &dst).unwrap();
        assert_eq!(fs::read_link(dst.join("link")).unwrap(), Path::new("sub/run.sh"));
        let mode = fs::metadata(dst.join("sub/run.sh")).unwrap().permissions().mode();
        assert_eq!(mode & 0o111, 0o111);
    }
}
