#!/usr/bin/env python3
"""Causal attention alone, forward and backward, as the peers run it, at a recipe's shapes:
PyTorch's SDPA on each of its fused back ends (FlashAttention-2, cuDNN, memory-efficient) and
JAX's `dot_product_attention` on cuDNN and on XLA. Prints one JSON line per implementation with
milliseconds and TFLOP/s per call; set beside the engine's own attention kernels in
`engine bench --profile` (its table gives the per-step time of all layers: divide by n_layers).
Decides issue 27's question "cuDNN or our own kernels" by measurement.

FLOPs by the engine's convention (recipes.md): forward 4·B·H·S²·D/2 under the causal mask (two
products, half the square), backward 2.5 times that (five products).

    python3 bench/attention_peers.py --recipe llama3.2-1b --set train.seq_len=4096 --set train.batch_size=4
    python3 bench/attention_peers.py --recipe tiny-llama2 --device cpu --only jax-xla   # a smoke test

Each framework runs in a process of its own (JAX would otherwise take most of the GPU's memory).
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_train import resolved_recipe  # noqa: E402

IMPLS = ["torch-flash", "torch-cudnn", "torch-efficient", "jax-cudnn", "jax-xla"]


def timed(fn, warmup, iters, sync, clock):
    """Median milliseconds of `fn` over `iters` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = clock()
        fn()
        sync()
        times.append((clock() - start) * 1e3)
    times.sort()
    return times[len(times) // 2]


def run_torch(impl, shape, device, warmup, iters):
    import time

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, hq, hkv, d = shape
    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION,
               "torch-efficient": SDPBackend.EFFICIENT_ATTENTION}[impl]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, hq, s, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    do = torch.randn(b, hq, s, d, device=device, dtype=dtype, generator=g)
    note = "grouped-query (enable_gqa)"
    with sdpa_kernel([backend]):
        def fwd():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        try:
            fwd()
        except RuntimeError:
            # A back end without grouped-query support: K and V repeated to every query head
            # once, outside the timing (the products and FLOPs are the same).
            kx = k.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_()
            vx = v.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_()
            note = "K, V repeated to every query head (no grouped-query support)"

            def fwd():
                return torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True)

        def both():
            fwd().backward(do)

        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        with torch.no_grad():
            f_ms = timed(fwd, warmup, iters, sync, time.perf_counter)
        fb_ms = timed(both, warmup, iters, sync, time.perf_counter)
    return f_ms, fb_ms, f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; {note}"


def run_jax(impl, shape, device, warmup, iters):
    import time

    import jax
    import jax.numpy as jnp

    b, s, hq, hkv, d = shape
    implementation = impl.split("-")[1]
    dtype = jnp.bfloat16 if device == "cuda" else jnp.float32
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (b, s, hq, d), dtype)
    k = jax.random.normal(keys[1], (b, s, hkv, d), dtype)
    v = jax.random.normal(keys[2], (b, s, hkv, d), dtype)
    do = jax.random.normal(keys[3], (b, s, hq, d), dtype)

    def attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    fwd = jax.jit(attention)

    @jax.jit
    def both(q, k, v, do):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(do)

    f_ms = timed(lambda: fwd(q, k, v).block_until_ready(), warmup, iters, lambda: None, time.perf_counter)
    fb_ms = timed(lambda: jax.block_until_ready(both(q, k, v, do)), warmup, iters, lambda: None, time.perf_counter)
    return f_ms, fb_ms, f"jax {jax.__version__}"


def child(args):
    shape = tuple(json.loads(args.shape))
    b, s, hq, _, d = shape
    fwd_flop = 4 * b * hq * s * s * d / 2
    run = run_torch if args.child.startswith("torch") else run_jax
    try:
        f_ms, fb_ms, versions = run(args.child, shape, args.device, args.warmup, args.iters)
    except Exception as e:  # one line per failing implementation; the others go on
        print(json.dumps({"impl": args.child, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}))
        return
    b_ms = fb_ms - f_ms
    print(json.dumps({"impl": args.child, "shape_b_s_hq_hkv_d": shape, "forward_ms": f_ms, "backward_ms": b_ms,
                      "forward_tflops": fwd_flop / f_ms / 1e9, "backward_tflops": 2.5 * fwd_flop / b_ms / 1e9,
                      "versions": versions}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe")
    ap.add_argument("--set", action="append", default=[], help="recipe override KEY=VALUE")
    ap.add_argument("--engine", default=os.path.join(HERE, "..", "target", "release", "engine"))
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--only", action="append", choices=IMPLS, help="run only these (repeatable)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", help="append the results here as JSON lines")
    ap.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if not args.recipe:
        ap.error("--recipe is required")
    recipe = resolved_recipe(args.engine, args.recipe, args.set)
    m, t = recipe["model"], recipe["train"]
    shape = [t["batch_size"], t["seq_len"], m["n_heads"], m["n_kv_heads"], m["head_dim"]]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    for impl in args.only or IMPLS:
        cmd = [sys.executable, __file__, "--child", impl, "--shape", json.dumps(shape), "--device", args.device,
               "--warmup", str(args.warmup), "--iters", str(args.iters)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else json.dumps(
            {"impl": impl, "error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]})
        result = dict(json.loads(line), recipe=args.recipe)
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
