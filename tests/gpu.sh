#!/usr/bin/env bash
# The checks and measurements that need an NVIDIA GPU (CI has none; see docs/cuda.md). Run on a
# GPU machine from a checkout, with a built engine or cargo to build one:
#
#   tests/gpu.sh                 # gpu-test, the long run, the side-by-side benchmarks
#   tests/gpu.sh check           # only engine gpu-test
#
# Needs the NVIDIA driver (580+) and CUDA 13's NVRTC and cuBLASLt on the library path or in
# ENGINE_CUDA_LIB_PATH; the benchmarks need python3 with torch and transformers. Outputs go to
# runs/gpu/.
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${ENGINE:-target/release/engine}
PYTHON=${PYTHON:-python3}
OUT=runs/gpu
mkdir -p "$OUT"
if [ ! -x "$ENGINE" ]; then
    cargo build --release -p engine --locked
fi
what=${1:-all}

section() { printf '\n== %s\n' "$*"; }

section "devices"
"$ENGINE" info

section "engine gpu-test: kernels against the CPU, model parity, graphs, remat, memory, 200-step training"
"$ENGINE" gpu-test --json "$OUT/gpu-test.json"
[ "$what" = check ] && exit 0

section "long run: llama3.2-1b, 1000 steps on the GPU; its first steps against the CPU reference"
# The same seed gives the same initial weights and data order on both devices: the losses of
# the first steps must agree within bf16 tolerance, and the GPU's must keep falling.
long=(--recipe llama3.2-1b --set train.seq_len=1024 --set train.batch_size=8 --set optim.warmup_steps=100)
rm -rf "$OUT/long-cpu" "$OUT/long-cuda"
"$ENGINE" --device cpu train "${long[@]}" --set train.batch_size=1 --set train.grad_accum=8 --steps 3 --run-dir "$OUT/long-cpu"
"$ENGINE" --device cuda train "${long[@]}" --steps 1000 --run-dir "$OUT/long-cuda"
"$PYTHON" - "$OUT/long-cpu/metrics.jsonl" "$OUT/long-cuda/metrics.jsonl" <<'PY'
import json, sys
cpu = [json.loads(l)["loss"] for l in open(sys.argv[1])]
gpu = [json.loads(l)["loss"] for l in open(sys.argv[2])]
for i, c in enumerate(cpu):
    print(f"step {i + 1}: loss {c:.4f} on the CPU, {gpu[i]:.4f} on the GPU ({100 * (gpu[i] - c) / c:+.2f} %)")
    assert abs(gpu[i] - c) <= 0.01 * c, "the GPU's loss left the CPU reference's"
first, last = sum(gpu[:50]) / 50, sum(gpu[-50:]) / 50
print(f"GPU loss: mean {first:.4f} over the first 50 steps, {last:.4f} over the last 50")
assert last < 0.7 * first, "the GPU's loss did not keep falling"
PY

section "side by side with PyTorch (eager and torch.compile), one GPU"
"$PYTHON" bench/compare.py --engine "$ENGINE" --python "$PYTHON" --recipe llama3.2-1b \
    --set train.seq_len=4096 --set train.batch_size=4 --json "$OUT/compare-llama3.2-1b.json"
"$PYTHON" bench/compare.py --engine "$ENGINE" --python "$PYTHON" --recipe fuji-3B-v3 \
    --set train.seq_len=4096 --set train.batch_size=2 --json "$OUT/compare-fuji-3B-v3.json"
section "done: record the figures in docs/PERF.md"
