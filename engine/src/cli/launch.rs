//! `engine launch` starts one process per local device, watches them, restarts them all when
//! one fails (`--max-restarts`) and passes its signals on to them; `engine dist check` meets the
//! other processes of a job and reports who is who.
//!
//! The launcher is a small supervisor, and may be PID 1 of a container (`exec engine launch` in
//! the Kubernetes template, `docker run IMAGE engine launch ...`):
//!
//! - It reaps with `waitpid(-1)`, so that orphans reparented to it (as PID 1) do not pile up as
//!   zombies; a pid that is not one of its processes is reaped and forgotten.
//! - It handles SIGTERM, SIGINT and SIGUSR1 itself, which PID 1 must do: the kernel drops signals
//!   whose action is the default for a namespace's init, so an engine without handlers ignores
//!   `docker stop` until its SIGKILL.
//! - Its processes run in a process group of their own, so that Ctrl-C in a terminal (SIGINT to
//!   the terminal's foreground group) reaches only the launcher, which passes it on once; the
//!   processes would otherwise see it twice (from the terminal and from the launcher) and take
//!   the second for "stop at once".
//! - They die with it ([`spawn`]'s `PR_SET_PDEATHSIG`), so that a launcher killed abruptly
//!   leaves no process training on, holding the run directory's lock.
//! - Each process writes its final error line to a pipe of the launcher's ([`ERROR_FD`]) rather
//!   than to standard error, so that the launcher prints the lines of an attempt once it has
//!   ended, identical lines of several processes folded into one: bad input that every rank
//!   reads alike is one line, not one per process.

use std::io::{PipeReader, Read, Write};
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use engine::parallel::{job, rendezvous};
use engine::say;

/// How often the launcher looks at its processes and signals.
const POLL: Duration = Duration::from_millis(20);

/// The exit code of `engine train` stopped by SIGTERM, SIGINT or SIGUSR1 after writing its
/// checkpoint (76): not a failure, so not restarted.
const EXIT_STOPPED_ON_SIGNAL: i32 = engine::train::signals::STOPPED_EXIT as i32;

/// The exit code of bad input, which running the command again repeats: never restarted.
const EXIT_BAD_INPUT: i32 = 2;

/// The variable naming the file descriptor where a process started by `engine launch` writes
/// its final error line ([`super::report_error`]), the write end of a pipe the launcher reads.
pub const ERROR_FD: &str = "ENGINE_LAUNCH_ERROR_FD";

#[derive(Args)]
pub struct LaunchArgs {
    /// Processes to start on this node, one per device.
    #[arg(long, value_name = "N")]
    nproc: usize,
    /// When a process fails, stop the others and start all of them again, at most N times
    /// (torchrun's --max-restarts; the command should resume, as `train --resume=auto` does).
    #[arg(long, value_name = "N", default_value_t = 0)]
    max_restarts: usize,
    /// Seconds the processes still running when one fails get to exit after SIGTERM, before
    /// SIGKILL.
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
    stop_grace: f64,
    /// The engine command each process runs, after `--` (e.g. `-- train --recipe llama3-8b`).
    #[arg(last = true, required = true, value_name = "ARGS")]
    command: Vec<String>,
}

#[derive(Subcommand)]
pub enum DistCommand {
    /// Discover this process's rank from the launcher's variables, meet every other process of
    /// the job, and print who is who (a quick test of a cluster's setup).
    Check {
        /// Seconds to wait for every rank [default: ENGINE_RENDEZVOUS_TIMEOUT or 300].
        #[arg(long, value_name = "SECONDS")]
        timeout: Option<f64>,
    },
}

/// Seconds allowed for every rank to arrive, from `ENGINE_RENDEZVOUS_TIMEOUT` (default 300).
pub fn check(cmd: DistCommand) -> Result<()> {
    let DistCommand::Check { timeout } = cmd;
    let job = rendezvous::discover(|k| std::env::var(k).ok())?;
    // Rank 0 makes a token; everyone printing the same one shows they met the same coordinator.
    let token = rendezvous::rendezvous(&job, job::rendezvous_timeout(timeout)?, &job::terms(None), || {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        engine::rng::mix(seed ^ std::process::id() as u64).to_le_bytes().to_vec()
    })?;
    let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
    engine::out!(
        "rank {} of {} (local {} of {}), {} node(s), via {}: rendezvous at {} ok, token {hex}",
        job.rank,
        job.world,
        job.local_rank,
        job.local_world,
        job.nodes(),
        job.convention,
        if job.coordinator.is_empty() { "-" } else { &job.coordinator }
    );
    Ok(())
}

