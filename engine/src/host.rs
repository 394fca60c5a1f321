//! What this machine lets a process have, read before anything is allocated: the memory
//! (the available RAM and the address-space limit) and a file system's free bytes, and whether
//! that file system lives in memory (`/dev/shm`, a tmpfs), where files take RAM too.

use std::path::Path;

/// The memory this process can have, and where the figure comes from: the smaller of the
/// available RAM (`MemAvailable`) and the address-space limit (`ulimit -v`, less what the
/// program itself maps, about 1 GiB of code, stacks and libraries). None when neither is known.
pub fn memory_limit() -> Option<(u64, String)> {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some((kib * 1024, "available RAM (MemAvailable)".to_owned()))
    });
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given and nothing else.
    let ulimit = (unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } == 0
        && limit.rlim_cur != libc::RLIM_INFINITY)
        .then(|| (limit.rlim_cur.saturating_sub(1 << 30), "the address-space limit (ulimit -v) less 1 GiB".to_owned()));
    [available, ulimit].into_iter().flatten().min_by_key(|(bytes, _)| *bytes)
}

/// Bytes available to this user on the file system of `path`, and whether it is a tmpfs
/// (statfs).
pub fn file_system(path: &Path) -> std::io::Result<(u64, bool)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and a zeroed struct for the call to fill.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // The field and the constant have other integer types on other targets.
    #[allow(clippy::unnecessary_cast)]
    let tmpfs = st.f_type as i64 == libc::TMPFS_MAGIC as i64;
    // Blocks count in fragments where the file system has them, as statvfs's f_frsize.
    let block = if st.f_frsize > 0 { st.f_frsize } else { st.f_bsize };
    Ok((st.f_bavail as u64 * block as u64, tmpfs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_shm_is_memory_and_a_temporary_directory_has_room() {
        let (free, _) = file_system(Path::new("/tmp")).unwrap();
        assert!(free > 0);
        if Path::new("/dev/shm").is_dir() {
            assert!(file_system(Path::new("/dev/shm")).unwrap().1, "/dev/shm is a tmpfs");
        }
        assert!(file_system(Path::new("/no/such/dir")).is_err());
        let (bytes, what) = memory_limit().expect("Linux has /proc/meminfo");
        assert!(bytes > 0 && !what.is_empty());
    }
}
