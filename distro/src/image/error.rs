//! Errors that mean "the input is wrong" (exit code 2) as opposed to failures (exit code 1).
use std::fmt;

/// A problem with what the user gave us: a file, a key, a flag. `main` prints it on one line and
/// exits with code 2; everything else exits with 1.
#[derive(Debug)]
pub struct BadInput(pub String);

impl fmt::Display for BadInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadInput {}

/// Returns an `anyhow::Error` carrying [`BadInput`].
pub fn bad_input(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(BadInput(msg.into()))
}

/// True when `err` (or any error in its chain) is a [`BadInput`].
pub fn is_bad_input(err: &anyhow::Error) -> bool {
    err.chain().any(|e| e.is::<BadInput>())
}

/// 1-based line number of byte offset `pos` in `text`, for messages that name a line.
pub fn line_of(text: &str, pos: usize) -> usize {
    text.as_bytes()[..pos.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1
}
