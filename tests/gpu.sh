#!/usr/bin/env bash
# The checks and measurements that need an NVIDIA GPU (CI has none; see docs/cuda.md), in phases
# that each finish within 10 minutes, so that they fit the short slots GPU time comes in. Every
# phase writes under one output folder; run them in the order `list` prints, in one slot or many.
#
#   tests/gpu.sh list                 # the phases in order, with their expected durations
#   tests/gpu.sh PHASE OUTDIR         # one phase; its files go to OUTDIR/PHASE/, its log to OUTDIR/PHASE.log
#   tests/gpu.sh all OUTDIR           # every phase in order
#   tests/gpu.sh quick OUTDIR         # one call for a short loan, instead of the others (9 minutes)
#
# No cargo is needed: ENGINE names a binary built elsewhere and carried here (default
# target/release/engine). Needs the NVIDIA driver (580+) and CUDA 13's NVRTC and cuBLASLt on the
# library path or in ENGINE_CUDA_LIB_PATH; the bench-* phases need PYTHON (default python3) with
# torch and transformers, and JAX for its peer (ROUNDS, default 3, interleaved rounds of
# bench/compare.py; PEERS, its --peers; MOE_PEERS and MOE_ROUNDS for the Mixtral phase;
# QWEN3_PEERS, QWEN3_MOE_PEERS and QWEN3_ROUNDS for the Qwen3 phase; GPT_OSS_PEERS and
# GPT_OSS_ROUNDS for the GPT-OSS phase; GEMMA3_PEERS and GEMMA3_ROUNDS for the Gemma 3 phase), the
# profile phase torch and JAX too, long-check
# only python3. The long run keeps its run directory (with a checkpoint of about 15 GB) in
# LONG_DIR (default OUTDIR/long-run), which must survive from one piece to the next.
# Exit codes: 0 done, 1 a check failed, 2 bad usage (one line on stderr).
set -euo pipefail
here=$PWD
cd "$(dirname "$0")/.."

# Paths given relative to where the script was started from.
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$here/$1" ;; esac; }
ENGINE=$(absolute "${ENGINE:-$PWD/target/release/engine}")
PYTHON=${PYTHON:-python3}
ROUNDS=${ROUNDS:-3}
PEERS=${PEERS:-engine,eager,compile-blocks,jax}
# Mixtral's peers: transformers' model in eager PyTorch, a torchtitan-style model on
# torch._grouped_mm compiled per block, JAX with ragged_dot (bench/compare.py).
MOE_PEERS=${MOE_PEERS:-engine,eager,grouped-mm,jax}
MOE_ROUNDS=${MOE_ROUNDS:-2}
# The Qwen3 phase: qwen3-8b against transformers' Qwen3ForCausalLM compiled per block, and
# qwen3-30b-a3b against transformers' Qwen3MoeForCausalLM in eager PyTorch and the torchtitan-style
# grouped-mm model; one round each by default, to stay within the slot (every torch run pays its
# model's initialisation and, compiled, torch.compile's).
QWEN3_PEERS=${QWEN3_PEERS:-engine,compile-blocks}
QWEN3_MOE_PEERS=${QWEN3_MOE_PEERS:-engine,eager,grouped-mm}
QWEN3_ROUNDS=${QWEN3_ROUNDS:-1}
# The GPT-OSS phase: gpt-oss-20b against transformers' GptOssForCausalLM in eager PyTorch and
# compiled per block, with eager attention both ways (transformers has no SDPA path for its
# sinks) and its experts as transformers 5 runs them by default, grouped products
# (torch._grouped_mm); no torchtitan-style peer (bench/torch_moe.py's SDPA attention takes no
# sinks). One round, as the Qwen3 phase.
GPT_OSS_PEERS=${GPT_OSS_PEERS:-engine,eager,compile-blocks}
GPT_OSS_ROUNDS=${GPT_OSS_ROUNDS:-1}
# The Gemma 3 phase: gemma3-1b whole against transformers' Gemma3ForCausalLM (SDPA attention) in
# eager PyTorch and compiled per block. One round: the compiled run compiles 26 blocks.
GEMMA3_PEERS=${GEMMA3_PEERS:-engine,eager,compile-blocks}
GEMMA3_ROUNDS=${GEMMA3_ROUNDS:-1}
# The long run: llama3.2-1b at 8 x 1024 tokens a step, LONG_STEPS steps in 4 pieces, each
# resuming from the previous piece's checkpoint. The cosine is fixed at LONG_STEPS
# (optim.decay_steps), so the pieces make exactly the run one process would have made.
# LONG_RECIPE, LONG_SETS, LONG_STEPS and DEVICE exist so that the piecing itself can be tested
# on the CPU with a tiny model (engine/tests/gpu_script.rs).
LONG_RECIPE=${LONG_RECIPE:-llama3.2-1b}
LONG_SETS=${LONG_SETS:-train.seq_len=1024 train.batch_size=8 optim.warmup_steps=100}
LONG_STEPS=${LONG_STEPS:-1000}
DEVICE=${DEVICE:-cuda}
PIECES=4
# The quick phase (issue 45): one 9-minute call that measures what a short loan should. Its
# gpu-test filters (QUICK_CHECKS, comma-separated), its shapes (QUICK_SHAPES: `recipe sets...`
# entries separated by `;`), the engine's interleaved rounds of bf16 and fp8 at each shape
# (QUICK_ROUNDS, QUICK_STEPS measured steps after QUICK_WARMUP), and one round of the fastest
# peer of each precision (QUICK_PEERS: `recipe precision peer` entries separated by `;`, the
# recipe one of the shapes'; empty: none). The defaults are sized in docs/cuda.md. Carried Python
# wheels (torchao for the FP8 peer; the GPU machine reaches no registry) are installed from
# WHEELS (default target/wheels) into the phase's folder.
QUICK_CHECKS=${QUICK_CHECKS:-FP8,mixtral}
QUICK_SHAPES=${QUICK_SHAPES:-llama3.2-1b train.seq_len=4096 train.batch_size=4;llama3.1-8b model.n_layers=8 train.seq_len=8192 train.batch_size=1;mixtral-8x7b model.n_layers=2 train.seq_len=4096 train.batch_size=2}
QUICK_ROUNDS=${QUICK_ROUNDS:-2}
QUICK_STEPS=${QUICK_STEPS:-5}
QUICK_WARMUP=${QUICK_WARMUP:-2}
QUICK_PEERS=${QUICK_PEERS-llama3.1-8b bf16 compile-blocks;llama3.1-8b fp8 float8-tensorwise;mixtral-8x7b bf16 grouped-mm}
WHEELS=$(absolute "${WHEELS:-$PWD/target/wheels}")

