//! Failures of a multi-process job on the CPU, with real processes and real signals, through
//! `engine launch`: a rank killed (the others end within seconds, naming it; `--max-restarts`
//! finishes the run on the uninterrupted curve), a rank stopped (the watchdog ends the job),
//! SIGTERM to the launcher (a checkpoint of the step it stopped at, which `--resume=auto`
//! continues), a second signal, a launcher killed outright or running as PID 1, and 20 random
//! kills over one run (the same curve, every checkpoint whole).
//!
//! The tests run one at a time (timing bounds on a 2-core machine) on a shrunken tiny-llama2
//! over FSDP × 2, one thread per process: a step takes about 20 ms.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::{engine_cmd, s, scratch};
use engine::checkpoint::Checkpoint;

/// Steps of the runs whose curves are compared, and their checkpoint cadence.
const STEPS: usize = 90;
const EVERY: usize = 3;

/// The exit code of a run stopped by a signal after writing a checkpoint (docs/launch.md).
const STOPPED: i32 = 76;

/// The shrunken recipe: FSDP over the two processes, every checkpoint kept.
const SMALL: &[&str] = &[
    "model.vocab_size=512",
    "train.seq_len=32",
    "model.d_model=256",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.head_dim=64",
    "model.mlp_dim=512",
    "optim.warmup_steps=2",
    "train.keep_last=0",
    "mesh.ici_data=1",
    "mesh.ici_fsdp=2",
];

/// One test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `train` on the CPU in `run`, resuming automatically, `steps` steps, a checkpoint every `every`.
fn train(run: &Path, steps: usize, every: usize) -> Vec<String> {
    train_with(run, steps, every, &[])
}

/// [`train`] with more `--set`s (after the others, so they win).
fn train_with(run: &Path, steps: usize, every: usize, sets: &[&str]) -> Vec<String> {
    let mut args: Vec<String> =
        ["--device", "cpu", "train", "--recipe", "tiny-llama2", "--resume=auto"].map(String::from).to_vec();
    args.extend(["--run-dir".into(), s(run).into(), "--steps".into(), steps.to_string()]);
    for set in SMALL
        .iter()
        .map(|s| s.to_string())
        .chain([format!("train.checkpoint_every={every}")])
        .chain(sets.iter().map(|s| s.to_string()))
    {
        args.extend(["--set".into(), set]);
    }
    args
}

/// A running `engine launch`, its standard output and error gathered line by line.
struct Launched {
    child: Child,
    out: Arc<Mutex<String>>,
}

impl Launched {
    /// `engine launch LAUNCH... -- COMMAND...` with `env`.
    fn start(launch: &[&str], command: &[String], env: &[(&str, &str)]) -> Launched {
        let mut args: Vec<&str> = vec!["launch"];
        args.extend(launch);
        args.push("--");
        args.extend(command.iter().map(String::as_str));
        Launched::spawn(engine_cmd(&args), env)
    }

