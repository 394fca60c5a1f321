#!/usr/bin/env python3
"""The engine and its peers side by side on one machine, the same recipe and shapes, interleaved
over several rounds so that drifting clocks or a noisy neighbour touch every peer alike:

- `engine`: `engine bench`;
- `eager`: PyTorch eager (bench/torch_train.py: transformers' model, SDPA, fused AdamW);
- `compile-blocks`: PyTorch + torch.compile of each decoder layer, as torchtitan sets it up;
- `compile-whole`: PyTorch + torch.compile of the forward pass and the loss together;
- `jax`: the seeds' stack, a MaxText-style step in JAX with cuDNN flash attention
  (bench/jax_train.py; `--jax-attention xla` on a CPU); for Mixtral, the experts dropless
  through `jax.lax.ragged_dot`, MaxText's path;
- `grouped-mm` (Mixtral only): a torchtitan-style MoE model (bench/torch_moe.py), the experts'
  products in `torch._grouped_mm`, each block compiled with fullgraph=True as torchtitan does.
- `float8-tensorwise`, `float8-rowwise`: `compile-blocks` with torchao's float8 training of the
  decoder's linear layers (`--float8` of bench/torch_train.py; torchtitan's FP8), the peers of
  the engine's `train.precision = "fp8"` (give `--set train.precision=fp8` to compare them with
  the engine's FP8). torchao comes as a carried wheel on machines that reach no registry
  (tests/gpu.sh's WHEELS).
- `jax-fp8`: `jax` with the decoder's linear layers through JAX's native FP8 path (bench/jax_train.py
  `--fp8 tensorwise`: each operand quantized and dequantized around the product, which XLA's GPU
  compiler rewrites into cuBLASLt FP8 products, as flax's `fp8_ops` write it).

On a GPT-OSS recipe `eager` and `compile-blocks` run `GptOssForCausalLM` with eager attention
(transformers has no SDPA path for its sinks) and its experts as grouped products; `grouped-mm`
is not written for it (bench/torch_train.py). On a Gemma 3 recipe they run transformers'
`Gemma3ForCausalLM` (the text model; SDPA attention on CUDA), its parameter count checked against
the engine's:

    python3 bench/compare.py --recipe gemma3-1b --set train.seq_len=4096 --set train.batch_size=2 \
        --peers engine,eager,compile-blocks --rounds 1

On a Mixtral recipe `eager` is Hugging Face's `MixtralForCausalLM` in eager PyTorch, what most
users start from:

    python3 bench/compare.py --recipe mixtral-8x7b --set model.n_layers=2 --set train.seq_len=4096 \
        --set train.batch_size=2 --peers engine,eager,grouped-mm,jax

Prints the median tokens/s of each, their TFLOP/s and MFU by the engine's FLOP convention (FLOPs
per token from `engine recipes show`, peak from the engine's device table), and the engine's
speed over each peer's and over the fastest. Nothing is asserted: the figures are for
docs/PERF.md.

    python3 bench/compare.py --recipe llama3.2-1b --set train.seq_len=4096 --set train.batch_size=4
    python3 bench/compare.py --recipe tiny-llama2 --device cpu --rounds 1 --peers engine,eager,jax --jax-attention xla

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


def torch_round(args, sets, compiled, moe_layer="hf", float8=None):
    cmd = [args.python, os.path.join(HERE, "torch_train.py"), "--engine", args.engine, "--recipe", args.recipe,
           "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup + (3 if compiled else 0)),
           "--moe-layer", moe_layer]
    if float8:
        cmd += ["--float8", float8]
    cmd += [a for s in sets for a in ("--set", s)]
    if compiled:
        cmd += ["--compile", compiled]
    if args.device == "cpu":
        cmd += ["--threads", str(os.cpu_count())]
    return json.loads(run(cmd).strip().splitlines()[-1])


def jax_round(args, sets, fp8=None):
    cmd = [args.python, os.path.join(HERE, "jax_train.py"), "--engine", args.engine, "--recipe", args.recipe,
           "--attention", args.jax_attention, "--steps", str(args.steps), "--warmup", str(args.warmup + 1)]
    if fp8:
        cmd += ["--fp8", fp8]
    cmd += [a for s in sets for a in ("--set", s)]
    return json.loads(run(cmd).strip().splitlines()[-1])


PEERS = {
    "engine": "engine",
    "eager": "pytorch eager",
    "compile-blocks": "pytorch + torch.compile (blocks)",
    "compile-whole": "pytorch + torch.compile (whole)",
    "jax": "jax + cudnn attention",
    "grouped-mm": "pytorch + torch._grouped_mm (blocks)",
    "float8-tensorwise": "pytorch + torch.compile (blocks) + torchao float8 tensorwise",
    "float8-rowwise": "pytorch + torch.compile (blocks) + torchao float8 rowwise",
    "jax-fp8": "jax + cudnn attention + fp8 tensorwise",
}


def peer_round(args, peer):
    """One run of a peer; a failing peer is reported and left out of that round."""
    try:
        if peer == "engine":
            return engine_round(args, args.set)
        if peer in ("jax", "jax-fp8"):
            return jax_round(args, args.set, "tensorwise" if peer == "jax-fp8" else None)
        if peer == "grouped-mm":
            return torch_round(args, args.set, "blocks", moe_layer="grouped-mm")
        if peer.startswith("float8-"):
            return torch_round(args, args.set, "blocks", float8=peer.split("-")[1])
        return torch_round(args, args.set, None if peer == "eager" else peer.split("-")[1])
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or "").strip().splitlines()[-3:]
        print(f"  {peer} failed (exit {e.returncode}): " + " | ".join(tail), file=sys.stderr, flush=True)
        return None


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
    ap.add_argument("--peers", default="engine,eager,compile-blocks,jax",
                    help="comma-separated, in the order run each round: " + ", ".join(PEERS))
    ap.add_argument("--jax-attention", default="cudnn", choices=["cudnn", "xla"],
                    help="the JAX peer's attention (xla on a CPU)")
    ap.add_argument("--json", help="write the rounds and the summary here")
    args = ap.parse_args()

    fpt = flops_per_token(args.engine, args.recipe, args.set)
    chosen = args.peers.split(",")
    unknown = [p for p in chosen if p not in PEERS]
    if unknown or "engine" not in chosen:
        ap.error(f"--peers: {', '.join(unknown) or 'engine missing'}; choose from {', '.join(PEERS)} (engine among them)")
    if args.jax_attention != "cudnn":
        PEERS["jax"] = f"jax + {args.jax_attention} attention"
        PEERS["jax-fp8"] = f"jax + {args.jax_attention} attention + fp8 tensorwise"
    peers = [PEERS[p] for p in chosen]
    rounds = {p: [] for p in peers}
    runs = []  # every run's own report (versions, peak memory, final loss)
    device, peak = "", 0.0

    def summarise(done):
        """The medians over the rounds done so far; written to --json after every round, so that a
        run cut short (a GPU slot ending) still leaves its figures."""
        engine_tps = statistics.median(rounds["engine"])
        summary = {}
        for p in peers:
            if not rounds[p]:
                continue
            tps = statistics.median(rounds[p])
            tflops = tps * fpt / 1e12
            mfu = tflops / peak if peak > 0 else 0.0
            summary[p] = {"tokens_per_s": tps, "tflops": tflops, "mfu": mfu, "engine_over_peer": engine_tps / tps,
                          "rounds": rounds[p]}
        others = [p for p in summary if p != "engine"]
        fastest = max(others, key=lambda p: summary[p]["tokens_per_s"]) if others else None
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"recipe": args.recipe, "set": args.set, "device": device, "peak_tflops": peak,
                           "flops_per_token": fpt, "date": datetime.date.today().isoformat(), "rounds_done": done,
                           "rounds_asked": args.rounds, "peers": summary, "fastest_peer": fastest, "runs": runs},
                          f, indent=2)
        return summary

    for i in range(args.rounds):
        print(f"round {i + 1}/{args.rounds}", file=sys.stderr)
        for key in chosen:
            r = peer_round(args, key)
            if r is None:
                continue
            if key == "engine":
                device, peak = r["device"], r["peak_tflops"]
            rounds[PEERS[key]].append(r["tokens_per_s"])
            runs.append(dict(r, round=i + 1, peer=PEERS[key]))
            print(f"  {PEERS[key]}: {r['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
        if not rounds["engine"]:
            sys.exit("the engine's run failed")
        summary = summarise(i + 1)

    print(f"\n{args.recipe} {' '.join(args.set)} on {device}, {args.rounds} interleaved rounds, "
          f"{datetime.date.today().isoformat()}")
    print(f"{'peer':<34} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7} {'engine / peer':>14}")
    for p in summary:
        r = summary[p]
        print(f"{p:<34} {r['tokens_per_s']:>12.0f} {r['tflops']:>9.1f} {100 * r['mfu']:>6.1f}% "
              f"{r['engine_over_peer']:>13.2f}x")
    others = [p for p in summary if p != "engine"]
    if others:
        fastest = max(others, key=lambda p: summary[p]["tokens_per_s"])
        print(f"fastest peer: {fastest}; the engine runs {summary[fastest]['engine_over_peer']:.2f}x its tokens/s")
    print(f"(FLOPs per token {fpt:.4e} by the engine's convention; peak {peak} TFLOP/s)")


if __name__ == "__main__":
    main()
