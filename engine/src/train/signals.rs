//! Stopping a run on request, as schedulers ask: SIGTERM (Kubernetes, Docker, Slurm at the end
//! of a job's time), SIGUSR1 (Slurm's `--signal=USR1@SECONDS`) and SIGINT (Ctrl-C).
//!
//! The first of them asks the run to stop: the session finishes the step in progress, all ranks
//! agree on that step (each step boundary they exchange their "signal seen" flag), save a sealed
//! checkpoint of it, wait for it, and the command exits with [`STOPPED_EXIT`]. A second signal
//! ends the process at once, from the handler, with `128 + signal` (130 for SIGINT, 143 for
//! SIGTERM, 138 for SIGUSR1), as a process killed by it would report in a shell.
//!
//! The handlers are plain `sigaction` handlers that touch two atomics and, for the second signal,
//! write one line and `_exit`: everything they do is async-signal-safe. `libc` is already a
//! dependency, and the signal-hook crate would add a dependency for the same dozen lines.
//! `SA_RESTART` keeps the signal from failing the system calls it interrupts (socket reads of
//! collectives, file writes of a save).

use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// The exit code of a run stopped by a signal at a step boundary with a sealed checkpoint of that
/// step, which `--resume=auto` continues on the same curve. Next to 75, a job's collective that
/// failed (restart it: it resumes from its last checkpoint); apart from 2 (an error), 101 (a bug)
/// and `128 + signal` (a second signal, or a kill: no checkpoint of the step it stopped at).
pub const STOPPED_EXIT: u8 = 76;

/// The signals that stop a run.
pub const STOP_SIGNALS: [i32; 3] = [libc::SIGTERM, libc::SIGUSR1, libc::SIGINT];

/// Signals received by this process since the handlers were installed.
static RECEIVED: AtomicUsize = AtomicUsize::new(0);
/// The first of them (0: none yet).
static FIRST: AtomicI32 = AtomicI32::new(0);

/// The usual name of a stop signal.
pub fn name(signal: i32) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGINT => "SIGINT",
        libc::SIGUSR2 => "SIGUSR2",
        _ => "a signal",
    }
}

/// Installs the handlers of [`STOP_SIGNALS`] for the rest of the process's life.
pub fn install() -> anyhow::Result<()> {
    handle(&STOP_SIGNALS, handler)
}

/// Makes `handler` handle each of `signals` (with `SA_RESTART`), for the rest of the process's
/// life; `handler` must do only what is async-signal-safe (atomics, `write`, `_exit`).
pub fn handle(signals: &[i32], handler: extern "C" fn(libc::c_int)) -> anyhow::Result<()> {
    for &signal in signals {
        // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe (above).
        let failed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = handler as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut()) != 0
        };
        if failed {
            anyhow::bail!("cannot install the {} handler: {}", name(signal), std::io::Error::last_os_error());
        }
    }
    Ok(())
}

extern "C" fn handler(signal: libc::c_int) {
    let n = RECEIVED.fetch_add(1, Ordering::SeqCst) + 1;
    let line: &[u8] = if n == 1 {
        let _ = FIRST.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
        match signal {
            libc::SIGTERM => {
                b"engine: SIGTERM: stopping after this step with a checkpoint; a second signal exits at once\n"
            }
            libc::SIGUSR1 => {
                b"engine: SIGUSR1: stopping after this step with a checkpoint; a second signal exits at once\n"
            }
            _ => b"engine: SIGINT: stopping after this step with a checkpoint; a second signal exits at once\n",
        }
    } else {
        match signal {
            libc::SIGTERM => b"engine: second signal (SIGTERM): exiting at once, without a checkpoint of this step\n",
            libc::SIGUSR1 => b"engine: second signal (SIGUSR1): exiting at once, without a checkpoint of this step\n",
            _ => b"engine: second signal (SIGINT): exiting at once, without a checkpoint of this step\n",
        }
    };
    // SAFETY: write and _exit are async-signal-safe; the buffer is static.
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
        if n > 1 {
            libc::_exit(128 + signal);
        }
    }
}

/// The write end of the pipe SIGUSR2's handler writes a byte to ([`on_sigusr2`]).
static USR2_PIPE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn usr2_handler(_: libc::c_int) {
    let fd = USR2_PIPE.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: write is async-signal-safe; a full pipe drops the byte (a dump is on its way).
        unsafe { libc::write(fd, b"!".as_ptr().cast(), 1) };
    }
}

