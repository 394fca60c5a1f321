//! The dashboard's pages: `index.html` (one row per date, then the trends) and each date's
//! `diff-DATE.html` (`distro diff`'s text). Self-contained: inline style and SVG, no script, no
//! request. The figures a test reads back sit in `data-*` attributes beside the text people read:
//! each row's `data-date` and `data-digest`, each size's `data-platform`, `data-group` and
//! `data-bytes` (exact compressed bytes), each test run's `data-platform`, `data-device`,
//! `data-passed`, `data-failed` and `data-skipped`.
use super::{Night, group_sizes, trends};
use crate::registry::reference::Reference;
use anyhow::Result;
use std::collections::BTreeMap;
use std::fmt::Write as _;

const STYLE: &str = "body{font-family:sans-serif;margin:2em auto;max-width:1400px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}.size{display:inline-block;min-width:7em;font-variant-numeric:tabular-nums}.total{font-weight:bold}
.badge{display:inline-block;padding:0 .5em;border-radius:.3em;color:#fff;font-weight:bold}
.badge.pass{background:#2ca02c}.badge.fail{background:#d62728}.none{color:#7f7f7f}
code{font-size:.9em}figure{margin:1em 0}figcaption{font-size:.9em;color:#555}pre{background:#f8f8f8;padding:1em;overflow-x:auto}";

/// `&`, `<`, `>` and `"` as entities: text and attribute values alike.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

/// Bytes in the largest binary unit that keeps a whole part, one decimal: `3.2 GiB`, `512 B`.
pub fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{bytes} B") } else { format!("{v:.1} {}", units[u]) }
}

fn head(title: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        escape(title)
    )
}

/// `index.html`: `diffs` maps a date to its diff page and the date it compares with.
pub fn page(repo: &Reference, nights: &[Night], diffs: &BTreeMap<String, (String, String)>) -> Result<String> {
    let name = repo.name();
    let mut h = head(&format!("{name}: dated images"));
    let _ = writeln!(h, "<h1>Dated images of <code>{}</code></h1>", escape(&name));
    if let (Some(first), Some(last)) = (nights.first(), nights.last()) {
        let _ = writeln!(
            h,
            "<p>{} date(s), {} to {}, newest first. Sizes are compressed (what a pull downloads), per layer group: <b>base</b> (the base image), <b>engine</b> (its binaries, trees and <code>/opt/distro</code>), <b>cuda</b> (CUDA libraries from NVIDIA's wheels). Test results are the <code>test-all</code> summaries attached to each index.</p>",
            nights.len(),
            first.date,
            last.date
        );
    }
    h.push_str("<table id=\"nights\">\n<thead><tr><th>date</th><th>index</th><th>platforms</th><th>compressed size</th><th>test-all</th><th>changes</th></tr></thead>\n<tbody>\n");
    for n in nights.iter().rev() {
        let f = &n.facts;
        let _ = writeln!(h, "<tr class=\"night\" data-date=\"{}\" data-digest=\"{}\">", n.date, escape(&f.digest));
        let _ = writeln!(h, "<td>{}</td>", n.date);
        let short = &f.digest[..f.digest.len().min(19)];
        let _ = writeln!(h, "<td><code title=\"{0}\">{1}</code></td>", escape(&f.digest), escape(short));
        let platforms: Vec<String> = f.platforms.keys().map(|p| escape(p)).collect();
        let _ = writeln!(h, "<td>{}</td>", platforms.join("<br>"));
        h.push_str("<td>");
        for (p, pf) in &f.platforms {
            let sizes = group_sizes(pf);
            let _ = write!(h, "<div class=\"sizes\" data-platform=\"{0}\"><b>{0}</b>:", escape(p));
            for (g, bytes) in &sizes {
                let _ = write!(
                    h,
                    " <span class=\"size\" data-platform=\"{}\" data-group=\"{}\" data-bytes=\"{bytes}\" title=\"{bytes} bytes\">{} {}</span>",
                    escape(p),
                    escape(g),
                    escape(g),
                    human(*bytes)
                );
            }
            let total: u64 = sizes.values().sum();
            let _ = writeln!(
                h,
                " <span class=\"size total\" data-platform=\"{}\" data-group=\"total\" data-bytes=\"{total}\" title=\"{total} bytes\">total {}</span></div>",
                escape(p),
                human(total)
            );
        }
        h.push_str("</td>\n<td>");
        if n.tests.is_empty() && n.notes.is_empty() {
            h.push_str("<span class=\"none\">no results attached</span>");
        }
        for t in &n.tests {
            let s = &t.summary;
            let verdict = if s.failed > 0 { "fail" } else { "pass" };
            let _ = writeln!(
                h,
                "<div class=\"test\" data-platform=\"{0}\" data-device=\"{1}\" data-passed=\"{2}\" data-failed=\"{3}\" data-skipped=\"{4}\"><span class=\"badge {verdict}\">{verdict}</span> {0} {1} ({5}, {6}): {2} passed, {3} failed, {4} skipped</div>",
                escape(&t.platform),
                escape(&s.device_class),
                s.passed,
                s.failed,
                s.skipped,
                escape(&s.mode),
                escape(&s.device)
            );
        }
        for note in &n.notes {
            let _ = writeln!(h, "<div class=\"note\">note: {}</div>", escape(note));
        }
        h.push_str("</td>\n<td>");
        match diffs.get(&n.date) {
            Some((file, prev)) => {
                let _ = write!(h, "<a class=\"diff\" href=\"{}\">distro diff against {prev}</a>", escape(file));
            }
            None => h.push_str("<span class=\"none\">the first date</span>"),
        }
        h.push_str("</td>\n</tr>\n");
    }
    h.push_str("</tbody>\n</table>\n<h2>Trends</h2>\n");
    for (caption, svg) in trends::figures(nights)? {
        match svg {
            Some(svg) => {
                let _ = writeln!(h, "<figure>\n{svg}\n<figcaption>{}</figcaption>\n</figure>", escape(&caption));
            }
            None => {
                let _ = writeln!(h, "<p class=\"none\">{}</p>", escape(&caption));
            }
        }
    }
    h.push_str("</body>\n</html>\n");
    Ok(h)
}

/// `diff-DATE.html`: `distro diff`'s text between the image of `old` and that of `new`.
pub fn diff_page(text: &str, old: &str, new: &str) -> String {
    let mut h = head(&format!("distro diff {old} -> {new}"));
    let _ = writeln!(h, "<h1>Changes from {old} to {new}</h1>\n<p><a href=\"index.html\">All dates</a></p>");
    let _ = writeln!(h, "<pre>{}</pre>\n</body>\n</html>", escape(text));
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diff::{Facts, LayerFacts, PlatformFacts};
    use crate::provenance::test_summary::TestSummary;
    use crate::report::TestRun;

    fn night(date: &str, sizes: &[(u64, &str)], failed: u64) -> Night {
        let layers = sizes
            .iter()
            .map(|&(size, group)| LayerFacts {
                digest: format!("sha256:{size:064}"),
                size,
                created_by: String::new(),
                group: group.into(),
            })
            .collect();
        let mut facts = Facts { digest: format!("sha256:{:0>64}", date.replace('-', "")), ..Default::default() };
        facts.platforms.insert("linux/amd64".into(), PlatformFacts { layers, ..Default::default() });
        let summary = TestSummary {
            format: "engine-test-all-summary".into(),
            mode: "quick".into(),
            device_class: "cpu".into(),
            device: "cpu <2 threads>".into(),
            started: format!("{date}T03:00:00Z"),
            passed: 7,
            failed,
            skipped: 1,
            checks: vec![],
        };
        Night {
            date: date.into(),
            tag: format!("engine-{date}"),
            facts,
            tests: vec![TestRun { platform: "linux/amd64".into(), summary }],
            notes: vec![],
        }
    }

    #[test]
    fn the_table_lists_every_date_newest_first_with_exact_sizes_results_and_diff_links() {
        let nights = [
            night("2026-01-01", &[(3 << 20, "base"), (1 << 20, "engine")], 0),
            night("2026-01-02", &[(3 << 20, "base"), (2 << 20, "engine"), (5, "engine")], 1),
        ];
        let diffs = BTreeMap::from([(
            "2026-01-02".to_string(),
            ("diff-2026-01-02.html".to_string(), "2026-01-01".to_string()),
        )]);
        let repo = Reference::parse("localhost:5000/distro").unwrap();
        let h = page(&repo, &nights, &diffs).unwrap();
        let (new, old) = (h.find("data-date=\"2026-01-02\"").unwrap(), h.find("data-date=\"2026-01-01\"").unwrap());
        assert!(new < old, "newest first");
        let row = &h[new..old];
        assert!(row.contains("data-group=\"engine\" data-bytes=\"2097157\""), "{row}");
        assert!(row.contains("data-group=\"cuda\" data-bytes=\"0\""), "{row}");
        assert!(row.contains("data-group=\"total\" data-bytes=\"5242885\""), "{row}");
        assert!(row.contains("data-passed=\"7\" data-failed=\"1\" data-skipped=\"1\""), "{row}");
        assert!(row.contains("<span class=\"badge fail\">fail</span>"), "{row}");
        assert!(row.contains("cpu &lt;2 threads&gt;") && !row.contains("<2 threads>"), "escaped: {row}");
        assert!(
            row.contains("<a class=\"diff\" href=\"diff-2026-01-02.html\">distro diff against 2026-01-01</a>"),
            "{row}"
        );
        assert!(h[old..].contains("the first date"));
        assert!(h[old..].contains("<span class=\"badge pass\">pass</span>"));
        assert!(h.contains("<svg"), "the trends are drawn");
        assert!(!h.contains("<script") && !h.contains("src=") && !h.contains("href=\"http"), "self-contained");
    }

    #[test]
    fn sizes_read_in_the_largest_unit_with_a_whole_part() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(5 << 20), "5.0 MiB");
        assert_eq!(human(3_900_000_000), "3.6 GiB");
    }

    #[test]
    fn the_diff_page_holds_the_text_escaped() {
        let h = diff_page("distro diff a b\n  ~ x: <1> -> 2 & 3\n", "2026-01-01", "2026-01-02");
        assert!(h.contains("<pre>distro diff a b\n  ~ x: &lt;1&gt; -&gt; 2 &amp; 3\n</pre>"), "{h}");
        assert!(h.contains("href=\"index.html\""));
    }
}