# name|expected minutes (measured on an H100 on 2026-11-24 where docs/cuda.md says so, else an
# estimate)|what it does
PHASES=(
    "gpu-test|1|engine gpu-test: every kernel against the CPU, model parity, graphs, remat, memory, 200-step training"
    "test-all|1|engine test-all, quick then full (full holds gpu-test again), as the image runs it"
    "baselines|1|engine baselines create, quick and full, 3 runs each: the CUDA baselines to commit"
    "cudnn|6|cuDNN's fused attention: its gpu-test checks (stopping there if they fail, with cuDNN's log), gpu-test whole, bench --profile of both recipes, one round of the peers"
    "profile|3|engine bench --profile of llama3.2-1b (4 x 4096) and fuji-3B-v3 (2 x 4096), and bench/attention_peers.py at both shapes"
    "nccl|1|engine launch --nproc 1 on the GPU: NCCL loaded, a one-rank communicator, the watchdog running beside a short training run"
    "image|2|the engine-wheels image (IMAGE_LAYOUT) unpacked and run in a chroot with the host driver bound in: engine gpu-test and test-all --quick inside it"
    "fp8|8|FP8: engine gpu-test's FP8 checks, then bf16 and fp8 steps of llama3.2-1b, fuji-3B-v3, llama3.1-8b (8 layers) and mixtral-8x7b (2 layers), interleaved, and llama3.2-1b's fp8 at min_dim 1024, 2048 and 4096"
    "bench-llama3.2-1b|7|bench/compare.py: the engine, PyTorch eager, torch.compile per block and JAX + cuDNN, llama3.2-1b at 4 x 4096"
    "bench-fuji-3B-v3|9|bench/compare.py: the same for fuji-3B-v3 at 2 x 4096"
    "bench-mixtral-8x7b|6|mixtral-8x7b cut to 2 layers at 2 x 4096: engine bench --profile (where the MoE step goes), then bench/compare.py against the MoE peers (MOE_PEERS), MOE_ROUNDS interleaved rounds"
    "bench-qwen3|7|bench/compare.py at 2 x 4096: qwen3-8b cut to 10 layers against torch.compile per block (QWEN3_PEERS), qwen3-30b-a3b cut to 4 layers against eager transformers and grouped-mm (QWEN3_MOE_PEERS), QWEN3_ROUNDS rounds each"
    "bench-gpt-oss|6|bench/compare.py at 2 x 4096: gpt-oss-20b cut to 3 layers against transformers' GptOssForCausalLM (eager attention) in eager PyTorch and compiled per block (GPT_OSS_PEERS), GPT_OSS_ROUNDS rounds"
    "bench-gemma3|5|bench/compare.py at 2 x 4096: gemma3-1b (26 layers, 262k vocabulary) against transformers' Gemma3ForCausalLM (SDPA attention) in eager PyTorch and compiled per block (GEMMA3_PEERS), GEMMA3_ROUNDS rounds"
    "bench-muon|3|Muon against AdamW: engine gpu-test's Muon checks, then llama3.2-1b at 4 x 4096, a step of each optimizer, two interleaved rounds"
    "long-cpu|4|the long run's first 3 steps on the CPU (the reference for long-check)"
    "long-1|3|the long run on the GPU: steps 1 to 250, checkpoint"
    "long-2|2|the long run: resume, steps 251 to 500, checkpoint"
    "long-3|2|the long run: resume, steps 501 to 750, checkpoint"
    "long-4|2|the long run: resume, steps 751 to 1000"
    "long-check|1|the long run's first steps against the CPU's, and its loss kept falling"
)

