#!/usr/bin/env python3
"""Convergence evidence: the engine's loss curve against a PyTorch reference (issue 34).

Both runs start from the same weights and see the same batches in the same order:

- weights: the reference builds the Hugging Face model of the engine's resolved recipe
  (bench/torch_train.py's `hf_config`), initialised by transformers from `train.seed`, and saves
  it (`OUT/init/`, f32 safetensors); the engine starts from that directory with
  `engine train --init-from-hf` (docs/hf.md). `--set model.*` keys shape that model, so they
  reach the engine through `config.json`, not as `--set` (which `--init-from-hf` refuses).
- batches: this script reads the engine's own data (`data.source` = `embedded`, `synthetic` or
  `shards`, one source) and cuts it as engine/src/data/mod.rs's loader does: windows of
  `train.seq_len + 1` tokens, the last 5 % held out (none with `data.validation_path`), the
  others visited in `rng::permutation(train_windows, train.seed, 0xda7a ^ epoch)`'s order
  (Fisher-Yates driven by SplitMix64, engine/src/rng.rs), `train.batch_size` windows per
  micro-batch, `train.grad_accum` micro-batches per step.
- loss and optimizer, as engine/src/train and engine/src/backend/cpu/adamw.rs compute them: the
  mean next-token cross-entropy of each micro-batch (in f32), divided by `grad_accum`; the global
  gradient norm clipped to `optim.grad_clip` by `min(1, clip / norm)` (the engine adds no 1e-6 as
  `clip_grad_norm_` does, so the clip is written out); `torch.optim.AdamW` with the recipe's
  betas and eps, weight decay on matrices only (embeddings, projections, head: every parameter
  of two or more dimensions; norms and biases do not decay, engine/src/model/layout.rs); the
  learning rate of engine/src/train/schedule.rs (linear warmup `lr·(s+1)/warmup`, then cosine to
  `lr·min_lr_ratio` at `decay_steps`, or constant), rounded to f32 as the engine passes it.

The reference runs in f32 on the CPU (the engine's CPU backend is exact f32 too, so the curves
should agree to about 1e-4) and, on CUDA, in bf16 autocast over f32 master weights (as the
engine's bf16 keeps f32 masters), SDPA attention. `--precision fp8` trains the engine in FP8
(`train.precision = "fp8"`); the reference stays bf16/f32: it is the curve FP8 must follow.

Outputs in `--out DIR` (created; must be empty or absent):

    init/              the initial weights both start from (a Hugging Face model directory)
    engine-PRECISION/  the engine's run directory (metrics.jsonl, config.toml, summary.json)
    pytorch-f32/       (pytorch-bf16/ on CUDA) the reference's curve as a run directory:
                       metrics.jsonl in the engine's format (step, loss, lr, grad_norm,
                       step_time_s, tokens_per_s), for `engine plot`
    curves.json        both curves and the figures below
    loss.png           `engine plot engine-PRECISION pytorch-f32 --out loss.png` (the directories'
                       names are the legend)

It prints the first losses, the mean loss of the last 50 steps (fewer when the run is shorter) of
each, and their relative difference `|engine − reference| / reference`, and exits 1 when that
exceeds `--tolerance`.

Options (defaults in brackets):

    --recipe NAME|FILE    the engine recipe (required)
    --set KEY=VALUE       recipe override, repeatable, for both runs
    --steps N             optimizer steps [200]
    --precision P         bf16 | fp8, the engine's train.precision [bf16]
    --device D            cpu | cuda, for both runs [cpu]
    --threads N           CPU threads for both runs [all cores]
    --out DIR             where everything goes [runs/converge]
    --tolerance X         largest relative difference of the last-50 means accepted [0.01]
    --engine PATH         the engine binary [target/release/engine]
    --self-test           check the data order, RNG and schedule helpers in pure Python, and exit

Torch and transformers are needed (not part of the test suite). On the CPU:

    python3 -m venv target/converge-venv
    target/converge-venv/bin/pip install torch transformers
    cargo build --release --locked -p engine --bin engine
    target/converge-venv/bin/python bench/converge.py --recipe tiny-llama2 \\
        --set model.vocab_size=512 --set model.d_model=64 --set model.n_heads=2 \\
        --set model.n_kv_heads=2 --set model.head_dim=32 --set model.mlp_dim=128 \\
        --set train.seq_len=32 --set train.batch_size=4 --set optim.warmup_steps=10 \\
        --steps 200 --tolerance 1e-4 --out runs/converge-cpu

(PyTorch's own CPU-only wheel index, where it is reachable, gives a much smaller torch than
PyPI's, which brings the CUDA libraries along: about 10 minutes to install here.) On a GPU, issue
34's run:

    python3 bench/converge.py --recipe llama3.2-1b --device cuda --precision fp8 \\
        --set train.seq_len=1024 --set train.batch_size=8 --set data.source=shards \\
        --set data.path=data/shards --steps 1000 --out runs/converge-fp8

Errors in what it is given (a recipe the engine refuses, a mixture, document masking, an --out
that holds files, torch missing) are one line with exit code 2.
"""

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_train import hf_config, resolved_recipe  # noqa: E402  (the PyTorch peer's model and recipe)

