//! `engine info`: what this engine is and what it runs on.

use anyhow::Result;
use engine::backend::cpu;
use engine::backend::cuda::{cudnn, discovery, flags, nvrtc};

/// Where an image keeps the lock of the sources it was built from.
const LOCK_IN_IMAGE: &str = "/opt/distro/manifest.lock";

pub fn run() -> Result<()> {
    println!("engine {}", engine::parallel::engine_version());
    println!("target        {}-{}", std::env::consts::ARCH, std::env::consts::OS);
    println!("\ndevices");
    println!("  cpu         {} ({} threads)", cpu::model_name(), rayon::current_num_threads());
    let probed = discovery::probe();
    match &probed {
        Ok(devices) => {
            for d in devices {
                let peak = discovery::peak_tflops(&d.name)
                    .map_or("not in the peak table".into(), |p| format!("{p} TFLOP/s dense bf16"));
                println!(
                    "  cuda:{}      {} (sm_{}{}, {:.0} GiB, {} SMs, {peak})",
                    d.ordinal,
                    d.name,
                    d.capability.0,
                    d.capability.1,
                    d.memory as f64 / (1u64 << 30) as f64,
                    d.sm_count
                );
            }
        }
        Err(e) => println!("  cuda        none: {e}"),
    }
    let (loaded, problems) = discovery::preload_libraries();
    for path in loaded {
        println!("  loaded      {path} ({})", discovery::LIB_PATH_VAR);
    }
    for p in problems {
        println!("  warning     {p}");
    }
    match nvrtc::version() {
        Ok((a, b)) => println!(
            "  nvrtc       {a}.{b}; kernel cache {}",
            nvrtc::cache_dir().map_or("off".into(), |d| d.display().to_string())
        ),
        Err(e) => println!("  nvrtc       none: {e}"),
    }
    // cuDNN's fused attention: `train.attention = "auto"` takes it after a check against the CPU.
    match cudnn::version() {
        Ok(v) => println!(
            "  cudnn       {} (fused attention; train.attention = \"auto\" takes it after its check)",
            cudnn::dotted(v)
        ),
        Err(e) => println!("  cudnn       none: {e}; attention runs on the native kernels"),
    }
    // What the engine decides by GPU generation, for the device a single-GPU run opens.
    println!("\nflags by GPU generation (cuda:0; docs/flags.md)");
    let capability = probed.as_ref().ok().and_then(|d| d.first()).map(|d| d.capability);
    for (name, decision) in flags::decisions(capability, |k| std::env::var(k).ok()) {
        println!("  {name:<28} {decision}");
    }
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
