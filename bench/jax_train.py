#!/usr/bin/env python3
"""The seeds' own stack as a peer of `engine bench`: a MaxText-style Llama training step in JAX
(XLA), with cuDNN's fused flash attention, and its step time printed as JSON.

MaxText's Llama recipe, reduced to what the engine's recipe names: f32 master weights with bf16
compute, the decoder layers stacked and run under `jax.lax.scan` (MaxText's `scan_layers`),
RMSNorm, RoPE with Llama 3 frequency scaling, grouped-query attention through
`jax.nn.dot_product_attention(..., implementation="cudnn")`, SwiGLU, tied or separate output
head, mean next-token cross-entropy in f32, global-norm clipping and AdamW (optax), one jitted
step with donated state. No recomputation (the engine's bench runs with `train.remat = none`
at the shapes compared). The model comes from the engine's resolved recipe, so both sides train
exactly the same shapes. Llama, Mistral (sliding window) and Mixtral: the experts dropless as
MaxText's `sparse_matmul` path runs them, the (token, slot) pairs sorted by expert and every
expert's product in one `jax.lax.ragged_dot` (group sizes from the routing), the load-balancing
loss as the engine's (Hugging Face's).

    python3 bench/jax_train.py --recipe llama3.2-1b --set train.seq_len=4096 --set train.batch_size=4
    python3 bench/jax_train.py --recipe tiny-llama2 --attention xla --steps 3   # on a CPU

With `--fp8 tensorwise` the decoder's linear layers (q, k, v, o, gate, up, down; not the
embedding, the head or the experts, as the engine's `train.precision = "fp8"`, and only where
both widths reach `train.fp8.min_dim` and are multiples of 16) take JAX's native FP8 path: each
operand cast to FP8 with its own amax and back (E4M3 for x and W, E5M2 for the output's
gradient, in a `jax.custom_vjp`), the quantize-dequantize pattern that XLA's GPU compiler turns
into cuBLASLt FP8 products with the scales in the epilogue, as flax's `fp8_ops` and MaxText's
`quantization = "fp8"` write it (they keep delayed scaling's amax history in the model's state;
here each cast takes its tensor's own amax, torchao's tensorwise recipe). On a CPU the same
graph runs as bf16 products of the rounded operands.

    python3 bench/jax_train.py --recipe tiny-llama2 --attention xla --steps 3 --fp8 tensorwise \
        --set train.fp8.min_dim=16

Each step ends by reading the loss back to the host, as the engine's logged loss does.
bench/compare.py runs this beside `engine bench` and the PyTorch peers.
"""

import argparse
import math
import os
import sys
import time

# XLA takes 75 % of the GPU's memory up front by default; the 1B step needs one 55 GiB buffer
# and failed on an 80 GB H100 with it (RESOURCE_EXHAUSTED, 2026-11-26). The engine may use all
# of the device, so the peer may too. Set before JAX is imported; a user's own setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import report, resolved_recipe  # noqa: E402  (plain Python: no torch import at module level)


