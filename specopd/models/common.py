"""Building blocks shared by all target models: RMSNorm, RoPE (computed on the fly), SwiGLU MLP, MoE (and,
re-exported from ``specopd_executors.attention``, the dense attention ``masked_attention`` / ``sdpa_attention``).

Numerics follow Hugging Face transformers 5.x exactly (same cast order), so our models agree with
the transformers oracle to fp32 rounding. No buffers anywhere: models are built under the meta device.
"""
from __future__ import annotations

import math
import weakref
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from specopd_executors.attention import masked_attention, sdpa_attention  # noqa: F401  (the models' plain attention)
from specopd_kernels.layer_ops import cpu as layer_ops
from specopd_kernels.layer_ops import naive as layer_naive

# ----------------------------------------------------------------------------------------- RMSNorm


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32.

    ``unit_offset=False`` (llama / qwen3): ``w * normed(x).to(x.dtype)``, weight initialised to 1.
    ``unit_offset=True`` (qwen3_next / qwen3_5 / qwen4_exp): ``(normed(x) * (1 + w.float())).to(x.dtype)``,
    weight initialised to 0.
    """

    kernel_paths = None  # the recipe's kernels: section (``hand_down``); None: all "auto"

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = float(eps)
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if layer_ops.enabled(x, self.weight, kernel_paths=self.kernel_paths):  # bf16, CPU, no autograd: one C pass
            return layer_ops.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return layer_naive.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"


# ----------------------------------------------------------------------------------------- RoPE


def rope_parameters(cfg: dict, layer_type: str | None = None) -> dict:
    """The RoPE settings of a flat HF config dict, normalised to one dict with at least
    ``rope_type``, ``rope_theta`` and ``partial_rotary_factor`` (handles the legacy ``rope_theta`` /
    ``rope_scaling`` / ``partial_rotary_factor`` top-level keys and per-layer-type nested dicts)."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rp = dict(rp)
    if rp and all(isinstance(v, dict) or v is None for v in rp.values()):  # nested by layer type
        key = layer_type if layer_type in rp else next(k for k, v in rp.items() if v is not None)
        rp = dict(rp[key])
    rp.setdefault("rope_type", rp.get("type", "default"))
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rp.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0) or 1.0)
    if rp["rope_type"] in ("llama3", "yarn", "longrope"):
        rp.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return rp


def rope_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    """[rot_dim // 2] fp32 inverse frequencies on the CPU (HF's init functions). rot_dim =
    int(head_dim * partial_rotary_factor). Supports rope_type default, linear, llama3."""
    key = tuple(sorted((k, v) for k, v in params.items() if isinstance(v, (int, float, str, type(None)))))
    return _inv_freq_cached(key, int(head_dim)).clone()


