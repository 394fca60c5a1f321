//! End-to-end tests of `distro sources`, `lock`, `fetch`, `bump` and `patches refresh` on git
//! sources, with upstream repositories made by the tests (real git).

mod common;

use common::*;
use std::fs;
use std::path::Path;

/// An upstream, a project pinning it with two patches (the second builds on the first), and a
/// machine to run distro on.
struct Fixture {
    _tmp: tempfile::TempDir,
    up: Upstream,
    project: Project,
    machine: Machine,
    pin: String,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let up = Upstream::new(tmp.path().join("upstream"));
    let pin = up.head();
    let project = Project::new(tmp.path().join("project"));
    // 0001 rewrites line 3; 0002 rewrites it again, so it applies only after 0001.
    let p1 = up.patch_setting_line(&pin, 3, "line 3 (first)", "First fix");
    up.git(&["checkout", "-q", "-b", "stack", &pin]);
    up.change_line(3, "line 3 (first)", "First fix");
    let on_first = up.head();
    up.git(&["checkout", "-q", "main"]);
    let p2 = up.patch_setting_line(&on_first, 3, "line 3 (second)", "Second fix");
    project.write_file("patches/foo/0001-first.patch", &p1);
    project.write_file("patches/foo/0002-second.patch", &p2);
    project.write_manifest(&git_source(
        "foo",
        &up.url(),
        &pin,
        &["patches/foo/0001-first.patch", "patches/foo/0002-second.patch"],
    ));
    let machine = Machine::new(&tmp.path().join("machine"));
    Fixture { _tmp: tmp, up, project, machine, pin }
}

#[test]
fn patches_apply_in_order_and_fetch_verifies_the_lock() {
    let f = fixture();
    let root = &f.project.root;
    let run = f.machine.run(root, &["sources"]).ok();
    assert!(run.stdout.contains("missing"), "{}", run.stdout);

    let run = f.machine.run(root, &["lock"]).ok();
    let lock = f.project.lock();
    assert!(lock.contains(&format!("commit = \"{}\"", f.pin)), "{lock}");
    assert!(lock.contains("entry = \"patches/foo/0001-first.patch\""));
    assert!(lock.find("0001-first").unwrap() < lock.find("0002-second").unwrap());
    let tree = run.stdout.split('\t').nth(1).unwrap().trim().to_owned();
    assert!(lock.contains(&format!("tree = \"{tree}\"")));

    let run = f.machine.run(root, &["sources"]).ok();
    assert!(run.stdout.lines().nth(1).unwrap().ends_with("2        current"), "{}", run.stdout);

    let run = f.machine.run(root, &["fetch", "--out", "vendor"]).ok();
    assert_eq!(run.stdout.trim(), format!("foo\t{tree}\t{}", Path::new("vendor/foo").display()));
    let fetched = fs::read_to_string(root.join("vendor/foo/lib.txt")).unwrap();
    assert!(fetched.contains("line 3 (second)\n") && !fetched.contains("line 3\n"));
    // A second fetch finds the cached tree and the unmodified copy.
    f.machine.run(root, &["fetch", "--out", "vendor"]).ok();
    // A copy the user edited is never overwritten.
    fs::write(root.join("vendor/foo/lib.txt"), "mine").unwrap();
    let run = f.machine.run(root, &["fetch", "--out", "vendor"]);
    assert_eq!(run.code, 2);
    assert!(run.error_line().contains("has local changes"), "{}", run.stderr);

    // The patched commit was made by the fixed identity, on top of the pin.
    let repos = fs::read_dir(f.machine.cache.join("repos")).unwrap();
    let repo = repos.map(|e| e.unwrap().path()).find(|p| p.is_dir()).unwrap();
    let log = git(&repo, &["log", "--format=%s|%an|%cn|%cd", "--date=raw", "-3", "HEAD"]);
    assert_eq!(
        log,
        "Second fix|Up Stream|distro|946684800 +0000\nFirst fix|Up Stream|distro|946684800 +0000\nInitial import|Up Stream|Up Stream|1700000000 +0000"
    );

    // The same patches in the other order do not apply: the lock is not touched.
    let before = f.project.lock();
    f.project.write_manifest(&git_source(
        "foo",
        &f.up.url(),
        &f.pin,
        &["patches/foo/0002-second.patch", "patches/foo/0001-first.patch"],
    ));
    let run = f.machine.run(root, &["lock"]);
    assert_eq!(run.code, 1);
    assert!(run.error_line().contains("patches/foo/0002-second.patch"), "{}", run.stderr);
    assert_eq!(f.project.lock(), before);
    let run = f.machine.run(root, &["sources"]).ok();
    assert!(run.stdout.contains("stale"), "{}", run.stdout);
}