pub fn launch(args: LaunchArgs) -> Result<()> {
    anyhow::ensure!(args.nproc > 0, "--nproc must be at least 1");
    anyhow::ensure!(
        args.stop_grace >= 0.0 && args.stop_grace.is_finite(),
        "--stop-grace must be a number of seconds, 0 or more"
    );
    let grace = Duration::from_secs_f64(args.stop_grace);
    let exe = std::env::current_exe().context("cannot find the engine executable")?;
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    // Per-process variables: a node-level convention (MaxText/Vertex) only needs the local rank;
    // a single node needs a whole torchrun-style job description.
    let (single_node, first_rank) = if var("JAX_COORDINATOR_ADDRESS").is_some() {
        let per_node: usize = var("GPUS_PER_NODE").and_then(|v| v.parse().ok()).unwrap_or(0);
        if per_node != args.nproc {
            bail!(
                "GPUS_PER_NODE = {} but --nproc {}: they must agree",
                var("GPUS_PER_NODE").unwrap_or_default(),
                args.nproc
            );
        }
        let node: usize = var("NODE_RANK").and_then(|v| v.trim().parse().ok()).unwrap_or(0);
        (false, node * per_node)
    } else if var("SLURM_PROCID").is_some() {
        bail!(
            "under Slurm, start one task per device with `srun --ntasks-per-node=N engine ...` instead of `engine launch`"
        );
    } else if var("RANK").is_some() || var("MASTER_ADDR").is_some() {
        bail!(
            "RANK/MASTER_ADDR are already set (a torchrun-style launcher started this process): run the command directly"
        );
    } else {
        (true, 0)
    };
    if args.max_restarts > 0 && trains_without_auto_resume(&args.command) {
        say!(
            "engine launch: warning: --max-restarts {} restarts `train` without --resume=auto: a restarted process cannot continue the run",
            args.max_restarts
        );
    }
    signals::install()?;
    let mut restarts = 0;
    loop {
        // A fresh port for every attempt (the last attempt's may still be in use), and on one
        // node a fresh job token, so that nothing left of an earlier attempt joins this one.
        // Across nodes the launchers cannot agree on one: the user's ENGINE_JOB_TOKEN, if any.
        let node = match single_node {
            true => Some((free_port()?, var("ENGINE_JOB_TOKEN").unwrap_or_else(|| job_token(restarts)))),
            false => None,
        };
        let attempt = engine::parallel::flight::now_us();
        let mut procs = start(&exe, &args, node, first_rank)?;
        let end = supervise(&mut procs, grace);
        report_errors(&mut procs);
        if let (End::Failed(_), Some(dir)) = (&end, run_dir(&args.command)) {
            diagnose(&dir, attempt);
        }
        let failed = match end {
            End::Done => return Ok(()),
            End::Stopped(code) => {
                say!(
                    "engine launch: the processes stopped on a signal; exit code {code}{}",
                    if code == EXIT_STOPPED_ON_SIGNAL { " (checkpoint written)" } else { "" }
                );
                exit(code)
            }
            End::Killed(signal) => exit(128 + signal),
            End::Failed(i) => i,
        };
        let (p, outcome) = (&procs[failed], procs[failed].outcome.expect("a failed process has ended"));
        let cause = format!("process {} (rank {}) {outcome}", p.local, p.rank);
        if let Some(signal) = signals::first() {
            say!("error: {cause}; stopped the others; not restarting: engine launch received {}", signal_name(signal));
            exit(outcome.exit_code());
        }
        if outcome == Outcome::Code(EXIT_BAD_INPUT) && args.max_restarts > 0 {
            say!(
                "error: {cause}; stopped the others; not restarting: exit code 2 is bad input, which a restart repeats"
            );
            exit(EXIT_BAD_INPUT);
        }
        if restarts == args.max_restarts {
            let left = match args.max_restarts {
                0 => String::new(),
                n => format!("; no restarts left ({n} of {n} used)"),
            };
            say!("error: {cause}; stopped the others{left}");
            exit(outcome.exit_code());
        }
        restarts += 1;
        say!("engine launch: {cause}; restarting all {} (restart {restarts} of {})", args.nproc, args.max_restarts);
    }
}