MASK64 = (1 << 64) - 1
VALIDATION_FRACTION = 0.05  # engine/src/data/mod.rs
ORDER_STREAM = 0xDA7A  # the loader's permutation stream
SYNTHETIC_STREAM = 0x5EED
SHARD_HEADER = 64  # docs/data.md, "Shard format"
LAST = 50  # steps whose mean loss is compared


def fail(message, code=2):
    print(f"bench/converge.py: {message}", file=sys.stderr)
    sys.exit(code)


# --- engine/src/rng.rs -------------------------------------------------------------------------


def mix(z):
    """SplitMix64's finaliser."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def bits(seed, stream, counter):
    return mix(mix(mix(seed) ^ stream) ^ counter)


def permutation(n, seed, stream):
    """rng::permutation: Fisher-Yates from the end, j = bits(seed, stream, i) mod (i + 1)."""
    p = list(range(n))
    for i in range(n - 1, 0, -1):
        j = bits(seed, stream, i) % (i + 1)
        p[i], p[j] = p[j], p[i]
    return p


# --- engine/src/data -----------------------------------------------------------------------------


class Tokens:
    """The engine's token stream for a data config: `len(self)` tokens, `read(start, n)`."""

    def __init__(self, data, vocab_size, seed, repo):
        source = data.get("source", "embedded")
        self.kind = source
        if data.get("mixture"):
            fail("data.mixture is not supported: the reference reads one source (set data.path)")
        if data.get("document_mask"):
            fail("data.document_mask = true is not supported: the reference's attention has no document mask")
        if source == "embedded":
            with open(os.path.join(repo, "engine", "data", "shakespeare.txt"), "rb") as f:
                self.bytes = f.read()
            self.length = len(self.bytes)
        elif source == "synthetic":
            self.vocab, self.seed, self.length = vocab_size, seed, 1 << 24
        elif source == "shards":
            self.shards = shard_files(data.get("path", ""))
            self.starts, total = [], 0
            for path, width, count in self.shards:
                self.starts.append(total)
                total += count
            self.length = total
        else:
            fail(f"data.source = {source!r}: expected embedded, synthetic or shards")

    def __len__(self):
        return self.length

    def read(self, start, n):
        if self.kind == "embedded":
            return list(self.bytes[start : start + n])
        if self.kind == "synthetic":
            return [bits(self.seed, SYNTHETIC_STREAM, start + i) % self.vocab for i in range(n)]
        out = []
        pos = start
        while len(out) < n:
            i = max(k for k, s in enumerate(self.starts) if s <= pos)
            path, width, count = self.shards[i]
            offset = pos - self.starts[i]
            take = min(count - offset, n - len(out))
            with open(path, "rb") as f:
                f.seek(SHARD_HEADER + offset * width)
                raw = f.read(take * width)
            out += struct.unpack(f"<{take}{'H' if width == 2 else 'I'}", raw)
            pos += take
        return out


