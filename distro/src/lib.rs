//! The distribution tool: pins upstream sources plus cherry-picked patches and builds
//! reproducible, dated, multi-arch OCI images of the engine.
//!
//! The folders, in the order data flows through them:
//!
//! - [`sources`]: the manifest of upstream pins and patches, its lock, and the patched source
//!   trees.
//! - [`image`]: the build pipeline: workspace, definition and patched sources -> engine binaries
//!   -> layers -> configs -> manifests -> index.
//! - [`oci`]: the OCI vocabulary everything above speaks (digests, descriptors, manifests,
//!   platforms, canonical JSON, blob store, layout).
//! - [`registry`]: the OCI distribution API client (pull, push, tags, auth).
//! - [`docker`]: the Docker engine (load an image, run a container).
//! - [`triage`]: the search for the first failing date and upstream commit.
//! - [`publish`]: where a built image goes: an OCI layout, a registry, the Docker engine.
//! - [`provenance`]: the SBOM, SLSA provenance and test summaries attached to a pushed index,
//!   and the check of the first two.
//! - [`report`]: the static dashboard of the dated images, read from the registry.
//! - [`cli`]: one file per subcommand: arguments and what it prints.
//!
//! Cross-cutting helpers sit at the root, below every folder: [`error`] (exit codes),
//! [`fsutil`] (atomic writes), [`git`] (the git runner), [`retry`] (the retry policy), [`hex`]
//! (hex and SHA-256), [`progress`] (stderr progress), [`dated`] (dated tags and calendar
//! arithmetic).

#![warn(missing_docs)]

pub mod cli;
pub mod dated;
pub mod diff;
pub mod docker;
pub mod error;
pub mod fsutil;
pub mod git;
pub mod hex;
pub mod image;
pub mod oci;
pub mod progress;
pub mod provenance;
pub mod publish;
pub mod registry;
pub mod report;
pub mod retry;
pub mod sources;
pub mod triage;