/// The run directory of `command`'s `--run-dir`, where its ranks write their flight records.
fn run_dir(command: &[String]) -> Option<std::path::PathBuf> {
    let at = command.iter().position(|a| a == "--run-dir").and_then(|i| command.get(i + 1));
    let joined = command.iter().find_map(|a| a.strip_prefix("--run-dir="));
    at.map(String::as_str).or(joined).map(std::path::PathBuf::from)
}

/// Prints the flight recorder's diagnosis of the attempt that started at `since` (Unix µs)
/// from the records its ranks wrote to `RUN_DIR/flight/`; nothing when none wrote one.
fn diagnose(run_dir: &Path, since: u64) {
    let dir = run_dir.join(engine::parallel::flight::DIR);
    if !dir.is_dir() {
        return;
    }
    match engine::parallel::flight::diagnose_since(&dir, since) {
        Ok(diagnosis) => say!("engine launch: {diagnosis}"),
        Err(e) if e.to_string().contains("no flight records") => {}
        Err(e) => say!("engine launch: the flight records could not be read: {e:#}"),
    }
}

/// Whether `command` runs `train` without `--resume=auto`, so that a restart could not continue.
fn trains_without_auto_resume(command: &[String]) -> bool {
    let auto = command.windows(2).any(|w| w[0] == "--resume" && w[1] == "auto");
    command.iter().any(|a| a == "train") && !auto && !command.iter().any(|a| a == "--resume=auto")
}

/// A token for one attempt of a single-node job: unique to this launcher, attempt and moment.
fn job_token(attempt: usize) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    format!("launch-{}-{attempt}-{:016x}", std::process::id(), engine::rng::mix(nanos ^ std::process::id() as u64))
}

fn free_port() -> Result<u16> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("no free port for the rendezvous")
        .map(|a| a.port())
}

/// "1 process", "4 processes".
fn processes(n: usize) -> String {
    format!("{n} process{}", if n == 1 { "" } else { "es" })
}

/// Ends the launcher with `code`, standard error flushed.
fn exit(code: i32) -> ! {
    let _ = std::io::stderr().flush();
    std::process::exit(code)
}

/// One started process.
struct Proc {
    /// Its local rank.
    local: usize,
    /// Its global rank.
    rank: usize,
    pid: libc::pid_t,
    /// How it ended, once reaped.
    outcome: Option<Outcome>,
    /// The read end of the pipe it writes its final error line to ([`ERROR_FD`]).
    errors: PipeReader,
}

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Code(i32),
    Signal(i32),
}

impl Outcome {
    /// The exit code a shell reports for it: the code, or 128 + the signal's number.
    fn exit_code(self) -> i32 {
        match self {
            Outcome::Code(c) => c,
            Outcome::Signal(s) => 128 + s,
        }
    }

    fn failed(self) -> bool {
        self != Outcome::Code(0) && self != Outcome::Code(EXIT_STOPPED_ON_SIGNAL)
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Code(c) => write!(f, "exited with code {c}"),
            Outcome::Signal(s) => write!(f, "was killed by {}", signal_name(*s)),
        }
    }
}

fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return format!("signal {signal}"),
    };
    name.to_owned()
}

