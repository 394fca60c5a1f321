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
pub mod parallel;
pub mod parity;
pub mod plot;
pub mod rng;
pub mod tensors;
pub mod testall;
pub mod train;

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
