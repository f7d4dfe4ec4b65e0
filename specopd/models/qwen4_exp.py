"""Our own ``qwen4_exp`` text target (HF transformers 5.24 ``Qwen4ExpForCausalLM``): QSA + Gated DeltaNet with
hyper-connections, PLE n-gram embeddings and MoE. Layer structure: specopd/models/DESIGN.md ("qwen4_exp").
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from specopd.models.base import DecoderLayer as BaseDecoderLayer
from specopd.models.base import TargetModel
from specopd.models.common import Linear, MoE, RMSNorm, masked_attention, rope_cos_sin
from specopd.models.context import RunContext
from specopd.models.qwen3_next import GatedAttention, GatedDeltaNet, stack_expert_tensors
from specopd.models.registry import register_model

# ----------------------------------------------------------------------------------------- helpers


class GroupRMSNorm(nn.Module):
    """HF Qwen4ExpTextRMSNorm with ``group_size``: zero-centred (1 + w) RMSNorm over each group of the last dim."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-6):
        super().__init__()
        if dim % group_size:
            raise ValueError(f"hidden_size ({dim}) must be divisible by group_size ({group_size})")
        self.eps, self.group_size = float(eps), int(group_size)
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float().reshape(*x.shape[:-1], -1, self.group_size)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (h * (1.0 + self.weight.float())).type_as(x)


