"""A torchtitan-style Mixtral or Qwen3-MoE in plain PyTorch, the MoE peer that
bench/torch_train.py trains with `--moe-layer grouped-mm` (bench/compare.py's `grouped-mm` peer,
each block compiled on its own).

What torchtitan's MoE does (torchtitan/models/moe/moe.py, as of torch 2.11), reduced to Mixtral's
and Qwen3-MoE's routing: a bias-free router, softmax over all experts, the top k, renormalised
when the recipe says so (`model.moe.renormalize`: Mixtral and Qwen3-30B-A3B do, ties to the lower
index, as the engine), the (token, slot) pairs sorted by expert into groups padded to 16 rows
(`_grouped_mm`'s alignment in bf16; torchtitan's `TOKEN_GROUP_ALIGN_SIZE_M`), every expert's
SwiGLU through three `torch._grouped_mm` products over those groups, and the outputs scattered
back and summed with their weights. Every shape is static (the groups live in a buffer of
`N·k + 16·E` rows, the padding reading a zero row), so each block compiles with
`fullgraph=True`. Dropless; the load-balancing loss is the engine's (Hugging Face's).

Attention is SDPA (causal, grouped-query), RoPE the "rotate half" layout, RMSNorm `torch.nn`'s;
Qwen3-MoE adds its QK-norm (an RMSNorm over each query and key head, before RoPE) and keeps a
dense SwiGLU MLP of `model.moe.dense_mlp_dim` in `model.moe.dense_layers` (the load-balancing
loss then averages over the layers with experts, as transformers and the engine do): the same
model and FLOPs as the engine's recipe. On CUDA it needs bf16 `_grouped_mm` (compute capability
9.0 and up, torch >= 2.8); torch 2.15 also runs `_grouped_mm` on the CPU (f32), which the CPU
check uses.
"""

import torch
import torch.nn.functional as F
from torch import nn

ALIGN = 16  # rows of a group: _grouped_mm's alignment of the offsets in bf16


