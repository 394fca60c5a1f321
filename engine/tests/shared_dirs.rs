//! Writing into directories other users share (issue 46, hole 7), as another user: the test
//! runs as root and starts the engine as uid 12345 (`setpriv`), so it needs root and `setpriv`
//! and says SKIPPED otherwise. An output directory another user owns (uid 12346, open to all) is
//! refused in one line naming it, exit code 2, with nothing written there; one of this user's
//! own is written as before.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use common::{s, scratch};

const USER: u32 = 12345;
const OTHER: u32 = 12346;

/// `engine ARGS` as uid [`USER`], or None where this test cannot switch users.
fn as_user(args: &[&str]) -> Option<Command> {
    // SAFETY: geteuid cannot fail and touches no memory.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/usr/bin/setpriv").exists() {
        return None;
    }
    let mut cmd = Command::new("/usr/bin/setpriv");
    let ids = [format!("--reuid={USER}"), format!("--regid={USER}")];
    cmd.args(&ids).arg("--clear-groups").arg(env!("CARGO_BIN_EXE_engine")).args(args);
    cmd.env_remove("ENGINE_FLAGS").env_remove("ENGINE_DEFAULT_FLAGS").env("HOME", "/nonexistent");
    Some(cmd)
}

/// A directory at `path` owned by `uid`, mode `mode`.
fn dir_of(path: &Path, uid: u32, mode: u32) {
    std::fs::create_dir_all(path).unwrap();
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn an_output_directory_of_another_user_is_refused() {
    let dir = scratch("shared-dirs");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    // A run directory the plot reads (readable by all).
    let run = dir.join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{\"step\":1,\"loss\":2.5}\n{\"step\":2,\"loss\":2.0}\n").unwrap();
    let (theirs, mine) = (dir.join("theirs"), dir.join("mine"));
    dir_of(&theirs, OTHER, 0o777);
    dir_of(&mine, USER, 0o755);

    let out_theirs = theirs.join("loss.svg");
    let Some(mut cmd) = as_user(&["plot", s(&run), "--out", s(&out_theirs)]) else {
        return eprintln!("SKIPPED: needs root and setpriv to run the engine as another user");
    };
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let expected =
        format!("{} belongs to another user (uid {OTHER}; this process runs as uid {USER})", theirs.display());
    assert!(stderr.contains(&expected) && !stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert_eq!(std::fs::read_dir(&theirs).unwrap().count(), 0, "written into another user's directory");

    let out_mine = mine.join("loss.svg");
    let out = as_user(&["plot", s(&run), "--out", s(&out_mine)]).unwrap().output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let names: Vec<_> = std::fs::read_dir(&mine).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["loss.svg"], "no temporary left");
    // The ordinary mode (0666 less the umask), this user's.
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(&out_mine).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o777), (USER, 0o666 & !engine::fsutil::umask()), "{:o}", meta.mode());
}
