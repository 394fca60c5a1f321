//! The OCI vocabulary, at the bottom of the crate: content digests, descriptors, manifests and
//! indexes, platforms, the canonical JSON their digests are taken over, the content-addressed
//! blob store and the OCI image layout on disk. Nothing here knows how an image is built or
//! where it is published; everything above speaks these types.
pub mod bundle;
pub mod digest;
#[cfg(test)]
pub(crate) mod fixture;
pub mod json;
pub mod layer_files;
pub mod layout;
pub mod manifest;
pub mod platform;
pub mod store;
