//! The dashboard's trends, drawn by `plotters` as inline SVG: each platform's compressed size
//! (in all and per layer group) and each throughput figure of the attached test summaries
//! (per platform, device class and recipe), one point per date.
//!
//! Text is laid out with the engine's embedded font (a cut of DejaVu Sans, registered as
//! `sans-serif` through `ab_glyph`), as `engine plot` does: one font file in the repository, no
//! system font library, and the same layout whichever crate's features the workspace unifies.
use super::{Night, group_sizes};
use anyhow::{Result, anyhow};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::sync::Once;

/// Each figure's size in pixels.
const SIZE: (u32, u32) = (1000, 420);

/// Matplotlib's "tab10", as in `engine plot`.
const PALETTE: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// One trend: its name and its values by date index (a date without a value has none).
pub type Series = (String, BTreeMap<usize, f64>);

/// The compressed sizes in MiB: each platform's total, and each of its groups that has a layer.
pub fn size_series(nights: &[Night]) -> Vec<Series> {
    let mut out: BTreeMap<String, BTreeMap<usize, f64>> = BTreeMap::new();
    for (i, n) in nights.iter().enumerate() {
        for (p, pf) in &n.facts.platforms {
            let sizes = group_sizes(pf);
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            out.entry(format!("{p} total")).or_default().insert(i, mib(sizes.values().sum()));
            for (g, b) in sizes.iter().filter(|(_, b)| **b > 0) {
                out.entry(format!("{p} {g}")).or_default().insert(i, mib(*b));
            }
        }
    }
    out.into_iter().collect()
}

/// The throughput figures (tokens/s) of the attached summaries, per platform, device class and
/// recipe.
pub fn throughput_series(nights: &[Night]) -> Vec<Series> {
    let mut out: BTreeMap<String, BTreeMap<usize, f64>> = BTreeMap::new();
    for (i, n) in nights.iter().enumerate() {
        for t in &n.tests {
            for (recipe, v) in t.summary.throughput() {
                out.entry(format!("{} {} {recipe}", t.platform, t.summary.device_class)).or_default().insert(i, v);
            }
        }
    }
    out.into_iter().collect()
}

/// The figures below the table: (caption, SVG), or (what is missing, `None`) when a trend has
/// no value to draw.
pub fn figures(nights: &[Night]) -> Result<Vec<(String, Option<String>)>> {
    let dates: Vec<&str> = nights.iter().map(|n| n.date.as_str()).collect();
    let sizes = size_series(nights);
    let speed = throughput_series(nights);
    let mut out = vec![(
        "Compressed size per platform and layer group, MiB".to_string(),
        Some(svg(&dates, "MiB, compressed", &sizes)?),
    )];
    if speed.is_empty() {
        out.push(("Throughput: no attached test summary measured any (test-all's throughput check)".into(), None));
    } else {
        out.push((
            "Throughput of test-all's throughput check, tokens/s, per platform, device class and recipe".into(),
            Some(svg(&dates, "tokens/s", &speed)?),
        ));
    }
    Ok(out)
}

/// One figure: `series` over `dates` (x: the date's index, labelled with the date).
pub fn svg(dates: &[&str], y_label: &str, series: &[Series]) -> Result<String> {
    register_font()?;
    let top = series.iter().flat_map(|s| s.1.values().copied()).fold(0.0f64, f64::max);
    let top = if top > 0.0 { top * 1.1 } else { 1.0 };
    let n = dates.len().max(1);
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, SIZE).into_drawing_area();
        let fail = |e: DrawingAreaErrorKind<std::io::Error>| anyhow!("cannot draw the trend: {e}");
        root.fill(&WHITE).map_err(fail)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..top)
            .map_err(fail)?;
        let date_of = |x: &f64| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                dates.get(i as usize).map_or(String::new(), |d| d.to_string())
            } else {
                String::new()
            }
        };
        chart
            .configure_mesh()
            .light_line_style(WHITE.mix(0.0))
            .bold_line_style(BLACK.mix(0.08))
            .x_labels(n.min(12))
            .x_label_formatter(&date_of)
            .y_desc(y_label)
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 14))
            .draw()
            .map_err(fail)?;
        for (k, (label, values)) in series.iter().enumerate() {
            let colour = PALETTE[k % PALETTE.len()];
            let points: Vec<(f64, f64)> = values.iter().map(|(&i, &v)| (i as f64, v)).collect();
            chart
                .draw_series(LineSeries::new(points.iter().copied(), colour.stroke_width(2)))
                .map_err(fail)?
                .label(label)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
            // A point per date: one date alone draws no line.
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, colour.filled()))).map_err(fail)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(fail)?;
        root.present().map_err(fail)?;
    }
    Ok(text)
}

/// Registers the engine's embedded font as `sans-serif`, once per process.
fn register_font() -> Result<()> {
    static FONT: &[u8] = include_bytes!("../../../engine/src/plot/DejaVuSans-subset.ttf");
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| anyhow!("the embedded font does not read (a build fault)"));
    });
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diff::{Facts, LayerFacts, PlatformFacts};
    use crate::provenance::test_summary::{CheckSummary, MeasureSummary, TestSummary};
    use crate::report::TestRun;

    fn night(date: &str, engine_bytes: u64, tokens: Option<f64>) -> Night {
        let layer = |size: u64, group: &str| LayerFacts {
            digest: String::new(),
            size,
            created_by: String::new(),
            group: group.into(),
        };
        let mut facts = Facts::default();
        facts.platforms.insert(
            "linux/amd64".into(),
            PlatformFacts { layers: vec![layer(1 << 20, "base"), layer(engine_bytes, "engine")], ..Default::default() },
        );
        let tests = tokens
            .map(|v| {
                let measures =
                    vec![MeasureSummary { name: "tiny-llama2".into(), value: Some(v), unit: "tokens/s".into() }];
                let summary = TestSummary {
                    format: "engine-test-all-summary".into(),
                    mode: "full".into(),
                    device_class: "cuda".into(),
                    device: "H100".into(),
                    started: String::new(),
                    passed: 1,
                    failed: 0,
                    skipped: 0,
                    checks: vec![CheckSummary { name: "throughput".into(), status: "pass".into(), measures }],
                };
                vec![TestRun { platform: "linux/amd64".into(), summary }]
            })
            .unwrap_or_default();
        Night { date: date.into(), tag: format!("engine-{date}"), facts, tests, notes: vec![] }
    }

    #[test]
    fn the_series_hold_each_dates_sizes_and_throughput() {
        let nights = [night("2026-01-01", 1 << 19, Some(1000.0)), night("2026-01-02", 1 << 20, None)];
        let sizes: BTreeMap<String, BTreeMap<usize, f64>> = size_series(&nights).into_iter().collect();
        assert_eq!(sizes["linux/amd64 total"], BTreeMap::from([(0, 1.5), (1, 2.0)]));
        assert_eq!(sizes["linux/amd64 engine"], BTreeMap::from([(0, 0.5), (1, 1.0)]));
        assert!(!sizes.contains_key("linux/amd64 cuda"), "a group without layers is not drawn");
        let speed = throughput_series(&nights);
        assert_eq!(speed, vec![("linux/amd64 cuda tiny-llama2".to_string(), BTreeMap::from([(0, 1000.0)]))]);
        let drawn = figures(&nights).unwrap();
        assert_eq!(drawn.len(), 2);
        let svg = drawn[0].1.as_ref().unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("2026-01-02") && svg.contains("linux/amd64 total"), "{svg}");
        let none = figures(&nights[1..]).unwrap();
        assert!(none[1].1.is_none() && none[1].0.contains("no attached test summary"));
    }
}
