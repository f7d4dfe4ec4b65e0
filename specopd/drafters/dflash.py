"""DFlash as released (z-lab/dflash ``DFlashDraftModel``): a block of [anchor, MASK x W] over the target's features.
Shapes N branches, S = block_size (counts the anchor), W = S - 1, D hidden, V vocab, F = len(feature_layers) * D.
Design and weight names: specopd/drafters/DESIGN.md ("Drafters").
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import safetensors.torch
import torch
from torch import nn

from specopd.drafters.attention import BranchLayout, branch_attention, cached_branch_attention
from specopd.errors import open_write, replacing_path
from specopd.models.common import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq, rope_parameters
from specopd.models.tensor_parallel import vocab_group
from specopd.sampling import pick_tokens, sample_from_hidden

INIT_STD = 0.02
FORMAT = 2  # our checkpoint format: 2 = released semantics (block_size counts the anchor, no target final norm)


@dataclass
class DrafterConfig:
    """Everything needed to rebuild a drafter (our checkpoints' config.json is ``dataclasses.asdict`` of it;
    ``specopd.drafters.layout`` converts to and from the released config.json)."""

    kind: str
    num_layers: int
    block_size: int  # counts the anchor: W = block_size - 1 tokens are drafted
    feature_layers: tuple  # released dflash_config.target_layer_ids
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF rope_scaling of the drafter (released: null)
    hidden_act: str = "silu"
    mask_token_id: Optional[int] = None  # the MASK token (released dflash_config.mask_token_id)
    learned_mask: bool = False  # True: a trained vector fills the masked slots (mask_token_id only for serving)
    markov_rank: int = 256  # DSpark: rank r of the Markov head
    confidence_head: bool = True  # DSpark: enable_confidence_head
    confidence_with_markov: bool = True  # DSpark: confidence_head_with_markov ([h ; W1[x_prev]] input)
    target: dict = field(default_factory=dict)  # model_type, vocab_size, hidden_size, num_hidden_layers, ...
    format: int = FORMAT

    @property
    def draft_len(self) -> int:
        return int(self.block_size) - 1


# ------------------------------------------------------------------------------------------- helpers


def target_config(target, name, default=None):
    """``target.config[name]`` (a dict or an HF config object), ``default`` when missing or None."""
    cfg = target.config
    val = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
    return default if val is None else val


def target_identity(target) -> dict:
    out = {"model_type": str(getattr(target, "model_type", None) or target_config(target, "model_type", "?")),
           "vocab_size": int(target.vocab_size), "hidden_size": int(target.hidden_size),
           "num_hidden_layers": int(target.num_layers)}
    mpe = target_config(target, "max_position_embeddings")
    if mpe is not None:
        out["max_position_embeddings"] = int(mpe)
    return out


def target_rope_theta(target) -> float:
    theta = target_config(target, "rope_theta")
    if theta is None:
        rp = target_config(target, "rope_parameters") or {}
        theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    return float(theta if theta is not None else 10000.0)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple:
    """Released default (SpecForge ``build_target_layer_ids``): one layer -> ``[L // 2]``; n layers ->
    ``round(1 + i * (L - 4) / (n - 1))`` for i < n (Qwen3-8B, 5 layers: [1, 9, 17, 25, 33]).
    Shallow targets where that leaves [0, L) (e.g. L = 2, n = 2) get ids spread evenly over [0, L - 1]."""
    L, n = int(num_target_layers), int(num_draft_layers)
    if L < 1 or n < 1:
        raise ValueError(f"need >= 1 target and draft layers; got {L}, {n}")
    if n == 1:
        return (L // 2,)
    ids = [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
    if min(ids) < 0 or max(ids) >= L:
        ids = [int(round(i * (L - 1) / (n - 1))) for i in range(n)]
    return tuple(ids)


def tokenizer_size(folder: Optional[str]) -> Optional[int]:
    """Number of token ids the tokenizer in ``folder`` uses (max id + 1 over its vocab and added tokens;
    tokenizer.json, else vocab.json + tokenizer_config.json), or None when there is no tokenizer."""
    if not folder or not os.path.isdir(folder):
        return None
    ids = []
    tj = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(tj):
        with open(tj) as f:
            tok = json.load(f)
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            ids += [int(i) for i in vocab.values()]
        elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
            ids.append(len(vocab) - 1)
        ids += [int(t["id"]) for t in tok.get("added_tokens", [])]
    else:
        vj = os.path.join(folder, "vocab.json")
        if not os.path.isfile(vj):
            return None
        with open(vj) as f:
            ids += [int(i) for i in json.load(f).values()]
        tc = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(tc):
            with open(tc) as f:
                ids += [int(i) for i in (json.load(f).get("added_tokens_decoder") or {})]
    return max(ids) + 1 if ids else None


def choose_mask(target, mask_token_id: Optional[int] = None, target_dir: Optional[str] = None) -> tuple:
    """-> (mask_token_id, learned_mask). Released drafters embed MASK with a real but unused token id (Qwen3:
    151669, the first id after the tokenizer's last token). Rule:

    - ``mask_token_id`` >= 0: that token's frozen target embedding (released behaviour).
    - None (automatic): the first embedding row the tokenizer in ``target_dir`` does not use, when the
      tokenizer has fewer tokens than vocab_size (this reproduces Qwen3's 151669); otherwise a learned vector.
      The config's pad token is not used: it is usually a real token (<|endoftext|>, eos).
    - -1: always a learned vector.

    With a learned vector, mask_token_id is only the id serving engines replace by it (vLLM's
    ``mask_embedding.pt``): the target's eos token (a served sequence never drafts after eos), else pad/bos.
    """
    v = int(target.vocab_size)
    if mask_token_id is not None and int(mask_token_id) >= 0:
        if int(mask_token_id) >= v:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the target's vocab [0, {v})")
        return int(mask_token_id), False
    if mask_token_id is None:
        n_tok = tokenizer_size(target_dir)
        if n_tok is not None and n_tok < v:
            return n_tok, False
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        t = target_config(target, key)
        t = t[0] if isinstance(t, (list, tuple)) and t else t
        if isinstance(t, int) and 0 <= t < v:
            return t, True
    return None, True


# ------------------------------------------------------------------------------------------- layers


class DraftAttention(nn.Module):
    """Qwen3 attention whose keys/values are [k_proj(context) ; k_proj(block)] (same weights)."""

    kernel_paths = None  # the recipe's kernels: section for RoPE and the branch attention (``hand_down``)

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.h, self.hkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        if self.h % self.hkv:
            raise ValueError(f"num_heads ({self.h}) must be a multiple of num_kv_heads ({self.hkv})")
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, T, D] block slots (or [T, D] context rows), cos/sin [N, T, hd] (or [T, hd])
        -> k, v [N, T, Hkv, hd] (or [T, Hkv, hd])."""
        if x.dim() == 2:
            k, v = self.kv(x[None], cos[None], sin[None])
            return k[0], v[0]
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.hkv, self.hd))
        return apply_rope(k, cos, sin, self.kernel_paths), self.v_proj(x).view(b, t, self.hkv, self.hd)

    def forward(self, x, cos, sin, k_ctx, v_ctx, layout: Optional[BranchLayout], backend="auto"):
        """One draft layer's attention: block queries over [context ; block] keys.

        Args:
            x: [N, S, D] the block (normed).
            cos, sin: [N, S, hd] RoPE at the block slots' positions.
            k_ctx, v_ctx: [C, Hkv, hd] packed context seen through ``layout``; or (layout None, decoding) lists of N
                cached contexts [T_b, Hkv, hd].
            layout: BranchLayout, or None when decoding.
            backend: see ``branch_attention``.

        Returns:
            [N, S, D].
        """
        n, s, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(n, s, self.h, self.hd)), cos, sin, self.kernel_paths)
        kb, vb = self.kv(x, cos, sin)
        if layout is None:
            o = cached_branch_attention(q, kb, vb, k_ctx, v_ctx, self.hd ** -0.5)
        else:
            o = branch_attention(q, kb, vb, k_ctx, v_ctx, layout, self.hd ** -0.5, backend, self.kernel_paths)
        return self.o_proj(o.reshape(n, s, self.h * self.hd))


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act)

    def forward(self, h, cos, sin, k_ctx, v_ctx, layout, backend="auto"):
        """A Qwen3 decoder layer over the block: attention (as ``DraftAttention.forward``), then the MLP, pre-norm.

        Args:
            h: [N, S, D] the block's hidden state.
            cos, sin, k_ctx, v_ctx, layout, backend: as ``DraftAttention.forward``.

        Returns:
            [N, S, D].
        """
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_ctx, v_ctx, layout, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


