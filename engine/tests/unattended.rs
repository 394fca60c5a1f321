//! Running unattended, through the real binary, as schedulers run it: a signal stops a run at a
//! step boundary with a checkpoint of that step (every virtual device agreeing on it) and a
//! documented exit code; a second signal exits at once; `--resume=auto` continues a stopped run
//! on the uninterrupted curve and starts a run with no checkpoint yet again; runs started at
//! once without `--run-dir` take one directory each; a resume that would change the global batch
//! is refused; `train.checkpoint_every_minutes` saves on rank 0's clock; `engine goodput`
//! accounts for the attempts of a run killed and resumed.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Stdio};

use common::*;

/// A model whose step takes milliseconds, on the embedded corpus, with a constant learning rate
/// so that the length of a run (`--steps`) does not change its curve.
const SMALL: [&str; 20] = [
    "--set",
    "model.vocab_size=512",
    "--set",
    "train.seq_len=32",
    "--set",
    "model.d_model=64",
    "--set",
    "model.mlp_dim=128",
    "--set",
    "model.n_heads=4",
    "--set",
    "model.n_kv_heads=4",
    "--set",
    "model.head_dim=16",
    "--set",
    "optim.schedule=\"constant\"",
    "--set",
    "optim.warmup_steps=2",
    "--set",
    "train.profile_step=0",
];

/// The exit code of a run stopped by a signal with a checkpoint (docs/launch.md).
const STOPPED: i32 = 76;

fn train_args<'a>(run: &'a Path, steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["train", "--recipe", "tiny-llama2", "--run-dir", s(run), "--steps", steps];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(extra);
    args
}

fn losses(run: &Path) -> Vec<(u64, u64)> {
    metrics(run).iter().map(|m| (m["step"].as_u64().unwrap(), m["loss"].as_f64().unwrap().to_bits())).collect()
}

