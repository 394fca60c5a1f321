#!/usr/bin/env python3
"""The PyTorch peer of `engine bench`: trains the same architecture with Hugging Face
transformers and torch.optim.AdamW, and prints its step time as JSON.

The model comes from the engine's own resolved recipe (`engine recipes show`), so both sides
train exactly the same shapes: batch, sequence, gradient accumulation. CPU: f32, eager, the
given thread count. CUDA: bf16 weights and activations, SDPA attention, fused AdamW, eager or
torch.compile: `--compile blocks` as torchtitan does (each decoder layer compiled on its own,
`fullgraph=True`) or `--compile whole` (the forward
pass and the loss compiled together, as first measured). The loss is the mean next-token
cross-entropy (plus the load-balancing term for Mixtral, Qwen3-MoE and GPT-OSS), as the engine
computes it. Each step ends with `loss.item()`, which waits for the GPU, as the engine's logged
loss does.

    python3 bench/torch_train.py --recipe tiny-llama2 --threads 2
    python3 bench/torch_train.py --recipe gpt-126m --set train.seq_len=256 --threads 2   # GPT2LMHeadModel
    python3 bench/torch_train.py --recipe llama3.2-1b --device cuda --compile blocks --set train.seq_len=4096
    python3 bench/torch_train.py --recipe mixtral-8x7b --set model.n_layers=2 --device cuda --moe-layer grouped-mm --compile blocks

A Mixtral recipe trains transformers' `MixtralForCausalLM` (its experts one by one, as users
start from), or with `--moe-layer grouped-mm` bench/torch_moe.py's torchtitan-style model (the
experts' products in `torch._grouped_mm`).

A GPT-OSS recipe trains transformers' `GptOssForCausalLM` with eager attention on every device:
transformers has no SDPA path for it (the learned sinks are a logit column SDPA cannot take), and
its flex-attention path for sinks runs on CUDA only. Its experts run as transformers' default
runs them (`grouped_mm` in transformers 5: the (token, expert) rows sorted by expert through two
`torch._grouped_mm` products with the per-expert biases), recorded as `experts_implementation`;
`--moe-layer grouped-mm` is refused for it (bench/torch_moe.py has SDPA attention: no sinks, no
sliding window, no YaRN).

    python3 bench/torch_train.py --recipe tiny-gpt-oss --threads 2 --compile blocks

A Gemma 3 recipe (`model.family = "gemma3"`) trains transformers' `Gemma3ForCausalLM`, the text
model (`Gemma3TextConfig`: sliding-window and global layers from `window_pattern`, RoPE per layer
type, `query_pre_attn_scalar`, `final_logit_softcapping`), SDPA attention on CUDA as the dense
families; its parameter count is checked against the engine's (`parameters` in the JSON).

    python3 bench/torch_train.py --recipe tiny-gemma3 --threads 2 --compile blocks

bench/compare.py runs this and `engine bench` side by side.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib


def resolved_recipe(engine, recipe, sets):
    """The engine's resolved recipe as a dict (the TOML part of `engine recipes show`)."""
    cmd = [engine, "recipes", "show", recipe]
    for s in sets:
        cmd += ["--set", s]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return tomllib.loads(text.split("\n# size")[0])


def engine_parameters(engine, recipe, sets):
    """The engine's parameter count of the resolved recipe (`parameters` under `# size` in
    `engine recipes show`)."""
    import re

    cmd = [engine, "recipes", "show", recipe]
    for s in sets:
        cmd += ["--set", s]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    m = re.search(r"^parameters\s+([0-9,]+)", text.split("\n# size")[1], re.M)
    return int(m.group(1).replace(",", ""))


def report(about, tokens, times, losses, peak_memory_gib):
    """Prints a peer's result as one JSON line: `about` (peer, versions, recipe, device) and the
    step figures bench/compare.py reads."""
    median = statistics.median(times)
    json.dump(
        dict(
            about,
            tokens_per_step=tokens,
            median_step_time_s=median,
            tokens_per_s=tokens / median,
            final_loss=losses[-1],
            peak_memory_gib=peak_memory_gib,
        ),
        sys.stdout,
    )
    print()


