#!/usr/bin/env python3
"""The engine and PyTorch side by side on one machine: `engine bench`, then PyTorch eager, then
PyTorch + torch.compile (bench/torch_train.py), the same recipe and shapes, interleaved over
several rounds so that drifting clocks or a noisy neighbour touch every peer alike. Prints the
median tokens/s of each, their TFLOP/s and MFU by the engine's FLOP convention (FLOPs per token
from `engine recipes show`, peak from the engine's device table), and the engine's speed over
each peer's. Nothing is asserted: the figures are for docs/PERF.md.

    python3 bench/compare.py --recipe llama3.2-1b --set train.seq_len=4096 --set train.batch_size=4
    python3 bench/compare.py --recipe tiny-llama2 --device cpu --rounds 1      # a quick look on CPU

Writes the rounds and the summary as JSON with --json FILE, again after every round (a run cut
short leaves the rounds it finished; `rounds_done` says how many).
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def flops_per_token(engine, recipe, sets):
    cmd = [engine, "recipes", "show", recipe] + [a for s in sets for a in ("--set", s)]
    text = run(cmd)
    m = re.search(r"training FLOPs/token at seq_len \d+: ([0-9.e+]+)", text)
    if not m:
        sys.exit("cannot read the FLOPs per token from `engine recipes show`")
    return float(m.group(1))


def engine_round(args, sets):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [args.engine, "--device", args.device, "bench", "--recipe", args.recipe, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--json", f.name] + [a for s in sets for a in ("--set", s)]
        print(run(cmd), file=sys.stderr)
        r = json.load(open(f.name))["recipes"][0]
    return {"peer": "engine", "tokens_per_s": r["tokens_per_s"], "device": r["device"], "peak_tflops": r["peak_tflops"]}


def torch_round(args, sets, compiled):
    cmd = [args.python, os.path.join(HERE, "torch_train.py"), "--engine", args.engine, "--recipe", args.recipe,
           "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup + (3 if compiled else 0))]
    cmd += [a for s in sets for a in ("--set", s)]
    if compiled:
        cmd.append("--compile")
    if args.device == "cpu":
        cmd += ["--threads", str(os.cpu_count())]
    return json.loads(run(cmd).strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--set", action="append", default=[], help="recipe override KEY=VALUE (both sides)")
    ap.add_argument("--engine", default=os.path.join(HERE, "..", "target", "release", "engine"))
    ap.add_argument("--python", default=sys.executable, help="the Python that has torch and transformers")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    ap.add_argument("--no-compile", action="store_true", help="leave out PyTorch + torch.compile")
    ap.add_argument("--json", help="write the rounds and the summary here")
    args = ap.parse_args()

    fpt = flops_per_token(args.engine, args.recipe, args.set)
    peers = ["engine", "pytorch eager"] + ([] if args.no_compile else ["pytorch + torch.compile"])
    rounds = {p: [] for p in peers}
    device, peak = "", 0.0

    def summarise(done):
        """The medians over the rounds done so far; written to --json after every round, so that a
        run cut short (a GPU slot ending) still leaves its figures."""
        engine_tps = statistics.median(rounds["engine"])
        summary = {}
        for p in peers:
            tps = statistics.median(rounds[p])
            tflops = tps * fpt / 1e12
            mfu = tflops / peak if peak > 0 else 0.0
            summary[p] = {"tokens_per_s": tps, "tflops": tflops, "mfu": mfu, "engine_over_peer": engine_tps / tps,
                          "rounds": rounds[p]}
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"recipe": args.recipe, "set": args.set, "device": device, "peak_tflops": peak,
                           "flops_per_token": fpt, "date": datetime.date.today().isoformat(), "rounds_done": done,
                           "rounds_asked": args.rounds, "peers": summary}, f, indent=2)
        return summary

    for i in range(args.rounds):
        print(f"round {i + 1}/{args.rounds}", file=sys.stderr)
        e = engine_round(args, args.set)
        device, peak = e["device"], e["peak_tflops"]
        rounds["engine"].append(e["tokens_per_s"])
        rounds["pytorch eager"].append(torch_round(args, args.set, False)["tokens_per_s"])
        if not args.no_compile:
            rounds["pytorch + torch.compile"].append(torch_round(args, args.set, True)["tokens_per_s"])
        print("  tokens/s: " + ", ".join(f"{p} {rounds[p][-1]:.0f}" for p in peers), file=sys.stderr, flush=True)
        summary = summarise(i + 1)

    print(f"\n{args.recipe} {' '.join(args.set)} on {device}, {args.rounds} interleaved rounds, "
          f"{datetime.date.today().isoformat()}")
    print(f"{'peer':<26} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7} {'engine / peer':>14}")
    for p in peers:
        r = summary[p]
        print(f"{p:<26} {r['tokens_per_s']:>12.0f} {r['tflops']:>9.1f} {100 * r['mfu']:>6.1f}% "
              f"{r['engine_over_peer']:>13.2f}x")
    print(f"(FLOPs per token {fpt:.4e} by the engine's convention; peak {peak} TFLOP/s)")

if __name__ == "__main__":
    main()