/// Runs `f` on a thread of its own each time the process receives SIGUSR2 (the flight
/// recorder's "write your record now", which a rank survives): the handler only writes a byte
/// to a pipe, which the thread reads, so `f` may do anything. For the rest of the process's life.
pub fn on_sigusr2(f: impl Fn() + Send + 'static) -> anyhow::Result<()> {
    let mut fds = [0; 2];
    // SAFETY: pipe writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        anyhow::bail!("cannot make the SIGUSR2 pipe: {}", std::io::Error::last_os_error());
    }
    // SAFETY: the read end is ours alone; blocking reads suit its thread.
    unsafe { libc::fcntl(fds[0], libc::F_SETFL, 0) };
    USR2_PIPE.store(fds[1], Ordering::SeqCst);
    std::thread::Builder::new().name("sigusr2".into()).spawn(move || {
        let mut byte = [0u8];
        // SAFETY: reads into a local buffer from a descriptor this thread owns.
        while unsafe { libc::read(fds[0], byte.as_mut_ptr().cast(), 1) } == 1 {
            f();
        }
    })?;
    handle(&[libc::SIGUSR2], usr2_handler)
}

/// Runs `f`, a phase before the first step that may wait long and has nothing to save (meeting
/// the job's other ranks: the rendezvous waits `ENGINE_RENDEZVOUS_TIMEOUT`, 300 s by default), and
/// ends the process within a tenth of a second when a stop signal arrives before or during it:
/// one line, then [`STOPPED_EXIT`], as a stop that saved its step, since `--resume=auto`
/// continues the run just the same. A scheduler's grace period (Kubernetes' 30 s by default,
/// Slurm's `KillWait`) is far shorter than the phase's timeout, so waiting it out would end the
/// rank with a SIGKILL anyway.
pub fn exit_on_stop_during<T>(phase: &str, f: impl FnOnce() -> T) -> T {
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let phase = phase.to_owned();
    let watcher = std::thread::spawn(move || {
        while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
            finished.recv_timeout(std::time::Duration::from_millis(50))
        {
            let signal = FIRST.load(Ordering::SeqCst);
            if signal != 0 {
                crate::say!(
                    "engine: stopped by {} {phase}, before the first step: nothing to save (exit code {STOPPED_EXIT}); start again with --resume=auto",
                    name(signal)
                );
                // `_exit`: the phase's thread may be inside a network or driver call, and
                // nothing this process holds needs a destructor or an exit handler.
                // SAFETY: ends the process at once; no memory is touched.
                unsafe { libc::_exit(STOPPED_EXIT.into()) }
            }
        }
    });
    let out = f();
    drop(done);
    let _ = watcher.join();
    out
}

/// Where a run learns that it was asked to stop: the process's signal handlers, or (tests, and
/// callers that stop a run themselves) a flag of its own.
#[derive(Debug, Clone, Default)]
pub struct StopRequest {
    own: Option<Arc<AtomicI32>>,
}

impl StopRequest {
    /// The process's signals ([`install`]); nothing is ever requested if no handler is installed.
    pub fn signals() -> StopRequest {
        StopRequest { own: None }
    }

    /// A request of its own, set with [`StopRequest::request`], apart from the process's signals.
    pub fn own() -> StopRequest {
        StopRequest { own: Some(Arc::new(AtomicI32::new(0))) }
    }

    /// Asks the run to stop, as `signal` would (a request of its own only).
    pub fn request(&self, signal: i32) {
        if let Some(own) = &self.own {
            let _ = own.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
        }
    }

    /// The signal that asked the run to stop, if one did.
    pub fn requested(&self) -> Option<i32> {
        let signal = match &self.own {
            Some(own) => own.load(Ordering::SeqCst),
            None => FIRST.load(Ordering::SeqCst),
        };
        (signal != 0).then_some(signal)
    }
}

/// The error a run that stopped on request ends with: the command exits with [`STOPPED_EXIT`].
#[derive(Debug, Clone)]
pub struct Stopped {
    /// The signal this process received (none when another rank's signal stopped the job).
    pub signal: Option<i32>,
    /// The step the run stopped after; a checkpoint of it is sealed.
    pub step: u64,
    /// That checkpoint's directory.
    pub checkpoint: std::path::PathBuf,
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let by = match self.signal {
            Some(s) => name(s).to_owned(),
            None => "another rank's signal".to_owned(),
        };
        write!(
            f,
            "stopped by {by} after step {}, with checkpoint {} (exit code {STOPPED_EXIT}); continue with --resume=auto",
            self.step,
            self.checkpoint.display()
        )
    }
}

impl std::error::Error for Stopped {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_of_its_own_is_apart_from_the_process_signals() {
        let own = StopRequest::own();
        assert_eq!(own.requested(), None);
        own.request(libc::SIGUSR1);
        own.request(libc::SIGTERM);
        assert_eq!(own.requested(), Some(libc::SIGUSR1), "the first request counts");
        assert_eq!(StopRequest::own().requested(), None);
        let stopped = Stopped { signal: Some(libc::SIGTERM), step: 7, checkpoint: "r/checkpoints/step-000007".into() };
        assert!(stopped.to_string().starts_with("stopped by SIGTERM after step 7, with checkpoint r/"), "{stopped}");
    }
}
