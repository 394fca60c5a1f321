//! Dated tags (`NAME-YYYY-MM-DD`) and the two decisions made over them: which tags retention
//! deletes, and where triage looks for the first failing date (exponential search from the good
//! end, then bisection, stepping over points that cannot be tested); and the calendar arithmetic
//! (Unix time <-> `YYYY-MM-DD`, RFC 3339) that image configs, tags and SBOMs share.

/// A dated tag of an image.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DatedTag {
    /// Days since 1970-01-01 (sorts by date).
    pub day: i64,
    /// `YYYY-MM-DD`.
    pub date: String,
    /// The tag, `NAME-YYYY-MM-DD`.
    pub tag: String,
}

/// The dated tags of image `name` among `tags`, oldest first. Per-platform tags
/// (`NAME-YYYY-MM-DD-ARCH`) and other tags are left out.
pub fn dated_tags(name: &str, tags: &[String]) -> Vec<DatedTag> {
    let prefix = format!("{name}-");
    let mut out: Vec<DatedTag> = tags
        .iter()
        .filter_map(|t| {
            let date = t.strip_prefix(&prefix)?;
            let day = parse_date(date)?;
            Some(DatedTag { day, date: date.to_string(), tag: t.clone() })
        })
        .collect();
    out.sort();
    out
}

/// `YYYY-MM-DD` of a day number.
pub fn format_day(day: i64) -> String {
    let (y, m, d) = civil_from_days(day);
    format!("{y:04}-{m:02}-{d:02}")
}

/// `YYYY-MM` of a day number.
fn month_of(day: i64) -> (i64, u32) {
    let (y, m, _) = civil_from_days(day);
    (y, m)
}

/// Retention: which dated tags to delete. Kept: tags dated within `keep_days` days before
/// `today` (inclusive; `today - keep_days` is kept), and the oldest tag of each calendar month
/// (the month's first build, so one image per month stays for long-range triage).
pub fn expired(tags: &[DatedTag], today: i64, keep_days: i64) -> Vec<DatedTag> {
    let mut firsts = std::collections::BTreeMap::new();
    for t in tags {
        firsts.entry(month_of(t.day)).or_insert(t.day);
    }
    tags.iter().filter(|t| t.day < today - keep_days && firsts[&month_of(t.day)] != t.day).cloned().collect()
}

/// The verdict on one point (a dated image, or a rebuilt commit).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The command passed.
    Pass,
    /// The command failed (exit code, or metric past the threshold).
    Fail,
    /// The point could not be tested (the image would not build or pull); stepped over.
    Skip,
}

/// Where a search ended: `last_pass` passed, `first_fail` failed, and every point strictly
/// between them was skipped (`skipped`), so the change is one of `skipped` or `first_fail`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// Index of the last passing point.
    pub last_pass: usize,
    /// Index of the first failing point.
    pub first_fail: usize,
    /// Indices skipped between them.
    pub skipped: Vec<usize>,
}

/// Bisects points `lo..=hi` where `lo` passes and `hi` fails (not tested again). A skipped
/// midpoint is stepped over by trying its neighbours, nearest first, towards `hi` then `lo`.
pub fn bisect(lo: usize, hi: usize, test: &mut dyn FnMut(usize) -> Verdict) -> Found {
    bisect_skipping(lo, hi, Default::default(), test)
}

fn bisect_skipping(
    mut lo: usize,
    mut hi: usize,
    mut skipped: std::collections::BTreeSet<usize>,
    test: &mut dyn FnMut(usize) -> Verdict,
) -> Found {
    loop {
        let open: Vec<usize> = (lo + 1..hi).filter(|i| !skipped.contains(i)).collect();
        if open.is_empty() {
            return Found { last_pass: lo, first_fail: hi, skipped: (lo + 1..hi).collect() };
        }
        let mid = (lo + hi) / 2;
        // The untested point nearest the middle.
        let probe = *open.iter().min_by_key(|&&i| (i.abs_diff(mid), i < mid)).expect("open is not empty");
        match test(probe) {
            Verdict::Pass => lo = probe,
            Verdict::Fail => hi = probe,
            Verdict::Skip => {
                skipped.insert(probe);
            }
        }
    }
}

/// Exponential search from the good end, then bisection: `good` passes, `bad` fails (both
/// already tested). Probes `good+1`, `good+2`, `good+4`, ... until one fails, which bounds the
/// bisection near the good end (regressions are usually recent relative to a recent good date,
/// and this tests few points when the first failure is close to it).
pub fn search(good: usize, bad: usize, test: &mut dyn FnMut(usize) -> Verdict) -> Found {
    let (mut lo, mut hi) = (good, bad);
    let mut skipped = std::collections::BTreeSet::new();
    let mut step = 1;
    while good + step < bad {
        let probe = good + step;
        match test(probe) {
            Verdict::Pass => lo = probe,
            Verdict::Fail => {
                hi = probe;
                break;
            }
            Verdict::Skip => {
                skipped.insert(probe);
            }
        }
        step *= 2;
    }
    bisect_skipping(lo, hi, skipped, test)
}

/// `YYYY-MM-DDTHH:MM:SSZ` for a Unix time.
pub fn rfc3339(epoch: u64) -> String {
    let (y, m, d) = civil_from_days((epoch / 86_400) as i64);
    let s = epoch % 86_400;
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", s / 3600, s / 60 % 60, s % 60)
}

/// `YYYY-MM-DD` (UTC) for a Unix time.
pub fn utc_date(epoch: u64) -> String {
    rfc3339(epoch)[..10].to_string()
}

