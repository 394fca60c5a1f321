//! File-system helpers for files that must never be seen half-written.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};

/// Writes `bytes` to `path` atomically: a temporary file in the same directory
/// ([`create_temp`]: a name no one can guess, created new, never through a link), flushed to
/// disk, then renamed over `path`. Readers see the old file or the new one, never a part. A
/// directory that another user owns is refused ([`check_dir_owner`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    check_dir_owner(dir)?;
    let (tmp, mut f) = create_temp(path).with_context(|| format!("cannot write {}", path.display()))?;
    let result = (|| {
        f.write_all(bytes)?;
        set_default_mode(&f)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.with_context(|| format!("cannot write {}", path.display()))
}

/// Creates the temporary file a writer fills before renaming it to `path`: `.NAME.tmp-PID-RANDOM`
/// beside it, created new (`O_EXCL`) without following a link (`O_NOFOLLOW`), readable and
/// writable by this user alone (0600) until [`set_default_mode`]. In a directory others can
/// write, a link planted at a predictable name would have sent the write to any file this
/// process can write; a random name created new cannot be planted. The PID keeps it a temporary
/// [`remove_stale_temporaries`] recognises.
pub fn create_temp(path: &Path) -> std::io::Result<(PathBuf, File)> {
    use std::os::unix::fs::OpenOptionsExt;
    let name = path.file_name().ok_or_else(|| std::io::Error::other("no file name"))?.to_string_lossy();
    let mut tries = 0;
    loop {
        let tmp = path.with_file_name(format!(".{name}.tmp-{}-{:016x}", std::process::id(), random_u64()));
        let opened = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp);
        match opened {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 8 => tries += 1,
            Err(e) => return Err(e),
        }
    }
}

/// Gives a file written through [`create_temp`] the mode a file created the ordinary way gets
/// (0666 less the process's umask), before it is renamed into place.
pub fn set_default_mode(file: &File) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(fs::Permissions::from_mode(0o666 & !umask()))
}

/// The process's umask (from `/proc/self/status`, read once; 022 where it does not say).
pub fn umask() -> u32 {
    static UMASK: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *UMASK.get_or_init(|| {
        let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
        let value = status.lines().find_map(|l| l.strip_prefix("Umask:")).map(str::trim);
        value.and_then(|v| u32::from_str_radix(v, 8).ok()).unwrap_or(0o022)
    })
}

/// 64 random bits from the kernel (`getrandom`), for names no one can guess; the clock and a
/// counter where it fails.
pub fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: the kernel writes at most `bytes.len()` bytes into the buffer we own.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n == bytes.len() as isize {
        return u64::from_le_bytes(bytes);
    }
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let seed =
        format!("{:?} {} {}", now, std::process::id(), COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let digest = crate::digest::sha256_hex(seed.as_bytes());
    u64::from_str_radix(&digest[..16], 16).unwrap_or_default()
}

/// Refuses, in one line naming it, a directory to write into that another user owns: its owner
/// can read or replace what is written there, and plant links at the names this process writes.
/// Directories root owns (`/tmp`, `/dev/shm`, shared and sticky) pass, and every directory when
/// this process runs as root (a container writing into the bind mount of the host's user): the
/// temporary files are created so that no link is followed ([`create_temp`]). A directory that
/// does not exist passes (the write fails there, naming it).
pub fn check_dir_owner(dir: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = fs::metadata(dir) else { return Ok(()) };
    // SAFETY: geteuid cannot fail and touches no memory.
    let me = unsafe { libc::geteuid() };
    if foreign_owner(meta.uid(), me) {
        bail!(
            "{} belongs to another user (uid {}; this process runs as uid {me}): that user could read or replace what is written there, or plant links at its names; write into a directory of your own",
            dir.display(),
            meta.uid()
        );
    }
    Ok(())
}

/// Whether a directory owned by `owner` is another user's for a process running as `me`
/// ([`check_dir_owner`]): neither this user's nor root's, and this process is not root.
fn foreign_owner(owner: u32, me: u32) -> bool {
    owner != me && owner != 0 && me != 0
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

/// Removes the entries of `dir` whose names start with `prefix` and end in `.tmp-<pid>` or
/// `.tmp-<pid>-<random>` (temporary files and directories of [`write_atomic`] and of exports)
/// of a process that no longer runs: what a killed process left. A temporary of a process
/// still running is left alone.
pub fn remove_stale_temporaries(dir: &Path, prefix: &str) -> Result<()> {
    let Ok(entries) = fs::read_dir(dir) else { return Ok(()) };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(prefix) {
            continue;
        }
        // `.tmp-PID`, or `.tmp-PID-RANDOM` ([`create_temp`]).
        let pid = name.rsplit_once(".tmp-").and_then(|(_, p)| p.split('-').next()?.parse::<i32>().ok());
        let Some(pid) = pid else { continue };
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

    /// Links another user planted in a shared output directory, at the temporary name this
    /// process once used (`.NAME.tmp-PID`) and at the name itself, are never written through:
    /// the file they point to keeps its bytes, the temporary is random, created new and 0600,
    /// and the file written gets the ordinary mode.
    #[test]
    fn links_planted_at_the_temporary_name_are_never_written_through() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        let out = dir.path().join("out");
        fs::create_dir(&out).unwrap();
        fs::set_permissions(&out, fs::Permissions::from_mode(0o777)).unwrap();
        let path = out.join("report.json");
        let planted = out.join(format!(".report.json.tmp-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"precious", "written through the planted link");
        assert!(fs::symlink_metadata(&path).unwrap().is_file(), "the file written is a file, not the link");
        assert_eq!(fs::read(&path).unwrap(), b"new");
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666 & !umask());
        // A link at the name itself is replaced, not followed.
        fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        write_atomic(&path, b"again").unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert_eq!(fs::read(&path).unwrap(), b"again");
        // The temporary: a new name each time, 0600, never through a link.
        let (a, file) = create_temp(&path).unwrap();
        let (b, _) = create_temp(&path).unwrap();
        assert_ne!(a, b);
        assert_eq!(file.metadata().unwrap().permissions().mode() & 0o777, 0o600);
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(&format!(".report.json.tmp-{}-", std::process::id())), "{name}");
        let leftovers: Vec<_> = fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers.len(), 4, "{leftovers:?}");
        // A temporary with a random part is one of this process: kept while it runs.
        remove_stale_temporaries(&out, ".").unwrap();
        assert!(a.exists() && b.exists());
        let dead = out.join(".report.json.tmp-4194305-0123456789abcdef");
        fs::write(&dead, b"x").unwrap();
        remove_stale_temporaries(&out, ".").unwrap();
        assert!(!dead.exists());
    }

    /// Another user's directory is refused, root's (`/tmp`) is not, and a process running as
    /// root writes anywhere.
    #[test]
    fn directories_of_other_users_are_refused() {
        assert!(foreign_owner(1000, 1001));
        assert!(!foreign_owner(1000, 1000));
        assert!(!foreign_owner(0, 1000), "root's directories (/tmp) are shared ones");
        assert!(!foreign_owner(1000, 0), "root writes into its users' directories");
        let dir = tempfile::tempdir().unwrap();
        check_dir_owner(dir.path()).unwrap();
        check_dir_owner(&dir.path().join("missing")).unwrap();
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
