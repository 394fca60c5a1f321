//! `distro sbom`: the SPDX document of the committed lock for one platform (the Dockerfile's
//! build uses it; `distro build` writes its own, from the build's lock).
use super::parse_ref;
use crate::image::build::epoch_and_date;
use crate::image::def::ImageDef;
use crate::image::sbom::{SbomInput, sbom};
use crate::image::workspace::Workspace;
use crate::oci::digest::Digest;
use crate::oci::platform::Platform;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

/// The arguments of `distro sbom`.
#[derive(Args, Debug)]
pub struct SbomArgs {
    /// Image definition: images/NAME.toml.
    #[arg(long, default_value = "engine", value_name = "NAME", value_parser = super::image_name)]
    pub image: String,
    /// Platform the SBOM describes.
    #[arg(long, value_name = "P")]
    pub platform: String,
    /// Base image (default: the definition's).
    #[arg(long, value_name = "REF")]
    pub base: Option<String>,
    /// Tag date; the version is NAME-DATE.
    #[arg(long, value_name = "YYYY-MM-DD", value_parser = super::date_arg)]
    pub date: Option<String>,
    /// Revision, when the workspace is not a git checkout (e.g. a Docker build context).
    #[arg(long, value_name = "REV")]
    pub revision: Option<String>,
    /// Write here instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// Runs `distro sbom`: the SPDX document of the committed lock (without source patches) for
/// one platform. The Dockerfile uses it; `distro build` makes its own, from the build's lock.
pub fn sbom_cmd(a: SbomArgs) -> Result<ExitCode> {
    let platform = Platform::parse(&a.platform)?;
    let start = std::env::current_dir()?;
    let ws = match Workspace::open(&start) {
        Ok(ws) => ws,
        Err(_) => Workspace::plain(&start, a.revision.as_deref())?,
    };
    let def = ImageDef::load(&ws.root.join("images").join(format!("{}.toml", a.image)))?;
    let base = match &a.base {
        Some(b) => parse_ref(b, "--base")?,
        None => def.base_reference(&ws.root)?,
    };
    let (epoch, date) = epoch_and_date(&ws, a.date.as_deref())?;
    let lock = std::fs::read(ws.root.join("Cargo.lock"))?;
    let out = std::process::Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .current_dir(&ws.root)
        .args(["metadata", "--format-version", "1", "--locked", "--filter-platform", platform.rust_target()])
        .output()?;
    if !out.status.success() {
        anyhow::bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let unknown = Digest::of(b"");
    let bytes = sbom(&SbomInput {
        image: &def.name,
        version: &format!("{}-{date}", def.name),
        platform: &platform,
        epoch,
        revision: &a.revision.clone().unwrap_or_else(|| ws.revision()),
        repository: ws.repository.as_deref(),
        lock: &lock,
        metadata: &metadata,
        roots: &def.binaries.iter().map(|b| b.package.clone()).collect::<Vec<_>>(),
        base_name: base.name(),
        base_tag: base.tag.clone(),
        // Without a registry the platform manifest is unknown: the index digest stands in.
        base_digest: base.digest.as_ref().unwrap_or(&unknown),
        // Without a registry the base's layers are not read: its packages are not listed.
        base_contents: None,
    })?;
    match a.output {
        Some(p) => crate::fsutil::write_atomic(&p, &bytes)?,
        None => println!("{}", String::from_utf8_lossy(&bytes)),
    }
    Ok(ExitCode::SUCCESS)
}
