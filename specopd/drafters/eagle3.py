"""EAGLE-3 as vLLM serves it (``LlamaForCausalLMEagle3``, vLLM ``llama_eagle3.py``; SpecForge's layout): ``fc`` over the
concatenated features of three target layers, decoder layers whose first reads ``[input_layernorm(embed(x)) ;
hidden_norm(g)]`` (2D), ``norm``, its own ``lm_head`` over a draft vocabulary (``d2t`` / ``t2d``). Drafted one step
at a time (``specopd.drafters.autoregressive``). Design: specopd/drafters/DESIGN.md ("EAGLE-3").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from specopd.drafters.autoregressive import AutoregressiveDrafter
from specopd.drafters.dflash import INIT_STD, DFlashDrafter, DrafterConfig, target_identity
from specopd.models.common import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq, rope_parameters


@dataclass
class Eagle3Config(DrafterConfig):
    """``DrafterConfig`` plus EAGLE-3's keys. ``feature_layers`` are ours (the output of target layer i); the released
    ``eagle_aux_hidden_state_layer_ids`` count vLLM's way (the input of layer i), one more."""

    draft_vocab_size: int = 0  # 0: the target's vocabulary (no d2t / t2d); else the head's columns
    norm_before_fc: bool = False  # an RMSNorm (``input_norm``) over the concatenated features before fc
    norm_before_residual: bool = False  # the residual of layer 0 is hidden_norm(g) instead of g
    own_embedding: bool = False  # the folder ships ``embed_tokens`` (frozen); else the target's is shared
    attention_bias: bool = False  # q/k/v projections with biases
    qk_norm: bool = False  # the Qwen3 variant (vLLM's Eagle3Qwen3ForCausalLM): an RMSNorm over each head of q and k


EAGLE3_KEYS = ("draft_vocab", "norm_before_fc", "norm_before_residual", "own_embedding", "attention_bias", "qk_norm")
ARCH_QWEN3 = "Eagle3Qwen3ForCausalLM"  # vLLM's qwen3_eagle3.py: llama_eagle3's layout with Qwen3's q / k norms


