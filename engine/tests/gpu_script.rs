//! `tests/gpu.sh`, the GPU phases, without a GPU: the script parses, its phase list keeps every
//! phase within 10 minutes and the whole within 80 (by its own estimates), bad usage is one line
//! with exit code 2, and the long run's pieces — each resuming from the previous one's
//! checkpoint — make exactly the run one process makes (on the CPU, with a tiny model in place of
//! llama3.2-1b, through the script's DEVICE / LONG_* variables). The Python peers its bench
//! phases run (bench/*.py, which need torch or JAX and a GPU) are compiled, so that a syntax
//! error is found here rather than in a GPU slot.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{engine, s, scratch};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/gpu.sh")
}

fn gpu_sh(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new("bash");
    cmd.arg(script()).args(args).env("ENGINE", env!("CARGO_BIN_EXE_engine"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.env_remove("ENGINE_FLAGS").env_remove("ENGINE_DEFAULT_FLAGS").output().expect("bash runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn the_script_parses_and_lists_phases_within_the_time_budget() {
    let out = Command::new("bash").arg("-n").arg(script()).output().unwrap();
    assert!(out.status.success(), "bash -n: {}", text(&out.stderr));

    let out = gpu_sh(&["list"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let mut rows: Vec<(String, u32)> = Vec::new();
    let (mut total, mut quick) = (None, None);
    for line in stdout.lines().skip(1) {
        let mut f = line.split_whitespace();
        let (name, minutes) = (f.next().unwrap().to_owned(), f.next().unwrap().parse::<u32>().unwrap());
        match name.as_str() {
            "total" => total = Some(minutes),
            // The short loan's one call, instead of the others: not in the total.
            "quick" => quick = Some(minutes),
            _ => rows.push((name, minutes)),
        }
    }
    assert!(quick.is_some_and(|m| m <= 9), "the quick phase must fit 9 minutes: {stdout}");
    let names: Vec<&str> = rows.iter().map(|(n, _)| n.as_str()).collect();
    for phase in [
        "gpu-test",
        "test-all",
        "fp8",
        "bench-llama3.2-1b",
        "bench-fuji-3B-v3",
        "bench-mixtral-8x7b",
        "bench-qwen3",
        "bench-gpt-oss",
        "bench-gemma3",
        "bench-muon",
        "long-1",
        "long-4",
        "long-check",
    ] {
        assert!(names.contains(&phase), "{phase} missing: {stdout}");
    }
    // The long run's pieces come in order, after its CPU reference and before its check.
    let at = |p: &str| names.iter().position(|n| *n == p).unwrap();
    assert!(at("long-cpu") < at("long-1") && at("long-1") < at("long-2") && at("long-4") < at("long-check"));
    for (name, minutes) in &rows {
        assert!(*minutes <= 10, "{name}: {minutes} minutes, more than a 10-minute slot");
    }
    let sum: u32 = rows.iter().map(|(_, m)| m).sum();
    assert_eq!(total, Some(sum), "{stdout}");
    // Eight slots of 10 minutes: what a lent GPU's time should cover when every phase runs (the
    // Mixtral phase of issue 35 took the 5 minutes left spare of six; the Qwen3 phase a seventh,
    // the GPT-OSS phase an eighth; the Gemma 3 phase 5 of the 8 minutes then still spare, the Muon phase
    // the last 3).
    assert!(sum <= 80, "the phases take {sum} minutes, more than 80: {stdout}");
    assert!(stdout.contains("which were measured on a GPU"), "{stdout}");
}

#[test]
fn the_bench_peers_are_valid_python() {
    let bench = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench");
    let mut scripts: Vec<PathBuf> = std::fs::read_dir(&bench)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
        .collect();
    scripts.sort();
    for name in ["compare.py", "torch_train.py", "torch_moe.py", "jax_train.py"] {
        assert!(scripts.iter().any(|p| p.ends_with(name)), "bench/{name} missing");
    }
    // compile() checks the syntax without writing __pycache__ into the checkout.
    let check = "import sys\nfor f in sys.argv[1:]:\n    compile(open(f).read(), f, 'exec')";
    let out = Command::new("python3").arg("-c").arg(check).args(&scripts).output().expect("python3 runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn bad_usage_is_one_line_with_exit_code_2() {
    let dir = scratch("gpu-sh-usage");
    let out_dir = dir.join("out");
    for (args, expected, engine_path) in [
        (vec![], "no phase given", None),
        (vec!["nope", s(&out_dir)], "unknown phase nope", None),
        (vec!["gpu-test"], "gpu-test needs one OUTDIR", None),
        (vec!["list", s(&out_dir)], "list takes no folder", None),
        (vec!["gpu-test", s(&out_dir)], "no engine binary at /nonexistent/engine", Some("/nonexistent/engine")),
    ] {
        let env: Vec<(&str, &str)> = engine_path.map(|p| ("ENGINE", p)).into_iter().collect();
        let out = gpu_sh(&args, &env);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: expected `{expected}` in {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
    }
    assert!(!out_dir.exists(), "bad usage created the output folder");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The losses of a run directory's metrics.jsonl.
fn losses(run_dir: &Path) -> Vec<f64> {
    common::metrics(run_dir).iter().map(|m| m["loss"].as_f64().unwrap()).collect()
}

#[test]
fn the_long_run_in_pieces_is_the_run_one_process_makes() {
    let dir = scratch("gpu-sh-long");
    let out = dir.join("out");
    let sets = "model.d_model=64 model.n_heads=2 model.n_kv_heads=2 model.head_dim=32 model.mlp_dim=128 \
                model.vocab_size=256 train.seq_len=32 train.batch_size=4 optim.lr=1e-2 optim.warmup_steps=2";
    let env = [("DEVICE", "cpu"), ("LONG_RECIPE", "tiny-llama2"), ("LONG_SETS", sets), ("LONG_STEPS", "40")];
    let run = |phase: &str| {
        let o = gpu_sh(&[phase, s(&out)], &env);
        (o.status.code(), text(&o.stdout), text(&o.stderr))
    };
    // A piece before its predecessor is refused, naming it.
    let (code, stdout, _) = run("long-2");
    assert_eq!(code, Some(1), "{stdout}");
    assert!(
        stdout.contains("long-2 starts at step 10, but the newest checkpoint") && stdout.contains("run long-1 first")
    );
    for phase in ["long-cpu", "long-1", "long-2", "long-3", "long-4", "long-check"] {
        let (code, stdout, stderr) = run(phase);
        assert_eq!(code, Some(0), "{phase}: {stdout}\n{stderr}");
        assert!(stdout.contains(&format!("== {phase}: done after")), "{phase}: {stdout}");
    }
    // A piece already run is not run again.
    let (code, stdout, _) = run("long-3");
    assert_eq!(code, Some(0));
    assert!(stdout.contains("long-3: already done (checkpoint of step 40"), "{stdout}");

    // The same run in one process: the same losses, bit for bit (the CPU is deterministic).
    let straight = dir.join("straight");
    let mut args =
        vec!["--device", "cpu", "train", "--recipe", "tiny-llama2", "--steps", "40", "--run-dir", s(&straight)];
    let decay = "optim.decay_steps=40".to_string();
    for set in sets.split_whitespace().chain([decay.as_str()]) {
        args.extend(["--set", set]);
    }
    let o = engine(&args);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let pieces = losses(&out.join("long-run/run"));
    assert_eq!(pieces.len(), 40);
    assert_eq!(pieces, losses(&straight), "the pieced run differs from the one-process run");
    // Every phase left its log and its line in durations.tsv under the one output folder.
    let durations = std::fs::read_to_string(out.join("durations.tsv")).unwrap();
    assert!(durations.lines().any(|l| l.starts_with("long-check\t")), "{durations}");
    assert!(out.join("long-4.log").is_file() && out.join("long-4/metrics.jsonl").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `tests/gpu.sh quick`, the short loan's one call, end to end on the CPU emulator of a GPU with
/// its shapes shrunk (DEVICE=emulate and the QUICK_* variables): gpu-test's checks, bf16 and fp8
/// at two shapes in two interleaved rounds, a peer that fails (reported in the summary, not a
/// failed phase), one summary.json with each shape's ratio, and few files brought back.
#[test]
fn the_quick_phase_runs_end_to_end_on_the_emulator() {
    if !engine::backend::cuda::emulator::compiler_available() {
        assert!(std::env::var("ENGINE_REQUIRE_EMULATOR").is_err(), "no C++ compiler for the emulator");
        eprintln!("SKIPPED: the quick phase on the emulator: no C++ compiler");
        return;
    }
    let dir = scratch("gpu-sh-quick");
    let (out, no_wheels) = (dir.join("out"), dir.join("no-wheels"));
    let small = "model.d_model=64 model.n_layers=1 model.head_dim=16 model.vocab_size=256 train.seq_len=64 \
                 train.batch_size=1 train.fp8.min_dim=16";
    let shapes =
        format!("tiny-llama2 {small} model.mlp_dim=128;tiny-mixtral {small} model.mlp_dim=64 model.moe.num_experts=4");
    let env = [
        ("DEVICE", "emulate"),
        ("QUICK_CHECKS", "fp8 48x32"),
        ("QUICK_SHAPES", shapes.as_str()),
        ("QUICK_STEPS", "1"),
        ("QUICK_WARMUP", "1"),
        // compare.py's engine run asks for --device cuda, which this machine lacks: the peer fails.
        ("QUICK_PEERS", "tiny-llama2 bf16 eager"),
        ("WHEELS", s(&no_wheels)),
    ];
    let o = gpu_sh(&["quick", s(&out)], &env);
    let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("== quick: done after"), "{stdout}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("quick/summary.json")).unwrap()).unwrap();
    for recipe in ["tiny-llama2", "tiny-mixtral"] {
        let shape = &summary["shapes"][recipe];
        for precision in ["bf16", "fp8"] {
            assert_eq!(shape[precision]["rounds"], 2, "{recipe} {precision}: {shape}");
            assert!(shape[precision]["device"].as_str().unwrap().contains("emulator"), "{shape}");
        }
        assert!(shape["fp8_over_bf16"].as_f64().unwrap() > 0.0, "{shape}");
    }
    assert_eq!(summary["shapes"]["tiny-llama2"]["peers"]["bf16"][0]["failed"], true, "{summary}");
    assert_eq!(summary["checks"][0]["failed"].as_array().unwrap().len(), 0, "{summary}");
    // What a GPU call brings back: the log, the durations, the summary and one tarball.
    let mut files = Vec::new();
    let mut stack = vec![out.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() { stack.push(p) } else { files.push(p) }
        }
    }
    assert!(files.len() <= 8, "{} files: {files:?}", files.len());
    std::fs::remove_dir_all(&dir).unwrap();
}
