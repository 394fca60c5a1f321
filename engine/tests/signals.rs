//! Signals that must not end a run (issue 46, holes 8-10): SIGUSR2 to a single-process `train`
//! (no flight recorder: a line, and it trains on), SIGUSR2 to `engine launch` (passed on to the
//! ranks, which write their flight records and train on), and a reader of `train`'s output gone
//! away (`train … | head -2`: SIGPIPE ignored, a note, the run completes with its checkpoint).
//! And one that must end it promptly (hole 11): SIGTERM during a long evaluation, which went on
//! to the evaluation's end (11 minutes); with a `train.eval_steps` past the validation split,
//! which is refused.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Stdio};

use common::{engine_cmd, fails, s, scratch};

/// tiny-llama2 shrunk to a few milliseconds a step.
const SMALL: &[&str] = &[
    "model.vocab_size=512",
    "train.seq_len=32",
    "model.d_model=64",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.head_dim=32",
    "model.mlp_dim=128",
];

fn train_args<'a>(run_dir: &'a str, steps: &'a str) -> Vec<&'a str> {
    let mut args = vec!["--threads", "1", "train", "--recipe", "tiny-llama2", "--steps", steps, "--run-dir", run_dir];
    for set in SMALL {
        args.extend(["--set", set]);
    }
    args
}

/// Reads `child`'s standard output until a line starts with `prefix` (the run is training),
/// then keeps reading the rest on a thread (so the run never blocks on a full pipe).
fn wait_for_line(child: &mut Child, prefix: &str) -> std::thread::JoinHandle<String> {
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the run ended before a line starting with {prefix}");
        if line.trim_start().starts_with(prefix) {
            break;
        }
    }
    std::thread::spawn(move || {
        let mut rest = String::new();
        out.read_to_string(&mut rest).unwrap();
        rest
    })
}

fn send(child: &Child, signal: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
}

/// Runs `engine ARGS`, sends `signal` once its first step is logged, and waits for it: its exit
/// code, stderr and stdout.
fn signalled_after_a_step(args: &[&str], signal: i32) -> (Option<i32>, String, String) {
    let mut child = engine_cmd(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let rest = wait_for_line(&mut child, "step");
    send(&child, signal);
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned(), rest.join().unwrap())
}

#[test]
fn sigusr2_to_a_single_process_run_is_a_line_and_it_trains_on() {
    let dir = scratch("signals-usr2-train");
    let run = dir.join("run");
    let (code, stderr, stdout) = signalled_after_a_step(&train_args(s(&run), "400"), libc::SIGUSR2);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("SIGUSR2: this process keeps no flight record"), "{stderr}");
    assert!(stdout.contains("done: "), "{stdout}");
}

#[test]
fn sigusr2_to_the_launcher_reaches_the_ranks_which_train_on() {
    let dir = scratch("signals-usr2-launch");
    let run = dir.join("run");
    let mut args = vec!["launch", "--nproc", "2", "--"];
    let train = train_args(s(&run), "300");
    args.extend(train);
    args.extend(["--set", "mesh.ici_data=2"]);
    let (code, stderr, stdout) = signalled_after_a_step(&args, libc::SIGUSR2);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("received SIGUSR2: passed it on to the 2 processes running"), "{stderr}");
    assert!(stdout.contains("done: "), "{stdout}");
    for rank in 0..2 {
        assert!(run.join(format!("flight/rank-{rank}.json")).is_file(), "no flight record of rank {rank}: {stderr}");
    }
}

#[test]
fn a_reader_gone_away_does_not_end_the_run() {
    let dir = scratch("signals-pipe");
    let run = dir.join("run");
    let mut args = train_args(s(&run), "40");
    args.extend(["--set", "train.checkpoint_every=40"]);
    let mut child = engine_cmd(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // `| head -1`: one line read, then the reader closes the pipe.
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    drop(out);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "killed by its closed output? {:?} {stderr}", out.status);
    assert!(stderr.contains("standard output closed"), "{stderr}");
    assert!(run.join("checkpoints/step-000040").is_dir(), "no checkpoint of the last step: {stderr}");
    let last = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(last.lines().last().unwrap().contains("\"step\":40"), "{last}");
}

