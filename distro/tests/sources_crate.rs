//! End-to-end tests of crate sources: a local Cargo registry made by the test (Cargo's
//! `local-registry` source replacing the default registry, set in a test `CARGO_HOME`), and one
//! test against the real registry with the project's own manifest and lock.

mod common;

use common::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A local registry serving `fixcrate` 0.1.0 and 0.2.0, and a CARGO_HOME that uses it.
struct Registry {
    cargo_home: PathBuf,
    checksums: Vec<(String, String)>,
}

fn lib_rs(answer: u32) -> String {
    format!(
        "/// The answer.\npub fn answer() -> u32 {{\n    {answer}\n}}\n\n/// Unchanged helper.\npub fn helper() -> u32 {{\n    7\n}}\n"
    )
}

fn registry(dir: &Path) -> Registry {
    let reg = dir.join("registry");
    fs::create_dir_all(reg.join("index/fi/xc")).unwrap();
    let mut index = String::new();
    let mut checksums = Vec::new();
    for (version, answer) in [("0.1.0", 41), ("0.2.0", 42)] {
        let src = dir.join(format!("src-{version}"));
        fs::create_dir_all(src.join("src")).unwrap();
        fs::write(
            src.join("Cargo.toml"),
            format!("[package]\nname = \"fixcrate\"\nversion = \"{version}\"\nedition = \"2021\"\ndescription = \"fixture\"\nlicense = \"MIT\"\ninclude = [\"src/**\", \"Cargo.toml\", \".gitignore\", \"notes.log\"]\n\n[workspace]\n"),
        )
        .unwrap();
        fs::write(src.join("src/lib.rs"), lib_rs(answer)).unwrap();
        // A crate whose .gitignore matches one of its own files: the file is part of the crate.
        fs::write(src.join(".gitignore"), "/target\n*.log\n").unwrap();
        fs::write(src.join("notes.log"), "kept\n").unwrap();
        let out = Command::new("cargo")
            .args(["package", "--quiet", "--no-verify", "--offline", "--allow-dirty", "--target-dir"])
            .arg(dir.join("target"))
            .current_dir(&src)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let name = format!("fixcrate-{version}.crate");
        let bytes = fs::read(dir.join("target/package").join(&name)).unwrap();
        let sum = sha256(&bytes);
        fs::write(reg.join(&name), &bytes).unwrap();
        index.push_str(&format!(
            "{{\"name\":\"fixcrate\",\"vers\":\"{version}\",\"deps\":[],\"cksum\":\"{sum}\",\"features\":{{}},\"yanked\":false}}\n"
        ));
        checksums.push((version.to_owned(), sum));
    }
    fs::write(reg.join("index/fi/xc/fixcrate"), index).unwrap();
    let cargo_home = dir.join("cargo-home");
    fs::create_dir_all(&cargo_home).unwrap();
    fs::write(
        cargo_home.join("config.toml"),
        format!(
            "[source.crates-io]\nreplace-with = \"fixture\"\n\n[source.fixture]\nlocal-registry = \"{}\"\n",
            reg.display()
        ),
    )
    .unwrap();
    Registry { cargo_home, checksums }
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A `git format-patch` mbox that changes `helper` to return 8, made against the crate's files.
fn helper_patch(dir: &Path) -> Vec<u8> {
    let work = dir.join("patch-work");
    fs::create_dir_all(work.join("src")).unwrap();
    fs::write(work.join("src/lib.rs"), lib_rs(41)).unwrap();
    git(&work, &["init", "-q", "-b", "main"]);
    git(&work, &["add", "-A"]);
    git(&work, &["commit", "-q", "-m", "base"]);
    fs::write(work.join("src/lib.rs"), lib_rs(41).replace("    7\n", "    8\n")).unwrap();
    git(&work, &["commit", "-q", "-am", "Make helper return 8"]);
    format!("{}\n", git(&work, &["format-patch", "-1", "--stdout", "--full-index"])).into_bytes()
}

#[test]
fn crate_sources_lock_fetch_and_bump_through_cargo() {
    let tmp = tempfile::tempdir().unwrap();
    let reg = registry(tmp.path());
    let project = Project::new(tmp.path().join("project"));
    project.write_file("patches/fixcrate/0001-helper.patch", &helper_patch(tmp.path()));
    project.write_manifest(
        "[sources.fixcrate]\ncrate = \"fixcrate\"\nversion = \"0.1.0\"\npatches = [\"patches/fixcrate/0001-helper.patch\"]\n",
    );
    let home = reg.cargo_home.to_str().unwrap();
    let a = Machine::new(&tmp.path().join("a")).with_env("CARGO_HOME", home);
    let root = &project.root;

    a.run(root, &["lock"]).ok();
    let lock = project.lock();
    assert!(lock.contains("kind = \"crate\"\ncrate = \"fixcrate\"\nversion = \"0.1.0\""), "{lock}");
    assert!(lock.contains(&format!("checksum = \"{}\"", reg.checksums[0].1)), "{lock}");

    // Another machine (other HOME, cache and git dates) gets the same bytes.
    let b = Machine::new(&tmp.path().join("b"))
        .with_env("CARGO_HOME", home)
        .with_env("GIT_COMMITTER_DATE", "1234567890 +0200");
    fs::remove_file(project.lock_path()).unwrap();
    b.run(root, &["lock"]).ok();
    assert_eq!(project.lock(), lock);

    let run = a.run(root, &["fetch", "--out", "vendor"]).ok();
    assert!(run.stdout.starts_with("fixcrate\t"));
    let src = fs::read_to_string(root.join("vendor/fixcrate/src/lib.rs")).unwrap();
    assert!(src.contains("    41\n") && src.contains("    8\n"), "{src}");
    assert!(root.join("vendor/fixcrate/Cargo.toml.orig").exists());
    assert_eq!(
        fs::read_to_string(root.join("vendor/fixcrate/notes.log")).unwrap(),
        "kept\n",
        "every file of the crate is imported"
    );
    assert!(!root.join("vendor/fixcrate/.cargo-checksum.json").exists());

    // A workspace that depends on the crate exactly: its Cargo.toml and Cargo.lock are pins too.
    project.write_file("Cargo.toml", b"[workspace]\nmembers = [\"app\"]\nresolver = \"2\"\n");
    let app = "[package]\nname = \"app\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[dependencies]\nfixcrate = { version = \"=0.1.0\" }\n";
    project.write_file("app/Cargo.toml", app.as_bytes());
    project.write_file("app/src/lib.rs", b"");
    let out = Command::new("cargo")
        .args(["generate-lockfile", "--quiet"])
        .env("CARGO_HOME", home)
        .current_dir(root)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    a.run(root, &["sources"]).ok();

    // Bump follows the newest release and carries the patch over, and moves the workspace's
    // exact requirement and Cargo.lock with the manifest.
    let run = a.run(root, &["bump"]).ok();
    assert_eq!(run.stdout, "fixcrate\t0.1.0 -> 0.2.0\n");
    assert!(project.manifest().contains("version = \"0.2.0\""));
    assert!(project.lock().contains(&format!("checksum = \"{}\"", reg.checksums[1].1)));
    let app_toml = fs::read_to_string(root.join("app/Cargo.toml")).unwrap();
    assert!(app_toml.contains("fixcrate = { version = \"=0.2.0\" }"), "{app_toml}");
    let cargo_lock = fs::read_to_string(root.join("Cargo.lock")).unwrap();
    assert!(cargo_lock.contains("name = \"fixcrate\"\nversion = \"0.2.0\""), "{cargo_lock}");
    a.run(root, &["sources"]).ok();

    // Pins that disagree are refused in one line naming the file and line.
    project.write_file("app/Cargo.toml", app.replace("=0.1.0", "=0.2.1").as_bytes());
    let run = a.run(root, &["sources"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.error_line().contains("app/Cargo.toml:7: requires fixcrate `=0.2.1`"), "{}", run.stderr);
    project.write_file("app/Cargo.toml", app.replace("=0.1.0", "=0.2.0").as_bytes());
    fs::write(root.join("Cargo.lock"), cargo_lock.replace("version = \"0.2.0\"", "version = \"0.1.0\"")).unwrap();
    let run = a.run(root, &["sources"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.error_line().contains("Cargo.lock has fixcrate 0.1.0"), "{}", run.stderr);
    fs::write(root.join("Cargo.lock"), &cargo_lock).unwrap();
    let run = a.run(root, &["fetch", "--out", "vendor"]).ok();
    assert!(run.stdout.starts_with("fixcrate\t"));
    let src = fs::read_to_string(root.join("vendor/fixcrate/src/lib.rs")).unwrap();
    assert!(src.contains("    42\n") && src.contains("    8\n"), "{src}");

    // A version the registry does not have is bad input, named in one line.
    project.write_manifest("[sources.fixcrate]\ncrate = \"fixcrate\"\nversion = \"9.9.9\"\npatches = []\n");
    let run = a.run(root, &["lock"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.error_line().contains("fixcrate"), "{}", run.stderr);
}

/// The project's real manifest pins `cudarc` from the real registry: fetching it (network) must
/// reproduce exactly the tree the committed lock records.
#[test]
fn the_projects_cudarc_pin_matches_its_lock() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let m = Machine::new(tmp.path());
    let mut m = m;
    // Keep the user's Cargo home (its download cache), as a real run would.
    if let Some(home) = std::env::var_os("CARGO_HOME") {
        m = m.with_env("CARGO_HOME", home.to_str().unwrap());
    } else if let Some(home) = std::env::var_os("HOME") {
        m = m.with_env("CARGO_HOME", Path::new(&home).join(".cargo").to_str().unwrap());
    }
    let run = m.run(root, &["sources"]).ok();
    let cudarc = run.stdout.lines().find(|l| l.starts_with("cudarc ")).expect("cudarc is pinned");
    assert!(cudarc.ends_with("current"), "{}", run.stdout);
    let run = m.run(root, &["fetch", "cudarc"]).ok();
    let lock = fs::read_to_string(root.join("images/manifest.lock")).unwrap();
    let tree = run.stdout.split('\t').nth(1).unwrap();
    assert!(lock.contains(&format!("tree = \"{tree}\"")), "{tree} not in the lock");
    let dir = PathBuf::from(run.stdout.trim_end().split('\t').nth(2).unwrap());
    assert!(dir.join("Cargo.toml").exists() && dir.join("src/lib.rs").exists());
}

/// A carried patch of a crate source reaches the binary `distro build` puts in the image: the
/// same workspace built without and with `patches/fixcrate/0001-helper.patch` (helper 7 -> 8)
/// prints what the patched crate returns. Offline: the crate comes from the test's local
/// registry, and the base (one empty layer) is put in the build's blob store beforehand, so it
/// is read by digest without a request.
#[test]
fn a_carried_crate_patch_changes_what_the_built_binary_prints() {
    use distro::image::layer::LayerSpec;
    use distro::oci::manifest::{Descriptor, OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, image_manifest};
    use distro::oci::store::BlobStore;
    use std::io::Read;

    let tmp = tempfile::tempdir().unwrap();
    let reg = registry(tmp.path());
    let project = Project::new(tmp.path().join("project"));
    let root = &project.root;
    project.write_file("patches/fixcrate/0001-helper.patch", &helper_patch(tmp.path()));
    project.write_file("Cargo.toml", b"[workspace]\nmembers = [\"app\"]\nresolver = \"2\"\n");
    project.write_file(
        "app/Cargo.toml",
        b"[package]\nname = \"app\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[dependencies]\nfixcrate = { version = \"=0.1.0\" }\n",
    );
    project.write_file(
        "app/src/main.rs",
        b"fn main() {\n    println!(\"answer {} helper {}\", fixcrate::answer(), fixcrate::helper());\n}\n",
    );
    let host = distro::oci::platform::Platform::host().expect("a supported host");
    project.write_file(
        "images/app.toml",
        format!(
            "name = \"app\"\ndescription = \"patch test\"\nplatforms = [\"linux/{}\"]\nbase = \"127.0.0.1:9/base:none\"\ncmd = [\"/usr/local/bin/app\"]\n\n[[binary]]\npackage = \"app\"\ndest = \"/usr/local/bin/app\"\n",
            host.architecture
        )
        .as_bytes(),
    );
    let home = reg.cargo_home.to_str().unwrap();
    let out = Command::new("cargo")
        .args(["generate-lockfile", "--quiet"])
        .env("CARGO_HOME", home)
        .current_dir(root)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // The base: one empty layer and a config for this machine, already in the blob store.
    let build_dir = tmp.path().join("build");
    let store = BlobStore::new(build_dir.join("store"));
    let (layer, gz) = LayerSpec::new().build(0).unwrap();
    store.put(&gz).unwrap();
    let config = format!(
        "{{\"architecture\":\"{}\",\"os\":\"linux\",\"config\":{{}},\"rootfs\":{{\"type\":\"layers\",\"diff_ids\":[\"{}\"]}}}}",
        host.architecture, layer.diff_id
    );
    store.put(config.as_bytes()).unwrap();
    let layer_desc = Descriptor {
        media_type: OCI_LAYER_GZIP.into(),
        digest: layer.digest.clone(),
        size: layer.size,
        platform: None,
        annotations: None,
    };
    let manifest = image_manifest(
        &Descriptor::of(OCI_CONFIG, config.as_bytes()),
        &[layer_desc],
        &std::collections::BTreeMap::new(),
    )
    .unwrap();
    store.put(&manifest).unwrap();
    let base = format!("127.0.0.1:9/base@{}", Descriptor::of(OCI_MANIFEST, &manifest).digest);

    let m = Machine::new(&tmp.path().join("m"))
        .with_env("CARGO_HOME", home)
        .with_env("DISTRO_TARGET_DIR", build_dir.to_str().unwrap());
    // Builds the committed workspace into a layout and runs the binary found in its layers.
    let build_and_run = |patches: &str, out: &str| -> String {
        project.write_manifest(&format!(
            "[sources.fixcrate]\ncrate = \"fixcrate\"\nversion = \"0.1.0\"\npatches = [{patches}]\n"
        ));
        m.run(root, &["lock"]).ok();
        if !root.join(".git").exists() {
            git(root, &["init", "-q", "-b", "main"]);
        }
        git(root, &["add", "-A"]);
        git(root, &["commit", "-q", "--allow-empty", "-m", out]);
        let layout = tmp.path().join(out);
        m.run(
            root,
            &["build", "--image", "app", "--base", &base, "--date", "2026-01-01", "--output", layout.to_str().unwrap()],
        )
        .ok();
        for blob in fs::read_dir(layout.join("blobs/sha256")).unwrap() {
            let Ok(bytes) = fs::read(blob.unwrap().path()) else { continue };
            let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(bytes.as_slice()));
            let Ok(entries) = archive.entries() else { continue };
            for mut e in entries.filter_map(Result::ok) {
                if e.path().is_ok_and(|p| p.to_str() == Some("usr/local/bin/app")) {
                    let mut exe = Vec::new();
                    e.read_to_end(&mut exe).unwrap();
                    let path = tmp.path().join(format!("{out}-app"));
                    fs::write(&path, exe).unwrap();
                    use std::os::unix::fs::PermissionsExt;
                    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
                    let run = Command::new(&path).output().unwrap();
                    return String::from_utf8_lossy(&run.stdout).trim().to_string();
                }
            }
        }
        panic!("no layer of {} holds usr/local/bin/app", layout.display())
    };
    assert_eq!(build_and_run("", "unpatched"), "answer 41 helper 7");
    assert_eq!(build_and_run("\"patches/fixcrate/0001-helper.patch\"", "patched"), "answer 41 helper 8");
}
