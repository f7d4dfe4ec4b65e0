"""What one target call reads and keeps: ``RunContext`` (how the layers see their tokens: plain, prefill or
score; see ``specopd.models.base``), ``TargetCache`` (a prefilled trunk) and ``VerifyState`` (what ``commit``
needs of a verified tree). Below ``base`` and ``packed``, which both build contexts."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
from torch import nn

from specopd_executors import get_executor
from specopd_executors.base import GrowingCache
from specopd_executors.options import ExecOptions
from specopd.tree import ProposalTree


@dataclass
class TargetCache(GrowingCache):
    """What ``prefill`` keeps of one trunk. ``layers[i]`` is layer i's executor cache (has ``nbytes()``).
    token_ids / logits / features grow by amortised appends (``specopd_executors.base.Rows``) when extended."""

    token_ids: torch.Tensor  # [T] long (on the model's device)
    layers: list  # one executor cache per decoder layer
    logits: Optional[torch.Tensor] = None  # [T, V] target logits at every trunk position (prefill keep_logits)
    hidden: Optional[torch.Tensor] = None  # [T, D] what lm_head reads at every trunk position (keep_hidden)
    features: Optional[torch.Tensor] = None  # [T, len(feature_layers) * D] drafter context features
    feature_layers: tuple = ()
    options: ExecOptions = field(default_factory=ExecOptions)  # executor options it was built with (kernels None)
    extra: dict = field(default_factory=dict)  # caches of second mixers in a layer, key (layer_idx, name)

    def __len__(self) -> int:
        return int(self.token_ids.numel())

    def layer_cache(self, key):
        """The executor cache of ``key``: a layer index, or (layer_idx, name) for a second mixer in a layer."""
        return self.layers[key] if isinstance(key, int) else self.extra[key]

    def nbytes(self) -> int:
        """Bytes held by the per-layer caches (not counting logits / hidden / features)."""
        return int(sum(c.nbytes() for c in self.layers) + sum(c.nbytes() for c in self.extra.values()))


@dataclass
class VerifyState:
    """What ``target.score(tree, caches, return_state=True)`` keeps for ``target.commit``.

    tree: the verified tree (M nodes); trunk_lens: the caches' lengths at verify time; layers: per mixer key
    (layer index, or (layer_idx, name)) the mixer and its executor's node state; logits [M, V], hidden [M, D]
    (what lm_head reads: ``head_input``) and features [M, F] (at the caches' feature_layers, None without) of
    every node."""

    tree: ProposalTree
    trunk_lens: list
    layers: dict
    logits: torch.Tensor
    features: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None


class RunContext:
    """How the layers of one target call see their tokens. Built by TargetModel; read by backbones."""

    def __init__(self, mode: str, input_ids: torch.Tensor, positions: torch.Tensor, *,
                 tree: Optional[ProposalTree] = None, caches: Sequence[TargetCache] = (),
                 prev: Optional[TargetCache] = None, feature_layers: Sequence[int] = (),
                 options: Optional[ExecOptions] = None,
                 keep_state: bool = False):
        assert mode in ("plain", "prefill", "score")
        self.mode = mode
        self.input_ids = input_ids  # [B, T] (B = 1 for prefill and score; T = M nodes for score)
        self.positions = positions  # [B, T] semantic positions
        self.tree = tree
        self.caches = list(caches)
        self.prev = prev
        self.options = replace(options) if options is not None else ExecOptions()  # a copy
        self.feature_layers = tuple(feature_layers)
        self.layer_caches: dict = {}
        self.features: dict = {}
        self.keep_state = keep_state  # score mode: keep each executor's node state (for commit)
        self.node_states: dict = {}

    def mix(self, layer_idx: int, mixer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run token mixer ``mixer`` of layer ``layer_idx`` on x [B, T, D] -> [B, T, D].
        ``layer_idx`` may be (layer_idx, name) for a second sequence mixer of one layer (qwen4_exp's PLE conv)."""
        if self.mode == "plain":
            return mixer(x, self.positions)
        ex = get_executor(mixer.kind)
        if self.mode == "prefill":
            prev = self.prev.layer_cache(layer_idx) if self.prev is not None else None
            out, cache = ex.prefill(mixer, x, self.positions, prev=prev, options=self.options)
            self.layer_caches[layer_idx] = cache
            return out
        caches = [c.layer_cache(layer_idx) for c in self.caches]
        if self.keep_state:
            out, nodes = ex.verify(mixer, x, self.tree, caches, options=self.options)
            self.node_states[layer_idx] = (mixer, nodes)
            return out
        return ex.score(mixer, x, self.tree, caches, options=self.options)

    def prev_tokens(self, k: int) -> torch.Tensor:
        """[B, T, k]: the ids of the tokens 1..k steps before each token along its path (-1 before the start)."""
        ids = self.input_ids
        if self.mode == "score":
            trunks = [c.token_ids for c in self.caches]
            _, _, tok = self.tree.path_back(k, trunks)
            return tok.to(ids.device).unsqueeze(0)
        if self.mode == "prefill" and self.prev is not None:
            full = torch.cat([self.prev.token_ids.view(1, -1), ids], dim=1)
        else:
            full = ids
        t0 = full.shape[1] - ids.shape[1]
        pad = torch.full((full.shape[0], k), -1, dtype=full.dtype, device=full.device)
        padded = torch.cat([pad, full], dim=1)  # padded[:, j + k] == full[:, j]
        t = ids.shape[1]
        cols = [padded[:, t0 + k - s: t0 + k - s + t] for s in range(1, k + 1)]
        return torch.stack(cols, dim=-1)

    def record(self, layer_idx: int, h: torch.Tensor) -> None:
        """Backbones call this with each layer's output hidden state [B, T, D] (drafter features)."""
        if layer_idx in self.feature_layers:
            self.features[layer_idx] = h
