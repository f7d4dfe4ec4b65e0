"""An independent transcription of vLLM 0.32's DFlash V2 (``vllm/model_executor/models/qwen3_dflash2.py``,
``DFlash2DraftModel``; the drafting walk of ``vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py``) in plain
torch, for tests/test_dflash2.py. It reads a released-layout folder itself (config.json + safetensors +
optional mask_embedding.pt) and does not import ``specopd.drafters``.

What is transcribed, in vLLM's own layout:
- the query rows of all blocks flattened ([N * S, D], S = 1 + num_speculative_tokens), as vLLM's model runner lays
  them out; the grouped convolution is the CPU branch of ``_grouped_conv`` (position = row % block_size, tap t
  masked where position < t), attention per block over [context ; block] (context K/V from
  hidden_norm(fc(features)), never convolved);
- ``LogitsProcessor.get_top_k_tokens``: top K of the raw lm_head logits, values * output_multiplier, then the soft
  cap (that order: it is the path ``compute_candidates`` takes);
- ``_score_edges`` ([N, W, K, K]) and the walk (``_selector_walk_kernel``): argmax at T = 0, else argmax of
  scores / T + Gumbel noise (given here, one value per candidate slot), the realized row scattered into -inf draft
  logits (``_cache_draft_logits_kernel``).
"""
from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F

from tests.dflash_reference import _rms, _rot


def grouped_conv(x, delta, base, block_size, num_groups, group_size, taps):
    """vLLM ``_grouped_conv`` (CPU branch): x [rows, D], delta [rows, taps, groups], base [taps, D]."""
    blocks = x.unflatten(-1, (num_groups, group_size))
    coefficients = base.view(1, taps, num_groups, group_size) + delta.unsqueeze(-1)
    output = coefficients[:, 0] * blocks
    position = torch.arange(x.shape[0]) % block_size
    for tap in range(1, taps):
        shifted = F.pad(blocks[:-tap], (0, 0, 0, 0, tap, 0))
        output += coefficients[:, tap] * shifted * (position >= tap).view(-1, 1, 1)
    return output.flatten(-2)


