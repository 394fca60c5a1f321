//! `report.html`: a run of test-all as one page that opens offline, without a script or a
//! request: the device, image and counts at the top, the checks' table, every curve check's loss
//! over its baseline's band (and its relative difference against the tolerance, where a narrow
//! band shows) with the failing steps circled, and the measured figures (throughput against its
//! baseline, parity checks) in a table. The figures are inline SVG drawn by [`crate::plot`].

use std::fmt::Write as _;

use anyhow::Result;

use super::report::{HTML, Summary, escape};
use super::{CurveRecord, Outcome, Status};
use crate::plot::{Band, Figure, Line};

/// The size of each curve figure in pixels.
const FIGURE: (u32, u32) = (600, 360);

/// The page's style: readable without it, nothing fetched.
const STYLE: &str = "body{font-family:sans-serif;margin:2em auto;max-width:1280px;color:#222}
h1 .pass{color:#2ca02c}h1 .fail{color:#d62728}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;padding:0 .5em;border-radius:.3em;color:#fff;font-weight:bold}
.pass .badge,.badge.pass{background:#2ca02c}.fail .badge,.badge.fail{background:#d62728}.skip .badge,.badge.skip{background:#7f7f7f}
.figures{display:flex;flex-wrap:wrap;gap:1em}figure{margin:0}figcaption{font-size:.9em;color:#555;max-width:600px}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:bold}dd{margin:0}";

/// The whole page of a summary.
pub fn page(s: &Summary) -> Result<String> {
    let verdict = if s.failed > 0 { ("fail", "FAILED") } else { ("pass", "passed") };
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>test-all {}: {} passed, {} failed, {} skipped</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        verdict.1, s.passed, s.failed, s.skipped
    );
    let _ = writeln!(
        h,
        "<h1>test-all <span class=\"{}\">{}</span>: {} passed, {} failed, {} skipped</h1>",
        verdict.0, verdict.1, s.passed, s.failed, s.skipped
    );
    h.push_str("<dl>\n");
    let mut field = |name: &str, value: &str| {
        let _ = writeln!(h, "<dt>{name}</dt><dd>{}</dd>", escape(value));
    };
    field("device", &s.device);
    field("image", s.image.as_deref().unwrap_or("not named (test-all --image, or ENGINE_IMAGE)"));
    field("revision", s.revision);
    field("engine", s.engine_version);
    field("started", &s.started);
    field("took", &format!("{:.1} s", s.seconds));
    field("mode", s.mode.name());
    field(
        "reference",
        &match (&s.reference, &s.baselines) {
            (Some(r), Some(b)) => format!("{r} ({b})"),
            _ => "none (no check compared with baselines)".into(),
        },
    );
    h.push_str("</dl>\n<p>The same run as <a href=\"junit.xml\">junit.xml</a> and <a href=\"summary.json\">summary.json</a>.</p>\n");

    h.push_str("<h2>Checks</h2>\n<table>\n<tr><th>check</th><th>status</th><th>time</th><th>detail</th></tr>\n");
    for o in s.checks {
        let name = match o.curve {
            Some(_) => format!("<a href=\"#{}\">{}</a>", anchor(&o.name), escape(&o.name)),
            None => escape(&o.name),
        };
        let _ = writeln!(
            h,
            "<tr class=\"{0}\"><td>{name}</td><td><span class=\"badge\">{0}</span></td><td class=\"num\">{1:.1} s</td><td>{2}</td></tr>",
            status(o.status),
            o.seconds,
            escape(&o.detail)
        );
    }
    h.push_str("</table>\n");

    let curves: Vec<(&Outcome, &CurveRecord)> = s.checks.iter().filter_map(|o| Some((o, o.curve.as_ref()?))).collect();
    if !curves.is_empty() {
        h.push_str("<h2>Loss curves against the baselines</h2>\n");
    }
    for (o, c) in curves {
        let _ = writeln!(
            h,
            "<section id=\"{}\" class=\"{}\">\n<h3>{} <span class=\"badge\">{}</span></h3>\n<div class=\"figures\">",
            anchor(&o.name),
            status(o.status),
            escape(&o.name),
            status(o.status)
        );
        let failing = if c.failing_steps.is_empty() {
            "every step within the tolerance".to_string()
        } else {
            format!(
                "circled: the steps outside the tolerance ({})",
                c.failing_steps.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", ")
            )
        };
        let _ = writeln!(
            h,
            "<figure>{}<figcaption>The loss of this run over the baseline's band (baseline ± tolerance × |baseline|); {failing}.</figcaption></figure>",
            loss_figure(c).svg(FIGURE)?
        );
        let _ = writeln!(
            h,
            "<figure>{}<figcaption>The same steps as relative differences, (loss − baseline) / |baseline|, against ± the tolerance.</figcaption></figure>",
            difference_figure(c).svg(FIGURE)?
        );
        h.push_str("</div>\n</section>\n");
    }

    let measured: Vec<&Outcome> = s.checks.iter().filter(|o| !o.measures.is_empty()).collect();
    if !measured.is_empty() {
        h.push_str("<h2>Measured figures</h2>\n<table>\n<tr><th>check</th><th>what</th><th>value</th><th>baseline</th><th>ratio</th><th>held</th><th>note</th></tr>\n");
    }
    for o in &measured {
        for m in &o.measures {
            let (baseline, ratio) = match m.baseline {
                Some(b) => (format!("{} {}", number(b), m.unit), format!("{:.2}x", m.value / b)),
                None => (String::new(), String::new()),
            };
            let held = if m.ok { "pass" } else { "fail" };
            let _ = writeln!(
                h,
                "<tr class=\"{held}\"><td>{}</td><td>{}</td><td class=\"num\">{} {}</td><td class=\"num\">{baseline}</td><td class=\"num\">{ratio}</td><td><span class=\"badge\">{held}</span></td><td>{}</td></tr>",
                escape(&o.name),
                escape(&m.name),
                number(m.value),
                m.unit,
                escape(&m.note)
            );
        }
    }
    if !measured.is_empty() {
        h.push_str("</table>\n");
    }
    let _ = writeln!(h, "<p><small>{HTML} of engine test-all.</small></p>\n</body>\n</html>");
    Ok(h)
}

/// A check's loss over the baseline's band, its failing steps circled.
pub fn loss_figure(c: &CurveRecord) -> Figure {
    let steps = 1..=c.loss.len();
    let band = steps
        .clone()
        .zip(c.baseline.iter().zip(&c.tolerance))
        .map(|(s, (&b, &t))| (s as f64, b - t * b.abs(), b + t * b.abs()))
        .collect();
    let loss: Vec<(f64, f64)> = steps.zip(&c.loss).map(|(s, &l)| (s as f64, l)).collect();
    Figure {
        title: String::new(),
        x_label: "step".into(),
        y_label: "loss".into(),
        band: Some(Band { label: "baseline ± tolerance".into(), points: band }),
        lines: vec![Line { label: "this run".into(), points: loss.clone() }],
        marks: Some(("outside the tolerance".into(), marked(&c.failing_steps, |s| loss[s - 1].1))),
    }
}

/// A check's relative differences against ± its tolerance, its failing steps circled.
pub fn difference_figure(c: &CurveRecord) -> Figure {
    let rel = |i: usize| (c.loss[i] - c.baseline[i]) / c.baseline[i].abs();
    let steps = 1..=c.loss.len();
    Figure {
        title: String::new(),
        x_label: "step".into(),
        y_label: "relative difference".into(),
        band: Some(Band {
            label: "± tolerance".into(),
            points: steps.clone().zip(&c.tolerance).map(|(s, &t)| (s as f64, -t, t)).collect(),
        }),
        lines: vec![Line { label: "this run".into(), points: steps.map(|s| (s as f64, rel(s - 1))).collect() }],
        marks: Some(("outside the tolerance".into(), marked(&c.failing_steps, |s| rel(s - 1)))),
    }
}

/// The failing steps' points whose value is finite (a NaN loss cannot be placed).
fn marked(steps: &[usize], value: impl Fn(usize) -> f64) -> Vec<(f64, f64)> {
    steps.iter().map(|&s| (s as f64, value(s))).filter(|p| p.1.is_finite()).collect()
}

fn status(s: Status) -> &'static str {
    match s {
        Status::Pass => "pass",
        Status::Fail => "fail",
        Status::Skip => "skip",
    }
}