usage() {
    echo "usage: tests/gpu.sh list | tests/gpu.sh PHASE OUTDIR | tests/gpu.sh all OUTDIR | tests/gpu.sh quick OUTDIR ($1)" >&2
    exit 2
}

list() {
    local total=0 entry name minutes what
    printf '%-20s %8s  %s\n' phase minutes what
    for entry in "${PHASES[@]}"; do
        IFS='|' read -r name minutes what <<<"$entry"
        printf '%-20s %8s  %s\n' "$name" "$minutes" "$what"
        total=$((total + minutes))
    done
    printf '%-20s %8s  %s\n' total "$total" "expected minutes (docs/cuda.md says which were measured on a GPU; OUTDIR/durations.tsv records them)"
    printf '%-20s %8s  %s\n' quick 9 "instead of the others, for a short loan (not in all): gpu-test's FP8 and MoE checks, bf16 and fp8 at llama3.2-1b 4 x 4096, llama3.1-8b (8 layers) 1 x 8192 and mixtral-8x7b (2 layers) 2 x 4096, interleaved, the fastest peer of each precision, one summary.json (estimate)"
}

known() {
    local entry
    for entry in "${PHASES[@]}"; do
        [ "${entry%%|*}" = "$1" ] && return 0
    done
    return 1
}

need_engine() {
    if [ ! -x "$ENGINE" ]; then
        echo "tests/gpu.sh: no engine binary at $ENGINE: build one with \`cargo build --release -p engine --locked\` (here or elsewhere) and set ENGINE to it" >&2
        exit 2
    fi
}

read -r -a long_sets <<<"$LONG_SETS"
long_args() {
    local s
    printf '%s\n' --recipe "$LONG_RECIPE" --set "optim.decay_steps=$LONG_STEPS"
    for s in "${long_sets[@]}"; do
        printf '%s\n' --set "$s"
    done
}

