//! Training across processes on the CPU (the TCP collectives): `engine launch --nproc N` and two
//! nodes' launchers follow the virtual devices' curves bit for bit, and a checkpoint written by
//! four processes resumes on two.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{SHRINK, Scratch, copy_dir, metrics, s, scratch};

/// `engine ARGS` with the launcher variables of the test process removed and `env` set.
fn engine(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = common::engine_cmd(args);
    for var in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"] {
        cmd.env_remove(var);
    }
    cmd.env_remove("JAX_COORDINATOR_ADDRESS").env_remove("ENGINE_JOB_TOKEN").envs(env.iter().copied());
    cmd
}

/// `train --device cpu` of tiny-llama2 into `run_dir` with `sets` (and the shrinking ones),
/// after `prefix` (`launch --nproc N --`, or nothing).
fn train_args<'a>(prefix: &[&'a str], run_dir: &'a Path, steps: &'a str, sets: &[&'a str]) -> Vec<String> {
    recipe_args("tiny-llama2", prefix, run_dir, steps, sets)
}

/// [`train_args`] of another recipe.
fn recipe_args<'a>(
    recipe: &str,
    prefix: &[&'a str],
    run_dir: &'a Path,
    steps: &'a str,
    sets: &[&'a str],
) -> Vec<String> {
    let mut args: Vec<String> = prefix.iter().map(|a| a.to_string()).collect();
    args.extend(
        ["train", "--device", "cpu", "--recipe", recipe, "--steps", steps, "--run-dir", s(run_dir)].map(String::from),
    );
    for set in SHRINK.iter().chain(sets) {
        args.extend(["--set".to_string(), set.to_string()]);
    }
    args
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).output().expect("engine runs");
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn losses(run_dir: &Path) -> Vec<f64> {
    metrics(run_dir).iter().filter_map(|m| m["loss"].as_f64()).collect()
}

/// Losses of `steps` steps on `n` processes of one node and on `n` virtual devices, same mesh,
/// run in `DIR/processes` and `DIR/virtual` of the scratch directory `DIR` returned.
fn processes_and_virtual(name: &str, n: usize, steps: &str, sets: &[&str]) -> (Scratch, Vec<f64>, Vec<f64>) {
    recipe_processes_and_virtual("tiny-llama2", name, n, steps, sets)
}

/// [`processes_and_virtual`] of another recipe.
fn recipe_processes_and_virtual(
    recipe: &str,
    name: &str,
    n: usize,
    steps: &str,
    sets: &[&str],
) -> (Scratch, Vec<f64>, Vec<f64>) {
    let dir = scratch(name);
    let (procs, virt) = (dir.join("processes"), dir.join("virtual"));
    let nproc = n.to_string();
    let args = recipe_args(recipe, &["launch", "--nproc", &nproc, "--"], &procs, steps, sets);
    run(&mut engine(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]));
    let mut args = recipe_args(recipe, &[], &virt, steps, sets);
    args.extend(["--devices".into(), nproc]);
    run(&mut engine(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]));
    (dir, losses(&procs), losses(&virt))
}

/// Three steps on `n` processes equal three on `n` virtual devices bit for bit (`what` names
/// the mesh); returns the scratch directory and the processes' losses.
fn three_steps_follow_virtual(name: &str, n: usize, sets: &[&str], what: &str) -> (Scratch, Vec<f64>) {
    let (dir, procs, virt) = processes_and_virtual(name, n, "3", sets);
    assert_eq!((procs.len(), &procs), (3, &virt), "{what}");
    (dir, procs)
}

#[test]
fn four_processes_fsdp_x_data_follow_four_virtual_devices_and_resume_on_two() {
    let mesh = ["mesh.ici_data=2", "mesh.ici_fsdp=2", "train.checkpoint_every=3"];
    let (dir, procs, virt) = processes_and_virtual("mp-fsdp", 4, "6", &mesh);
    assert_eq!(procs.len(), 6);
    assert_eq!(procs, virt, "4 processes (data 2 x fsdp 2) and 4 virtual devices, bit for bit");

    // The checkpoint of step 3, written by four processes, resumes on two (FSDP 2, the same
    // global batch) and ends on the four processes' curve.
    let four = dir.join("processes");
    let two = dir.join("two");
    std::fs::create_dir_all(two.join("checkpoints")).unwrap();
    let from = four.join("checkpoints/step-000003");
    assert!(from.join("state.json").is_file(), "the four processes sealed step 3");
    copy_dir(&from, &two.join("checkpoints/step-000003"));
    let args = train_args(
        &["launch", "--nproc", "2", "--"],
        &two,
        "6",
        &["mesh.ici_data=1", "mesh.ici_fsdp=2", "train.batch_size=2", "train.checkpoint_every=3"],
    );
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.push("--resume");
    run(&mut engine(&args, &[]));
    let resumed = losses(&two);
    assert_eq!(resumed.len(), 3, "steps 4 to 6");
    for (step, (a, b)) in procs[3..].iter().zip(&resumed).enumerate() {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {}: {b} on two processes, {a} on four", step + 4);
    }
}

