//! A real cargo build in the stage with a patched crate wired in through `[patch.crates-io]`:
//! the derived lock is checked, the build runs `--locked` against it, and the patch is in
//! effect (the program only compiles with the patched crate).
use distro::image::def::Binary;
use distro::image::engine_build::{CratePatch, Stage};
use distro::image::workspace::Workspace;
use distro::oci::platform::Platform;
use distro::progress::Progress;
use std::path::{Path, PathBuf};
use std::process::Command;

fn run(dir: &Path, cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).current_dir(dir).output().unwrap();
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A crates.io crate already unpacked in the local registry (any dependency-free one the
/// workspace's own build downloaded): `itoa`.
fn local_itoa() -> (String, PathBuf) {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cargo"));
    for index in std::fs::read_dir(home.join("registry/src")).expect("a cargo registry cache") {
        for e in std::fs::read_dir(index.unwrap().path()).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(v) = name.strip_prefix("itoa-")
                && v.starts_with("1.")
            {
                return (v.to_string(), e.path());
            }
        }
    }
    panic!("no itoa 1.x in the local cargo registry (the workspace build downloads it)")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn patched_crate_builds_locked_against_a_checked_derived_lock() {
    let (version, src) = local_itoa();
    let tmp = tempfile::tempdir().unwrap();
    let ws_dir = tmp.path().join("ws");
    std::fs::create_dir_all(ws_dir.join("app/src")).unwrap();
    std::fs::write(ws_dir.join("Cargo.toml"), "[workspace]\nresolver = \"3\"\nmembers = [\"app\"]\n").unwrap();
    std::fs::write(
        ws_dir.join("app/Cargo.toml"),
        format!("[package]\nname = \"app\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[dependencies]\nitoa = \"={version}\"\n"),
    )
    .unwrap();
    std::fs::write(
        ws_dir.join("app/src/main.rs"),
        "fn main() { println!(\"{} {}\", itoa::Buffer::new().format(42), itoa::PATCHED_BY_TEST); }\n",
    )
    .unwrap();
    run(&ws_dir, "cargo", &["generate-lockfile", "--offline"]);
    run(&ws_dir, "git", &["init", "-q"]);
    run(&ws_dir, "git", &["add", "-A"]);
    run(&ws_dir, "git", &["-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "app"]);
    let committed = std::fs::read(ws_dir.join("Cargo.lock")).unwrap();

    let tree = tmp.path().join("itoa-patched");
    copy_dir(&src, &tree);
    let lib = tree.join("src/lib.rs");
    let mut text = std::fs::read_to_string(&lib).unwrap();
    text.push_str("\n/// Added by the test's patch.\npub const PATCHED_BY_TEST: bool = true;\n");
    std::fs::write(&lib, text).unwrap();

    // The stage's rustc wrapper is the distro executable (this test binary is not).
    // SAFETY: set before any thread of this test runs commands.
    unsafe { std::env::set_var(distro::image::engine_build::WRAPPER_EXE_ENV, env!("CARGO_BIN_EXE_distro")) };
    let ws = Workspace::open(&ws_dir).unwrap();
    let cache = tmp.path().join("cache");
    let progress = Progress::plain();
    let patch = CratePatch {
        krate: "itoa".into(),
        source: "itoa".into(),
        tree_dir: tree.clone(),
        tree_id: "test-tree-1".into(),
        subdir: String::new(),
    };
    let stage = Stage::prepare(&ws, &cache, std::slice::from_ref(&patch), &progress).unwrap();
    let derived = String::from_utf8(stage.lock().to_vec()).unwrap();
    assert_ne!(stage.lock(), committed.as_slice(), "the patch must change the lock");
    let itoa_entry = derived.split("[[package]]").find(|p| p.contains("name = \"itoa\"")).unwrap();
    assert!(!itoa_entry.contains("source ="), "the patched crate is a path entry: {itoa_entry}");
    // The workspace's own lock is untouched.
    assert_eq!(std::fs::read(ws_dir.join("Cargo.lock")).unwrap(), committed);

    let host = Platform::host().expect("a supported host");
    let bin = Binary { package: "app".into(), bin: None, dest: "/usr/local/bin/app".into() };
    let built = stage.build(std::slice::from_ref(&host), &[bin], "test", &progress).unwrap();
    let out = Command::new(&built[&(host, "app".to_string())]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42 true");

    // A patch nothing uses is refused.
    let unused =
        CratePatch { krate: "not-a-dependency".into(), source: "x".into(), tree_id: "test-tree-2".into(), ..patch };
    std::fs::write(
        tree.join("Cargo.toml"),
        std::fs::read_to_string(tree.join("Cargo.toml")).unwrap().replacen(
            "name = \"itoa\"",
            "name = \"not-a-dependency\"",
            1,
        ),
    )
    .unwrap();
    let e = Stage::prepare(&ws, &cache, &[unused], &progress).err().expect("an unused patch is an error");
    assert!(format!("{e:#}").contains("not used"), "{e:#}");
}