#[test]
fn a_conflicting_patch_is_reported_and_nothing_is_written() {
    // Two sources. In `foo`, upstream merges one patch and rewrites the lines another patches;
    // `bar` moves on and its patch still applies.
    let f = fixture();
    let root = &f.project.root;
    let p0 = f.up.patch_setting_line(&f.pin, 15, "line 15 (fixed)", "Fix line 15");
    f.project.write_file("patches/foo/0000-line15.patch", &p0);
    let bar = Upstream::new(f.up.dir.parent().unwrap().join("bar"));
    let bar_pin = bar.head();
    let pb = bar.patch_setting_line(&bar_pin, 1, "bar line 1", "Bar fix");
    f.project.write_file("patches/bar/0001-bar.patch", &pb);
    f.project.write_manifest(&format!(
        "{}\n{}",
        git_source("bar", &bar.url(), &bar_pin, &["patches/bar/0001-bar.patch"]),
        git_source(
            "foo",
            &f.up.url(),
            &f.pin,
            &["patches/foo/0000-line15.patch", "patches/foo/0001-first.patch", "patches/foo/0002-second.patch"],
        )
    ));
    f.machine.run(root, &["lock"]).ok();
    f.up.change_line(15, "line 15 (fixed)", "Upstream takes the line-15 fix");
    let tip = f.up.change_line(3, "line 3 rewritten upstream", "Upstream rewrite");
    bar.change_line(20, "bar line 20", "Bar upstream work");
    let (manifest, lock) = (f.project.manifest(), f.project.lock());

    let run = f.machine.run(root, &["bump"]);
    assert_eq!(run.code, 1, "{}", run.stderr);
    for needle in [
        "conflict in source `foo`",
        "patch:    patches/foo/0001-first.patch",
        &format!("upstream: {tip} (the tip of `main`)"),
        "commit:   1/1 \"First fix\"",
        "lib.txt: ",
        "hunk #1 @@ -1,6 +1,6 @@ failed",
        "merged:   patches/foo/0000-line15.patch is already upstream (would be dropped)",
    ] {
        assert!(run.stderr.contains(needle), "stderr lacks {needle:?}:\n{}", run.stderr);
    }
    assert!(!run.stderr.contains("conflict in source `bar`"), "{}", run.stderr);
    let line = run.error_line();
    assert!(
        line.contains("1 patch no longer applies; nothing was written")
            && line.contains("patches/foo/0001-first.patch")
            && line.contains(&tip)
            && line.contains("lib.txt"),
        "{line}"
    );
    assert_eq!(run.stdout, "");
    assert_eq!(f.project.manifest(), manifest);
    assert_eq!(f.project.lock(), lock);
}

#[test]
fn a_patch_merged_upstream_is_dropped_on_bump() {
    let f = fixture();
    let root = &f.project.root;
    // A second, independent patch on line 15 that upstream merges (as its own commit).
    let p3 = f.up.patch_setting_line(&f.pin, 15, "line 15 (fixed)", "Fix line 15");
    f.project.write_file("patches/foo/0003-line15.patch", &p3);
    f.project.write_manifest(&format!(
        "# Upstreams of the engine.\n{}",
        git_source(
            "foo",
            &f.up.url(),
            &f.pin,
            &["patches/foo/0001-first.patch", "patches/foo/0002-second.patch", "patches/foo/0003-line15.patch"],
        )
    ));
    f.machine.run(root, &["lock"]).ok();
    f.up.change_line(15, "line 15 (fixed)", "Apply the line-15 fix (reworded by the maintainer)");
    f.up.write("other.txt", "unrelated\n");
    let tip = f.up.commit("Unrelated upstream work");

    let run = f.machine.run(root, &["bump", "--dry-run"]).ok();
    assert!(run.stdout.contains("dropped patches/foo/0003-line15.patch (merged upstream)"), "{}", run.stdout);
    assert!(!f.project.manifest().contains(&tip), "--dry-run wrote the manifest");

    let run = f.machine.run(root, &["bump"]).ok();
    assert!(run.stdout.contains(&format!("foo\t{} -> {tip}", f.pin)), "{}", run.stdout);
    assert!(run.stdout.contains("dropped patches/foo/0003-line15.patch (merged upstream)"), "{}", run.stdout);
    let manifest = f.project.manifest();
    assert!(manifest.starts_with("# Upstreams of the engine.\n"), "comments must survive: {manifest}");
    assert!(manifest.contains(&format!("commit = \"{tip}\"")));
    assert!(!manifest.contains("0003-line15") && manifest.contains("0002-second"), "{manifest}");
    let lock = f.project.lock();
    assert!(!lock.contains("0003-line15") && lock.contains(&format!("commit = \"{tip}\"")), "{lock}");
    // The file is left for the maintainer to delete.
    assert!(root.join("patches/foo/0003-line15.patch").exists());
    assert!(run.stderr.contains("git rm patches/foo/0003-line15.patch"), "{}", run.stderr);

    let run = f.machine.run(root, &["fetch", "--out", "out"]).ok();
    assert!(run.stdout.starts_with("foo\t"));
    let text = fs::read_to_string(root.join("out/foo/lib.txt")).unwrap();
    assert!(text.contains("line 3 (second)") && text.contains("line 15 (fixed)"));
    assert!(root.join("out/foo/other.txt").exists());
}