def shard_files(path):
    """(file, bytes per token, tokens) of data.path: a shard, or a directory's *.tok in name order."""
    if not path:
        fail("data.source = \"shards\" needs data.path")
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(".tok"))
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    if not files:
        fail(f"data.path = {path}: no *.tok shards there")
    out = []
    for file in files:
        try:
            with open(file, "rb") as f:
                header = f.read(SHARD_HEADER)
        except OSError as e:
            fail(f"data.path = {path}: {file}: {e.strerror}")
        if len(header) < SHARD_HEADER or header[:8] != b"LLMDTOKS":
            fail(f"{file}: not a token shard (no LLMDTOKS header)")
        width, count = struct.unpack_from("<IQ", header, 12)
        out.append((file, width, count))
    return out


class Loader:
    """engine/src/data/mod.rs's Loader for one source on one device: windows of seq + 1 tokens,
    a held-out tail, a seeded order per epoch."""

    def __init__(self, tokens, seq, seed, own_validation):
        self.tokens, self.seq, self.seed = tokens, seq, seed
        windows = max(len(tokens) - 1, 0) // seq
        val = 0 if own_validation else min(math.ceil(windows * VALIDATION_FRACTION), max(windows - 1, 0))
        self.train_windows = windows - val
        if self.train_windows < 1:
            fail(f"the data holds {len(tokens)} tokens, too few for one sample of train.seq_len + 1 = {seq + 1}")
        self.epoch, self.index = 0, 0
        self.order = permutation(self.train_windows, seed, ORDER_STREAM ^ self.epoch)

    def window(self):
        """The next sample's window index (one device: world = 1)."""
        if self.index + 1 > self.train_windows:
            self.epoch, self.index = self.epoch + 1, 0
            self.order = permutation(self.train_windows, self.seed, ORDER_STREAM ^ self.epoch)
        w = self.order[self.index]
        self.index += 1
        return w

    def batch(self, rows):
        """`rows` samples of seq + 1 tokens (inputs, and targets one token on)."""
        return [self.tokens.read(self.window() * self.seq, self.seq + 1) for _ in range(rows)]


# --- engine/src/train/schedule.rs ----------------------------------------------------------------


