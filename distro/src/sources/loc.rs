//! Positions in the manifest's text, which its parsing and the wheels' and lock's validation
//! name in every error (a module of its own below `manifest.rs` and `wheels.rs`, which both
//! use it).

/// A 1-based line and column in the manifest file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Loc {
    /// Line number, from 1.
    pub line: usize,
    /// Column number (in characters), from 1.
    pub column: usize,
}

impl Loc {
    /// The position of byte `offset` in `text`.
    pub fn at(text: &str, offset: usize) -> Loc {
        let offset = offset.min(text.len());
        let before = &text[..floor_char_boundary(text, offset)];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
        Loc { line, column: before[line_start..].chars().count() + 1 }
    }
}

fn floor_char_boundary(text: &str, mut i: usize) -> usize {
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}