# ------------------------------------------------------------------------------------------- the model


class DFlashDrafter(nn.Module):
    """DFlash block drafter. Build with ``specopd.drafters.build_drafter``; see specopd/drafters/DESIGN.md.

    ``attention_backend``: "auto" (flex_attention on CUDA, the exact chunked path elsewhere) | "chunked" |
    "flex" | a callable (see ``specopd/drafters/attention.py``)."""

    kind = "dflash"
    has_confidence = False
    kernel_paths = None  # the recipe's kernels: section, its target's (``build_drafter`` / ``load_drafter``)
    config_class = DrafterConfig  # the config dataclass of this kind (DFlash V2 adds fields)
    layer_class = DraftLayer  # one draft decoder layer (DFlash V2 adds its convolutions)

    def __init__(self, target, config: DrafterConfig, seed: Optional[int] = 0):
        """seed: the weights' init seed; None leaves them as the modules make them (a shape-only skeleton, built on
        the meta device by ``specopd.drafters.layout`` to check a folder's tensors)."""
        super().__init__()
        self.__dict__["target"] = target  # not a submodule: no target weights in state_dict / parameters
        self.config = c = config
        self.attention_backend = "auto"
        bad = self.config_problems(c, target_identity(target))
        if bad:
            raise ValueError("drafter config out of range: " + "; ".join(f"{k}={v!r} ({rule})" for k, v, rule in bad))
        d = c.hidden_size
        self.layers = nn.ModuleList(self.layer_class(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.fc = nn.Linear(len(c.feature_layers) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        if c.learned_mask:
            self.mask_embedding = nn.Parameter(torch.zeros(d))
        self._build_extra()
        if seed is not None:
            self._init_weights(seed)
        self.to(target.device)
        self._rope = rope_inv_freq(rope_parameters({"rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling}),
                                   c.head_dim)
        if self._rope.numel() * 2 != c.head_dim:
            raise ValueError("the drafter's RoPE must rotate the whole head (no partial_rotary_factor)")

    @classmethod
    def config_problems(cls, c: DrafterConfig, ident: dict) -> list:
        """(field, value, what it must be) for every setting of ``c`` this kind cannot be built with, against the
        target's ``ident`` (``target_identity``; a key it lacks is not checked). The one owner of these rules: the
        constructor raises on them, ``specopd.drafters.layout`` names them as a folder's config.json keys."""
        bad = []
        hid, layers, vocab = ident.get("hidden_size"), ident.get("num_hidden_layers"), ident.get("vocab_size")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if not getattr(c, name) >= 1:
                bad.append((name, getattr(c, name), ">= 1"))
        if hid is not None and c.hidden_size >= 1 and c.hidden_size != hid:
            bad.append(("hidden_size", c.hidden_size, f"the target's hidden_size={hid}: the drafter uses the "
                                                      f"target's embedding and lm_head"))
        if not c.block_size >= 2:
            bad.append(("block_size", c.block_size, "counts the anchor: >= 2"))
        ids = list(c.feature_layers)
        if not ids or any(not 0 <= i < (layers if layers is not None else i + 1) for i in ids):
            bad.append(("feature_layers", ids, "non-empty layer ids in " + (f"[0, {layers}) of the target" if layers
                                                                             is not None else "[0, target layers)")))
        if c.num_heads >= 1 and c.num_kv_heads >= 1 and c.num_heads % c.num_kv_heads:
            bad.append(("num_heads", c.num_heads, f"a multiple of num_kv_heads={c.num_kv_heads}"))
        if not (c.head_dim >= 2 and c.head_dim % 2 == 0):
            bad.append(("head_dim", c.head_dim, "even and >= 2: RoPE turns pairs of channels"))
        for name in ("rms_norm_eps", "rope_theta"):
            if not getattr(c, name) > 0:
                bad.append((name, getattr(c, name), "> 0"))
        if c.mask_token_id is None and not c.learned_mask:
            bad.append(("mask_token_id", None, "a token id, or learned_mask with a learned mask vector"))
        elif c.mask_token_id is not None and not 0 <= c.mask_token_id < (vocab or c.mask_token_id + 1):
            bad.append(("mask_token_id", c.mask_token_id, f"a token id in [0, {vocab or 'vocab_size'})"))
        return bad

    def _build_extra(self) -> None:
        """Hook for subclasses (DSpark heads)."""

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Deterministic in ``seed``: every Linear / Embedding weight and the learned mask vector
        ~ N(0, 0.02^2), biases 0, norms 1; subclasses may zero some weights afterwards."""
        g = torch.Generator().manual_seed(int(seed))
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() >= 2 or name == "mask_embedding":
                p.copy_(torch.randn(p.shape, generator=g) * INIT_STD)

    # -- properties ---------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Block length including the anchor, as released ("b16" = 16)."""
        return int(self.config.block_size)

    @property
    def draft_len(self) -> int:
        """W = block_size - 1: tokens drafted per block (what everything outside drafters/ reads)."""
        return int(self.config.block_size) - 1

    @property
    def feature_layers(self) -> tuple:
        return tuple(int(i) for i in self.config.feature_layers)

    @property
    def mask_token_id(self) -> Optional[int]:
        return self.config.mask_token_id

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # -- inputs -------------------------------------------------------------------------------------------
    def _features(self, features) -> list:
        feats = []
        fdim = len(self.feature_layers) * self.config.hidden_size
        for f in ([features] if torch.is_tensor(features) else list(features)):
            if not torch.is_tensor(f):  # a TargetCache
                if tuple(f.feature_layers) != self.feature_layers:
                    raise ValueError(f"cache features are of layers {tuple(f.feature_layers)}, drafter needs "
                                     f"{self.feature_layers}: prefill(..., feature_layers=drafter.feature_layers)")
                f = f.features
            if f is None or f.dim() != 2 or f.shape[1] != fdim:
                raise ValueError(f"features must be [T, {fdim}] (len(feature_layers) * hidden); got "
                                 f"{None if f is None else tuple(f.shape)}; prefill with "
                                 f"feature_layers=drafter.feature_layers")
            feats.append(f)
        return feats

    def _inputs(self, features, anchors, trunk_index, anchor_tokens):
        feats = self._features(features)
        dev = self.device
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
        self._check_tokens(anchor_tokens, "anchor_tokens")
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

    def _check_tokens(self, tokens: torch.Tensor, name: str) -> None:
        v = int(self.target.vocab_size)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= v):
            raise ValueError(f"{name} must be token ids in [0, {v}); got min {int(tokens.min())}, "
                             f"max {int(tokens.max())}")

    # -- the backbone -------------------------------------------------------------------------------------
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, F] -> ``hidden_norm(fc(features))`` [T, D] (shared by all layers)."""
        return self.hidden_norm(self.fc(features.to(device=self.device, dtype=self.dtype)))

    def _rope_cos_sin(self, positions: torch.Tensor):
        return rope_cos_sin(positions, self._rope.to(positions.device), self.dtype)

    def _block(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """anchor_tokens [N] -> the embedded block [N, S, D]: target embedding of the anchor, then MASK x W."""
        n, w = anchor_tokens.numel(), self.draft_len
        a = self.target.embed(anchor_tokens)[:, None].to(self.dtype)  # [N, 1, D]
        if self.config.learned_mask:
            m = self.mask_embedding.to(self.dtype)
        else:
            m = self.target.embed(torch.tensor([self.config.mask_token_id], device=self.device))[0].to(self.dtype)
        return torch.cat([a, m.expand(n, w, -1)], 1)

    def _layers(self, anchor_tokens, anchors, layer_kv, layout: BranchLayout, backend=None) -> torch.Tensor:
        """Run the draft layers over the blocks of ``anchors`` [N]. ``layer_kv(i, attn)`` gives layer i's packed
        context (k, v) [C, Hkv, hd]. -> normed hidden [N, W, D] at slots 1..W."""
        h = self._block(anchor_tokens)
        cos, sin = self._rope_cos_sin(anchors[:, None] + torch.arange(self.block_size, device=anchors.device))
        for i, layer in enumerate(self.layers):
            k, v = layer_kv(i, layer.self_attn)
            h = layer(h, cos, sin, k, v, layout, backend or self.attention_backend)
        return self.norm(h[:, 1:])

    def hidden(self, features, anchors, trunk_index=None, anchor_tokens=None) -> torch.Tensor:
        """The drafter's normed hidden state at the W drafted slots (what lm_head reads). Memory per layer:
        O(sum_i max anchor on trunk i + N * block_size): no per-branch copy of the context.

        Args:
            features: list of [T_i, F] per trunk (or TargetCaches), F = len(feature_layers) * D.
            anchors: [N] in [0, T_i] (T_i at inference: the anchor is the bonus token the target has not run).
            trunk_index: [N] which trunk (default: all 0).
            anchor_tokens: [N] the token at each anchor (required; at inference the bonus token).

        Returns:
            h [N, W, D].
        """
        feats, anchors, tix, atok = self._inputs(features, anchors, trunk_index, anchor_tokens)
        dev = self.device
        # group by trunk and sort by anchor (block-sparse layout); undo at the end
        key = tix * (int(anchors.max()) + 1) + anchors
        order = None
        if bool((key[1:] < key[:-1]).any()):
            order = torch.argsort(key, stable=True)
            anchors, tix, atok = anchors[order], tix[order], atok[order]
        need = torch.zeros(len(feats), dtype=torch.long, device=dev).scatter_reduce(0, tix, anchors, "amax")
        need_l = need.tolist()
        starts = torch.cumsum(need, 0) - need
        c_len = int(sum(need_l))
        layout = BranchLayout(starts[tix], anchors, c_len, self.block_size)
        if c_len:
            ctx = self.context(torch.cat([f[:k] for f, k in zip(feats, need_l) if k]))  # [C, D]
            cpos = torch.cat([torch.arange(k, device=dev) for k in need_l if k])
            ccos, csin = self._rope_cos_sin(cpos)
        else:
            ctx = ccos = csin = None

        def layer_kv(i, attn):
            if ctx is None:
                empty = torch.zeros(0, attn.hkv, attn.hd, device=dev, dtype=self.dtype)
                return empty, empty
            return attn.kv(ctx, ccos, csin)

        h = self._layers(atok, anchors, layer_kv, layout)
        if order is not None:
            h = h[torch.argsort(order)]
        return h

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] -> fp32 logits [..., V] = the target's frozen lm_head (its final norm is NOT applied)."""
        lm_head = self.target.lm_head
        return lm_head(h.to(lm_head.weight.dtype)).float()

    def forward(self, features, anchors, trunk_index=None, anchor_tokens=None, prev_tokens=None,
                return_confidence: bool = False) -> torch.Tensor:
        """Raw logits of every drafted slot (the target's lm_head on ``hidden``).

        Args:
            features: list of [T_i, F] per trunk (or TargetCaches), F = len(feature_layers) * D.
            anchors: [N] in [0, T_i] (T_i at inference: the anchor is the bonus token the target has not run).
            trunk_index: [N] which trunk (default: all 0).
            anchor_tokens: [N] the token at each anchor (required; at inference the bonus token).
            prev_tokens: [N, W] the token before each slot; ignored by DFlash (DSpark's Markov head reads it).
            return_confidence: DSpark only.

        Returns:
            [N, W, V] fp32 logits.
        """
        if return_confidence:
            raise ValueError("DFlash has no confidence head; build a 'dspark' drafter for confidences")
        return self.logits_from_hidden(self.hidden(features, anchors, trunk_index, anchor_tokens))

    # -- sampling -----------------------------------------------------------------------------------------
    def _sample_hidden(self, h, anchor_tokens, temperature, generator, rows=None, return_confidence=False,
                       return_logits=True, chunk_rows="auto"):
        """h [N, W, D] -> (tokens [N, W], logits [N, W, V] or None); DFlash draws all W slots independently.
        Without ``return_logits`` the tokens come from ``sample_from_hidden`` in chunks of rows (no [N, W, V])."""
        if return_confidence:
            raise ValueError("DFlash has no confidence head")
        if not return_logits:
            head = self.target.lm_head
            return sample_from_hidden(h.detach(), head.weight, temperature, rows, generator, chunk_rows=chunk_rows,
                                      tp=vocab_group(head), kernel_paths=self.kernel_paths), None
        logits = self.logits_from_hidden(h)
        return pick_tokens(logits, temperature, generator, rows, chunk_rows, self.kernel_paths), logits

    def sample(self, features, anchors, trunk_index=None, anchor_tokens=None, temperature: float = 1.0,
               generator=None, rows=None, return_confidence: bool = False):
        """Draft W tokens per branch. Autograd is not disabled: wrap in ``torch.no_grad()`` to propose only.

        Args:
            features: list of [T_i, F] per trunk (or TargetCaches), F = len(feature_layers) * D.
            anchors: [N] in [0, T_i] (T_i at inference: the anchor is the bonus token the target has not run).
            trunk_index: [N] which trunk (default: all 0).
            anchor_tokens: [N] the token at each anchor (required; at inference the bonus token).
            temperature: 0 = argmax, else a draw from softmax(logits / T).
            generator: one Generator, or one per ``rows`` group (``pick_tokens``).
            rows: list of index tensors into N (per-sample randomness).
            return_confidence: DSpark: also the confidence logits.

        Returns:
            (tokens [N, W], raw logits [N, W, V]) [+ confidence logits [N, W]].
        """
        h = self.hidden(features, anchors, trunk_index, anchor_tokens)
        atok = torch.as_tensor(anchor_tokens, dtype=torch.long, device=h.device).reshape(-1)
        return self._sample_hidden(h, atok, temperature, generator, rows, return_confidence)

    @torch.no_grad()
    def sample_tokens(self, h: torch.Tensor, anchor_tokens, temperature: float = 1.0, generator=None, rows=None,
                      chunk_rows="auto") -> torch.Tensor:
        """Branch tokens from a given hidden state without logits [N, W, V]: ``chunk_rows`` rows at a time through the
        target's lm_head (DSpark: its Markov head, left to right); the same tokens as ``sample`` for the same
        generators.

        Args:
            h: [N, W, D] the drafter's hidden state (``hidden(...)``; detached here).
            anchor_tokens: [N] (DSpark's first Markov input).
            temperature: 0 = argmax.
            generator: one Generator, or one per ``rows`` group.
            rows: list of index tensors into N.
            chunk_rows: rows per chunk, or "auto".

        Returns:
            tokens [N, W].
        """
        atok = torch.as_tensor(anchor_tokens, dtype=torch.long, device=h.device).reshape(-1)
        return self._sample_hidden(h.detach(), atok, temperature, generator, rows, return_logits=False,
                                   chunk_rows=chunk_rows)[0]

    # -- decoding -----------------------------------------------------------------------------------------
    def context_cache(self, features: Optional[torch.Tensor] = None, capacity: int = 0) -> "DraftContext":
        """A decoding cache holding every layer's context K/V of one sequence; ``features`` [T, F] (or None)."""
        ctx = DraftContext(self, capacity)
        if features is not None:
            ctx.extend(features)
        return ctx

    @torch.no_grad()
    def extend_contexts(self, ctxs: Sequence["DraftContext"], features: Sequence[torch.Tensor],
                        next_tokens=None) -> None:
        """Append ``features[b]`` [n_b, F] (positions len(ctxs[b]) ..) to every decoding cache in one pass: the
        new rows of all sequences are projected together (fc, hidden_norm, k/v, RoPE at their own positions) and
        written after each cache's rows. Nothing already cached is read or recomputed: O(sum_b n_b) work.
        ``next_tokens`` (the token after each row, ``BlockDrafter``'s) is not read: a block's context is features
        alone."""
        ctxs = list(ctxs)
        feats = self._features(features)
        if len(feats) != len(ctxs) or any(c.drafter is not self for c in ctxs):
            raise ValueError(f"extend_contexts: {len(feats)} feature tensors for {len(ctxs)} contexts (of this "
                             f"drafter: drafter.context_cache())")
        ns = [int(f.shape[0]) for f in feats]
        if not sum(ns):
            return
        dev = self.device
        pos = torch.cat([torch.arange(len(c), len(c) + n, device=dev) for c, n in zip(ctxs, ns) if n])  # [M]
        x = self.context(torch.cat([f for f, n in zip(feats, ns) if n]))  # [M, D]
        cos, sin = self._rope_cos_sin(pos)
        for c, n in zip(ctxs, ns):
            c.reserve(len(c) + n)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(x, cos, sin)  # [M, Hkv, hd]
            off = 0
            for c, n in zip(ctxs, ns):
                c.k[i][c.length:c.length + n] = k[off:off + n]
                c.v[i][c.length:c.length + n] = v[off:off + n]
                off += n
        for c, n in zip(ctxs, ns):
            c.length += n

    @torch.no_grad()
    def draft_batch(self, ctxs: Sequence["DraftContext"], anchor_tokens, temperature: float = 0.0,
                    generators=None, return_confidence: bool = False):
        """One block per decoding sequence, all in one drafter call: block b is anchored at ``len(ctxs[b])`` and attends
        to
        its own cached context K/V in place (no packing, no copy); DSpark samples left to right. Equals
        ``sample([features_b], [len(ctx_b)], None, [anchor_token_b])`` per sequence without recomputing any context.
        Cost per round: O(A * block_size) in the layers and lm_head + O(sum_b T_b) attention reads.

        Args:
            ctxs: A DraftContexts.
            anchor_tokens: [A] the pending tokens the target has not run yet.
            temperature: 0 = argmax.
            generators: None, one Generator for every draw, or a list of A (sequence b's W draws from generators[b]).
            return_confidence: DSpark: also the confidence logits.

        Returns:
            (tokens [A, W], raw logits [A, W, V]) [+ confidence logits [A, W]].
        """
        ctxs = list(ctxs)
        if not ctxs or any(c.drafter is not self for c in ctxs):
            raise ValueError("draft_batch needs >= 1 DraftContext of this drafter (drafter.context_cache(...)); "
                             "got none, or one that belongs to another drafter")
        atok = torch.as_tensor(anchor_tokens, dtype=torch.long, device=self.device).reshape(-1)
        if atok.numel() != len(ctxs):
            raise ValueError(f"draft_batch: {atok.numel()} anchor tokens for {len(ctxs)} contexts")
        self._check_tokens(atok, "anchor_tokens")
        rows = None
        if isinstance(generators, (list, tuple)):
            if len(generators) != len(ctxs):
                raise ValueError(f"draft_batch: {len(generators)} generators for {len(ctxs)} sequences (give one, "
                                 f"or one per sequence)")
            rows = [torch.tensor([b], device=self.device) for b in range(len(ctxs))]
        anchors = torch.tensor([len(c) for c in ctxs], device=self.device)
        h = self._layers(atok, anchors, lambda i, attn: tuple(zip(*(c.kv(i) for c in ctxs))), None)
        return self._sample_hidden(h, atok, temperature, generators, rows, return_confidence)

    @torch.no_grad()
    def draft(self, ctx: "DraftContext", anchor_token, temperature: float = 0.0, generator=None,
              return_confidence: bool = False):
        """One block at anchor ``len(ctx)`` from the cached context K/V: ``draft_batch`` with one sequence.

        Args:
            ctx: the sequence's DraftContext.
            anchor_token: the bonus token, not yet run by the target.
            temperature: 0 = argmax.
            generator: a Generator or None.
            return_confidence: DSpark: also the confidence logits.

        Returns:
            (tokens [W], raw logits [W, V]) [+ confidence logits [W]].
        """
        atok = torch.as_tensor(anchor_token, dtype=torch.long).reshape(1)
        out = self.draft_batch([ctx], atok, temperature, generator, return_confidence)
        return tuple(x[0] for x in out)

    # -- save / load --------------------------------------------------------------------------------------
    def config_dict(self) -> dict:
        """Our config.json (``dataclasses.asdict`` of the config, lists for tuples)."""
        cfg = dataclasses.asdict(self.config)
        cfg["feature_layers"] = list(self.feature_layers)
        return cfg

    def save(self, path: str) -> None:
        """Our checkpoint: ``config.json`` + ``model.safetensors`` (trainable weights, released names)."""
        os.makedirs(path, exist_ok=True)
        with open_write(os.path.join(path, "config.json")) as f:
            json.dump(self.config_dict(), f, indent=2)
        sd = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        with replacing_path(os.path.join(path, "model.safetensors")) as tmp:
            safetensors.torch.save_file(sd, tmp, metadata={"format": "pt", "kind": self.kind})


class DraftContext:
    """Decoding cache of one sequence: every draft layer's context K/V [T, Hkv, hd] (after k_norm and RoPE).

    ``extend(features [n, F])`` projects only the n new positions and appends them (capacity doubles, so
    growth is amortised O(1) per token); nothing is recomputed over the whole context.
    ``drafter.extend_contexts(ctxs, features)`` does it for many sequences in one pass. ``len(ctx)`` = T =
    the anchor of the next ``drafter.draft(ctx, ...)``. Only the context is cached: block K/V are never kept
    (the block changes every round)."""

    def __init__(self, drafter: DFlashDrafter, capacity: int = 0):
        self.drafter = drafter
        self.length = 0
        self.k: list = []
        self.v: list = []
        self._alloc(max(int(capacity), 0))

    def __len__(self) -> int:
        return self.length

    def _alloc(self, cap: int) -> None:
        d = self.drafter
        new_k, new_v = [], []
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            k = torch.empty(cap, a.hkv, a.hd, device=d.device, dtype=d.dtype)
            v = torch.empty(cap, a.hkv, a.hd, device=d.device, dtype=d.dtype)
            if self.k:
                k[: self.length] = self.k[i][: self.length]
                v[: self.length] = self.v[i][: self.length]
            new_k.append(k)
            new_v.append(v)
        self.k, self.v = new_k, new_v

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[0]) if self.k else 0

    def reserve(self, length: int) -> None:
        """Room for ``length`` positions (capacity doubles: growth by n tokens in rounds copies O(n) amortised)."""
        if length > self.capacity:
            self._alloc(max(length, 2 * self.capacity, 16))

    def extend(self, features: torch.Tensor) -> "DraftContext":
        """Append the context K/V of positions len(self) .. len(self) + n - 1 from their features [n, F]."""
        self.drafter.extend_contexts([self], [features])
        return self

    def kv(self, i: int):
        """Layer i's context (k, v) [T, Hkv, hd] (views, no copy)."""
        return self.k[i][: self.length], self.v[i][: self.length]

    def nbytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for t in self.k + self.v))