/// A check's name as a fragment identifier.
fn anchor(name: &str) -> String {
    let id: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    format!("curve-{id}")
}

/// A figure for a table: whole above 100, four significant digits below.
fn number(v: f64) -> String {
    if v.abs() >= 100.0 { format!("{v:.0}") } else { crate::plot::figure::tick(v) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testall::report::tests::outcome;
    use crate::testall::{Measure, Mode, Target};

    #[test]
    fn the_page_holds_counts_curves_and_figures_and_asks_for_nothing() {
        let mut failing = outcome("tiny-<x>", Status::Fail, "step 2 & more");
        failing.curve = Some(CurveRecord {
            loss: vec![5.0, 4.9, 4.0],
            baseline: vec![5.0, 4.0, 4.0],
            tolerance: vec![0.01; 3],
            failing_steps: vec![2],
        });
        let mut measured = outcome("throughput", Status::Pass, "fine");
        measured.measures = vec![Measure {
            name: "tiny-llama2".into(),
            value: 2000.0,
            unit: "tokens/s",
            baseline: Some(1000.0),
            ok: true,
            note: String::new(),
        }];
        let checks = [failing, measured];
        let mut s = Summary::new(Mode::Quick, Target::Cpu, None, "2026-01-01T00:00:00Z".into(), 3.0, &checks);
        s.image = Some("r.io/llm@sha256:abc".into());
        let h = page(&s).unwrap();
        assert!(h.contains("1 passed, 1 failed, 0 skipped") && h.contains("r.io/llm@sha256:abc"), "{h}");
        assert!(h.contains("tiny-&lt;x&gt;") && h.contains("step 2 &amp; more") && !h.contains("tiny-<x>"));
        assert!(h.contains("id=\"curve-tiny-_x_\"") && h.contains("steps outside the tolerance (2)"));
        assert_eq!(h.matches("<svg").count(), 2);
        assert!(h.contains("<td class=\"num\">2.00x</td>"), "{h}");
        assert!(!h.contains("<script") && !h.contains("src=") && !h.contains("href=\"http") && !h.contains("url("));
        assert!(h.contains("href=\"junit.xml\"") && h.contains("href=\"summary.json\""));
    }
}
