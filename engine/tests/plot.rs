//! `engine plot`: two short runs overlaid; the SVG's curves, read back through its axes, equal
//! the runs' metrics.jsonl within a pixel; the PNG decodes to the size asked for; bad input is
//! one line and exit code 2.

mod common;

use std::path::Path;

use common::svg::{assert_drawn, axes, polylines, to_data};
use common::*;

fn train(run: &Path, lr: &str) {
    let lr = format!("optim.lr={lr}");
    let mut args = vec![
        "train",
        "--recipe",
        "tiny-llama2",
        "--run-dir",
        s(run),
        "--steps",
        "6",
        "--set",
        "train.eval_every=3",
        "--set",
        "train.eval_steps=1",
        "--set",
        &lr,
    ];
    args.extend_from_slice(&SMALL);
    ok(&args);
}

/// `(step or tokens, value)` of `field` in a run's metrics.jsonl.
fn recorded(run: &Path, field: &str, tokens: bool) -> Vec<(f64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|r| {
            let step = r["step"].as_f64().unwrap();
            let x =
                if tokens { step * (r["tokens_per_s"].as_f64()? * r["step_time_s"].as_f64()?).round() } else { step };
            Some((x, r[field].as_f64()?))
        })
        .collect()
}

#[test]
fn two_runs_are_drawn_as_their_metrics_say() {
    let dir = scratch("plot");
    let (a, b) = (dir.join("a"), dir.join("b"));
    train(&a, "0.01");
    train(&b, "0.002");
    // Tab10's first two colours: the runs in the order given.
    let colours = ["#1F77B4", "#FF7F0E"];
    for (metric, field, x) in [("loss", "loss", "step"), ("eval-loss", "eval_loss", "step"), ("lr", "lr", "tokens")] {
        let out = dir.join(format!("{metric}.svg"));
        ok(&["plot", s(&a), s(&b), "--metric", metric, "--x", x, "--out", s(&out)]);
        let svg = std::fs::read_to_string(&out).unwrap();
        let axes = axes(&svg);
        for (run, colour) in [&a, &b].into_iter().zip(colours) {
            // The curve is the colour's first polyline; the legend's sample comes after it.
            let drawn = to_data(&polylines(&svg, colour)[0], axes);
            assert_drawn(&drawn, &recorded(run, field, x == "tokens"), axes, &format!("{metric} of {}", run.display()));
        }
        assert!(
            svg.contains("a (tiny-llama2): optim.lr=0.01") && svg.contains("b (tiny-llama2): optim.lr=0.002"),
            "legend: {svg}"
        );
    }
    let png = dir.join("loss.png");
    ok(&["plot", s(&a), s(&b), "--out", s(&png), "--size", "640x400"]);
    let reader = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap())).read_info().unwrap();
    assert_eq!((reader.info().width, reader.info().height), (640, 400));

    // Bad input: one line naming what is wrong, exit code 2, nothing written.
    fails(&["plot", s(&a), "--out", s(&dir.join("x.jpg"))], "name a .svg or .png file");
    fails(&["plot", s(&dir.join("none")), "--out", s(&dir.join("x.svg"))], "not a directory");
    fails(&["plot", s(&dir), "--out", s(&dir.join("x.svg"))], "no metrics.jsonl here");
    fails(&["plot", s(&a), "--out", s(&dir.join("x.svg")), "--size", "10x10"], "WIDTHxHEIGHT");
    std::fs::write(a.join("metrics.jsonl"), "{\"step\":1,\"loss\":2.0}\n").unwrap();
    fails(&["plot", s(&a), "--metric", "eval-loss", "--out", s(&dir.join("x.svg"))], "no record has validation loss");
    std::fs::write(a.join("metrics.jsonl"), "{\"step\":1,\"loss\":2.0}\n{\"step\":2,\"loss\":\n").unwrap();
    fails(&["plot", s(&a), "--out", s(&dir.join("x.svg"))], "metrics.jsonl line 2: not a JSON object");
    // A metrics file without end (linked to /dev/zero) is read a bounded line at a time.
    std::fs::remove_file(a.join("metrics.jsonl")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", a.join("metrics.jsonl")).unwrap();
    fails(&["plot", s(&a), "--out", s(&dir.join("x.svg"))], "metrics.jsonl:1: a line longer than 1048576 bytes");
    assert!(!dir.join("x.svg").exists() && !dir.join("x.jpg").exists());
}
