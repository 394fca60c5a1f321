//! One owner per directory, between real processes: a build holds its build directory and its
//! output layout for its life, so a second build of either, or a push of the layout, is refused
//! in one line naming the directory and the holder's PID (exit code 2) and changes nothing;
//! pushes of one layout share it with each other but not with a build.
use distro::fsutil::DirLock;
use distro::oci::layout::Layout;
use distro::oci::manifest::{Descriptor, OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, image_manifest};
use distro::oci::store::BlobStore;
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A registry that accepts connections and never answers: a process talking to it holds its
/// locks until it is killed. Returns the port and the number of connections so far.
fn stalling_registry() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    std::thread::spawn(move || {
        let mut open = Vec::new();
        for stream in listener.incoming() {
            seen.fetch_add(1, Ordering::SeqCst);
            open.push(stream);
        }
    });
    (port, count)
}

/// Waits until `count` exceeds `n` (the process under test reached the registry).
fn wait_for_connection(count: &AtomicUsize, n: usize, who: &mut Child) {
    let start = Instant::now();
    while count.load(Ordering::SeqCst) <= n {
        if let Some(status) = who.try_wait().unwrap() {
            panic!("the process exited ({status}) before reaching the registry");
        }
        assert!(start.elapsed() < Duration::from_secs(120), "the process never reached the registry");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Processes killed when the test ends, however it ends.
struct Holders(Vec<Child>);

impl Drop for Holders {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

struct Env {
    tmp: tempfile::TempDir,
}

impl Env {
    fn new() -> Env {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("home")).unwrap();
        Env { tmp }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    /// `distro ARGS` in the project's checkout, with the build directory `target`.
    fn cmd(&self, target: &str, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_distro"));
        c.args(args)
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .env("HOME", self.path("home"))
            .env("DISTRO_CACHE_DIR", self.path("cache"))
            .env("DISTRO_TARGET_DIR", self.path(target))
            .env("DISTRO_NET_BACKOFF_MS", "10")
            .env_remove("DOCKER_CONFIG")
            .env_remove("RUST_BACKTRACE")
            .stdin(Stdio::null());
        c
    }

    fn spawn(&self, target: &str, args: &[&str]) -> Child {
        self.cmd(target, args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
    }

    /// Runs a process that must be refused: exit code 2 and one line, `error: ...`, returned. A
    /// process that is not refused would stall on the registry too: it is killed after a minute
    /// and the test fails.
    fn refusal(&self, target: &str, args: &[&str]) -> String {
        let mut child = self.cmd(target, args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let start = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{args:?} was not refused: still running after a minute");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: more than one line: {stderr}");
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
        stderr.into_owned()
    }

    /// [`Env::refusal`], whose line must contain `expected`.
    fn refused(&self, target: &str, args: &[&str], expected: &str) {
        let line = self.refusal(target, args);
        assert!(line.contains(expected), "{args:?}: expected `{expected}` in {line}");
    }
}

/// A layout at `dir` with one image tagged `engine`.
fn layout_with_one_image(dir: &Path, scratch: &Path) {
    let store = BlobStore::new(scratch);
    let desc = |media_type: &str, bytes: &[u8]| Descriptor::of(media_type, bytes);
    let config = desc(OCI_CONFIG, b"{}");
    let layer = desc(OCI_LAYER_GZIP, b"layer");
    store.put(b"{}").unwrap();
    store.put(b"layer").unwrap();
    let m = image_manifest(&config, std::slice::from_ref(&layer), &BTreeMap::new()).unwrap();
    let manifest = desc(OCI_MANIFEST, &m);
    store.put(&m).unwrap();
    let blobs = [config.digest, layer.digest, manifest.digest.clone()];
    Layout::new(dir).write(&store, &blobs, &[("engine".into(), manifest)]).unwrap();
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn a_layout_and_a_build_directory_being_built_are_refused_to_a_second_process() {
    let env = Env::new();
    let layout = env.path("oci");
    layout_with_one_image(&layout, &env.path("scratch"));
    let (port, connections) = stalling_registry();
    let base = format!("127.0.0.1:{port}/base:latest");
    let out = layout.to_str().unwrap();
    // The holder takes both locks first, then stalls resolving the base on the silent registry.
    let mut holders =
        Holders(vec![env.spawn("target", &["build", "--output", out, "--base", &base, "--platform", "linux/amd64"])]);
    wait_for_connection(&connections, 0, &mut holders.0[0]);
    let pid = holders.0[0].id();
    let before = snapshot(&layout);
    let in_use =
        |what: &str, dir: &Path| format!("{what} {} is in use by process {pid}; wait for it to finish", dir.display());

    // A second build into the layout (from another build directory), a push of it, and a build
    // in the same build directory into another layout.
    env.refused("target2", &["build", "--output", out, "--base", &base], &in_use("OCI layout", &layout));
    env.refused("target2", &["push", out, &format!("127.0.0.1:{port}/r")], &in_use("OCI layout", &layout));
    let other = env.path("other");
    env.refused(
        "target",
        &["build", "--output", other.to_str().unwrap(), "--base", &base],
        &format!("{}, or set DISTRO_TARGET_DIR", in_use("build directory", &env.path("target"))),
    );
    assert_eq!(snapshot(&layout), before, "a refused process changed the layout");
    assert!(!other.exists(), "a refused build created its layout");
    assert_eq!(connections.load(Ordering::SeqCst), 1, "a refused process reached the registry");

    // Killed (SIGKILL releases OS locks), the holder leaves the directories free.
    drop(holders);
    let _held = DirLock::exclusive(&layout, "OCI layout", "").unwrap();
}

#[test]
fn pushes_of_one_layout_run_together_and_keep_a_build_out() {
    let env = Env::new();
    let layout = env.path("oci");
    layout_with_one_image(&layout, &env.path("scratch"));
    let (port, connections) = stalling_registry();
    let out = layout.to_str().unwrap();
    let mut holders = Holders(Vec::new());
    // Two pushes of the layout at once, each stalled on the registry while holding it shared.
    for (i, repo) in ["a", "b"].iter().enumerate() {
        holders.0.push(env.spawn("target", &["push", out, &format!("127.0.0.1:{port}/{repo}")]));
        wait_for_connection(&connections, i, holders.0.last_mut().unwrap());
    }
    let before = snapshot(&layout);
    let readers: Vec<String> =
        holders.0.iter().map(|c| format!("OCI layout {out} is in use by process {}", c.id())).collect();
    let line = env.refusal("target", &["build", "--output", out]);
    assert!(readers.iter().any(|r| line.contains(r.as_str())), "expected one of {readers:?} in {line}");
    assert_eq!(snapshot(&layout), before, "a refused build changed the layout");
}

#[test]
fn a_fetch_output_directory_in_use_is_refused() {
    let env = Env::new();
    let dir = env.path("trees");
    std::fs::create_dir_all(&dir).unwrap();
    let _held = DirLock::exclusive(&dir, "fetch output directory", "").unwrap();
    let before = snapshot(&dir);
    let expected = format!(
        "fetch output directory {} is in use by process {}; wait for it to finish, or choose another --out",
        dir.display(),
        std::process::id()
    );
    env.refused("target", &["fetch", "--out", dir.to_str().unwrap()], &expected);
    assert_eq!(snapshot(&dir), before);
}

/// A lock file that is a link (to a victim file, or a hard link to it) is refused, and the
/// victim is left as it was: the lock's PID is never written through it.
#[test]
fn a_lock_file_that_is_a_link_is_refused_and_its_target_kept() {
    let env = Env::new();
    let victim = env.path("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    for (i, hard) in [false, true].into_iter().enumerate() {
        let dir = env.path(&format!("trees{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        if hard {
            std::fs::hard_link(&victim, dir.join(".lock")).unwrap();
        } else {
            std::os::unix::fs::symlink(&victim, dir.join(".lock")).unwrap();
        }
        let err = DirLock::exclusive(&dir, "fetch output directory", "").unwrap_err();
        assert!(distro::error::is_bad_input(&err) && err.to_string().contains("is not a plain lock file"), "{err}");
        env.refused("target", &["fetch", "--out", dir.to_str().unwrap()], "is not a plain lock file");
        let layout = env.path(&format!("oci{i}"));
        layout_with_one_image(&layout, &env.path("scratch"));
        std::fs::remove_file(layout.join(".lock")).ok();
        if hard {
            std::fs::hard_link(&victim, layout.join(".lock")).unwrap();
        } else {
            std::os::unix::fs::symlink(&victim, layout.join(".lock")).unwrap();
        }
        env.refused("target", &["push", layout.to_str().unwrap(), "127.0.0.1:9/r"], "is not a plain lock file");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    }
}

/// A layout whose index blob is a link to /dev/zero is refused as corrupt at once, without
/// reading it whole; a ref that is not a tag is refused in one line.
#[test]
fn push_reads_a_blob_no_further_than_its_descriptor_and_refuses_bad_tags() {
    let env = Env::new();
    let layout = env.path("oci");
    layout_with_one_image(&layout, &env.path("scratch"));
    let refs = Layout::open(&layout).unwrap().refs().unwrap();
    let blob = Layout::open(&layout).unwrap().store.path(&refs[0].1.digest);
    let index = std::fs::read_to_string(layout.join("index.json")).unwrap();

    std::fs::write(layout.join("index.json"), index.replace("\"engine\"", "\"bad tag!\"")).unwrap();
    env.refused("target", &["push", layout.to_str().unwrap(), "127.0.0.1:9/r"], "ref \"bad tag!\" is not a valid tag");
    std::fs::write(layout.join("index.json"), &index).unwrap();

    std::fs::remove_file(&blob).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &blob).unwrap();
    let started = std::time::Instant::now();
    env.refused("target", &["push", layout.to_str().unwrap(), "127.0.0.1:9/r"], "is corrupt");
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "took {:?}", started.elapsed());
}
