//! A registry client (OCI distribution API): pull with digest verification, push with
//! HEAD-before-upload and cross-repository mounts, Bearer and Basic auth.
pub mod auth;
pub mod client;
pub mod pull;
pub mod push;
pub mod reference;
pub mod tags;
