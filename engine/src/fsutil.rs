//! File-system helpers for files that must never be seen half-written.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};

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

/// Reads `path` as text, refusing (naming it) a file longer than `max` bytes, so that a file
/// of any size (or a link to `/dev/zero`) is never held whole; `what` says what it should be.
pub fn read_bounded(path: &Path, max: u64, what: &str) -> Result<String> {
    use std::io::Read;
    let file = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).with_context(|| format!("cannot read {}", path.display()))?;
    if bytes.len() as u64 > max {
        bail!("{}: longer than {} bytes, more than {what} holds", path.display(), max);
    }
    String::from_utf8(bytes)
        .map_err(|e| anyhow!("{}: not UTF-8 text (byte {})", path.display(), e.utf8_error().valid_up_to()))
}

/// Calls `each(n, line)` for every line of `path` (`n` from 1, without its line ending),
/// reading at most `max` bytes of a line at a time: a longer line (or a file without line
/// breaks, such as `/dev/zero`) is refused, naming the file and the line, and memory stays
/// bounded whatever the file's size. Bytes that are not UTF-8 are replaced.
pub fn for_each_line(path: &Path, max: usize, mut each: impl FnMut(usize, &str) -> Result<()>) -> Result<()> {
    use std::io::{BufRead, Read};
    let file = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut reader = std::io::BufReader::new(file);
    let mut buf = Vec::new();
    for n in 1.. {
        buf.clear();
        let read = (&mut reader)
            .take(max as u64 + 1)
            .read_until(b'\n', &mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if read == 0 {
            break;
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
        } else if buf.len() > max {
            bail!("{}:{n}: a line longer than {max} bytes (no line of this file is that long)", path.display());
        }
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        each(n, &String::from_utf8_lossy(&buf))?;
    }
    Ok(())
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
        if !process_alive(pid) {
            let path = entry.path();
            let removed = if path.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
            removed.with_context(|| format!("cannot remove {}, left by a killed process", path.display()))?;
        }
    }
    Ok(())
}

/// Whether process `pid` exists (this process included): a temporary named for a process that
/// does not is what a killed process left.
pub fn process_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only asks whether the process exists; EPERM says it does, owned by
    // another user.
    pid == std::process::id() as i32
        || (pid > 0
            && (unsafe { libc::kill(pid, 0) } == 0
                || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)))
}

/// Whether `name` is a plain relative path: one or more ordinary components, nothing absolute,
/// no `.` or `..`, no empty component (`a//b`). What a file name read from a file (a
/// checkpoint's `state.json`, an index) must be before it is joined to a directory.
pub fn is_plain_relative(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('/')
        && name.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
        && Path::new(name).components().all(|c| matches!(c, std::path::Component::Normal(_)))
}

/// Where `path` leads once every symbolic link is followed, if that is a regular file under
/// `root` (itself canonical, as [`fs::canonicalize`] gives it). Otherwise an error that says
/// why: the file is missing, leaves `root` (through a symbolic link, absolute or relative), or
/// is not a regular file (a directory, a device, a FIFO).
pub fn regular_file_under(path: &Path, root: &Path) -> Result<std::path::PathBuf> {
    let p = path.display();
    let real = fs::canonicalize(path).map_err(|e| match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            let to = fs::read_link(path).map(|t| t.display().to_string()).unwrap_or_default();
            anyhow!("{p} is a symbolic link to {to}, which does not exist")
        }
        _ => anyhow!("cannot read {p}: {e}"),
    })?;
    if !real.starts_with(root) {
        bail!(
            "{p} leads outside {} (a symbolic link to {}); copy the file in instead (cp -L)",
            root.display(),
            real.display()
        );
    }
    let meta = fs::metadata(&real).map_err(|e| anyhow!("cannot read {p}: {e}"))?;
    if !meta.is_file() {
        bail!("{p} is not a regular file");
    }
    Ok(real)
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
    ///
    /// The lock file is opened without following a symbolic link and must be a regular file
    /// with no other name (a hard link), since taking the lock rewrites it: a `.lock` that is
    /// a link to another file is refused, never written through.
    pub fn try_acquire(dir: &Path) -> Result<std::result::Result<DirLock, Option<String>>> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let path = dir.join(".lock");
        let p = path.display();
        let refuse =
            |what: &str| anyhow::anyhow!("{p} is {what}, not the lock file this engine writes; remove it and retry");
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => refuse("a symbolic link"),
                _ => anyhow::Error::new(e).context(format!("cannot open {p}")),
            })?;
        let meta = file.metadata().with_context(|| format!("cannot open {p}"))?;
        if !meta.is_file() {
            return Err(refuse("not a regular file"));
        }
        if meta.nlink() > 1 {
            return Err(refuse("a hard link to another file"));
        }
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

    /// A `.lock` that is a symbolic or hard link to another file is refused and the file left
    /// as it was: taking the lock rewrites the lock file.
    #[test]
    fn a_lock_file_that_links_elsewhere_is_refused_and_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        let run = dir.path().join("run");
        fs::create_dir(&run).unwrap();
        std::os::unix::fs::symlink(&victim, run.join(".lock")).unwrap();
        let e = DirLock::acquire(&run, "run directory", "wait").unwrap_err().to_string();
        assert!(e.contains(".lock is a symbolic link, not the lock file this engine writes; remove it"), "{e}");
        fs::remove_file(run.join(".lock")).unwrap();
        fs::hard_link(&victim, run.join(".lock")).unwrap();
        let e = DirLock::acquire(&run, "run directory", "wait").unwrap_err().to_string();
        assert!(e.contains(".lock is a hard link to another file"), "{e}");
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        fs::remove_file(run.join(".lock")).unwrap();
        fs::create_dir(run.join(".lock")).unwrap();
        let e = DirLock::acquire(&run, "run directory", "wait").unwrap_err();
        assert!(format!("{e:#}").contains(".lock"), "{e:#}");
    }

    #[test]
    fn plain_relative_names_and_files_under_a_root() {
        for ok in ["a", "hf/config.json", "shard-00000-of-00001.json"] {
            assert!(is_plain_relative(ok), "{ok}");
        }
        for bad in ["", "/etc/passwd", "hf//tmp/x", "../x", "hf/../../x", "./a", "a/.", "a/"] {
            assert!(!is_plain_relative(bad), "{bad}");
        }
        let dir = tempfile::tempdir().unwrap();
        let root = fs::canonicalize(dir.path()).unwrap().join("root");
        fs::create_dir_all(root.join("sub")).unwrap();
        fs::write(root.join("sub/blob"), b"x").unwrap();
        fs::write(dir.path().join("outside"), b"x").unwrap();
        std::os::unix::fs::symlink("sub/blob", root.join("inner")).unwrap();
        std::os::unix::fs::symlink("../outside", root.join("relative-out")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", root.join("absolute-out")).unwrap();
        std::os::unix::fs::symlink("missing", root.join("dangling")).unwrap();
        assert_eq!(regular_file_under(&root.join("inner"), &root).unwrap(), root.join("sub/blob"));
        for (name, expected) in [
            ("relative-out", "leads outside"),
            ("absolute-out", "leads outside"),
            ("dangling", "is a symbolic link to missing, which does not exist"),
            ("sub", "is not a regular file"),
            ("absent", "cannot read"),
        ] {
            let e = regular_file_under(&root.join(name), &root).unwrap_err().to_string();
            assert!(e.contains(expected), "{name}: {e}");
        }
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