# The newest checkpoint's step in the long run's directory (0 when there is none).
newest_step() {
    local newest
    newest=$(find "$LONG_DIR/run/checkpoints" -maxdepth 1 -name 'step-*' 2>/dev/null | sort | tail -1)
    [ -n "$newest" ] || { echo 0; return; }
    newest=${newest##*/step-}
    echo $((10#$newest))
}

# Piece K (1-based) of the long run on DEVICE: steps (K-1)·N/4 + 1 to K·N/4, resuming from the
# checkpoint the previous piece left. A piece already done is not run again.
long_piece() {
    local k=$1 from=$(( ($1 - 1) * LONG_STEPS / PIECES )) to=$(( $1 * LONG_STEPS / PIECES )) have args
    mapfile -t args < <(long_args)
    args+=(--set "train.checkpoint_every=$((LONG_STEPS / PIECES))" --set train.keep_last=1 --steps "$to" --run-dir "$LONG_DIR/run")
    have=$(newest_step)
    if [ "$have" -ge "$to" ]; then
        echo "long-$k: already done (checkpoint of step $have in $LONG_DIR/run)"
        return
    fi
    if [ "$have" -ne "$from" ]; then
        echo "long-$k starts at step $from, but the newest checkpoint in $LONG_DIR/run is of step $have: run long-$((k - 1)) first" >&2
        return 1
    fi
    if [ "$k" -eq 1 ]; then
        rm -rf "$LONG_DIR/run"
        "$ENGINE" --device "$DEVICE" train "${args[@]}"
    else
        "$ENGINE" --device "$DEVICE" train "${args[@]}" --resume
    fi
    cp "$LONG_DIR/run/metrics.jsonl" "$out/metrics.jsonl"
}

phase() {
    local name=$1 args
    case "$name" in
    gpu-test)
        "$ENGINE" info
        "$ENGINE" gpu-test --json "$out/gpu-test.json"
        ;;
    test-all)
        "$ENGINE" --device "$DEVICE" test-all --quick --report "$out/quick"
        "$ENGINE" --device "$DEVICE" test-all --report "$out/full"
        ;;
    baselines)
        "$ENGINE" --device "$DEVICE" baselines create --quick --runs 3 --out "$out"
        "$ENGINE" --device "$DEVICE" baselines create --full --runs 3 --out "$out"
        # Read back as test-all reads them: the curves against the new files.
        "$ENGINE" --device "$DEVICE" test-all --quick --filter 'tiny-*' --filter throughput --baselines "$out"
        echo "to commit: cp $out/cuda/*.json tests/baselines/cuda/ (docs/ci.md)"
        ;;
    cudnn)
        # cuDNN's own log of why a graph is refused goes to the phase's folder.
        "$ENGINE" info
        CUDNN_LOGERR_DBG=1 CUDNN_LOGWARN_DBG=1 CUDNN_LOGDEST_DBG="$out/cudnn.log" \
            "$ENGINE" gpu-test --only "attention on cuDNN" --json "$out/gpu-test-cudnn.json"
        "$ENGINE" gpu-test --json "$out/gpu-test.json"
        local shape recipe batch
        for shape in "llama3.2-1b 4" "fuji-3B-v3 2"; do
            read -r recipe batch <<<"$shape"
            "$ENGINE" --device "$DEVICE" bench --recipe "$recipe" --set train.seq_len=4096 --set "train.batch_size=$batch" \
                --steps 5 --warmup 2 --profile --json "$out/bench-$recipe.json"
        done
        "$PYTHON" bench/compare.py --engine "$ENGINE" --python "$PYTHON" --recipe llama3.2-1b --peers "$PEERS" \
            --set train.seq_len=4096 --set train.batch_size=4 --rounds 1 --json "$out/compare.json"
        ;;
    profile)
        local shape recipe batch
        for shape in "llama3.2-1b 4" "fuji-3B-v3 2"; do
            read -r recipe batch <<<"$shape"
            "$ENGINE" --device "$DEVICE" bench --recipe "$recipe" --set train.seq_len=4096 --set "train.batch_size=$batch" \
                --steps 5 --warmup 2 --profile --json "$out/bench-$recipe.json"
            "$PYTHON" bench/attention_peers.py --engine "$ENGINE" --recipe "$recipe" --set train.seq_len=4096 \
                --set "train.batch_size=$batch" --json "$out/attention-peers.jsonl"
        done
        ;;
    quick)
        quick_phase
        ;;
    fp8)
        # train.precision = "fp8" against bf16 on the same GPU (docs/PERF.md#fp8): the FP8
        # kernels and a whole FP8 step against the CPU reference first, then each shape's step
        # in both precisions, two interleaved rounds, then the products' size threshold.
        "$ENGINE" gpu-test --only FP8 --json "$out/gpu-test-fp8.json"
        local shape recipe rest round precision min sets
        for shape in "llama3.2-1b train.seq_len=4096 train.batch_size=4" \
            "fuji-3B-v3 train.seq_len=4096 train.batch_size=2" \
            "llama3.1-8b model.n_layers=8 train.seq_len=8192 train.batch_size=1" \
            "mixtral-8x7b model.n_layers=2 train.seq_len=4096 train.batch_size=2"; do
            read -r recipe rest <<<"$shape"
            read -r -a sets <<<"$rest"
            sets=("${sets[@]/#/--set=}")
            for round in 1 2; do
                for precision in bf16 fp8; do
                    "$ENGINE" --device "$DEVICE" bench --recipe "$recipe" "${sets[@]}" --set "train.precision=$precision" \
                        --steps 6 --warmup 3 --json "$out/bench-$recipe-$precision-$round.json"
                done
            done
        done
        for min in 1024 4096; do
            "$ENGINE" --device "$DEVICE" bench --recipe llama3.2-1b --set train.seq_len=4096 --set train.batch_size=4 \
                --set train.precision=fp8 --set "train.fp8.min_dim=$min" --steps 6 --warmup 3 --json "$out/bench-min-dim-$min.json"
        done
        ;;
    nccl)
        # One GPU holds one NCCL rank (NCCL refuses two ranks on one device), so this checks the
        # loading, the communicator's set-up and the watchdog's thread beside real work, not a
        # lost peer.
        "$ENGINE" launch --nproc 1 -- train --device "$DEVICE" --recipe tiny-llama2 --steps 20 \
            --run-dir "$out/run"
        ;;
    image)
        image_phase
        ;;
    bench-llama3.2-1b)
        "$PYTHON" bench/compare.py --engine "$ENGINE" --python "$PYTHON" --recipe llama3.2-1b --peers "$PEERS" \
            --set train.seq_len=4096 --set train.batch_size=4 --rounds "$ROUNDS" --json "$out/compare.json"
        ;;
    bench-fuji-3B-v3)
        "$PYTHON" bench/compare.py --engine "$ENGINE" --python "$PYTHON" --recipe fuji-3B-v3 --peers "$PEERS" \
            --set train.seq_len=4096 --set train.batch_size=2 --rounds "$ROUNDS" --json "$out/compare.json"
        ;;
    bench-mixtral-8x7b)
        # Issue 35's GPU figures: the engine's MFU on Mixtral's shapes (experts of 4096 x 14336,
        # top-2 of 8) and its speed against the MoE peers, with the per-op profile beside them.
        local mixtral=(--set model.n_layers=2 --set train.seq_len=4096 --set train.batch_size=2)
        "$ENGINE" --device "$DEVICE" bench --recipe mixtral-8x7b "${mixtral[@]}" --steps 5 --warmup 2 --profile \
            --json "$out/bench-mixtral-8x7b.json"
        "$PYTHON" bench/compare.py --engine "$ENGINE" --python "$PYTHON" --recipe mixtral-8x7b --peers "$MOE_PEERS" \
            "${mixtral[@]}" --rounds "$MOE_ROUNDS" --json "$out/compare.json"
        ;;
    bench-qwen3)
        # Qwen3 dense and MoE on one GPU, the shapes cut to fit 80 GiB at 2 x 4096 by the
        # engine's estimate (`engine recipes show RECIPE --set model.n_layers=N ...`, CUDA column):
        # qwen3-8b at 10 layers needs 67.3 GiB (11: 71.6, 12: 75.9), qwen3-30b-a3b at 4 layers
        # 60.3 GiB (5: 71.9, 6: 83.5). An H100 gives about 78 GiB: one more layer of either would
        # leave under 8 % for the estimate's error, the CUDA context and cuDNN's workspace.
        # One log and one JSON per model; both models run even when the first fails.
        local shape recipe layers peers rc=0
        for shape in "qwen3-8b 10 $QWEN3_PEERS" "qwen3-30b-a3b 4 $QWEN3_MOE_PEERS"; do
            read -r recipe layers peers <<<"$shape"
            "$PYTHON" bench/compare.py --engine "$ENGINE" --python "$PYTHON" --recipe "$recipe" --peers "$peers" \
                --set "model.n_layers=$layers" --set train.seq_len=4096 --set train.batch_size=2 \
                --rounds "$QWEN3_ROUNDS" --json "$out/$recipe.json" 2>&1 | tee "$out/$recipe.log" || rc=1
        done
        return "$rc"
        ;;
    bench-gpt-oss)
        # gpt-oss-20b (bf16) on one GPU, cut to fit 80 GiB at 2 x 4096 by the engine's estimate
        # (`engine recipes show gpt-oss-20b --set model.n_layers=N --set train.seq_len=4096
        # --set train.batch_size=2`, CUDA column). A layer holds 823 M parameters (32 experts of
        # 2880 -> 2 x 2880 -> 2880 with biases: 796 M; attention with sinks: 27 M), the embedding
        # and the untied head 1.16 B. At 18 bytes a parameter (bf16 weights and their f32 master:
        # 6; f32 gradients: 4; AdamW's two f32 moments: 8) a layer's state is 13.8 GiB, and its
        # activations 1.2 GiB: 3 layers (3.63 B parameters) need 68.9 GiB (state 60.8, activations
        # 7.9, scratch 0.2), 4 layers 83.9 (80.4 with remat = full; 79.3 at batch 1). An H100 gives
        # about 78 GiB: 3 layers leave 12 % for the estimate's error, the CUDA context and cuDNN's
        # workspace. PyTorch holds bf16 weights, gradients and both AdamW moments, 8 bytes a
        # parameter (27.0 GiB), and eager attention's probabilities, [2, 64, 4096, 4097] in bf16,
        # 4 GiB a copy, two kept per layer for the backward pass (the softmax's output and the
        # sink-less slice the value product reads), and the logits in f32 (6 GiB a copy): its
        # eager step, counted on the meta device (every tensor while alive, no fragmentation),
        # peaks at 59 GiB with the moments (at 4 layers the engine would not fit anyway;
        # `peak_memory_gib` in the JSON records the real peak of each PyTorch run).
        # One log and one JSON.
        "$PYTHON" bench/compare.py --engine "$ENGINE" --python "$PYTHON" --recipe gpt-oss-20b --peers "$GPT_OSS_PEERS" \
            --set model.n_layers=3 --set train.seq_len=4096 --set train.batch_size=2 \
            --rounds "$GPT_OSS_ROUNDS" --json "$out/gpt-oss-20b.json" 2>&1 | tee "$out/gpt-oss-20b.log"
        ;;
    bench-gemma3)
        # gemma3-1b (bf16) whole on one GPU at 2 x 4096 (1.00 B parameters, 302 M of them the tied
        # 262144 x 1152 embedding; 26 layers, five sliding-window layers of 512 for each global
        # one). The engine's estimate (`engine recipes show gemma3-1b --set train.seq_len=4096
        # --set train.batch_size=B`, CUDA column): state 16.8 GiB (weights and their f32 master
        # 5.59, f32 gradients 3.72, AdamW's f32 moments 7.45) and 8.5 GiB of activations a
        # sequence: 33.9 GiB at batch 2, 51.0 at 4, 85.1 at 8. The engine would fit batch 4 (or
        # 6, about 68), PyTorch would not: its bf16 state is 7.45 GiB (weights, gradients, both
        # moments at 8 bytes a parameter), but the logits, [B x 4096, 262144], cost 4 GiB a
        # sequence in f32 and the loss keeps up to three such copies at once (log_softmax's output,
        # the gradient coming back and the one going on; 24 GiB at batch 2): its eager step,
        # counted on the meta device (every tensor while alive, no fragmentation; attention as a
        # fused kernel, which keeps only its output and log-sum-exp), peaks at 53.4 GiB at batch 2
        # (66.8 if SDPA took its math kernel for every layer) and 101 GiB at batch 4. So 2 x 4096,
        # within an H100's 78 GiB for every peer (`peak_memory_gib` in the JSON records the real
        # peak of each PyTorch run). One round: the engine and the eager run take well under a
        # minute each, torch.compile of 26 blocks about three. One log and one JSON.
        "$PYTHON" bench/compare.py --engine "$ENGINE" --python "$PYTHON" --recipe gemma3-1b --peers "$GEMMA3_PEERS" \
            --set train.seq_len=4096 --set train.batch_size=2 \
            --rounds "$GEMMA3_ROUNDS" --json "$out/gemma3-1b.json" 2>&1 | tee "$out/gemma3-1b.log"
        ;;
    bench-muon)
        # optim.name = "muon" against "adamw" on the same GPU (docs/PERF.md#muon): the momentum
        # and norm kernels against the CPU first, then llama3.2-1b's whole step with each
        # optimizer, two interleaved rounds. Muon's extra time is its Newton-Schulz products
        # (5 iterations of X Xᵀ, A² and B X in bf16 per matrix, 2r²c + r³ multiply-adds each for
        # an r x c matrix, r ≤ c: 46 TFLOP a step for the 16 layers' 7 matrices, against the
        # step's own 6 x 1.24 B x 16384 = 122 TFLOP at 4 x 4096; a larger batch dilutes it).
        # Five files.
        "$ENGINE" gpu-test --only muon --json "$out/gpu-test-muon.json"
        local round optimizer
        for round in 1 2; do
            for optimizer in adamw muon; do
                "$ENGINE" --device "$DEVICE" bench --recipe llama3.2-1b --set train.seq_len=4096 --set train.batch_size=4 \
                    --set "optim.name=$optimizer" --steps 6 --warmup 3 --json "$out/bench-$optimizer-$round.json"
            done
        done
        ;;
    long-cpu)
        # The same seed gives the same initial weights and data order on both devices; the CPU
        # takes the batch as micro-batches of one.
        mapfile -t args < <(long_args)
        rm -rf "$LONG_DIR/cpu"
        "$ENGINE" --device cpu train "${args[@]}" --set train.batch_size=1 \
            --set "train.grad_accum=$(batch)" --steps 3 --run-dir "$LONG_DIR/cpu"
        cp "$LONG_DIR/cpu/metrics.jsonl" "$out/metrics.jsonl"
        ;;
    long-[0-9])
        long_piece "${name#long-}"
        ;;
    long-check)
        "$PYTHON" - "$LONG_DIR/cpu/metrics.jsonl" "$LONG_DIR/run/metrics.jsonl" "$LONG_STEPS" <<'PY'
