//! The local tier of checkpoints (`train.local_checkpoint_every`, `train/local_tier.rs`) across
//! two processes of `engine launch` on the TCP collectives: a job killed (SIGKILL, every
//! process) after a local save and before the next persistent one resumes with
//! `--resume=auto` from the local tier; from the peer's copy when a rank's own is deleted or
//! corrupted (the corruption found by the seal, with a line saying so); from the persistent
//! tier when both copies are gone, when the tier is another run's, or another mesh's. Every
//! case ends on the uninterrupted curve, bit for bit, and removes the tier once complete. The
//! tier's directory is this user's alone: one planted as a link or another user's is refused.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use common::{SHRINK, copy_dir, engine_cmd, metrics, s, scratch};

/// Beside [`SHRINK`]: a mesh of FSDP 2 (each rank's part is half the state, so a rank cannot
/// restore from its own copy what only the other holds); persistent checkpoints every 5 steps,
/// local ones every 2.
const SETS: [&str; 4] = ["train.profile_step=0", "mesh.ici_data=1", "mesh.ici_fsdp=2", "train.checkpoint_every=5"];

const STEPS: &str = "12";

/// `engine launch --nproc 2 -- train ...` into `run` (with the local tier in `local`, if given).
fn job(run: &Path, local: Option<&Path>, extra: &[&str]) -> Command {
    job_of(STEPS, run, local, extra)
}

/// [`job`] of `steps` steps.
fn job_of(steps: &str, run: &Path, local: Option<&Path>, extra: &[&str]) -> Command {
    let mut args: Vec<String> = ["launch", "--nproc", "2", "--", "train", "--device", "cpu", "--recipe", "tiny-llama2"]
        .map(String::from)
        .into();
    args.extend(["--steps", steps, "--run-dir", s(run)].map(String::from));
    let tier =
        local.map(|l| ["train.local_checkpoint_every=2".to_owned(), format!("train.local_checkpoint_dir={}", s(l))]);
    for set in SHRINK.iter().chain(&SETS).map(|x| x.to_string()).chain(tier.into_iter().flatten()) {
        args.extend(["--set".to_owned(), set]);
    }
    args.extend(extra.iter().map(|x| x.to_string()));
    let mut cmd = engine_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>());
    for var in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"] {
        cmd.env_remove(var);
    }
    cmd.env_remove("JAX_COORDINATOR_ADDRESS").env_remove("ENGINE_JOB_TOKEN").env_remove("ENGINE_TEST_STEP_DELAY");
    cmd.env_remove("ENGINE_TEST_LOCAL_SAVE_DELAY");
    cmd
}

/// Waits for the line of step `step` on `child`'s stdout, then kills its process group
/// (SIGKILL) and waits until nothing holds `run`'s lock; what it printed.
fn kill_after(child: &mut std::process::Child, step: u64, run: &Path) -> String {
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "the job ended before step {step}: {seen}");
        seen.push_str(&line);
        let prefix = format!("{step}/");
        if line.starts_with("step") && line.split_whitespace().nth(1).is_some_and(|s| s.starts_with(&prefix)) {
            break;
        }
    }
    // SAFETY: the job's own process group, which the test started.
    assert_eq!(unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) }, 0);
    child.wait().unwrap();
    // The ranks, in a process group of their own, die with the launcher (its PR_SET_PDEATHSIG)
    // but not at once: one in the middle of a write may take seconds on a loaded machine. Until
    // the last is gone the run directory's lock is held (by a process the test cannot see from
    // the launcher's group), and a job started there is refused. The lock is flock(2), as
    // `File::try_lock` takes it: once this process can take it, nothing else holds it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let lock = std::fs::File::open(run.join(".lock")).unwrap();
    while let Err(std::fs::TryLockError::WouldBlock) = lock.try_lock() {
        assert!(std::time::Instant::now() < deadline, "the killed job's ranks still hold its run directory after 30 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    seen
}

/// Runs a job to its end; what it printed (stdout and stderr).
fn completed(mut cmd: Command) -> String {
    let out = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).output().expect("engine runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed: {text}");
    text
}

fn losses(run: &Path) -> Vec<(u64, u64)> {
    metrics(run).iter().map(|m| (m["step"].as_u64().unwrap(), m["loss"].as_f64().unwrap().to_bits())).collect()
}