#[test]
fn pipeline_x_data_tensor_and_interleaved_stages_across_processes_follow_virtual_devices() {
    let pipeline = [
        "model.n_layers=2",
        "mesh.ici_data=2",
        "mesh.ici_pipeline=2",
        "train.batch_size=2",
        "train.pipeline_microbatches=2",
    ];
    let _ = three_steps_follow_virtual("mp-pipe", 4, &pipeline, "pipeline 2 x data 2");
    let _ = three_steps_follow_virtual("mp-tensor", 2, &["mesh.ici_tensor=2"], "tensor 2");
    // Interleaved 1F1B: two virtual stages on each of two processes, the handoffs over TCP.
    let interleaved = [
        "model.n_layers=4",
        "mesh.ici_data=1",
        "mesh.ici_pipeline=2",
        "train.batch_size=2",
        "train.pipeline_microbatches=4",
        "train.pipeline_schedule=\"interleaved\"",
        "train.pipeline_virtual_stages=2",
    ];
    let _ = three_steps_follow_virtual("mp-interleaved", 2, &interleaved, "interleaved pipeline 2 x V 2");
}

/// The sequence axis across processes: two processes each keep two chunks of every sequence
/// and gather the keys and values over TCP, bit for bit the virtual devices' curve and within
/// 1e-5 of one device with the same global batch.
#[test]
fn a_sequence_axis_across_processes_follows_one_device() {
    let mesh = ["mesh.ici_data=1", "mesh.ici_seq=2"];
    let (dir, procs) = three_steps_follow_virtual("mp-seq", 2, &mesh, "seq 2");
    let one = dir.join("one");
    run(&mut engine(
        &train_args(&[], &one, "3", &["train.batch_size=2"]).iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
    ));
    for (step, (a, b)) in losses(&one).iter().zip(&procs).enumerate() {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {}: {b} on two processes (seq 2), {a} on one device", step + 1);
    }
    // With FSDP (which shards over fsdp x seq), and with tensor and pipeline stages on eight
    // processes (the virtual devices' tests hold those within 1e-5 of one device).
    let fsdp = ["mesh.ici_data=1", "mesh.ici_seq=2", "mesh.ici_fsdp=2", "train.batch_size=0.5"];
    let _ = three_steps_follow_virtual("mp-seq-fsdp", 4, &fsdp, "seq 2 x fsdp 2");
    let all = [
        "model.n_layers=2",
        "mesh.ici_data=1",
        "mesh.ici_seq=2",
        "mesh.ici_tensor=2",
        "mesh.ici_pipeline=2",
        "train.batch_size=1",
        "train.pipeline_microbatches=2",
    ];
    let _ = three_steps_follow_virtual("mp-seq-tp-pp", 8, &all, "seq 2 x tensor 2 x pipeline 2");
}

/// The expert axis across processes: tiny-mixtral's eight experts over two processes (EP 2),
/// the tokens exchanged by the all-to-all over TCP, bit for bit the virtual devices' curve and
/// within 1e-5 of one device with the same global batch; and EP 2 x FSDP 2 on four.
#[test]
fn an_expert_axis_across_processes_follows_virtual_devices_and_one_device() {
    let mesh = ["mesh.ici_data=2", "mesh.ici_expert=2"];
    let (dir, procs, virt) = recipe_processes_and_virtual("tiny-mixtral", "mp-ep", 2, "3", &mesh);
    assert_eq!((procs.len(), &procs), (3, &virt), "ep 2 on processes and on virtual devices");
    let one = dir.join("one");
    let args = recipe_args("tiny-mixtral", &[], &one, "3", &["train.batch_size=2"]);
    run(&mut engine(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]));
    for (step, (a, b)) in losses(&one).iter().zip(&procs).enumerate() {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {}: {b} on two processes (ep 2), {a} on one device", step + 1);
    }
    let fsdp = ["mesh.ici_data=2", "mesh.ici_fsdp=2", "mesh.ici_expert=2"];
    let (_dir, procs, virt) = recipe_processes_and_virtual("tiny-mixtral", "mp-ep-fsdp", 4, "3", &fsdp);
    assert_eq!((procs.len(), &procs), (3, &virt), "ep 2 x fsdp 2 on processes and on virtual devices");
}