    fn spawn(mut cmd: std::process::Command, env: &[(&str, &str)]) -> Launched {
        for var in [
            "RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "LOCAL_RANK",
            "SLURM_PROCID",
            "JAX_COORDINATOR_ADDRESS",
            "ENGINE_JOB_TOKEN",
            "ENGINE_COLLECTIVE_TIMEOUT",
        ] {
            cmd.env_remove(var);
        }
        cmd.env("ENGINE_THREADS", "1").stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("engine starts");
        let out = Arc::new(Mutex::new(String::new()));
        fn gather(from: impl Read + Send + 'static, into: &Arc<Mutex<String>>) {
            let into = into.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(from).lines().map_while(Result::ok) {
                    let mut text = into.lock().unwrap();
                    text.push_str(&line);
                    text.push('\n');
                }
            });
        }
        gather(child.stdout.take().unwrap(), &out);
        gather(child.stderr.take().unwrap(), &out);
        Launched { child, out }
    }

    fn output(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    /// Waits until `ready` holds (of the output), at most `limit`.
    fn wait_until(&mut self, limit: Duration, what: &str, ready: impl Fn(&Self) -> bool) {
        let start = Instant::now();
        while !ready(self) {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the launcher ended ({status}) before {what}:\n{}", self.output());
            }
            if start.elapsed() > limit {
                self.kill();
                panic!("no {what} within {limit:?}:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The pids the launcher started in attempt `n` (1, 2, ...), by rank, once it has said so.
    fn pids(&mut self, n: usize) -> Vec<i32> {
        self.wait_until(Duration::from_secs(60), &format!("start of attempt {n}"), |l| started(&l.output()).len() >= n);
        started(&self.output())[n - 1].clone()
    }

    /// Waits until the run has logged `step`, at most 60 s.
    fn wait_step(&mut self, run: &Path, step: usize) {
        self.wait_until(Duration::from_secs(60), &format!("step {step}"), |_| logged_steps(run) >= step);
    }

    /// Waits for the launcher to end, at most `limit`; its status, output and time taken.
    fn finish(mut self, limit: Duration) -> (ExitStatus, String, Duration) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // The readers see the pipes close once no process of the job holds them.
                let elapsed = start.elapsed();
                std::thread::sleep(Duration::from_millis(100));
                return (status, self.output(), elapsed);
            }
            if start.elapsed() > limit {
                self.kill();
                panic!("the launcher did not end within {limit:?}:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills the launcher (its processes die with it).
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn signal(&self, sig: i32) {
        signal(self.child.id() as i32, sig);
    }
}

/// Every "engine launch: started" line's pids, in rank order.
fn started(output: &str) -> Vec<Vec<i32>> {
    output
        .lines()
        .filter(|l| l.starts_with("engine launch: started"))
        .map(|l| {
            l.split("pid ")
                .skip(1)
                .map(|p| p.split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap())
                .collect()
        })
        .collect()
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig}): {}", std::io::Error::last_os_error());
}

/// Whether a process of the job training in `run` is still alive under `pid`.
fn alive(pid: i32, run: &Path) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| String::from_utf8_lossy(&c).contains(run.to_str().unwrap()))
}

/// Asserts that no process of any attempt in `output` still runs.
fn all_gone(output: &str, run: &Path) {
    for pid in started(output).concat() {
        assert!(!alive(pid, run), "process {pid} still runs:\n{output}");
    }
}

/// Complete lines of the run's metrics.jsonl.
fn logged_steps(run: &Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |t| t.matches('\n').count())
}

/// (step, loss bits) of every record of the run's metrics.jsonl.
fn curve(run: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap().to_bits())
        })
        .collect()
}

/// The loss curve of an uninterrupted two-process run of `steps` steps (the checkpoints' cadence
/// does not change it).
fn reference(steps: usize) -> Vec<(u64, u64)> {
    /// Curves already run, by step count.
    type Curves = Vec<(usize, Vec<(u64, u64)>)>;
    static CURVES: Mutex<Curves> = Mutex::new(Vec::new());
    let mut curves = CURVES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, curve)) = curves.iter().find(|c| c.0 == steps) {
        return curve.clone();
    }
    let dir = scratch(&format!("failures-reference-{steps}"));
    let run = dir.join("run");
    let (status, out, _) =
        Launched::start(&["--nproc", "2"], &train(&run, steps, 0), &[]).finish(Duration::from_secs(120));
    assert!(status.success(), "{out}");
    let curve = curve(&run);
    assert_eq!(curve.iter().map(|c| c.0).collect::<Vec<_>>(), (1..=steps as u64).collect::<Vec<_>>(), "{out}");
    curves.push((steps, curve.clone()));
    let _ = std::fs::remove_dir_all(dir);
    curve
}

/// Asserts that `run` logged the reference curve of `steps` steps, bit for bit, each step once.
fn same_curve(run: &Path, steps: usize, output: &str) {
    let got = curve(run);
    let want = reference(steps);
    assert_eq!(got.len(), want.len(), "steps logged: {:?}\n{output}", got.iter().map(|c| c.0).collect::<Vec<_>>());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(
            g,
            w,
            "step {}: loss {} after the failures, {} without\n{output}",
            g.0,
            f64::from_bits(g.1),
            f64::from_bits(w.1)
        );
    }
}

