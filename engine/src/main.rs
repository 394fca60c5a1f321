#![warn(missing_docs)]
//! The `engine` command: train, inspect recipes, benchmark, describe the machine.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Die quietly when the reader of our output goes away (`engine recipes list | head`), as
    // Unix tools do, instead of failing on the write.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of a signal at start-up, before any thread.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    keep_freed_memory();
    cli::install_panic_hook();
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error and its causes, outermost first.
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Makes glibc's malloc keep freed memory instead of returning it to the system. The GEMM
/// library allocates its packing buffers (megabytes) at every call; with glibc's adaptive
/// thresholds those allocations can turn into fresh mappings, page-faulted in on every product,
/// which made training steps up to twice as slow depending on what ran before (measured on
/// tiny-llama2: 0.55 s instead of 0.28 s per step after a large temporary allocation).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only tunes the allocator; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
