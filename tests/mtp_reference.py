"""Plain-torch transcription of vLLM 0.32's MTP drafting for qwen3_next / qwen3_5 (the oracle of tests/test_mtp.py),
and the fixture step that gives a transformers-written tiny hybrid checkpoint its MTP head.

Transcribed from ``.venv-vllm``: ``model_executor/models/qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``
(``*MultiTokenPredictor.forward``: ``fc(cat[pre_fc_norm_embedding(embed(ids)), pre_fc_norm_hidden(hidden)])``, one
decoder layer, ``norm(hidden + residual)``), ``qwen3_next.py`` (``GemmaRMSNorm``: ``x * rsqrt(mean(x^2) + eps) * (1
+ w)`` in fp32; ``Qwen3NextAttention``: ``q_proj`` rows per head ``[q | gate]``, q/k norm, neox RoPE on the first
``head_dim * partial_rotary_factor`` dims, causal attention, ``* sigmoid(gate)``, ``o_proj``; MLP ``down(silu(gate) *
up)``; ``Qwen3NextSparseMoeBlock``: softmax top-k router (renormalised when norm_topk_prob), experts, shared expert
gated by ``sigmoid(shared_expert_gate)``), and ``v1/spec_decode/llm_base_proposer.py`` (``propose``: the first pass
runs rows ``(x_{j+1}, h_j)`` at positions j with the target's *normed* final hidden (Qwen3Next / Qwen3_5 models
return the state after their final norm); each later step reads the drafted token and the head's own output at the
next position, over the head's KV cache; ``Qwen3NextMTP.forward`` passes no ``spec_step_idx``, so layer 0 drafts every
step). Weights are read by their released names straight from the folder's safetensors, nothing from specopd.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def _rms(x, w, eps):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


def _rope(x, pos, rot, theta):
    """neox-style RoPE on the first ``rot`` dims: x [T, H, hd], pos [T]."""
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    f = pos.float()[:, None] * inv[None]
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    x1, x2, rest = x[..., : rot // 2], x[..., rot // 2: rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def text_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    return raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


def mtp_weights(folder: str) -> dict:
    """The folder's ``mtp.*`` tensors by released name (per-expert tensors as written)."""
    sd = load_file(os.path.join(folder, "model.safetensors"))
    return {k: v for k, v in sd.items() if k.startswith("mtp.")}


