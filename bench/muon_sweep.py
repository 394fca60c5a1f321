#!/usr/bin/env python3
"""Muon against AdamW on the bundled corpus (docs/PERF.md, "Muon"): a tiny-llama2-shaped model
(2 layers of 256, 4 heads of 64, MLP 1024, byte vocabulary) trained 300 steps by each optimizer
at each learning rate of a small sweep, on the embedded Shakespeare text, with warmup 5 and the
cosine schedule. AdamW's sweep runs first; Muon's runs keep AdamW's best lr for the tensors AdamW
updates (embeddings, head, norms) and sweep optim.muon.lr.

    python3 bench/muon_sweep.py [--engine target/release/engine] [--steps 300] [--out DIR]

Prints a table (final training loss averaged over the last 20 steps, evaluation loss on the
held-out 5 %, step time) and, for the best Muon run, the first step at which its 20-step average
training loss reaches the best AdamW run's final average.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

SHAPE = [
    "model.d_model=256",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.head_dim=64",
    "model.mlp_dim=1024",
    "model.n_layers=2",
    "model.vocab_size=256",
    "train.batch_size=8",
    "train.eval_steps=10",
]
WINDOW = 20


def train(engine, out, steps, sets):
    run_dir = os.path.join(out, "-".join(s.split("=")[1] for s in sets))
    args = [engine, "train", "--recipe", "tiny-llama2", "--steps", str(steps), "--run-dir", run_dir]
    for s in SHAPE + [f"train.eval_every={steps}"] + sets:
        args += ["--set", s]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    losses = [r["loss"] for r in rows if "loss" in r]
    smooth = [sum(losses[max(0, i - WINDOW + 1) : i + 1]) / len(losses[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(losses))]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    times = sorted(r["step_time_s"] for r in rows if "step_time_s" in r)
    return {"smooth": smooth, "final": smooth[-1], "eval": evals[-1] if evals else float("nan"), "step_s": times[len(times) // 2]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="target/release/engine")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--adamw", default="1e-3,3e-3,1e-2,3e-2", help="AdamW's learning rates")
    p.add_argument("--muon", default="0.01,0.02,0.05,0.1", help="optim.muon.lr values")
    p.add_argument("--out", default=None, help="run directories (default: a temporary one)")
    a = p.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="muon-sweep-")
    results = []
    print(f"{'optimizer':<10} {'lr':>8} {'final loss (20-step mean)':>26} {'eval loss':>10} {'step s':>8}", flush=True)
    for lr in a.adamw.split(","):
        r = train(a.engine, out, a.steps, ["optim.name=adamw", f"optim.lr={lr}"])
        results.append(("adamw", lr, r))
        print(f"{'adamw':<10} {lr:>8} {r['final']:>26.4f} {r['eval']:>10.4f} {r['step_s']:>8.3f}", flush=True)
    best_adamw = min((r for r in results if r[0] == "adamw"), key=lambda r: r[2]["final"])
    for lr in a.muon.split(","):
        r = train(a.engine, out, a.steps, ["optim.name=muon", f"optim.lr={best_adamw[1]}", f"optim.muon.lr={lr}"])
        results.append(("muon", lr, r))
        print(f"{'muon':<10} {lr:>8} {r['final']:>26.4f} {r['eval']:>10.4f} {r['step_s']:>8.3f}", flush=True)
    best_muon = min((r for r in results if r[0] == "muon"), key=lambda r: r[2]["final"])
    target = best_adamw[2]["final"]
    reach = next((i + 1 for i, v in enumerate(best_muon[2]["smooth"]) if v <= target), None)
    print(
        f"best AdamW lr {best_adamw[1]}: final {target:.4f}, eval {best_adamw[2]['eval']:.4f}; "
        f"best Muon lr {best_muon[1]}: final {best_muon[2]['final']:.4f}, eval {best_muon[2]['eval']:.4f}; "
        f"Muon reaches AdamW's final loss at step {reach} of {a.steps}"
    )
    if not a.out:
        subprocess.run(["rm", "-rf", out])
    return 0 if best_muon[2]["final"] <= target else 1


if __name__ == "__main__":
    sys.exit(main())
