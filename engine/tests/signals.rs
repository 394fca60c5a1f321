//! Signals that must not end a run (issue 46, holes 8-10): SIGUSR2 to a single-process `train`
//! (no flight recorder: a line, and it trains on), SIGUSR2 to `engine launch` (passed on to the
//! ranks, which write their flight records and train on), and a reader of `train`'s output gone
//! away (`train … | head -2`: SIGPIPE ignored, a note, the run completes with its checkpoint).

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Stdio};

use common::{engine_cmd, s, scratch};

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

#[test]
fn sigusr2_to_a_single_process_run_is_a_line_and_it_trains_on() {
    let dir = scratch("signals-usr2-train");
    let run = dir.join("run");
    let mut child =
        engine_cmd(&train_args(s(&run), "400")).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let rest = wait_for_line(&mut child, "step");
    send(&child, libc::SIGUSR2);
    let out = child.wait_with_output().unwrap();
    let (stderr, stdout) = (String::from_utf8_lossy(&out.stderr), rest.join().unwrap());
    assert_eq!(out.status.code(), Some(0), "{stderr}");
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
    let mut child = engine_cmd(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let rest = wait_for_line(&mut child, "step");
    send(&child, libc::SIGUSR2);
    let out = child.wait_with_output().unwrap();
    let (stderr, stdout) = (String::from_utf8_lossy(&out.stderr), rest.join().unwrap());
    assert_eq!(out.status.code(), Some(0), "{stderr}");
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