/// The steps of the run's checkpoints that have their `state.json` (written last).
fn sealed_checkpoints(run: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(run.join("checkpoints")) else { return Vec::new() };
    let mut steps: Vec<u64> = entries
        .filter_map(|e| {
            let path = e.ok()?.path();
            let step = path.file_name()?.to_str()?.strip_prefix("step-")?.parse().ok()?;
            path.join("state.json").exists().then_some(step)
        })
        .collect();
    steps.sort();
    steps
}

/// The steps of the run's complete checkpoints, each verified against its checksums.
fn verified_checkpoints(run: &Path) -> Vec<u64> {
    let mut steps = Vec::new();
    for entry in std::fs::read_dir(run.join("checkpoints")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let step: u64 =
            name.strip_prefix("step-").unwrap_or_else(|| panic!("{name} left in checkpoints/")).parse().unwrap();
        let ck = Checkpoint::open(&path).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(ck.state.step, step);
        steps.push(step);
    }
    steps.sort();
    steps
}

/// SIGKILL of one rank mid-run, in a job of 2 (FSDP) and of 4 (FSDP 2 x data 2): the others end
/// within seconds, and so does the launcher, naming the killed rank, with its status; nothing is
/// left running.
#[test]
fn a_killed_rank_ends_the_job_within_seconds_naming_it() {
    let _one = serial();
    for (nproc, victim, sets) in [("2", 1, vec![]), ("4", 2, vec!["mesh.ici_data=2"])] {
        let dir = scratch(&format!("failures-killed-{nproc}"));
        let run = dir.join("run");
        let mut job = Launched::start(&["--nproc", nproc], &train_with(&run, 100_000, 0, &sets), &[]);
        let pids = job.pids(1);
        job.wait_step(&run, 5);
        signal(pids[victim], libc::SIGKILL);
        let (status, out, took) = job.finish(Duration::from_secs(60));
        assert!(took < Duration::from_secs(20), "the job took {took:?} to end:\n{out}");
        assert_eq!(status.code(), Some(128 + libc::SIGKILL), "{out}");
        let named = format!("error: process {victim} (rank {victim}) was killed by SIGKILL; stopped the others");
        assert!(out.contains(&named), "{out}");
        // The ranks that shared a collective with it say so.
        assert!(out.contains(&format!("rank {victim} left the job")), "{out}");
        all_gone(&out, &run);
        eprintln!("{nproc} processes: the job ended {took:?} after the kill");
    }
}

/// `--max-restarts 2`: the coordinator (rank 0) killed mid-run, every process is started again,
/// resumes from the newest checkpoint, and the run ends on the uninterrupted curve, bit for bit.
#[test]
fn max_restarts_finish_the_run_on_the_uninterrupted_curve() {
    let _one = serial();
    reference(STEPS);
    let dir = scratch("failures-restart");
    let run = dir.join("run");
    let mut job = Launched::start(&["--nproc", "2", "--max-restarts", "2"], &train(&run, STEPS, EVERY), &[]);
    let pids = job.pids(1);
    job.wait_step(&run, 20);
    signal(pids[0], libc::SIGKILL);
    let (status, out, _) = job.finish(Duration::from_secs(120));
    assert!(status.success(), "{out}");
    assert!(
        out.contains("engine launch: process 0 (rank 0) was killed by SIGKILL; restarting all 2 (restart 1 of 2)"),
        "{out}"
    );
    assert_eq!(started(&out).len(), 2, "{out}");
    assert!(out.contains("resuming after step"), "{out}");
    same_curve(&run, STEPS, &out);
    all_gone(&out, &run);
}

