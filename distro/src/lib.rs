//! The distribution tool: pins upstream sources plus cherry-picked patches and builds
//! reproducible, dated, multi-arch OCI images of the engine.
//!
//! - [`sources`]: the manifest of upstream pins and patches, its lock, and the patched source trees
//!   (`distro sources`, `fetch`, `lock`, `bump`, `patches refresh`).
//! - [`error`]: how failures map to exit codes and one-line messages.

pub mod error;
pub mod sources;