#[test]
fn bump_with_nothing_new_changes_nothing() {
    let f = fixture();
    let root = &f.project.root;
    f.machine.run(root, &["bump"]).ok(); // writes the lock (pin already at the tip)
    let (manifest, lock) = (f.project.manifest(), f.project.lock());
    let mtimes = |p: &Project| {
        (
            fs::metadata(p.manifest_path()).unwrap().modified().unwrap(),
            fs::metadata(p.lock_path()).unwrap().modified().unwrap(),
        )
    };
    let before = mtimes(&f.project);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let run = f.machine.run(root, &["bump"]).ok();
    assert_eq!(run.stdout, "");
    assert!(run.stderr.contains("unchanged"), "{}", run.stderr);
    assert_eq!(f.project.manifest(), manifest);
    assert_eq!(f.project.lock(), lock);
    assert_eq!(mtimes(&f.project), before, "files were rewritten");

    // With something new, --dry-run reports it and still writes nothing.
    let tip = f.up.change_line(19, "line 19 upstream", "More upstream work");
    let run = f.machine.run(root, &["bump", "--dry-run"]).ok();
    assert!(run.stdout.contains(&format!("-> {tip}")), "{}", run.stdout);
    assert_eq!((f.project.manifest(), f.project.lock()), (manifest, lock));
}

#[test]
fn the_lock_is_byte_identical_across_machines_directories_and_times() {
    let tmp = tempfile::tempdir().unwrap();
    let up = Upstream::new(tmp.path().join("upstream"));
    let pin = up.head();
    let patch = up.patch_setting_line(&pin, 7, "line 7 patched", "Patch line 7");
    let make = |dir: &str| {
        let p = Project::new(tmp.path().join(dir).join("checkout"));
        p.write_file("patches/foo/0001-seven.patch", &patch);
        p.write_manifest(&git_source("foo", &format!("file://{}", up.url()), &pin, &["patches/foo/0001-seven.patch"]));
        p
    };
    let (a, b) = (make("a"), make("b/deeper"));
    let ma = Machine::new(&tmp.path().join("machine-a"))
        .with_env("GIT_AUTHOR_DATE", "1111111111 +0100")
        .with_env("GIT_COMMITTER_DATE", "1111111111 +0100")
        .with_env("GIT_COMMITTER_NAME", "Someone")
        .with_env("TZ", "Asia/Tokyo");
    let mb = Machine::new(&tmp.path().join("machine-b"))
        .with_env("GIT_AUTHOR_DATE", "1600000000 -0700")
        .with_env("GIT_COMMITTER_DATE", "1600000000 -0700")
        .with_env("GIT_COMMITTER_EMAIL", "other@example.invalid")
        .with_env("TZ", "America/Denver");
    // Machine B's user has a global git config that would change line endings and prefixes.
    fs::write(mb.home.join(".gitconfig"), "[core]\n\tautocrlf = true\n[diff]\n\tnoprefix = true\n[user]\n\tname = B\n")
        .unwrap();
    ma.run(&a.root, &["lock"]).ok();
    // Machine B runs from elsewhere, naming the manifest.
    let manifest_b = b.manifest_path();
    mb.run(tmp.path(), &["lock", "--manifest", manifest_b.to_str().unwrap()]).ok();
    let (la, lb) = (a.lock(), b.lock());
    assert_eq!(la, lb);
    // Had the callers' git dates or identities leaked into the patched commit, `head` would
    // differ between the two machines.
    assert!(la.contains("head = "), "{la}");
    // The only path in the lock is the upstream URL, as the manifest writes it.
    let tmp_str = tmp.path().to_str().unwrap();
    for line in la.lines().filter(|l| l.contains(tmp_str)) {
        assert!(line.starts_with("url = \"file://"), "a path leaked into the lock: {line}");
    }
    // And the fetched trees are the same too.
    let ra = ma.run(&a.root, &["fetch"]).ok();
    let rb = mb.run(&b.root, &["fetch"]).ok();
    let tree = |r: &Run| r.stdout.split('\t').nth(1).unwrap().to_owned();
    assert_eq!(tree(&ra), tree(&rb));
}