def learning_rate(optim, total_steps, step):
    """The learning rate of 0-based optimizer step `step`."""
    warmup = optim["warmup_steps"]
    if step < warmup:
        return optim["lr"] * (step + 1) / warmup
    if optim["schedule"] == "constant":
        return optim["lr"]
    end = optim["decay_steps"] or total_steps
    span = max(end - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    low = optim["lr"] * optim["min_lr_ratio"]
    return low + (optim["lr"] - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def f32(x):
    """`x` rounded to f32, as the engine hands the learning rate to AdamW."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def last_mean(losses):
    tail = losses[-LAST:]
    return sum(tail) / len(tail)


def self_test():
    """Pure-Python checks of the helpers against values the engine's own tests state."""
    # SplitMix64 seeded with 0: its first output, a published test vector.
    assert mix(0) == 0xE220A8397B1DCDAF, hex(mix(0))
    p = permutation(1000, 3, 0)
    assert sorted(p) == list(range(1000)) and p != permutation(1000, 4, 0)
    # engine/src/train/schedule.rs's unit test.
    o = dict(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule="cosine", decay_steps=0)
    assert [learning_rate(o, 14, s) for s in (0, 1, 3, 4)] == [0.25, 0.5, 1.0, 1.0]
    assert abs(learning_rate(o, 14, 9) - 0.55) < 1e-12
    assert abs(learning_rate(o, 14, 14) - 0.1) < 1e-12 and abs(learning_rate(o, 14, 100) - 0.1) < 1e-12
    assert learning_rate(dict(o, schedule="constant"), 14, 10) == 1.0
    # The loader: every window once per epoch, targets one token on.
    class Seq:
        def __len__(self):
            return 1001

        def read(self, start, n):
            return list(range(start, start + n))

    loader = Loader(Seq(), 10, 7, False)
    assert loader.train_windows == 100 - 5
    first = [loader.batch(1)[0] for _ in range(loader.train_windows)]
    assert sorted(w[0] // 10 for w in first) == list(range(95)) and all(w[1:] == [x + 1 for x in w[:-1]] for w in first)
    assert loader.batch(1)[0][0] // 10 == permutation(95, 7, ORDER_STREAM ^ 1)[0]
    print("bench/converge.py: self-test passed")


# --- the runs ------------------------------------------------------------------------------------


def split_sets(sets):
    """`--set`s for the engine: model.* ones are in the initial model's config.json instead."""
    for s in sets:
        if "=" not in s:
            fail(f"--set {s}: expected KEY=VALUE")
    return [s for s in sets if not s.split("=", 1)[0].strip().startswith("model.")]


def open_loader(recipe):
    """The engine's loader over the recipe's data, checked before anything is written."""
    data, train = recipe["data"], recipe["train"]
    tokens = Tokens(data, recipe["model"]["vocab_size"], train["seed"], os.path.dirname(HERE))
    return Loader(tokens, train["seq_len"], train["seed"], bool(data.get("validation_path")))


def reference(recipe, args, loader, init_dir):
    """Saves the initial model to `init_dir` and trains it on `loader`'s batches; returns the
    per-step records."""
    import torch
    import transformers

    model_cfg, train, optim = recipe["model"], recipe["train"], recipe["optim"]
    cuda = args.device == "cuda"
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(train["seed"])
    config = hf_config(model_cfg)
    config._attn_implementation = "sdpa" if cuda else "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(init_dir, safe_serialization=True)
    model = model.to(args.device)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [dict(params=decay, weight_decay=optim["weight_decay"]), dict(params=keep, weight_decay=0.0)],
        lr=optim["lr"],
        betas=(optim["beta1"], optim["beta2"]),
        eps=optim["eps"],
        foreach=False,
    )
    vocab, rows, accum = model_cfg["vocab_size"], train["batch_size"], train.get("grad_accum", 1)
    clip = optim["grad_clip"]
    records = []
    for step in range(args.steps):
        start = time.perf_counter()
        total = 0.0
        for _ in range(accum):
            ids = torch.tensor(loader.batch(rows), dtype=torch.long, device=args.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                logits = model(input_ids=ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids[:, 1:].reshape(-1)) / accum
            loss.backward()
            total += loss.item()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        if clip > 0 and norm > clip:
            for g in grads:
                g.mul_(f32(clip) / f32(norm))
        lr = f32(learning_rate(optim, args.steps, step))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        records.append(
            dict(step=step + 1, loss=total, lr=lr, grad_norm=norm, step_time_s=elapsed,
                 tokens_per_s=rows * accum * train["seq_len"] / elapsed)
        )
    return records


def run_engine(args, sets, init_dir, run_dir):
    cmd = [args.engine, "train", "--recipe", args.recipe, "--device", args.device, "--steps", str(args.steps),
           "--init-from-hf", init_dir, "--run-dir", run_dir]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    for s in sets + [f"train.precision={args.precision}"]:
        cmd += ["--set", s]
    print("+ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no message)"]
        fail(f"engine train failed (exit {done.returncode}): {lines[-1]}", 2 if done.returncode == 2 else 1)
    print("\n".join(l for l in done.stdout.splitlines() if l.startswith(("training", "done", "fp8", "FP8"))), flush=True)
    records = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            records[r["step"]] = r
    return [records[s] for s in sorted(records)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe")
    ap.add_argument("--set", action="append", default=[], help="recipe override KEY=VALUE (both runs)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=os.path.join("runs", "converge"))
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--engine", default=os.path.join(HERE, "..", "target", "release", "engine"))
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if not args.recipe:
        ap.error("--recipe is required")
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: must be at least 1")
    if not (args.tolerance >= 0):
        ap.error(f"--tolerance {args.tolerance}: must be a non-negative number")
    if not os.access(args.engine, os.X_OK):
        fail(f"no engine binary at {args.engine}: build it (cargo build --release --locked -p engine --bin engine) or pass --engine")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        fail(f"{e.name} is not installed in {sys.executable}: python3 -m venv target/converge-venv && "
             "target/converge-venv/bin/pip install torch transformers, then run with target/converge-venv/bin/python")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: torch sees no CUDA device")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        fail(f"--out {args.out} exists and is not an empty directory; choose another")
    try:
        recipe = resolved_recipe(args.engine, args.recipe, args.set)
    except subprocess.CalledProcessError as e:
        lines = (e.stderr or "").strip().splitlines() or ["(no message)"]
        fail(f"engine recipes show {args.recipe}: {lines[-1]}")
    if recipe["model"].get("moe"):
        fail("Mixtral recipes are not supported: the reference's router and load-balancing loss are not matched to the engine's")
    loader = open_loader(recipe)
    os.makedirs(args.out, exist_ok=True)
    reference_kind = "bf16" if args.device == "cuda" else "f32"
    # The directories' names are the plot's legend.
    init_dir, engine_dir, torch_dir = (
        os.path.join(args.out, d) for d in ("init", f"engine-{args.precision}", f"pytorch-{reference_kind}")
    )
    torch.set_num_threads(args.threads)

    ref = reference(recipe, args, loader, init_dir)
    os.makedirs(torch_dir)
    with open(os.path.join(torch_dir, "metrics.jsonl"), "w") as f:
        for r in ref:
            f.write(json.dumps(r) + "\n")
    eng = run_engine(args, split_sets(args.set), init_dir, engine_dir)
    if len(eng) != args.steps:
        fail(f"the engine logged {len(eng)} steps, not {args.steps}", 1)

    e_losses, r_losses = [r["loss"] for r in eng], [r["loss"] for r in ref]
    e_mean, r_mean = last_mean(e_losses), last_mean(r_losses)
    rel = abs(e_mean - r_mean) / abs(r_mean)
    result = dict(
        recipe=args.recipe,
        sets=args.set,
        steps=args.steps,
        device=args.device,
        engine_precision=args.precision,
        reference=f"PyTorch {torch.__version__}, transformers {transformers.__version__}, "
        + ("bf16 autocast over f32 masters" if args.device == "cuda" else "f32"),
        first_loss=dict(engine=e_losses[0], pytorch=r_losses[0]),
        last_steps=min(LAST, args.steps),
        mean_last=dict(engine=e_mean, pytorch=r_mean),
        relative_difference=rel,
        max_step_relative_difference=max(abs(a - b) / abs(b) for a, b in zip(e_losses, r_losses)),
        tolerance=args.tolerance,
        curves=dict(engine=e_losses, pytorch=r_losses),
    )
    with open(os.path.join(args.out, "curves.json"), "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.join(args.out, "loss.png")
    title = f"{args.recipe}: engine {args.precision} vs PyTorch {reference_kind} ({args.device})"
    plot = subprocess.run([args.engine, "plot", engine_dir, torch_dir, "--out", png, "--title", title],
                          capture_output=True, text=True)
    if plot.returncode != 0:
        fail(f"engine plot failed: {plot.stderr.strip()}", 1)

    print(f"first loss: engine {e_losses[0]:.6f}, pytorch {r_losses[0]:.6f}")
    print(f"mean loss of the last {result['last_steps']} steps: engine {e_mean:.6f}, pytorch {r_mean:.6f}")
    print(f"relative difference: {rel:.3e} (tolerance {args.tolerance:g}); largest at one step "
          f"{result['max_step_relative_difference']:.3e}")
    print(f"wrote {os.path.join(args.out, 'curves.json')} and {png}")
    if rel > args.tolerance:
        print(f"bench/converge.py: the relative difference {rel:.3e} exceeds --tolerance {args.tolerance:g}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
