//! What `test-all` reports: the table on stdout, and with `--report DIR` a JUnit XML file
//! (`junit.xml`, the schema CI systems read: one `testsuite`, one `testcase` per check with a
//! `failure` or `skipped` element), a JSON summary (`summary.json`) and a page to look at
//! (`report.html`, drawn by `html.rs`), each written atomically by [`super::write_report`]; the
//! first two name the page.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use super::baselines::Reference;
use super::{DeviceClass, Mode, Outcome, Status, Target};
use crate::fsutil::write_atomic;

/// The report page's file name in the report directory.
pub const HTML: &str = "report.html";

/// `summary.json`.
#[derive(Debug, Serialize)]
pub struct Summary<'a> {
    /// `engine-test-all-summary`.
    pub format: &'static str,
    /// The engine's version.
    pub engine_version: &'static str,
    /// Its source revision, when the build knew it.
    pub revision: &'static str,
    /// The image the checks ran in (`REPO@sha256:...`), as `--image` or `ENGINE_IMAGE` named it.
    pub image: Option<String>,
    /// The page that shows this summary, beside it: [`HTML`].
    pub report: &'static str,
    /// Quick or full.
    pub mode: Mode,
    /// The device class the checks ran on.
    pub device_class: DeviceClass,
    /// The device, in words.
    pub device: String,
    /// The baseline file compared with, if any check used one.
    pub baselines: Option<String>,
    /// How the curves were compared ([`Reference::label`]): `cpu baseline`, `cuda baseline` or
    /// `cpu baseline, bf16 tolerance`; absent when no check compared.
    pub reference: Option<&'static str>,
    /// When the run started, UTC.
    pub started: String,
    /// Wall time of the whole run.
    pub seconds: f64,
    /// Checks passed.
    pub passed: usize,
    /// Checks failed.
    pub failed: usize,
    /// Checks skipped.
    pub skipped: usize,
    /// Every check, in the order run.
    pub checks: &'a [Outcome],
}

impl<'a> Summary<'a> {
    /// Counts the outcomes.
    pub fn new(
        mode: Mode,
        target: Target,
        reference: Option<&Reference>,
        started: String,
        seconds: f64,
        checks: &'a [Outcome],
    ) -> Summary<'a> {
        let count = |s: Status| checks.iter().filter(|o| o.status == s).count();
        Summary {
            format: "engine-test-all-summary",
            engine_version: env!("CARGO_PKG_VERSION"),
            revision: option_env!("ENGINE_REVISION").unwrap_or("unknown"),
            image: None,
            report: HTML,
            mode,
            device_class: target.class(),
            device: target.describe(),
            baselines: reference.map(|r| r.file.path.display().to_string()),
            reference: reference.map(Reference::label),
            started,
            seconds,
            passed: count(Status::Pass),
            failed: count(Status::Fail),
            skipped: count(Status::Skip),
            checks,
        }
    }
}

/// One table row: check, status, time, detail.
pub fn row(o: &Outcome) -> String {
    let status = match o.status {
        Status::Pass => "pass",
        Status::Fail => "FAIL",
        Status::Skip => "skip",
    };
    format!("{:<18} {:<6} {:>8.1} s  {}", o.name, status, o.seconds, o.detail)
}

/// The table's header line.
pub fn header() -> String {
    format!("{:<18} {:<6} {:>10}  {}", "check", "status", "time", "detail")
}

/// The JUnit XML document of a run.
pub fn junit(s: &Summary) -> String {
    let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        x,
        "<testsuites name=\"test-all\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" time=\"{:.3}\">",
        s.checks.len(),
        s.failed,
        s.skipped,
        s.seconds
    );
    let _ = writeln!(
        x,
        "  <testsuite name=\"test-all {} {}\" tests=\"{}\" failures=\"{}\" errors=\"0\" skipped=\"{}\" time=\"{:.3}\" timestamp=\"{}\" hostname=\"{}\">",
        s.device_class.name(),
        s.mode.name(),
        s.checks.len(),
        s.failed,
        s.skipped,
        s.seconds,
        escape(s.started.trim_end_matches('Z')),
        escape(&s.device)
    );
    let _ = writeln!(x, "    <properties>\n      <property name=\"report\" value=\"{HTML}\"/>");
    if let Some(image) = &s.image {
        let _ = writeln!(x, "      <property name=\"image\" value=\"{}\"/>", escape(image));
    }
    let _ = writeln!(x, "      <property name=\"revision\" value=\"{}\"/>\n    </properties>", escape(s.revision));
    for o in s.checks {
        let _ = write!(
            x,
            "    <testcase name=\"{}\" classname=\"test-all.{}\" time=\"{:.3}\"",
            escape(&o.name),
            s.device_class.name(),
            o.seconds
        );
        match o.status {
            Status::Pass => {
                let _ = writeln!(x, ">\n      <system-out>{}</system-out>\n    </testcase>", escape(&o.detail));
            }
            Status::Fail => {
                let _ = writeln!(
                    x,
                    ">\n      <failure message=\"{}\">{}</failure>\n    </testcase>",
                    escape(&o.detail),
                    escape(&o.detail)
                );
            }
            Status::Skip => {
                let _ = writeln!(x, ">\n      <skipped message=\"{}\"/>\n    </testcase>", escape(&o.detail));
            }
        }
    }
    x.push_str("  </testsuite>\n</testsuites>\n");
    x
}

/// Text for XML content and attribute values: the five special characters escaped, and the
/// control characters XML 1.0 does not allow replaced.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\n' => out.push_str("&#10;"),
            '\t' => out.push_str("&#9;"),
            c if (c as u32) < 0x20 => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// Writes `junit.xml`, `summary.json` and the page `report.html` (`page`, drawn from the same
/// summary) into `dir` (created), each atomically.
pub fn write(dir: &Path, s: &Summary, page: &str) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create --report {}", dir.display()))?;
    write_atomic(&dir.join("junit.xml"), junit(s).as_bytes())?;
    write_atomic(&dir.join("summary.json"), format!("{}\n", serde_json::to_string_pretty(s)?).as_bytes())?;
    write_atomic(&dir.join(HTML), page.as_bytes())?;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn outcome(name: &str, status: Status, detail: &str) -> Outcome {
        Outcome { name: name.into(), status, seconds: 1.0, detail: detail.into(), curve: None, measures: Vec::new() }
    }

    #[test]
    fn junit_escapes_and_counts() {
        let checks = [
            outcome("a", Status::Pass, "ok"),
            outcome("b", Status::Fail, "x < y & \"z\"\n"),
            outcome("c", Status::Skip, "no GPU"),
        ];
        let s = Summary::new(Mode::Quick, Target::Cpu, None, "2026-01-01T00:00:00Z".into(), 3.0, &checks);
        let x = junit(&s);
        assert!(x.contains("tests=\"3\" failures=\"1\" skipped=\"1\""), "{x}");
        assert!(x.contains("<failure message=\"x &lt; y &amp; &quot;z&quot;&#10;\">"), "{x}");
        assert!(x.contains("<skipped message=\"no GPU\"/>"), "{x}");
        assert_eq!((s.passed, s.failed, s.skipped), (1, 1, 1));
        assert!(x.contains("<property name=\"report\" value=\"report.html\"/>"), "{x}");
    }
}