#[test]
fn source_override_and_extra_patches_apply_for_one_run() {
    let f = fixture();
    let root = &f.project.root;
    f.machine.run(root, &["lock"]).ok();
    let lock_before = f.project.lock();
    // A fork with a feature branch.
    let fork_dir = f.up.dir.parent().unwrap().join("fork");
    git(f.up.dir.parent().unwrap(), &["clone", "-q", f.up.dir.to_str().unwrap(), fork_dir.to_str().unwrap()]);
    let fork = Upstream { dir: fork_dir };
    fork.git(&["checkout", "-q", "-b", "feature"]);
    fork.write("feature.txt", "from the fork\n");
    let feature = fork.commit("Fork feature");
    let extra = f.up.patch_setting_line(&f.pin, 10, "line 10 (extra)", "Extra for one build");
    fs::write(root.join("extra.patch"), &extra).unwrap();

    let spec = format!("foo={}#feature", fork.url());
    let run = f
        .machine
        .run(root, &["fetch", "--source", &spec, "--patch", "foo=extra.patch", "--out", "o", "--lock-out", "run.lock"])
        .ok();
    assert!(run.stderr.contains("overridden for this run"), "{}", run.stderr);
    let lib = fs::read_to_string(root.join("o/foo/lib.txt")).unwrap();
    assert!(lib.contains("line 3 (second)") && lib.contains("line 10 (extra)"), "{lib}");
    assert_eq!(fs::read_to_string(root.join("o/foo/feature.txt")).unwrap(), "from the fork\n");
    let run_lock = fs::read_to_string(root.join("run.lock")).unwrap();
    assert!(run_lock.contains(&format!("commit = \"{feature}\"")), "{run_lock}");
    assert!(run_lock.contains("ref = \"feature\"") && run_lock.contains("overridden = true"));
    assert!(
        run_lock.contains("entry = \"extra.patch\"\nfile = \"extra.patch\"\nsha256 = ")
            && run_lock.contains("extra = true"),
        "{run_lock}"
    );
    // The project's own lock and manifest are untouched, and still current.
    assert_eq!(f.project.lock(), lock_before);
    let run = f.machine.run(root, &["sources"]).ok();
    assert!(run.stdout.contains("current"));

    // A bad override is bad input.
    let run = f.machine.run(root, &["fetch", "--source", "nope=/x#main"]);
    assert_eq!(run.code, 2);
    assert!(run.error_line().contains("no source named `nope`"), "{}", run.stderr);
}

