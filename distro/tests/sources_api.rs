//! The library API the image build (`distro build --source ... --patch ...`) calls: a run's lock
//! with overrides and extra patches, recorded as such, and its materialised trees.

mod common;

use common::*;
use distro::sources::{Cache, Lock, Manifest, Origin, Overrides, lock_for_run, materialise};
use std::fs;

#[test]
fn extra_patches_for_one_build_are_recorded_in_that_builds_lock() {
    let tmp = tempfile::tempdir().unwrap();
    let up = Upstream::new(tmp.path().join("upstream"));
    let pin = up.head();
    let project = Project::new(tmp.path().join("project"));
    project.write_file("patches/foo/0001-a.patch", &up.patch_setting_line(&pin, 2, "line 2 (a)", "A"));
    project.write_manifest(&git_source("foo", &up.url(), &pin, &["patches/foo/0001-a.patch"]));
    // A build-only patch kept outside the project, and a PR only this build wants.
    let outside = tmp.path().join("try-this.patch");
    fs::write(&outside, up.patch_setting_line(&pin, 9, "line 9 (try)", "Try")).unwrap();
    up.git(&["checkout", "-q", "-b", "pr", &pin]);
    up.change_line(12, "line 12 (PR)", "PR");
    up.git(&["update-ref", "refs/pull/5/head", "HEAD"]);
    up.git(&["checkout", "-q", "main"]);

    let cache = Cache::at(tmp.path().join("cache"));
    let manifest = Manifest::load(&project.manifest_path()).unwrap();
    let record = distro::sources::resolve(&manifest, &[], &Overrides::default(), &cache).unwrap();
    fs::write(project.lock_path(), record.render()).unwrap();
    let lock = Lock::load(&project.lock_path()).unwrap().unwrap();

    let overrides = Overrides {
        sources: vec![],
        extra_patches: vec![
            format!("foo={}", outside.display()).parse().unwrap(),
            "pull/5/head".parse().unwrap(), // the only source: inferred
        ],
    };
    let build = lock_for_run(&manifest, Some(&lock), &[], &overrides, &cache).unwrap();
    let foo = &build.sources["foo"];
    assert!(matches!(&foo.origin, Origin::Git { commit, .. } if commit == &pin));
    let entries: Vec<(&str, bool, bool)> =
        foo.patches.iter().map(|p| (p.entry.as_str(), p.extra, p.file.is_some())).collect();
    assert_eq!(
        entries,
        vec![
            ("patches/foo/0001-a.patch", false, true),
            (outside.to_str().unwrap(), true, false),
            ("pull/5/head", true, false)
        ]
    );
    assert_ne!(foo.tree, lock.sources["foo"].tree);
    // The lock of record is unchanged, and the build lock renders and parses back.
    assert_eq!(Lock::load(&project.lock_path()).unwrap().unwrap(), lock);
    assert_eq!(Lock::parse(&build.render()).unwrap(), build);

    // The extra patches were kept in the cache: the build materialises without them on disk.
    fs::remove_file(&outside).unwrap();
    let trees = materialise(&build, &manifest.root, &cache).unwrap();
    let text = fs::read_to_string(trees[0].dir.join("lib.txt")).unwrap();
    for line in ["line 2 (a)", "line 9 (try)", "line 12 (PR)"] {
        assert!(text.contains(line), "{line} missing:\n{text}");
    }
    assert_eq!(trees[0].tree, foo.tree);

    // Without overrides the run's lock is the lock of record itself.
    let plain = lock_for_run(&manifest, Some(&lock), &[], &Overrides::default(), &cache).unwrap();
    assert_eq!(plain, lock);
}

#[test]
fn materialise_rejects_a_lock_that_does_not_match_its_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let up = Upstream::new(tmp.path().join("upstream"));
    let pin = up.head();
    let project = Project::new(tmp.path().join("project"));
    project.write_file("patches/foo/0001-a.patch", &up.patch_setting_line(&pin, 2, "line 2 (a)", "A"));
    project.write_manifest(&git_source("foo", &up.url(), &pin, &["patches/foo/0001-a.patch"]));
    let cache = Cache::at(tmp.path().join("cache"));
    let manifest = Manifest::load(&project.manifest_path()).unwrap();
    let mut lock = distro::sources::resolve(&manifest, &[], &Overrides::default(), &cache).unwrap();
    let real = lock.sources["foo"].tree.clone();
    lock.sources.get_mut("foo").unwrap().tree = "0".repeat(40);
    let err = materialise(&lock, &manifest.root, &cache).unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains(&format!("gives tree {real}")) && msg.contains("the lock records tree 0000"), "{msg}");

    // A cached tree someone modified is detected and checked out again.
    lock.sources.get_mut("foo").unwrap().tree = real;
    let trees = materialise(&lock, &manifest.root, &cache).unwrap();
    fs::write(trees[0].dir.join("lib.txt"), "tampered").unwrap();
    let trees = materialise(&lock, &manifest.root, &cache).unwrap();
    assert!(fs::read_to_string(trees[0].dir.join("lib.txt")).unwrap().contains("line 2 (a)"));
}
