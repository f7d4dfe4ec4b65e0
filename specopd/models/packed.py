"""Packed trunk prefill: a step's sequences in one target pass (``TargetModel.prefill_batch``), one cache per
trunk. Design: specopd/models/DESIGN.md ("Packed prefill").
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from specopd_executors import get_executor
from specopd_executors.options import ExecOptions
from specopd.models.context import RunContext, TargetCache


class PackedUnsupported(Exception):
    """A layer of this model cannot run packed; ``prefill_batch`` falls back to one prefill per trunk."""


class PackedPrefillContext(RunContext):
    """A prefill RunContext over packed trunks: mixers run their executor's ``prefill_packed``."""

    def __init__(self, input_ids, positions, cu_seqlens: list, feature_layers, options):
        super().__init__("prefill", input_ids, positions, feature_layers=feature_layers, options=options)
        self.cu_seqlens = cu_seqlens

    def mix(self, layer_idx, mixer, x):
        ex = get_executor(mixer.kind)
        run = getattr(ex, "prefill_packed", None)
        if run is None or not isinstance(layer_idx, int):
            raise PackedUnsupported(f"mixer kind {mixer.kind!r} of layer {layer_idx} has no packed prefill")
        out, caches = run(mixer, x, self.positions, self.cu_seqlens, options=self.options)
        self.layer_caches[layer_idx] = caches
        return out

    def prev_tokens(self, k: int):
        raise PackedUnsupported("the model reads earlier tokens outside its mixers")


def use_packed(target, packed) -> bool:
    """``packed``: True (always try), False (never), "auto" (on CUDA, and on the CPU for bf16 / fp16 targets, unless
    this model was found unpackable). On the CPU one pass over all trunks' tokens runs the matmuls at M = sum T_i
    instead of T_i (faster in bf16: the bf16 report in ``benchmarks/results/``); fp32 on the CPU
    stays per trunk, so a trunk's numbers do not depend on its batch-mates to the bit (``trainer.cache_trunks``)."""
    if packed not in (True, False, "auto"):
        raise ValueError(f"packed must be True, False or 'auto'; got {packed!r}")
    if packed == "auto":
        return target.packed_ok and (target.device.type == "cuda" or target.dtype != torch.float32)
    return bool(packed) and target.packed_ok


@torch.no_grad()
def prefill_batch(target, trunks: Sequence[torch.Tensor], *, feature_layers: Optional[Sequence[int]] = None,
                  gdn_checkpoint_every: int = 64, keep_logits: bool = True, keep_hidden: bool = False,
                  keep_checkpoints: bool = True, packed="auto") -> list:
    """Prefill fresh trunks in one varlen pass where every executor supports it, else one by one; equal to
    ``target.prefill(ids, ...)`` of each (same options, logits, features, layer caches).

    Args:
        target: the TargetModel.
        trunks: list of [T_i] token ids.
        feature_layers, gdn_checkpoint_every, keep_logits, keep_hidden, keep_checkpoints: as ``TargetModel.prefill``.
        packed: True | False | "auto" (packed on CUDA and for low-precision targets, unless it failed once on this
            target: ``target.packed_ok``).

    Returns:
        list of one TargetCache per trunk.
    """
    trunks = [torch.as_tensor(t, device=target.device).reshape(-1).to(torch.long) for t in trunks]
    kw = dict(feature_layers=feature_layers, gdn_checkpoint_every=gdn_checkpoint_every, keep_logits=keep_logits,
              keep_hidden=keep_hidden, keep_checkpoints=keep_checkpoints)
    if len(trunks) <= 1 or not use_packed(target, packed) or any(t.numel() == 0 for t in trunks):
        return [target.prefill(t, **kw) for t in trunks]
    feature_layers = tuple(feature_layers or ())
    ids = torch.cat(trunks).view(1, -1)
    target.check_ids(ids)
    lens = [int(t.numel()) for t in trunks]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    pos = torch.cat([torch.arange(n, device=target.device) for n in lens]).view(1, -1)
    opts = ExecOptions(gdn_checkpoint_every=int(gdn_checkpoint_every), gdn_keep_checkpoints=bool(keep_checkpoints))
    if opts.gdn_checkpoint_every < 1:
        raise ValueError("gdn_checkpoint_every must be >= 1")
    ctx = PackedPrefillContext(ids, pos, cu, feature_layers, target.run_options(opts))
    try:
        h = target.backbone(ctx)
    except PackedUnsupported:
        target.packed_ok = False
        return [target.prefill(t, **kw) for t in trunks]
    hn = target.head_input(h)[0] if (keep_logits or keep_hidden) else None  # [N, D] what lm_head reads
    logits = target.lm_head(hn) if keep_logits else None  # [N, V]
    hidden = hn if keep_hidden else None
    feats = torch.cat([ctx.features[i][0] for i in feature_layers], dim=-1) if feature_layers else None
    out = []
    for j, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        layers = [ctx.layer_caches[i][j] for i in range(target.num_layers)]
        out.append(TargetCache(token_ids=trunks[j], layers=layers,
                               logits=None if logits is None else logits[a:b],
                               hidden=None if hidden is None else hidden[a:b],
                               features=None if feats is None else feats[a:b], feature_layers=feature_layers,
                               options=replace(opts), extra={}))
    return out