/// A rank stopped with SIGSTOP: the other's collective times out after ENGINE_COLLECTIVE_TIMEOUT
/// with the watchdog's line, the launcher stops the job (the stopped process included) and
/// exits with the watchdog's code.
#[test]
fn a_stopped_rank_is_ended_by_the_watchdog() {
    let _one = serial();
    let dir = scratch("failures-stopped");
    let run = dir.join("run");
    let mut job = Launched::start(&["--nproc", "2"], &train(&run, 100_000, 0), &[("ENGINE_COLLECTIVE_TIMEOUT", "3")]);
    let pids = job.pids(1);
    job.wait_step(&run, 5);
    // SIGUSR2: each rank writes its flight record and trains on.
    for &pid in &pids {
        signal(pid, libc::SIGUSR2);
    }
    job.wait_until(Duration::from_secs(10), "the flight records", |_| (0..2).all(|r| flight_record(&run, r).is_some()));
    assert!((0..2).all(|r| flight_record(&run, r).unwrap()["reason"] == "SIGUSR2"));
    let steps = logged_steps(&run);
    job.wait_step(&run, steps + 2);
    signal(pids[1], libc::SIGSTOP);
    let (status, out, took) = job.finish(Duration::from_secs(60));
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(20), "the job took {took:?} to end:\n{out}");
    assert_eq!(status.code(), Some(75), "{out}");
    assert!(out.contains("ENGINE_COLLECTIVE_TIMEOUT"), "{out}");
    assert!(out.contains("error: process 0 (rank 0) exited with code 75; stopped the others"), "{out}");
    all_gone(&out, &run);
    eprintln!("the job ended {took:?} after the stop");
    // The flight recorder: rank 0 gave up in a collective, and the diagnosis names rank 1 as
    // behind, with the collective and the sequence number its own record holds.
    let zero = flight_record(&run, 0).expect("rank 0's record");
    assert!(zero["reason"].as_str().unwrap().contains("ENGINE_COLLECTIVE_TIMEOUT"), "{zero}");
    assert_eq!(zero["suspects"], serde_json::json!([1]), "{zero}");
    let (seq, op) = behind(&out, 1);
    let one = flight_record(&run, 1).expect("rank 1's record (it failed once woken to stop)");
    let entries = one["entries"].as_array().unwrap();
    assert!(
        entries.iter().any(|e| e["seq"] == seq && e["op"] == op.as_str()),
        "#{seq} {op} not in rank 1's record:\n{out}"
    );
    // The same, offline.
    let offline = common::ok(&["flight", s(&run)]);
    assert_eq!(behind(&offline, 1), (seq, op), "{offline}");
    eprintln!("{offline}");
}