/// Starts the `--nproc` processes of one attempt, in one process group, and says which pid is
/// which rank (one line on standard error, which tests and people can read).
fn start(exe: &Path, args: &LaunchArgs, node: Option<(u16, String)>, first_rank: usize) -> Result<Vec<Proc>> {
    let mut procs: Vec<Proc> = Vec::with_capacity(args.nproc);
    let mut group = 0;
    for local in 0..args.nproc {
        let mut cmd = Command::new(exe);
        cmd.args(&args.command).env("LOCAL_RANK", local.to_string()).env("LOCAL_WORLD_SIZE", args.nproc.to_string());
        if let Some((port, token)) = &node {
            cmd.env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", local.to_string())
                .env("WORLD_SIZE", args.nproc.to_string())
                .env("ENGINE_JOB_TOKEN", token);
        }
        if run_dir(&args.command).is_some() {
            // The launcher prints the flight recorder's diagnosis; rank 0 need not.
            cmd.env(engine::parallel::flight::LAUNCHER_DIAGNOSES, "1");
        }
        let (errors, writer) = std::io::pipe().context("cannot make a pipe for a process's errors")?;
        cmd.env(ERROR_FD, writer.as_raw_fd().to_string());
        let spawned = spawn(cmd, group, writer.as_raw_fd());
        // The process holds the write end now: the pipe ends when the process does.
        drop(writer);
        match spawned {
            Ok(pid) => {
                if local == 0 {
                    group = pid;
                }
                procs.push(Proc { local, rank: first_rank + local, pid, outcome: None, errors });
            }
            Err(e) => {
                signal_running(&procs, libc::SIGKILL);
                while procs.iter().any(|p| p.outcome.is_none()) {
                    reap(&mut procs);
                    std::thread::sleep(POLL);
                }
                bail!("cannot start process {local}: {e}");
            }
        }
    }
    let list: Vec<String> = procs.iter().map(|p| format!("rank {} pid {}", p.rank, p.pid)).collect();
    let at = node.map(|(p, _)| format!(", rendezvous at 127.0.0.1:{p}")).unwrap_or_default();
    say!("engine launch: started {} ({}){at}", processes(procs.len()), list.join(", "));
    Ok(procs)
}

