//! The build pipeline: workspace + image definition + pinned sources -> engine binaries ->
//! layers -> image configs -> manifests -> index. It returns what it built (see
//! [`build::Built`]); publishing it is the job of the `publish` folder.
pub mod base;
pub mod build;
pub mod config;
pub mod def;
pub mod dpkg;
pub mod engine_build;
pub mod layer;
pub mod pins;
pub mod sbom;
pub mod size;
pub mod wheels;
pub mod workspace;