#[test]
fn malformed_manifests_and_bad_inputs_are_one_line_errors() {
    let f = fixture();
    let root = &f.project.root;
    let good = f.project.manifest();
    let cases: Vec<(String, &str)> = vec![
        (good.replace("tracking_ref = \"main\"", "tracking_ref = main"), "images/manifest.toml:3:16: "),
        (format!("{good}branch = \"dev\"\n"), "images/manifest.toml:6:1: unknown field `branch`"),
        (good.replace(&f.pin, "abc123"), "images/manifest.toml:4:10: `commit` must be a full commit id"),
        (
            good.replace("0002-second.patch", "0009-gone.patch"),
            "images/manifest.toml:5:44: patch file patches/foo/0009-gone.patch does not exist",
        ),
        (good.replace(&f.pin, &"0".repeat(40)), "does not exist at "),
    ];
    for (text, expected) in cases {
        f.project.write_manifest(&text);
        let run = f.machine.run(root, &["lock"]);
        assert_eq!(run.code, 2, "{expected}: {}", run.stderr);
        let line = run.error_line();
        assert!(line.contains(expected), "expected {expected:?} in {line:?}");
    }
    // The missing commit is named in one line with its manifest position.
    let run = f.machine.run(root, &["lock"]);
    assert!(
        run.error_line().contains(&format!("images/manifest.toml:4:10: commit {} does not exist", "0".repeat(40))),
        "{}",
        run.stderr
    );
    // No manifest at all, and unknown source names.
    let run = f.machine.run(f.up.dir.as_path(), &["sources"]);
    assert_eq!(run.code, 2);
    assert!(run.error_line().contains("manifest images/manifest.toml not found"));
    f.project.write_manifest(&good);
    let run = f.machine.run(root, &["fetch", "bar"]);
    assert_eq!(run.code, 2);
    assert!(run.error_line().contains("no source named `bar`"), "{}", run.stderr);
    let run = f.machine.run(root, &["fetch"]);
    assert_eq!(run.code, 2);
    assert!(run.error_line().contains("run `distro lock`"), "{}", run.stderr);
}