/// The new families across processes, bit for bit their virtual devices, on every axis:
/// Qwen3 (QK-norm), Qwen3-MoE (fine-grained experts) and DeepSeek-V3 (latent attention, grouped
/// sigmoid routing with the balancing step, a dense first layer, a shared expert) under FSDP 2,
/// tensor 2, seq 2 and pipeline 2 (1F1B and interleaved); the two mixtures of experts under
/// EP 2 x FSDP 2, EP 4 and EP 2 x tensor 2 x pipeline 2.
#[test]
fn the_new_families_across_processes_follow_virtual_devices() {
    let pipeline = ["mesh.ici_data=1", "mesh.ici_pipeline=2", "train.pipeline_microbatches=2", "train.batch_size=2"];
    let interleaved = [
        "model.n_layers=4",
        "train.pipeline_schedule=interleaved",
        "train.pipeline_virtual_stages=2",
        "train.pipeline_microbatches=4",
    ];
    let every: Vec<(&str, Vec<&str>, usize)> = vec![
        ("fsdp 2", vec!["mesh.ici_data=1", "mesh.ici_fsdp=2"], 2),
        ("tensor 2", vec!["mesh.ici_data=1", "mesh.ici_tensor=2"], 2),
        ("seq 2", vec!["mesh.ici_data=1", "mesh.ici_seq=2"], 2),
        ("pipeline 2", pipeline.to_vec(), 2),
        ("interleaved pipeline 2", [&pipeline[..], &interleaved[..]].concat(), 2),
    ];
    let experts: Vec<(&str, Vec<&str>, usize)> = vec![
        ("ep 2 x fsdp 2", vec!["mesh.ici_data=2", "mesh.ici_fsdp=2", "mesh.ici_expert=2"], 4),
        ("ep 4", vec!["mesh.ici_data=4", "mesh.ici_expert=4"], 4),
        (
            "ep 2 x tensor 2 x pipeline 2",
            vec!["mesh.ici_data=2", "mesh.ici_expert=2", "mesh.ici_tensor=2", "mesh.ici_pipeline=2"],
            8,
        ),
    ];
    // SHRINK's heads are 32 wide: latent attention's two parts must add up to them.
    let latent = ["model.mla.nope_dim=24", "model.mla.rope_dim=8", "model.mla.v_dim=16"];
    for (recipe, own, moe) in [
        ("tiny-qwen3", &["model.tie_embeddings=false"][..], false),
        ("tiny-qwen3-moe", &[][..], true),
        ("tiny-deepseek-v3", &latent[..], true),
    ] {
        let meshes = every.iter().chain(if moe { &experts[..] } else { &[][..] });
        for (what, sets, n) in meshes {
            let sets = [own, &sets[..]].concat();
            let name = format!("mp-{recipe}-{}", what.replace(' ', "-"));
            let (_dir, procs, virt) = recipe_processes_and_virtual(recipe, &name, *n, "3", &sets);
            assert_eq!((procs.len(), &procs), (3, &virt), "{recipe}, {what}");
        }
    }
}