import json, sys
cpu = [json.loads(l)["loss"] for l in open(sys.argv[1])]
gpu = [json.loads(l)["loss"] for l in open(sys.argv[2])]
steps = int(sys.argv[3])
assert len(gpu) == steps, f"the long run has {len(gpu)} steps, not {steps}: run the long-N phases first"
for i, c in enumerate(cpu):
    print(f"step {i + 1}: loss {c:.4f} on the CPU, {gpu[i]:.4f} on the device ({100 * (gpu[i] - c) / c:+.2f} %)")
    assert abs(gpu[i] - c) <= 0.01 * c, "the device's loss left the CPU reference's"
n = max(1, steps // 20)
first, last = sum(gpu[:n]) / n, sum(gpu[-n:]) / n
print(f"device loss: mean {first:.4f} over the first {n} steps, {last:.4f} over the last {n}")
assert last < 0.7 * first, "the device's loss did not keep falling"
PY
        ;;
    esac
}

# The `image` phase: the image as users run it, not the carried binary. IMAGE_LAYOUT is an OCI
# layout of the engine-wheels image (`distro build --image engine-wheels --platform linux/amd64
# --output DIR`, or that DIR as a .tar); nothing is fetched (the GPU machine may have no network).
# Its layers are unpacked in order into OUTDIR/image/rootfs and the image's Env is read from its
# config. The host driver is bound in as NVIDIA's container toolkit does for
# NVIDIA_DRIVER_CAPABILITIES=compute,utility: each of the host's libcuda, libnvidia-ml,
# libnvidia-ptxjitcompiler, libnvidia-nvvm and libnvidia-gpucomp files (found with ldconfig -p)
# bind-mounted read-only at the same name in the rootfs's /usr/lib/x86_64-linux-gnu, nvidia-smi
# at /usr/bin/nvidia-smi, the host's /dev (the /dev/nvidia* nodes), /proc and /sys, then
# ldconfig inside; all in a private mount namespace (unshare), as root, so nothing outlives it.
# Needs root (or unprivileged user namespaces) and python3. Without IMAGE_LAYOUT: SKIPPED.
image_phase() {
    if [ -z "${IMAGE_LAYOUT:-}" ]; then
        echo "image: SKIPPED: set IMAGE_LAYOUT to the engine-wheels image's OCI layout (docs/images.md)"
        return 0
    fi
    local layout rootfs
    layout=$(absolute "$IMAGE_LAYOUT")
    rootfs="$out/rootfs"
    rm -rf "$rootfs"
    mkdir -p "$rootfs"
    "$PYTHON" - "$layout" "$rootfs" "$out/env" <<'PY'
import io, json, os, sys, tarfile
layout, rootfs, env_out = sys.argv[1:]
tar = tarfile.open(layout) if os.path.isfile(layout) else None
def blob(digest):
    rel = "blobs/" + digest.replace(":", "/")
    if tar:
        return tar.extractfile(next(m for m in tar.getmembers() if m.name.lstrip("./") == rel)).read()
    return open(os.path.join(layout, rel), "rb").read()
def doc(rel):
    if tar:
        return json.load(tar.extractfile(next(m for m in tar.getmembers() if m.name.lstrip("./") == rel)))
    return json.load(open(os.path.join(layout, rel)))
index = doc("index.json")
m = index["manifests"][0]
while m["mediaType"].endswith("index.v1+json"):
    m = next(x for x in json.loads(blob(m["digest"]))["manifests"] if x.get("platform", {}).get("architecture") == "amd64")
manifest = json.loads(blob(m["digest"]))
config = json.loads(blob(manifest["config"]["digest"]))
for layer in manifest["layers"]:
    with tarfile.open(fileobj=io.BytesIO(blob(layer["digest"])), mode="r:*") as t:
        for e in t.getmembers():
            head, _, name = e.name.rpartition("/")
            if name.startswith(".wh."):  # OCI whiteouts: remove what a lower layer put there
                victim = os.path.join(rootfs, head, name[4:])
                os.system(f"rm -rf '{victim}'")
                continue
            try:
                t.extract(e, rootfs, numeric_owner=True, filter="fully_trusted")
            except TypeError:  # Python before 3.11.4 has no extraction filters
                t.extract(e, rootfs, numeric_owner=True)
    print(f"unpacked {layer['digest']} ({layer['size']} bytes)")
with open(env_out, "w") as f:
    f.write("\n".join(config["config"].get("Env", [])) + "\n")
PY
    echo "image env:"
    cat "$out/env"
    # The driver as the container toolkit binds it (compute, utility).
    local libdir="$rootfs/usr/lib/x86_64-linux-gnu" binds=() f
    mkdir -p "$libdir" "$rootfs/out" "$rootfs/dev" "$rootfs/proc" "$rootfs/sys"
    while read -r f; do
        [ -e "$f" ] && binds+=("$f")
    done < <(ldconfig -p | awk '$1 ~ /^lib(cuda|nvidia-ml|nvidia-ptxjitcompiler|nvidia-nvvm|nvidia-gpucomp)\.so/ {print $NF}' | sort -u)
    [ ${#binds[@]} -gt 0 ] || { echo "image: no libcuda on this host (ldconfig -p): is the NVIDIA driver installed?" >&2; return 1; }
    printf 'driver file bound in: %s\n' "${binds[@]}"
    local script="$out/inside.sh"
    {
        echo "set -e"
        for f in "${binds[@]}"; do
            # Bind the real file (the host's names are links to it), under the name the loader asks for.
            echo "touch '$libdir/$(basename "$f")' && mount --bind -o ro '$(readlink -f "$f")' '$libdir/$(basename "$f")'"
        done
        if command -v nvidia-smi >/dev/null; then
            echo "touch '$rootfs/usr/bin/nvidia-smi' && mount --bind -o ro '$(command -v nvidia-smi)' '$rootfs/usr/bin/nvidia-smi'"
        fi
        echo "mount --rbind /dev '$rootfs/dev' && mount -t proc proc '$rootfs/proc' && mount --rbind /sys '$rootfs/sys'"
        echo "mount --bind '$out' '$rootfs/out'"
        echo "chroot '$rootfs' /sbin/ldconfig"
        echo "run() { chroot '$rootfs' /usr/bin/env -i \$(cat '$out/env') HOME=/root sh -c 'cd /opt/engine && exec \"\$@\"' sh \"\$@\"; }"
        echo "run engine info"
        echo "run engine gpu-test --json /out/gpu-test.json"
        echo "run test-all --quick --report /out/quick"
    } >"$script"
    local rc=0
    if [ "$(id -u)" = 0 ]; then
        unshare --mount --propagation private bash "$script" || rc=$?
    else
        unshare --user --map-root-user --mount --propagation private bash "$script" || rc=$?
    fi
    # The mounts went with the namespace; the 1.6 GB rootfs need not come back with OUTDIR.
    rm -rf "$rootfs"
    return "$rc"
}

# The quick phase: every result under $out/runs, then summary.json beside one tarball of them
# (the files a GPU call brings back are few).
quick_phase() {
    local runs="$out/runs" emulate=() filter round shape recipe rest sets precision
    local name entry peer_recipe peer_precision peer found
    mkdir -p "$runs"
    # DEVICE=emulate (the CPU emulator of a GPU, with QUICK_* shrunk): gpu-test's own flag.
    [ "$DEVICE" = emulate ] && emulate=(--emulate)
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PYTHON" -m pip install --quiet --no-deps --no-index --target "$out/python" "$WHEELS"/*.whl
        export PYTHONPATH="$out/python${PYTHONPATH:+:$PYTHONPATH}"
    fi
    IFS=',' read -r -a filters <<<"$QUICK_CHECKS"
    for filter in "${filters[@]}"; do
        "$ENGINE" gpu-test "${emulate[@]}" --only "$filter" --json "$runs/gpu-test-${filter// /_}.json"
    done
    IFS=';' read -r -a shapes <<<"$QUICK_SHAPES"
    for round in $(seq 1 "$QUICK_ROUNDS"); do
        for shape in "${shapes[@]}"; do
            read -r recipe rest <<<"$shape"
            read -r -a sets <<<"$rest"
            sets=("${sets[@]/#/--set=}")
            for precision in bf16 fp8; do
                "$ENGINE" --device "$DEVICE" bench --recipe "$recipe" "${sets[@]}" --set "train.precision=$precision" \
                    --steps "$QUICK_STEPS" --warmup "$QUICK_WARMUP" --json "$runs/engine-$recipe-$precision-$round.json"
            done
        done
    done
    IFS=';' read -r -a peers <<<"$QUICK_PEERS"
    for entry in "${peers[@]}"; do
        read -r peer_recipe peer_precision peer <<<"$entry"
        [ -n "$peer_recipe" ] || continue
        found=
        for shape in "${shapes[@]}"; do
            read -r recipe rest <<<"$shape"
            [ "$recipe" = "$peer_recipe" ] && found=$rest
        done
        [ -n "$found" ] || { echo "QUICK_PEERS: $peer_recipe is none of QUICK_SHAPES' recipes" >&2; return 2; }
        read -r -a sets <<<"$found train.precision=$peer_precision"
        sets=("${sets[@]/#/--set=}")
        name="$peer_recipe-$peer_precision-$peer"
        # A failing peer is reported in the summary, not a failed phase.
        "$PYTHON" bench/compare.py --engine "$ENGINE" --python "$PYTHON" --recipe "$peer_recipe" --peers "engine,$peer" \
            "${sets[@]}" --rounds 1 --steps "$QUICK_STEPS" --warmup "$QUICK_WARMUP" --json "$runs/compare-$name.json" ||
            echo "peer $name failed" | tee "$runs/compare-$name.failed"
    done
    "$PYTHON" bench/quick_summary.py "$runs" --json "$out/summary.json"
    tar -C "$out" -cf "$out/runs.tar" runs
    rm -rf "$runs" "$out/python"
}

# train.batch_size of the long run (the CPU reference accumulates that many micro-batches of one).
batch() {
    local s
    for s in "${long_sets[@]}"; do
        case "$s" in train.batch_size=*) echo "${s#*=}"; return ;; esac
    done
    echo 1
}

run_phase() {
    local name=$1 start seconds rc
    out="$outdir/$name"
    mkdir -p "$out"
    printf '\n== %s (%s)\n' "$name" "$(date -u +%FT%TZ)"
    start=$(date +%s)
    # The phase stops at its first failing command (set -e would be ignored under `||`).
    set +e
    (set -e; phase "$name") 2>&1 | tee "$outdir/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    seconds=$(($(date +%s) - start))
    printf '%s\t%s\t%s\t%s\n' "$name" "$seconds" "$rc" "$(date -u +%FT%TZ)" >>"$outdir/durations.tsv"
    if [ "$rc" -eq 0 ]; then
        printf '== %s: done after %d s\n' "$name" "$seconds"
    else
        printf '== %s: FAILED (exit %d) after %d s\n' "$name" "$rc" "$seconds"
    fi
    return "$rc"
}

[ $# -ge 1 ] || usage "no phase given"
what=$1
if [ "$what" = list ]; then
    [ $# -eq 1 ] || usage "list takes no folder"
    list
    exit 0
fi
[ "$what" = all ] || [ "$what" = quick ] || known "$what" || usage "unknown phase $what; tests/gpu.sh list shows them"
[ $# -eq 2 ] || usage "$what needs one OUTDIR"
need_engine
outdir=$(absolute "$2")
mkdir -p "$outdir"
LONG_DIR=$(absolute "${LONG_DIR:-$outdir/long-run}")
mkdir -p "$LONG_DIR"
if [ "$what" = all ]; then
    # A failed phase does not stop the others (GPU time is scarce); the exit code says it failed.
    failed=()
    for entry in "${PHASES[@]}"; do
        run_phase "${entry%%|*}" || failed+=("${entry%%|*}")
    done
    if [ ${#failed[@]} -gt 0 ]; then
        echo "failed: ${failed[*]} (logs in $outdir)" >&2
        exit 1
    fi
else
    run_phase "$what"
fi
