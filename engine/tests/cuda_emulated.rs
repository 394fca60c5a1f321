//! The CUDA backend — its host code and the kernel sources NVRTC compiles — against the f32 CPU
//! reference, with the kernels running on the CPU emulator (engine::backend::cuda::emulator):
//! every op against its CPU twin, whole-model loss and gradients, graph replay, recomputation,
//! the memory estimate and a few training steps, on shapes shrunk for the emulator.
//!
//! Needs a C++20 compiler (`$CXX`, else `c++`). Without one the test prints a SKIPPED line and
//! passes, unless `ENGINE_REQUIRE_EMULATOR=1` (CI sets it) makes that a failure.
//! `ENGINE_CHECK_FILTER=text` runs only the checks whose names contain the text.

use engine::backend::cuda::{Cuda, emulator};
use engine::parity::{self, Scale};

#[test]
fn cuda_backend_matches_the_cpu_reference_on_the_emulator_or_reports_skipped() {
    if !emulator::compiler_available() {
        if std::env::var("ENGINE_REQUIRE_EMULATOR").is_ok_and(|v| v == "1") {
            panic!("ENGINE_REQUIRE_EMULATOR=1 but no C++ compiler was found (install g++ or set CXX)");
        }
        eprintln!("SKIPPED: CUDA emulator checks: no C++ compiler (install g++ or set CXX)");
        return;
    }
    let filter = std::env::var("ENGINE_CHECK_FILTER").unwrap_or_default();
    let scale = Scale { emulated: true, train_steps: 20 };
    let outcomes = parity::run(scale, &mut Cuda::emulated, &filter, &mut |o| {
        eprintln!("{} {:<70} {:6.1} s  {}", if o.passed { "ok  " } else { "FAIL" }, o.name, o.seconds, o.detail)
    });
    let failed: Vec<&str> = outcomes.iter().filter(|o| !o.passed).map(|o| o.name.as_str()).collect();
    assert!(failed.is_empty(), "failed on the emulator: {failed:?}");
    assert!(!outcomes.is_empty(), "no check matches ENGINE_CHECK_FILTER={filter}");
}
