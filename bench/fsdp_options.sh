#!/usr/bin/env bash
# Step time of FSDP on virtual CPU devices under its options (resharding after the forward pass,
# prefetch), interleaved so that a noisy machine affects every variant alike. tiny-llama2 with 4
# layers (the recipe has one, which leaves no layer to prefetch), FSDP 4:
#
#   bash bench/fsdp_options.sh [ROUNDS] [ENGINE]
#
# Prints one line per run and the median step time per variant (docs/PERF.md, "FSDP options").
set -euo pipefail
rounds=${1:-3}
engine=${2:-target/release/engine}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
variants=(
  "reshard+prefetch|mesh.fsdp_reshard_after_forward=true mesh.fsdp_prefetch=true"
  "reshard, no prefetch|mesh.fsdp_reshard_after_forward=true mesh.fsdp_prefetch=false"
  "kept+prefetch|mesh.fsdp_reshard_after_forward=false mesh.fsdp_prefetch=true"
  "kept, no prefetch|mesh.fsdp_reshard_after_forward=false mesh.fsdp_prefetch=false"
)
declare -A times=()
n=0
for round in $(seq "$rounds"); do
  for v in "${variants[@]}"; do
    name=${v%%|*}
    sets=()
    for s in ${v#*|}; do sets+=(--set "$s"); done
    n=$((n + 1))
    run="$dir/run-$n"
    "$engine" train --recipe tiny-llama2 --set model.n_layers=4 --steps 4 --devices 4 --set mesh.ici_fsdp=4 --set mesh.ici_data=1 \
      --set train.perf_warmup_steps=1 --set train.profile_step=0 "${sets[@]}" --run-dir "$run" >/dev/null 2>&1
    t=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['median_step_time_s'])" "$run/summary.json")
    peak=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['peak_memory_bytes'] / 2**30)" "$run/summary.json")
    echo "round $round: $name: step $t s, peak $(printf %.3f "$peak") GiB"
    times[$name]="${times[$name]:-} $t"
  done
done
for v in "${variants[@]}"; do
  name=${v%%|*}
  echo "$name: median step $(python3 -c "import statistics,sys; print(round(statistics.median(map(float, sys.argv[1:])), 3))" ${times[$name]}) s"
done
