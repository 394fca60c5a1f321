//! Publishing a built image, after ko's build -> publish split: the build returns a
//! [`Bundle`] and does not know where it goes; each destination is a [`Publisher`]: an OCI
//! layout directory ([`layout::OciLayout`]), a registry ([`registry::Registry`]) or the local
//! Docker engine ([`daemon::Daemon`]). `distro build` and `distro push` publish through the
//! same registry publisher, so there is one way to push.
use crate::oci::bundle::Bundle;
use crate::oci::digest::Digest;
use crate::progress::Progress;
use anyhow::Result;

pub mod daemon;
pub mod layout;
pub mod registry;

/// What a publisher did.
#[derive(Clone, Debug, Default)]
pub struct Published {
    /// Each name the image is now reachable by (a ref, `REPO:TAG`), with the digest it names.
    pub names: Vec<(String, Digest)>,
    /// One line on what was written or sent, for the progress step.
    pub summary: String,
}

/// A destination for built images.
pub trait Publisher {
    /// What the progress step says while this publisher runs (`pushing to REPO`).
    fn describe(&self, bundle: &Bundle) -> String;

    /// Publishes `bundle`: every blob and manifest, then its refs.
    fn publish(&self, bundle: &Bundle, progress: &Progress) -> Result<Published>;
}

/// Runs `publisher` on `bundle` as one progress step.
pub fn publish(publisher: &dyn Publisher, bundle: &Bundle, progress: &Progress) -> Result<Published> {
    let step = progress.step(publisher.describe(bundle));
    let published = publisher.publish(bundle, progress)?;
    step.done(&published.summary);
    Ok(published)
}