/// A rank that skips one collective (the test hook of `parallel/flight.rs`) puts the job out of
/// step: the diagnosis names the rank, the collective the others ran and its sequence number,
/// which the others' records hold.
#[test]
fn a_skipped_collective_is_named_by_the_flight_recorder() {
    let _one = serial();
    let dir = scratch("failures-skipped");
    let run = dir.join("run");
    let command = train_with(&run, 100_000, 0, &["mesh.ici_fsdp=1", "mesh.ici_data=3"]);
    let env = [("ENGINE_COLLECTIVE_TIMEOUT", "3"), ("ENGINE_TEST_FLIGHT_SKIP", "2:3:all-reduce")];
    let job = Launched::start(&["--nproc", "3"], &command, &env);
    let (status, out, _) = job.finish(Duration::from_secs(120));
    assert_eq!(status.code(), Some(75), "{out}");
    all_gone(&out, &run);
    // What ranks 0 and 1 ran where rank 2 skipped: their first all-reduce of step 3.
    let record = flight_record(&run, 0).expect("rank 0's record");
    let skipped = record["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["step"] == 3 && e["op"] == "all-reduce")
        .unwrap_or_else(|| panic!("no all-reduce at step 3 in rank 0's record:\n{out}"))
        .clone();
    let seq = skipped["seq"].as_u64().unwrap();
    for rank in 1..3 {
        assert!(flight_record(&run, rank).is_some(), "rank {rank} wrote no record:\n{out}");
    }
    let mismatch =
        out.lines().find(|l| l.contains(&format!("mismatch at #{seq}: rank 2 ran #{seq} "))).unwrap_or_else(|| {
            panic!("no mismatch at #{seq} naming rank 2:\n{out}");
        });
    assert!(mismatch.contains(&format!("ranks 0, 1 ran #{seq} all-reduce over")), "{mismatch}");
    eprintln!(
        "{}",
        out.lines()
            .filter(|l| l.contains("flight") || l.starts_with("  ") || l.contains("diagnosis"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Rank `rank`'s flight record in `run`, if written.
fn flight_record(run: &Path, rank: usize) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(run.join(format!("flight/rank-{rank}.json"))).ok()?;
    Some(serde_json::from_str(&text).unwrap_or_else(|e| panic!("rank {rank}'s flight record is not JSON: {e}\n{text}")))
}

/// The sequence number and operation of the diagnosis line naming `rank` as behind.
fn behind(out: &str, rank: usize) -> (u64, String) {
    let prefix = format!("diagnosis: rank {rank} is behind: ");
    let line = out.lines().find_map(|l| l.split_once(&prefix).map(|(_, rest)| rest)).unwrap_or_else(|| {
        panic!("no diagnosis naming rank {rank} as behind:\n{out}");
    });
    let at = line.split_once('#').unwrap_or_else(|| panic!("{line}")).1;
    let (seq, rest) = at.split_once(' ').unwrap();
    let op = rest.split(" over ").next().unwrap();
    (seq.parse().unwrap(), op.to_owned())
}

/// SIGTERM to the launcher: passed on to both processes, which stop at the same step with a
/// checkpoint of it; the launcher exits with their code, and `--resume=auto` continues on the
/// uninterrupted curve.
#[test]
fn sigterm_to_the_launcher_checkpoints_and_resume_auto_continues() {
    let _one = serial();
    reference(STEPS);
    let dir = scratch("failures-sigterm");
    let run = dir.join("run");
    // No checkpoint on the cadence before the end: the one there is, the signal made.
    let mut job = Launched::start(&["--nproc", "2"], &train(&run, STEPS, 1000), &[]);
    job.wait_step(&run, 10);
    job.signal(libc::SIGTERM);
    let (status, out, took) = job.finish(Duration::from_secs(60));
    assert_eq!(status.code(), Some(STOPPED), "{out}");
    assert!(out.contains("engine launch: received SIGTERM: passed it on to the 2 processes running"), "{out}");
    all_gone(&out, &run);
    let stopped_at = curve(&run).last().unwrap().0;
    assert!(stopped_at < STEPS as u64, "the run ended before the signal:\n{out}");
    assert_eq!(verified_checkpoints(&run), vec![stopped_at], "{out}");
    eprintln!("stopped after step {stopped_at}, {took:?} after SIGTERM");

    let again = Launched::start(&["--nproc", "2"], &train(&run, STEPS, 1000), &[]);
    let (status, out, _) = again.finish(Duration::from_secs(120));
    assert!(status.success(), "{out}");
    assert!(out.contains(&format!("resuming after step {stopped_at}")), "{out}");
    same_curve(&run, STEPS, &out);
}

/// A second signal to the launcher kills the processes at once; it exits as killed by it.
#[test]
fn a_second_signal_to_the_launcher_kills_the_job() {
    let _one = serial();
    let dir = scratch("failures-second");
    let run = dir.join("run");
    let mut job = Launched::start(&["--nproc", "2"], &train(&run, 100_000, 0), &[]);
    job.wait_step(&run, 3);
    job.signal(libc::SIGINT);
    job.wait_until(Duration::from_secs(10), "the launcher's answer", |l| l.output().contains("received SIGINT"));
    job.signal(libc::SIGINT);
    let (status, out, took) = job.finish(Duration::from_secs(30));
    assert_eq!(status.code(), Some(128 + libc::SIGINT), "{out}");
    assert!(out.contains("engine launch: received SIGINT again: killing the"), "{out}");
    assert!(took < Duration::from_secs(5), "{took:?}:\n{out}");
    all_gone(&out, &run);
}

/// A launcher killed outright (SIGKILL: no chance to pass anything on) takes its processes
/// with it (PR_SET_PDEATHSIG), so none trains on holding the run directory.
#[test]
fn the_processes_die_with_a_killed_launcher() {
    let _one = serial();
    let dir = scratch("failures-launcher-killed");
    let run = dir.join("run");
    let mut job = Launched::start(&["--nproc", "2"], &train(&run, 100_000, 0), &[]);
    let pids = job.pids(1);
    job.wait_step(&run, 3);
    job.signal(libc::SIGKILL);
    let _ = job.child.wait();
    let start = Instant::now();
    while pids.iter().any(|&p| alive(p, &run)) {
        assert!(start.elapsed() < Duration::from_secs(5), "processes {pids:?} outlived their launcher");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `engine launch` as PID 1 of a PID namespace (as in `docker run IMAGE engine launch ...`),
/// where the kernel drops signals whose action is the default: SIGTERM still stops the job with
/// a checkpoint. Skipped where `unshare --pid` is not allowed.
#[test]
fn as_pid_1_sigterm_stops_the_job_with_a_checkpoint() {
    let _one = serial();
    let allowed = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !allowed {
        eprintln!("skipped: `unshare --pid` is not allowed here");
        return;
    }
    let dir = scratch("failures-pid1");
    let run = dir.join("run");
    let mut cmd = std::process::Command::new("unshare");
    cmd.args(["--pid", "--fork", "--kill-child", env!("CARGO_BIN_EXE_engine"), "launch", "--nproc", "2", "--"]);
    cmd.args(train(&run, 100_000, 0)).env_remove("ENGINE_FLAGS").env_remove("ENGINE_DEFAULT_FLAGS");
    let mut job = Launched::spawn(cmd, &[]);
    job.wait_step(&run, 3);
    let unshare = job.child.id();
    let children = std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children")).unwrap();
    let launcher: i32 = children.split_whitespace().next().expect("the launcher").parse().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{launcher}/status")).unwrap();
    assert!(status.lines().any(|l| l.starts_with("NSpid:") && l.trim_end().ends_with("\t1")), "{status}");
    signal(launcher, libc::SIGTERM);
    let (status, out, _) = job.finish(Duration::from_secs(60));
    assert_eq!(status.code(), Some(STOPPED), "{out}");
    let stopped_at = curve(&run).last().unwrap().0;
    assert_eq!(verified_checkpoints(&run), vec![stopped_at], "{out}");
}

/// 20 kills of a random rank at a random moment over one run under `--max-restarts 20`: half
/// within 0.7 s of an attempt's start (starting up, meeting, the first steps), half within
/// 0.5 s of its first step (training, saving). The run ends on the uninterrupted curve, no
/// complete checkpoint ever goes missing, and every one of the cadence is there and whole.
#[test]
fn twenty_random_kills_end_on_the_same_curve_and_lose_no_checkpoint() {
    // A checkpoint every 6 steps (about 0.15 s) takes 0.1 to 0.3 s to write: most kills in
    // training land during a save. The attempts advance about 10 steps each on average (up to
    // 35 on a fast machine): 402 steps keep the run going through all 20 kills, which 180 did
    // not always (a run that ended after 18 kills, at 13 ms a step). A multiple of EVERY, so the
    // last step's checkpoint is one of the cadence.
    const STEPS: usize = 402;
    const EVERY: usize = 6;
    let _one = serial();
    reference(STEPS);
    let dir = scratch("failures-random");
    let run = dir.join("run");
    // A process killed while the job meets leaves the other waiting for it: SIGKILL after 0.5 s.
    let launch = ["--nproc", "2", "--max-restarts", "20", "--stop-grace", "0.5"];
    let mut job = Launched::start(&launch, &train(&run, STEPS, EVERY), &[]);
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut rng = seed;
    let mut next = |n: u64| {
        rng = engine::rng::mix(rng);
        rng % n
    };
    let mut kills = Vec::new();
    // Complete checkpoints seen so far: none may go missing later.
    let mut seen: Vec<u64> = Vec::new();
    for attempt in 1..=20 {
        let pids = job.pids(attempt);
        let now = sealed_checkpoints(&run);
        let lost: Vec<&u64> = seen.iter().filter(|s| !now.contains(s)).collect();
        assert!(lost.is_empty(), "seed {seed}: checkpoints {lost:?} went missing:\n{}", job.output());
        seen = now;
        let (rank, after) = if attempt % 2 == 1 {
            (next(2) as usize, next(700))
        } else {
            // The attempt's first step: a step line after its "started" line.
            job.wait_until(Duration::from_secs(60), "a step", |l| {
                let out = l.output();
                let from = out.match_indices("engine launch: started").nth(attempt - 1).unwrap().0;
                out[from..].lines().any(|l| l.starts_with("step "))
            });
            (next(2) as usize, next(500))
        };
        std::thread::sleep(Duration::from_millis(after));
        let ended = job.child.try_wait().unwrap();
        assert!(ended.is_none(), "seed {seed}: the run ended after {} kills {kills:?}:\n{}", kills.len(), job.output());
        // SAFETY: kill has no memory-safety preconditions. (The process may have ended by itself.)
        unsafe { libc::kill(pids[rank], libc::SIGKILL) };
        kills.push((rank, after, logged_steps(&run)));
    }
    let (status, out, _) = job.finish(Duration::from_secs(120));
    let said: Vec<&str> =
        out.lines().filter(|l| !l.starts_with("step ") && !l.starts_with("saved checkpoint")).collect();
    eprintln!("{}", said.join("\n"));
    eprintln!("seed {seed}; kills (rank, ms after the start or first step, steps logged): {kills:?}");
    assert!(status.success(), "seed {seed}: {out}");
    assert!(out.contains("(restart 20 of 20)"), "{out}");
    same_curve(&run, STEPS, &out);
    let every: Vec<u64> = (1..=STEPS as u64).filter(|s| s.is_multiple_of(EVERY as u64)).collect();
    assert_eq!(verified_checkpoints(&run), every, "{out}");
    all_gone(&out, &run);
}

/// The variables that make a process rank `rank` of a torchrun-style job of two at `port`.
fn rank_of_two(rank: usize, port: &str) -> Vec<(&'static str, String)> {
    vec![
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.into()),
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", "2".into()),
        ("ENGINE_RENDEZVOUS_TIMEOUT", "60".into()),
    ]
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

/// SIGTERM to a rank waiting at the rendezvous (rank 0 for a rank that never comes, rank 1 for
/// rank 0's answer) ends it within a second, with the code of a stop that had nothing to save
/// (76, docs/launch.md), leaving no run directory; it used to say "stopping after this step"
/// and wait out the rendezvous timeout.
#[test]
fn a_stop_during_the_rendezvous_ends_the_rank_within_a_second() {
    let _one = serial();
    let dir = scratch("failures-rendezvous-stop");
    let run = dir.join("run");
    for rank in [0, 1] {
        let port = free_port();
        let env = rank_of_two(rank, &port);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        // Rank 1's rank 0 is this test: it takes rank 1's hello and answers nothing.
        let coordinator = (rank == 1).then(|| std::net::TcpListener::bind(format!("127.0.0.1:{port}")).unwrap());
        let mut job =
            Launched::spawn(engine_cmd(&train(&run, 3, 0).iter().map(String::as_str).collect::<Vec<_>>()), &env);
        // Wait until the rank is at the rendezvous: rank 0 listens, rank 1 has said hello.
        let _hello = match &coordinator {
            None => loop {
                if std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_ok() {
                    break None;
                }
                assert!(job.child.try_wait().unwrap().is_none(), "rank 0 ended:\n{}", job.output());
                std::thread::sleep(Duration::from_millis(10));
            },
            Some(listener) => {
                let (stream, _) = listener.accept().unwrap();
                let mut line = String::new();
                BufReader::new(&stream).read_line(&mut line).unwrap();
                assert!(line.starts_with("ENGINE-RENDEZVOUS"), "{line}");
                Some(stream)
            }
        };
        std::thread::sleep(Duration::from_millis(100));
        job.signal(libc::SIGTERM);
        let (status, out, took) = job.finish(Duration::from_secs(30));
        assert!(took < Duration::from_secs(1), "rank {rank} took {took:?} to stop:\n{out}");
        assert_eq!(status.code(), Some(STOPPED), "rank {rank}: {out}");
        assert!(
            out.contains("engine: stopped by SIGTERM during the rendezvous, before the first step: nothing to save"),
            "{out}"
        );
        assert!(!run.exists(), "rank {rank} left {}", run.display());
    }
}

/// A panic on a helper thread (the test hook makes the TCP collectives' readers panic at their
/// first frame) ends the process at once with 101, RUST_BACKTRACE set or not; with it set, the
/// panic used to end only the thread, and its rank waited out the collective timeout (60 s here).
#[test]
fn a_panic_on_a_helper_thread_ends_the_process_with_101() {
    let _one = serial();
    let dir = scratch("failures-panic");
    let run = dir.join("run");
    for backtrace in ["1", "0"] {
        let env =
            [("RUST_BACKTRACE", backtrace), ("ENGINE_TEST_PANIC_READER", "1"), ("ENGINE_COLLECTIVE_TIMEOUT", "60")];
        let job = Launched::start(&["--nproc", "2"], &train(&run, 3, 0), &env);
        let (status, out, took) = job.finish(Duration::from_secs(90));
        assert!(took < Duration::from_secs(20), "RUST_BACKTRACE={backtrace}: the job took {took:?}:\n{out}");
        assert_eq!(status.code(), Some(101), "RUST_BACKTRACE={backtrace}: {out}");
        assert!(out.contains("ENGINE_TEST_PANIC_READER=1: the reader of rank"), "{out}");
        all_gone(&out, &run);
        let _ = std::fs::remove_dir_all(&run);
    }
}

/// `--max-restarts` does not restart a process that exited 2 (bad input: a restart repeats it):
/// one attempt, and its error once, the processes' identical lines folded into one.
#[test]
fn bad_input_is_not_restarted_and_its_error_is_printed_once() {
    let _one = serial();
    let dir = scratch("failures-bad-input");
    let run = dir.join("run");
    let job = Launched::start(&["--nproc", "2", "--max-restarts", "3"], &train_with(&run, 3, 0, &["optim.lrr=1"]), &[]);
    let (status, out, _) = job.finish(Duration::from_secs(60));
    assert_eq!(status.code(), Some(2), "{out}");
    assert_eq!(started(&out).len(), 1, "restarted:\n{out}");
    assert_eq!(out.matches("unknown field `lrr`").count(), 1, "{out}");
    assert!(out.contains("not restarting: exit code 2 is bad input, which a restart repeats"), "{out}");
    assert!(!out.contains("restarting all"), "{out}");
}

/// A peer's frame of another length than the collective expects (headers of 2^61 and 2^40
/// elements, which were a capacity-overflow panic and an out-of-memory blamed on the recipe) ends
/// the rank in one line naming the peer, the lane and the length, exit 75. Rank 1 is this test:
/// it meets rank 0 with the same terms, connects as the mesh does, and sends the header.
#[test]
fn a_frame_of_an_unexpected_length_ends_the_rank_naming_it() {
    use engine::parallel::rendezvous::{Job, meet};
    use engine::parallel::tcp::{Header, Lane};
    use std::io::Write;
    let _one = serial();
    let dir = scratch("failures-frame");
    let run = dir.join("run");
    let args = train(&run, 3, 0);
    // The configuration rank 0 resolves from the same flags.
    let mut overrides: Vec<engine::config::Override> = args
        .windows(2)
        .filter(|w| w[0] == "--set")
        .map(|w| engine::config::Override { text: w[1].clone(), origin: "--set".into() })
        .collect();
    overrides.push(engine::config::Override { text: "train.steps=3".into(), origin: "--steps".into() });
    let config = engine::config::resolve("tiny-llama2", &overrides).unwrap().config;
    let terms = engine::parallel::job::terms(Some(&config));
    for len in [1u64 << 61, 1 << 40] {
        let port = free_port();
        let env = rank_of_two(0, &port);
        let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        env.push(("ENGINE_COLLECTIVE_TIMEOUT", "60"));
        let job = Launched::spawn(engine_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>()), &env);
        let me = Job {
            rank: 1,
            world: 2,
            local_rank: 1,
            local_world: 2,
            coordinator: format!("127.0.0.1:{port}"),
            convention: "test",
            token: "-".into(),
        };
        let meeting = meet(&me, Duration::from_secs(30), &terms, |_| Ok("-".into()), Vec::new).unwrap();
        let mut mesh = std::net::TcpStream::connect(&meeting.brought[0]).unwrap();
        mesh.write_all(b"ENGINE-TCP 1 - 1\n").unwrap();
        let header = Header::Data { lane: Lane::Step, len };
        mesh.write_all(&header.bytes()).unwrap();
        let (status, out, took) = job.finish(Duration::from_secs(90));
        assert_eq!(status.code(), Some(75), "{out}");
        let want = format!("rank 1 sent a frame of {len} elements on the step lane where");
        let line = out.lines().find(|l| l.contains(&want)).unwrap_or_else(|| panic!("expected `{want}` in:\n{out}"));
        eprintln!("{line}");
        assert!(took < Duration::from_secs(20), "{took:?}:\n{out}");
        let _ = std::fs::remove_dir_all(&run);
    }
}
