"""DSpark: the DFlash backbone + a Markov head sampled left to right + a confidence head.

With U [N, W, V] the DFlash logits and x_{k-1} the token before output slot k (x_{-1} = the anchor
token, i.e. ``prev_tokens[:, 0] == anchor_tokens``):

    logits_k = U_k + W2(W1[x_{k-1}])          W1: Embedding(V, r), W2: Linear(r, V), r = markov_rank (256)
    conf_k   = Linear([h_k ; W1[x_{k-1}]])    scalar logit per slot (h_k: the normed backbone hidden state)

``forward`` teacher-forces the given ``prev_tokens``; ``sample`` draws token k from logits_k and feeds it
to slot k + 1. The backbone runs once either way. W2 starts at zero (DSpark == DFlash at init; W1 gets
gradient once W2 moves); conf_k's bias starts at 0 (confidence 0.5).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from specopd.drafters.dflash import DFlashDrafter, pick_tokens


class DSparkDrafter(DFlashDrafter):
    kind = "dspark"
    has_confidence = True

    def _build_extra(self) -> None:
        c, v = self.config, int(self.target.vocab_size)
        if c.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1; got {c.markov_rank}")
        self.markov_w1 = nn.Embedding(v, c.markov_rank)
        self.markov_w2 = nn.Linear(c.markov_rank, v, bias=False)
        self.conf_head = nn.Linear(c.hidden_size + c.markov_rank, 1)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        super()._init_weights(seed)
        self.markov_w2.weight.zero_()

    def _heads(self, u: torch.Tensor, h: torch.Tensor, prev: torch.Tensor):
        """u [N, S, V] base logits, h [N, S, D], prev [N, S] -> (logits [N, S, V], conf [N, S])."""
        e = self.markov_w1(prev)
        logits = u + self.markov_w2(e).float()
        conf = self.conf_head(torch.cat([h, e.to(h.dtype)], -1)).squeeze(-1).float()
        return logits, conf

    def forward(self, features, anchors, trunk_index=None, anchor_tokens=None, prev_tokens=None,
                return_confidence: bool = False):
        """Teacher forcing on ``prev_tokens`` [N, W] (prev_tokens[:, k] = token before slot k, column 0 =
        anchor_tokens) -> raw logits [N, W, V] (fp32), and with return_confidence also conf logits [N, W]."""
        if prev_tokens is None:
            raise ValueError("DSpark's Markov head needs prev_tokens [N, W] (column 0 = anchor_tokens, column k = "
                             "token k-1 of the branch); use sample() to draw a branch left to right")
        h = self.backbone(features, anchors, trunk_index, anchor_tokens)
        prev = torch.as_tensor(prev_tokens, dtype=torch.long, device=h.device)
        n, w = h.shape[:2]
        if tuple(prev.shape) != (n, w):
            raise ValueError(f"prev_tokens must be [N, W] = [{n}, {w}]; got {tuple(prev.shape)}")
        atok = torch.as_tensor(anchor_tokens, dtype=torch.long, device=h.device).reshape(-1)
        if not torch.equal(prev[:, 0], atok):
            raise ValueError("prev_tokens[:, 0] must equal anchor_tokens (slot 0 follows the anchor token); "
                             "build it as cat([anchor_tokens[:, None], tokens[:, :-1]], 1)")
        logits, conf = self._heads(self.logits_from_hidden(h), h, prev)
        return (logits, conf) if return_confidence else logits

    def sample(self, features, anchors, trunk_index=None, anchor_tokens=None, temperature: float = 1.0,
               generator: Optional[torch.Generator] = None, return_confidence: bool = False):
        """Left to right: token k from logits_k, then it feeds slot k + 1. -> (tokens [N, W], raw logits
        [N, W, V]) [+ conf logits [N, W]]; the logits equal forward(prev_tokens = shifted tokens)."""
        h = self.backbone(features, anchors, trunk_index, anchor_tokens)
        u = self.logits_from_hidden(h)
        x = torch.as_tensor(anchor_tokens, dtype=torch.long, device=h.device).reshape(-1)
        toks, logits, confs = [], [], []
        for k in range(h.shape[1]):
            lk, ck = self._heads(u[:, k:k + 1], h[:, k:k + 1], x[:, None])
            x = pick_tokens(lk[:, 0], temperature, generator)
            toks.append(x)
            logits.append(lk)
            confs.append(ck)
        tokens, logits = torch.stack(toks, 1), torch.cat(logits, 1)
        return (tokens, logits, torch.cat(confs, 1)) if return_confidence else (tokens, logits)
