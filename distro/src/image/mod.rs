//! Image building: definitions, layers, config, manifests, index, OCI layout, SBOM.
pub mod def;
pub mod digest;
pub mod error;
pub mod fsutil;
pub mod json;
pub mod layer;
pub mod platform;
