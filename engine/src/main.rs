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
