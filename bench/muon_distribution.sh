#!/usr/bin/env bash
# Muon's two ways of assembling sharded matrices, measured on virtual CPU devices (docs/PERF.md,
# "Muon"): optim.muon.distribution = "owner" (a reduce-scatter gives each matrix of a batch to one
# device of the group, which orthogonalises it; an all-gather brings the updates back) against
# "everywhere" (an all-reduce, every device orthogonalising every matrix), with AdamW's step
# beside them, on FSDP 4 and FSDP 2 x tensor 2. ROUNDS interleaved rounds; prints each run's
# median step time (engine bench --devices: the slowest device's) and the medians over rounds.
#
#   bash bench/muon_distribution.sh [ENGINE]      (ROUNDS=3 by default)
set -euo pipefail
ENGINE=${1:-target/release/engine}
ROUNDS=${ROUNDS:-3}
SHAPE=(--set model.d_model=512 --set model.n_heads=8 --set model.n_kv_heads=8 --set model.head_dim=64
    --set model.mlp_dim=2048 --set model.n_layers=2 --set model.vocab_size=256 --set train.seq_len=64)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for round in $(seq "$ROUNDS"); do
    for mesh in "fsdp4:mesh.ici_data=1 mesh.ici_fsdp=4" "fsdp2xtp2:mesh.ici_data=1 mesh.ici_fsdp=2 mesh.ici_tensor=2"; do
        name=${mesh%%:*}
        read -r -a sets <<<"${mesh#*:}"
        sets=("${sets[@]/#/--set=}")
        for how in adamw owner everywhere; do
            case $how in
                adamw) opt=(--set optim.name=adamw) ;;
                *) opt=(--set optim.name=muon --set "optim.muon.distribution=\"$how\"") ;;
            esac
            "$ENGINE" --device cpu bench --recipe tiny-llama2 --devices 4 "${SHAPE[@]}" "${sets[@]}" "${opt[@]}" \
                --steps 5 --warmup 2 --json "$out/$name-$how-$round.json" >/dev/null
            python3 - "$out/$name-$how-$round.json" "$name" "$how" "$round" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
t = max(r["median_step_time_s"] for r in d["per_device"])
print(f"{sys.argv[2]:<10} {sys.argv[3]:<11} round {sys.argv[4]}: step {t:.4f} s", flush=True)
PY
        done
    done
done
