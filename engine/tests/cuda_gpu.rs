//! The CUDA backend on a real GPU: `engine gpu-test` (every kernel against its CPU twin, model
//! parity, graphs, recomputation, memory, 200 training steps of each tiny configuration).
//!
//! Ignored by default, so a machine without a GPU reports it as ignored — never as passed. Run it
//! where there is a GPU with `cargo test --release -p engine --test cuda_gpu -- --ignored`
//! (tests/gpu.sh does); there, no usable GPU is a failure.

use std::process::Command;

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p engine --test cuda_gpu -- --ignored (or tests/gpu.sh)"]
fn gpu_test_passes_on_this_machines_gpu() {
    let out = Command::new(env!("CARGO_BIN_EXE_engine")).arg("gpu-test").output().expect("engine runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert_ne!(out.status.code(), Some(77), "no usable GPU on this machine: nothing was checked");
    assert!(out.status.success(), "engine gpu-test failed");
}
