"""DFlash: a parallel block drafter conditioned on target features (one forward for all branches).

Shapes: N branches, W = block_size, D = target hidden size, V = vocab, F = len(feature_layers) * D.

- Context of branch b (anchor a_b on trunk t_b): the target features of trunk positions p < a_b,
  ``c = RMSNorm(fc(features[:a_b]))`` [a_b, D]. At inference a_b == len(trunk) is allowed (the anchor
  is the bonus token the target has not run yet); a_b > len(trunk) is an error.
- Block: ``[anchor token, mask x W]``; the anchor token is embedded with the target's frozen embedding,
  the W mask slots all start from one *learned* vector ``mask_embedding`` [D] (no mask token id needed).
  RoPE at semantic positions: context position p -> p, block slot k -> a_b + k (anchor at a_b, mask j
  at a_b + 1 + j).
- Each draft layer: ``h += Attn(RMSNorm(h))``, ``h += SwiGLU(RMSNorm(h))``; queries from the block only;
  keys/values ``[kv_proj(c) ; kv_proj(RMSNorm(h))]`` (per-head q/k RMSNorm as in DFlash / Qwen3);
  non-causal inside the block, context keys ``p < a_b`` only.
- Output: the drafter's RMSNorm, then ``target.head`` (the target's own final norm + frozen lm_head)
  at the W mask slots -> logits [N, W, V] (fp32, raw: no temperature applied).

The target is kept outside the module tree (``self.__dict__``) so ``state_dict()`` holds only the
drafter's trainable weights and ``.parameters()`` never yields target weights.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from specopd.models.common import MLP, RMSNorm, apply_rope, rope_cos_sin

INIT_STD = 0.02


@dataclass
class DrafterConfig:
    """Everything needed to rebuild a drafter (saved as config.json)."""

    kind: str
    num_layers: int
    block_size: int
    feature_layers: tuple
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = True
    hidden_act: str = "silu"
    markov_rank: int = 256  # DSpark only
    target: dict = field(default_factory=dict)  # model_type, vocab_size, hidden_size, num_hidden_layers


def _tcfg(target, name, default=None):
    cfg = target.config
    val = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
    return default if val is None else val


def target_identity(target) -> dict:
    return {"model_type": str(getattr(target, "model_type", None) or _tcfg(target, "model_type", "?")),
            "vocab_size": int(target.vocab_size), "hidden_size": int(target.hidden_size),
            "num_hidden_layers": int(target.num_layers)}


def target_rope_theta(target) -> float:
    theta = _tcfg(target, "rope_theta")
    if theta is None:
        rp = _tcfg(target, "rope_parameters") or {}
        theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    return float(theta if theta is not None else 10000.0)


def pick_tokens(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """logits [..., V] -> tokens [...]: argmax at T = 0, else a draw from softmax(logits / T) with ``generator``."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy); got {temperature}")
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / float(temperature), dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


