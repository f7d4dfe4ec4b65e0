"""MTP: the target's own multi-token-prediction head (``mtp.*`` of qwen3_next / qwen3_5 checkpoints) as a drafter,
exactly as vLLM's ``qwen3_next_mtp`` / ``qwen3_5_mtp`` run it, loaded from and exported to folders vLLM's
``method: mtp`` reads. Design: specopd/drafters/DESIGN.md ("MTP").
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from specopd.drafters.autoregressive import AutoregressiveDrafter
from specopd.drafters.dflash import target_identity
from specopd.errors import BadInputError, FolderNotEmptyError, make_dir, replacing_path, write_replace
from specopd.models.common import hand_down
from specopd.models.loading import NoMTPError, checkpoint_names, load_mtp, read_selected
from specopd.models.qwen3_next import MTP_LAYERS_KEY, stack_expert_tensors, unstack_expert_tensors

FORMAT = 1  # our MTP folder format


@dataclass
class MTPConfig:
    """Everything needed to rebuild an MTP drafter besides its weights (which come from a folder)."""

    kind: str
    num_layers: int  # MTP layers (the checkpoint's num_nextn_predict_layers / mtp_num_hidden_layers)
    block_size: int  # counts the anchor, as the other drafters': W = block_size - 1 draft steps per branch
    hidden_size: int
    source_config: dict = field(default_factory=dict)  # the target folder's config.json as written
    target: dict = field(default_factory=dict)  # target_identity
    num_heads: int = 0  # the layer's sizes (the target's), for the memory plan
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0  # MLP width, or the MoE's per token (top-k experts + the shared expert)
    format: int = FORMAT

    @property
    def draft_len(self) -> int:
        return int(self.block_size) - 1


class MTPDrafter(AutoregressiveDrafter):
    """The checkpoint's MTP module (``self.mtp``: state-dict names are the released ``mtp.*`` ones) on the
    autoregressive base (``AutoregressiveDrafter``: trunk context, unrolled branches, decoding caches, sampling). The
    target's embedding, final norm and lm_head are shared and frozen (kept outside the module tree).

    A row reads (token, hidden): context row p = (x_{p+1}, the target's normed final hidden h_p), a later step = (the
    token drafted before, this head's normed output of the step before); ``rows`` is vLLM's
    ``*MultiTokenPredictor.forward`` with ``mtp.layers.0``: vLLM 0.32's proposer passes no ``spec_step_idx``, so
    that layer drafts every step (a head of more layers keeps the others, loaded, exported and untrained)."""

    kind = "mtp"
    has_confidence = False
    soft_ttt = False  # offpolicy_ce: CE on the reference's next tokens at every chained step, as MTP heads are trained

    def __init__(self, target, config: MTPConfig, mtp: nn.Module):
        super().__init__()
        self.__dict__["target"] = target  # not a submodule: no target weights in state_dict / parameters
        self.config = config
        self.mtp = mtp
        for layer in mtp.layers[1:]:  # never run by vLLM's MTP proposer: kept as loaded
            layer.requires_grad_(False)
        self.attention_backend = "auto"
        self.scale = mtp.layers[0].self_attn.scaling

    # -- properties (the names every drafter has) ---------------------------------------------------------
    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    @property
    def feature_layers(self) -> tuple:
        """The target's last layer: its output through the target's final norm is the hidden vLLM feeds an MTP head."""
        return (int(self.target.num_layers) - 1,)

    @property
    def mask_token_id(self) -> Optional[int]:
        return None

    @property
    def dtype(self) -> torch.dtype:
        return self.mtp.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.mtp.fc.weight.device

    @property
    def layers(self) -> list:
        """The layers the base sizes its caches by: the one that drafts (``mtp.layers.0``), its K/V heads and head
        size under the base's names."""
        a = self.mtp.layers[0].self_attn
        return [SimpleNamespace(self_attn=SimpleNamespace(hkv=a.num_kv_heads, hd=a.head_dim))]

    # -- the model (what the base asks for) ---------------------------------------------------------------
    def head_weight(self) -> torch.Tensor:
        return self.target.lm_head.weight

    def context_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """features [M, D] (the target's last layer output) -> the target's final norm of it [M, D] (what its lm_head
        reads: vLLM's Qwen3Next / Qwen3_5 models return it and the MTP proposer feeds it as is)."""
        return self.target.head_input(features.to(device=self.device, dtype=self.target.dtype))

    def rows(self, tokens, hidden, positions, attend, out=None):
        """One step of M rows: ``fc([norm(embed(tokens)) ; norm(hidden)])``, the decoder layer (gated attention
        through ``attend(0, ...)``, MLP or MoE), ``norm``.

        Args / Returns: as ``AutoregressiveDrafter.rows`` (hidden_out = normed: vLLM feeds the MTP's output back as
        is)."""
        layer = self.mtp.layers[0]
        attn = layer.self_attn
        e = self.target.embed(tokens.to(self.device)).to(self.dtype)
        x = self.mtp.combine(e, hidden.to(self.dtype))[None]  # [1, M, D]
        q, k, v, gate = attn.project(layer.input_layernorm(x), positions.to(self.device)[None])
        if out is not None:  # the wanted rows' queries only (K/V of all rows)
            q, gate, x = q[:, out], gate[:, out], x[:, out]
        o = attend(0, q[0], k[0], v[0])
        h = x + attn.finish(o[None], gate)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        normed = self.mtp.norm(h)[0]
        return normed, normed

    def config_dict(self) -> dict:
        """config.json of its checkpoints: ``folder_config`` (what ``build_mtp`` loads back)."""
        return folder_config(self.config)


# ------------------------------------------------------------------------------------------- folders


def mtp_layers_key(source_config: dict) -> str:
    """The config.json key naming the MTP layer count for this target's model type (vLLM's)."""
    mt = read_text_config(source_config).get("model_type")
    if mt not in MTP_LAYERS_KEY:
        raise BadInputError(f"drafter.kind=mtp needs a qwen3_next or qwen3_5 target; this one is {mt!r}")
    return MTP_LAYERS_KEY[mt]


def read_text_config(raw: dict) -> dict:
    """The text model's config of a config.json (a composite one's ``text_config``)."""
    return raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


DEFAULT_BLOCK_SIZE = 3  # a target folder records no draft length: 2 steps, what Qwen's MTP serving examples use


def build_mtp(target, folder: str, block_size: Optional[int] = None) -> MTPDrafter:
    """The MTP drafter of ``target`` from ``folder``: the target folder itself (its ``mtp.*`` tensors as released),
    one of our MTP checkpoints or an export (``export_mtp``). Drafts W = block_size - 1 steps per branch (None: the
    folder's, else ``DEFAULT_BLOCK_SIZE``)."""
    if block_size is None:
        with open(os.path.join(folder, "config.json")) as f:
            block_size = (json.load(f).get("specopd") or {}).get("block_size", DEFAULT_BLOCK_SIZE)
    if int(block_size) < 2:
        raise ValueError(f"block_size={block_size}: counts the anchor, so >= 2 (W = block_size - 1 draft steps)")
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    ours = raw.get("specopd") or {}
    if ours and ours.get("kind") != "mtp":
        raise BadInputError(f"{folder}/config.json: a {ours.get('kind')!r} drafter folder, not an MTP one")
    ident = target_identity(target)
    if ours and dict(ours.get("target") or {}) != ident:
        raise BadInputError(f"{folder}: an MTP head for the target {ours.get('target')}, not this one ({ident})")
    mtp = load_mtp(folder, target, dtype=torch.float32)  # the training precision, as every drafter's
    drafter = MTPDrafter(target, mtp_config(target, mtp, block_size, {k: v for k, v in raw.items() if k != "specopd"}),
                         mtp)
    return hand_down(drafter, getattr(target, "kernel_paths", None))  # the target's kernels: section


def mtp_config(target, mtp: nn.Module, block_size: int, source: dict) -> MTPConfig:
    """The MTPConfig of a head drafting for a target.

    Args:
        target: the target.
        mtp: its MultiTokenPredictor.
        block_size: W + 1.
        source: the folder's config.json (without our ``specopd`` entry).

    Returns:
        MTPConfig.
    """
    a, mlp = mtp.layers[0].self_attn, mtp.layers[0].mlp
    if hasattr(mlp, "experts"):
        shared = mlp.shared_expert.gate_proj.out_features if mlp.shared_expert is not None else 0
        inter = mlp.gate.top_k * mlp.experts.down_proj.shape[-1] + shared
    else:
        inter = mlp.gate_proj.out_features
    return MTPConfig(kind="mtp", num_layers=len(mtp.layers), block_size=int(block_size),
                     hidden_size=int(target.hidden_size), source_config=source, target=target_identity(target),
                     num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, intermediate_size=inter)


def mtp_skeleton(target, block_size: int) -> MTPDrafter:
    """A shape-only MTP drafter on the meta device (the memory plan): the head the target's config names (one layer
    when it names none), no weights read."""
    with torch.device("meta"):
        mtp = target.build_mtp(target.mtp_num_layers() or 1)
    return hand_down(MTPDrafter(target, mtp_config(target, mtp, block_size, {}), mtp),
                     getattr(target, "kernel_paths", None))


def folder_config(cfg: MTPConfig) -> dict:
    """config.json of our MTP folders (checkpoints and exports): the target's config.json as written (a composite
    one keeps its ``text_config``) with its MTP layer count set, and a ``specopd`` entry (kind, block_size, target
    identity) that lets ``build_mtp`` check the folder."""
    src = copy.deepcopy(cfg.source_config)
    read_text_config(src)[mtp_layers_key(src)] = int(cfg.num_layers)
    src["specopd"] = {"kind": "mtp", "format": FORMAT, "block_size": int(cfg.block_size), "target": dict(cfg.target)}
    return src


def write_mtp(out_dir: str, config: dict, tensors: dict, dtype: Optional[torch.dtype], force: bool) -> list:
    """Write an MTP folder: ``config.json`` and ``model.safetensors``.

    Args:
        out_dir: empty or new (``FolderNotEmptyError`` otherwise, unless ``force``: its model.safetensors and
            config.json are replaced).
        config: the config.json content.
        tensors: by checkpoint name (written with MoE experts one by one, as released).
        dtype: the weights' dtype (None: as given).
        force: see out_dir.

    Returns:
        the files written.
    """
    have = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if have and not force:
        raise FolderNotEmptyError(f"{out_dir!r} already holds {len(have)} file(s) ({', '.join(have[:3])}); export into "
                                  f"an empty folder, or pass --force (force=True) to replace its MTP files")
    sd = {}
    for k, v in unstack_expert_tensors(tensors).items():
        v = v.detach().cpu()
        sd[k] = (v if dtype is None else v.to(dtype)).contiguous()
    make_dir(out_dir, "MTP export folder")
    with replacing_path(os.path.join(out_dir, "model.safetensors")) as tmp:
        safetensors.torch.save_file(sd, tmp, metadata={"format": "pt"})
    write_replace(os.path.join(out_dir, "config.json"), json.dumps(config, indent=2))
    return ["config.json", "model.safetensors"]


def export_mtp(drafter: MTPDrafter, out_dir: str, dtype: Optional[torch.dtype] = None, force: bool = False) -> str:
    """Write the folder vLLM's ``--speculative-config '{"method": "mtp", "model": OUT, ...}'`` reads: ``folder_config``
    and ``model.safetensors`` with the ``mtp.*`` tensors under their released names plus the target's embedding and
    lm_head (vLLM's loader wants every parameter of the draft model from the folder, then shares the target's).

    Args:
        drafter: the MTPDrafter.
        out_dir: empty or new (``FolderNotEmptyError`` otherwise, unless ``force``).
        dtype: the weights' dtype (default: the drafter's).
        force: replace the MTP files of a folder that holds other files.

    Returns:
        out_dir.
    """
    t = drafter.target
    cfg = drafter.config
    composite = "text_config" in cfg.source_config
    sd = {"mtp." + k: v for k, v in drafter.mtp.state_dict().items()}
    sd["model.language_model.embed_tokens.weight" if composite else "model.embed_tokens.weight"] = \
        t.model.embed_tokens.weight
    if not read_text_config(cfg.source_config).get("tie_word_embeddings", False):
        sd["lm_head.weight"] = t.lm_head.weight
    write_mtp(out_dir, folder_config(cfg), sd, dtype or drafter.dtype, force)
    return out_dir


def export_mtp_folder(src: str, target_dir: str, out_dir: str, dtype: Optional[torch.dtype] = None,
                      force: bool = False) -> dict:
    """``export_mtp`` without loading the target (``specopd export`` of an MTP run): the ``mtp.*`` tensors of ``src``
    (our checkpoint, an export, or a target folder) and the target's embedding and lm_head read by name from
    ``target_dir``'s safetensors.

    Args:
        src: the MTP folder.
        target_dir: the target's folder.
        out_dir, dtype, force: as ``export_mtp``.

    Returns:
        the written config.json.
    """
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    ours = raw.get("specopd") or {}
    keep = lambda n: n.startswith("mtp.")  # noqa: E731
    sd = read_selected(src, keep)
    if not sd:
        raise NoMTPError(f"{src}: no mtp.* tensors: not an MTP head")
    source = {k: v for k, v in raw.items() if k != "specopd"}
    n = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("mtp.layers."))
    cfg = MTPConfig(kind="mtp", num_layers=n, block_size=int(ours.get("block_size", DEFAULT_BLOCK_SIZE)),
                    hidden_size=int(read_text_config(raw)["hidden_size"]), source_config=source,
                    target=dict(ours.get("target") or {}))
    target = read_selected(target_dir, lambda n: not n.startswith("mtp.") and (n.endswith("embed_tokens.weight") or
                                                                               n == "lm_head.weight"))
    if not any(k.endswith("embed_tokens.weight") for k in target):
        raise BadInputError(f"{target_dir}: no embed_tokens tensor: give the target's folder (the MTP export carries "
                            f"the target's embedding and lm_head, as vLLM loads them)")
    sd = stack_expert_tensors(sd)  # one layout in, one out: experts one by one
    config = folder_config(cfg)
    write_mtp(out_dir, config, {**sd, **target}, dtype, force)
    return config


