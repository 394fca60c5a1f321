#![warn(missing_docs)]
//! A training engine for Llama 2/3, Mistral and Mixtral style models, and GPT (Pax, GPT-2).
//!
//! Data flows: recipe ([`config`]) → [`model::Model`] (parameter layout) → [`model::Plan`]
//! (device memory for a batch shape) → [`train::Trainer`]: batch from [`data`], forward, loss,
//! backward, optimizer, metrics. Every op has an explicit forward and backward ([`backend`]);
//! the CPU backend is the f32 reference.
//! [`parity`] checks the CUDA backend against that reference, op by op and model by model.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod digest;
pub mod eval;
pub mod fsutil;
pub mod hf;
pub mod host;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod parity;
pub mod plot;
pub mod rng;
pub mod tensors;
pub mod testall;
pub mod train;

/// Writes one line to standard output in one system call, going on when its reader is gone
/// ([`print_line`]).
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {{
        $crate::print_line(&format!("{}\n", format_args!($($arg)*)));
    }};
}

/// Writes `line` to standard output in one system call. A reader gone away (`train … | head`,
/// where SIGPIPE is ignored) is said once on standard error and the run goes on, its lines in
/// its run directory's files; `println!` would panic there.
pub fn print_line(line: &str) {
    static CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if CLOSED.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    if let Err(e) = std::io::Write::write_all(&mut std::io::stdout(), line.as_bytes()) {
        CLOSED.store(true, std::sync::atomic::Ordering::Relaxed);
        crate::say!(
            "note: standard output closed ({e}); going on, the run's lines are in its run directory's files only"
        );
    }
}

/// Writes one line to standard error in one system call. `eprintln!` makes two (the text, then
/// the newline), and where stdout and stderr travel apart (docker's attach, a launcher's pipes)
/// another line can land between them and start mid-line.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        let line = format!("{}\n", format_args!($($arg)*));
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    }};
}
