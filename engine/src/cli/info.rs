//! `engine info`: what this engine is and what it runs on.

use anyhow::Result;
use engine::backend::cpu;

/// Where an image keeps the lock of the sources it was built from.
const LOCK_IN_IMAGE: &str = "/opt/distro/manifest.lock";

pub fn run() -> Result<()> {
    println!("engine {} ({})", env!("CARGO_PKG_VERSION"), option_env!("ENGINE_REVISION").unwrap_or("revision unknown"));
    println!("target        {}-{}", std::env::consts::ARCH, std::env::consts::OS);
    println!("\ndevices");
    println!("  cpu         {} ({} threads)", cpu::model_name(), rayon::current_num_threads());
    println!("\nflags in effect");
    let mut any = false;
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            k.starts_with("ENGINE_") || k.starts_with("NCCL_") || k.starts_with("CUDA_") || k == "RAYON_NUM_THREADS"
        })
        .collect();
    vars.sort();
    for (k, v) in vars {
        println!("  {k}={v}");
        any = true;
    }
    if !any {
        println!("  (none set)");
    }
    println!("\nupstream pins");
    match std::fs::read_to_string(LOCK_IN_IMAGE) {
        Ok(lock) => print!("{}", lock.lines().map(|l| format!("  {l}\n")).collect::<String>()),
        Err(_) => println!("  (no {LOCK_IN_IMAGE}: not running from a distro image)"),
    }
    Ok(())
}
