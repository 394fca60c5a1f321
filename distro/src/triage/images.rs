//! `--good IMAGE --bad IMAGE`: two given images instead of two dates. Both are run (the good
//! one must pass, the bad one fail); stage 2 then compares their sources and bisects what moved.
use super::{Pair, Triage};
use crate::dated::{Verdict, parse_date};
use crate::error::bad_input;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use anyhow::{Result, bail};

/// Runs the command in both images and checks that the good one passes and the bad one fails.
pub(super) fn check(t: &mut Triage, client: &Client, good: &Reference, bad: &Reference) -> Result<Pair> {
    let g = t.run_in("image", &good.to_string(), &good.to_string(), 0.0);
    match g.verdict {
        Verdict::Pass => {}
        Verdict::Fail => {
            return Err(bad_input(format!("--good {good}: the command fails in it too; give an image that passes")));
        }
        Verdict::Skip => bail!("--good {good}: {}", g.note.unwrap_or_default()),
    }
    let b = t.run_in("image", &bad.to_string(), &bad.to_string(), 0.0);
    match b.verdict {
        Verdict::Fail => {}
        Verdict::Pass => {
            return Err(bad_input(format!("--bad {bad}: the command passes in it; give an image that fails")));
        }
        Verdict::Skip => bail!("--bad {bad}: {}", b.note.unwrap_or_default()),
    }
    let ann = super::commits::annotations(client, bad)?;
    Ok(Pair { good: good.clone(), bad: bad.clone(), bad_label: bad.to_string(), date: image_date(&ann) })
}

/// The date a rebuild of an image is tagged with: the one of its version (`NAME-YYYY-MM-DD`),
/// else of its creation time, else today's.
pub(super) fn image_date(ann: &std::collections::BTreeMap<String, String>) -> String {
    let version = ann.get("org.opencontainers.image.version").map(String::as_str).unwrap_or("");
    let created = ann.get("org.opencontainers.image.created").map(String::as_str).unwrap_or("");
    let from_version = version.len().checked_sub(10).and_then(|i| version.get(i..));
    from_version
        .filter(|d| parse_date(d).is_some())
        .or_else(|| created.get(..10).filter(|d| parse_date(d).is_some()))
        .map(String::from)
        .unwrap_or_else(|| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            crate::dated::utc_date(now)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn a_rebuild_is_dated_by_the_images_version_or_creation() {
        let ann = |v: &str, c: &str| {
            BTreeMap::from([
                ("org.opencontainers.image.version".to_string(), v.to_string()),
                ("org.opencontainers.image.created".to_string(), c.to_string()),
            ])
        };
        assert_eq!(image_date(&ann("probe-2026-03-05", "1970-01-01T00:00:00Z")), "2026-03-05");
        assert_eq!(image_date(&ann("probe", "2026-02-01T10:00:00Z")), "2026-02-01");
        assert!(parse_date(&image_date(&BTreeMap::new())).is_some());
    }
}
