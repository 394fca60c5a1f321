#![warn(missing_docs)]
//! The `engine` command: train, inspect recipes, benchmark, describe the machine.

mod cli;

use std::alloc::{GlobalAlloc, Layout, System};
use std::process::ExitCode;

/// The system allocator, except that running out of memory ends the process with one line and
/// exit code 2 instead of Rust's abort (exit 134, "memory allocation of N bytes failed"). The
/// memory check refuses runs that cannot fit before they start (`train.memory_check`); this
/// catches what slips past it, such as memory taken by other processes meanwhile.
struct OneLineOnOom;

// SAFETY: every call is forwarded to the system allocator unchanged; a failed allocation does
// not return.
unsafe impl GlobalAlloc for OneLineOnOom {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is the system allocator's.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            out_of_memory(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            out_of_memory(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as for `alloc`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            out_of_memory(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: OneLineOnOom = OneLineOnOom;

/// Set by `engine data prepare`, whose out-of-memory line gives its own advice (the training
/// advice, a smaller batch or recomputation, means nothing there).
pub static PREPARING_DATA: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Set by the commands that build a model and its step (train, eval, bench, test-all,
/// baselines, gpu-test, launch): only their out-of-memory line advises on the batch; the others
/// (plot, goodput, flight, recipes, import and export) read files and say so.
pub static TRAINS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Writes one line and exits with code 2, allocating nothing (the heap is what failed):
/// `core::fmt` formats into a buffer on the stack.
fn out_of_memory(bytes: usize) -> ! {
    struct Line {
        bytes: [u8; 192],
        len: usize,
    }
    impl std::fmt::Write for Line {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let n = s.len().min(self.bytes.len() - self.len);
            self.bytes[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
            self.len += n;
            Ok(())
        }
    }
    let mut line = Line { bytes: [0; 192], len: 0 };
    let advice = if PREPARING_DATA.load(std::sync::atomic::Ordering::Relaxed) {
        "tokenize on fewer threads (--threads), split very large documents (--separator), or free memory"
    } else if TRAINS.load(std::sync::atomic::Ordering::Relaxed) {
        "lower train.batch_size, set train.remat, or free memory"
    } else {
        "the files this command reads need more memory than the process may take: check their sizes, or free memory"
    };
    let _ = std::fmt::Write::write_fmt(
        &mut line,
        format_args!("error: out of memory: an allocation of {bytes} bytes failed; {advice}\n"),
    );
    // SAFETY: writing a buffer we own to standard error, then ending the process at once.
    unsafe {
        libc::write(2, line.bytes.as_ptr().cast(), line.len);
        libc::_exit(2)
    }
}

fn main() -> ExitCode {
    keep_freed_memory();
    // The goodput timeline's start of the attempt, where /proc does not say.
    engine::train::goodput::process_start();
    cli::install_panic_hook();
    let args = cli::parse();
    // Die quietly when the reader of our output goes away (`engine recipes list | head`), as
    // Unix tools do, instead of failing on the write; a training run goes on (SIGPIPE stays
    // ignored, as Rust leaves it, and its lines go to its files: `engine::print_line`).
    #[cfg(unix)]
    if !args.outlives_its_reader() {
        // SAFETY: restoring the default disposition of a signal, before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error and its causes, outermost first. A fault of the job rather
            // than of its input (a rank that never arrived) is worth a restart: 75, not 2.
            cli::report_error(&format!("error: {e:#}"));
            match e.downcast_ref::<engine::parallel::Transient>() {
                Some(_) => ExitCode::from(engine::parallel::COLLECTIVE_FAILED as u8),
                None => ExitCode::from(2),
            }
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
