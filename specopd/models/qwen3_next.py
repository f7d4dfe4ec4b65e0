"""Our own ``qwen3_next`` and ``qwen3_5`` (dense and MoE) text targets: Gated DeltaNet hybrids (``GatedDeltaNet``,
kind "gdn"; ``GatedAttention``, kind "gqa"). Layers, MLPs and checkpoint names: specopd/models/DESIGN.md
("qwen3_next and qwen3_5").
"""
from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from specopd_kernels.gated_delta.naive import prepare_qk, recurrent_gated_delta_rule
from specopd.models.base import DecoderLayer as BaseDecoderLayer
from specopd.models.base import TargetModel
from specopd.models.common import MLP, Linear, MoE, RMSNorm, Rotary, activation, causal_mask, masked_attention
from specopd.models.registry import register_model


def _get(cfg, name, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


class GatedRMSNorm(nn.Module):
    """HF Qwen3NextRMSNormGated: ``(w * normed(x).to(dtype)) * act(gate.float())`` then cast back.
    x, gate [..., V] -> [..., V]. Weight initialised to 1 (not zero-centred)."""

    def __init__(self, dim: int, eps: float = 1e-6, act: str = "silu"):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim))
        self.act = activation(act) if act != "sigmoid" else torch.sigmoid

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * self.act(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (kind "gdn") of qwen3_next / qwen3_5 / qwen4_exp.

    ``GatedDeltaNet(cfg, layer_idx=0, fused_qkvz=False)``: cfg is a flat HF config dict (or any object
    with these attributes): hidden_size, linear_num_key_heads (HK), linear_num_value_heads (H),
    linear_key_head_dim (K), linear_value_head_dim (V), linear_conv_kernel_dim (default 4), hidden_act,
    rms_norm_eps, and optionally output_gate_type (qwen4_exp: "silu" | "sigmoid", default hidden_act).
    ``fused_qkvz=True`` is qwen3_next's layout (in_proj_qkvz + in_proj_ba, grouped per key head);
    False is qwen3_5 / qwen4_exp's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).

    Pipeline (the executor calls the pieces): ``project`` -> conv inputs u [B, T, Cd] (Cd = 2*HK*K + H*V),
    z, g, beta; ``conv`` over the last W conv inputs -> SiLU; ``split_qkv`` -> l2-normed q, k (q * K^-0.5)
    expanded to H heads, v; the recurrence (state [B, H, K, V] fp32); ``finish`` (gated RMSNorm, out_proj).
    """

    kind = "gdn"

    def __init__(self, cfg, layer_idx: int = 0, fused_qkvz: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = d = int(_get(cfg, "hidden_size"))
        self.num_k_heads = int(_get(cfg, "linear_num_key_heads"))
        self.num_v_heads = int(_get(cfg, "linear_num_value_heads"))
        self.head_k_dim = int(_get(cfg, "linear_key_head_dim"))
        self.head_v_dim = int(_get(cfg, "linear_value_head_dim"))
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_k_heads})")
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = int(_get(cfg, "linear_conv_kernel_dim", 4) or 4)
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.fused_qkvz = fused_qkvz
        self.act = activation(_get(cfg, "hidden_act", "silu") or "silu")
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, bias=False,
                                groups=self.conv_dim, padding=self.conv_kernel_size - 1)
        if fused_qkvz:
            self.in_proj_qkvz = Linear(d, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(d, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = Linear(d, self.conv_dim, bias=False)
            self.in_proj_z = Linear(d, self.value_dim, bias=False)
            self.in_proj_b = Linear(d, self.num_v_heads, bias=False)
            self.in_proj_a = Linear(d, self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        gate_act = _get(cfg, "output_gate_type", None) or _get(cfg, "hidden_act", "silu") or "silu"
        self.norm = GatedRMSNorm(self.head_v_dim, _get(cfg, "rms_norm_eps", 1e-6), gate_act)
        self.out_proj = Linear(self.value_dim, d, bias=False)

    # ---------------------------------------------------------------- pieces (the executor uses these)
    def project(self, x: torch.Tensor):
        """x [B, T, D] -> (u [B, T, Cd] conv inputs (q|k|v), z [B, T, H, V], g [B, T, H] fp32, beta [B, T, H] fp32)."""
        b, t, _ = x.shape
        hk, r = self.num_k_heads, self.num_v_heads // self.num_k_heads
        if self.fused_qkvz:
            qkvz = self.in_proj_qkvz(x).view(b, t, hk, 2 * self.head_k_dim + 2 * r * self.head_v_dim)
            q, k, v, z = torch.split(qkvz, [self.head_k_dim, self.head_k_dim, r * self.head_v_dim,
                                            r * self.head_v_dim], dim=3)
            ba = self.in_proj_ba(x).view(b, t, hk, 2 * r)
            bb, a = torch.split(ba, [r, r], dim=3)
            u = torch.cat([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], dim=-1)
            z = z.reshape(b, t, self.num_v_heads, self.head_v_dim)
            bb, a = bb.reshape(b, t, self.num_v_heads), a.reshape(b, t, self.num_v_heads)
        else:
            u = self.in_proj_qkv(x)
            z = self.in_proj_z(x).view(b, t, self.num_v_heads, self.head_v_dim)
            bb, a = self.in_proj_b(x), self.in_proj_a(x)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        beta = bb.sigmoid().float()
        return u, z, g, beta

    def conv(self, windows: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv + act at one position per window: windows [..., W, Cd] (oldest first,
        zeros before the sequence start) -> [..., Cd]."""
        w = self.conv1d.weight[:, 0, :].t().float()  # [W, Cd]; accumulate in fp32, like conv1d kernels
        out = windows[..., 0, :].float() * w[0]
        for j in range(1, self.conv_kernel_size):
            out = out + windows[..., j, :].float() * w[j]
        return self.act(out.to(windows.dtype))

    def conv_seq(self, u: torch.Tensor, history: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal conv over a sequence: u [B, T, Cd], history [B, W-1, Cd] (the conv inputs just before,
        zeros when None) -> [B, T, Cd]."""
        b, t, c = u.shape
        wk = self.conv_kernel_size
        if history is None:
            history = u.new_zeros(b, wk - 1, c)
        full = torch.cat([history.to(u.dtype), u], dim=1)  # [B, T + W - 1, Cd]
        windows = torch.stack([full[:, j: j + t] for j in range(wk)], dim=2)  # [B, T, W, Cd]
        return self.conv(windows)

    def split_qkv(self, c: torch.Tensor):
        """Conv outputs c [..., Cd] -> q, k [..., H, K] (fp32, l2-normed, q * K^-0.5, expanded from HK to
        H heads), v [..., H, V] (fp32)."""
        q, k, v = torch.split(c, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead = c.shape[:-1]
        q = q.reshape(*lead, self.num_k_heads, self.head_k_dim)
        k = k.reshape(*lead, self.num_k_heads, self.head_k_dim)
        v = v.reshape(*lead, self.num_v_heads, self.head_v_dim).float()
        r = self.num_v_heads // self.num_k_heads
        if r > 1:
            q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
        q, k = prepare_qk(q, k)
        return q, k, v

    def finish(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, V] (fp32 recurrence output), z [B, T, H, V] -> [B, T, D]."""
        o = self.norm(o.to(z.dtype), z)
        return self.out_proj(o.reshape(*o.shape[:-2], -1))

    # ---------------------------------------------------------------- plain causal forward (the reference)
    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D] (positions unused: the recurrence is position-free). fp32 recurrence:
        the naive loop on the CPU, the Triton fused kernel on CUDA."""
        u, z, g, beta = self.project(x)
        q, k, v = self.split_qkv(self.conv_seq(u))
        run = recurrent_gated_delta_rule
        if x.is_cuda:  # same arithmetic in one Triton launch (tested against the naive loop)
            from specopd_kernels.gated_delta.fused_recurrent import fused_recurrent_gated_delta_rule as run  # Triton, CUDA only
        o, _, _ = run(q, k, v, g=g, beta=beta)
        return self.finish(o, z)


class GatedAttention(nn.Module):
    """qwen3_next / qwen3_5 full attention (kind "gqa"): q_proj gives per head [q | gate]; q/k RMSNorm
    (1 + w); partial RoPE; output * sigmoid(gate) before o_proj."""

    kind = "gqa"
    kernel_paths = None  # the recipe's kernels: section for RoPE (``common.hand_down``)

    def __init__(self, cfg: dict, layer_idx: int = 0):
        super().__init__()
        d = cfg["hidden_size"]
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or d // self.num_heads
        self.scaling = self.head_dim ** -0.5
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = Linear(d, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, d, bias=bias)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps, unit_offset=True)
        self.rotary = Rotary(cfg, self.head_dim, "full_attention")

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, D], positions [B, T] -> q [B, T, H, hd], k, v [B, T, Hkv, hd], gate [B, T, H * hd]."""
        b, t, _ = x.shape
        q, gate = torch.chunk(self.q_proj(x).view(b, t, self.num_heads, 2 * self.head_dim), 2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, positions, self.kernel_paths)
        return q, k, v, gate.reshape(b, t, -1)

    def finish(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, hd], gate [B, T, H * hd] -> [B, T, D]."""
        return self.o_proj(o.reshape(*o.shape[:2], -1) * torch.sigmoid(gate))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v, gate = self.project(x, positions)
        return self.finish(masked_attention(q, k, v, causal_mask(x.shape[1], x.device), self.scaling), gate)


def layer_types_of(cfg: dict) -> list:
    """HF's rule: ``layer_types`` if given, else every ``full_attention_interval``-th layer (default 4) is full."""
    n = cfg["num_hidden_layers"]
    lt = cfg.get("layer_types")
    if lt is None:
        every = cfg.get("full_attention_interval", 4) or 4
        lt = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    lt = list(lt)[:n]
    bad = sorted({t for t in lt if t not in ("linear_attention", "full_attention")})
    if bad or len(lt) != n:
        raise ValueError(f"layer_types must name {n} layers as 'linear_attention' or 'full_attention'; got {lt}")
    return lt


def moe_layers(cfg: dict, n: int) -> list:
    """Which of layers 0..n-1 use the MoE block: every layer of qwen3_5_moe, none of dense qwen3_5; qwen3_next: layers
    with ``(i + 1) % decoder_sparse_step == 0`` not in ``mlp_only_layers`` when num_experts > 0 (HF's and vLLM's rule;
    vLLM applies it to MTP layer i with i = its index in ``mtp.layers``)."""
    mt = cfg.get("model_type")
    if mt in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return [True] * n
    if mt == "qwen3_next" and (cfg.get("num_experts") or 0) > 0:
        step, only = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
        return [(i not in only) and (i + 1) % step == 0 for i in range(n)]
    return [False] * n


class DecoderLayer(BaseDecoderLayer):
    def __init__(self, cfg: dict, layer_idx: int, layer_type: str, moe: bool, fused_qkvz: bool):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, fused_qkvz=fused_qkvz)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx)
        self.mlp = MoE.from_config(cfg) if moe else MLP(d, cfg["intermediate_size"], cfg.get("hidden_act", "silu"))
        self.input_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(d, eps, unit_offset=True)