#[test]
fn a_repository_left_mid_am_is_recovered() {
    let f = fixture();
    let root = &f.project.root;
    f.machine.run(root, &["lock"]).ok();
    let lock = f.project.lock();
    // Simulate a crash in the middle of `git am`: stop am on a patch that cannot apply.
    let repo =
        fs::read_dir(f.machine.cache.join("repos")).unwrap().map(|e| e.unwrap().path()).find(|p| p.is_dir()).unwrap();
    let bad = f.up.patch_setting_line(&f.pin, 3, "x", "Never applies");
    let bad = String::from_utf8(bad).unwrap().replace("-line 3\n", "-no such line\n");
    fs::write(f.project.root.join("bad.patch"), bad).unwrap();
    let out = std::process::Command::new("git")
        .current_dir(&repo)
        .args(["-c", "user.name=x", "-c", "user.email=x@y", "am", f.project.root.join("bad.patch").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(repo.join(".git/rebase-apply").exists());
    fs::write(repo.join("lib.txt"), "half-applied junk\n").unwrap();

    let run = f.machine.run(root, &["lock"]).ok();
    assert!(run.stderr.contains("left in the middle of `git am`"), "{}", run.stderr);
    assert!(!repo.join(".git/rebase-apply").exists());
    assert_eq!(f.project.lock(), lock);
}

#[test]
fn pull_refs_are_exported_by_patches_refresh_and_dropped_once_merged() {
    let tmp = tempfile::tempdir().unwrap();
    let up = Upstream::new(tmp.path().join("upstream"));
    let pin = up.head();
    // A pull request with two commits, published as refs/pull/123/head.
    up.git(&["checkout", "-q", "-b", "pr", &pin]);
    up.change_line(5, "line 5 (PR)", "PR part 1");
    up.write("added.txt", "new file from the PR\n");
    let pr_head = up.commit("PR part 2");
    up.git(&["checkout", "-q", "main"]);
    up.git(&["update-ref", "refs/pull/123/head", &pr_head]);
    let project = Project::new(tmp.path().join("project"));
    project.write_manifest(&git_source("foo", &up.url(), &pin, &["pull/123/head"]));
    let m = Machine::new(&tmp.path().join("machine"));
    let root = &project.root;

    // Builds never fetch patches: the ref must be exported first.
    let run = m.run(root, &["lock"]);
    assert_eq!(run.code, 2);
    assert!(run.error_line().contains("run `distro patches refresh foo`"), "{}", run.stderr);

    let run = m.run(root, &["patches", "refresh"]).ok();
    assert_eq!(run.stdout, "new\tfoo\tpull/123/head\tpatches/foo/PR-123.patch\n");
    let exported = fs::read_to_string(root.join("patches/foo/PR-123.patch")).unwrap();
    assert!(exported.contains("Subject: [PATCH 1/2] PR part 1") && exported.contains("Subject: [PATCH 2/2] PR part 2"));
    assert!(exported.contains(&format!("From {pr_head} ")));
    let run = m.run(root, &["patches", "refresh", "foo"]).ok();
    assert_eq!(run.stdout, "unchanged\tfoo\tpull/123/head\tpatches/foo/PR-123.patch\n");

    // The PR gets another commit, reworking its own first change: refresh reports it.
    up.git(&["checkout", "-q", "pr"]);
    up.change_line(5, "line 5 (PR, reworked)", "PR part 3");
    up.git(&["update-ref", "refs/pull/123/head", "HEAD"]);
    up.git(&["checkout", "-q", "main"]);
    let run = m.run(root, &["patches", "refresh"]).ok();
    assert!(run.stdout.starts_with("changed\tfoo\tpull/123/head"), "{}", run.stdout);

    let run = m.run(root, &["lock"]).ok();
    assert!(run.stdout.starts_with("foo\t"));
    assert!(project.lock().contains("entry = \"pull/123/head\"\nfile = \"patches/foo/PR-123.patch\""));
    m.run(root, &["fetch", "--out", "o"]).ok();
    assert_eq!(fs::read_to_string(root.join("o/foo/added.txt")).unwrap(), "new file from the PR\n");

    // Upstream squash-merges the PR. Replaying its commits one by one would conflict (part 1's
    // line 5 against the squashed final line 5); bump sees that the PR's combined change is
    // already upstream and drops the patch.
    up.git(&["merge", "-q", "--squash", "pr"]);
    let tip = up.commit("Squash-merge PR #123");
    let run = m.run(root, &["bump"]).ok();
    assert!(run.stdout.contains("dropped pull/123/head (merged upstream)"), "{}", run.stdout);
    assert!(project.manifest().contains("patches = []") && project.manifest().contains(&tip));
    let run = m.run(root, &["patches", "refresh"]).ok();
    assert_eq!(run.stdout, "", "{}", run.stdout);
}

#[test]
fn network_failures_are_retried_then_reported_once() {
    let tmp = tempfile::tempdir().unwrap();
    let project = Project::new(tmp.path().join("project"));
    // Nothing listens on port 9 of the loopback: every attempt is refused.
    project
        .write_manifest("[sources.foo]\nurl = \"http://127.0.0.1:9/foo.git\"\ntracking_ref = \"main\"\npatches = []\n");
    let m = Machine::new(&tmp.path().join("machine")).with_env("DISTRO_NET_ATTEMPTS", "3");
    let run = m.run(&project.root, &["bump"]);
    assert_eq!(run.code, 1);
    assert!(run.stderr.contains("(attempt 1 of 3)") && run.stderr.contains("(attempt 2 of 3)"), "{}", run.stderr);
    let line = run.error_line();
    assert!(line.contains("failed after 3 attempts") && line.contains("http://127.0.0.1:9/foo.git"), "{line}");
    assert_eq!(run.stderr.matches("error: ").count(), 1, "{}", run.stderr);
}

#[test]
fn a_new_source_is_pinned_by_bump_and_a_stale_lock_blocks_fetch() {
    let tmp = tempfile::tempdir().unwrap();
    let up = Upstream::new(tmp.path().join("upstream"));
    let project = Project::new(tmp.path().join("project"));
    project.write_manifest(&format!("[sources.foo]\nurl = \"{}\"\ntracking_ref = \"main\"\npatches = []\n", up.url()));
    let m = Machine::new(&tmp.path().join("machine"));
    let root = &project.root;
    let run = m.run(root, &["lock"]);
    assert_eq!(run.code, 2);
    assert!(run.error_line().contains("run `distro bump foo`"), "{}", run.stderr);

    let run = m.run(root, &["bump", "foo"]).ok();
    assert_eq!(run.stdout, format!("foo\t(unpinned) -> {}\n", up.head()));
    assert!(project.manifest().contains(&format!("commit = \"{}\"", up.head())));
    m.run(root, &["lock", "--check"]).ok();

    // Edit a pinned input by hand: the lock no longer matches, and fetch refuses it.
    let older = up.head();
    let newer = up.change_line(4, "line 4 new", "New");
    project.write_manifest(&project.manifest().replace(&older, &newer));
    let run = m.run(root, &["fetch"]);
    assert_eq!(run.code, 2);
    assert!(
        run.error_line().contains("the lock entry for source `foo` is stale (the pin changed); run `distro lock foo`"),
        "{}",
        run.stderr
    );
    let run = m.run(root, &["lock", "--check"]);
    assert_eq!(run.code, 1);
    assert!(run.error_line().contains("is not what the manifest gives"), "{}", run.stderr);
    m.run(root, &["lock", "foo"]).ok();
    m.run(root, &["fetch"]).ok();
}
