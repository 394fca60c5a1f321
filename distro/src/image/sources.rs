//! What the pinned upstream sources (`images/manifest.toml`, its lock, `patches/`) contribute to
//! an image build.
use super::build::SourcesInput;
use super::error::bad_input;
use super::progress::Progress;
use anyhow::Result;
use std::path::Path;

/// Resolves the build's sources: the lock of record plus `--patch`/`--source` overrides, and the
/// patched trees to wire into the engine build.
pub fn collect(start: &Path, patches: &[String], overrides: &[String], _progress: &Progress) -> Result<SourcesInput> {
    let ws = super::workspace::Workspace::open(start)?;
    if !ws.root.join("images/manifest.toml").exists() {
        if let Some(p) = patches.first().or(overrides.first()) {
            return Err(bad_input(format!(
                "{p:?}: --patch and --source need images/manifest.toml, and this checkout has none"
            )));
        }
        return Ok(SourcesInput::default());
    }
    Err(bad_input("images/manifest.toml is present but this build of distro cannot read it yet"))
}
