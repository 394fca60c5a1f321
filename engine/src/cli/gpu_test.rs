//! `engine gpu-test`: the CUDA backend against the CPU reference on this machine's GPU (see
//! `engine::parity`). Exit codes: 0 all passed, 1 some failed, 77 skipped (no usable
//! GPU: nothing was checked), 2 bad arguments.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use engine::backend::cuda::{Cuda, discovery, nvrtc};
use engine::fsutil::write_atomic;
use engine::parity::{self, Outcome, Scale};

/// Exit code of a run that checked nothing (the convention of automake and meson).
pub const SKIPPED: i32 = 77;

#[derive(Args)]
pub struct GpuTestArgs {
    /// Run on the CPU emulator of a GPU instead: the same kernels and host code, shapes shrunk,
    /// needs a C++20 compiler (`CXX`); slow.
    #[arg(long)]
    emulate: bool,
    /// Training steps of each tiny configuration [default: 200 on a GPU, 20 emulated].
    #[arg(long, value_name = "N")]
    steps: Option<usize>,
    /// Run only the checks whose name contains this text (ignoring case).
    #[arg(long, value_name = "TEXT", default_value = "")]
    only: String,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(serde::Serialize)]
struct JsonOutcome<'a> {
    name: &'a str,
    passed: bool,
    detail: &'a str,
    seconds: f64,
}

pub fn run(args: GpuTestArgs) -> Result<()> {
    if !args.emulate {
        match discovery::probe() {
            Err(e) => {
                println!(
                    "SKIPPED: no usable CUDA GPU ({e}); nothing was checked (--emulate runs the checks on the CPU)"
                );
                std::process::exit(SKIPPED);
            }
            Ok(devices) => {
                let d = &devices[0];
                let nvrtc = nvrtc::version().map(|(a, b)| format!("NVRTC {a}.{b}")).unwrap_or_else(|e| e.to_string());
                println!("{} (sm_{}{}), {nvrtc}", d.name, d.capability.0, d.capability.1);
            }
        }
    } else {
        println!("CPU emulator of a GPU (shapes shrunk)");
    }
    let scale =
        Scale { emulated: args.emulate, train_steps: args.steps.unwrap_or(if args.emulate { 20 } else { 200 }) };
    let mut open = || if args.emulate { Cuda::emulated() } else { Cuda::new(0) };
    let print = &mut |o: &Outcome| {
        println!("{} {:<72} {:7.1} s  {}", if o.passed { "ok  " } else { "FAIL" }, o.name, o.seconds, o.detail)
    };
    let outcomes = parity::run(scale, &mut open, &args.only, print);
    anyhow::ensure!(!outcomes.is_empty(), "--only {}: no check has that in its name", args.only);
    if let Some(path) = &args.json {
        let rows: Vec<JsonOutcome> = outcomes
            .iter()
            .map(|o| JsonOutcome { name: &o.name, passed: o.passed, detail: &o.detail, seconds: o.seconds })
            .collect();
        write_atomic(path, serde_json::to_string_pretty(&rows)?.as_bytes())?;
    }
    let failed = outcomes.iter().filter(|o| !o.passed).count();
    println!("\n{} passed, {failed} failed", outcomes.len() - failed);
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
