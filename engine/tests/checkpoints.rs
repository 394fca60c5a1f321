//! The checkpoint promises, through the real binary: a resumed run continues bitwise identically;
//! a run killed with SIGKILL in the middle of a save resumes from the previous complete
//! checkpoint; a truncated or corrupted checkpoint is detected and reported, never loaded; an
//! incompatible configuration is refused with the differing keys named.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;

use common::*;

fn train_args<'a>(run: &'a Path, steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["train", "--recipe", "tiny-mixtral", "--run-dir", s(run), "--steps", steps];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&["--set", "model.moe.num_experts=4", "--set", "train.checkpoint_every=3"]);
    args.extend_from_slice(extra);
    args
}

fn loss_bits(run: &Path) -> Vec<(u64, u64)> {
    metrics(run).iter().map(|m| (m["step"].as_u64().unwrap(), m["loss"].as_f64().unwrap().to_bits())).collect()
}

/// The data file of a one-device checkpoint (the sharded format, one shard).
const SHARD: &str = "shard-00000-of-00001.safetensors";

fn sha256(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// A `state.json` edited by hand, sealed again as docs/checkpoints.md says: the SHA-256 of the
/// rest in compact JSON with sorted keys.
fn reseal(mut v: serde_json::Value) -> serde_json::Value {
    v.as_object_mut().unwrap().remove("seal");
    v.sort_all_objects();
    v["seal"] = sha256(serde_json::to_string(&v).unwrap().as_bytes()).into();
    v
}

fn bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The acceptance scenario: a corpus prepared with a real tokenizer, a run killed with SIGKILL
/// while saving step 6 resumes from step 3 and ends with the same losses, parameters and
/// optimizer state, bit for bit, as a run never killed.
#[test]
fn a_run_killed_during_a_save_resumes_from_the_previous_checkpoint_bitwise() {
    let dir = scratch("kill");
    let shards = dir.join("shards");
    assert!(prepare_shakespeare(&shards, &[]).status.success());
    let path = format!("data.path={}", shards.display());
    let data = ["--set", "data.source=shards", "--set", &path, "--set", "model.vocab_size=512"];
    let (whole, killed) = (dir.join("whole"), dir.join("killed"));
    ok(&train_args(&whole, "8", &data));

    let mut child = engine_cmd(&train_args(&killed, "8", &data))
        .env("ENGINE_TEST_PAUSE_SAVE", "6")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    for line in stderr.lines() {
        if line.unwrap().contains("the save of step 6 stops") {
            break;
        }
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let ckpts = killed.join("checkpoints");
    let names: Vec<String> =
        std::fs::read_dir(&ckpts).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(names.contains(&"step-000003".to_string()), "{names:?}");
    assert!(names.iter().any(|n| n.starts_with(".tmp-step-000006")), "the half-written save is gone: {names:?}");
    assert!(!names.contains(&"step-000006".to_string()));

    let out = ok(&train_args(&killed, "8", &[&data[..], &["--resume"]].concat()));
    assert!(out.contains("resuming after step 3"), "{out}");
    assert_eq!(loss_bits(&killed), loss_bits(&whole), "the losses of the resumed run differ");
    let (a, b) = (whole.join("checkpoints/step-000008").join(SHARD), ckpts.join("step-000008").join(SHARD));
    assert!(bytes(&a) == bytes(&b), "the parameters or moments differ after resuming");
    assert!(!std::fs::read_dir(&ckpts).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().starts_with(".tmp")));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run stopped at step 4 and continued to step 8 (`--steps`, a key that may change) equals a
/// run of 8 steps, here with a constant schedule so that the length does not change the rates.
#[test]
fn extending_a_run_continues_it_bitwise() {
    let dir = scratch("extend");
    let (whole, parts) = (dir.join("whole"), dir.join("parts"));
    let constant = ["--set", "optim.schedule=constant", "--set", "optim.warmup_steps=2"];
    ok(&train_args(&whole, "8", &constant));
    ok(&train_args(&parts, "4", &constant));
    let ck = parts.join("checkpoints/step-000004");
    let out = ok(&train_args(&parts, "8", &[&constant[..], &["--resume", s(&ck)]].concat()));
    assert!(out.contains("resuming after step 4"), "{out}");
    assert_eq!(loss_bits(&parts), loss_bits(&whole));
    assert_eq!(
        bytes(&whole.join("checkpoints/step-000008").join(SHARD)),
        bytes(&parts.join("checkpoints/step-000008").join(SHARD))
    );
    // keep_last (3 by default): steps 3, 6 and 8 remain of 3, 4, 6 and 8.
    let mut kept: Vec<String> = std::fs::read_dir(parts.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    kept.sort();
    assert_eq!(kept, ["step-000004", "step-000006", "step-000008"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn damaged_checkpoints_are_reported_never_loaded() {
    let dir = scratch("damaged");
    let run = dir.join("run");
    ok(&train_args(&run, "6", &[]));
    let newest = run.join("checkpoints/step-000006");
    let model = newest.join(SHARD);
    let original = bytes(&model);

    std::fs::write(&model, &original[..original.len() - 100]).unwrap();
    let e = fails(&train_args(&run, "9", &["--resume"]), &format!("{SHARD} is"));
    assert!(e.contains("step-000006 is damaged") && e.contains("truncated"), "{e}");
    assert!(e.contains("--resume") && e.contains("step-000003"), "the error points at the previous checkpoint: {e}");

    let mut flipped = original.clone();
    let at = flipped.len() - 7;
    flipped[at] ^= 0x40;
    std::fs::write(&model, &flipped).unwrap();
    fails(&train_args(&run, "9", &["--resume"]), &format!("{SHARD} does not match its SHA-256"));
    fails(&["eval", "--checkpoint", s(&newest), "--tokens", "x.json"], &format!("{SHARD} does not match its SHA-256"));
    fails(&["export-hf", s(&newest), "--out", s(&dir.join("export"))], "is damaged");
    assert!(!dir.join("export").exists());

    // The previous checkpoint, named explicitly, still resumes; the damaged one is moved aside.
    let out = ok(&train_args(&run, "9", &["--resume", s(&run.join("checkpoints/step-000003"))]));
    assert!(out.contains("resuming after step 3") && out.contains("superseded-step-000006"), "{out}");
    assert_eq!(metrics(&run).len(), 9);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_incompatible_configuration_is_refused_with_the_keys_named() {
    let dir = scratch("incompatible");
    let run = dir.join("run");
    ok(&train_args(&run, "3", &[]));
    let e = fails(
        &train_args(&run, "6", &["--set", "model.d_model=64", "--set", "optim.lr=0.05", "--resume"]),
        "cannot resume",
    );
    assert!(e.contains("model.d_model (checkpoint 32, now 64)") && e.contains("optim.lr"), "{e}");
    assert!(!e.contains("train.steps"), "train.steps may change: {e}");
    fails(&train_args(&dir.join("empty"), "6", &["--resume"]), "no complete checkpoint");
    fails(&train_args(&run, "6", &[]), "already holds a run");
    assert_eq!(metrics(&run).len(), 3, "a refused resumption leaves the run as it was");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A diverging run (a learning rate of 1e6) stops at the first step whose loss or gradient norm
/// is not finite, without applying or saving it: the last finite checkpoint survives
/// `keep_last = 1`. A checkpoint that holds NaN anyway (its hashes fixed up, as a buggy writer
/// would leave it) is refused by `--resume`, `export-hf` and `eval`, naming the problem.
#[test]
fn divergence_never_costs_the_last_good_checkpoint() {
    let dir = scratch("diverge");
    let run = dir.join("run");
    let diverge = ["--set", "optim.lr=1e6", "--set", "train.checkpoint_every=1", "--set", "train.keep_last=1"];
    let e = fails(&train_args(&run, "8", &diverge), "diverged");
    assert!(e.contains("not applied") && e.contains("is kept"), "{e}");
    let kept: Vec<_> = std::fs::read_dir(run.join("checkpoints")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let newest = &kept[0];
    let tokens = dir.join("tokens.json");
    std::fs::write(&tokens, "[[1, 2, 3, 4, 5, 6]]").unwrap();
    // Its parameters are finite (it exports), though so large that the loss overflows: eval
    // says so instead of printing a null loss.
    ok(&["export-hf", s(newest), "--out", s(&dir.join("finite"))]);
    fails(&["eval", "--checkpoint", s(newest), "--tokens", s(&tokens)], "overflow");

    // Poison the first parameter and make the hashes agree, then try every reader.
    let shard = newest.join(SHARD);
    let mut data = bytes(&shard);
    let header_len = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&data[8..8 + header_len]).unwrap();
    let at = 8 + header_len + header["params"]["data_offsets"][0].as_u64().unwrap() as usize;
    data[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&shard, &data).unwrap();
    let state_path = newest.join("state.json");
    let mut state: serde_json::Value = serde_json::from_slice(&bytes(&state_path)).unwrap();
    state["files"][SHARD]["sha256"] = sha256(&data).into();
    std::fs::write(&state_path, serde_json::to_vec(&reseal(state)).unwrap()).unwrap();
    for args in [
        train_args(&run, "9", &[&diverge[..], &["--resume"]].concat()),
        vec!["export-hf", s(newest), "--out", s(&dir.join("export"))],
        vec!["eval", "--checkpoint", s(newest), "--tokens", s(&tokens)],
    ] {
        let e = fails(&args, "non-finite");
        assert!(e.contains("NaN or infinite") && e.contains("earlier checkpoint"), "{args:?}: {e}");
    }
    assert!(!dir.join("export").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One run directory has one owner: while a run trains, a second fresh run and a `--resume` in
/// its directory are refused with the holder's PID and change nothing; once the holder is
/// killed (SIGKILL releases the OS lock), the run resumes.
#[test]
fn a_running_run_directory_is_refused_to_a_second_process() {
    let dir = scratch("owner");
    let run = dir.join("run");
    let mut holder = engine_cmd(&train_args(&run, "100000", &["--set", "train.checkpoint_every=2"]))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(holder.stdout.take().unwrap());
    let mut lines = stdout.lines();
    // Step lines read `step      5/100000 | ...`.
    let trains = lines.by_ref().take(50).any(|l| l.unwrap().split_whitespace().nth(1) == Some("5/100000"));
    assert!(trains, "the holder does not train");
    let in_use = format!("is in use by process {}", holder.id());
    let before = std::fs::read_dir(run.join("checkpoints")).unwrap().count();
    fails(&train_args(&run, "8", &[]), &in_use);
    fails(&train_args(&run, "100000", &["--set", "train.checkpoint_every=2", "--resume"]), &in_use);
    assert!(
        std::fs::read_dir(run.join("checkpoints")).unwrap().count() >= before,
        "a refused process removed or moved checkpoints"
    );
    holder.kill().unwrap();
    holder.wait().unwrap();
    drop(lines);
    let newest = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().into_string().unwrap().strip_prefix("step-")?.parse::<u64>().ok())
        .max()
        .unwrap();
    let steps = (newest + 2).to_string();
    let out = ok(&train_args(&run, &steps, &["--set", "train.checkpoint_every=2", "--resume"]));
    assert!(out.contains(&format!("resuming after step {newest}")), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `state.json` is checked, not trusted: an edited step or data position breaks its seal, a
/// checkpoint moved under another step's name (two swapped) is refused, and so is a data position
/// past the data even when the seal is made to agree.
#[test]
fn an_edited_or_moved_state_is_refused() {
    let dir = scratch("state");
    let run = dir.join("run");
    ok(&train_args(&run, "6", &[]));
    let (three, six) = (run.join("checkpoints/step-000003"), run.join("checkpoints/step-000006"));
    let state_of = |ck: &Path| -> serde_json::Value { serde_json::from_slice(&bytes(&ck.join("state.json"))).unwrap() };
    let write = |ck: &Path, v: &serde_json::Value| {
        std::fs::write(ck.join("state.json"), serde_json::to_string_pretty(v).unwrap()).unwrap()
    };
    let resume_six = train_args(&run, "9", &["--resume", s(&six)]);
    let original = state_of(&six);

    for (key, value) in [("step", serde_json::json!(5)), ("step", serde_json::json!(u64::MAX))] {
        let mut edited = original.clone();
        edited[key] = value;
        write(&six, &edited);
        fails(&resume_six, "does not match its seal");
    }
    let mut edited = original.clone();
    edited["data_position"]["index"] = serde_json::json!(1);
    write(&six, &edited);
    fails(&resume_six, "does not match its seal");

    // Sealed again (as a careful forger would), a wrong step still disagrees with the name...
    let mut edited = original.clone();
    edited["step"] = serde_json::json!(5);
    write(&six, &reseal(edited));
    fails(&resume_six, "says step 5, the directory is named for step 6");
    // ... and a data position past the data is refused by the trainer.
    let mut edited = original.clone();
    edited["data_position"]["index"] = serde_json::json!(1u64 << 40);
    write(&six, &reseal(edited));
    fails(&resume_six, "is past the");
    write(&six, &original);

    // Two checkpoints swapped between directories.
    let tmp = run.join("checkpoints/swap");
    std::fs::rename(&three, &tmp).unwrap();
    std::fs::rename(&six, &three).unwrap();
    std::fs::rename(&tmp, &six).unwrap();
    fails(&train_args(&run, "9", &["--resume"]), "says step 3, the directory is named for step 6");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `model.moe.capacity_factor = 1.0` on tiny Mixtral (4 experts, 64 tokens a pass, top-2: 32
/// rows an expert): tokens are dropped from the first step, the share is reported in
/// metrics.jsonl and on the step line, the curve differs from the dropless one, and a run
/// resumed from a checkpoint continues it bit for bit. A factor ≤ 0 or NaN is refused.
#[test]
fn a_capacity_factor_drops_tokens_reports_them_and_resumes_bitwise() {
    let dir = scratch("capacity");
    let (dropless, whole, parts) = (dir.join("dropless"), dir.join("whole"), dir.join("parts"));
    let constant = ["--set", "optim.schedule=constant", "--set", "optim.warmup_steps=2"];
    let capped = [&constant[..], &["--set", "model.moe.capacity_factor=1.0"]].concat();
    ok(&train_args(&dropless, "6", &constant));
    let out = ok(&train_args(&whole, "6", &capped));
    assert!(out.contains("| dropped "), "no dropped share on the step line: {out}");
    let tensorboard = |run: &Path| -> Vec<u8> {
        let events = std::fs::read_dir(run).unwrap().map(|e| e.unwrap().path());
        events
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents"))
            .flat_map(|p| bytes(&p))
            .collect()
    };
    let has_tag = |run: &Path| tensorboard(run).windows(16).any(|w| w == b"dropped_fraction");
    assert!(has_tag(&whole) && !has_tag(&dropless), "TensorBoard's dropped_fraction scalar");

    let dropped = |run: &Path| -> Vec<Option<u64>> {
        metrics(run).iter().map(|m| m.get("dropped_fraction").map(|f| f.as_f64().unwrap().to_bits())).collect()
    };
    assert!(dropped(&dropless).iter().all(Option::is_none), "a dropless run reports a dropped share");
    for (step, f) in dropped(&whole).iter().enumerate() {
        let f = f64::from_bits(f.unwrap_or_else(|| panic!("step {}: no dropped_fraction", step + 1)));
        assert!(f > 0.0 && f < 0.5, "step {}: dropped share {f}", step + 1);
    }
    let (a, b) = (loss_bits(&dropless), loss_bits(&whole));
    assert_ne!(a[0], b[0], "the first step's loss is the dropless one");
    assert_ne!(a, b);

    ok(&train_args(&parts, "4", &capped));
    let ck = parts.join("checkpoints/step-000003");
    let out = ok(&train_args(&parts, "6", &[&capped[..], &["--resume", s(&ck)]].concat()));
    assert!(out.contains("resuming after step 3"), "{out}");
    assert_eq!(loss_bits(&parts), loss_bits(&whole));
    assert_eq!(dropped(&parts), dropped(&whole));
    assert_eq!(
        bytes(&whole.join("checkpoints/step-000006").join(SHARD)),
        bytes(&parts.join("checkpoints/step-000006").join(SHARD))
    );

    for bad in ["0", "-1.5", "nan"] {
        let set = format!("model.moe.capacity_factor={bad}");
        let e = fails(&train_args(&dir.join("bad"), "2", &["--set", &set]), "model.moe.capacity_factor");
        assert!(e.contains("must be a positive number"), "{e}");
    }
    assert!(!dir.join("bad").join("metrics.jsonl").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
