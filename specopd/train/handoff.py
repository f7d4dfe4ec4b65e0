"""What the phases of one training step (``specopd.train.phases``) hand each other, as typed records.
N = branches, W = drafted tokens per branch, D = hidden size, F = feature width, T = trunk length.
Which phase hands what: specopd/train/DESIGN.md ("Step handoff").
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch


@dataclass
class Trunk:
    """Split roles: what the drafter worker needs of a trunk the target worker prefilled (and keeps)."""

    token_ids: torch.Tensor  # [T] int64, the reference sequence
    features: torch.Tensor  # [T, F], the drafter's conditioning features (outputs of its feature layers)

    def to(self, device) -> "Trunk":
        return Trunk(self.token_ids.to(device), self.features.to(device))


@dataclass
class Branches:
    """The part of the proposals the target scores (split roles: sent drafter -> target worker)."""

    anchors: torch.Tensor  # [N] int64, trunk positions (branch b drafts the tokens at anchors[b] + 1 ..)
    trunk_index: torch.Tensor  # [N] int64, the trunk (row of the share) each branch hangs off
    tokens: torch.Tensor  # [N, W] int64, branch tokens (sampled, or the reference's when reference)
    reference: bool  # True: off-policy blocks of reference tokens (scored from the trunk, no tree pass)

    def to(self, device) -> "Branches":
        return replace(self, anchors=self.anchors.to(device), trunk_index=self.trunk_index.to(device),
                       tokens=self.tokens.to(device))


@dataclass
class Proposals:
    """The branches of one worker's share and the drafter forward that proposed them."""

    anchors: torch.Tensor  # [N] int64, trunk positions (branch b drafts the tokens at anchors[b] + 1 ..)
    trunk_index: torch.Tensor  # [N] int64, the trunk (row of sample_ids / features) each branch hangs off
    anchor_tokens: torch.Tensor  # [N] int64, the trunk's token at each anchor (the block's first input)
    tokens: torch.Tensor  # [N, W] int64, branch tokens (sampled, or the reference's when reference)
    features: List[torch.Tensor]  # per trunk [T_i, F], the drafter's context features
    sample_ids: List[int]  # [S] dataset ids of the trunks
    reference: bool  # True: off-policy blocks of reference tokens (scored from the trunk, no tree pass)
    hidden: Optional[torch.Tensor] = None  # [N, W, D] drafter forward with its graph (None: Draft-OPD's, or taken)
    reference_tokens: Optional[torch.Tensor] = None  # [N, W] int64, the trunk's tokens after each anchor (the CE
    #                                                  labels of trainer.ce_weight; None when it is 0)
    trunk_tokens: Optional[List[torch.Tensor]] = None  # per trunk [T_i]: an autoregressive drafter's context rows
    #                                                    read them (a forward run again: Draft-OPD's)

    def branches(self) -> Branches:
        return Branches(self.anchors, self.trunk_index, self.tokens, self.reference)

    def take_hidden(self) -> Optional[torch.Tensor]:
        """The drafter forward, once: its graph is consumed by the loss's backward (a second loss pass runs a
        new forward)."""
        h, self.hidden = self.hidden, None
        return h


@dataclass
class Staged:
    """A step's share between ``stage`` and ``finish`` (split roles: ``drafter_propose`` -> ``drafter_update``)."""

    proposals: Proposals
    hp: Optional[torch.Tensor] = None  # [N, W, D] the target side; None until the target worker's scores arrive


@dataclass
class Scored:
    """Split roles: the target worker's answer to ``target_score``."""

    hp: Optional[torch.Tensor]  # [N, W, D] the target's hidden states at the branch slots (None: empty share)
    phase_s: Dict[str, float] = field(default_factory=dict)  # the target worker's seconds per phase


@dataclass
class GradBlocks:
    """``trainer.batch_invariant``: this shard's gradient as blocks of the fixed summation tree
    (``specopd.train.determinism``), for ``phases.optimizer_step`` to exchange and combine."""

    mine: Dict[Tuple[int, int], torch.Tensor]  # (start, size) -> [P] fp32 flat gradient sum of this shard's blocks
    every: List[Tuple[int, int]]  # (start, size) of every worker's blocks, in worker order (the exchange order)
    total: int  # the global batch size
