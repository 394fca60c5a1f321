#!/usr/bin/env python3
"""The planner's best plan for each of the seeds' configurations (docs/parallel.md, "What the
planner picks for the seeds"): runs `engine recipes plan R --nodes N --devices-per-node 8
--memory GIB --global-batch B --set train.seq_len=S --json` for each row and prints a Markdown
table of the first plan (mesh, batch split, recomputation, memory, bubble, estimated step time),
or the planner's own line when nothing fits. The planner's assumptions are its defaults (MFU
0.4 of 989 TFLOP/s, ICI 450 GB/s, DCN 50 GB/s: docs/parallel.md).

    python3 bench/plan_table.py                    # 80 GiB (H100)
    python3 bench/plan_table.py --memory 141       # H200
"""

import argparse
import json
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))

# (configuration, recipe, nodes of 8 devices, global batch in sequences, sequence length): the
# rows of docs/parallel.md's table of the seeds' configurations.
SEEDS = [
    ("llama2-7b, A3 Mega", "llama2-7b", 2, 64, 4096),
    ("llama2-70b, A3 Mega", "llama2-70b", 2, 64, 4096),
    ("fuji-7B-v3", "fuji-7B-v3", 4, 32, 8192),
    ("fuji-70B-v3", "fuji-70B-v3", 4, 32, 8192),
    ("llama3.1-8b", "llama3.1-8b", 2, 16, 8192),
    ("llama3.1-70b", "llama3.1-70b", 4, 32, 8192),
    ("llama3.1-405b, 16 nodes", "llama3.1-405b", 16, 128, 8192),
    ("mixtral-8x7b", "mixtral-8x7b", 2, 16, 4096),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default=os.path.join(HERE, "..", "target", "release", "engine"))
    ap.add_argument("--memory", type=float, default=80, help="GiB per device")
    args = ap.parse_args()
    print(f"| configuration | devices, global batch × sequence | mesh (data × fsdp × tensor × pipeline × seq) | "
          f"sequences per micro-batch × accumulation, remat | memory per device | bubble | step (estimate) |")
    print("|---|---|---|---|---|---|---|")
    for name, recipe, nodes, batch, seq in SEEDS:
        cmd = [args.engine, "recipes", "plan", recipe, "--nodes", str(nodes), "--devices-per-node", "8",
               "--memory", str(args.memory), "--global-batch", str(batch), "--set", f"train.seq_len={seq}", "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        where = f"{nodes * 8}, {batch} × {seq}"
        if out.returncode != 0:
            line = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
            # The planner's line up to the closest plan's --sets (`engine recipes plan` prints them).
            line = line.split(": --set")[0].split("nothing fits")[-1]
            print(f"| {name} | {where} | nothing fits{line.replace('|', '/')} | | | | |")
            continue
        best = json.loads(out.stdout)[0]
        sets = dict(s.split("=", 1) for s in best["sets"])
        split = f"{sets['train.batch_size']} × {sets['train.grad_accum']}, {sets['train.remat'].strip(chr(34))}"
        if int(sets.get("train.pipeline_microbatches", "1")) > 1:
            split += f", {sets['train.pipeline_microbatches']} micro-batches a round"
        print(f"| {name} | {where} | {best['mesh']} | {split} | {best['memory_per_device_bytes'] / 2**30:.1f} GiB | "
              f"{100 * best['bubble_fraction']:.0f} % | {best['step_time_estimate_s']:.2f} s |")


if __name__ == "__main__":
    main()