fn checkpoints(run: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .map(|d| d.map(|e| e.unwrap().file_name().into_string().unwrap()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// Starts a long run and waits until it has logged step 3; returns it and what it printed.
fn started(args: &[&str]) -> (Child, String) {
    started_with(engine_cmd(args))
}

fn started_with(mut cmd: std::process::Command) -> (Child, String) {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "the run ended before step 3: {seen}");
        seen.push_str(&line);
        if line.starts_with("step") && line.split_whitespace().nth(1).is_some_and(|s| s.starts_with("3/")) {
            break;
        }
    }
    // Keep reading, so that a full pipe never holds the run up.
    std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    (child, seen)
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: sending a signal to our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

/// Waits for a run; its exit code and standard error.
fn ended(mut child: Child) -> (Option<i32>, String) {
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    (child.wait().unwrap().code(), stderr)
}

/// SIGTERM to a running `engine train` (one device and two virtual devices): the run stops after
/// the step in progress with a sealed checkpoint of it, exits with the documented code, and
/// `--resume=auto` continues it on the curve of a run never stopped, bit for bit.
#[test]
fn sigterm_saves_the_step_it_stopped_at_and_resume_auto_continues_the_same_curve() {
    let dir = scratch("sigterm");
    for (name, extra) in [("one", &[][..]), ("two", &["--devices", "2", "--set", "mesh.ici_data=2"][..])] {
        let run = dir.join(name);
        let (child, out) = started(&train_args(&run, "100000", extra));
        signal(&child, libc::SIGTERM);
        let (code, stderr) = ended(child);
        assert_eq!(code, Some(STOPPED), "{name}: {stderr}");
        if name == "two" {
            assert!(out.contains("no checkpoints: a lost rank loses the whole run of 2 devices"), "{out}");
        }
        let logged = losses(&run);
        let stopped = logged.last().unwrap().0;
        assert_eq!(logged.len() as u64, stopped, "{name}: every step logged once");
        let saved = format!("step-{stopped:06}");
        assert_eq!(checkpoints(&run), std::slice::from_ref(&saved), "{name}: the checkpoint of the step it stopped at");
        assert!(run.join("checkpoints").join(&saved).join("state.json").exists());
        assert!(
            stderr.contains(&format!("stopped by SIGTERM after step {stopped}, with checkpoint"))
                && stderr.contains("exit code 76"),
            "{name}: {stderr}"
        );
        if name == "two" {
            let m = metrics(&run);
            assert!(m.iter().all(|r| r["slowest_rank"].as_u64().is_some_and(|r| r < 2)), "{m:?}");
            assert!(m.iter().all(|r| r["slowest_step_time_s"].as_f64().is_some_and(|t| t > 0.0)));
        }

        let end = (stopped + 3).to_string();
        let out = ok(&train_args(&run, &end, &[extra, &["--resume=auto"]].concat()));
        assert!(out.contains(&format!("resuming after step {stopped}")), "{out}");
        let whole = dir.join(format!("{name}-whole"));
        ok(&train_args(&whole, &end, extra));
        assert_eq!(losses(&run), losses(&whole), "{name}: the resumed curve differs from the uninterrupted one");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A second signal ends the run at once, with 128 + the signal and no checkpoint, even while the
/// first waits for a save that never ends (the crash test's hook stops the save of step 2 for
/// good); SIGUSR1 (Slurm's `--signal`) and SIGINT stop a run as SIGTERM does.
#[test]
fn a_second_signal_exits_at_once_and_usr1_and_int_stop_too() {
    let dir = scratch("second");
    let run = dir.join("twice");
    let mut cmd = engine_cmd(&train_args(&run, "100000", &["--set", "train.checkpoint_every=2"]));
    cmd.env("ENGINE_TEST_PAUSE_SAVE", "2");
    let (mut child, _) = started_with(cmd);
    signal(&child, libc::SIGTERM);
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    while !said.contains("engine: SIGTERM: stopping after this step") {
        assert!(stderr.read_line(&mut said).unwrap() > 0, "{said}");
    }
    signal(&child, libc::SIGTERM);
    stderr.read_to_string(&mut said).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(128 + libc::SIGTERM), "{said}");
    assert!(said.contains("second signal (SIGTERM): exiting at once"), "{said}");
    assert!(checkpoints(&run).iter().all(|c| !c.starts_with("step-")), "{:?}", checkpoints(&run));

    for (sig, name) in [(libc::SIGUSR1, "SIGUSR1"), (libc::SIGINT, "SIGINT")] {
        let run = dir.join(name);
        let (child, _) = started(&train_args(&run, "100000", &["--devices", "2", "--set", "mesh.ici_fsdp=2"]));
        signal(&child, sig);
        let (code, stderr) = ended(child);
        assert_eq!(code, Some(STOPPED), "{name}: {stderr}");
        assert!(stderr.contains(&format!("stopped by {name} after step")), "{stderr}");
        assert_eq!(checkpoints(&run).len(), 1, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--resume=auto`: a fresh start in a directory that does not exist yet; a resume from the
/// newest checkpoint when there is one; a start from step 0 again over an attempt killed before
/// its first checkpoint, whose records it replaces; a finished run without checkpoints is refused.
#[test]
fn resume_auto_resumes_when_it_can_and_starts_again_when_it_cannot() {
    let dir = scratch("auto");
    let run = dir.join("run");
    let out = ok(&train_args(&run, "4", &["--resume=auto", "--set", "train.checkpoint_every=2"]));
    assert!(!out.contains("resuming"), "{out}");
    assert_eq!(checkpoints(&run), ["step-000002", "step-000004"]);
    let out = ok(&train_args(&run, "6", &["--resume=auto", "--set", "train.checkpoint_every=2"]));
    assert!(out.contains("resuming after step 4"), "{out}");
    let whole = dir.join("whole");
    ok(&train_args(&whole, "6", &[]));
    assert_eq!(losses(&run), losses(&whole));

    // Killed (SIGKILL: no handler runs) before its first checkpoint.
    let killed = dir.join("killed");
    let (mut child, _) = started(&train_args(&killed, "100000", &[]));
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(losses(&killed).len() >= 3 && checkpoints(&killed).is_empty());
    let out = ok(&train_args(&killed, "6", &["--resume=auto"]));
    assert!(out.contains("starting again from step 0"), "{out}");
    assert_eq!(losses(&killed), losses(&whole), "the records of the killed attempt are replaced");

    // A finished run without checkpoints has nothing to continue from; one of another
    // configuration is not this run's.
    fails(&train_args(&whole, "8", &["--resume=auto"]), "holds a finished run without checkpoints");
    std::fs::remove_file(killed.join("summary.json")).unwrap();
    fails(
        &train_args(&killed, "6", &["--resume=auto", "--set", "optim.lr=0.01"]),
        "holds an earlier attempt of another configuration (it differs in optim.lr",
    );
    fails(&["train", "--recipe", "tiny-llama2", "--resume=auto"], "--resume=auto needs --run-dir");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Three runs started at once without --run-dir take runs/RECIPE, -2 and -3.
#[test]
fn concurrent_runs_take_one_default_directory_each() {
    let dir = scratch("concurrent");
    let mut args = vec!["train", "--recipe", "tiny-llama2", "--steps", "2"];
    args.extend_from_slice(&SMALL);
    let children: Vec<Child> = (0..3)
        .map(|_| engine_cmd(&args).current_dir(&dir).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap())
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    for name in ["tiny-llama2", "tiny-llama2-2", "tiny-llama2-3"] {
        assert_eq!(losses(&dir.join("runs").join(name)).len(), 2, "{name}");
    }
    assert!(!dir.join("runs/tiny-llama2-4").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A checkpoint of 4 data-parallel devices resumed on one device with the same batch_size would
/// train a quarter of the global batch: refused, naming the batch_size that keeps it, which
/// resumes.
#[test]
fn a_resume_that_changes_the_global_batch_is_refused() {
    let dir = scratch("global-batch");
    let run = dir.join("run");
    let four = ["--devices", "4", "--set", "mesh.ici_data=4", "--set", "train.checkpoint_every=2"];
    ok(&train_args(&run, "2", &four));
    let line =
        fails(&train_args(&run, "4", &["--resume"]), "the global batch (checkpoint train.batch_size 1 x 4 devices");
    assert!(line.contains("--set train.batch_size=4 keeps it"), "{line}");
    fails(
        &train_args(&run, "4", &["--resume", "--devices", "2", "--set", "mesh.ici_data=2"]),
        "--set train.batch_size=2 keeps it",
    );
    let out = ok(&train_args(&run, "4", &["--resume", "--set", "train.batch_size=4"]));
    assert!(out.contains("resuming after step 2"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train.checkpoint_every_minutes` saves on rank 0's clock, with no step cadence, on one device
/// and on two.
#[test]
fn checkpoints_are_saved_on_a_time_cadence() {
    let dir = scratch("minutes");
    for (name, extra) in [("one", &[][..]), ("two", &["--devices", "2", "--set", "mesh.ici_data=2"][..])] {
        let run = dir.join(name);
        // 6 ms: the 40 steps (a few ms each) take longer, so some save before the last step,
        // which saves too.
        let sets = ["--set", "train.checkpoint_every_minutes=0.0001", "--set", "train.keep_last=0"];
        let out = ok(&train_args(&run, "40", &[extra, &sets].concat()));
        assert!(!out.contains("no checkpoints"), "{out}");
        let saved = checkpoints(&run);
        assert!(saved.len() >= 2, "{name}: {saved:?}");
        assert_eq!(saved.last().unwrap(), "step-000040", "{name}: the last step is saved");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run killed with SIGKILL after its checkpoint of step 2 and its step 5 (the test hook holds the
/// save of step 4 for good, so the step loop waits there before logging step 6), then resumed with
/// `--resume=auto` to the end: `engine goodput` finds two attempts (the first killed at step 5,
/// the second completed after resuming step 2), counts the 3 steps computed again as
/// wasted progress, and splits every second of each attempt into productive time and causes;
/// `summary.json` carries the same figures; a directory without a timeline is one line, exit 2.
#[test]
fn goodput_accounts_for_a_run_killed_and_resumed() {
    let dir = scratch("goodput");
    let run = dir.join("run");
    let cadence = ["--set", "train.checkpoint_every=2", "--set", "train.eval_every=3"];
    let mut cmd = engine_cmd(&train_args(&run, "100000", &cadence));
    cmd.env("ENGINE_TEST_PAUSE_SAVE", "4");
    let (mut child, _) = started_with(cmd);
    while losses(&run).len() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let killed_at = losses(&run).last().unwrap().0;
    let newest = checkpoints(&run).iter().rev().find_map(|c| c.strip_prefix("step-")?.parse::<u64>().ok()).unwrap();
    assert_eq!((newest, killed_at), (2, 5), "{:?}", checkpoints(&run));
    let end = (killed_at + 2).to_string();
    let out = ok(&train_args(&run, &end, &[&cadence[..], &["--resume=auto"]].concat()));
    assert!(out.contains(&format!("resuming after step {newest}")), "{out}");
    assert!(out.contains("goodput ") && out.contains("(2 attempts"), "{out}");

    let report: serde_json::Value = serde_json::from_str(&ok(&["goodput", s(&run), "--json"])).unwrap();
    let attempts = report["attempts"].as_array().unwrap();
    let field = |a: &serde_json::Value, k: &str| a[k].as_u64().unwrap();
    assert_eq!(attempts.len(), 2, "{report:#}");
    assert_eq!((attempts[0]["outcome"].as_str(), field(&attempts[0], "last_step")), (Some("killed"), killed_at));
    assert_eq!((attempts[1]["outcome"].as_str(), field(&attempts[1], "last_step")), (Some("completed"), killed_at + 2));
    assert_eq!(field(&attempts[1], "resumed_after_step"), newest);
    assert_eq!(field(&report["run"], "recomputed_steps"), killed_at - newest, "{report:#}");
    assert_eq!(field(&report["run"], "steps"), killed_at + 2 + killed_at - newest);
    assert!(report["run"]["badput"]["recomputed_s"].as_f64().unwrap() > 0.0);
    assert!(report["last_attempt"]["badput"]["startup_checkpoint_load_s"].as_f64().unwrap() > 0.0);
    assert!(report["run"]["badput"]["eval_s"].as_f64().unwrap() > 0.0);
    // Productive time and the causes add up to the wall time, attempt by attempt and in all.
    for f in attempts.iter().chain([&report["run"], &report["last_attempt"]]) {
        let causes: f64 = f["badput"].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).sum();
        let (productive, wall) = (f["productive_s"].as_f64().unwrap(), f["wall_s"].as_f64().unwrap());
        assert!(wall > 0.0 && (productive + causes - wall).abs() < 1e-6 * wall.max(1.0), "{f:#}");
        assert!(f["goodput"].as_f64().unwrap() > 0.0 && f["goodput"].as_f64().unwrap() < 1.0, "{f:#}");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["goodput"]["attempts"], 2);
    assert_eq!(summary["goodput"]["run"]["recomputed_steps"], report["run"]["recomputed_steps"]);
    // TensorBoard: the resumed attempt's event file carries the goodput and badput scalars.
    let tagged = |tag: &str| {
        std::fs::read_dir(&run).unwrap().map(|e| e.unwrap().path()).any(|p| {
            p.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents")
                && std::fs::read(&p).unwrap().windows(tag.len()).any(|w| w == tag.as_bytes())
        })
    };
    assert!(tagged("goodput/run") && tagged("badput/run/recomputed_steps"), "no goodput scalars in TensorBoard");

    let table = ok(&["goodput", s(&run)]);
    for row in ["productive", "start-up: checkpoint load", "recomputed steps", "wall", "killed", "completed"] {
        assert!(table.contains(row), "{row}: {table}");
    }
    fails(&["goodput", s(&dir)], "holds no goodput timeline (goodput.jsonl)");
    fails(&["goodput", s(&dir.join("absent"))], "no such run directory");
    std::fs::remove_dir_all(&dir).unwrap();
}
