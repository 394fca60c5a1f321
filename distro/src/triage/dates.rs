//! Stage 1: the first dated image where the command fails, by exponential search from the good
//! end and bisection over the dated tags between `--good` and `--bad`.
use super::Triage;
use crate::dated::{DatedTag, Verdict, dated_tags, search};
use crate::error::bad_input;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use anyhow::{Result, bail};
use serde_json::{Value, json};

/// Stage 1: checks both ends, then searches the dated images between them for the first one
/// where the command fails. Returns the last passing and the first failing dated tag.
pub(super) fn find(
    t: &mut Triage,
    client: &Client,
    repo: &Reference,
    (good_date, bad_date): (&str, &str),
    summary: &mut Value,
) -> Result<(DatedTag, DatedTag)> {
    let tags = client.list_tags(repo)?;
    let dated = dated_tags(&t.args.image, &tags);
    let find = |flag: &str, date: &str| -> Result<usize> {
        dated.iter().position(|d| d.date == date).ok_or_else(|| {
            bad_input(format!(
                "{flag} {date}: {} has no tag {}-{date} ({} dated tags{})",
                repo.name(),
                t.args.image,
                dated.len(),
                match (dated.first(), dated.last()) {
                    (Some(a), Some(b)) => format!(", {} to {}", a.date, b.date),
                    _ => String::new(),
                }
            ))
        })
    };
    let (gi, bi) = (find("--good", good_date)?, find("--bad", bad_date)?);
    let dates: Vec<DatedTag> = dated[gi..=bi].to_vec();
    t.progress.info(format!("triage: {} dated images from {} to {}", dates.len(), good_date, bad_date));
    let image_of = |d: &DatedTag| repo.with_tag(&d.tag).to_string();
    let good = t.run_in("date", &dates[0].date, &image_of(&dates[0]), 0.0);
    match good.verdict {
        Verdict::Pass => {}
        Verdict::Fail => {
            return Err(bad_input(format!(
                "--good {}: the command fails in {} too; give an earlier good date",
                good_date, good.image
            )));
        }
        Verdict::Skip => bail!("--good {}: {}", good_date, good.note.unwrap_or_default()),
    }
    let last = dates.len() - 1;
    let bad = t.run_in("date", &dates[last].date, &image_of(&dates[last]), 0.0);
    match bad.verdict {
        Verdict::Fail => {}
        Verdict::Pass => {
            return Err(bad_input(format!(
                "--bad {}: the command passes in {}; give a date that fails",
                bad_date, bad.image
            )));
        }
        Verdict::Skip => bail!("--bad {}: {}", bad_date, bad.note.unwrap_or_default()),
    }
    let found = search(0, last, &mut |i| t.run_in("date", &dates[i].date, &image_of(&dates[i]), 0.0).verdict);
    let (lg, fb) = (&dates[found.last_pass], &dates[found.first_fail]);
    summary["last_good_date"] = json!(lg.date);
    summary["first_bad_date"] = json!(fb.date);
    summary["untestable_dates"] = json!(found.skipped.iter().map(|&i| &dates[i].date).collect::<Vec<_>>());
    if !found.skipped.is_empty() {
        let c: Vec<&str> = found.skipped.iter().map(|&i| dates[i].date.as_str()).collect();
        t.progress.info(format!(
            "triage: the first failing date is one of {} or {} (could not run those)",
            c.join(", "),
            fb.date
        ));
    }
    t.progress.info(format!("triage: first failing date {} (last passing {})", fb.date, lg.date));
    Ok((lg.clone(), fb.clone()))
}
