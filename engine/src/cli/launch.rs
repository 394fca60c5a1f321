//! `engine launch` starts one process per local device; `engine dist check` meets the other
//! processes of a job and reports who is who.

use std::net::TcpListener;
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use engine::parallel::{job, rendezvous};

#[derive(Args)]
pub struct LaunchArgs {
    /// Processes to start on this node, one per device.
    #[arg(long, value_name = "N")]
    nproc: usize,
    /// The engine command each process runs, after `--` (e.g. `-- train --recipe llama3-8b`).
    #[arg(last = true, required = true, value_name = "ARGS")]
    command: Vec<String>,
}

#[derive(Subcommand)]
pub enum DistCommand {
    /// Discover this process's rank from the launcher's variables, meet every other process of
    /// the job, and print who is who (a quick test of a cluster's setup).
    Check {
        /// Seconds to wait for every rank [default: ENGINE_RENDEZVOUS_TIMEOUT or 300].
        #[arg(long, value_name = "SECONDS")]
        timeout: Option<f64>,
    },
}

/// Seconds allowed for every rank to arrive, from `ENGINE_RENDEZVOUS_TIMEOUT` (default 300).
pub fn check(cmd: DistCommand) -> Result<()> {
    let DistCommand::Check { timeout } = cmd;
    let job = rendezvous::discover(|k| std::env::var(k).ok())?;
    // Rank 0 makes a token; everyone printing the same one shows they met the same coordinator.
    let token = rendezvous::rendezvous(&job, job::rendezvous_timeout(timeout)?, || {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        engine::rng::mix(seed ^ std::process::id() as u64).to_le_bytes().to_vec()
    })?;
    let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "rank {} of {} (local {} of {}), {} node(s), via {}: rendezvous at {} ok, token {hex}",
        job.rank,
        job.world,
        job.local_rank,
        job.local_world,
        job.nodes(),
        job.convention,
        if job.coordinator.is_empty() { "-" } else { &job.coordinator }
    );
    Ok(())
}

pub fn launch(args: LaunchArgs) -> Result<()> {
    anyhow::ensure!(args.nproc > 0, "--nproc must be at least 1");
    let exe = std::env::current_exe().context("cannot find the engine executable")?;
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    // Per-process variables: a node-level convention (MaxText/Vertex) only needs the local rank;
    // a single node needs a whole torchrun-style job description.
    let single_node = if var("JAX_COORDINATOR_ADDRESS").is_some() {
        let per_node: usize = var("GPUS_PER_NODE").and_then(|v| v.parse().ok()).unwrap_or(0);
        if per_node != args.nproc {
            bail!(
                "GPUS_PER_NODE = {} but --nproc {}: they must agree",
                var("GPUS_PER_NODE").unwrap_or_default(),
                args.nproc
            );
        }
        None
    } else if var("SLURM_PROCID").is_some() {
        bail!(
            "under Slurm, start one task per device with `srun --ntasks-per-node=N engine ...` instead of `engine launch`"
        );
    } else if var("RANK").is_some() || var("MASTER_ADDR").is_some() {
        bail!(
            "RANK/MASTER_ADDR are already set (a torchrun-style launcher started this process): run the command directly"
        );
    } else {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("no free port for the rendezvous")?
            .port();
        Some(port)
    };
    let mut children: Vec<Child> = Vec::with_capacity(args.nproc);
    for local in 0..args.nproc {
        let mut cmd = Command::new(&exe);
        cmd.args(&args.command).env("LOCAL_RANK", local.to_string()).env("LOCAL_WORLD_SIZE", args.nproc.to_string());
        if let Some(port) = single_node {
            cmd.env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", local.to_string())
                .env("WORLD_SIZE", args.nproc.to_string());
        }
        match cmd.spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                stop(&mut children);
                bail!("cannot start process {local}: {e}");
            }
        }
    }
    wait_all(children)
}

/// Waits for every process; when one fails, stops the others and reports the first failure.
fn wait_all(mut children: Vec<Child>) -> Result<()> {
    loop {
        let mut running = false;
        for (local, child) in children.iter_mut().enumerate() {
            match child.try_wait()? {
                Some(status) if !status.success() => {
                    stop(&mut children);
                    bail!("process {local} failed ({status}); stopped the others");
                }
                Some(_) => {}
                None => running = true,
            }
        }
        if !running {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stop(children: &mut [Child]) {
    for child in children.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
}