def hf_config(model):
    """A transformers config for the engine's model section."""
    import transformers

    if model["family"] == "gpt":
        # GPT2LMHeadModel: LayerNorm, learned positions, biases, a 4·d GELU MLP; no dropout.
        return transformers.GPT2Config(
            vocab_size=model["vocab_size"],
            n_embd=model["d_model"],
            n_layer=model["n_layers"],
            n_head=model["n_heads"],
            n_inner=model["mlp_dim"],
            n_positions=model["max_seq_len"],
            layer_norm_epsilon=model["norm_eps"],
            activation_function="gelu" if model.get("gelu") == "erf" else "gelu_new",
            tie_word_embeddings=model["tie_embeddings"],
            initializer_range=model["init_std"],
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    common = dict(
        vocab_size=model["vocab_size"],
        hidden_size=model["d_model"],
        intermediate_size=model["mlp_dim"],
        num_hidden_layers=model["n_layers"],
        num_attention_heads=model["n_heads"],
        num_key_value_heads=model["n_kv_heads"],
        head_dim=model["head_dim"],
        rms_norm_eps=model["norm_eps"],
        max_position_embeddings=model["max_seq_len"],
        tie_word_embeddings=model["tie_embeddings"],
        initializer_range=model["init_std"],
        attention_dropout=0.0,
    )
    rope = {"rope_type": "default", "rope_theta": model["rope_theta"]}
    scaling = model.get("rope_scaling")
    if scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": model["rope_theta"],
            "factor": scaling["factor"],
            "low_freq_factor": scaling["low_freq_factor"],
            "high_freq_factor": scaling["high_freq_factor"],
            "original_max_position_embeddings": scaling["original_max_seq_len"],
        }
    family = model["family"]
    if family == "llama":
        return transformers.LlamaConfig(rope_parameters=rope, **common)
    window = model["sliding_window"] or None
    if family == "mistral":
        return transformers.MistralConfig(rope_parameters=rope, sliding_window=window, **common)
    if family == "gpt_oss":
        return gpt_oss_config(model, common)
    if family == "gemma3":
        return gemma3_config(model, common)
    if family in ("qwen3", "qwen3_moe") and window:
        sys.exit(f"bench/torch_train.py: model.sliding_window = {window} on {family} is not written here")
    if family == "qwen3":
        # Qwen3ForCausalLM: Llama's layer with an RMSNorm over each query and key head (QK-norm)
        # before RoPE, and a head_dim of its own (not d_model / heads).
        return transformers.Qwen3Config(rope_parameters=rope, use_sliding_window=False, **common)
    moe = model.get("moe")
    if family not in ("mixtral", "qwen3_moe") or not moe:
        sys.exit(f"bench/torch_train.py: model.family = {family!r} is not written here")
    if family == "mixtral":
        return transformers.MixtralConfig(
            rope_parameters=rope,
            sliding_window=window,
            num_local_experts=moe["num_experts"],
            num_experts_per_tok=moe["top_k"],
            router_aux_loss_coef=moe["aux_loss_coef"],
            output_router_logits=True,
            **common,
        )
    check_softmax_routing(moe)
    # Qwen3MoeForCausalLM: Qwen3's attention, a softmax router over every expert, the top k
    # renormalised or not (norm_topk_prob), experts of moe_intermediate_size; the layers in
    # mlp_only_layers keep a dense MLP of intermediate_size. Qwen3MoeConfig has no head_dim
    # argument of its own (the attention reads `config.head_dim`, else d_model / heads); the
    # keyword is kept on the config as the hub's configs have it.
    dense = list(moe.get("dense_layers") or [])
    common = dict(common, intermediate_size=moe["dense_mlp_dim"] if dense else model["mlp_dim"])
    return transformers.Qwen3MoeConfig(
        rope_parameters=rope,
        use_sliding_window=False,
        num_experts=moe["num_experts"],
        num_experts_per_tok=moe["top_k"],
        moe_intermediate_size=model["mlp_dim"],
        norm_topk_prob=moe["renormalize"],
        decoder_sparse_step=1,
        mlp_only_layers=dense,
        router_aux_loss_coef=moe["aux_loss_coef"],
        output_router_logits=True,
        **common,
    )