/// The step directories under `dir`.
fn steps(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().file_name().into_string().unwrap()).filter(|n| n.starts_with("step-")).collect())
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn a_killed_job_resumes_from_the_local_tier_or_the_peers_copy_or_the_persistent_tier_on_the_same_curve() {
    let dir = scratch("local-tier");
    let reference = dir.join("reference");
    completed(job(&reference, None, &[]));
    let uninterrupted = losses(&reference);
    assert_eq!(uninterrupted.len(), 12);

    // The job killed, all of it, during step 9 (rank 0 slowed to 300 ms a step so that the
    // kill lands there): the local tier holds step 6 (maybe 8), the persistent tier step 5.
    // (Step 6's copies are written in the background after the boundary where every rank's
    // part is sealed, and certainly in place at boundary 8, which waits for them.)
    let (killed, killed_local) = (dir.join("killed"), dir.join("killed-local"));
    let mut cmd = job(&killed, Some(&killed_local), &[]);
    cmd.env("ENGINE_TEST_STEP_DELAY", "0:0.3").process_group(0).stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let seen = kill_after(&mut child, 8, &killed);
    assert_eq!(steps(&killed.join("checkpoints")), ["step-000005"], "{seen}");
    let local_steps = steps(&killed_local.join("rank-00000"));
    assert!(local_steps.contains(&"step-000006".to_owned()), "{local_steps:?}");
    assert_eq!(local_steps.len(), 2, "the tier keeps two steps: {local_steps:?}");
    for part in ["rank-00001", "copy-of-rank-00000", "copy-of-rank-00001"] {
        assert!(killed_local.join(part).join("step-000006/state.json").is_file(), "{part}: {local_steps:?}");
    }
    let (saved, saved_local) = (dir.join("saved"), dir.join("saved-local"));
    copy_dir(&killed, &saved);
    copy_dir(&killed_local, &saved_local);

    // Each case on the killed job as it was, in its own directories: the tier records the run
    // directory it belongs to. `another-run` resumes a copy of the run elsewhere with the same
    // tier; `another-mesh` on data 2 instead of FSDP 2.
    type Damage = fn(&Path);
    let cases: [(&str, Damage, &str); 6] = [
        ("intact", |_| {}, "from the local tier"),
        ("another-run", |_| {}, "saved by another run"),
        ("another-mesh", |_| {}, "saved on another mesh"),
        (
            "own-deleted",
            |local| std::fs::remove_dir_all(local.join("rank-00000")).unwrap(),
            "ranks [0] from their peers' copies",
        ),
        (
            "both-deleted",
            |local| {
                std::fs::remove_dir_all(local.join("rank-00000")).unwrap();
                std::fs::remove_dir_all(local.join("copy-of-rank-00000")).unwrap();
            },
            "resuming from the persistent tier (step 5)",
        ),
        (
            "corrupted",
            |local| {
                let own = local.join("rank-00000");
                for step in steps(&own) {
                    let shard = own.join(step).join("shard-00000-of-00002.safetensors");
                    let mut bytes = std::fs::read(&shard).unwrap();
                    let n = bytes.len() - 7;
                    bytes[n] ^= 0x40;
                    std::fs::write(&shard, bytes).unwrap();
                }
            },
            "ranks [0] from their peers' copies",
        ),
    ];
    for (name, damage, expected) in cases {
        let local = killed_local.clone();
        let run = if name == "another-run" { dir.join(name) } else { killed.clone() };
        for d in [&killed, &killed_local] {
            let _ = std::fs::remove_dir_all(d);
        }
        copy_dir(&saved, &run);
        copy_dir(&saved_local, &local);
        // As the engine made it: a directory group members can write (umask 002) is refused.
        std::fs::set_permissions(&local, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        damage(&local);
        let mesh: &[&str] = match name {
            "another-mesh" => &["--set", "mesh.ici_fsdp=1", "--set", "mesh.ici_data=2"],
            _ => &[],
        };
        let out = completed(job(&run, Some(&local), &[&["--resume=auto"], mesh].concat()));
        assert!(out.contains(expected), "{name}: expected `{expected}` in: {out}");
        let resumed = |what: &str| out.lines().any(|l| l.contains("resuming after step") && l.contains(what));
        if ["both-deleted", "another-run", "another-mesh"].contains(&name) {
            assert!(out.contains("resuming from the persistent tier (step 5)"), "{name}: {out}");
            assert!(resumed("after step 5 from ") && resumed("checkpoints/step-000005"), "{name}: {out}");
        } else {
            assert!(resumed("from the local tier") && !resumed("after step 5 "), "{name}: {out}");
        }
        if name == "corrupted" {
            assert!(
                out.contains("shard-00000-of-00002.safetensors does not match its SHA-256") && out.contains("skipped"),
                "{name}: {out}"
            );
        }
        if name != "another-mesh" {
            assert_eq!(losses(&run), uninterrupted, "{name}: the resumed job's curve, bit for bit");
        }
        // Complete, the job removes the tier (its own saves replaced another run's steps).
        let removed = format!("; local tier {} removed", s(&local));
        assert!(out.lines().any(|l| l.starts_with("done: ") && l.ends_with(&removed)), "{name}: {out}");
        assert!(!local.exists(), "{name}: {out}");
    }
}

/// The local save in the background: every rank's writer sleeps 0.5 s before writing
/// (`ENGINE_TEST_LOCAL_SAVE_DELAY`) while a step takes 0.3 s (rank 0 slowed), so a save spans
/// steps. The step loop does not wait for it (the first save's boundary costs less than the
/// writer's sleep, and the next step is logged before the part is sealed), the job's curve is the
/// uninterrupted one, and the job killed after step 9 resumes from the local tier, bit for bit.
#[test]
fn a_local_save_in_the_background_lets_the_steps_go_on_and_resumes_on_the_same_curve() {
    let dir = scratch("local-tier-background");
    let reference = dir.join("reference");
    completed(job(&reference, None, &[]));
    let uninterrupted = losses(&reference);

    let (run, local) = (dir.join("run"), dir.join("run-local"));
    let mut cmd = job(&run, Some(&local), &[]);
    cmd.env("ENGINE_TEST_STEP_DELAY", "0:0.3").env("ENGINE_TEST_LOCAL_SAVE_DELAY", "0.5");
    cmd.process_group(0).stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let seen = kill_after(&mut child, 9, &run);
    let records = metrics(&run);
    let at = |step: u64| records.iter().find(|m| m["step"] == step).unwrap_or_else(|| panic!("step {step}: {seen}"));
    let stall = at(2)["local_checkpoint_s"].as_f64().expect("the save of step 2 is on the loop's record");
    assert!(stall < 0.5, "the loop waited {stall} s at step 2, not less than the writer's 0.5 s sleep");
    // The writer took longer than the loop's stall: the loop went on while it wrote. Step 3's
    // boundary asked the other rank whether the parts were sealed (its record says the time).
    let written: Vec<f64> = records.iter().filter_map(|m| m["local_checkpoint_write_s"].as_f64()).collect();
    assert!(!written.is_empty() && written.iter().all(|&w| w >= 0.5), "{written:?}");
    assert!(at(3)["local_checkpoint_s"].is_f64(), "{seen}");
    // Step 8's boundary waited for step 6's parts (sealed) and step 4's copies (written).
    for part in ["rank-00000/step-000006", "rank-00001/step-000006", "copy-of-rank-00000/step-000004"] {
        assert!(local.join(part).join("state.json").is_file(), "{part}: {seen}");
    }

    let mut resume = job(&run, Some(&local), &["--resume=auto"]);
    resume.env("ENGINE_TEST_LOCAL_SAVE_DELAY", "0.5");
    let out = completed(resume);
    assert!(out.lines().any(|l| l.contains("resuming after step") && l.contains("from the local tier")), "{out}");
    assert_eq!(losses(&run), uninterrupted, "the resumed job's curve, bit for bit: {out}");
}

/// A run stopped (SIGTERM to the launcher) while a local save is being written (the writer
/// sleeps 1 s, a step takes 0.3 s) completes it before exiting: every rank's own part and its
/// peer's copy of the steps kept are in place, sealed, with nothing temporary left, and
/// restore as they are, from the own copies and from the peer's. The resumed run, complete,
/// removes the tier.
#[test]
fn a_run_stopped_while_a_local_save_is_in_flight_leaves_a_valid_tier() {
    let dir = scratch("local-tier-end");
    let (run, local) = (dir.join("run"), dir.join("run-local"));
    let mut cmd = job(&run, Some(&local), &[]);
    cmd.env("ENGINE_TEST_LOCAL_SAVE_DELAY", "1").env("ENGINE_TEST_STEP_DELAY", "0:0.3");
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen
        .lines()
        .any(|l| l.starts_with("step") && l.split_whitespace().nth(1).is_some_and(|s| s.starts_with("3/")))
    {
        assert!(stdout.read_line(&mut seen).unwrap() > 0, "the job ended before step 3: {seen}");
    }
    // SAFETY: the launcher the test started; it passes the signal on to the ranks.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let out = child.wait_with_output().unwrap();
    let out = format!("{seen}{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let stopped = metrics(&run).last().unwrap()["step"].as_u64().unwrap();
    assert!((4..12).contains(&stopped), "{out}");
    // The newest local step is the last due one, 2 before it.
    let newest = stopped - stopped % 2;
    let kept = [newest - 2, newest].map(|s| format!("step-{s:06}"));
    for part in ["rank-00000", "rank-00001", "copy-of-rank-00000", "copy-of-rank-00001"] {
        assert_eq!(steps(&local.join(part)), kept, "{part}: {out}");
        let names: Vec<String> = std::fs::read_dir(local.join(part))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| n.starts_with("step-")), "{part}: {names:?}");
    }

    // Each restore verifies what it loads: every file's hash against the seal. A stop at an odd
    // step saved it to the persistent tier only, newer than the local one.
    std::fs::remove_dir_all(local.join("rank-00000")).unwrap();
    let out = completed(job(&run, Some(&local), &["--resume=auto"]));
    let from = match stopped % 2 {
        0 => format!("resuming after step {stopped} from the local tier"),
        _ => format!("resuming from the persistent tier (step {stopped})"),
    };
    assert!(out.contains(&from), "{out}");
    if stopped.is_multiple_of(2) {
        assert!(out.contains("ranks [0] from their peers' copies"), "{out}");
    }
    assert!(!local.exists(), "{out}");
}

