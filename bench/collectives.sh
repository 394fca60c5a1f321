#!/usr/bin/env bash
# The TCP collectives (one process per device) against virtual devices (threads of one process):
# step time and the bytes rank 0 sends per step, for each mesh, interleaved so that a noisy
# machine affects both alike. tiny-llama2 with 4 layers, an MLP of 2048, a 4096-token vocabulary
# and 128-token sequences (50 M parameters), 4 devices:
#
#   bash bench/collectives.sh [ROUNDS] [ENGINE]
#
# Prints one line per run and the median step time per variant (docs/PERF.md, "Collectives
# across processes"). The curves of both are checked equal bit for bit by engine/tests/multiprocess.rs.
set -euo pipefail
rounds=${1:-3}
engine=${2:-target/release/engine}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
meshes=(
  "data 4|mesh.ici_data=4"
  "fsdp 4|mesh.ici_fsdp=4"
  "data 2 x fsdp 2|mesh.ici_data=2 mesh.ici_fsdp=2"
  "tensor 2 x data 2|mesh.ici_tensor=2 mesh.ici_data=2"
  "pipeline 2 x data 2|mesh.ici_pipeline=2 mesh.ici_data=2 train.pipeline_microbatches=2 train.batch_size=2"
)
declare -A times=()
n=0
for round in $(seq "$rounds"); do
  for m in "${meshes[@]}"; do
    name=${m%%|*}
    sets=()
    for s in ${m#*|}; do sets+=(--set "$s"); done
    for how in processes virtual; do
      n=$((n + 1))
      run="$dir/run-$n"
      if [ "$how" = processes ]; then
        cmd=("$engine" launch --nproc 4 -- train)
      else
        cmd=("$engine" train --devices 4)
      fi
      if ! out=$("${cmd[@]}" --device cpu --recipe tiny-llama2 --steps 8 --set model.n_layers=4 \
        --set model.mlp_dim=2048 --set model.vocab_size=4096 --set train.seq_len=128 --set train.perf_warmup_steps=2 \
        --set train.profile_step=0 "${sets[@]}" --run-dir "$run" 2>&1); then
        echo "$out" >&2
        exit 1
      fi
      t=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['median_step_time_s'])" "$run/summary.json")
      bytes=$(grep -o '[0-9.]* MiB per step' <<<"$out" || echo "- (shared memory)")
      echo "round $round: $name, $how: step $t s, rank 0 sends $bytes"
      times["$name|$how"]="${times["$name|$how"]:-} $t"
    done
  done
done
median() { python3 -c "import statistics,sys; print(round(statistics.median(map(float, sys.argv[1:])), 3))" "$@"; }
for m in "${meshes[@]}"; do
  name=${m%%|*}
  # shellcheck disable=SC2086 # the lists are space-separated numbers
  p=$(median ${times["$name|processes"]}) v=$(median ${times["$name|virtual"]})
  echo "$name: median step $p s across processes, $v s on virtual devices ($(python3 -c "print(round($p / $v, 2))")x)"
done
