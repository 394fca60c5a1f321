//! Publishing to an OCI image layout directory: blobs are linked in from the bundle's store,
//! the refs are added to `index.json` (same-named refs replaced, others kept), and blobs that
//! nothing references any more are removed.
use super::{Published, Publisher};
use crate::oci::bundle::Bundle;
use crate::oci::layout::Layout;
use crate::progress::Progress;
use anyhow::Result;
use std::path::PathBuf;

/// An OCI layout directory (created when missing).
pub struct OciLayout {
    /// The layout's directory.
    pub dir: PathBuf,
}

impl Publisher for OciLayout {
    fn describe(&self, _: &Bundle) -> String {
        format!("writing OCI layout {}", self.dir.display())
    }

    fn publish(&self, bundle: &Bundle, _: &Progress) -> Result<Published> {
        Layout::new(&self.dir).write(&bundle.store, &bundle.digests(), &bundle.refs)?;
        Ok(Published {
            names: bundle.refs.iter().map(|(n, d)| (n.clone(), d.digest.clone())).collect(),
            summary: bundle.tags().join(", "),
        })
    }
}