/// The default directory of the tier (`/dev/shm/engine-local-UID-HASH`): created for the run,
/// this user's alone, removed when the run completes, which the closing line says. One that is
/// a symbolic link, or that another user made first (0777), is refused in one line, exit code 2,
/// and nothing is written through it.
#[test]
fn the_default_tier_is_this_users_alone_and_removed_when_the_run_completes() {
    if !Path::new("/dev/shm").is_dir() {
        return eprintln!("SKIPPED: no /dev/shm");
    }
    let dir = scratch("local-tier-default");
    let run = dir.join("run");
    let tier = engine::train::local_tier::root_of("", &run);
    let train = |run: &Path, steps: &str| {
        let mut args: Vec<String> =
            ["train", "--device", "cpu", "--recipe", "tiny-llama2", "--steps", steps, "--run-dir"]
                .map(String::from)
                .into();
        args.push(s(run).to_owned());
        for set in SHRINK.iter().chain(&["train.profile_step=0", "train.local_checkpoint_every=1"]) {
            args.extend(["--set".to_owned(), set.to_string()]);
        }
        engine_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let out = completed(train(&run, "2"));
    let done = out.lines().find(|l| l.starts_with("done: ")).unwrap_or_else(|| panic!("{out}"));
    assert!(done.ends_with(&format!("; local tier {} removed", tier.display())), "{done}");
    assert!(!tier.exists(), "{out}");

    // Planted before the run: a link to a directory another user could read, then (as root)
    // a directory another user made, open to all.
    let target = dir.join("theirs");
    std::fs::create_dir(&target).unwrap();
    let fresh = dir.join("fresh");
    let refused = |cmd: &mut Command, expected: &str| {
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(expected) && !stderr.contains("panicked"), "expected `{expected}` in: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    };
    let other = engine::train::local_tier::root_of("", &fresh);
    std::os::unix::fs::symlink(&target, &other).unwrap();
    refused(&mut train(&fresh, "1"), &format!("{} is a symbolic link (to {})", other.display(), target.display()));
    std::fs::remove_file(&other).unwrap();
    assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0, "written through the link");

    if unsafe { libc::geteuid() } != 0 {
        return eprintln!("SKIPPED: another user's directory (needs root to make one)");
    }
    std::fs::create_dir(&other).unwrap();
    std::os::unix::fs::chown(&other, Some(12345), Some(12345)).unwrap();
    std::fs::set_permissions(&other, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    refused(&mut train(&fresh, "1"), "belongs to another user (uid 12345; this process runs as uid 0)");
    assert_eq!(std::fs::read_dir(&other).unwrap().count(), 0, "written into another user's directory");
    std::fs::remove_dir(&other).unwrap();
}