def rope_frequencies(model, head_dim):
    """Inverse frequencies of the rotary embedding, with Llama 3's scaling when the recipe has it
    (the engine's model/rope.rs and transformers' `_compute_llama3_parameters`)."""
    import numpy as np

    inv = 1.0 / (model["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    s = model.get("rope_scaling")
    if not s:
        return inv
    low_wavelen = s["original_max_seq_len"] / s["low_freq_factor"]
    high_wavelen = s["original_max_seq_len"] / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    smooth = (s["original_max_seq_len"] / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    scaled = np.where(wavelen > low_wavelen, inv / s["factor"], inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(mid, (1 - smooth) * scaled / s["factor"] + smooth * scaled, scaled)


def init_params(key, model):
    import jax
    import jax.numpy as jnp

    d, hd, f, layers = model["d_model"], model["head_dim"], model["mlp_dim"], model["n_layers"]
    q, kv, vocab, std = model["n_heads"] * hd, model["n_kv_heads"] * hd, model["vocab_size"], model["init_std"]
    shapes = {"wq": (layers, d, q), "wk": (layers, d, kv), "wv": (layers, d, kv), "wo": (layers, q, d)}
    moe = model.get("moe")
    if moe:
        e = moe["num_experts"]
        shapes.update({"router": (layers, d, e), "w_gate_up": (layers, e, d, 2 * f), "w_down": (layers, e, f, d)})
    else:
        shapes.update({"w_gate": (layers, d, f), "w_up": (layers, d, f), "w_down": (layers, f, d)})
    keys = jax.random.split(key, len(shapes) + 2)
    params = {"layers": {name: std * jax.random.normal(k, shape, jnp.float32) for (name, shape), k in zip(shapes.items(), keys)}}
    params["layers"]["attn_norm"] = jnp.ones((layers, d), jnp.float32)
    params["layers"]["mlp_norm"] = jnp.ones((layers, d), jnp.float32)
    params["embed"] = std * jax.random.normal(keys[-2], (vocab, d), jnp.float32)
    params["final_norm"] = jnp.ones((d,), jnp.float32)
    if not model["tie_embeddings"]:
        params["head"] = std * jax.random.normal(keys[-1], (d, vocab), jnp.float32)
    return params


def fp8_linear():
    """`x @ w` with both operands, and in the backward pass the output's gradient, cast to FP8
    with their own amax (tensorwise scaling) and back to bf16: the quantize-dequantize pattern
    that XLA's GPU compiler rewrites into cuBLASLt FP8 products (E4M3 operands forward, E5M2
    gradients backward), as flax's `fp8_ops` do."""
    import jax
    import jax.numpy as jnp

    bf16 = jnp.bfloat16

    def qdq(x, dtype):
        top = float(jnp.finfo(dtype).max)
        amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
        scale = jnp.where(amax > 0, top / amax, 1.0)
        q = jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(dtype)
        return q.astype(bf16) * (1.0 / scale).astype(bf16)

    @jax.custom_vjp
    def linear(x, w):
        return qdq(x, jnp.float8_e4m3fn) @ qdq(w, jnp.float8_e4m3fn)

    def forward(x, w):
        xq, wq = qdq(x, jnp.float8_e4m3fn), qdq(w, jnp.float8_e4m3fn)
        return xq @ wq, (xq, wq)

    def backward(saved, g):
        xq, wq = saved
        gq = qdq(g, jnp.float8_e5m2)
        return gq @ wq.T, jnp.einsum("...i,...o->io", xq, gq)

    linear.defvjp(forward, backward)
    return linear


def make_loss(model, attention, seq_len, fp8=None, min_dim=0):
    import jax
    import jax.numpy as jnp

    hd, heads, kv_heads, eps = model["head_dim"], model["n_heads"], model["n_kv_heads"], model["norm_eps"]
    window = model.get("sliding_window") or 0
    inv = jnp.asarray(rope_frequencies(model, hd), jnp.float32)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    bf16 = jnp.bfloat16

    def rms_norm(x, w):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * w).astype(bf16)

    def rope(x):  # [B, T, N, hd], "rotate half" layout
        x32 = x.astype(jnp.float32)
        a, b = jnp.split(x32, 2, axis=-1)
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1).astype(bf16)

    moe = model.get("moe")
    fp8_mm = fp8_linear() if fp8 else None

    def dense(x, w):
        """A decoder linear layer: in FP8 where `--fp8` asks and its widths qualify."""
        i, o = w.shape
        if fp8_mm is None or min(i, o) < min_dim or i % 16 or o % 16:
            return x @ w
        return fp8_mm(x, w)

    def experts(h, w):
        """Mixtral's sparse MLP, dropless: softmax over the experts, the top k renormalised, the
        (token, slot) pairs sorted by expert, each expert's SwiGLU through `ragged_dot` over its
        group; returns the output and the layer's load-balancing statistics."""
        b, t, d = h.shape
        e, k = moe["num_experts"], moe["top_k"]
        rows = h.reshape(b * t, d)
        probs = jax.nn.softmax((rows @ w["router"]).astype(jnp.float32), axis=-1)  # [N, E]
        top_p, top_e = jax.lax.top_k(probs, k)  # ties to the lower index, as the engine's
        weights = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        flat = top_e.reshape(-1)  # slot t·k + j
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        xs = rows[order // k]  # [N·k, d] grouped by expert
        gu = jax.lax.ragged_dot(xs, w["w_gate_up"], sizes)  # [N·k, 2F]
        gate, up = jnp.split(gu, 2, axis=-1)
        ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w["w_down"], sizes)  # [N·k, d]
        ys = jnp.zeros_like(ys).at[order].set(ys).reshape(b * t, k, d)
        out = jnp.einsum("nkd,nk->nd", ys.astype(jnp.float32), weights).astype(bf16)
        # The engine's aux loss: E · Σ_e f_e · P_e over all layers; per layer the sums.
        return out.reshape(b, t, d), (sizes.astype(jnp.float32), jnp.sum(probs, axis=0))

    def layer(x, w):
        w = jax.tree.map(lambda p: p.astype(bf16), w)
        b, t, _ = x.shape
        h = rms_norm(x, w["attn_norm"])
        q = rope(dense(h, w["wq"]).reshape(b, t, heads, hd))
        k = rope(dense(h, w["wk"]).reshape(b, t, kv_heads, hd))
        v = dense(h, w["wv"]).reshape(b, t, kv_heads, hd)
        window_arg = {"local_window_size": (window - 1, 0)} if window else {}
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention, **window_arg)
        x = x + dense(o.reshape(b, t, heads * hd), w["wo"])
        h = rms_norm(x, w["mlp_norm"])
        if moe:
            y, stats = experts(h, w)
            return x + y, stats
        x = x + dense(jax.nn.silu(dense(h, w["w_gate"])) * dense(h, w["w_up"]), w["w_down"])
        return x, None

    def loss_fn(params, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = params["embed"].astype(bf16)[inputs]
        x, stats = jax.lax.scan(layer, x, params["layers"])
        x = rms_norm(x, params["final_norm"])
        head = params["head"] if "head" in params else params["embed"].T
        logits = (x @ head.astype(bf16)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        loss = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
        if moe:
            counts, prob_sums = (jnp.sum(s, axis=0) for s in stats)  # over the layers
            total = model["n_layers"] * inputs.size
            aux = moe["num_experts"] * jnp.sum(counts * prob_sums) / total**2
            loss = loss + moe["aux_loss_coef"] * aux
        return loss

    return loss_fn


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--set", action="append", default=[], help="recipe override KEY=VALUE")
    ap.add_argument("--engine", default=os.path.join(here, "..", "target", "release", "engine"))
    ap.add_argument("--attention", default="cudnn", choices=["cudnn", "xla"],
                    help="jax.nn.dot_product_attention's implementation (cudnn needs a GPU)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps before measuring (XLA compiles in the first)")
    ap.add_argument("--fp8", choices=["tensorwise"], default=None,
                    help="the decoder's linear layers through JAX's FP8 quantize-dequantize path (train.fp8.min_dim applies)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import optax

    recipe = resolved_recipe(args.engine, args.recipe, args.set)
    model, train, optim = recipe["model"], recipe["train"], recipe["optim"]
    if model["family"] not in ("llama", "mistral", "mixtral"):
        sys.exit(f"bench/jax_train.py: the {model['family']} family is not written in JAX here (llama, mistral, mixtral are)")
    if (model.get("moe") or {}).get("capacity_factor"):
        sys.exit("bench/jax_train.py: the Mixtral peer is dropless; leave model.moe.capacity_factor out")
    batch, seq, accum = train["batch_size"], train["seq_len"], train.get("grad_accum", 1)

    params = init_params(jax.random.PRNGKey(train["seed"]), model)
    tx = optax.chain(
        optax.clip_by_global_norm(optim["grad_clip"]) if optim["grad_clip"] > 0 else optax.identity(),
        optax.adamw(optim["lr"], b1=optim["beta1"], b2=optim["beta2"], eps=optim["eps"],
                    weight_decay=optim["weight_decay"]),
    )
    opt_state = tx.init(params)
    min_dim = (train.get("fp8") or {}).get("min_dim", 0)
    grad_fn = jax.value_and_grad(make_loss(model, args.attention, seq, args.fp8, min_dim))

    def step(params, opt_state, tokens):  # tokens: [accum, B, T+1]
        def micro(carry, toks):
            loss, grads = grad_fn(params, toks)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(micro, zero, tokens)
        grads = jax.tree.map(lambda g: g / accum, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / accum

    step = jax.jit(step, donate_argnums=(0, 1))
    key = jax.random.PRNGKey(0)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        key, sub = jax.random.split(key)
        tokens = jax.random.randint(sub, (accum, batch, seq + 1), 0, model["vocab_size"], jnp.int32)
        tokens.block_until_ready()
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens)
        loss = float(loss)  # waits for the device, like the engine's logged loss
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed)
            losses.append(loss)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    report(
        {
            "peer": f"jax + {args.attention} attention" + (" + ragged_dot experts" if model.get("moe") else "")
            + (f" + fp8 {args.fp8}" if args.fp8 else ""),
            "jax": jax.__version__,
            "recipe": args.recipe,
            "device": getattr(device, "device_kind", str(device)),
        },
        batch * seq * accum,
        times,
        losses,
        stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None,
    )

if __name__ == "__main__":
    main()
