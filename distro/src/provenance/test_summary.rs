//! `test-all`'s `summary.json` attached to a pushed index as an OCI referrer, as the SBOM and
//! provenance are, so that which dated image passed what, where, can be read back from the
//! registry alone (`distro report`).
//!
//! One artifact per run: `artifactType` [`TEST_SUMMARY_TYPE`], one layer holding the summary byte
//! for byte, annotated with the platform it ran on ([`PLATFORM_ANNOTATION`]) and its device class
//! ([`DEVICE_ANNOTATION`]: `cpu` on the architectures' runners, `cuda` on the GPU runner). The
//! same summary attached twice is the same artifact, pushed once.
use super::{Artifact, PLATFORM_ANNOTATION, artifact_manifest};
use crate::error::bad_input;
use crate::oci::manifest::Descriptor;
use anyhow::Result;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The test summary artifact's type (and its layer's media type).
pub const TEST_SUMMARY_TYPE: &str = "application/vnd.llm-distro.test-summary.v1+json";
/// The annotation naming the device class a summary's checks ran on.
pub const DEVICE_ANNOTATION: &str = "io.github.llm-distro.device-class";
/// The `format` of the summaries `test-all --report` writes.
pub const SUMMARY_FORMAT: &str = "engine-test-all-summary";

/// What the dashboard reads of a `summary.json` (docs/test-all.md has all of it).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct TestSummary {
    /// [`SUMMARY_FORMAT`].
    pub format: String,
    /// `quick` or `full`.
    pub mode: String,
    /// `cpu` or `cuda`.
    pub device_class: String,
    /// The device, in words.
    pub device: String,
    /// When the run started, UTC.
    pub started: String,
    /// Checks passed.
    pub passed: u64,
    /// Checks failed.
    pub failed: u64,
    /// Checks skipped.
    pub skipped: u64,
    /// Every check.
    #[serde(default)]
    pub checks: Vec<CheckSummary>,
}

/// One check of a summary.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct CheckSummary {
    /// Its name.
    pub name: String,
    /// `pass`, `fail` or `skip`.
    pub status: String,
    /// The figures it measured.
    #[serde(default)]
    pub measures: Vec<MeasureSummary>,
}

/// One measured figure.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct MeasureSummary {
    /// What was measured (a recipe, for throughput).
    pub name: String,
    /// The value (`null` in the JSON when it was not a finite number).
    pub value: Option<f64>,
    /// Its unit.
    pub unit: String,
}

impl TestSummary {
    /// Parses a summary; `what` names it (a file) in the one-line error, which is bad input.
    pub fn parse(bytes: &[u8], what: &str) -> Result<TestSummary> {
        let s: TestSummary = serde_json::from_slice(bytes).map_err(|e| {
            bad_input(format!("{what}: not a test-all summary.json ({e}); give the file `test-all --report DIR` wrote"))
        })?;
        if s.format != SUMMARY_FORMAT {
            return Err(bad_input(format!(
                "{what}: its format is {:?}, not {SUMMARY_FORMAT:?}; give the summary.json of `test-all --report DIR`",
                s.format
            )));
        }
        if s.checks.len() as u64 != s.passed + s.failed + s.skipped {
            return Err(bad_input(format!(
                "{what}: {} checks listed, but passed + failed + skipped = {}",
                s.checks.len(),
                s.passed + s.failed + s.skipped
            )));
        }
        Ok(s)
    }

    /// The throughput figures (`tokens/s`), by the recipe measured.
    pub fn throughput(&self) -> BTreeMap<String, f64> {
        self.checks
            .iter()
            .flat_map(|c| &c.measures)
            .filter(|m| m.unit == "tokens/s")
            .filter_map(|m| Some((m.name.clone(), m.value.filter(|v| v.is_finite())?)))
            .collect()
    }
}

