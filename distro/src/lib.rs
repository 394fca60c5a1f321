//! The distribution tool: pins upstream sources plus cherry-picked patches and builds
//! reproducible, dated, multi-arch OCI images of the engine.
//!
//! - [`sources`]: the manifest of upstream pins and patches, its lock, and the patched source trees
//!   (`distro sources`, `fetch`, `lock`, `bump`, `patches refresh`).
//! - [`image`]: image building, a short pipeline of pure steps after ko and apko: build the
//!   engine ([`image::engine_build`]) -> layers ([`image::layer`]) -> image config
//!   ([`image::config`]) -> manifests and index ([`image::manifest`]) -> publish (an OCI layout,
//!   [`image::layout`], or a registry, [`registry`]); [`docker`] loads and runs the result.
//! - [`error`]: how failures map to exit codes and one-line messages.

pub mod dated;
pub mod docker;
pub mod error;
pub mod image;
pub mod registry;
pub mod retention;
pub mod sources;
pub mod triage;
