//! `engine flight RUN_DIR`: the flight recorder's diagnosis of a job that failed, from the
//! records its ranks wrote to `RUN_DIR/flight/` ([`engine::parallel::flight`]).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use engine::parallel::flight;

#[derive(Args)]
pub struct FlightArgs {
    /// The run directory (its `flight/` folder holds a `rank-R.json` per rank that wrote one).
    #[arg(value_name = "RUN_DIR")]
    run_dir: PathBuf,
}

pub fn run(args: FlightArgs) -> Result<()> {
    println!("{}", flight::diagnose(&args.run_dir.join(flight::DIR))?);
    Ok(())
}