class DFlash2Reference:
    """The V2 drafter of ``folder`` on a target given by its frozen ``embed`` [V, D] and ``lm_head`` [V, D]."""

    def __init__(self, folder: str, embed: torch.Tensor, lm_head: torch.Tensor):
        from safetensors.torch import load_file

        with open(os.path.join(folder, "config.json")) as f:
            self.cfg = c = json.load(f)
        assert c["architectures"] == ["DFlash2DraftModel"], c["architectures"]
        dc = c["dflash_config"]
        self.w = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
        self.embed, self.lm_head = embed.float(), lm_head.float()
        self.mask_id = dc["mask_token_id"]
        self.mask_vec = None
        mf = os.path.join(folder, "mask_embedding.pt")
        if os.path.isfile(mf):
            st = torch.load(mf, weights_only=True)
            self.mask_vec = (st["embedding"] if isinstance(st, dict) else st).float().reshape(-1)
        self.bs = int(c["block_size"])  # serve with num_speculative_tokens = bs - 1: the conv's block is bs rows
        self.layers = int(c["num_hidden_layers"])
        self.h, self.hkv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
        self.hd = int(c.get("head_dim") or c["hidden_size"] // self.h)
        self.eps, self.theta = float(c["rms_norm_eps"]), float(c["rope_theta"])
        self.taps, self.gs = int(dc["conv_kernel_size"]), int(dc["conv_group_size"])
        self.groups = int(c["hidden_size"]) // self.gs
        self.top_k = int(dc["selector_top_k"])
        self.emb_scale = float(dc.get("input_embedding_scale", 1.0))
        self.scale = float(dc.get("output_multiplier", 1.0))
        cap = float(dc.get("final_logit_softcapping") or 0.0)
        self.cap = cap if cap > 0 else None

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed[ids].clone()
        if self.mask_vec is not None:
            x[ids == self.mask_id] = self.mask_vec
        return x * self.emb_scale

    def _prepare(self, prefix, x):
        """``DFlashGroupedConv.prepare``: (conv side 0 of x, the side-1 coefficients)."""
        coef = (x @ self.w[prefix + ".kernel_projection.weight"].T).reshape(x.shape[0], 2, self.taps, self.groups)
        base = self.w[prefix + ".base_kernel"]
        out = grouped_conv(x, coef[:, 0], base[0], self.bs, self.groups, self.gs, self.taps)
        return out, coef[:, 1]

    def _finish(self, prefix, x, coef):
        return grouped_conv(x, coef, self.w[prefix + ".base_kernel"][1], self.bs, self.groups, self.gs, self.taps)

    def _attention(self, p, y, ctxs, anchors):
        """Per block b: queries of its rows over [k_proj(ctx_b) ; k_proj(block)] (non-causal). y [N * S, D]."""
        w, eps, rep = self.w, self.eps, self.h // self.hkv
        outs = []
        for b, (ctx, a) in enumerate(zip(ctxs, anchors)):
            yb = y[b * self.bs: (b + 1) * self.bs]
            pos_c, pos_b = torch.arange(a), a + torch.arange(self.bs)
            q = (yb @ w[p + "self_attn.q_proj.weight"].T).view(self.bs, self.h, self.hd)
            q = _rot(_rms(q, w[p + "self_attn.q_norm.weight"], eps), pos_b, self.theta)
            keys, vals = [], []
            for src, pos in ((ctx, pos_c), (yb, pos_b)):
                k = (src @ w[p + "self_attn.k_proj.weight"].T).view(-1, self.hkv, self.hd)
                keys.append(_rot(_rms(k, w[p + "self_attn.k_norm.weight"], eps), pos, self.theta))
                vals.append((src @ w[p + "self_attn.v_proj.weight"].T).view(-1, self.hkv, self.hd))
            k = torch.cat(keys).repeat_interleave(rep, 1)
            v = torch.cat(vals).repeat_interleave(rep, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.hd), -1)
            outs.append(torch.einsum("hqk,khd->qhd", att, v).reshape(self.bs, -1) @ w[p + "self_attn.o_proj.weight"].T)
        return torch.cat(outs)

    def hidden(self, feats, anchors, anchor_tokens) -> torch.Tensor:
        """feats: per block its trunk's features [T_b, F]; anchors [N]; anchor_tokens [N] -> normed hidden of the
        sampled rows [N, S - 1, D] (vLLM's ``last_hidden_states[sample_indices]``)."""
        w, eps = self.w, self.eps
        anchors = [int(a) for a in anchors]
        ctxs = [_rms(f[:a].float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps) for f, a in zip(feats, anchors)]
        ids = torch.cat([torch.tensor([int(t)] + [self.mask_id] * (self.bs - 1)) for t in anchor_tokens])
        x = self._embed(ids)  # [N * S, D]: the flattened query rows
        for i in range(self.layers):
            p = f"layers.{i}."
            y = _rms(x, w[p + "input_layernorm.weight"], eps)
            y, coef = self._prepare(p + "attention_conv", y)
            a = self._finish(p + "attention_conv", self._attention(p, y, ctxs, anchors), coef)
            x = x + a
            y = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            y, coef = self._prepare(p + "mlp_conv", y)
            m = (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
            x = x + self._finish(p + "mlp_conv", m, coef)
        out = _rms(x, w["norm.weight"], eps)
        return out.view(len(anchors), self.bs, -1)[:, 1:]

    def block_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The candidate logits over the vocabulary [.., V]: raw lm_head logits, * multiplier, then the soft cap."""
        x = h @ self.lm_head.T
        if self.scale != 1.0:
            x = x * self.scale
        if self.cap is not None:
            x = torch.tanh(x / self.cap) * self.cap
        return x

    def candidates(self, h: torch.Tensor):
        """``compute_candidates``: (ids [N, W, K], values [N, W, K])."""
        values, ids = torch.topk(h @ self.lm_head.T, self.top_k, dim=-1)
        values = values.float()
        if self.scale != 1.0:
            values = values * self.scale
        if self.cap is not None:
            values = torch.tanh(values / self.cap) * self.cap
        return ids, values

    def scores(self, h, ids, unary, anchor_tokens) -> torch.Tensor:
        """``_score_edges``: [N, W, K (previous), K (candidate)]."""
        hidden = h @ self.w["candidate_selector.hidden_projection.weight"].T
        successors = self.w["candidate_selector.successor_codebook"][ids]
        pred_ids = torch.cat((torch.as_tensor(anchor_tokens)[:, None, None].expand(-1, 1, self.top_k), ids[:, :-1]), 1)
        predecessors = self.w["candidate_selector.predecessor_codebook"][pred_ids]
        return unary[:, :, None] + torch.einsum("blpr,blcr->blpc", predecessors * hidden[:, :, None], successors)

    def walk(self, scores, ids, temperature: float, noise=None):
        """``_selector_walk_kernel`` for every row: previous = 0; per step the scores row of the previous choice,
        argmax (T = 0) or argmax(row / T + noise[n, step]) (noise [N, W, K]: the Gumbel values of the candidates),
        the realized row kept. -> (tokens [N, W], realized scores [N, W, K], draft logits [N, W, V] (-inf off the
        candidates))."""
        n, steps, k = ids.shape
        tokens = torch.zeros(n, steps, dtype=torch.long)
        realized = torch.zeros(n, steps, k)
        for row in range(n):
            previous = 0
            for step in range(steps):
                s = scores[row, step, previous]
                z = s if temperature == 0 else s / temperature + noise[row, step]
                index = int(torch.argmax(z))
                realized[row, step] = s
                tokens[row, step] = ids[row, step, index]
                previous = index
        logits = torch.full((n, steps, self.lm_head.shape[0]), float("-inf"))
        logits.scatter_(-1, ids, realized)
        return tokens, realized, logits