/// Two nodes of two processes each, under the MaxText/Vertex convention (one launcher per
/// node): FSDP within a node, data parallelism across them (HSDP), against one device with
/// the same global batch.
#[test]
fn two_nodes_of_fsdp_follow_one_device() {
    let dir = scratch("mp-hsdp");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let nodes = dir.join("nodes");
    let args = train_args(&["launch", "--nproc", "2", "--"], &nodes, "3", &["mesh.ici_fsdp=2", "mesh.dcn_data=2"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let launchers: Vec<_> = ["0", "1"]
        .map(|node| {
            let env = [
                ("JAX_COORDINATOR_ADDRESS", "127.0.0.1"),
                ("JAX_COORDINATOR_PORT", port.as_str()),
                ("NNODES", "2"),
                ("NODE_RANK", node),
                ("GPUS_PER_NODE", "2"),
            ];
            engine(&args, &env).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .into_iter()
        .collect();
    for child in launchers {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "a node failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let one = dir.join("one");
    let args = train_args(&[], &one, "3", &["train.batch_size=4"]);
    run(&mut engine(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]));
    let (want, got) = (losses(&one), losses(&nodes));
    assert_eq!(got.len(), 3);
    for (step, (w, g)) in want.iter().zip(&got).enumerate() {
        assert!((w - g).abs() <= 1e-5 * w.abs(), "step {}: {g} on 2 nodes x 2, {w} on one device", step + 1);
    }
}

/// Stragglers (`train/stragglers.rs`): a rank slowed on purpose by 200 ms a step (the test hook
/// `ENGINE_TEST_STEP_DELAY`) is named within its window of 10 steps, by one warning line and in
/// that step's record of `metrics.jsonl`; the same run without the delay warns of nothing. Steps
/// of about 20 ms (a wider model than [`SHRINK`]'s, whose 2 ms steps are mostly noise).
#[test]
fn a_rank_slowed_on_purpose_is_named_a_straggler_and_no_other_run_warns() {
    let dir = scratch("multiprocess-stragglers");
    // A rank six times as busy as the other: on a loaded 2-core machine (the CPU taken from a
    // rank counts as busy) either rank measured up to 170 % busier than the other without any
    // delay, past the default threshold's 25 %, and once past 300 % under a load average of 256;
    // the delay of 500 ms makes it 2500 % and more.
    let sets = [
        "model.d_model=256",
        "model.head_dim=128",
        "model.mlp_dim=512",
        "train.diagnostics.straggler_window=10",
        "train.diagnostics.straggler_threshold=5.0",
    ];
    for (name, delay) in [("slowed", Some("1:0.5")), ("even", None)] {
        let run_dir = dir.join(name);
        let args = train_args(&["launch", "--nproc", "2", "--"], &run_dir, "12", &sets);
        let env: Vec<(&str, &str)> = delay.map(|d| ("ENGINE_TEST_STEP_DELAY", d)).into_iter().collect();
        let mut cmd = engine(&args.iter().map(String::as_str).collect::<Vec<_>>(), &env);
        let out = run(cmd.env("ENGINE_THREADS", "1"));
        let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
        let warnings: Vec<&str> = text.lines().filter(|l| l.contains("warning: straggler")).collect();
        let named: Vec<serde_json::Value> =
            metrics(&run_dir).into_iter().filter(|m| m.get("straggler").is_some()).collect();
        if delay.is_none() {
            assert!(warnings.is_empty() && named.is_empty(), "a run without a straggler warned:\n{text}");
            continue;
        }
        assert_eq!(warnings.len(), 1, "one warning in 12 steps of a window of 10:\n{text}");
        assert!(warnings[0].contains("straggler: rank 1 was the slowest in "), "{}", warnings[0]);
        assert_eq!(named.len(), 1, "{text}");
        let record = &named[0];
        assert_eq!(record["step"], 10, "named at the end of its first window: {record}");
        let s = &record["straggler"];
        assert_eq!((s["rank"].as_u64(), s["window"].as_u64()), (Some(1), Some(10)), "{record}");
        let excess_s = s["busy_s"].as_f64().unwrap() - s["median_busy_s"].as_f64().unwrap();
        assert!(excess_s > 0.4, "the excess is the delay's 0.5 s or about: {record}");
        eprintln!("{}", warnings[0]);
    }
}

/// Muon across processes, bit for bit its virtual devices: its matrices assembled over TCP from
/// FSDP's pieces and tensor slices (round-robin owners: a reduce-scatter and an all-gather) on
/// tiny-llama2 under FSDP 2 x tensor 2, and each expert's matrices on their own device on
/// tiny-mixtral under EP 2 x FSDP 2.
#[test]
fn muon_across_processes_follows_virtual_devices() {
    let muon = ["optim.name=muon", "optim.muon.lr=0.02"];
    for (recipe, mesh) in [
        ("tiny-llama2", &["mesh.ici_data=1", "mesh.ici_fsdp=2", "mesh.ici_tensor=2"][..]),
        ("tiny-mixtral", &["mesh.ici_data=2", "mesh.ici_fsdp=2", "mesh.ici_expert=2"][..]),
    ] {
        let sets = [&muon[..], mesh].concat();
        let (_dir, procs, virt) = recipe_processes_and_virtual(recipe, &format!("mp-muon-{recipe}"), 4, "3", &sets);
        assert_eq!((procs.len(), &procs), (3, &virt), "Muon, {recipe}");
    }
}
