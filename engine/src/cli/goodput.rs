//! `engine goodput RUN_DIR`: the run's wall time by cause, for its last attempt and all of them
//! (the timeline is [`engine::train::goodput`]).

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use engine::train::goodput::{self, GOODPUT, Report};

#[derive(Args)]
pub struct GoodputArgs {
    /// The run directory (its goodput.jsonl is read; the run may still be going).
    #[arg(value_name = "RUN_DIR")]
    run_dir: PathBuf,
    /// Print the figures as one JSON object: every attempt, the last one and the whole run.
    #[arg(long)]
    json: bool,
}

pub fn run(args: GoodputArgs) -> Result<()> {
    let path = args.run_dir.join(GOODPUT);
    if !args.run_dir.is_dir() {
        bail!("{}: no such run directory", args.run_dir.display());
    }
    if !path.exists() {
        bail!(
            "{} holds no goodput timeline ({GOODPUT}): no attempt has reached its first step there (or it was trained by an engine older than the timeline)",
            args.run_dir.display()
        );
    }
    let Some(report) = Report::of(&goodput::read(&path)?) else {
        bail!("{}: no attempt's start record reads; the file is not a goodput timeline", path.display());
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("goodput of {} ({} attempts)\n", args.run_dir.display(), report.attempts.len());
        print!("{}", report.table());
    }
    Ok(())
}
