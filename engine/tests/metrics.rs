//! What a run records: metrics.jsonl with evaluations on the validation split, TensorBoard event
//! files that TensorBoard's own reader opens (Python `tensorboard`, installed by tests/run.sh),
//! and the end-of-run performance summary.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::*;

fn train(run: &Path, steps: &str, extra: &[&str]) -> String {
    let mut args = vec!["train", "--recipe", "tiny-llama2", "--run-dir", s(run), "--steps", steps];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&[
        "--set",
        "train.eval_every=3",
        "--set",
        "train.eval_steps=2",
        "--set",
        "train.perf_warmup_steps=2",
    ]);
    args.extend_from_slice(extra);
    ok(&args)
}

#[test]
fn evaluations_and_the_summary_are_recorded() {
    let dir = scratch("metrics");
    let run = dir.join("run");
    let out = train(&run, "7", &[]);
    let m = metrics(&run);
    let evaluated: Vec<u64> =
        m.iter().filter(|r| r.get("eval_loss").is_some()).map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(evaluated, [3, 6, 7], "every 3 steps and at the end");
    // The same validation samples every time: the loss on them moves with training only.
    let eval: Vec<f64> = m.iter().filter_map(|r| r.get("eval_loss").and_then(|e| e.as_f64())).collect();
    assert!(eval.iter().all(|e| e.is_finite() && *e > 0.0) && eval[2] < eval[0], "{eval:?}");
    assert!(out.contains("| eval loss "), "{out}");

    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 7);
    // Steps 1-2 (warm-up) and 6 (the profiled one) are left out of the step-time figures.
    assert_eq!(summary["perf_steps_excluded"], 3);
    let mut kept: Vec<f64> = m
        .iter()
        .filter(|r| ![1, 2, 6].contains(&r["step"].as_u64().unwrap()))
        .map(|r| r["step_time_s"].as_f64().unwrap())
        .collect();
    kept.sort_by(f64::total_cmp);
    assert_eq!(summary["median_step_time_s"].as_f64().unwrap(), kept[kept.len() / 2]);
    assert_eq!(summary["p90_step_time_s"].as_f64().unwrap(), kept[kept.len() - 1]);
    assert_eq!(summary["final_eval_loss"].as_f64().unwrap(), eval[2]);
    assert!(out.contains("median") && out.contains("p90"));
    assert!(run.join("trace-step-6.json").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Reads a run directory's event files with TensorBoard's EventAccumulator: tag -> [(step, value)].
fn read_events(python: &str, run: &Path) -> BTreeMap<String, Vec<(u64, f64)>> {
    let script = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})
acc.Reload()
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"#;
    let out = Command::new(python).args(["-c", script, s(run)]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: BTreeMap<String, Vec<(u64, f64)>> = serde_json::from_slice(&out.stdout).unwrap();
    v
}

#[test]
fn tensorboard_reads_the_event_files() {
    let Some(python) = python_with("ENGINE_TEST_PYTHON", "tensorboard", true) else { return };
    let dir = scratch("tensorboard");
    let run = dir.join("run");
    train(&run, "6", &["--set", "train.checkpoint_every=3"]);
    let m = metrics(&run);
    let events = read_events(&python, &run);
    for tag in ["loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "step_time_s", "eval_loss"] {
        assert!(events.contains_key(tag), "no {tag} in {:?}", events.keys());
    }
    let as_f32 = |x: f64| x as f32 as f64;
    let loss: Vec<(u64, f64)> =
        m.iter().map(|r| (r["step"].as_u64().unwrap(), as_f32(r["loss"].as_f64().unwrap()))).collect();
    assert_eq!(events["loss"], loss);
    assert_eq!(events["eval_loss"].iter().map(|e| e.0).collect::<Vec<_>>(), [3, 6]);
    assert_eq!(events["lr"][0].1, as_f32(m[0]["lr"].as_f64().unwrap()));

    // Resumed from step 3: a second event file, and TensorBoard shows each step once, the points
    // the first process logged after step 3 replaced by the resumed run's.
    train(&run, "6", &["--set", "train.checkpoint_every=3", "--resume", s(&run.join("checkpoints/step-000003"))]);
    let files = std::fs::read_dir(&run)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("events.out.tfevents"))
        .count();
    assert_eq!(files, 2);
    let events = read_events(&python, &run);
    assert_eq!(events["loss"].iter().map(|e| e.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    assert_eq!(events["loss"], loss, "the resumed run computes the same losses");
    std::fs::remove_dir_all(&dir).unwrap();
}