class DraftAttention(nn.Module):
    """Block queries attend to [context keys of p < a ; all block keys]."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.h, self.hkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        if self.h % self.hkv:
            raise ValueError(f"num_heads ({self.h}) must be a multiple of num_kv_heads ({self.hkv})")
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps) if c.qk_norm else nn.Identity()

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, D] -> k, v [B, T, Hkv, hd] (k normed and rotated)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.hkv, self.hd))
        return apply_rope(k, cos, sin), self.v_proj(x).view(b, t, self.hkv, self.hd)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_valid):
        """x [N, S, D] block; cos/sin [N, S, hd]; ctx_k/ctx_v [N, C, Hkv, hd]; ctx_valid [N, C] bool."""
        n, s, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(n, s, self.h, self.hd)), cos, sin)
        kb, vb = self.kv(x, cos, sin)
        k = torch.cat([ctx_k, kb], 1).transpose(1, 2)
        v = torch.cat([ctx_v, vb], 1).transpose(1, 2)
        mask = torch.cat([ctx_valid, ctx_valid.new_ones(n, s)], 1)[:, None, None, :]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=self.hd ** -0.5,
                                           enable_gqa=self.h != self.hkv)
        return self.o_proj(o.transpose(1, 2).reshape(n, s, self.h * self.hd))


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act)

    def forward(self, h, cos, sin, ctx_k, ctx_v, ctx_valid):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, ctx_valid)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """DFlash block drafter. Build with ``specopd.drafters.build_drafter``; see the module docstring."""

    kind = "dflash"
    has_confidence = False

    def __init__(self, target, config: DrafterConfig, seed: int = 0):
        super().__init__()
        self.__dict__["target"] = target  # not a submodule: no target weights in state_dict / parameters
        self.config = c = config
        ident = target_identity(target)
        if c.hidden_size != ident["hidden_size"]:
            raise ValueError(f"drafter hidden_size {c.hidden_size} != target hidden_size {ident['hidden_size']}: "
                             f"the drafter shares the target's embeddings and head, so they must be equal")
        bad = [i for i in c.feature_layers if not 0 <= int(i) < ident["num_hidden_layers"]]
        if not c.feature_layers or bad:
            raise ValueError(f"feature_layers {tuple(c.feature_layers)} must be non-empty layer ids in "
                             f"[0, {ident['num_hidden_layers']}) of the target")
        if c.block_size < 1 or c.num_layers < 1:
            raise ValueError(f"block_size ({c.block_size}) and num_layers ({c.num_layers}) must be >= 1")
        d = c.hidden_size
        self.fc = nn.Linear(len(c.feature_layers) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self._build_extra()
        self._init_weights(seed)
        self.to(target.device)

    def _build_extra(self) -> None:
        """Hook for subclasses (DSpark heads)."""

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Deterministic in ``seed``: every Linear / Embedding weight and the mask vector ~ N(0, 0.02^2),
        biases 0, norms 1; subclasses may zero some weights afterwards."""
        g = torch.Generator().manual_seed(int(seed))
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() >= 2 or name == "mask_embedding":
                p.copy_(torch.randn(p.shape, generator=g) * INIT_STD)

    # -- properties ---------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    draft_len = property(lambda self: self.block_size)  # tokens drafted per round (the drafter rewrite resolves it)

    @property
    def feature_layers(self) -> tuple:
        return tuple(int(i) for i in self.config.feature_layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # -- the backbone -------------------------------------------------------------------------------------
    def _inputs(self, features, anchors, trunk_index, anchor_tokens):
        feats = []
        for f in ([features] if torch.is_tensor(features) else list(features)):
            if not torch.is_tensor(f):  # a TargetCache
                if tuple(f.feature_layers) != self.feature_layers:
                    raise ValueError(f"cache features are of layers {tuple(f.feature_layers)}, drafter needs "
                                     f"{self.feature_layers}: prefill(..., feature_layers=drafter.feature_layers)")
                f = f.features
            fdim = len(self.feature_layers) * self.config.hidden_size
            if f is None or f.dim() != 2 or f.shape[1] != fdim:
                raise ValueError(f"features must be [T, {fdim}] (len(feature_layers) * hidden); got "
                                 f"{None if f is None else tuple(f.shape)}; prefill with "
                                 f"feature_layers=drafter.feature_layers")
            feats.append(f)
        dev = self.fc.weight.device
        anchors = torch.as_tensor(anchors, dtype=torch.long, device=dev).reshape(-1)
        n = anchors.numel()
        trunk_index = (torch.zeros(n, dtype=torch.long, device=dev) if trunk_index is None else
                       torch.as_tensor(trunk_index, dtype=torch.long, device=dev).reshape(-1))
        if anchor_tokens is None:
            raise ValueError("anchor_tokens [N] is required (the trunk token at each anchor, or the bonus token)")
        anchor_tokens = torch.as_tensor(anchor_tokens, dtype=torch.long, device=dev).reshape(-1)
        if trunk_index.numel() != n or anchor_tokens.numel() != n or n == 0:
            raise ValueError(f"anchors, trunk_index and anchor_tokens must all be [N] with N >= 1; got "
                             f"{n}, {trunk_index.numel()}, {anchor_tokens.numel()}")
        if int(anchor_tokens.min()) < 0 or int(anchor_tokens.max()) >= self.target.vocab_size:
            raise ValueError(f"anchor_tokens must be token ids in [0, {self.target.vocab_size}); got min "
                             f"{int(anchor_tokens.min())}, max {int(anchor_tokens.max())}")
        if int(trunk_index.min()) < 0 or int(trunk_index.max()) >= len(feats):
            raise ValueError(f"trunk_index must be in [0, {len(feats)}) (one features tensor per trunk)")
        lens = torch.tensor([f.shape[0] for f in feats], device=dev)
        over = (anchors < 0) | (anchors > lens[trunk_index])
        if bool(over.any()):
            b = int(over.nonzero()[0])
            raise ValueError(f"anchor {int(anchors[b])} of branch {b} is outside [0, {int(lens[trunk_index[b]])}] "
                             f"(trunk {int(trunk_index[b])} has {int(lens[trunk_index[b]])} feature rows; an anchor "
                             f"may equal the trunk length at inference, never exceed it)")
        return feats, anchors, trunk_index, anchor_tokens

    def backbone(self, features, anchors, trunk_index=None, anchor_tokens=None) -> torch.Tensor:
        """-> h [N, W, D]: the normed drafter hidden state at the W mask slots (before target.head)."""
        feats, anchors, tix, atok = self._inputs(features, anchors, trunk_index, anchor_tokens)
        c, dt, dev = self.config, self.dtype, self.fc.weight.device
        n, w = anchors.numel(), self.block_size
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float, device=dev) / c.head_dim))
        # context: trunk i contributes its first max(anchor on i) rows, flattened [sum_i C_i, F]
        need = torch.zeros(len(feats), dtype=torch.long, device=dev).scatter_reduce(0, tix, anchors, "amax")
        need_l = need.tolist()
        cmax = max(need_l)
        offs = torch.cumsum(need, 0) - need
        pcol = torch.arange(cmax, device=dev)
        ctx_valid = pcol[None, :] < anchors[:, None]  # [N, C]
        if cmax > 0:
            flat = torch.cat([f[:k].to(device=dev, dtype=dt) for f, k in zip(feats, need_l)])
            ctx = self.hidden_norm(self.fc(flat))[None]  # [1, sumC, D]
            fpos = torch.cat([torch.arange(k, device=dev) for k in need_l])[None]
            fcos, fsin = rope_cos_sin(fpos, inv, dt)
            gather = offs[tix][:, None] + torch.minimum(pcol[None, :], (need[tix] - 1).clamp(min=0)[:, None])
        # block: [anchor, mask x W] at positions a .. a + W
        h = torch.cat([self.target.embed(atok)[:, None].to(dt), self.mask_embedding.to(dt).expand(n, w, -1)], 1)
        cos, sin = rope_cos_sin(anchors[:, None] + torch.arange(w + 1, device=dev), inv, dt)
        for layer in self.layers:
            attn = layer.self_attn
            if cmax > 0:
                k, v = attn.kv(ctx, fcos, fsin)
                ck, cv = k[0][gather], v[0][gather]  # [N, C, Hkv, hd]
            else:
                ck = cv = h.new_zeros(n, 0, attn.hkv, attn.hd)
            h = layer(h, cos, sin, ck, cv, ctx_valid)
        return self.norm(h[:, 1:])

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] -> fp32 logits [..., V] through the target's frozen final norm + lm_head."""
        return self.target.head(h.to(self.target.dtype)).float()

    def forward(self, features, anchors, trunk_index=None, anchor_tokens=None, prev_tokens=None,
                return_confidence: bool = False) -> torch.Tensor:
        """-> raw logits [N, W, V] (fp32). ``features``: list of [T_i, F] (or TargetCaches), anchors [N],
        trunk_index [N], anchor_tokens [N]; prev_tokens [N, W] is ignored by DFlash."""
        if return_confidence:
            raise ValueError("DFlash has no confidence head; build a 'dspark' drafter for confidences")
        return self.logits_from_hidden(self.backbone(features, anchors, trunk_index, anchor_tokens))

    def sample(self, features, anchors, trunk_index=None, anchor_tokens=None, temperature: float = 1.0,
               generator: Optional[torch.Generator] = None):
        """-> (tokens [N, W], raw logits [N, W, V]). T = 0: argmax; T > 0: draws from softmax(logits / T)
        with ``generator`` (on the drafter's device). Autograd is not disabled: wrap in no_grad to propose only."""
        logits = self(features, anchors, trunk_index, anchor_tokens)
        return pick_tokens(logits, temperature, generator), logits

    # -- save / load --------------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Write ``config.json`` + ``model.safetensors`` (trainable weights only) into folder ``path``."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        cfg = dataclasses.asdict(self.config)
        cfg["feature_layers"] = list(self.feature_layers)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        sd = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt", "kind": self.kind})

    @classmethod
    def load(cls, path: str, target) -> "DFlashDrafter":
        """Rebuild the drafter saved in ``path`` (any kind) on ``target``'s device."""
        from safetensors.torch import load_file

        from specopd.drafters import DRAFTERS

        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{path!r} has no config.json: not a saved drafter (drafter.save(dir) writes it)")
        with open(cfg_path) as f:
            raw = json.load(f)
        known = {fl.name for fl in dataclasses.fields(DrafterConfig)}
        cfg = DrafterConfig(**{k: v for k, v in raw.items() if k in known})
        cfg.feature_layers = tuple(cfg.feature_layers)
        if cfg.kind not in DRAFTERS:
            raise ValueError(f"{cfg_path}: unknown drafter kind {cfg.kind!r}; known: {sorted(DRAFTERS)}")
        have, saved = target_identity(target), dict(cfg.target)
        for key in ("vocab_size", "hidden_size"):
            if key in saved and int(saved[key]) != have[key]:
                raise ValueError(f"drafter in {path} was trained for a target with {key}={saved[key]}, but this "
                                 f"target has {key}={have[key]}; load it with the target it was trained for")
        for key in ("model_type", "num_hidden_layers"):
            if key in saved and saved[key] != have[key]:
                warnings.warn(f"drafter in {path} was trained for {key}={saved[key]!r}, this target has "
                              f"{have[key]!r}; continuing (vocab and hidden size match)")
        drafter = DRAFTERS[cfg.kind](target, cfg)
        sd = load_file(os.path.join(path, "model.safetensors"), device=str(target.device))
        drafter.load_state_dict(sd, strict=True)
        return drafter
