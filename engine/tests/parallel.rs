//! Rendezvous with real processes on loopback: every rank meets, a missing rank is named, and
//! `engine launch` starts one process per device under each launcher convention.

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn engine(args: &[&str], env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_engine"));
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    for var in
        ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "SLURM_PROCID", "JAX_COORDINATOR_ADDRESS"]
    {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("engine starts")
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The token every rank printed (they must agree).
fn tokens(stdout: &str) -> Vec<&str> {
    stdout.lines().filter_map(|l| l.rsplit_once("token ").map(|(_, t)| t)).collect()
}

#[test]
fn launch_starts_one_process_per_device_and_they_meet() {
    let out =
        engine(&["launch", "--nproc", "3", "--", "dist", "check", "--timeout", "20"], &[]).wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let t = tokens(&stdout);
    assert_eq!(t.len(), 3, "{stdout}");
    assert!(t.iter().all(|x| *x == t[0]));
    for r in 0..3 {
        assert!(stdout.contains(&format!("rank {r} of 3")), "{stdout}");
    }
}

#[test]
fn a_rank_that_never_arrives_is_named() {
    let port = free_port().to_string();
    let children: Vec<Child> = (0..3)
        .map(|rank| {
            let env = [
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", port.clone()),
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", "4".to_string()),
            ];
            engine(&["dist", "check", "--timeout", "3"], &env)
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    // A rank that never arrived is a transient fault (a slow pod, an image still pulling): 75,
    // which schedulers retry, not 2, which they do not.
    let (_, rank0) = text(&outs[0]);
    assert_eq!(outs[0].status.code(), Some(75), "{rank0}");
    assert!(rank0.contains("rendezvous timed out after 3 s: rank(s) 3 of 4 never arrived"), "{rank0}");
    assert_eq!(rank0.trim_end().lines().count(), 1, "{rank0}");
    for out in &outs[1..] {
        let (_, stderr) = text(out);
        assert_eq!(out.status.code(), Some(75), "{stderr}");
        assert!(stderr.contains("rank 0 says: rendezvous timed out") && stderr.contains("rank(s) 3 of 4"), "{stderr}");
    }
}

/// Two ranks of one job started with different recipes (one rank's flags edited) are refused
/// at the rendezvous, on both ranks, in one line naming each key and both values, exit 2:
/// another learning rate or seed trained silently, another model shape failed mid-step, and
/// fewer steps left the other rank waiting out the collective timeout.
#[test]
fn ranks_of_different_recipes_are_refused_at_the_rendezvous() {
    // Rank 1's overrides and steps (rank 0 has neither override, and 3 steps), and the line.
    let cases: [(&[&str], &str, &str); 3] = [
        (
            &["optim.lr=0.5", "train.seed=7"],
            "3",
            "rank 1's configuration differs from rank 0's: optim.lr 0.001 vs 0.5, train.seed 1234 vs 7;",
        ),
        (&["model.d_model=128"], "3", "rank 1's configuration differs from rank 0's: model.d_model 64 vs 128;"),
        (&[], "5", "rank 1's configuration differs from rank 0's: train.steps 3 vs 5;"),
    ];
    for (sets, steps, want) in cases {
        let port = free_port().to_string();
        let dir = std::env::temp_dir().join(format!("engine-dist-differ-{}-{port}", std::process::id()));
        let run = dir.join("run");
        let ranks: Vec<Child> = (0..2)
            .map(|rank| {
                let (sets, steps) = if rank == 1 { (sets, steps) } else { (&[][..], "3") };
                let mut args = vec!["--device", "cpu", "train", "--recipe", "tiny-llama2", "--steps", steps];
                args.extend(["--run-dir", run.to_str().unwrap()]);
                let shrink = ["model.d_model=64", "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=32"];
                for set in shrink.iter().chain(sets) {
                    args.extend(["--set", set]);
                }
                let env = [
                    ("MASTER_ADDR", "127.0.0.1".to_string()),
                    ("MASTER_PORT", port.clone()),
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", "2".to_string()),
                    ("ENGINE_RENDEZVOUS_TIMEOUT", "30".to_string()),
                ];
                engine(&args, &env)
            })
            .collect();
        for (rank, child) in ranks.into_iter().enumerate() {
            let out = child.wait_with_output().unwrap();
            let (_, stderr) = text(&out);
            assert_eq!(out.status.code(), Some(2), "rank {rank}: {stderr}");
            assert!(stderr.contains(want), "rank {rank}: expected `{want}` in: {stderr}");
            assert_eq!(stderr.trim_end().lines().count(), 1, "rank {rank}: {stderr}");
        }
        assert!(!run.join("metrics.jsonl").exists(), "nothing trained");
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn vertex_style_nodes_each_launch_their_devices() {
    let port = free_port().to_string();
    let nodes: Vec<Child> = (0..2)
        .map(|node| {
            let env = [
                ("JAX_COORDINATOR_ADDRESS", "127.0.0.1".to_string()),
                ("JAX_COORDINATOR_PORT", port.clone()),
                ("NODE_RANK", node.to_string()),
                ("NNODES", "2".to_string()),
                ("GPUS_PER_NODE", "2".to_string()),
            ];
            engine(&["launch", "--nproc", "2", "--", "dist", "check", "--timeout", "20"], &env)
        })
        .collect();
    let stdout: String = nodes
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let (stdout, stderr) = text(&out);
            assert!(out.status.success(), "{stderr}");
            stdout
        })
        .collect();
    let t = tokens(&stdout);
    assert_eq!(t.len(), 4, "{stdout}");
    assert!(t.iter().all(|x| *x == t[0]));
    assert!(stdout.contains("rank 3 of 4 (local 1 of 2), 2 node(s), via MaxText/Vertex"), "{stdout}");
}

#[test]
fn launch_refuses_a_mismatched_node_description() {
    let env = [
        ("JAX_COORDINATOR_ADDRESS", "127.0.0.1".to_string()),
        ("JAX_COORDINATOR_PORT", "1".to_string()),
        ("NODE_RANK", "0".to_string()),
        ("NNODES", "1".to_string()),
        ("GPUS_PER_NODE", "8".to_string()),
    ];
    let out = engine(&["launch", "--nproc", "2", "--", "dist", "check"], &env).wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).1.contains("GPUS_PER_NODE = 8 but --nproc 2"));
}

/// The last step's loss in a run directory's metrics.
fn last_loss(run: &std::path::Path) -> f64 {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    last["loss"].as_f64().unwrap()
}

/// `engine train --devices 4` on FSDP x TP saves sharded checkpoints; the run resumes from one on
/// DP x TP and on one device (global batch kept), and all three end on the same loss.
#[test]
fn virtual_devices_train_save_and_resume_on_another_mesh() {
    let tmp = std::env::temp_dir().join(format!("engine-dist-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let small =
        "model.vocab_size=512 model.mlp_dim=1024 train.seq_len=32 train.checkpoint_every=3 optim.warmup_steps=2";
    let run = |name: &str, extra: &[&str]| {
        let dir = tmp.join(name);
        let mut args = vec!["train", "--recipe", "tiny-llama2", "--steps", "6", "--run-dir", dir.to_str().unwrap()];
        args.extend(extra);
        let out = engine(&args, &[("ENGINE_FLAGS", small.to_string())]).wait_with_output().unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{args:?}: {stdout}{stderr}");
        (dir, stdout)
    };
    let mesh = |d: &str, f: &str, t: &str| ["--set", d, "--set", f, "--set", t].map(str::to_string).to_vec();
    let fsdp_tp = mesh("mesh.ici_data=1", "mesh.ici_fsdp=2", "mesh.ici_tensor=2");
    let args: Vec<&str> = fsdp_tp.iter().map(String::as_str).chain(["--devices", "4"]).collect();
    let (dir, stdout) = run("mesh", &args);
    assert!(stdout.contains("mesh data 1 x fsdp 2 x tensor 2") && stdout.contains("saved checkpoint"), "{stdout}");
    let ck = dir.join("checkpoints/step-000003");
    assert!(ck.join("shard-00003-of-00004.safetensors").exists());
    let want = last_loss(&dir);

    let dp_tp = mesh("mesh.ici_data=2", "mesh.ici_fsdp=1", "mesh.ici_tensor=2");
    let mut args: Vec<&str> = dp_tp.iter().map(String::as_str).chain(["--devices", "4"]).collect();
    args.extend(["--resume", ck.to_str().unwrap()]);
    let (other, _) = run("other-mesh", &args);
    let (one, _) = run("one-device", &["--set", "train.batch_size=4", "--resume", ck.to_str().unwrap()]);
    for got in [last_loss(&other), last_loss(&one)] {
        assert!((got - want).abs() <= 1e-5 * want.abs(), "loss {got} after resuming, {want} without");
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// A process of a job trains one device: asked for virtual devices too, each says why not.
#[test]
fn virtual_devices_inside_a_multi_process_job_are_refused_with_the_reason() {
    let args =
        ["launch", "--nproc", "2", "--", "train", "--device", "cpu", "--devices", "2", "--recipe", "tiny-llama2"];
    let out = engine(&args, &[]).wait_with_output().unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("a process of a job trains one device"), "{stderr}");
}

/// The expert axis's bad input, one line each with exit code 2 before anything trains: a dense
/// model, experts the axis does not divide, an axis that does not divide the data axis.
#[test]
fn expert_axis_bad_input_is_refused_in_one_line() {
    for (recipe, devices, sets, want) in [
        ("tiny-llama2", "2", vec!["mesh.ici_expert=2"], "but the model is dense (model.moe is not set)"),
        ("tiny-mixtral", "3", vec!["mesh.ici_expert=3"], "which does not divide model.moe.num_experts = 8"),
        ("tiny-mixtral", "4", vec!["mesh.ici_expert=8"], "mesh.ici_expert = 8 does not divide mesh.ici_data = 4"),
    ] {
        let mut args = vec!["train", "--recipe", recipe, "--devices", devices, "--steps", "1"];
        for s in &sets {
            args.extend(["--set", s]);
        }
        let out = engine(&args, &[("RUST_BACKTRACE", "1".to_string())]).wait_with_output().unwrap();
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: one line, no backtrace: {stderr}");
    }
}

/// `recipes show` of an expert axis counts what it divides and moves: tiny-mixtral's 8 experts
/// over EP 4 are 2 a device, a quarter of the experts' parameters; a layer may receive every
/// member's rows (dropless), or under a capacity factor of 1 the 8 experts' capacity at most;
/// its all-to-alls send (e − 1)/e of 4 exchanges of `N · k` bf16 rows of `d_model` a layer.
#[test]
fn recipes_show_counts_the_expert_axis() {
    let show = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["recipes", "show", "tiny-mixtral", "--json", "--devices", "4"];
        for s in ["mesh.ici_data=4", "mesh.ici_expert=4"].iter().chain(extra) {
            args.extend(["--set", s]);
        }
        let out = engine(&args, &[]).wait_with_output().unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        serde_json::from_str(&stdout).unwrap()
    };
    let json = show(&[]);
    let (e, m) = (&json["expert_axis"], &json["mesh"]);
    let u = |v: &serde_json::Value| v.as_u64().unwrap();
    assert_eq!((u(&m["expert"]), u(&e["devices"]), u(&e["experts_per_device"])), (4, 4, 2));
    // tiny-mixtral: 2 layers of 8 experts of 3 x 1024 x 896.
    let (layers, d, f) = (2, 1024, 896);
    assert_eq!(u(&e["expert_parameters"]), layers * 2 * 3 * d * f);
    let rows = u(&e["rows_dispatched"]);
    assert_eq!(u(&e["received_rows_max"]), 4 * rows, "dropless: every member's rows");
    let sent = e["all_to_all_bytes_sent_per_step"].as_f64().unwrap();
    assert_eq!(sent, (layers * 4 * rows * d * 2) as f64 * 3.0 / 4.0);
    let capped = show(&["model.moe.capacity_factor=1.0"]);
    let tokens = rows / 2;
    assert_eq!(u(&capped["expert_axis"]["received_rows_max"]), 8 * (tokens * 2 / 8), "E x C");
}