def eagle3_default_layers(num_target_layers: int) -> tuple:
    """vLLM's default aux layers (2, L // 2, L - 3) (the input of those layers) as our feature layers (the output of
    the layer before), kept inside the target, sorted and distinct (vLLM collects each layer once, in order)."""
    L = int(num_target_layers)
    return tuple(sorted({min(max(0, i - 1), L - 1) for i in (2, L // 2, L - 3)}))


class Eagle3Attention(nn.Module):
    """Llama attention whose input is 2D in layer 0; the Qwen3 variant (``qk_norm``) normalises each head of q and k
    (``q_norm`` / ``k_norm`` [hd]) before RoPE, as vLLM's Qwen3 attention."""

    kernel_paths = None  # the recipe's kernels: section for RoPE (``hand_down``)

    def __init__(self, c: Eagle3Config, in_dim: int):
        super().__init__()
        self.h, self.hkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(in_dim, self.h * self.hd, bias=c.attention_bias)
        self.k_proj = nn.Linear(in_dim, self.hkv * self.hd, bias=c.attention_bias)
        self.v_proj = nn.Linear(in_dim, self.hkv * self.hd, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.h * self.hd, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def forward(self, x, cos, sin, attend, i, out=None):
        """Layer i's attention of M rows.

        Args:
            x: [M, in_dim] the normed input.
            cos, sin: [M, hd] RoPE at the rows' positions.
            attend: ``attend(i, q, k, v) -> o`` (``AutoregressiveDrafter.rows``).
            i: the layer's index.
            out: [M'] the rows whose output is wanted (their queries only; K/V of all rows); None: all.

        Returns:
            [M', D].
        """
        m = x.shape[0]
        xq, cq, sq = (x, cos, sin) if out is None else (x[out], cos[out], sin[out])
        q, k = self.q_proj(xq).view(1, xq.shape[0], self.h, self.hd), self.k_proj(x).view(1, m, self.hkv, self.hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cq[None], sq[None], self.kernel_paths)[0]
        k = apply_rope(k, cos[None], sin[None], self.kernel_paths)[0]
        v = self.v_proj(x).view(m, self.hkv, self.hd)
        return self.o_proj(attend(i, q, k, v).reshape(xq.shape[0], self.h * self.hd))


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config, first: bool):
        super().__init__()
        d = c.hidden_size
        self.first = first
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c, 2 * d if first else d)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.mlp = MLP(d, c.intermediate_size, c.hidden_act)
        self.norm_before_residual = c.norm_before_residual


class Eagle3Drafter(AutoregressiveDrafter):
    """EAGLE-3 drafter. Build with ``build_drafter("eagle3", target)``; see specopd/drafters/DESIGN.md."""

    kind = "eagle3"
    has_confidence = False
    config_class = Eagle3Config

    def __init__(self, target, config: Eagle3Config, seed: Optional[int] = 0):
        super().__init__()
        self.__dict__["target"] = target
        self.config = c = config
        self.attention_backend = "auto"
        bad = self.config_problems(c, target_identity(target))
        if bad:
            raise ValueError("drafter config out of range: " + "; ".join(f"{k}={v!r} ({rule})" for k, v, rule in bad))
        d, f = c.hidden_size, len(c.feature_layers) * c.hidden_size
        v = int(target.vocab_size)
        if c.norm_before_fc:
            self.input_norm = RMSNorm(f, c.rms_norm_eps)
        self.fc = nn.Linear(f, d, bias=False)
        self.layers = nn.ModuleList(Eagle3Layer(c, i == 0) for i in range(c.num_layers))
        self.norm = RMSNorm(d, c.rms_norm_eps)
        vq = c.draft_vocab_size or v
        self.lm_head = nn.Linear(d, vq, bias=False)
        if c.own_embedding:
            self.embed_tokens = nn.Embedding(v, d)
            self.embed_tokens.weight.requires_grad_(False)  # frozen, as SpecForge trains it
        if c.draft_vocab_size:
            self.register_buffer("d2t", torch.zeros(vq, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(v, dtype=torch.bool))
        if seed is not None:
            self._init_weights(seed)
        self.to(target.device)
        self._rope = rope_inv_freq(rope_parameters({"rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
                                                    "max_position_embeddings": c.target.get("max_position_embeddings")}),
                                   c.head_dim)
        self.scale = c.head_dim ** -0.5

    @classmethod
    def config_problems(cls, c: Eagle3Config, ident: dict) -> list:
        """(field, value, what it must be) for every setting this kind cannot be built with: ``DFlashDrafter``'s
        rules but the mask token's (EAGLE-3 has none), and the draft vocabulary's size."""
        bad = [b for b in DFlashDrafter.config_problems(c, ident) if b[0] != "mask_token_id"]
        ids = list(c.feature_layers)
        if any(b <= a for a, b in zip(ids, ids[1:])):
            bad.append(("feature_layers", ids, "increasing and distinct: vLLM collects the aux layers sorted, each once"))
        vocab = ident.get("vocab_size")
        if not 0 <= c.draft_vocab_size <= (vocab or c.draft_vocab_size):
            bad.append(("draft_vocab_size", c.draft_vocab_size, f"in [1, vocab_size={vocab}] (0: the target's)"))
        return bad

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Deterministic in ``seed``: Linear weights ~ N(0, 0.02^2), biases 0, norms 1; the head starts as the
        target's lm_head rows of the draft vocabulary (an identity d2t until ``set_draft_vocab``), the embedding
        (when own) as the target's."""
        g = torch.Generator().manual_seed(int(seed))
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() >= 2 and not name.startswith(("lm_head", "embed_tokens")):
                p.copy_(torch.randn(p.shape, generator=g) * INIT_STD)
        if self.lm_head.weight.is_meta:  # a shape-only build (the memory plan): nothing to copy
            return
        self.set_draft_vocab(torch.arange(self.lm_head.weight.shape[0]))
        if self.config.own_embedding:
            self.embed_tokens.weight.copy_(self.target.model.embed_tokens.weight)

    @torch.no_grad()
    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """The head's columns are the target tokens ``ids`` [Vq] (sorted, distinct): d2t / t2d as SpecForge writes
        them (target = i + d2t[i]), the head's rows copied from the target's lm_head."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
        vq = self.lm_head.weight.shape[0]
        if ids.numel() != vq or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError(f"set_draft_vocab: {vq} sorted distinct target ids needed; got {ids.numel()}")
        head = getattr(self.target, "lm_head", None)
        if head is not None and getattr(head, "weight", None) is not None and head.weight.device.type != "meta":
            self.lm_head.weight.copy_(head.weight.detach()[ids.to(head.weight.device)].to(self.lm_head.weight))
        if self.config.draft_vocab_size:
            self.d2t.copy_(ids - torch.arange(vq))
            self.t2d.zero_()
            self.t2d[ids] = True

    # -- properties ---------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    @property
    def feature_layers(self) -> tuple:
        return tuple(int(i) for i in self.config.feature_layers)

    @property
    def mask_token_id(self) -> Optional[int]:
        return None

    dtype = DFlashDrafter.dtype  # fc's, as DFlash's
    device = DFlashDrafter.device

    @property
    def vocab_ids(self) -> Optional[torch.Tensor]:
        """[Vq] the target ids of the head's columns (None: the target's whole vocabulary)."""
        if not self.config.draft_vocab_size:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    # -- the model ---------------------------------------------------------------------------------------------
    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.config.own_embedding:
            return self.embed_tokens(tokens)
        return self.target.embed(tokens)

    def context_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """features [M, F] -> fc(input_norm?(features)) [M, D] (vLLM's ``combine_hidden_states``)."""
        x = features.to(device=self.device, dtype=self.dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        return self.fc(x)

    def rows(self, tokens, hidden, positions, attend, out=None):
        """One step of M rows: vLLM's ``LlamaModel.forward`` with its fused add-norms written out.

        Args / Returns: as ``AutoregressiveDrafter.rows`` (hidden_out = the pre-norm residual vLLM feeds the next
        step)."""
        e = self.embed(tokens.to(self.device)).to(self.dtype)
        cos, sin = rope_cos_sin(positions.to(self.device), self._rope.to(self.device), self.dtype)
        h = hidden.to(self.dtype)
        res = None
        for i, layer in enumerate(self.layers):
            if layer.first:
                gn = layer.hidden_norm(h)
                res = gn if layer.norm_before_residual else h
                x = torch.cat([layer.input_layernorm(e), gn], -1)
            else:
                res = h + res
                x = layer.input_layernorm(res)
            sub = out if i == len(self.layers) - 1 else None  # the last layer: the wanted rows only
            res = layer.self_attn(x, cos, sin, attend, i, sub) + (res if sub is None else res[sub])
            h = layer.mlp(layer.post_attention_layernorm(res))
        res = h + res
        return self.norm(res), res

    # -- save: DFlash's (config.json = asdict(config), model.safetensors = the state dict) --------------------
    def config_dict(self) -> dict:
        """DFlash's, without ``qk_norm`` while it is False: checkpoints of the llama layout keep the bytes they had
        before the Qwen3 variant existed (a folder without it reads as False)."""
        cfg = DFlashDrafter.config_dict(self)
        if not cfg["qk_norm"]:
            del cfg["qk_norm"]
        return cfg

    save = DFlashDrafter.save


# ------------------------------------------------------------------------------------------- the released layout
def eagle3_config_from_released(raw: dict, path: str, f, target_layers: Optional[int] = None) -> Eagle3Config:
    """A ``LlamaForCausalLMEagle3`` config.json -> Eagle3Config. Aux layer ids absent: vLLM's default for the target's
    layers; the features we do not implement are refused by name.

    Args:
        raw: the config.json.
        path: the folder (named in errors).
        f: its ``layout.ConfigFields`` (typed values).
        target_layers: the target's layer count when known.

    Returns:
        Eagle3Config.
    """
    ec = raw.get("eagle_config") or {}
    if not isinstance(ec, dict):
        raise f.wrong("eagle_config", ec, "an object")
    unsupported = [k for k in ("fc_norm", "norm_output", "parallel_drafting") if raw.get(k) or ec.get(k)]
    if ec.get("use_aux_hidden_state", True) is False:
        unsupported.append("use_aux_hidden_state")
    if any(t != "full_attention" for t in raw.get("layer_types") or []):
        unsupported.append("sliding_attention layers")
    n, hidden = f.need("num_hidden_layers", int), f.need("hidden_size", int)
    ths = f.get("target_hidden_size", int, nested=False)
    if ths is not None and ths != hidden:
        unsupported.append(f"target_hidden_size={ths} != hidden_size={hidden}")
    if unsupported:
        raise ValueError(f"{path}/config.json uses {', '.join(unsupported)}, which SpecOPD's EAGLE-3 does not "
                         f"implement")
    spec = raw.get("specopd") if isinstance(raw.get("specopd"), dict) else {}
    ntl = (spec.get("target") or {}).get("num_hidden_layers", target_layers)
    aux = ec.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    if aux is None:
        if ntl is None:
            raise ValueError(f"{path}/config.json has no eagle_config.eagle_aux_hidden_state_layer_ids, and the "
                             f"target's layer count (for vLLM's default) is not known here")
        ids = eagle3_default_layers(int(ntl))
    else:
        aux = f.ints("eagle_config.eagle_aux_hidden_state_layer_ids", aux)
        if any(i < 1 for i in aux):
            raise ValueError(f"{path}/config.json: eagle_aux_hidden_state_layer_ids {list(aux)} reads the embedding "
                             f"(id 0: the input of layer 0), which SpecOPD's features do not hold; ids >= 1")
        ids = tuple(i - 1 for i in aux)
    heads = f.need("num_attention_heads", int)
    vocab = f.need("vocab_size", int)
    dv = f.get("draft_vocab_size", int, vocab, nested=False)
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise f.wrong("rope_scaling", rope_scaling, "an object or null")
    target = (f.target("specopd.target", spec["target"]) if spec.get("target") else
              {"vocab_size": vocab, "hidden_size": hidden, **({"num_hidden_layers": int(ntl)} if ntl else {}),
               **({"max_position_embeddings": f.get("max_position_embeddings", int, nested=False)}
                  if raw.get("max_position_embeddings") else {})})

    def flag(name):
        v = ec.get(name, raw.get(name, False))
        return f.typed(f"eagle_config.{name}" if name in ec else name, v, bool)

    return Eagle3Config(
        kind="eagle3", num_layers=n, block_size=int(spec.get("block_size", 8)), feature_layers=ids,
        hidden_size=hidden, num_heads=heads, num_kv_heads=f.get("num_key_value_heads", int, heads, nested=False),
        head_dim=f.get("head_dim", int, hidden // max(heads, 1), nested=False),
        intermediate_size=f.need("intermediate_size", int), rms_norm_eps=f.get("rms_norm_eps", float, 1e-6, False),
        rope_theta=f.get("rope_theta", float, 10000.0, False),
        rope_scaling=dict(rope_scaling) if rope_scaling else None, hidden_act=str(raw.get("hidden_act", "silu")),
        mask_token_id=None, learned_mask=False, target=target, draft_vocab_size=0 if dv == vocab else dv,
        norm_before_fc=flag("norm_before_fc"), norm_before_residual=flag("norm_before_residual"),
        attention_bias=flag("attention_bias"), qk_norm=ARCH_QWEN3 in (raw.get("architectures") or []))


def eagle3_arch(cfg: Eagle3Config) -> str:
    """The released architecture name of ``cfg``: the Qwen3 variant's, or SpecForge's llama one."""
    return ARCH_QWEN3 if cfg.qk_norm else "LlamaForCausalLMEagle3"


def eagle3_released_config(cfg: Eagle3Config, dtype_name: str, fmt: int) -> dict:
    """Eagle3Config -> the ``LlamaForCausalLMEagle3`` config.json SpecForge writes and vLLM / SGLang load
    (``Eagle3Qwen3ForCausalLM`` for the Qwen3 variant) (+ our ``specopd`` entry: kind, block_size, target)."""
    t = cfg.target or {}
    return {
        "architectures": [eagle3_arch(cfg)], "model_type": "qwen3" if cfg.qk_norm else "llama",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in cfg.feature_layers],
                         "use_aux_hidden_state": True, "norm_before_fc": bool(cfg.norm_before_fc)},
        "norm_before_residual": bool(cfg.norm_before_residual),
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": int(t.get("max_position_embeddings") or 40960),
        "vocab_size": t.get("vocab_size"), "draft_vocab_size": cfg.draft_vocab_size or t.get("vocab_size"),
        "target_hidden_size": cfg.hidden_size, "tie_word_embeddings": False,
        "attention_bias": bool(cfg.attention_bias), "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True, "torch_dtype": dtype_name,
        "specopd": {"kind": "eagle3", "format": fmt, "block_size": int(cfg.block_size), "target": dict(t)},
    }
