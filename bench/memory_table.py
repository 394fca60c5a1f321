#!/usr/bin/env python3
"""Per-device memory of the seeds' large configurations on their meshes, from the engine's plan.

Prints the Markdown table of docs/parallel.md ("The seeds' configurations"): for each
configuration, `engine recipes show --json` on its mesh, the CUDA estimate per device, and
whether it fits an 80 GB H100 and a 141 GB H200 (the usable memory taken as the card's less
the ~1 GiB a CUDA context and NCCL take).

    python3 bench/memory_table.py [--engine target/release/engine]
"""

import argparse
import json
import subprocess

GIB = 1 << 30
# Usable bytes: the card's memory less the CUDA context and NCCL's buffers (about 1 GiB).
H100 = 80e9 - GIB
H200 = 141e9 - GIB

# (what, recipe, overrides, devices per node, nodes). Meshes are the seeds': MaxText on A3 Mega
# (`ici_fsdp=8`, `dcn_data=2`, per-device batch 4, sequence 4096, minimal remat), AXLearn's
# fuji on H100 nodes (FSDP within a node, data across), torchax's Llama 3.1 405B on 16 nodes.
CONFIGS = [
    ("llama2-7b, A3 Mega", "llama2-7b",
     ["mesh.ici_fsdp=8", "mesh.ici_data=1", "mesh.dcn_data=2", "train.batch_size=4", "train.seq_len=4096",
      "train.remat=minimal"], 8, 2),
    ("llama2-7b, data parallel", "llama2-7b",
     ["mesh.ici_fsdp=1", "mesh.ici_data=8", "mesh.dcn_data=2", "train.batch_size=4", "train.seq_len=4096",
      "train.remat=minimal"], 8, 2),
    ("llama2-70b, A3 Mega", "llama2-70b",
     ["mesh.ici_fsdp=8", "mesh.ici_data=1", "mesh.dcn_data=2", "train.batch_size=4", "train.seq_len=4096",
      "train.remat=minimal"], 8, 2),
    ("llama2-70b, FSDP over 2 nodes", "llama2-70b",
     ["mesh.ici_fsdp=8", "mesh.ici_data=1", "mesh.dcn_fsdp=2", "mesh.dcn_data=1", "train.batch_size=1",
      "train.seq_len=4096", "train.remat=full"], 8, 2),
    ("fuji-7B-v3", "fuji-7B-v3",
     ["mesh.ici_fsdp=8", "mesh.ici_data=1", "train.batch_size=1", "train.seq_len=8192", "train.remat=minimal"], 8, 4),
    ("fuji-70B-v3", "fuji-70B-v3",
     ["mesh.ici_fsdp=8", "mesh.ici_data=1", "mesh.dcn_fsdp=4", "mesh.dcn_data=1", "train.batch_size=1",
      "train.seq_len=8192", "train.remat=full"], 8, 4),
    ("llama3.1-8b", "llama3.1-8b",
     ["mesh.ici_fsdp=8", "mesh.ici_data=1", "train.batch_size=1", "train.seq_len=8192", "train.remat=minimal"], 8, 2),
    ("llama3.1-70b", "llama3.1-70b",
     ["mesh.ici_fsdp=8", "mesh.ici_data=1", "mesh.dcn_fsdp=4", "mesh.dcn_data=1", "train.batch_size=1",
      "train.seq_len=8192", "train.remat=full"], 8, 4),
    ("llama3.1-405b, 16 nodes", "llama3.1-405b",
     ["mesh.ici_fsdp=8", "mesh.ici_data=1", "mesh.dcn_fsdp=16", "mesh.dcn_data=1", "train.batch_size=1",
      "train.seq_len=8192", "train.remat=full"], 8, 16),
    ("llama3.1-405b, 16 nodes, tensor 8", "llama3.1-405b",
     ["mesh.ici_tensor=8", "mesh.ici_fsdp=1", "mesh.ici_data=1", "mesh.dcn_fsdp=16", "mesh.dcn_data=1",
      "train.batch_size=0.125", "train.seq_len=8192", "train.remat=full"], 8, 16),
    ("mixtral-8x7b", "mixtral-8x7b",
     ["mesh.ici_fsdp=8", "mesh.ici_data=1", "mesh.dcn_fsdp=2", "mesh.dcn_data=1", "train.batch_size=1",
      "train.seq_len=4096", "train.remat=full"], 8, 2),
]


def plan(engine, recipe, sets, devices, nodes):
    cmd = [engine, "recipes", "show", recipe, "--json", "--devices", str(devices), "--nodes", str(nodes)]
    for s in sets:
        cmd += ["--set", s]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="target/release/engine")
    args = ap.parse_args()
    print("| configuration | mesh (data × fsdp × tensor) | batch × sequence, remat | params + grads + moments | "
          "activations | total per device | H100 80 GB | H200 141 GB |")
    print("|---|---|---|---|---|---|---|---|")
    for what, recipe, sets, devices, nodes in CONFIGS:
        d = plan(args.engine, recipe, sets, devices, nodes)
        m, c = d["mesh"], d["memory_per_device"]["cuda"]
        def get(key):
            return next(s.split("=", 1)[1] for s in sets if s.startswith(key + "="))

        state = c["parameters_bytes"] + c["gradients_bytes"] + c["optimizer_bytes"]
        total = c["total_bytes"]
        def fits(cap):
            return "fits" if total <= cap else "no"
        print(f"| {what} | {m['data']} × {m['fsdp']} × {m['tensor']} ({m['devices']} GPUs) | "
              f"{get('train.batch_size')} × {get('train.seq_len')}, {get('train.remat')} | {state / GIB:.1f} GiB | {c['activations_bytes'] / GIB:.1f} GiB | "
              f"{total / GIB:.1f} GiB | {fits(H100)} | {fits(H200)} |")


if __name__ == "__main__":
    main()
