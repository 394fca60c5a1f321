//! `distro report --repo REPO [--since DATE] --out SITE/`: the static dashboard of the dated
//! images ([`crate::report`]); prints the files written, one per line.
use super::parse_repo;
use crate::dated::parse_date;
use crate::error::bad_input;
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use crate::report::{collect, write_site};
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

/// The arguments of `distro report`.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Repository of the dated images, e.g. ghcr.io/org/distro.
    #[arg(long, value_name = "REPO")]
    pub repo: String,
    /// Image name: the dated tags are NAME-YYYY-MM-DD.
    #[arg(long, default_value = "engine", value_name = "NAME", value_parser = super::image_name)]
    pub image: String,
    /// The first date shown (default: every dated tag).
    #[arg(long, value_name = "YYYY-MM-DD", value_parser = super::date_arg)]
    pub since: Option<String>,
    /// The site's directory: index.html and diff-DATE.html are written there.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    pub insecure: Vec<String>,
}

/// Runs `distro report`.
pub fn report_cmd(a: ReportArgs) -> Result<ExitCode> {
    let repo = parse_repo(&a.repo)?;
    let since = match &a.since {
        Some(d) => Some(parse_date(d).ok_or_else(|| bad_input(format!("--since {d:?} is not a date YYYY-MM-DD")))?),
        None => None,
    };
    let client = Client::new(Credentials::from_environment(Some(repo.api_host()))?, a.insecure)?;
    let (nights, before) = collect(&client, &repo, &a.image, since)?;
    // What was left out (a test summary too large or unreadable) is noted, not fatal.
    for n in &nights {
        for note in &n.notes {
            eprintln!("note: {}: {note}", n.tag);
        }
    }
    for f in write_site(&a.out, &repo, &nights, before.as_ref())? {
        println!("{}", a.out.join(f).display());
    }
    Ok(ExitCode::SUCCESS)
}