/// Waits for `child` at most `limit`; kills it when it has not ended by then (the test fails).
fn ended_within(mut child: Child, limit: std::time::Duration) -> (Option<i32>, String, std::time::Duration) {
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let took = start.elapsed();
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned(), took)
}

/// SIGTERM during a long evaluation (13,000 batches of the synthetic data's validation split:
/// tens of seconds) ends it within about a second, on one device and on two virtual devices
/// (which agree on the batch to stop before): no eval_loss for that step, a line saying so, and
/// the run stops as at a step boundary, with a checkpoint of the step and exit code 76.
#[test]
fn sigterm_during_a_long_evaluation_stops_the_run_within_a_second() {
    let dir = scratch("signals-eval");
    for (name, extra) in [("one", &[][..]), ("two", &["--devices", "2", "--set", "mesh.ici_data=2"][..])] {
        let run = dir.join(name);
        let mut args = train_args(s(&run), "100000");
        // A model 4 times the usual per token: the whole evaluation takes tens of seconds.
        let wider = ["model.d_model=128", "model.head_dim=64", "model.mlp_dim=512"];
        let eval = ["data.source=synthetic", "train.eval_every=2", "train.eval_steps=13000"];
        args.extend(wider.iter().flat_map(|set| ["--set", set]));
        args.extend(eval.iter().flat_map(|set| ["--set", set]));
        args.extend(extra);
        let mut child = engine_cmd(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        // Step 1 logged: step 2 takes milliseconds, then its evaluation runs.
        let rest = wait_for_line(&mut child, "step");
        std::thread::sleep(std::time::Duration::from_millis(700));
        send(&child, libc::SIGTERM);
        let (code, stderr, took) = ended_within(child, std::time::Duration::from_secs(10));
        let stdout = rest.join().unwrap();
        eprintln!("{name}: ended {took:?} after SIGTERM");
        assert_eq!(code, Some(76), "{name}: {stderr}");
        assert!(took < std::time::Duration::from_secs(3), "{name}: {took:?} after SIGTERM: {stderr}");
        assert!(stdout.contains("step 2: evaluation abandoned after "), "{name}: {stdout}");
        assert!(stderr.contains("stopped by SIGTERM after step 2, with checkpoint"), "{name}: {stderr}");
        assert!(run.join("checkpoints/step-000002/state.json").is_file(), "{name}: {stderr}");
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert!(metrics.lines().count() == 2 && !metrics.contains("eval_loss"), "{name}: {metrics}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `train.eval_steps` that reads more validation samples than the split holds (the embedded
/// corpus at train.seq_len = 32 holds out 200) is one line, exit code 2, before the first step;
/// the most it allows runs.
#[test]
fn eval_steps_past_the_validation_split_are_refused() {
    let dir = scratch("signals-eval-steps");
    let run = dir.join("run");
    let mut args = train_args(s(&run), "1");
    args.extend(["--set", "train.eval_every=1", "--set", "train.eval_steps=1000000000"]);
    fails(
        &args,
        "train.eval_steps = 1000000000 reads 1000000000 x 1 batch shard(s) x 1 pipeline micro-batch(es) x 1 sequence(s) = 1000000000 validation samples per evaluation, more than the 200 distinct samples of the held-out tail (the last 5 %) of the data (of train.seq_len + 1 = 33 tokens each): past them it would read the same samples again; set train.eval_steps to at most 200",
    );
    assert!(!run.join("metrics.jsonl").exists(), "it trained first");
    let (refused, ran) = (dir.join("two-refused"), dir.join("two"));
    let two = |run, steps| {
        let mut args = train_args(run, "1");
        let eval = ["train.eval_every=1", steps];
        args.extend(["--devices", "2", "--set", "mesh.ici_data=2"]);
        args.extend(eval.iter().flat_map(|set| ["--set", *set]));
        args
    };
    fails(
        &two(s(&refused), "train.eval_steps=101"),
        "= 202 validation samples per evaluation, more than the 200 distinct samples",
    );
    let out = engine_cmd(&two(s(&ran), "train.eval_steps=100")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}
