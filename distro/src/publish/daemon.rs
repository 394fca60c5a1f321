//! Publishing to the local Docker engine: `docker load` of one platform's image per ref (or the
//! tar `docker load -i` reads, written to a file).
use super::{Published, Publisher};
use crate::docker;
use crate::oci::bundle::Bundle;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use anyhow::Result;
use std::path::PathBuf;

/// The Docker engine (or a load tar for it).
pub struct Daemon {
    /// Refs of the bundle to load (empty: every ref).
    pub refs: Vec<String>,
    /// Platform to load (default: the engine's; for a tar, this machine's).
    pub platform: Option<Platform>,
    /// Repository the loaded images are tagged in: `REPO:REF`.
    pub repo: String,
    /// Write the tar here instead of loading it.
    pub output: Option<PathBuf>,
}

impl Publisher for Daemon {
    fn describe(&self, bundle: &Bundle) -> String {
        match &self.output {
            Some(out) => format!("writing a Docker load tar of {} to {}", bundle.name, out.display()),
            None => format!("loading {} into Docker", bundle.name),
        }
    }

    fn publish(&self, bundle: &Bundle, _: &Progress) -> Result<Published> {
        let loaded = docker::load(bundle, &self.refs, self.platform.as_ref(), &self.repo, self.output.as_deref())?;
        let mut summary = format!("{} image", loaded.platform);
        if !loaded.messages.is_empty() {
            summary += &format!(": {}", loaded.messages.join("; "));
        }
        let names = loaded
            .images
            .into_iter()
            .flat_map(|i| i.repo_tags.into_iter().map(move |t| (t, i.manifest.digest.clone())));
        Ok(Published { names: names.collect(), summary })
    }
}