/// Today (UTC) as days since 1970-01-01; `DISTRO_TODAY=YYYY-MM-DD` sets it (for tests and
/// replays).
pub fn today() -> i64 {
    if let Some(d) = std::env::var("DISTRO_TODAY").ok().and_then(|s| parse_date(&s)) {
        return d;
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    (now / 86_400) as i64
}

/// Parses `YYYY-MM-DD` into days since 1970-01-01, refusing impossible dates.
pub fn parse_date(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let y: i64 = s[..4].parse().ok()?;
    let m: u32 = s[5..7].parse().ok()?;
    let d: u32 = s[8..10].parse().ok()?;
    if !(1..=12).contains(&m) || d == 0 {
        return None;
    }
    let days = days_from_civil(y, m, d);
    (civil_from_days(days) == (y, m, d)).then_some(days)
}

// Howard Hinnant's civil-date algorithms (public domain).
/// Days since 1970-01-01 -> (year, month, day).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(parse_date("2000-02-29"), Some(11_016));
        assert_eq!(parse_date("2001-02-29"), None);
        assert_eq!(parse_date("2025-13-01"), None);
        assert_eq!(parse_date("2025-1-01"), None);
        assert_eq!(utc_date(parse_date("2031-07-04").unwrap() as u64 * 86_400 + 86_399), "2031-07-04");
    }

    fn tags(dates: &[&str]) -> Vec<DatedTag> {
        dated_tags("engine", &dates.iter().map(|d| format!("engine-{d}")).collect::<Vec<_>>())
    }

    #[test]
    fn dated_tags_skip_other_tags_and_sort() {
        let all: Vec<String> = [
            "engine",
            "engine-2026-01-03",
            "engine-2026-01-02-arm64",
            "engine-2026-01-01",
            "other-2026-01-01",
            "engine-2026-02-30",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let d = dated_tags("engine", &all);
        assert_eq!(d.iter().map(|t| t.tag.as_str()).collect::<Vec<_>>(), ["engine-2026-01-01", "engine-2026-01-03"]);
    }

    #[test]
    fn retention_keeps_recent_and_the_first_of_each_month() {
        let t = tags(&[
            "2025-11-03",
            "2025-11-20",
            "2025-12-01",
            "2025-12-02",
            "2025-12-31",
            "2026-01-05",
            "2026-01-06",
            "2026-01-10",
        ]);
        let today = parse_date("2026-01-10").unwrap();
        let gone: Vec<String> = expired(&t, today, 4).into_iter().map(|t| t.date).collect();
        // 2026-01-06 is exactly 4 days old: kept. 2025-11-03 and 2025-12-01 are their month's first.
        assert_eq!(gone, ["2025-11-20", "2025-12-02", "2025-12-31"]);
        assert!(expired(&t, today, 1000).is_empty());
        let gone0: Vec<String> = expired(&t, today, 0).into_iter().map(|t| t.date).collect();
        assert_eq!(gone0, ["2025-11-20", "2025-12-02", "2025-12-31", "2026-01-06"]);
    }

    /// Runs `search` over `n` points where points `>= first_bad` fail and `skip` are untestable.
    fn run(n: usize, first_bad: usize, skip: &[usize]) -> (Found, Vec<usize>) {
        let mut tested = Vec::new();
        let found = search(0, n - 1, &mut |i| {
            tested.push(i);
            if skip.contains(&i) {
                Verdict::Skip
            } else if i >= first_bad {
                Verdict::Fail
            } else {
                Verdict::Pass
            }
        });
        (found, tested)
    }

    #[test]
    fn search_finds_the_first_failure_everywhere() {
        for n in 2..40 {
            for first_bad in 1..n {
                let (f, tested) = run(n, first_bad, &[]);
                assert_eq!((f.last_pass, f.first_fail), (first_bad - 1, first_bad), "n={n} first_bad={first_bad}");
                assert!(f.skipped.is_empty());
                // Logarithmic: never more than 2*log2(n)+2 tests.
                assert!(tested.len() <= 2 * (usize::BITS - n.leading_zeros()) as usize + 2, "{n}: {tested:?}");
                assert!(!tested.contains(&0) && !tested.contains(&(n - 1)), "endpoints are not retested");
            }
        }
    }

    #[test]
    fn days_format_back() {
        assert_eq!(format_day(parse_date("2024-02-29").unwrap()), "2024-02-29");
    }

    #[test]
    fn search_is_exponential_from_the_good_end() {
        let (_, tested) = run(100, 3, &[]);
        assert_eq!(&tested[..3], &[1, 2, 4]);
        assert!(tested.len() <= 4, "{tested:?}");
    }

    #[test]
    fn skipped_points_are_stepped_over_and_reported() {
        // The regression is at 6; 5 cannot be built.
        let (f, _) = run(10, 6, &[5]);
        assert_eq!((f.last_pass, f.first_fail), (4, 6));
        assert_eq!(f.skipped, [5]);
        // A skip that does not hide the answer leaves no ambiguity.
        let (f, _) = run(10, 6, &[2, 8]);
        assert_eq!((f.last_pass, f.first_fail, f.skipped.len()), (5, 6, 0));
        // Everything between the ends untestable: the whole range is ambiguous.
        let (f, _) = run(5, 2, &[1, 2, 3]);
        assert_eq!((f.last_pass, f.first_fail, f.skipped), (0, 4, vec![1, 2, 3]));
        // A point skipped in the exponential phase is not built again while bisecting.
        let (_, tested) = run(20, 3, &[2]);
        assert_eq!(tested.iter().filter(|&&i| i == 2).count(), 1, "{tested:?}");
    }
}
