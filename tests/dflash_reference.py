"""Independent references for the drafter tests (and benchmarks/bench_drafter.py).

1. ``ReleasedReference``: a forward of the released DFlash / DSpark model written from its description
   (../shared/REFERENCES.md, z-lab ``dflash/model.py``, SpecForge ``dspark.py``) in plain torch. It reads a
   released-layout folder itself (config.json + safetensors, sharded or not, + ``mask_embedding.pt``) and does
   not import ``specopd.drafters``: one branch at a time, explicit key lists, repeated KV heads, softmax.
2. ``write_released_folder``: a tiny random released-layout folder written by hand (not by our exporter).
3. ``per_branch_attention``: the v0.1 way of attending, each branch with its own gathered copy of the context
   K/V ([N, C, Hkv, hd]) and a dense mask; the reference of ``specopd.drafters.attention`` (values and
   gradients) and the baseline of the memory benchmark.
"""
from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------- 1. released model


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rot(x, pos, theta):
    """Neox-style RoPE of x [T, H, hd] at integer positions pos [T]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos.double()[:, None] * inv[None]  # [T, hd/2]
    cos, sin = torch.cos(ang).float()[:, None], torch.sin(ang).float()[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class ReleasedReference:
    """The released drafter of ``folder`` on a target given by its frozen ``embed`` [V, D] and ``lm_head`` [V, D]."""

    def __init__(self, folder: str, embed: torch.Tensor, lm_head: torch.Tensor):
        from safetensors.torch import load_file

        with open(os.path.join(folder, "config.json")) as f:
            self.cfg = c = json.load(f)
        dc = c.get("dflash_config") or {}
        self.w = {}
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            for name in sorted(set(json.load(open(index))["weight_map"].values())):
                self.w.update(load_file(os.path.join(folder, name)))
        else:
            self.w.update(load_file(os.path.join(folder, "model.safetensors")))
        self.w = {k: v.float() for k, v in self.w.items()}
        self.embed, self.lm_head = embed.float(), lm_head.float()
        self.mask_id = dc["mask_token_id"]
        self.mask_vec = None
        mf = os.path.join(folder, "mask_embedding.pt")
        if os.path.isfile(mf):
            st = torch.load(mf, weights_only=True)
            self.mask_vec = (st["embedding"] if isinstance(st, dict) else st).float().reshape(-1)
        self.bs = int(dc.get("block_size", c.get("block_size", 16)))
        self.layers = int(c["num_hidden_layers"])
        self.h, self.hkv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
        self.hd = int(c.get("head_dim") or c["hidden_size"] // self.h)
        self.eps, self.theta = float(c["rms_norm_eps"]), float(c["rope_theta"])
        self.dspark = "DSparkDraftModel" in c["architectures"]
        self.conf_with_markov = bool(dc.get("confidence_head_with_markov", False))

    def _embed_block(self, anchor_token: int) -> torch.Tensor:
        ids = torch.tensor([anchor_token] + [self.mask_id] * (self.bs - 1))
        x = self.embed[ids].clone()
        if self.mask_vec is not None:  # vLLM: the learned vector replaces embed(mask_token_id) wherever it occurs
            x[ids == self.mask_id] = self.mask_vec
        return x

    def hidden(self, feats: torch.Tensor, a: int, anchor_token: int) -> torch.Tensor:
        """One branch: features [T, F] of its trunk, anchor a <= T -> normed hidden [bs - 1, D]."""
        w, eps = self.w, self.eps
        ctx = _rms(feats[:a].float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [a, D]
        x = self._embed_block(anchor_token)  # [bs, D]
        pos_c, pos_b = torch.arange(a), a + torch.arange(self.bs)
        rep = self.h // self.hkv
        for i in range(self.layers):
            p = f"layers.{i}."
            y = _rms(x, w[p + "input_layernorm.weight"], eps)
            q = (y @ w[p + "self_attn.q_proj.weight"].T).view(self.bs, self.h, self.hd)
            q = _rot(_rms(q, w[p + "self_attn.q_norm.weight"], eps), pos_b, self.theta)
            keys, vals = [], []
            for src, pos in ((ctx, pos_c), (y, pos_b)):  # context rows first, then the block
                k = (src @ w[p + "self_attn.k_proj.weight"].T).view(-1, self.hkv, self.hd)
                keys.append(_rot(_rms(k, w[p + "self_attn.k_norm.weight"], eps), pos, self.theta))
                vals.append((src @ w[p + "self_attn.v_proj.weight"].T).view(-1, self.hkv, self.hd))
            k = torch.cat(keys).repeat_interleave(rep, 1)
            v = torch.cat(vals).repeat_interleave(rep, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.hd), -1)  # non-causal
            x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(self.bs, -1) @ w[p + "self_attn.o_proj.weight"].T
            y = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            x = x + (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
        return _rms(x, w["norm.weight"], eps)[1:]

    def logits(self, feats, a, anchor_token, prev_tokens=None) -> torch.Tensor:
        """-> [bs - 1, V]: lm_head(norm(h)) (+ DSpark's W2(W1[prev]) with prev_tokens [bs - 1])."""
        out = self.hidden(feats, a, anchor_token) @ self.lm_head.T
        if self.dspark and prev_tokens is not None:
            out = out + self.w["markov_head.markov_w1.weight"][prev_tokens] @ self.w["markov_head.markov_w2.weight"].T
        return out

    def confidence(self, feats, a, anchor_token, prev_tokens) -> torch.Tensor:
        h = self.hidden(feats, a, anchor_token)
        x = torch.cat([h, self.w["markov_head.markov_w1.weight"][prev_tokens]], -1) if self.conf_with_markov else h
        return (x @ self.w["confidence_head.proj.weight"].T + self.w["confidence_head.proj.bias"])[:, 0]


# ----------------------------------------------------------------------------------- 2. random folders


def write_released_folder(folder, *, hidden, vocab, target_layers, num_layers=2, block_size=4, layer_ids=None,
                          heads=4, kv_heads=2, head_dim=8, intermediate=48, mask_token_id=5, seed=0,
                          kind="dflash", rank=16, shards=1, mask_vector=False, dtype=torch.bfloat16,
                          rope_theta=10000.0, extra_config=None) -> str:
    """A tiny random drafter in the released layout (names and config as z-lab / SpecForge publish them)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    ids = list(layer_ids) if layer_ids is not None else [min(target_layers - 1, 1 + i) for i in range(num_layers)]
    r = lambda *s, std=0.1: (torch.randn(*s, generator=g) * std).to(dtype)  # noqa: E731
    w = {"fc.weight": r(hidden, len(ids) * hidden), "hidden_norm.weight": (1 + r(hidden)).to(dtype),
         "norm.weight": (1 + r(hidden)).to(dtype)}
    for i in range(num_layers):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": r(heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": r(kv_heads * head_dim, hidden),
                  p + "self_attn.v_proj.weight": r(kv_heads * head_dim, hidden),
                  p + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
                  p + "self_attn.q_norm.weight": (1 + r(head_dim)).to(dtype),
                  p + "self_attn.k_norm.weight": (1 + r(head_dim)).to(dtype),
                  p + "mlp.gate_proj.weight": r(intermediate, hidden), p + "mlp.up_proj.weight": r(intermediate, hidden),
                  p + "mlp.down_proj.weight": r(hidden, intermediate),
                  p + "input_layernorm.weight": (1 + r(hidden)).to(dtype),
                  p + "post_attention_layernorm.weight": (1 + r(hidden)).to(dtype)})
    dflash = {"mask_token_id": mask_token_id, "target_layer_ids": ids}
    arch = "DFlashDraftModel"
    if kind == "dspark":
        arch = "DSparkDraftModel"
        w.update({"markov_head.markov_w1.weight": r(vocab, rank, std=0.5), "markov_head.markov_w2.weight": r(vocab, rank, std=0.5),
                  "confidence_head.proj.weight": r(1, hidden + rank), "confidence_head.proj.bias": r(1)})
        dflash.update(markov_rank=rank, markov_head_type="vanilla", enable_confidence_head=True,
                      confidence_head_with_markov=True, projector_type="dspark", attention_mode="gqa")
    cfg = {"architectures": [arch], "auto_map": {"AutoModel": f"{kind}.{arch}"}, "model_type": "qwen3",
           "block_size": block_size, "num_target_layers": target_layers, "dflash_config": dflash,
           "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": num_layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "rope_scaling": None, "max_position_embeddings": 4096,
           "vocab_size": vocab, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
           "layer_types": ["full_attention"] * num_layers, "dtype": "bfloat16"}
    cfg.update(extra_config or {})
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    names = sorted(w)
    if shards == 1:
        save_file(w, os.path.join(folder, "model.safetensors"))
    else:
        wmap = {}
        for s in range(shards):
            part = names[s::shards]
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: w[k] for k in part}, os.path.join(folder, fn))
            wmap.update({k: fn for k in part})
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wmap}, f)
    if mask_vector:
        torch.save({"mask_token_id": mask_token_id, "embedding": r(hidden, std=1.0)},
                   os.path.join(folder, "mask_embedding.pt"))
    return str(folder)


# ----------------------------------------------------------------------------------- 3. per-branch attention


def per_branch_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout, scale):
    """Each branch gets its own copy of its context K/V (gathered to [N, C_max, Hkv, hd]) and a dense mask;
    one SDPA over [context copy ; block]. Memory O(N * C): the reference, not the way to run at scale."""
    n, s, h, hd = q.shape
    starts, anchors = layout.starts, layout.anchors
    cmax = int(anchors.max()) if n else 0
    col = torch.arange(cmax, device=q.device)
    valid = col[None, :] < anchors[:, None]  # [N, C]
    idx = (starts[:, None] + torch.minimum(col[None, :], (anchors - 1).clamp(min=0)[:, None])).clamp(
        max=max(k_ctx.shape[0] - 1, 0))
    if k_ctx.shape[0]:
        kc, vc = k_ctx[idx], v_ctx[idx]  # [N, C, Hkv, hd]  <- the per-branch copy
    else:
        kc = vc = k_blk.new_zeros(n, 0, k_blk.shape[2], hd)
    k = torch.cat([kc.to(q.dtype), k_blk], 1).transpose(1, 2)
    v = torch.cat([vc.to(q.dtype), v_blk], 1).transpose(1, 2)
    mask = torch.cat([valid, valid.new_ones(n, s)], 1)[:, None, None, :]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=h != k_blk.shape[2])
    return o.transpose(1, 2)
