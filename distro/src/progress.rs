//! Progress on stderr: spinners and byte bars on a terminal, plain lines otherwise (CI logs).
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// The progress reporter of one command.
#[derive(Clone)]
pub struct Progress {
    multi: Option<MultiProgress>,
}

/// One running step: a spinner on a terminal, a `... ` line otherwise; [`Step::done`] ends it.
pub struct Step {
    bar: Option<ProgressBar>,
    msg: String,
    start: Instant,
}

impl Progress {
    /// Bars on a terminal (unless `TERM=dumb`), lines otherwise.
    pub fn new() -> Progress {
        let tty = std::io::stderr().is_terminal() && std::env::var("TERM").map(|t| t != "dumb").unwrap_or(true);
        Progress { multi: tty.then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr())) }
    }

    /// Plain lines only, even on a terminal (triage's long logs).
    pub fn plain() -> Progress {
        Progress { multi: None }
    }

    /// A line of information.
    pub fn info(&self, msg: impl AsRef<str>) {
        match &self.multi {
            Some(m) => {
                let _ = m.println(msg.as_ref());
            }
            None => eprintln!("{}", msg.as_ref()),
        }
    }

    /// Starts a step; finish it with [`Step::done`].
    pub fn step(&self, msg: impl Into<String>) -> Step {
        let msg = msg.into();
        let bar = match &self.multi {
            Some(m) => {
                let b = m.add(ProgressBar::new_spinner());
                b.set_style(ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"));
                b.set_message(msg.clone());
                b.enable_steady_tick(Duration::from_millis(120));
                Some(b)
            }
            None => {
                eprintln!("{msg} ...");
                None
            }
        };
        Step { bar, msg, start: Instant::now() }
    }

    /// A byte counter for a transfer of `total` bytes (hidden without a terminal).
    pub fn bytes(&self, total: u64, msg: impl Into<String>) -> ProgressBar {
        match &self.multi {
            Some(m) => {
                let b = m.add(ProgressBar::new(total));
                b.set_style(
                    ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}")
                        .expect("valid template")
                        .progress_chars("=> "),
                );
                b.set_message(msg.into());
                b
            }
            None => ProgressBar::hidden(),
        }
    }
}

impl Default for Progress {
    fn default() -> Self {
        Progress::new()
    }
}

impl Step {
    /// Finishes the step with a short result.
    pub fn done(self, result: impl AsRef<str>) {
        let line = format!("{}: {} ({:.2?})", self.msg, result.as_ref(), self.start.elapsed());
        match self.bar {
            Some(b) => {
                b.set_style(ProgressStyle::with_template("{msg}").expect("valid template"));
                b.finish_with_message(line)
            }
            None => eprintln!("{line}"),
        }
    }
}