def gpt_oss_config(model, common):
    """GptOssConfig for the engine's `gpt_oss` model: biases on q, k, v and o, a learned sink per
    query head, sliding-window layers among full ones (`layer_types`, from the recipe's
    `window_pattern` or `layer_types` as the engine's export-hf writes them), YaRN, a biased
    router whose top k logits are softmaxed (the engine's `renormalize = true`), experts of
    `mlp_dim` with biases and the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`)."""
    import transformers

    moe = model.get("moe")
    if not moe:
        sys.exit("bench/torch_train.py: model.family = 'gpt_oss' needs model.moe")
    check_softmax_routing(moe)
    if not moe["renormalize"] or moe.get("dense_layers"):
        sys.exit("bench/torch_train.py: GptOssForCausalLM softmaxes the top k of every layer "
                 "(renormalize = true, no dense_layers)")
    window = model["sliding_window"]
    layer_types = hf_layer_types(model)
    rope = {"rope_type": "default", "rope_theta": model["rope_theta"]}
    yarn = model.get("yarn")
    if model.get("rope_scaling"):
        sys.exit("bench/torch_train.py: Llama 3's RoPE scaling on gpt_oss is not written here")
    if yarn:
        rope = {
            "rope_type": "yarn",
            "rope_theta": model["rope_theta"],
            "factor": yarn["factor"],
            "original_max_position_embeddings": yarn["original_max_seq_len"],
            "beta_fast": yarn["beta_fast"],
            "beta_slow": yarn["beta_slow"],
            "mscale": yarn.get("mscale", 1.0),
            "mscale_all_dim": yarn.get("mscale_all_dim", 0.0),
            "truncate": yarn["truncate"],
        }
        if yarn.get("attention_factor") is not None:
            rope["attention_factor"] = yarn["attention_factor"]
    extra = {}
    # swiglu_alpha is a config field of transformers 5.25 (1.702 hard-coded in the experts before).
    if hasattr(transformers.GptOssConfig, "swiglu_alpha"):
        extra["swiglu_alpha"] = model["glu_alpha"]
    elif model["glu_alpha"] != 1.702:
        sys.exit(f"bench/torch_train.py: transformers {transformers.__version__} hard-codes swiglu_alpha 1.702, "
                 f"not {model['glu_alpha']}")
    return transformers.GptOssConfig(
        rope_parameters=rope,
        sliding_window=window or None,
        layer_types=layer_types,
        attention_bias=True,
        num_local_experts=moe["num_experts"],
        num_experts_per_tok=moe["top_k"],
        swiglu_limit=model["glu_limit"],
        router_aux_loss_coef=moe["aux_loss_coef"],
        output_router_logits=True,
        **extra,
        **common,
    )


def hf_layer_types(model):
    """transformers' `layer_types` for the engine's model: a layer is full by the recipe's
    `layer_types` when it has them, else every `window_pattern`-th one (the engine's
    ModelConfig::window); every layer is full without a `sliding_window`."""
    window = model["sliding_window"]
    kinds = model.get("layer_types") or []
    pattern = model.get("window_pattern", 0)

    def full(i):
        if kinds:
            return kinds[i] == "full"
        return window == 0 or (pattern > 0 and (i + 1) % pattern == 0)

    return ["full_attention" if full(i) else "sliding_attention" for i in range(model["n_layers"])]


def gemma3_config(model, common):
    """Gemma3TextConfig (`Gemma3ForCausalLM`, the text model) for the engine's `gemma3` model:
    sandwich norms, (1 + w) RMSNorm, QK-norm, the GeGLU MLP with gelu_pytorch_tanh, the embedding
    times sqrt(d_model), tied embeddings as the recipe says; sliding-window layers among global
    ones (`layer_types` from `window_pattern` or `layer_types`), RoPE per layer type
    (`rope_parameters` keyed by `sliding_attention` and `full_attention`, as transformers 5's
    Gemma3TextConfig takes them: the local layers on `rope_local_theta`, never scaled, the global
    ones on `rope_theta` scaled linearly by `rope_linear_factor`), the attention logits scaled by
    `query_pre_attn_scalar^-1/2` (the engine's 0: head_dim's), `final_logit_softcapping` from
    `final_logit_softcap` (0: none). No padding token: transformers' default pad_token_id 0 would
    make row 0 of the embedding an `nn.Embedding` padding row (zeroed at init, no input-side
    gradient), which the engine has not. No KV cache in training (`use_cache=False`)."""
    import transformers

    if model.get("rope_scaling") or model.get("yarn") or model.get("moe") or model.get("mla"):
        sys.exit("bench/torch_train.py: Gemma3ForCausalLM has a dense GeGLU MLP, grouped-query attention and "
                 "linear RoPE scaling only (no model.rope_scaling, model.yarn, model.moe or model.mla)")
    q = model.get("query_pre_attn_scalar", 0.0) or model["head_dim"]
    if q != int(q):
        sys.exit(f"bench/torch_train.py: model.query_pre_attn_scalar = {q} is not a whole number "
                 "(transformers' Gemma3TextConfig takes an int)")
    factor = model.get("rope_linear_factor", 1.0)
    full = {"rope_type": "default", "rope_theta": model["rope_theta"]}
    if factor != 1.0:
        full = {"rope_type": "linear", "factor": factor, "rope_theta": model["rope_theta"]}
    local = {"rope_type": "default", "rope_theta": model.get("rope_local_theta", 0.0) or model["rope_theta"]}
    softcap = model.get("final_logit_softcap", 0.0)
    return transformers.Gemma3TextConfig(
        rope_parameters={"full_attention": full, "sliding_attention": local},
        sliding_window=model["sliding_window"] or None,
        layer_types=hf_layer_types(model),
        query_pre_attn_scalar=int(q),
        final_logit_softcapping=softcap or None,
        attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=False,
        use_bidirectional_attention=False,
        pad_token_id=None,
        use_cache=False,
        **common,
    )


