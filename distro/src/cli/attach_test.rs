//! `distro attach-test IMAGE SUMMARY --platform P`: attaches `test-all`'s `summary.json` of a run
//! on platform P to a pushed index as an OCI referrer ([`crate::provenance::test_summary`]), for
//! `distro report` to read back. Prints one line saying what was attached, and how; exit 75
//! when the registry cannot be reached.
use super::parse_index_ref;
use crate::error::bad_input;
use crate::oci::manifest::{Descriptor, is_index};
use crate::oci::platform::Platform;
use crate::oci::store::{BlobStore, MAX_DOCUMENT_BYTES};
use crate::progress::Progress;
use crate::provenance::referrers::attach;
use crate::provenance::test_summary::{TestSummary, artifact};
use crate::registry::auth::Credentials;
use crate::registry::client::{Client, mark_transient};
use anyhow::Result;
use clap::Args;
use serde_json::Value;
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

/// The arguments of `distro attach-test`.
#[derive(Args, Debug)]
pub struct AttachTestArgs {
    /// The pushed index, by tag or digest (REPO:TAG or REPO@DIGEST).
    #[arg(value_name = "IMAGE")]
    pub image: String,
    /// The `summary.json` that `test-all --report DIR` wrote.
    #[arg(value_name = "SUMMARY")]
    pub summary: PathBuf,
    /// The platform the checks ran on, one of the index's (linux/amd64, linux/arm64).
    #[arg(long, value_name = "PLATFORM", value_parser = |s: &str| Platform::parse(s))]
    pub platform: Platform,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    pub insecure: Vec<String>,
}

/// Runs `distro attach-test`.
pub fn attach_test_cmd(a: AttachTestArgs) -> Result<ExitCode> {
    let r = parse_index_ref(&a.image)?;
    let what = a.summary.display().to_string();
    let bytes = read_summary(&a.summary, &what)?;
    let summary = TestSummary::parse(&bytes, &what)?;
    let client = Client::new(Credentials::from_environment(Some(r.api_host()))?, a.insecure)?;
    let top = client.fetch_manifest(&r).map_err(mark_transient)?;
    if !is_index(&top.media_type) {
        return Err(bad_input(format!(
            "{r} is a single image manifest; attach test results to the index distro pushed"
        )));
    }
    let v: Value = serde_json::from_slice(&top.bytes)?;
    if !v["manifests"].as_array().into_iter().flatten().any(|e| a.platform.matches(&e["platform"])) {
        return Err(bad_input(format!(
            "{r} ({}) has no {} image: give --platform of one it holds",
            top.digest, a.platform
        )));
    }
    let index = Descriptor::of(&top.media_type, &top.bytes);
    let scratch = tempfile::tempdir()?;
    let store = BlobStore::new(scratch.path());
    let how = attach(
        &client,
        &r,
        &top.digest,
        &[artifact(&index, &a.platform.to_string(), &bytes, &summary)],
        &store,
        &Progress::new(),
    )
    .map_err(mark_transient)?;
    println!(
        "attached {what} ({} on {}: {} passed, {} failed, {} skipped) to {r} ({}) through the {how}",
        summary.device_class, a.platform, summary.passed, summary.failed, summary.skipped, top.digest
    );
    Ok(ExitCode::SUCCESS)
}

/// The summary's bytes, refused up front (before anything is read or sent) when it is larger
/// than [`MAX_DOCUMENT_BYTES`]: `distro report` reads no attached summary larger than that, so
/// one attached would only be left out of the dashboard.
fn read_summary(path: &std::path::Path, what: &str) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).map_err(|e| bad_input(format!("{what}: {e}")))?;
    let too_large = || {
        bad_input(format!(
            "{what}: larger than {MAX_DOCUMENT_BYTES} bytes (4 MiB), the most a test summary may have (distro report reads none larger); refusing it"
        ))
    };
    if file.metadata().map_err(|e| bad_input(format!("{what}: {e}")))?.len() > MAX_DOCUMENT_BYTES {
        return Err(too_large());
    }
    // A file that grows, or a device, is held to the limit too.
    let mut bytes = Vec::new();
    file.take(MAX_DOCUMENT_BYTES + 1).read_to_end(&mut bytes).map_err(|e| bad_input(format!("{what}: {e}")))?;
    if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
        return Err(too_large());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_over_the_limit_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("summary.json");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(400_000_000).unwrap(); // sparse: 400 MB on paper
        let what = path.display().to_string();
        let e = read_summary(&path, &what).unwrap_err();
        assert!(crate::error::is_bad_input(&e), "{e:#}");
        assert_eq!(
            crate::error::one_line(&e),
            format!(
                "{what}: larger than 4194304 bytes (4 MiB), the most a test summary may have (distro report reads none larger); refusing it"
            )
        );
        std::fs::File::create(&path).unwrap().set_len(MAX_DOCUMENT_BYTES).unwrap();
        assert_eq!(read_summary(&path, &what).unwrap().len() as u64, MAX_DOCUMENT_BYTES, "the limit itself is allowed");
    }

    #[test]
    fn a_device_is_held_to_the_limit_too() {
        let e = read_summary(std::path::Path::new("/dev/zero"), "/dev/zero").unwrap_err();
        assert!(crate::error::one_line(&e).starts_with("/dev/zero: larger than 4194304 bytes"), "{e:#}");
    }
}
