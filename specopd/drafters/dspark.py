"""DSpark (SpecForge ``modeling/draft/dspark.py``): the DFlash backbone + a Markov head + a confidence head.
Maths and sampling order: specopd/drafters/DESIGN.md ("DSpark model").
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from specopd.drafters.dflash import DFlashDrafter
from specopd.models.tensor_parallel import vocab_group
from specopd.sampling import pick_tokens, sample_from_hidden


class MarkovHead(nn.Module):
    """Low-rank previous-token logit bias: W2(W1[x_prev]) [..., V]."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev_tokens)).float()


class ConfidenceHead(nn.Module):
    """Per-slot acceptance logit from [h ; W1[x_prev]] (SpecForge's AcceptRatePredictor)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).squeeze(-1).float()


class DSparkDrafter(DFlashDrafter):
    kind = "dspark"

    @property
    def has_confidence(self) -> bool:
        return self.confidence_head is not None

    @classmethod
    def config_problems(cls, c, ident: dict) -> list:
        """DFlash's, and the Markov head's rank r."""
        return super().config_problems(c, ident) + ([] if c.markov_rank >= 1 else [("markov_rank", c.markov_rank,
                                                                                   ">= 1")])

    def _build_extra(self) -> None:
        c, v = self.config, int(self.target.vocab_size)
        self.markov_head = MarkovHead(v, c.markov_rank)
        self.confidence_head = (ConfidenceHead(c.hidden_size + (c.markov_rank if c.confidence_with_markov else 0))
                                if c.confidence_head else None)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        super()._init_weights(seed)
        self.markov_head.markov_w2.weight.zero_()

    def markov_features(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """prev_tokens [N, W] -> W1[x_prev] [N, W, r] (the extra columns of the fused output matmul)."""
        return self.markov_head.markov_w1(prev_tokens)

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> Optional[torch.Tensor]:
        """h [N, W, D], prev tokens [N, W] -> confidence logits [N, W] (None without a confidence head)."""
        if self.confidence_head is None:
            return None
        x = torch.cat([h, self.markov_features(prev).to(h.dtype)], -1) if self.config.confidence_with_markov else h
        return self.confidence_head(x)

    def logits_from_hidden(self, h: torch.Tensor, prev_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """h [..., D] -> fp32 logits [..., V]: lm_head(h), + W2(W1[prev_tokens]) when prev_tokens [...] is given."""
        u = super().logits_from_hidden(h)
        return u if prev_tokens is None else u + self.markov_head(prev_tokens)

    def forward(self, features, anchors, trunk_index=None, anchor_tokens=None, prev_tokens=None,
                return_confidence: bool = False):
        """Teacher forcing on ``prev_tokens``: lm_head(h) plus the Markov head's W2(W1[prev]).

        Args:
            features, anchors, trunk_index, anchor_tokens: as ``DFlashDrafter.hidden``.
            prev_tokens: [N, W], prev_tokens[:, k] = the token before slot k (column 0 = anchor_tokens).
            return_confidence: also the confidence logits.

        Returns:
            raw logits [N, W, V] fp32 [, confidence logits [N, W]].
        """
        if prev_tokens is None:
            raise ValueError("DSpark's Markov head needs prev_tokens [N, W] (column 0 = anchor_tokens, column k = "
                             "token k-1 of the branch); use sample() to draw a branch left to right")
        if return_confidence and self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (confidence_head=False)")
        h = self.hidden(features, anchors, trunk_index, anchor_tokens)
        prev = torch.as_tensor(prev_tokens, dtype=torch.long, device=h.device)
        n, w = h.shape[:2]
        if tuple(prev.shape) != (n, w):
            raise ValueError(f"prev_tokens must be [N, W] = [{n}, {w}]; got {tuple(prev.shape)}")
        atok = torch.as_tensor(anchor_tokens, dtype=torch.long, device=h.device).reshape(-1)
        if not torch.equal(prev[:, 0], atok):
            raise ValueError("prev_tokens[:, 0] must equal anchor_tokens (slot 0 follows the anchor token); "
                             "build it as cat([anchor_tokens[:, None], tokens[:, :-1]], 1)")
        self._check_tokens(prev, "prev_tokens")
        logits = self.logits_from_hidden(h, prev)
        return (logits, self.confidence_logits(h, prev)) if return_confidence else logits

    def markov_sample(self, h: torch.Tensor, anchor_tokens: torch.Tensor, temperature: float, generator=None,
                      rows=None, return_logits: bool = True, chunk_rows="auto"):
        """The left-to-right sampler (the one implementation): token k is drawn from ``lm_head(h_k) + W2(W1[x_{k-1}])``
        and feeds slot k + 1; each generator draws its rows' uniforms slot by slot. Without ``return_logits`` slot k's
        logits are built ``chunk_rows`` rows at a time: memory one [chunk_rows, V] chunk, never [N, W, V].

        Args:
            h: [N, W, D] the drafter's hidden state.
            anchor_tokens: [N] (x_{-1}).
            temperature: 0 = argmax.
            generator: one Generator, or one per ``rows`` group.
            rows: list of index tensors into N.
            return_logits: also return the logits [N, W, V].
            chunk_rows: rows per chunk, or "auto".

        Returns:
            (tokens [N, W], logits [N, W, V] or None, confidence logits [N, W] or None).
        """
        x = anchor_tokens.reshape(-1).to(device=h.device, dtype=torch.long)
        w_lm, w2 = self.target.lm_head.weight, self.markov_head.markov_w2.weight
        toks, logits, prevs = [], [], []
        for k in range(h.shape[1]):
            prevs.append(x)
            if return_logits:
                lk = self.logits_from_hidden(h[:, k], x)  # [N, V]
                logits.append(lk)
                x = pick_tokens(lk, temperature, generator, rows, chunk_rows, self.kernel_paths)
            else:
                x = sample_from_hidden(h[:, k].detach(), w_lm, temperature, rows, generator,
                                       markov=(self.markov_features(x).detach(), w2.detach()), chunk_rows=chunk_rows,
                                       tp=vocab_group(self.target.lm_head), kernel_paths=self.kernel_paths)
            toks.append(x)
        conf = self.confidence_logits(h, torch.stack(prevs, 1))
        return torch.stack(toks, 1), (torch.stack(logits, 1) if return_logits else None), conf

    def _sample_hidden(self, h, anchor_tokens, temperature, generator, rows=None, return_confidence=False,
                       return_logits=True, chunk_rows="auto"):
        if return_confidence and self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (confidence_head=False)")
        tokens, logits, conf = self.markov_sample(h, anchor_tokens, temperature, generator, rows, return_logits,
                                                  chunk_rows)
        return (tokens, logits, conf) if return_confidence else (tokens, logits)