def rope_last(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first rot_dim channels of x [..., hd] with cos/sin broadcastable to [..., rot_dim]."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    return torch.cat([xr * cos + rot * sin, xp], dim=-1)


def select_groups(scores: torch.Tensor, n_complete: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k groups per query with deterministic ties (the lowest group index wins).

    scores [Q, G] fp32 (entries at g >= n_complete are ignored); n_complete [Q] long; -> [Q, k] long,
    the selected group indices ascending, padded with -1 (fewer than k complete groups).
    """
    q, g = scores.shape
    if g == 0 or k == 0:
        return torch.full((q, k), -1, dtype=torch.long, device=scores.device)
    valid = torch.arange(g, device=scores.device) < n_complete[:, None]
    s = scores.float().masked_fill(~valid, float("-inf"))
    kk = min(k, g)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :kk]
    keep = torch.arange(kk, device=scores.device) < n_complete.clamp(max=kk)[:, None]
    big = torch.iinfo(torch.long).max
    sel = torch.where(keep, order, torch.full_like(order, big)).sort(dim=-1).values
    sel = torch.where(sel == big, torch.full_like(sel, -1), sel)
    if kk < k:
        sel = torch.cat([sel, sel.new_full((q, k - kk), -1)], dim=1)
    return sel


# ----------------------------------------------------------------------------------------- QSA


class QSAIndexer(nn.Module):
    """Parameters of HF ``Qwen4ExpTextQSAIndexer`` (the math lives in ``QSAttention``)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.n_heads, self.head_dim = int(cfg["indexer_n_heads"]), int(cfg["indexer_head_dim"])
        if int(cfg.get("indexer_kv_heads") or 1) != 1:
            raise ValueError("qwen4_exp QSA needs indexer_kv_heads = 1 (as transformers requires)")
        self.index_qk_proj = Linear(cfg["hidden_size"], (self.n_heads + 1) * self.head_dim, bias=False)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_layernorm = RMSNorm(self.head_dim, eps, unit_offset=True)
        self.k_layernorm = RMSNorm(self.head_dim, eps, unit_offset=True)


class QSAttention(GatedAttention):
    """qwen4_exp ``indexed_attention`` (kind "qsa"): qwen3_5's gated attention (``project`` / ``finish`` /
    ``scaling`` inherited) plus the QSA indexer. Pieces the executor uses: ``index_project``, ``pool_keys``,
    ``index_scores``, ``select`` (see ``select_groups``), ``ratio``, ``topk``. ``record``: set to a list to
    collect plain-forward selections ([B, T, topk] per call)."""

    kind = "qsa"

    def __init__(self, cfg: dict, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.layer_idx = layer_idx
        self.indexer = QSAIndexer(cfg)
        self.ratio = int(cfg["indexer_compress_ratio"])
        budget = int(cfg["indexer_budget"])
        if budget % self.ratio:
            raise ValueError(f"indexer_budget ({budget}) must be a multiple of indexer_compress_ratio ({self.ratio})")
        self.topk = budget // self.ratio
        self.inv_freq = self.rotary.inv_freq  # the indexer uses the attention's RoPE (CPU fp32, not a buffer)
        if self.inv_freq.numel() * 2 > self.indexer.head_dim:
            raise ValueError("the attention's rotary dim must fit the QSA index head (indexer_head_dim)")
        self.record: Optional[list] = None

    def _cos_sin(self, positions: torch.Tensor, dtype):
        return rope_cos_sin(positions, self.inv_freq, dtype)

    # ---------------------------------------------------------------- pieces
    def index_project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, D] -> index queries [B, T, Hi, di] (q_layernorm + RoPE), raw index keys [B, T, di], both fp32
        whatever x's dtype: selection is discrete, so the indexer runs in fp32 from the projection on (a bf16
        rounding flip would change which tokens a query attends, and differently in prefill, score and commit,
        which compute the same rows in different batches)."""
        b, t, _ = x.shape
        ix = self.indexer
        proj = torch.nn.functional.linear(x.float(), ix.index_qk_proj.weight.float())
        q, raw = torch.split(proj, [ix.n_heads * ix.head_dim, ix.head_dim], dim=-1)
        q = ix.q_layernorm(q.reshape(b, t, ix.n_heads, ix.head_dim))
        cos, sin = self._cos_sin(positions, torch.float32)
        return rope_last(q, cos[:, :, None], sin[:, :, None]), raw

    def pool_keys(self, raw_groups: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """raw_groups [..., ratio, di], starts [...] (position of each group's first token) -> keys [..., di]
        (fp32: mean, k_layernorm and RoPE in fp32, see ``index_project``)."""
        pooled = raw_groups.float().mean(dim=-2)
        pooled = self.indexer.k_layernorm(pooled)
        cos, sin = self._cos_sin(starts, pooled.dtype)
        return rope_last(pooled, cos, sin)

    def index_scores(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [..., Hi, di], keys [..., G, di] -> fp32 scores [..., G] = sum_h relu(q_h . k_g) / sqrt(di)."""
        s = torch.matmul(q.float(), keys.float().transpose(-1, -2))  # [..., Hi, G]
        return torch.relu(s).sum(dim=-2) / math.sqrt(self.indexer.head_dim)

    def select(self, scores: torch.Tensor, n_complete: torch.Tensor) -> torch.Tensor:
        return select_groups(scores, n_complete, self.topk)

    # ---------------------------------------------------------------- plain causal forward (the reference)
    def token_mask(self, sel: torch.Tensor, last: torch.Tensor, length: int) -> torch.Tensor:
        """Selected groups sel [Q, topk] (-1 padded) of queries at positions last [Q] (visible 0..last)
        -> [Q, length] bool over positions: the selected groups' tokens plus the tail after the last
        complete group (up to and including the query)."""
        r, dev = self.ratio, sel.device
        n = (last + 1) // r
        j = torch.arange(length, device=dev)
        gm = torch.zeros(sel.shape[0], length // r + 2, dtype=torch.bool, device=dev)
        gm.scatter_(-1, torch.where(sel >= 0, sel, gm.shape[1] - 1), True)
        gm[:, -1] = False
        picked = gm[:, (j // r).clamp(max=gm.shape[1] - 1)] & (j[None, :] < (r * n)[:, None])
        tail = (j[None, :] >= (r * n)[:, None]) & (j[None, :] <= last[:, None])
        return picked | tail

    def selection_mask(self, q_idx: torch.Tensor, raw: torch.Tensor, positions: torch.Tensor):
        """Plain causal selection. q_idx [B, T, Hi, di], raw [B, T, di], positions [B, T] (query i sees
        tokens 0..i) -> (mask [B, T, T] bool: query i may attend token j, selected groups [B, T, topk])."""
        b, t = raw.shape[:2]
        r, dev = self.ratio, raw.device
        g = t // r
        keys = self.pool_keys(raw[:, : g * r].reshape(b, g, r, raw.shape[-1]), positions[:, : g * r: r])  # [B, G, di]
        scores = self.index_scores(q_idx, keys.unsqueeze(1))  # [B, T, G]
        last = torch.arange(t, device=dev)
        sel = self.select(scores.reshape(b * t, g), ((last + 1) // r).repeat(b)).view(b, t, self.topk)
        mask = self.token_mask(sel.reshape(b * t, -1), last.repeat(b), t).view(b, t, t)
        return mask, sel

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], positions [B, T] -> [B, T, D]: each query attends to its own QSA selection."""
        q, k, v, gate = self.project(x, positions)
        q_idx, raw = self.index_project(x, positions)
        mask, sel = self.selection_mask(q_idx, raw, positions)
        if self.record is not None:
            self.record.append(sel)
        return self.finish(masked_attention(q, k, v, mask, self.scaling), gate)


# ----------------------------------------------------------------------------------------- hyper-connections


class GatedResidual(nn.Module):
    """HF ``Qwen4ExpTextGatedResidual``: mixes hc streams [..., hc*D] into one [..., D] input and (with
    ``combine``) gives the per-stream injection weights [..., hc] for the block output."""

    def __init__(self, cfg: dict, combine: bool = True):
        super().__init__()
        self.hc, self.d = int(cfg["hc_count"]), int(cfg["hidden_size"])
        n = self.hc * self.d
        self.hc_norm = GroupRMSNorm(n, self.d, cfg.get("rms_norm_eps", 1e-6))
        self.input_mix_weight_down = Linear(n, int(cfg["hc_lowrank"]), bias=False)
        self.input_mix_weight_up = Linear(int(cfg["hc_lowrank"]), n, bias=False)
        self.block_inject_weight = Linear(n, self.hc, bias=False) if combine else None

    def forward(self, streams: torch.Tensor):
        normed = self.hc_norm(streams)
        w = F.silu(self.input_mix_weight_down(normed) / self.hc)
        w = torch.sigmoid(self.input_mix_weight_up(w)).unflatten(-1, (self.hc, self.d))
        mixed = (w * normed.unflatten(-1, (self.hc, self.d))).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc)

    @staticmethod
    def inject(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """streams [..., hc*D] + out [..., D] * weights [..., hc] (per stream)."""
        return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


# ----------------------------------------------------------------------------------------- PLE

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2, _PRIME_1 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 10007


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def ngram_multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> list:
    """HF ``_build_layer_multipliers`` as python ints: the hash multipliers of one PLE layer's n-gram embedding.

    Args:
        vocab: the n-gram table size.
        ngram_size: n.
        ple_index: the PLE layer's index.
        seed: the config's hash seed.

    Returns:
        list of n python ints.
    """
    half = max(1, (((1 << 63) - 1) // max(vocab, 1)) // 2)
    base = seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(v: int) -> bool:
    if v < 2 or (v % 2 == 0 and v != 2):
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


def _primes_after(start: int, count: int) -> list:
    out, p = [], start
    while len(out) < count:
        p += 1
        if _is_prime(p):
            out.append(p)
    return out


class NGramEmbedding(nn.Module):
    """HF ``Qwen4ExpTextNGramEmbedding``: (ngram_size - 1) * heads_per_ngram hashed embedding heads.
    ``forward(ids [B, T], prev [B, T, ngram_size - 1] (-1 before the start)) -> [B, T, ple_embed_dim]``."""

    def __init__(self, cfg: dict, ple_index: int):
        super().__init__()
        self.ngram_size, self.heads_per_ngram = int(cfg.get("ngram_size", 3)), int(cfg.get("heads_per_ngram", 8))
        n_heads = (self.ngram_size - 1) * self.heads_per_ngram
        dim = int(cfg.get("ple_embed_dim") or cfg["hidden_size"])
        if n_heads <= 0 or dim % n_heads:
            raise ValueError(f"ple_embed_dim ({dim}) must be a positive multiple of the n-gram heads ({n_heads})")
        eos = cfg.get("eos_token_id")
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        if eos is None:
            raise ValueError("qwen4_exp PLE layers need eos_token_id in config.json")
        self.eos = int(eos)
        self.mult = ngram_multipliers(int(cfg["vocab_size"]), self.ngram_size, ple_index, int(cfg.get("seed", 1234)))
        base = int(cfg.get("ngram_vocab_size_base", 20_000_000))
        # head h of layer index l uses the (l * n_heads + h + 1)-th prime after base - 1
        primes = _primes_after(base - 1, (ple_index + 1) * n_heads)[ple_index * n_heads:]
        self.sizes = primes
        self.offsets = [sum(primes[:i]) for i in range(n_heads)]
        div = int(cfg.get("make_ngram_vocab_size_divisible_by", 128))
        padded = math.ceil(sum(primes) / div) * div
        self.ngram_embedding = nn.Embedding(padded, dim // n_heads)

    def forward(self, ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        eos = torch.full_like(ids, self.eos)
        shifted, broken = [ids], torch.zeros_like(ids, dtype=torch.bool)
        for s in range(1, self.ngram_size):  # token s back, EOS once an EOS (or the start) lies in between
            p = prev[..., s - 1].long()
            broken = broken | (p < 0) | (p == self.eos)
            shifted.append(torch.where(broken, eos, p))
        sizes = torch.tensor(self.sizes, dtype=torch.long, device=ids.device)
        offsets = torch.tensor(self.offsets, dtype=torch.long, device=ids.device)
        blocks = []
        for n in range(2, self.ngram_size + 1):
            a, b = (n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram
            mixed = shifted[0] * self.mult[0]
            for p in range(1, n):
                mixed = torch.bitwise_xor(mixed, shifted[p] * self.mult[p])
            blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes[a:b]) + offsets[a:b])
        return self.ngram_embedding(torch.cat(blocks, dim=-1)).flatten(-2)


class DilatedConv(nn.Module):
    """Depthwise causal conv with dilation (kind "conv"): out[t] = sum_j w[:, j] * x[t - (K-1-j) * dil],
    zeros before the start. x [B, T, C] -> [B, T, C] (no activation). ``taps()``: offsets back per weight.
    fp32: ``F.conv1d``. bf16 / fp16: ``tap_sum`` (fp32 accumulation, taps in weight order, one rounding), which
    the executor's score path uses too, so a token's row is bitwise the same in every path (it feeds the MoE
    router and the QSA indexer: discrete decisions)."""

    kind = "conv"

    def __init__(self, channels: int, kernel: int, dilation: int):
        super().__init__()
        self.kernel, self.dilation = int(kernel), int(dilation)
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))

    def taps(self) -> list:
        """[(steps_back, j)] for every weight column j (steps_back 0 = the token itself)."""
        return [((self.kernel - 1 - j) * self.dilation, j) for j in range(self.kernel)]

    def tap_sum(self, cols: list, dtype: torch.dtype) -> torch.Tensor:
        """cols[j] [..., C]: the inputs weight column j reads -> sum_j cols[j] * w[:, j] [..., C] in ``dtype``,
        accumulated in fp32 from zero in weight order (fp32 inputs: the same ops as fp32 accumulation)."""
        w = self.weight[:, 0, :].float()  # [C, K]
        out = torch.zeros(cols[0].shape, dtype=torch.float32, device=cols[0].device)
        for j, col in enumerate(cols):
            out = out + col.float() * w[:, j]
        return out.to(dtype)

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        span = (self.kernel - 1) * self.dilation
        if x.dtype != torch.float32:
            h = F.pad(x, (0, 0, span, 0))  # [B, span + T, C]
            t = x.shape[1]
            return self.tap_sum([h[:, span - back: span - back + t] for back, _ in self.taps()], x.dtype)
        h = F.pad(x.transpose(1, 2), (span, 0))
        return F.conv1d(h, self.weight.to(x.dtype), groups=x.shape[-1], dilation=self.dilation).transpose(1, 2)


class PLELayer(nn.Module):
    """HF ``Qwen4ExpTextPLELayer``: streams [B, T, hc*D] -> the addition to the streams [B, T, hc*D]."""

    def __init__(self, cfg: dict, ple_index: int):
        super().__init__()
        self.hc, self.d = int(cfg["hc_count"]), int(cfg["hidden_size"])
        e, n, eps = int(cfg.get("ple_embed_dim") or self.d), self.hc * self.d, cfg.get("rms_norm_eps", 1e-6)
        self.ple_embedding = NGramEmbedding(cfg, ple_index)
        self.key_proj = Linear(e, n, bias=False)
        self.value_proj = Linear(e, self.d, bias=False)
        self.norm_key = GroupRMSNorm(n, self.d, eps)
        self.norm_query = GroupRMSNorm(n, self.d, eps)
        self.norm_conv = GroupRMSNorm(n, self.d, eps)
        self.conv1d = DilatedConv(n, int(cfg.get("ple_conv_kernel_size", 4)), self.ple_embedding.ngram_size)

    def forward(self, streams: torch.Tensor, ctx: RunContext, layer_idx: int) -> torch.Tensor:
        emb = self.ple_embedding(ctx.input_ids, ctx.prev_tokens(self.ple_embedding.ngram_size - 1))
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.hc, self.d))
        value = self.value_proj(emb)
        query = self.norm_query(streams).unflatten(-1, (self.hc, self.d))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.d)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
        conv = ctx.mix((layer_idx, "ple_conv"), self.conv1d, self.norm_conv(gated))
        return gated + F.silu(conv)


# ----------------------------------------------------------------------------------------- model


class DecoderLayer(BaseDecoderLayer):
    def __init__(self, cfg: dict, layer_idx: int, layer_type: str, ple_index: Optional[int]):
        super().__init__()
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, fused_qkvz=False)
        else:
            self.self_attn = QSAttention(cfg, layer_idx)
        self.mlp = MoE.from_config(cfg)
        self.ple = PLELayer(cfg, ple_index) if ple_index is not None else None
        self.attn_hyper_connection = GatedResidual(cfg)
        self.mlp_hyper_connection = GatedResidual(cfg)


class _Backbone(nn.Module):
    def __init__(self, cfg: dict, layers: list):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(layers)
        self.hyper_connection_mixer = GatedResidual(cfg, combine=False)


def _layer_types(cfg: dict) -> list:
    n = cfg["num_hidden_layers"]
    lt = cfg.get("layer_types")
    if lt is None:
        every = cfg.get("full_attention_interval", 4) or 4
        lt = ["linear_attention" if (i + 1) % every else "indexed_attention" for i in range(n)]
    lt = ["indexed_attention" if t == "full_attention" else t for t in list(lt)[:n]]
    bad = sorted({t for t in lt if t not in ("linear_attention", "indexed_attention")})
    if bad or len(lt) != n:
        raise ValueError(f"qwen4_exp layer_types must name {n} layers 'linear_attention' / 'indexed_attention'; got {lt}")
    return lt


@register_model("qwen4_exp", "qwen4_exp_text")
class Qwen4ExpTarget(TargetModel):
    """qwen4_exp text model: QSA + Gated DeltaNet, hyper-connection streams, PLE, MoE."""

    fp32_params = ("A_log",)

    def __init__(self, cfg: dict):
        super().__init__()
        cfg = dict(cfg)
        self.model_type = cfg.get("model_type")
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        types = _layer_types(cfg)
        if "indexed_attention" in types:
            missing = [k for k in ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
                       if not cfg.get(k)]
            if missing:
                raise ValueError(f"qwen4_exp indexed_attention layers need {missing} in config.json")
        cfg.setdefault("hc_count", 4)
        cfg.setdefault("hc_lowrank", 320)
        if int(cfg["hc_count"]) < 1:
            raise ValueError(f"hc_count must be >= 1, got {cfg['hc_count']}")
        ple_ids = sorted(set(cfg.get("ple_layer_ids") or []))
        n = cfg["num_hidden_layers"]
        for lid in ple_ids:
            if not 1 <= lid <= n or types[lid - 1] != "linear_attention":
                raise ValueError(f"ple_layer_ids are 1-indexed linear_attention layers; {lid} is not one")
        ple_index = {lid - 1: k for k, lid in enumerate(ple_ids)}
        self.config = SimpleNamespace(**cfg)
        self.model = _Backbone(cfg, [DecoderLayer(cfg, i, types[i], ple_index.get(i)) for i in range(n)])
        self.lm_head = Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.layer_kinds = ["gdn" if t == "linear_attention" else "qsa" for t in types]
        self.hc = int(cfg["hc_count"])
        tie = cfg.get("tie_word_embeddings", False)
        self.tied_params = {"lm_head.weight": "model.embed_tokens.weight"} if tie else {}

    @staticmethod
    def checkpoint_key(name: str) -> Optional[str]:
        if name.startswith(("mtp.", "model.mtp.", "model.visual.", "visual.")):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        # computed from the config (HF keeps them as buffers)
        if name.endswith(("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_vocab_sizes",
                          "ple_embedding.ngram_heads_offsets")):
            return None
        return name

    @staticmethod
    def convert_checkpoint(raw: dict, cfg: Optional[dict] = None) -> dict:
        """Per-expert tensors -> stacked experts; ``ngram_embedding.shard_<i>.weight`` -> one table (dim 0)."""
        raw = stack_expert_tensors(raw)
        shards: dict = {}
        out = {}
        for name, t in raw.items():
            head, sep, tail = name.partition("ngram_embedding.shard_")
            if sep and tail.endswith(".weight") and tail[: -len(".weight")].isdigit():
                shards.setdefault(head + "ngram_embedding.weight", {})[int(tail[: -len(".weight")])] = t
            else:
                out[name] = t
        want = (cfg or {}).get("split_ngram_parts")
        for key, parts in shards.items():
            n = int(want) if want else len(parts)
            if sorted(parts) != list(range(n)):
                raise ValueError(f"{key}: the checkpoint has n-gram embedding shards {sorted(parts)}, expected "
                                 f"0..{n - 1} (split_ngram_parts in config.json); is a safetensors file missing?")
            out[key] = torch.cat([parts[i] for i in range(len(parts))], dim=0)
        return out


    def head(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] (the hyper-connection mixer's output) -> logits [..., V]. No separate final norm."""
        return self.lm_head(h)

    def backbone(self, ctx: RunContext) -> torch.Tensor:
        """ids -> streams [B, T, hc*D] through the layers -> mixed [B, T, D]. Records the stream mean."""
        s = self.embed(ctx.input_ids).repeat(1, 1, self.hc)
        for i, layer in enumerate(self.model.layers):
            if layer.ple is not None:
                s = s + layer.ple(s, ctx, i)
            x, w = layer.attn_hyper_connection(s)
            s = GatedResidual.inject(s, ctx.mix(i, layer.mixer, x), w)
            x, w = layer.mlp_hyper_connection(s)
            s = GatedResidual.inject(s, layer.mlp(x), w)
            ctx.record(i, s.unflatten(-1, (self.hc, -1)).mean(dim=-2))
        return self.model.hyper_connection_mixer(s)
