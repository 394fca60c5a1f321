//! File-system helpers shared by every part of the crate: writes that never leave something
//! half-written that later looks valid (atomic replacement, temporary files committed by
//! rename), copies and removals of trees, and one owner per directory ([`DirLock`]).

use crate::error::bad_input;
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

/// A hold on a directory for this process's life: an OS lock (`flock`, through the standard
/// library's `File::try_lock`) on `DIR/.lock`, so a process that dies, however it dies, releases
/// it. As the engine's `DirLock` for run directories (the two crates share no code by design):
/// the holder writes its PID into the file for the message a second process gets.
///
/// A writer holds it exclusively; readers that only need the directory not to change under them
/// (`distro push` and `load` of a layout) hold it shared, so any number of them run at once and
/// none while a writer does.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

impl DirLock {
    /// Takes the exclusive lock of `dir` (which must exist) without waiting. `what` names the
    /// directory in the error (`OCI layout`), `advice` says what to do instead. A directory
    /// in use is bad input (exit code 2): one line naming it and the process holding it.
    pub fn exclusive(dir: &Path, what: &str, advice: &str) -> Result<DirLock> {
        let path = dir.join(LOCK_FILE);
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        check_lock_file(&file, &path)?;
        Self::take(file, &path, dir, what, advice, false)?.context("an exclusive lock is always taken")
    }

    /// Takes a shared lock of `dir` without waiting: refused while a writer holds it, never by
    /// other readers. Returns `None`, holding nothing, when `dir` cannot hold a lock file (a
    /// read-only directory that no distro process ever locked: nobody writes it through us).
    pub fn shared(dir: &Path, what: &str, advice: &str) -> Result<Option<DirLock>> {
        let path = dir.join(LOCK_FILE);
        let opened = fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path);
        let file = match opened {
            Ok(f) => f,
            // flock needs no write access: an existing lock file of a read-only layout still locks.
            Err(e) if is_read_only(&e) => match File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e).with_context(|| format!("cannot open {}", path.display())),
            },
            Err(e) => return Err(e).with_context(|| format!("cannot open {}", path.display())),
        };
        check_lock_file(&file, &path)?;
        Self::take(file, &path, dir, what, advice, true)
    }

    fn take(
        mut file: File,
        path: &Path,
        dir: &Path,
        what: &str,
        advice: &str,
        shared: bool,
    ) -> Result<Option<DirLock>> {
        let taken = if shared { file.try_lock_shared() } else { file.try_lock() };
        match taken {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(bad_input(format!("{what} {} is in use by {}; {advice}", dir.display(), holder(path))));
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()));
            }
        }
        // Readers write their PID too (the last one's stays), so that a writer refused while
        // they read can name one; a line end keeps a shorter PID written over a longer one whole.
        // A file opened read-only cannot say who holds it, which only costs the name.
        let _ = file.set_len(0).and_then(|()| file.write_all(format!("{}\n", std::process::id()).as_bytes()));
        Ok(Some(DirLock { _file: file }))
    }
}

/// Refuses a lock file that is not this directory's own plain file: a symbolic link (opening
/// follows it, and the holder's PID would then be written over whatever it points to), a file
/// with other hard links, or anything but a regular file. The check compares the opened file
/// with what the path names without following links, so a link swapped in after the open is
/// caught too. Bad input, naming the file.
fn check_lock_file(file: &File, path: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let opened = file.metadata().with_context(|| format!("cannot read {}", path.display()))?;
    let named = fs::symlink_metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    let same = opened.dev() == named.dev() && opened.ino() == named.ino();
    if named.file_type().is_symlink() || !same || !opened.is_file() || opened.nlink() != 1 {
        return Err(bad_input(format!(
            "{} is not a plain lock file (a symbolic link, a hard link or not a regular file); remove it and retry",
            path.display()
        )));
    }
    Ok(())
}

/// The name of a directory's lock file, `DIR/.lock`.
pub const LOCK_FILE: &str = ".lock";

fn is_read_only(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem)
}

/// Who holds the lock file at `path`: `process PID` from its first line, or `another process`
/// when it names none, or a process that has exited (on Linux, where `/proc` tells: a reader
/// that wrote its PID last may be gone while an earlier one still reads).
pub fn holder(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let pid = text.lines().next().unwrap_or("").trim();
    let gone = Path::new("/proc/self").exists() && !Path::new("/proc").join(pid).exists();
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) || gone {
        "another process".to_owned()
    } else {
        format!("process {pid}")
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
    fn a_written_directory_names_its_holder_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let held = DirLock::exclusive(dir.path(), "OCI layout", "wait").unwrap();
        // A second open file description conflicts even within one process.
        let me = format!("is in use by process {}; wait for it", std::process::id());
        let e = DirLock::exclusive(dir.path(), "OCI layout", "wait for it").unwrap_err();
        assert!(crate::error::is_bad_input(&e) && e.to_string().contains(&me), "{e}");
        let e = DirLock::shared(dir.path(), "OCI layout", "wait for it").unwrap_err().to_string();
        assert!(e.starts_with(&format!("OCI layout {} ", dir.path().display())) && e.contains(&me), "{e}");
        drop(held);
        DirLock::exclusive(dir.path(), "OCI layout", "wait").unwrap();
    }

    #[test]
    fn readers_share_a_directory_and_keep_writers_out() {
        let dir = tempfile::tempdir().unwrap();
        let a = DirLock::shared(dir.path(), "OCI layout", "wait").unwrap().unwrap();
        let b = DirLock::shared(dir.path(), "OCI layout", "wait").unwrap().unwrap();
        let e = DirLock::exclusive(dir.path(), "OCI layout", "wait").unwrap_err().to_string();
        assert!(e.contains(&format!("in use by process {}", std::process::id())), "{e}");
        drop(a);
        assert!(DirLock::exclusive(dir.path(), "OCI layout", "wait").is_err(), "one reader still holds it");
        drop(b);
        DirLock::exclusive(dir.path(), "OCI layout", "wait").unwrap();
    }

    #[test]
    fn a_holder_that_exited_or_wrote_nothing_is_not_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".lock");
        // PID 2^22 + 1 is above Linux's pid_max limit: no such process can exist.
        for (text, expected) in [("4194305\n", "another process"), ("", "another process"), ("x", "another process")] {
            fs::write(&path, text).unwrap();
            assert_eq!(holder(&path), expected, "{text:?}");
        }
        // A shorter PID written over a longer one: the first line is whole.
        fs::write(&path, format!("{}\n\n", std::process::id())).unwrap();
        assert_eq!(holder(&path), format!("process {}", std::process::id()));
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
