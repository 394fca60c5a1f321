//! Errors that mean "the input is wrong" (exit code 2): the crate's [`crate::error::BadInput`],
//! plus helpers for messages that name a line.
pub use crate::error::{BadInput, bad_input};

/// True when `err` (or any error in its chain) is a [`BadInput`].
pub fn is_bad_input(err: &anyhow::Error) -> bool {
    crate::error::exit_code(err) == 2
}

/// 1-based line number of byte offset `pos` in `text`, for messages that name a line.
pub fn line_of(text: &str, pos: usize) -> usize {
    text.as_bytes()[..pos.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1
}
