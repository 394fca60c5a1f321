//! Pinned upstream sources and the patches carried on top of them.
//!
//! Data flow: [`Manifest`] (`images/manifest.toml`: url/crate, tracking ref, pin, patches)
//! → [`resolve`] (fetch each pin, `git am --3way` its patches with a fixed identity and date)
//! → [`Lock`] (`images/manifest.lock`: commits or crate checksums, patch SHA-256s, tree ids)
//! → [`materialise`] (the patched trees in the content-addressed [`Cache`], verified).
//!
//! For the image build (`distro build`):
//!
//! ```no_run
//! use distro::sources::{Cache, Lock, Manifest, Overrides, lock_for_run, materialise};
//! # fn main() -> anyhow::Result<()> {
//! let manifest = Manifest::load("images/manifest.toml".as_ref())?;
//! let lock = Lock::load(&manifest.lock_path())?;
//! let overrides = Overrides {
//!     sources: vec!["cudarc=https://example.invalid/cudarc.git#main".parse().unwrap()],
//!     extra_patches: vec!["cudarc=patches/cudarc/extra.patch".parse().unwrap()],
//! };
//! let cache = Cache::from_env()?;
//! // The lock of this build: the lock of record plus the overrides, marked as such.
//! let build_lock = lock_for_run(&manifest, lock.as_ref(), &[], &overrides, &cache)?;
//! let trees = materialise(&build_lock, &manifest.root, &cache)?;
//! let _text_to_put_in_the_image = build_lock.render();
//! # let _ = trees; Ok(()) }
//! ```

pub mod apply;
pub mod bump;
pub mod cache;
pub mod cargo_pins;
pub mod edit;
pub mod loc;
pub mod lock;
pub mod manifest;
pub mod out;
pub mod refresh;
pub mod resolve;
pub mod status;
pub mod wheels;

mod crates;
mod patch;
mod trees;
mod upstream;

pub use apply::Conflict;
pub use cache::Cache;
pub use lock::{Lock, LockedPatch, LockedSource, Origin};
pub use manifest::{
    BaseSpec, CrateSpec, DEFAULT_MANIFEST, GitSpec, Manifest, PatchEntry, PatchSpec, Source, SourceKind,
};
pub use resolve::{ExtraPatch, FetchedSource, Overrides, SourceOverride, lock_for_run, materialise, resolve};
pub use status::{LockStatus, lock_status};
