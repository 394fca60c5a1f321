//! The `engine` command as a user runs it: training lowers the loss, runs are reproducible,
//! recipes report the published sizes, and bad input gets one clear line and exit code 2.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn engine(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(args)
        .env_remove("ENGINE_FLAGS")
        .env_remove("ENGINE_DEFAULT_FLAGS")
        .output()
        .expect("engine runs")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("engine-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The losses recorded in a run directory's metrics.jsonl.
fn losses(run_dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

fn train(recipe: &str, run_dir: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--recipe", recipe, "--run-dir", run_dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    let out = engine(&args);
    assert!(out.status.success(), "{recipe}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

#[test]
fn each_seed_configuration_learns() {
    let dir = scratch("learns");
    for recipe in ["tiny-llama2", "tiny-mistral", "tiny-mixtral"] {
        let run = dir.join(recipe);
        train(recipe, &run, &["--steps", "8"]);
        let l = losses(&run);
        assert_eq!(l.len(), 8);
        assert!(l[7] < 0.9 * l[0], "{recipe}: loss {} -> {}", l[0], l[7]);
        let record: serde_json::Value =
            serde_json::from_str(std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().next().unwrap())
                .unwrap();
        for key in ["step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"] {
            assert!(record[key].is_number(), "{recipe}: metrics lack {key}");
        }
        assert!(run.join("summary.json").exists() && run.join("config.toml").exists());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_same_seed_gives_bitwise_identical_losses() {
    let dir = scratch("determinism");
    let small = ["--steps", "4", "--set", "model.vocab_size=512", "--set", "model.d_model=256"];
    let runs: Vec<Vec<u64>> = ["a", "b"]
        .iter()
        .map(|name| {
            let run = dir.join(name);
            train("tiny-mixtral", &run, &small);
            losses(&run).iter().map(|l| l.to_bits()).collect()
        })
        .collect();
    assert_eq!(runs[0], runs[1]);
    let other = dir.join("other-seed");
    let mut args = small.to_vec();
    args.extend(["--set", "train.seed=99"]);
    train("tiny-mixtral", &other, &args);
    assert_ne!(losses(&other).iter().map(|l| l.to_bits()).collect::<Vec<_>>(), runs[0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The done-when of the GPT family: 30 steps of tiny-gpt lower the loss by at least 10 %, and two
/// runs give the same losses bit for bit.
#[test]
fn tiny_gpt_learns_and_is_reproducible() {
    let dir = scratch("gpt");
    let runs: Vec<Vec<f64>> = ["a", "b"]
        .iter()
        .map(|name| {
            let run = dir.join(name);
            train("tiny-gpt", &run, &["--steps", "30", "--device", "cpu"]);
            losses(&run)
        })
        .collect();
    let l = &runs[0];
    assert_eq!(l.len(), 30);
    // Single steps are noisy (one sequence of 64 bytes): compare the first loss with the mean of
    // the last five.
    let last = l[25..].iter().sum::<f64>() / 5.0;
    assert!(last < 0.9 * l[0], "tiny-gpt: loss {} -> {last}", l[0]);
    let bits = |l: &[f64]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&runs[0]), bits(&runs[1]));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The GPT family under data parallelism and FSDP (2 virtual devices: the position table and
/// the biases gathered and reduced with their units) follows one device training the same
/// global batch.
#[test]
fn tiny_gpt_trains_alike_on_one_device_and_two_sharded_ones() {
    let dir = scratch("gpt-mesh");
    let steps = ["--steps", "4", "--device", "cpu"];
    let one = dir.join("one");
    train("tiny-gpt", &one, &[&steps[..], &["--set", "train.batch_size=2"]].concat());
    for (name, mesh) in [("dp", "mesh.ici_data=2"), ("fsdp", "mesh.ici_fsdp=2")] {
        let run = dir.join(name);
        let data = if name == "fsdp" { "mesh.ici_data=1" } else { "mesh.ici_fsdp=1" };
        train("tiny-gpt", &run, &[&steps[..2], &["--devices", "2", "--set", mesh, "--set", data]].concat());
        for (a, b) in losses(&one).iter().zip(losses(&run)) {
            assert!((a - b).abs() <= 1e-5 * a, "{name}: loss {b} vs one device's {a}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn recipes_show_the_published_parameter_counts() {
    for (recipe, count) in [
        ("llama3-8b", "8,030,261,248"),
        ("llama2-7b", "6,738,415,616"),
        ("mistral-7b", "7,241,732,096"),
        ("mixtral-8x7b", "46,702,792,704"),
        // Pax's GPT sizes (126M, 5B, 175B), counted with positions and biases.
        ("gpt-126m", "125,262,336"),
        ("gpt-5b", "5,047,558,144"),
        ("gpt-175b", "174,604,259,328"),
    ] {
        let out = engine(&["recipes", "show", recipe]);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(out.status.success() && text.contains(count), "{recipe}: {text}");
        assert!(text.contains("Causal halving is applied"));
    }
    let list = String::from_utf8(engine(&["recipes", "list"]).stdout).unwrap();
    for recipe in [
        "tiny-llama2",
        "llama3.1-405b",
        "fuji-1B-v3",
        "fuji-70B-v1",
        "mixtral-8x7b",
        "fuji-7B-v2-flash",
        "fuji-70B-v3-flash-single-host",
    ] {
        assert!(list.contains(recipe), "{recipe} missing from the list");
    }
}

#[test]
fn overrides_apply_in_order_defaults_then_user_flags_then_the_command_line() {
    let show = |default_flags: &str, flags: &str, set: &[&str]| {
        let mut args = vec!["recipes", "show", "tiny-llama2"];
        for s in set {
            args.extend(["--set", s]);
        }
        let out = Command::new(env!("CARGO_BIN_EXE_engine"))
            .args(&args)
            .env("ENGINE_DEFAULT_FLAGS", default_flags)
            .env("ENGINE_FLAGS", flags)
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    assert!(show("train.steps=7 train.seed=3", "", &[]).contains("steps = 7"));
    let text = show("train.steps=7 train.seed=3", "train.steps=8", &[]);
    assert!(text.contains("steps = 8") && text.contains("seed = 3"), "ENGINE_FLAGS adds to the defaults: {text}");
    assert!(show("train.steps=7", "train.steps=8", &["train.steps=9"]).contains("steps = 9"));
}

/// Bad input: exit code 2, one line on stderr naming the problem, no panic, no run directory.
#[test]
fn bad_input_gets_one_clear_line() {
    let dir = scratch("errors");
    let bad_toml = dir.join("bad.toml");
    std::fs::write(&bad_toml, "[model]\nd_model = 64\nn_layers = \"two\"\n").unwrap();
    let bad_str = bad_toml.to_str().unwrap();
    let cases: [(&[&str], &str); 29] = [
        (&["--recipe", "tiny-llama2", "--set", "optim.qk_clip=-1"], "optim.qk_clip = -1 must be a non-negative number"),
        (
            &["--recipe", "tiny-qwen3", "--set", "optim.name=muon", "--set", "optim.qk_clip=100"],
            "optim.qk_clip = 100: this model normalises every q and k head after its projection",
        ),
        (&["--recipe", "tiny-gpt", "--set", "model.n_kv_heads=2"], "model.n_kv_heads = 2 must equal model.n_heads = 4"),
        (
            &["--recipe", "tiny-llama2", "--set", "optim.name=muon", "--set", "optim.muon.ns_steps=0"],
            "optim.muon.ns_steps = 0: at least 1 Newton–Schulz iteration",
        ),
        (
            &["--recipe", "tiny-llama2", "--set", "optim.name=muon", "--set", "optim.muon.momentum=-0.5"],
            "optim.muon.momentum = -0.5 must lie in [0, 1)",
        ),
        (
            &["--recipe", "tiny-llama2", "--set", "optim.muon.adjust_lr_fn=spectral"],
            "unknown variant `spectral`, expected `original` or `match_rms_adamw`",
        ),
        (
            &["--recipe", "tiny-llama2", "--reset-optimizer"],
            "--reset-optimizer resets a resumed run's optimizer state: add --resume",
        ),
        (
            &[
                "--recipe",
                "tiny-gpt",
                "--devices",
                "2",
                "--set",
                "mesh.ici_data=1",
                "--set",
                "mesh.ici_tensor=2",
                "--set",
                "model.vocab_size=513",
            ],
            "does not divide model.vocab_size = 513 (vocabulary parallelism",
        ),
        (&["--recipe", "tiny-lama2"], "unknown recipe `tiny-lama2` (did you mean `tiny-llama2`?)"),
        (&["--recipe", "tiny-llama2", "--set", "model.n_headz=4"], "unknown field `n_headz`"),
        (&["--recipe", "tiny-llama2", "--set", "train.seq_len=long"], "--set train.seq_len=long: invalid type"),
        (
            &["--recipe", "tiny-llama2", "--set", "model.n_kv_heads=3"],
            "model.n_heads = 8 is not divisible by model.n_kv_heads = 3",
        ),
        (
            &["--recipe", "tiny-mixtral", "--set", "model.moe.top_k=9"],
            "model.moe.top_k = 9 is larger than model.moe.num_experts = 8",
        ),
        (
            &["--recipe", "tiny-llama2", "--set", "train.seq_len=5000"],
            "train.seq_len = 5000 is longer than model.max_seq_len = 4096",
        ),
        (&["--recipe", "tiny-llama2", "--set", "model.n_layers=0"], "model.n_layers must be greater than 0"),
        (&["--recipe", "tiny-llama2", "--set", "model.vocab_size=100"], "model.vocab_size = 100"),
        (&["--recipe", "/nonexistent/recipe.toml"], "cannot read recipe file /nonexistent/recipe.toml"),
        (&["--recipe", bad_str], "bad.toml:3:12: invalid type"),
        (&["--recipe", "tiny-llama2", "--steps", "many"], "invalid value 'many'"),
        (&["--recipe", "tiny-llama2", "--devices", "0"], "--devices 0: a run needs at least one device"),
        (
            &["--recipe", "tiny-llama2", "--devices", "2", "--set", "mesh.ici_data=1", "--set", "mesh.ici_pipeline=2"],
            "ici_pipeline x dcn_pipeline = 2 x 1 = 2 stages, more than model.n_layers = 1",
        ),
        (
            &[
                "--recipe",
                "tiny-mixtral",
                "--devices",
                "2",
                "--set",
                "mesh.ici_data=1",
                "--set",
                "mesh.ici_pipeline=2",
                "--set",
                "train.pipeline_microbatches=3",
            ],
            "train.pipeline_microbatches = 3 does not divide the 2 sequences",
        ),
        (
            &[
                "--recipe",
                "tiny-llama2",
                "--devices",
                "2",
                "--set",
                "model.n_layers=3",
                "--set",
                "mesh.ici_data=1",
                "--set",
                "mesh.ici_pipeline=2",
                "--set",
                "train.pipeline_layers=[1,1,1]",
            ],
            "train.pipeline_layers = [1, 1, 1] gives 3 stages, but the pipeline axis has 2",
        ),
        (
            &["--recipe", "tiny-llama2", "--set", "model.n_layers=3", "--set", "train.pipeline_layers=[1,3]"],
            "train.pipeline_layers = [1, 3] sums to 4 layers, but model.n_layers = 3",
        ),
        (
            &["--recipe", "tiny-llama2", "--set", "model.n_layers=3", "--set", "train.pipeline_layers=[3,0]"],
            "train.pipeline_layers = [3, 0] gives stage 1 no layers",
        ),
        (
            &["--recipe", "tiny-llama2", "--set", "train.pipeline_virtual_stages=2"],
            "train.pipeline_virtual_stages = 2 needs train.pipeline_schedule = \"interleaved\"",
        ),
        (
            &[
                "--recipe",
                "tiny-llama2",
                "--devices",
                "2",
                "--set",
                "model.n_layers=3",
                "--set",
                "mesh.ici_data=1",
                "--set",
                "mesh.ici_pipeline=2",
                "--set",
                "train.pipeline_schedule=\"interleaved\"",
                "--set",
                "train.pipeline_virtual_stages=2",
                "--set",
                "train.pipeline_microbatches=2",
            ],
            "more than model.n_layers = 3",
        ),
        (
            &[
                "--recipe",
                "tiny-llama2",
                "--devices",
                "2",
                "--set",
                "model.n_layers=6",
                "--set",
                "mesh.ici_data=1",
                "--set",
                "mesh.ici_pipeline=2",
                "--set",
                "train.pipeline_schedule=\"interleaved\"",
                "--set",
                "train.pipeline_virtual_stages=2",
                "--set",
                "train.pipeline_microbatches=2",
            ],
            "model.n_layers = 6 does not split evenly into 2 stages x train.pipeline_virtual_stages = 2 = 4 virtual stages",
        ),
        (
            &[
                "--recipe",
                "tiny-llama2",
                "--devices",
                "2",
                "--set",
                "model.n_layers=4",
                "--set",
                "mesh.ici_data=1",
                "--set",
                "mesh.ici_pipeline=2",
                "--set",
                "train.batch_size=3",
                "--set",
                "train.pipeline_schedule=\"interleaved\"",
                "--set",
                "train.pipeline_microbatches=3",
            ],
            "train.pipeline_microbatches = 3 is not a multiple of the 2 pipeline stages",
        ),
    ];
    for (i, (args, expected)) in cases.iter().enumerate() {
        let run = dir.join(format!("run-{i}"));
        let mut full = vec!["train", "--run-dir", run.to_str().unwrap()];
        full.extend_from_slice(args);
        let out = engine(&full);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: expected `{expected}` in: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("backtrace"), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: more than one line: {stderr}");
        assert!(!run.exists(), "{args:?} left a run directory behind");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The command line's own errors (clap's) are one line too, keeping clap's tip; a value that
/// starts with `-` is taken by `--separator`, and the tip for other options says how; nonsense
/// sizes are refused before any work.
#[test]
fn command_line_errors_are_one_line_with_their_tip() {
    let cases: [(&[&str], &str); 8] = [
        (&["train", "--recipe", "tiny-llama2", "--steps", "abc"], "invalid value 'abc' for '--steps <N>'"),
        (&["trian"], "unrecognized subcommand 'trian' (tip: a similar subcommand exists: 'train'"),
        (&["data", "prepare", "--input", "x"], "required arguments were not provided: --tokenizer <FILE>, --out <DIR>"),
        (
            &["train", "--recipe", "tiny-llama2", "--set", "---"],
            "join them with '=': --OPTION=---; for more information, try '--help')",
        ),
        // `--separator ---` is taken as the separator: the error is the missing tokenizer's.
        (
            &["data", "prepare", "--tokenizer", "/nonexistent", "--input", "x", "--out", "y", "--separator", "---"],
            "/nonexistent",
        ),
        (
            &["recipes", "show", "tiny-llama2", "--devices", "0"],
            "--devices 0: a plan needs at least one device per node",
        ),
        (&["recipes", "show", "tiny-llama2", "--nodes", "0"], "--nodes 0: a plan needs at least one node"),
        (&["--threads", "20000", "info"], "--threads 20000: this process may use"),
    ];
    for (args, expected) in cases {
        let out = engine(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains(expected),
            "{args:?}: expected `{expected}` in: {stderr}"
        );
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: more than one line: {stderr}");
    }
}

/// RUN_DIR/.lock is the engine's own file: a symbolic link there (to a file the user cares
/// about) is refused, not truncated and written through.
#[test]
fn a_lock_file_linked_elsewhere_is_refused_and_its_target_kept() {
    let dir = scratch("lock-link");
    let (run, victim) = (dir.join("run"), dir.join("victim"));
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(&victim, "precious").unwrap();
    std::os::unix::fs::symlink(&victim, run.join(".lock")).unwrap();
    let out = engine(&["train", "--recipe", "tiny-llama2", "--steps", "1", "--run-dir", run.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(".lock is a symbolic link, not the lock file this engine writes"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert!(!run.join("metrics.jsonl").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_directory_is_never_reused_silently() {
    let dir = scratch("reuse");
    let run = dir.join("run");
    train("tiny-mistral", &run, &["--steps", "1", "--set", "model.d_model=64"]);
    let out = engine(&["train", "--recipe", "tiny-mistral", "--steps", "1", "--run-dir", run.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already holds a run"));
    assert_eq!(losses(&run).len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Sizes are bounded (nothing computed from them overflows), a run that cannot fit is refused
/// before it allocates, with the arithmetic, and an allocation that fails anyway ends in one
/// line with exit code 2, never an abort: here under `ulimit -v`, as on a crowded machine.
#[test]
fn sizes_and_memory_are_checked_before_use() {
    let dir = scratch("sizes");
    let one_line = |out: &Output, expected: &str, args: &str| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args}: {stderr}");
        assert!(stderr.contains(expected), "{args}: expected `{expected}` in: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args}: more than one line: {stderr}");
    };
    for (set, expected) in [
        ("model.d_model=1000000000", "model.d_model = 1000000000 is more than this engine trains (at most 131072)"),
        ("model.vocab_size=4611686018427387904", "model.vocab_size = 4611686018427387904 is more than"),
        ("train.batch_size=4611686018427387904", "is more than this engine trains (at most 1048576)"),
        ("model.n_layers=4096", "parameters, more than this engine trains"),
    ] {
        let extra = ["--set", "model.d_model=131072", "--set", "model.mlp_dim=1048576"];
        let mut args = vec!["recipes", "show", "tiny-llama2", "--set", set];
        if set.starts_with("model.n_layers") {
            args.extend(extra);
        }
        one_line(&engine(&args), expected, set);
    }

    // About 9 GiB of state on the CPU under a 4 GiB address-space limit.
    let big = "--set model.d_model=4096 --set model.mlp_dim=8192 --set model.n_heads=32 --set model.n_kv_heads=32 --set model.head_dim=128 --set model.vocab_size=32000";
    let limited = |extra: &str, run: &str| {
        let cmd = format!(
            "ulimit -v 4194304 && exec {} train --recipe tiny-llama2 --steps 1 --run-dir {} {big} {extra}",
            env!("CARGO_BIN_EXE_engine"),
            dir.join(run).display()
        );
        Command::new("sh").args(["-c", &cmd]).env_remove("ENGINE_FLAGS").output().unwrap()
    };
    let refused = limited("", "refused");
    one_line(&refused, "on the CPU: parameters", "the memory check");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("ulimit -v"), "the limit is named");
    one_line(
        &limited("--set train.memory_check=false", "oom"),
        "error: out of memory: an allocation of",
        "the OOM line",
    );
    assert!(!dir.join("refused").exists() && !dir.join("oom").exists(), "a refused run leaves no run directory");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `recipes show` plans memory per device for the recipe's mesh: FSDP's shards make a device's
/// share smaller than a data-parallel replica's (llama2-7b fits an 80 GiB GPU on the seed's A3
/// Mega mesh, and data parallelism needs more than twice as much); `--json` carries every figure.
#[test]
fn recipes_show_plans_memory_for_the_mesh() {
    let show = |mesh: &[&str]| -> serde_json::Value {
        let seed = ["train.batch_size=4", "train.seq_len=4096", "train.remat=minimal"];
        let mut args = vec!["recipes", "show", "llama2-7b", "--json"];
        for set in seed {
            args.extend(["--set", set]);
        }
        for set in mesh {
            args.extend(["--set", set]);
        }
        let out = engine(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let fsdp = show(&["mesh.dcn_data=2", "mesh.ici_fsdp=8", "mesh.ici_data=1"]);
    let dp = show(&["mesh.dcn_data=2", "mesh.ici_fsdp=1", "mesh.ici_data=8"]);
    assert_eq!(fsdp["mesh"]["devices"], 16);
    assert_eq!((fsdp["mesh"]["fsdp"].as_u64(), fsdp["mesh"]["data"].as_u64()), (Some(8), Some(2)));
    assert!(fsdp["parameters"].as_u64().unwrap() > 6_000_000_000 && fsdp["flops_per_token"].as_f64().unwrap() > 0.0);
    for target in ["cuda", "cpu"] {
        let total = |v: &serde_json::Value, key: &str| v["memory_per_device"][target][key].as_u64().unwrap();
        assert!(total(&fsdp, "total_bytes") < total(&dp, "total_bytes"), "{target}: {fsdp} vs {dp}");
        assert!(total(&fsdp, "optimizer_bytes") * 7 < total(&dp, "optimizer_bytes"), "FSDP shards the moments");
        for state in ["parameters_bytes", "gradients_bytes"] {
            assert!(total(&fsdp, state) * 4 < total(&dp, state), "FSDP shards the {state}");
        }
    }
    let cuda = |v: &serde_json::Value| v["memory_per_device"]["cuda"]["total_bytes"].as_u64().unwrap();
    assert!(cuda(&fsdp) < 80 << 30 && cuda(&dp) > 2 * cuda(&fsdp), "{} vs {}", cuda(&fsdp), cuda(&dp));
    let out = engine(&["recipes", "show", "llama2-7b", "--set", "mesh.ici_fsdp=2", "--devices", "3"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not divide the 3 devices per node"));
}

/// Device and node counts are bounded before anything is counted from them: 4 x 2^62 devices
/// wrapped to "0 devices", 2^64 - 1 to a wrapped tokens-per-step, and `recipes plan` took
/// minutes over 2^32 nodes. Each is one line, exit code 2, even with RUST_BACKTRACE=1.
#[test]
fn device_and_node_counts_are_bounded() {
    let huge = "more than this engine plans for (at most 1048576)";
    let plan = ["recipes", "plan", "tiny-llama2", "--memory", "80", "--devices-per-node"];
    let cases: [(&[&str], &str); 5] = [
        (&["recipes", "show", "tiny-llama2", "--devices", "4", "--nodes", "4611686018427387904"], huge),
        (&["recipes", "show", "tiny-llama2", "--devices", "18446744073709551615"], "18446744073709551615 devices"),
        (
            &[
                "recipes",
                "show",
                "tiny-llama2",
                "--set",
                "mesh.dcn_data=4611686018427387904",
                "--set",
                "mesh.ici_fsdp=4",
            ],
            huge,
        ),
        (&[&plan[..], &["8", "--nodes", "4294967296"]].concat(), "34359738368 devices, more than"),
        (&[&plan[..], &["18446744073709551615", "--nodes", "2"]].concat(), huge),
    ];
    for (args, expected) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_engine"))
            .args(args)
            .env_remove("ENGINE_FLAGS")
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: expected `{expected}` in: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: more than one line: {stderr}");
    }
}

/// `engine recipes plan`: a JSON list, best first, whose first row `recipes show` confirms with
/// its `sets`; every plan that fits llama3.1-8b at 131,072 tokens on one node has a seq or a
/// tensor axis, the first a seq axis;
/// nothing fitting and bad arguments are one line with exit code 2.
#[test]
fn recipes_plan_ranks_what_fits_and_names_the_closest_otherwise() {
    let base = ["recipes", "plan", "llama3.1-8b", "--nodes", "1", "--devices-per-node", "8"];
    let long = ["--set", "train.seq_len=131072", "--json"];
    let out = engine(&[&base[..], &["--memory", "80"], &long[..]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!rows.is_empty());
    let times: Vec<f64> = rows.iter().map(|r| r["step_time_estimate_s"].as_f64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "not best first: {times:?}");
    let sets: Vec<&str> = rows[0]["sets"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    // Each splits the sequence or (vocabulary parallelism) the logits over a tensor axis.
    let unsplit = |r: &serde_json::Value| {
        let sets = r["sets"].as_array().unwrap();
        sets.contains(&"mesh.ici_seq=1".into()) && sets.contains(&"mesh.ici_tensor=1".into())
    };
    assert!(rows.iter().all(|r| !unsplit(r)) && !sets.contains(&"mesh.ici_seq=1"), "{rows:?}");
    let mut show = vec!["recipes", "show", "llama3.1-8b", "--json", "--devices", "8", "--nodes", "1"];
    for set in std::iter::once("train.seq_len=131072").chain(sets.iter().copied()) {
        show.extend(["--set", set]);
    }
    let out = engine(&show);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bytes = shown["memory_per_device"]["cuda"]["total_bytes"].as_u64().unwrap();
    assert_eq!(bytes, rows[0]["memory_per_device_bytes"].as_u64().unwrap());
    assert!(bytes < 80 << 30);
    for (args, want) in [
        (vec!["--memory", "20"], "nothing fits 20 GiB per device on 1 x 8 devices; the closest needs"),
        (vec!["--memory", "0"], "--memory 0: a plan needs a positive number"),
        (vec!["--memory", "80", "--mfu", "1.5"], "--mfu 1.5: a share of the peak is at most 1"),
    ] {
        let out = engine(&[&base[..], &args[..], &long[..]].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(want) && err.trim().lines().count() == 1, "{err}");
    }
}
