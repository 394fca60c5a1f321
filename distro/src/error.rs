//! Error kinds that decide the exit code, and the one-line rendering `main` prints.
//!
//! Exit codes: 0 success, 1 the operation failed (network, git, a patch that no longer applies),
//! 2 the input is wrong (command line, manifest, lock, a patch file) and the user must fix it,
//! 75 (EX_TEMPFAIL) a transient fault a command marks as such (an unreachable registry after the
//! retries): running it again later may succeed.

use std::process::ExitCode;

/// An error caused by the user's input (manifest, lock, arguments, patch files): exit code 2.
///
/// Wrap it anywhere in an `anyhow` chain; [`exit_code`] looks through the whole chain.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// Builds an [`anyhow::Error`] carrying [`BadInput`].
pub fn bad_input(message: impl Into<String>) -> anyhow::Error {
    BadInput(message.into()).into()
}

/// A fault that may pass (a registry that cannot be reached after the retries): exit code 75.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Transient(pub String);

/// The exit code for `err`: 2 when any error in its chain is [`BadInput`], 75 when one is
/// [`Transient`], else 1.
pub fn exit_code(err: &anyhow::Error) -> u8 {
    if err.chain().any(|e| e.is::<BadInput>()) {
        2
    } else if err.chain().any(|e| e.is::<Transient>()) {
        75
    } else {
        1
    }
}

/// The error chain on a single line (`outer: inner: root cause`), newlines folded to `; `.
pub fn one_line(err: &anyhow::Error) -> String {
    let text = format!("{err:#}");
    text.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; ")
}

/// Prints `error: ...` on stderr and returns the exit code; what `main` calls on failure.
pub fn report(err: &anyhow::Error) -> ExitCode {
    eprintln!("error: {}", one_line(err));
    ExitCode::from(exit_code(err))
}

/// True when `err` (or any error in its chain) is a [`BadInput`].
pub fn is_bad_input(err: &anyhow::Error) -> bool {
    exit_code(err) == 2
}

/// 1-based line number of byte offset `pos` in `text`, for messages that name a line.
pub fn line_of(text: &str, pos: usize) -> usize {
    text.as_bytes()[..pos.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn bad_input_anywhere_in_the_chain_gives_exit_code_2() {
        let err = Err::<(), _>(bad_input("unknown key")).context("reading images/manifest.toml").unwrap_err();
        assert_eq!(exit_code(&err), 2);
        assert_eq!(exit_code(&anyhow::anyhow!("network down")), 1);
        let err =
            Err::<(), _>(anyhow::Error::from(Transient("registry down".into()))).context("listing tags").unwrap_err();
        assert_eq!(exit_code(&err), 75);
    }

    #[test]
    fn chain_is_printed_on_one_line() {
        let err = Err::<(), _>(anyhow::anyhow!("git said:\nfatal: no\n")).context("fetching main").unwrap_err();
        assert_eq!(one_line(&err), "fetching main: git said:; fatal: no");
    }
}