/// The artifact attaching `bytes` (a summary, already parsed as `summary`) of a run on
/// `platform` to the index `index`.
pub fn artifact(index: &Descriptor, platform: &str, bytes: &[u8], summary: &TestSummary) -> Artifact {
    let layer = Descriptor {
        annotations: Some(BTreeMap::from([
            (PLATFORM_ANNOTATION.to_string(), platform.to_string()),
            (DEVICE_ANNOTATION.to_string(), summary.device_class.clone()),
        ])),
        ..Descriptor::of(TEST_SUMMARY_TYPE, bytes)
    };
    Artifact {
        artifact_type: TEST_SUMMARY_TYPE,
        manifest: artifact_manifest(TEST_SUMMARY_TYPE, index, &summary.started, &[layer]),
        blobs: vec![b"{}".to_vec(), bytes.to_vec()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::manifest::OCI_INDEX;
    use serde_json::{Value, json};

    fn summary(checks: Value, passed: u64, failed: u64) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "format": SUMMARY_FORMAT, "engine_version": "0.1.0", "revision": "abc", "mode": "quick",
            "device_class": "cpu", "device": "cpu (2 threads)", "started": "2026-01-02T03:04:05Z",
            "seconds": 12.5, "passed": passed, "failed": failed, "skipped": 0, "checks": checks,
        }))
        .unwrap()
    }

    #[test]
    fn a_summary_reads_with_its_throughput_and_a_bad_one_is_bad_input() {
        let bytes = summary(
            json!([
                {"name": "tiny-llama2", "status": "pass", "seconds": 1.0, "detail": ""},
                {"name": "throughput", "status": "fail", "seconds": 1.0, "detail": "",
                 "measures": [{"name": "tiny-llama2", "value": 1234.5, "unit": "tokens/s", "ok": false},
                              {"name": "tiny-gpt", "value": null, "unit": "tokens/s", "ok": false}]},
            ]),
            1,
            1,
        );
        let s = TestSummary::parse(&bytes, "summary.json").unwrap();
        assert_eq!((s.passed, s.failed, s.device_class.as_str()), (1, 1, "cpu"));
        assert_eq!(s.throughput(), BTreeMap::from([("tiny-llama2".to_string(), 1234.5)]));

        let e = TestSummary::parse(b"{\"format\": 3}", "x/summary.json").unwrap_err();
        assert!(crate::error::is_bad_input(&e));
        assert!(crate::error::one_line(&e).starts_with("x/summary.json: not a test-all summary.json"), "{e:#}");
        let mut v: Value = serde_json::from_slice(&bytes).unwrap();
        v["format"] = json!("junit");
        let e = TestSummary::parse(&serde_json::to_vec(&v).unwrap(), "s.json").unwrap_err();
        assert!(format!("{e}").contains("its format is \"junit\""), "{e}");
        let e = TestSummary::parse(&summary(json!([]), 1, 0), "s.json").unwrap_err();
        assert!(format!("{e}").contains("0 checks listed, but passed + failed + skipped = 1"), "{e}");
    }

    #[test]
    fn the_artifact_names_the_index_and_holds_the_summary_byte_for_byte() {
        let bytes = summary(json!([]), 0, 0);
        let s = TestSummary::parse(&bytes, "s.json").unwrap();
        let index = Descriptor::of(OCI_INDEX, b"{\"manifests\": []}");
        let a = artifact(&index, "linux/arm64/v8", &bytes, &s);
        let m: Value = serde_json::from_slice(&a.manifest).unwrap();
        assert_eq!(m["artifactType"], TEST_SUMMARY_TYPE);
        assert_eq!(m["subject"]["digest"], index.digest.as_str());
        let layer = &m["layers"][0];
        assert_eq!(layer["digest"], crate::oci::digest::Digest::of(&bytes).as_str());
        assert_eq!(layer["annotations"][PLATFORM_ANNOTATION], "linux/arm64/v8");
        assert_eq!(layer["annotations"][DEVICE_ANNOTATION], "cpu");
        assert_eq!(a.blobs[1], bytes);
        assert_eq!(artifact(&index, "linux/arm64/v8", &bytes, &s).manifest, a.manifest, "the same artifact twice");
    }
}