def is_mtp_folder(folder: str) -> bool:
    """Whether ``folder`` holds an MTP head: our MTP checkpoint / export, or a target folder with ``mtp.*`` tensors."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    ours = raw.get("specopd") if isinstance(raw.get("specopd"), dict) else {}
    if ours:
        return ours.get("kind") == "mtp"
    if read_text_config(raw).get("model_type") not in MTP_LAYERS_KEY:
        return False
    try:
        return any(name.startswith("mtp.") for name in checkpoint_names(folder))
    except (OSError, ValueError, SafetensorError):  # no or unreadable weights: not an MTP folder (the caller says why)
        return False


def describe_mtp_export(src: str, out_dir: str, config: dict, target_path: Optional[str] = None) -> str:
    """What ``specopd export`` of an MTP head prints: what was written and the vLLM command that serves it.

    Args:
        src: the exported folder.
        out_dir: the export.
        config: its config.json.
        target_path: the target's folder (None: a placeholder).

    Returns:
        the lines.
    """
    return "\n".join([f"exported the MTP head of {src} to {out_dir} (mtp.* + the target's embed_tokens and lm_head, "
                      f"the target's config.json with its MTP layer count)",
                      mtp_serving_command(out_dir, config, target_path)])


def mtp_serving_command(out_dir: str, config: dict, target_path: Optional[str] = None) -> str:
    """The vLLM command line that serves ``target_path`` with the MTP export ``out_dir`` (its config.json:
    ``config``)."""
    w = int(config["specopd"]["block_size"]) - 1
    spec = json.dumps({"method": "mtp", "model": os.path.abspath(out_dir), "num_speculative_tokens": w})
    return f"vllm serve {target_path or '<TARGET_MODEL_DIR>'} --speculative-config '{spec}'"