class VllmMTP:
    """vLLM's MTP module over a KV cache: ``step(ids [n], hidden [n, D], positions [n]) -> normed out [n, D]``,
    appending the rows' K/V (the proposer's first pass is one call with n rows, each later step one row)."""

    def __init__(self, folder: str, embed: torch.Tensor):
        self.c = text_config(folder)
        self.w = mtp_weights(folder)
        self.embed = embed
        self.k, self.v = [], []

    def _mlp(self, p, x):
        w, c = self.w, self.c
        if p + "gate.weight" not in w:
            return F.linear(F.silu(F.linear(x, w[p + "gate_proj.weight"])) * F.linear(x, w[p + "up_proj.weight"]),
                            w[p + "down_proj.weight"])
        probs = F.softmax(F.linear(x.float(), w[p + "gate.weight"].float()), -1)
        top, idx = torch.topk(probs, c["num_experts_per_tok"], -1)
        if c.get("norm_topk_prob", True):
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = f"{p}experts.{int(idx[t, j])}."
                y = F.linear(F.silu(F.linear(x[t], w[e + "gate_proj.weight"])) * F.linear(x[t], w[e + "up_proj.weight"]),
                             w[e + "down_proj.weight"])
                out[t] += top[t, j].to(x.dtype) * y
        if p + "shared_expert.gate_proj.weight" in w:
            s = p + "shared_expert."
            y = F.linear(F.silu(F.linear(x, w[s + "gate_proj.weight"])) * F.linear(x, w[s + "up_proj.weight"]),
                         w[s + "down_proj.weight"])
            out = out + torch.sigmoid(F.linear(x, w[p + "shared_expert_gate.weight"])) * y
        return out

    def step(self, ids, hidden, positions, layer: int = 0):
        w, c = self.w, self.c
        eps = c.get("rms_norm_eps", 1e-6)
        e = _rms(self.embed[ids], w["mtp.pre_fc_norm_embedding.weight"], eps)
        h = _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
        x = F.linear(torch.cat([e, h], -1), w["mtp.fc.weight"])
        p = f"mtp.layers.{layer}."
        nh, nkv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
        hd = c.get("head_dim") or c["hidden_size"] // nh
        rp = c.get("rope_parameters") or {}
        rot = int(hd * rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
        theta = rp.get("rope_theta", c.get("rope_theta", 10000.0))
        residual = x
        a = _rms(x, w[p + "input_layernorm.weight"], eps)
        q_gate = F.linear(a, w[p + "self_attn.q_proj.weight"]).view(-1, nh, 2 * hd)
        q, gate = torch.chunk(q_gate, 2, dim=-1)
        gate = gate.reshape(-1, nh * hd)
        k = F.linear(a, w[p + "self_attn.k_proj.weight"]).view(-1, nkv, hd)
        v = F.linear(a, w[p + "self_attn.v_proj.weight"]).view(-1, nkv, hd)
        q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], eps), positions, rot, theta)
        k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps), positions, rot, theta)
        self.k.append(k)
        self.v.append(v)
        kk, vv = torch.cat(self.k), torch.cat(self.v)  # every cached row, this call's last
        n, total = x.shape[0], kk.shape[0]
        qpos = torch.arange(total - n, total)
        mask = torch.arange(total)[None] <= qpos[:, None]  # causal over the cache
        g = nh // nkv
        kk, vv = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * hd ** -0.5
        s = s.masked_fill(~mask[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", F.softmax(s.float(), -1).to(q.dtype), vv).reshape(n, nh * hd)
        o = F.linear(o * torch.sigmoid(gate), w[p + "self_attn.o_proj.weight"])
        residual = o + residual
        y = self._mlp(p + "mlp.", _rms(residual, w[p + "post_attention_layernorm.weight"], eps))
        return _rms(y + residual, w["mtp.norm.weight"], eps)


def vllm_propose(folder, embed, lm_head, tokens, hidden, next_token, steps):
    """The proposer's greedy drafts after a trunk: tokens [T] (the trunk), hidden [T, D] (the target's normed final
    hidden), next_token (the bonus token) -> (draft tokens [steps], draft logits [steps, V])."""
    m = VllmMTP(folder, embed)
    t = tokens.numel()
    ids = torch.cat([tokens[1:], torch.tensor([int(next_token)])])
    out = m.step(ids, hidden, torch.arange(t))[-1:]
    toks, logits = [], []
    for k in range(steps):
        lg = F.linear(out, lm_head).float()[0]
        toks.append(int(lg.argmax()))
        logits.append(lg)
        if k + 1 < steps:
            out = m.step(torch.tensor([toks[-1]]), out, torch.tensor([t + k]))
    return torch.tensor(toks), torch.stack(logits)


def add_mtp_head(folder: str, num_layers: int = 1, seed: int = 0) -> str:
    """Give a transformers-written qwen3_next / qwen3_5 checkpoint an MTP head as the releases name it (transformers
    writes none): ``mtp.fc``, ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.layers.<i>.*`` (a full-attention layer;
    MoE experts one by one, ``mtp.layers.<i>.mlp.experts.<e>.gate_proj.weight``), ``mtp.norm``, and the layer count
    in config.json (qwen3_5: ``mtp_num_hidden_layers`` in the text config, as released; qwen3_next:
    ``num_nextn_predict_layers``, vLLM's key). Random weights from ``seed``; the target's tensors are untouched."""
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    c = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    d, nh = c["hidden_size"], c["num_attention_heads"]
    nkv, hd = c.get("num_key_value_heads", nh), c.get("head_dim") or d // nh
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=None):
        return torch.randn(*shape, generator=g) / (scale or shape[-1]) ** 0.5

    def norm(n):
        return 0.2 * torch.randn(n, generator=g)

    new = {"mtp.fc.weight": rnd(d, 2 * d), "mtp.pre_fc_norm_embedding.weight": norm(d),
           "mtp.pre_fc_norm_hidden.weight": norm(d), "mtp.norm.weight": norm(d)}
    moe = c.get("model_type") in ("qwen3_5_moe", "qwen3_5_moe_text") or (c.get("num_experts") or 0) > 0
    for i in range(num_layers):
        p = f"mtp.layers.{i}."
        new.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                    p + "self_attn.q_proj.weight": rnd(2 * nh * hd, d), p + "self_attn.k_proj.weight": rnd(nkv * hd, d),
                    p + "self_attn.v_proj.weight": rnd(nkv * hd, d), p + "self_attn.o_proj.weight": rnd(d, nh * hd),
                    p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)})
        if moe:
            mi, si = c["moe_intermediate_size"], c.get("shared_expert_intermediate_size") or 0
            new[p + "mlp.gate.weight"] = rnd(c["num_experts"], d)
            for e in range(c["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                new.update({q + "gate_proj.weight": rnd(mi, d), q + "up_proj.weight": rnd(mi, d),
                            q + "down_proj.weight": rnd(d, mi)})
            if si:
                q = p + "mlp.shared_expert."
                new.update({q + "gate_proj.weight": rnd(si, d), q + "up_proj.weight": rnd(si, d),
                            q + "down_proj.weight": rnd(d, si), p + "mlp.shared_expert_gate.weight": rnd(1, d)})
        else:
            it = c["intermediate_size"]
            new.update({p + "mlp.gate_proj.weight": rnd(it, d), p + "mlp.up_proj.weight": rnd(it, d),
                        p + "mlp.down_proj.weight": rnd(d, it)})
    st = os.path.join(folder, "model.safetensors")
    sd = load_file(st)
    sd.update(new)
    save_file(sd, st, metadata={"format": "pt"})
    c["mtp_num_hidden_layers" if c.get("model_type", "").startswith("qwen3_5") else "num_nextn_predict_layers"] = \
        num_layers
    with open(cfg_path, "w") as f:
        json.dump(raw, f, indent=2)
    return folder