def check_softmax_routing(moe):
    """The MoE peers route as Mixtral and Qwen3-MoE do: a softmax over every expert, top k of
    one group, no shared expert, no selection bias, unscaled. DeepSeek-V3's routing is not
    written here."""
    odd = {
        "scoring": (moe.get("scoring", "softmax"), "softmax"),
        "groups": (moe.get("groups", 1), 1),
        "top_groups": (moe.get("top_groups", 1), 1),
        "shared_experts": (moe.get("shared_experts", 0), 0),
        "selection_bias": (moe.get("selection_bias", False), False),
        "routed_scale": (moe.get("routed_scale", 1.0), 1.0),
    }
    odd = {k: v for k, (v, want) in odd.items() if v != want}
    if odd:
        sys.exit(f"bench/torch_train.py: model.moe {odd}: only softmax top-k routing is written here")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--set", action="append", default=[], help="recipe override KEY=VALUE")
    ap.add_argument("--engine", default=os.path.join(here, "..", "target", "release", "engine"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--compile", choices=["blocks", "whole"],
                    help="torch.compile each decoder layer (torchtitan's way) or the forward pass and loss together")
    ap.add_argument("--moe-layer", default="hf", choices=["hf", "grouped-mm"],
                    help="Mixtral, Qwen3-MoE: transformers' model, or bench/torch_moe.py's torchtitan-style one")
    ap.add_argument("--float8", choices=["tensorwise", "rowwise"],
                    help="torchao's float8 training of the decoder's linear layers (torchtitan's way: not the "
                         "output head, widths multiples of 16), before torch.compile; needs torchao and a GPU "
                         "with FP8 (sm_89+)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps before measuring (torch.compile compiles in the first)")
    args = ap.parse_args()

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    recipe = resolved_recipe(args.engine, args.recipe, args.set)
    train, optim = recipe["train"], recipe["optim"]
    cuda = args.device == "cuda"
    moe = recipe["model"].get("moe")
    grouped = args.moe_layer == "grouped-mm"
    if grouped and not moe:
        sys.exit("bench/torch_train.py: --moe-layer grouped-mm needs a mixture-of-experts recipe (Mixtral, Qwen3-MoE)")
    gpt_oss = recipe["model"]["family"] == "gpt_oss"
    if grouped and gpt_oss:
        sys.exit("bench/torch_train.py: --moe-layer grouped-mm is not written for GPT-OSS (bench/torch_moe.py's "
                 "SDPA attention has no sinks); transformers' GptOssForCausalLM runs its experts as grouped "
                 "products already")
    if moe and moe.get("capacity_factor"):
        sys.exit("bench/torch_train.py: the MoE peers are dropless; leave model.moe.capacity_factor out")
    torch.manual_seed(train["seed"])
    # Built on the device it trains on (in f32, then cast): an 8B model's initialisation on the
    # host would take a while of every run.
    with torch.device(args.device):
        if grouped:
            sys.path.insert(0, here)
            from torch_moe import MoeTransformer

            model = MoeTransformer(recipe["model"], train["seq_len"])
        else:
            config = hf_config(recipe["model"])
            if gpt_oss:
                config._attn_implementation = "eager"  # no SDPA path: the sinks
            elif cuda:
                config._attn_implementation = "sdpa"
            model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(device=args.device, dtype=torch.bfloat16 if cuda else torch.float32)
    parameters = sum(p.numel() for p in model.parameters())  # a tied head counted once
    if recipe["model"]["family"] == "gemma3":
        # The same model as the engine's, to the parameter: every key mapped (a wrong tie, MLP
        # width, head count or norm would show here).
        want = engine_parameters(args.engine, args.recipe, args.set)
        assert parameters == want, f"Gemma3ForCausalLM has {parameters:,} parameters, the engine {want:,}"
    if not grouped and recipe["model"]["family"] != "gpt":
        # The recipe's head_dim, not d_model / heads (Qwen3MoeConfig takes it as a bare attribute).
        attn = model.model.layers[0].self_attn
        want = recipe["model"]["n_heads"] * recipe["model"]["head_dim"]
        assert attn.q_proj.out_features == want, f"q_proj has {attn.q_proj.out_features} outputs, not {want}"
    float8 = None
    if args.float8:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def eligible(module, fqn):
            return (isinstance(module, torch.nn.Linear) and "lm_head" not in fqn
                    and module.in_features % 16 == 0 and module.out_features % 16 == 0)

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(args.float8),
                                   module_filter_fn=eligible)
        float8 = {"recipe": args.float8, "torchao": torchao.__version__,
                  "linears": sum(type(m).__name__ == "Float8Linear" for m in model.modules())}
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=optim["lr"],
        betas=(optim["beta1"], optim["beta2"]),
        eps=optim["eps"],
        weight_decay=optim["weight_decay"],
        fused=cuda,
    )
    vocab = recipe["model"]["vocab_size"]

    def loss_fn(inputs, targets):
        """Mean next-token cross-entropy in f32 (plus the load-balancing loss with experts)."""
        if grouped:
            return model(inputs, targets)
        kwargs = {"output_router_logits": True} if moe else {}
        out = model(input_ids=inputs, **kwargs)
        loss = torch.nn.functional.cross_entropy(out.logits.float().view(-1, vocab), targets.reshape(-1))
        if moe:
            loss = loss + moe["aux_loss_coef"] * out.aux_loss
        return loss

    step_fn = loss_fn
    if args.compile == "whole":
        step_fn = torch.compile(loss_fn)
    elif args.compile == "blocks":
        # torchtitan's apply_compile: every transformer block compiled on its own with
        # fullgraph=True.
        # transformers' layers carry their index (`layer_idx`), which dynamo guards on: each
        # layer then compiles once (16 graphs for 16 layers), past dynamo's default limit of 8
        # recompilations, which fullgraph=True turns into a hard failure (seen on torch 2.11).
        import torch._dynamo

        if grouped:
            blocks = model.layers
        elif recipe["model"]["family"] == "gpt":
            blocks = model.transformer.h
        else:
            blocks = model.model.layers
        limit = 2 * len(blocks) + 8
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, fullgraph=True)
    batch, seq, accum = train["batch_size"], train["seq_len"], train.get("grad_accum", 1)
    gen = torch.Generator().manual_seed(0)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        batches = [torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(args.device) for _ in range(accum)]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        total = 0.0
        for ids in batches:
            loss = step_fn(ids[:, :-1], ids[:, 1:]) / accum
            loss.backward()
            total = total + loss.detach()
        if optim["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(total)  # waits for the device, like the engine's logged loss
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
            losses.append(loss)
    report(
        {
            "peer": "pytorch" + (f" + torch.compile ({args.compile})" if args.compile else " eager")
            + (" + grouped_mm experts" if grouped else "") + (f" + torchao float8 {args.float8}" if args.float8 else ""),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "recipe": args.recipe,
            "device": torch.cuda.get_device_name() if cuda else args.device,
            "threads": args.threads,
            # How transformers ran the experts ("grouped_mm", "eager", ...); None without them.
            "experts_implementation": getattr(model.config, "_experts_implementation", None)
            if moe and not grouped
            else ("torch_moe grouped_mm" if grouped else None),
            # transformers' attention ("sdpa", "eager": GPT-OSS); None for bench/torch_moe.py's SDPA.
            "attention_implementation": None if grouped else getattr(model.config, "_attn_implementation", None),
            "parameters": parameters,
            "float8": float8,
        },
        batch * seq * accum,
        times,
        losses,
        torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    )

if __name__ == "__main__":
    main()