/// Spawns `cmd` in process group `group` (a new one when 0), passing it the file descriptor
/// `errors` (which is closed on exec otherwise); returns its pid.
fn spawn(mut cmd: Command, group: libc::pid_t, errors: i32) -> std::io::Result<libc::pid_t> {
    // SAFETY: getpid has no preconditions.
    let launcher = unsafe { libc::getpid() };
    cmd.process_group(group);
    // The child asks the kernel for SIGKILL when the launcher dies, so that a launcher killed
    // abruptly (SIGKILL, the OOM killer, a crash) leaves no process training on while holding
    // the run directory's lock. SIGKILL rather than SIGTERM: with nobody left to watch them,
    // processes stopping one by one at different steps would only hang in collectives. The
    // signal is tied to the thread that forked, so processes are only ever spawned from the
    // launcher's main thread, which lives as long as the launcher. If the launcher died between
    // fork and prctl, the parent is already someone else: give up at once.
    // SAFETY: between fork and exec the closure only makes async-signal-safe system calls and
    // allocates nothing on its success path.
    unsafe {
        cmd.pre_exec(move || {
            // (Linux only; elsewhere the processes outlive a launcher killed outright.)
            #[cfg(target_os = "linux")]
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                libc::_exit(128 + libc::SIGKILL);
            }
            if libc::fcntl(errors, libc::F_SETFD, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // The `Child` is dropped without waiting: the launcher reaps with waitpid(-1) ([`reap`]).
    Ok(cmd.spawn()?.id() as libc::pid_t)
}

/// Prints the final error lines the processes of an attempt wrote ([`ERROR_FD`]), once each:
/// a line several processes wrote alike is one line that says how many did. Called once every
/// process has ended, so each pipe holds all its process wrote; a descriptor some grandchild
/// still holds is read without waiting.
fn report_errors(procs: &mut [Proc]) {
    let mut lines: Vec<(String, Vec<usize>)> = Vec::new();
    for p in procs.iter_mut() {
        // SAFETY: fcntl on a descriptor this process owns.
        unsafe { libc::fcntl(p.errors.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
        let mut text = Vec::new();
        let _ = (&mut p.errors).take(1 << 16).read_to_end(&mut text);
        for line in String::from_utf8_lossy(&text).lines().filter(|l| !l.trim().is_empty()) {
            match lines.iter_mut().find(|(l, _)| l == line) {
                Some((_, ranks)) => ranks.push(p.rank),
                None => lines.push((line.to_owned(), vec![p.rank])),
            }
        }
    }
    for (line, ranks) in lines {
        say!("{}", folded(&line, &ranks));
    }
}

/// A line and the ranks that wrote it: `LINE (rank 1)`, `LINE (4 ranks said it: 0, 1, 2, 3)`.
fn folded(line: &str, ranks: &[usize]) -> String {
    match ranks {
        [rank] => format!("{line} (rank {rank})"),
        _ => {
            let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
            format!("{line} ({} ranks said it: {})", ranks.len(), list.join(", "))
        }
    }
}

/// How an attempt ended.
enum End {
    /// Every process exited 0.
    Done,
    /// This process failed first; the others were stopped.
    Failed(usize),
    /// The processes stopped on a signal (the launcher's, passed on, or their own): the exit
    /// code to end with.
    Stopped(i32),
    /// A second signal to the launcher (this one) made it kill them.
    Killed(i32),
}

/// Watches the processes of one attempt until every one has ended:
///
/// - the first failure (an exit code other than 0 and [`EXIT_STOPPED_ON_SIGNAL`], or a signal)
///   stops the others: SIGTERM, and SIGKILL `grace` later;
/// - a process exiting with [`EXIT_STOPPED_ON_SIGNAL`] (someone signalled it, so the job
///   stops at the step all agree on) is waited for with the others, and not restarted;
/// - the launcher's first SIGTERM, SIGINT or SIGUSR1 is passed on to every process, which then
///   write a checkpoint and exit; its second kills them;
/// - SIGUSR2 is passed on every time (the ranks write their flight records and train on).
fn supervise(procs: &mut [Proc], grace: Duration) -> End {
    let mut failure: Option<usize> = None;
    let mut kill_at: Option<Instant> = None;
    let mut stopping = false;
    let mut killed: Option<i32> = None;
    let (mut handled, mut usr2_handled) = (0, 0);
    loop {
        let fresh = reap(procs);
        let usr2 = signals::usr2_received();
        if usr2 > usr2_handled {
            usr2_handled = usr2;
            let running = procs.iter().filter(|p| p.outcome.is_none()).count();
            signal_running(procs, libc::SIGUSR2);
            say!(
                "engine launch: received SIGUSR2: passed it on to the {} running, which write their flight records and train on",
                processes(running)
            );
        }
        if failure.is_none() && !stopping && killed.is_none() {
            let ended = |i: &usize| procs[*i].outcome.expect("reaped");
            if let Some(&i) = fresh.iter().find(|i| ended(i) == Outcome::Code(EXIT_STOPPED_ON_SIGNAL)) {
                stopping = true;
                let p = &procs[i];
                say!(
                    "engine launch: process {} (rank {}) stopped on a signal and wrote a checkpoint; waiting for the others, not restarting",
                    p.local,
                    p.rank
                );
            } else if let Some(i) = cause(procs, &fresh) {
                // The survivors usually end by themselves within moments (the collectives'
                // watchdog notices a peer gone); SIGCONT wakes a stopped one to take its SIGTERM.
                failure = Some(i);
                signal_running(procs, libc::SIGTERM);
                signal_running(procs, libc::SIGCONT);
                kill_at = Some(Instant::now() + grace);
            }
        }
        let (count, last) = signals::received();
        if count > handled {
            let running = procs.iter().filter(|p| p.outcome.is_none()).count();
            if handled == 0 {
                if failure.is_none() && !stopping {
                    signal_running(procs, last);
                    signal_running(procs, libc::SIGCONT);
                    say!(
                        "engine launch: received {}: passed it on to the {} running; waiting for them to write a checkpoint and exit (another signal kills them)",
                        signal_name(last),
                        processes(running)
                    );
                } else {
                    say!(
                        "engine launch: received {}: waiting for the {} running to stop, not restarting (another signal kills them)",
                        signal_name(last),
                        processes(running)
                    );
                }
                stopping = true;
            }
            if count >= 2 && killed.is_none() {
                say!("engine launch: received {} again: killing the {} running", signal_name(last), processes(running));
                signal_running(procs, libc::SIGKILL);
                killed = Some(last);
            }
            handled = count;
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            signal_running(procs, libc::SIGKILL);
            kill_at = None;
        }
        if procs.iter().all(|p| p.outcome.is_some()) {
            if let Some(signal) = killed {
                return End::Killed(signal);
            }
            if let Some(i) = failure {
                return End::Failed(i);
            }
            if stopping {
                return End::Stopped(exit_code(procs));
            }
            return End::Done;
        }
        std::thread::sleep(POLL);
    }
}

/// The process whose failure the others' ending follows, among those just reaped: one killed by
/// a signal first (the others then fail for lack of it), then the lowest rank.
fn cause(procs: &[Proc], fresh: &[usize]) -> Option<usize> {
    let outcome = |i: usize| procs[i].outcome.expect("reaped");
    let failed: Vec<usize> = fresh.iter().copied().filter(|&i| outcome(i).failed()).collect();
    let by_signal = failed.iter().copied().filter(|&i| matches!(outcome(i), Outcome::Signal(_))).min();
    by_signal.or_else(|| failed.iter().copied().min())
}

/// The exit code of processes that all ended: the lowest rank's failure, else
/// [`EXIT_STOPPED_ON_SIGNAL`] if one stopped so, else 0.
fn exit_code(procs: &[Proc]) -> i32 {
    let outcomes: Vec<Outcome> = procs.iter().filter_map(|p| p.outcome).collect();
    if let Some(failed) = outcomes.iter().find(|o| o.failed()) {
        return failed.exit_code();
    }
    if outcomes.contains(&Outcome::Code(EXIT_STOPPED_ON_SIGNAL)) { EXIT_STOPPED_ON_SIGNAL } else { 0 }
}

/// Reaps every child that has ended, without blocking; returns the indices of the processes
/// among them. Others are orphans reparented to the launcher as a container's PID 1.
fn reap(procs: &mut [Proc]) -> Vec<usize> {
    let mut fresh = Vec::new();
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes the status into a local.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return fresh;
        }
        let outcome = if libc::WIFEXITED(status) {
            Outcome::Code(libc::WEXITSTATUS(status))
        } else if libc::WIFSIGNALED(status) {
            Outcome::Signal(libc::WTERMSIG(status))
        } else {
            continue;
        };
        if let Some(i) = procs.iter().position(|p| p.pid == pid && p.outcome.is_none()) {
            procs[i].outcome = Some(outcome);
            fresh.push(i);
        }
    }
}

/// Sends `signal` to every process not reaped yet (whose pid therefore cannot have been reused).
fn signal_running(procs: &[Proc], signal: i32) {
    for p in procs.iter().filter(|p| p.outcome.is_none()) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe {
            libc::kill(p.pid, signal);
        }
    }
}

/// The launcher's handling of SIGTERM, SIGINT and SIGUSR1, and SIGUSR2: counted, acted on by
/// [`supervise`].
mod signals {
    use super::*;

    static COUNT: AtomicUsize = AtomicUsize::new(0);
    static FIRST: AtomicI32 = AtomicI32::new(0);
    static LAST: AtomicI32 = AtomicI32::new(0);

    extern "C" fn on_signal(signal: libc::c_int) {
        // Only atomics: async-signal-safe.
        let _ = FIRST.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
        LAST.store(signal, Ordering::SeqCst);
        COUNT.fetch_add(1, Ordering::SeqCst);
    }

    /// SIGUSR2s received: the flight recorder's "write your record now", passed on to the
    /// ranks, which train on.
    static USR2: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn on_usr2(_: libc::c_int) {
        USR2.fetch_add(1, Ordering::SeqCst);
    }

    pub fn install() -> Result<()> {
        engine::train::signals::handle(&engine::train::signals::STOP_SIGNALS, on_signal)?;
        engine::train::signals::handle(&[libc::SIGUSR2], on_usr2)
    }

    /// SIGUSR2s received so far.
    pub fn usr2_received() -> usize {
        USR2.load(Ordering::SeqCst)
    }

    /// Signals received so far, and the last one.
    pub fn received() -> (usize, i32) {
        let count = COUNT.load(Ordering::SeqCst);
        (count, LAST.load(Ordering::SeqCst))
    }

    /// The first signal received, if any.
    pub fn first() -> Option<i32> {
        Some(FIRST.load(Ordering::SeqCst)).filter(|&s| s != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_directory_is_read_from_the_command() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(run_dir(&args(&["train", "--run-dir", "runs/a"])), Some("runs/a".into()));
        assert_eq!(run_dir(&args(&["train", "--run-dir=runs/b", "--steps", "3"])), Some("runs/b".into()));
        assert_eq!(run_dir(&args(&["train", "--recipe", "r"])), None);
    }

    #[test]
    fn identical_lines_of_several_processes_are_folded_into_one() {
        assert_eq!(folded("error: x", &[1]), "error: x (rank 1)");
        assert_eq!(folded("error: x", &[0, 1, 2]), "error: x (3 ranks said it: 0, 1, 2)");
    }
}