@lru_cache(maxsize=64)
def _inv_freq_cached(key: tuple, head_dim: int) -> torch.Tensor:
    p = dict(key)
    kind = p["rope_type"]
    base = float(p["rope_theta"])
    dim = int(head_dim * float(p.get("partial_rotary_factor", 1.0)))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / p["factor"]
    if kind == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        inv_l = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wl < hi_wl) * ~(wl > lo_wl)
        return torch.where(medium, smoothed, inv_l)
    raise NotImplementedError(
        f"rope_type {kind!r} is not supported (supported: default, linear, llama3); "
        f"use a checkpoint with one of these or add it to specopd/models/common.py"
    )


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions [B, T] (any int) -> cos, sin [B, T, rot_dim] in ``dtype`` (HF: fp32 then cast)."""
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel_paths=None) -> torch.Tensor:
    """RoPE; bf16 on the CPU outside autograd: one pass in C (``specopd_kernels.layer_ops``, bitwise torch's).

    Args:
        x: [B, T, H, hd].
        cos, sin: [B, T, rot_dim] (rot_dim <= hd: the rest passes through unrotated).
        kernel_paths: the recipe's kernels: section (its ``cpu_layer_ops=torch`` keeps torch's ops); None: "auto".

    Returns:
        [B, T, H, hd] rotated.
    """
    if layer_ops.enabled(x, cos, sin, kernel_paths=kernel_paths):
        return layer_ops.rope(x, cos, sin)
    return layer_naive.rope(x, cos, sin)


_ROPE_MEMO: dict = {}  # id(positions) -> (weakref to it, its _version, {key: (cos, sin)})


def memo_cos_sin(positions: torch.Tensor, key, build):
    """``build()`` -> (cos, sin) once per live ``positions`` tensor and ``key``: every layer of one pass reads the
    same positions tensor, so RoPE tables are computed once per pass, not once per layer (the same values:
    bit-identical). An entry is used only while it is the same tensor object with the same version counter."""
    if torch.is_grad_enabled() and positions.requires_grad:
        return build()
    ent = _ROPE_MEMO.get(id(positions))
    if ent is None or ent[0]() is not positions or ent[1] != positions._version:
        if len(_ROPE_MEMO) >= 8:
            _ROPE_MEMO.clear()
        ent = _ROPE_MEMO[id(positions)] = (weakref.ref(positions), positions._version, {})
    out = ent[2].get(key)
    if out is None:
        out = ent[2][key] = build()
    return out


class Rotary:
    """RoPE of one attention layer (plain object, no buffers): ``rotary(q, k, positions)``. Layers with the same
    RoPE settings share their cos / sin tables within a pass (``memo_cos_sin``)."""

    def __init__(self, cfg: dict, head_dim: int, layer_type: str | None = None):
        self.params = rope_parameters(cfg, layer_type)
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq(self.params, head_dim)  # CPU fp32
        self._on_device: dict = {}  # device -> inv_freq copy (a plain dict, not a buffer)
        self._key = (tuple(self.inv_freq.tolist()),)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [B, T] -> cos, sin [B, T, rot_dim] in ``dtype`` (memoised per positions tensor)."""
        inv = self._on_device.get(positions.device)
        if inv is None:
            inv = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        return memo_cos_sin(positions, self._key + (dtype, str(positions.device)),
                            lambda: rope_cos_sin(positions, inv, dtype))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, kernel_paths=None):
        """q [B, T, H, hd], k [B, T, Hkv, hd], positions [B, T] -> rotated (q, k) (``kernel_paths``: as
        ``apply_rope``)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rope(q, cos, sin, kernel_paths), apply_rope(k, cos, sin, kernel_paths)


# ----------------------------------------------------------------------------------------- Linear


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict). bf16 on the CPU outside autograd it multiplies by a
    weight packed once for oneDNN (``specopd_kernels.layer_ops.linear``): the same bits as ``F.linear``, which reorders
    the weight on every call. x [..., in] -> [..., out]."""

    kernel_paths = None  # the recipe's kernels: section (``hand_down``); None: all "auto"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed = layer_ops.PackedWeight()  # a cache, not state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias) -> torch.Tensor:
        """x @ weight.T (+ ``bias``, None for none) through the packed weight where it applies."""
        if layer_ops.linear_enabled(x, self.weight, bias, kernel_paths=self.kernel_paths):
            return layer_ops.linear(x, self.packed.get(self.weight), bias)
        return F.linear(x, self.weight, bias)


def hand_down(model: nn.Module, kernel_paths) -> nn.Module:
    """Give ``model`` and every module of it that reads the recipe's ``kernels:`` section (a ``kernel_paths``
    attribute: RMSNorm, Linear, MLP, the attention layers (their RoPE), a target, a drafter) that choice, a
    ``KernelsConfig`` or None (all "auto"); returns ``model``. Per model, so two models in one process may differ."""
    for m in model.modules():
        if hasattr(m, "kernel_paths"):
            m.kernel_paths = kernel_paths
    return model


# ----------------------------------------------------------------------------------------- MLP / MoE

_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str):
    if name not in _ACTS:
        raise ValueError(f"hidden_act {name!r} is not supported (supported: {sorted(_ACTS)})")
    return _ACTS[name]


class MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)). [..., D] -> [..., D]."""

    kernel_paths = None  # the recipe's kernels: section (``hand_down``); None: all "auto"

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)
        self.gate_up_packed = layer_ops.PackedWeight()  # cat(gate, up) packed for oneDNN: a cache, not state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is F.silu and layer_ops.enabled(x, self.gate_proj.weight, self.up_proj.weight,
                                                    kernel_paths=self.kernel_paths):
            # bf16 on the CPU outside autograd: gate and up as one matmul (the same bits, measured: oneDNN's
            # [N = 2I] blocking there runs faster than two [N = I] calls), silu * up in one pass in C
            gu = self.gate_up(x)
            i = self.gate_proj.out_features
            return self.down_proj(layer_ops.silu_mul(gu[..., :i], gu[..., i:]))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., 2I] = cat(gate(x), up(x)) as one matmul, through the packed weight where
        ``layer_ops.linear_enabled`` (bf16 oneDNN), else ``F.linear`` on the concatenated weight."""
        g, u = self.gate_proj, self.up_proj
        if layer_ops.linear_enabled(x, g.weight, u.weight, kernel_paths=self.kernel_paths):
            b = None if g.bias is None else torch.cat((g.bias, u.bias)).detach()
            return layer_ops.linear(x, self.gate_up_packed.get(g.weight, u.weight), b)
        return F.linear(x, *self._gate_up())

    def _gate_up(self) -> tuple:
        """(weight [2I, D], bias [2I] or None) = cat(gate, up), rebuilt when a weight or bias changes (attributes,
        not in the state dict)."""
        ps = [p for p in (self.gate_proj.weight, self.up_proj.weight, self.gate_proj.bias, self.up_proj.bias)
              if p is not None]
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in ps)
        if getattr(self, "_gate_up_key", None) != key:
            w = torch.cat(ps[:2]).detach()
            b = torch.cat(ps[2:]).detach() if len(ps) == 4 else None
            self._gate_up_wb, self._gate_up_key = (w, b), key
        return self._gate_up_wb


class Router(nn.Module):
    """Top-k router (HF qwen3_moe / qwen3_next): logits and softmax in fp32 over all experts, top-k, optional
    renormalisation of the k weights. x [N, D] -> (weights [N, k] in x.dtype, experts [N, k] long).
    The logits are fp32 from the projection on (HF: in x's dtype): the top-k decides which experts' weights run,
    and a bf16 rounding flip there would route the same token differently in prefill, score and commit."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool = True):
        super().__init__()
        self.top_k, self.num_experts, self.norm_topk_prob = int(top_k), int(num_experts), bool(norm_topk_prob)
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.weight.float())
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), idx


class Experts(nn.Module):
    """Experts stored as 3D tensors (HF 5.x in-memory layout): gate_up_proj [E, 2I, D] (gate rows first),
    down_proj [E, D, I]. Checkpoints store experts one by one (``experts.<e>.gate_proj.weight``): models
    stack them when loading (see qwen3_next.py)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, act: str = "silu"):
        super().__init__()
        self.num_experts = int(num_experts)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = activation(act)

    first = 0  # the global id of gate_up_proj[0] (expert parallelism holds a block of experts)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], idx/weights [N, k] -> [N, D] (experts in ascending order, index_add_, like HF). Experts this
        module does not hold add nothing."""
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            j = e - self.first
            if not 0 <= j < self.gate_up_proj.shape[0]:
                continue
            tok, slot = torch.where(idx == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[j]).chunk(2, dim=-1)
            h = F.linear(self.act(gate) * up, self.down_proj[j]) * weights[tok, slot, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out


class MoE(nn.Module):
    """Sparse MoE block (HF qwen3_moe; with ``shared_intermediate`` > 0 also qwen3_next's shared expert
    gated by ``sigmoid(shared_expert_gate(x))``). [B, T, D] -> [B, T, D].
    Parameter names (HF 5.x in memory): gate.weight, experts.gate_up_proj, experts.down_proj,
    shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, moe_intermediate: int,
                 norm_topk_prob: bool = True, shared_intermediate: int = 0, act: str = "silu"):
        super().__init__()
        self.gate = Router(hidden, num_experts, top_k, norm_topk_prob)
        self.experts = Experts(hidden, moe_intermediate, num_experts, act)
        if shared_intermediate:
            self.shared_expert = MLP(hidden, shared_intermediate, act)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)
        else:
            self.shared_expert = None

    @classmethod
    def from_config(cls, cfg: dict) -> "MoE":
        """From a flat HF config dict (num_experts, num_experts_per_tok, moe_intermediate_size, ...)."""
        return cls(cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                   cfg.get("norm_topk_prob", True), cfg.get("shared_expert_intermediate_size", 0) or 0,
                   cfg.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, idx = self.gate(h)
        out = self.experts(h, idx, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out.reshape(shape)


def causal_mask(t: int, device=None) -> torch.Tensor:
    """[1, T, T] bool lower-triangular mask."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril_().unsqueeze(0)