class _Backbone(nn.Module):
    def __init__(self, cfg: dict, layers: list):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), unit_offset=True)


def unstack_expert_tensors(sd: dict) -> dict:
    """The inverse of ``stack_expert_tensors``: ``<p>.experts.gate_up_proj`` / ``<p>.experts.down_proj`` -> the
    checkpoints' per-expert ``<p>.experts.<e>.{gate,up,down}_proj.weight`` (views: the same bits). Other tensors pass
    through unchanged."""
    out = {}
    for name, t in sd.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, half = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


# config.json key naming the number of MTP layers, as vLLM reads it: qwen3_5 checkpoints carry
# mtp_num_hidden_layers (released: 1); qwen3_next ones may carry num_nextn_predict_layers (the released Qwen3-Next
# config carries neither: vLLM then builds 1)
MTP_LAYERS_KEY = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers",
                  "qwen3_5_text": "mtp_num_hidden_layers", "qwen3_5_moe": "mtp_num_hidden_layers",
                  "qwen3_5_moe_text": "mtp_num_hidden_layers"}


class MultiTokenPredictor(nn.Module):
    """The checkpoint's own MTP module (``mtp.*``; vLLM ``Qwen3NextMultiTokenPredictor`` /
    ``Qwen3_5MultiTokenPredictor``): ``fc`` over ``[pre_fc_norm_embedding(embed(x_{t+1})) ;
    pre_fc_norm_hidden(h_t)]``, one full-attention decoder layer of the target's kind (gated attention, the target's
    MLP or MoE) chosen by ``step % num_layers``, then ``norm``. Embedding and lm_head are the target's (not here).
    cfg: the target's normalised config (``vars(target.config)``)."""

    def __init__(self, cfg: dict, num_layers: int):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        if num_layers < 1:
            raise ValueError(f"an MTP module needs >= 1 layer; got {num_layers}")
        moe = moe_layers(cfg, num_layers)
        fused = cfg.get("model_type") == "qwen3_next"
        self.fc = Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(d, eps, unit_offset=True)
        self.pre_fc_norm_hidden = RMSNorm(d, eps, unit_offset=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cfg["num_hidden_layers"] + i, "full_attention", moe[i], fused)
                                    for i in range(num_layers))
        self.norm = RMSNorm(d, eps, unit_offset=True)

    def combine(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb [..., D] (the target's embedding of x_{t+1}), hidden [..., D] (h_t) -> the layer input [..., D]."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def layer(self, step: int) -> "DecoderLayer":
        """The decoder layer of draft step ``step`` (0-based): ``layers[step % num_layers]``."""
        return self.layers[step % len(self.layers)]

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, step: int = 0) -> torch.Tensor:
        """Plain causal pass over a sequence (the reference).

        Args:
            emb: [B, T, D] the target's embedding of the tokens the rows read (x_{t+1}).
            hidden: [B, T, D] the hidden of the position before (the target's normed h_t, or this head's output).
            positions: [B, T].
            step: the draft step (layer ``step % num_layers``).

        Returns:
            [B, T, D] the normed output (what lm_head reads, and the next step's hidden).
        """
        layer = self.layer(step)
        x = self.combine(emb, hidden)
        x = x + layer.self_attn(layer.input_layernorm(x), positions)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_expert_tensors(raw: dict) -> dict:
    """Per-expert checkpoint tensors ``<p>.experts.<e>.{gate,up,down}_proj.weight`` -> HF 5.x 3-D layout
    ``<p>.experts.gate_up_proj`` [E, 2I, D] (gate rows first) and ``<p>.experts.down_proj`` [E, D, I].
    Other tensors pass through unchanged."""
    groups: dict = {}
    out = {}
    for name, t in raw.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, parts in groups.items():
        n = 1 + max(max(p) for p in parts.values())
        for kind in ("gate_proj", "up_proj", "down_proj"):
            have = parts.get(kind, {})
            if sorted(have) != list(range(n)):
                raise ValueError(f"checkpoint lacks {prefix}.<e>.{kind}.weight for experts "
                                 f"{sorted(set(range(n)) - set(have))}")
        gate = torch.stack([parts["gate_proj"][e] for e in range(n)])
        up = torch.stack([parts["up_proj"][e] for e in range(n)])
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return out


@register_model("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
class Qwen3NextTarget(TargetModel):
    """qwen3_next / qwen3_5 / qwen3_5_moe text model: Gated DeltaNet + gated attention hybrid."""

    fp32_params = ("A_log",)

    def __init__(self, cfg: dict):
        super().__init__()
        cfg = dict(cfg)
        mt = cfg.get("model_type")
        self.model_type = mt
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        # HF's default partial_rotary_factor for these models is 0.25 (set when absent everywhere)
        rp = cfg.get("rope_parameters")
        if "partial_rotary_factor" not in cfg and not (isinstance(rp, dict) and "partial_rotary_factor" in rp):
            cfg["partial_rotary_factor"] = 0.25
        types = layer_types_of(cfg)
        n = cfg["num_hidden_layers"]
        fused = mt == "qwen3_next"
        moe = moe_layers(cfg, n)
        self.config = SimpleNamespace(**cfg)
        self.model = _Backbone(cfg, [DecoderLayer(cfg, i, types[i], moe[i], fused) for i in range(n)])
        self.lm_head = Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.layer_kinds = ["gdn" if t == "linear_attention" else "gqa" for t in types]
        tie = cfg.get("tie_word_embeddings", False)
        self.tied_params = {"lm_head.weight": "model.embed_tokens.weight"} if tie else {}

    def mtp_num_layers(self, cfg: Optional[dict] = None) -> Optional[int]:
        """The number of MTP layers a config names (``MTP_LAYERS_KEY``; ``cfg``: a folder's flat config, default this
        target's), None when it names none."""
        n = (vars(self.config) if cfg is None else cfg).get(MTP_LAYERS_KEY.get(self.model_type, ""))
        return None if n is None else int(n)

    def build_mtp(self, num_layers: int) -> MultiTokenPredictor:
        """A fresh MTP module of this target's kind (weights to be loaded: ``specopd.models.load_mtp``)."""
        return MultiTokenPredictor(vars(self.config), num_layers)

    @staticmethod
    def mtp_key(name: str) -> Optional[str]:
        """A checkpoint tensor name -> its name in ``MultiTokenPredictor`` (``mtp.fc.weight`` -> ``fc.weight``); None
        for the target's own tensors."""
        for prefix in ("mtp.", "model.mtp.", "model.language_model.mtp."):
            if name.startswith(prefix):
                return name[len(prefix):]
        return None

    @staticmethod
    def checkpoint_key(name: str) -> Optional[str]:
        if name.startswith(("mtp.", "model.visual.", "visual.", "model.mtp.", "model.language_model.mtp.")):
            return None
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        return name

    @staticmethod
    def convert_checkpoint(raw: dict, cfg: Optional[dict] = None) -> dict:
        """Called by the loader before ``checkpoint_key``: per-expert tensors -> stacked experts."""
        return stack_expert_tensors(raw)