def rope_tables(model, seq, device):
    hd = model["head_dim"]
    inv = 1.0 / (model["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    angles = torch.arange(seq, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return angles.cos(), angles.sin()


def rope(x, cos, sin):  # x: [B, H, T, hd]
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, model):
        super().__init__()
        d, hd = model["d_model"], model["head_dim"]
        self.heads, self.kv_heads, self.hd = model["n_heads"], model["n_kv_heads"], hd
        self.wq = nn.Linear(d, self.heads * hd, bias=False)
        self.wk = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.wo = nn.Linear(self.heads * hd, d, bias=False)
        # Qwen3's QK-norm: one RMSNorm weight of head_dim for all query heads, one for the keys.
        qk_norm = model["family"] == "qwen3_moe"
        self.q_norm = nn.RMSNorm(hd, eps=model["norm_eps"]) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(hd, eps=model["norm_eps"]) if qk_norm else nn.Identity()

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = rope(self.q_norm(self.wq(x).view(b, t, self.heads, self.hd)).transpose(1, 2), cos, sin)
        k = rope(self.k_norm(self.wk(x).view(b, t, self.kv_heads, self.hd)).transpose(1, 2), cos, sin)
        v = self.wv(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.wo(o.transpose(1, 2).reshape(b, t, self.heads * self.hd))


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts: w1 (gate), w3 (up) `[E, F, D]`, w2 (down) `[E, D, F]`."""

    def __init__(self, e, d, f, std):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(e, f, d) * std)
        self.w2 = nn.Parameter(torch.randn(e, d, f) * std)
        self.w3 = nn.Parameter(torch.randn(e, f, d) * std)

    def forward(self, x, offs):
        h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    def __init__(self, model):
        super().__init__()
        moe = model["moe"]
        self.e, self.k, self.renormalize = moe["num_experts"], moe["top_k"], moe["renormalize"]
        self.router = nn.Linear(model["d_model"], self.e, bias=False)
        self.experts = GroupedExperts(self.e, model["d_model"], model["mlp_dim"], model["init_std"])

    def forward(self, x):
        """Returns the output and the layer's load-balancing statistics (counts, Σ probabilities)."""
        b, t, d = x.shape
        n, e, k = b * t, self.e, self.k
        rows = x.reshape(n, d)
        probs = F.softmax(self.router(rows).float(), dim=-1)
        top_p, top_e = probs.topk(k, dim=-1)
        weights = top_p / top_p.sum(dim=-1, keepdim=True) if self.renormalize else top_p
        flat = top_e.reshape(-1)  # slot t·k + j
        counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        # Groups padded to ALIGN rows, at static size: slot i of the sorted order goes to row
        # start_padded[e] + (i - start[e]) of its expert e; the rest read a zero row.
        order = torch.argsort(flat, stable=True)
        sorted_e = flat[order]
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        start = torch.cumsum(counts, 0) - counts
        offs = torch.cumsum(padded, 0)
        start_padded = offs - padded
        dest = start_padded[sorted_e] + torch.arange(n * k, device=x.device) - start[sorted_e]
        capacity = n * k + ALIGN * e
        source = torch.full((capacity,), n, dtype=torch.int64, device=x.device)  # row n: zeros
        source[dest] = order // k
        padded_rows = torch.cat([rows, rows.new_zeros(1, d)])
        ys = self.experts(padded_rows[source], offs.to(torch.int32))  # [capacity, d]
        row_of_slot = torch.empty_like(dest)
        row_of_slot[order] = dest
        out = (ys[row_of_slot].view(n, k, d).float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        return out.view(b, t, d), counts.float(), probs.sum(dim=0)


class DenseMLP(nn.Module):
    """A dense SwiGLU MLP: Qwen3-MoE's `mlp_only_layers` (`model.moe.dense_layers`)."""

    def __init__(self, d, f):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, model, dense=False):
        super().__init__()
        eps = model["norm_eps"]
        self.attention_norm = nn.RMSNorm(model["d_model"], eps=eps)
        self.attention = Attention(model)
        self.ffn_norm = nn.RMSNorm(model["d_model"], eps=eps)
        self.dense = dense
        self.moe = DenseMLP(model["d_model"], model["moe"]["dense_mlp_dim"]) if dense else MoE(model)

    def forward(self, x, cos, sin):
        """The block's output and its routing statistics (None for a dense layer)."""
        x = x + self.attention(self.attention_norm(x), cos, sin)
        if self.dense:
            return x + self.moe(self.ffn_norm(x)), None, None
        y, counts, prob_sums = self.moe(self.ffn_norm(x))
        return x + y, counts, prob_sums


class MoeTransformer(nn.Module):
    """The recipe's Mixtral or Qwen3-MoE; `forward` returns the mean next-token cross-entropy
    plus `aux_loss_coef` times the load-balancing loss, as the engine's objective."""

    def __init__(self, model, seq):
        super().__init__()
        if model["family"] not in ("mixtral", "qwen3_moe"):
            raise SystemExit(f"bench/torch_moe.py: model.family = {model['family']!r}: Mixtral and Qwen3-MoE are written here")
        moe = model["moe"]
        odd = {k: moe.get(k, want) for k, want in [("scoring", "softmax"), ("groups", 1), ("top_groups", 1),
                                                   ("shared_experts", 0), ("selection_bias", False),
                                                   ("routed_scale", 1.0)] if moe.get(k, want) != want}
        if odd:
            raise SystemExit(f"bench/torch_moe.py: model.moe {odd}: only softmax top-k routing is written here")
        window = model.get("sliding_window") or 0
        if window and window < seq:
            raise SystemExit(f"bench/torch_moe.py: a sliding window of {window} < seq_len {seq} is not written here")
        if model.get("rope_scaling"):
            raise SystemExit("bench/torch_moe.py: RoPE scaling is not written here (Mixtral and Qwen3-MoE have none)")
        self.model = model
        dense = set(moe.get("dense_layers") or [])
        self.moe_layers = model["n_layers"] - len(dense)
        d, v = model["d_model"], model["vocab_size"]
        self.embed = nn.Embedding(v, d)
        self.layers = nn.ModuleList(Block(model, i in dense) for i in range(model["n_layers"]))
        self.norm = nn.RMSNorm(d, eps=model["norm_eps"])
        self.output = None if model["tie_embeddings"] else nn.Linear(d, v, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2 and "experts" not in name:
                nn.init.normal_(p, std=model["init_std"])

    def forward(self, inputs, targets):
        t = inputs.shape[1]
        cos, sin = rope_tables(self.model, t, inputs.device)
        x = self.embed(inputs)
        counts, prob_sums = 0.0, 0.0
        for block in self.layers:
            x, c, p = block(x, cos, sin)
            if c is not None:
                counts, prob_sums = counts + c, prob_sums + p
        x = self.norm(x)
        logits = self.output(x) if self.output is not None else x @ self.embed.weight.T
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        moe = self.model["moe"]
        total = self.moe_layers * inputs.numel()  # the layers with experts only
        aux = moe["num_experts"] * (counts * prob_sums).sum() / total**2
        return loss + moe["aux_loss_coef"] * aux


Mixtral = MoeTransformer  # the name bench/torch_train.py first imported
