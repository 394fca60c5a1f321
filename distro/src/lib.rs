//! The distribution tool: pins upstream sources plus cherry-picked patches and builds
//! reproducible, dated, multi-arch OCI images of the engine.
//!
//! Image building is a short pipeline of pure steps, after ko and apko:
//! build the engine ([`image::engine_build`]) -> layers ([`image::layer`]) -> image config
//! ([`image::config`]) -> manifests and index ([`image::manifest`]) -> publish (an OCI layout,
//! [`image::layout`], or a registry, [`registry`]); [`docker`] loads and runs the result.
pub mod docker;
pub mod image;
pub mod registry;
