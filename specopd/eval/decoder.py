"""Speculative decoding with a drafter and the target's trunk cache (the evaluation of a drafter).

State between rounds: ``cache`` covers every committed token except the last one, ``last`` (the anchor, at
position T = len(cache), not yet run by the target). One round:

1. draft     ``drafter.sample(features=[cache.features], anchors=[T], ...)`` -> d_1..d_W and their q logits
2. verify    one ``target.score`` over the chain ``[last, d_1..d_W]`` anchored at T-1: node j gives p for
             d_{j+1} (node W gives the bonus distribution)
3. accept    T = 0: exact match with argmax p. T > 0: lossless rejection sampling on the temperature-adjusted
             distributions (accept d_i with prob min(1, p/q); on rejection resample from norm(max(0, p - q));
             all W accepted -> bonus ~ p at node W)
4. commit    ``cache = target.prefill([last] + accepted, cache=cache)``; the bonus/resampled token is the new last

Rejected tokens are never committed, so nothing has to be rolled back. ``autoregressive`` runs the same target
and cache machinery one token per step (the speedup baseline, and the reference for T = 0).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from specopd.tree import ProposalTree


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [n'] long, new tokens only (n' >= max_new_tokens unless a stop token came first)
    accept_lengths: list  # tokens committed per verification round, *including* the bonus/resampled token
    accepted_at: list  # [W] rounds in which draft position i (0-based) was accepted
    block_size: int = 0  # W: draft tokens verified per round
    wall_time: float = 0.0  # seconds for the whole call (prefill included)
    times: dict = field(default_factory=dict)  # seconds per phase: prefill / draft / verify / commit / sample
    stopped_by: str = "length"  # "length" | "stop_token"

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        """AL: mean tokens committed per verification round, including the bonus token."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def survival(self) -> list:
        """[W] fraction of rounds whose first i+1 draft tokens were all accepted."""
        return [a / max(1, self.rounds) for a in self.accepted_at]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens.numel() / max(self.wall_time, 1e-9)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Temperature-adjusted distribution in fp32: softmax(logits / T) over the last dim."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def _sample(probs: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    """One draw from probs [V] (on the generator's device, so CPU generators work with GPU targets)."""
    dev = generator.device if generator is not None else probs.device
    return int(torch.multinomial(probs.to(dev), 1, generator=generator))


def _uniform(generator: Optional[torch.Generator]) -> float:
    dev = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, device=dev))


def _as_prompt(prompt_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token (e.g. BOS)")
    return ids.to(device)


def _check_length(target, prompt_len: int, max_new: int, extra: int) -> None:
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and prompt_len + max_new + extra > int(limit):
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) + draft block ({extra}) "
                         f"exceeds the target's context limit ({limit}); shorten the prompt or lower max_new_tokens")


class SpeculativeDecoder:
    """Draft with ``drafter``, verify with ``target``; temperature 0.0 = greedy (exact match), > 0 = lossless
    rejection sampling. ``block_size`` verifies only the first k <= W draft tokens (None: all W).
    ``stop_token_ids``: generation ends after one of them (what the round drafted beyond it is dropped)."""

    def __init__(self, target, drafter, temperature: float = 1.0, block_size: Optional[int] = None,
                 stop_token_ids: Sequence[int] = (), gdn_checkpoint_every: int = 64):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {temperature}")
        w = int(drafter.block_size)
        if block_size is not None and not 1 <= int(block_size) <= w:
            raise ValueError(f"block_size must be in [1, {w}] (the drafter's block size); got {block_size}")
        self.target, self.drafter = target, drafter
        self.temperature = float(temperature)
        self.block_size = int(block_size) if block_size is not None else w
        self.stop_token_ids = set(int(t) for t in stop_token_ids)
        self.gdn_checkpoint_every = int(gdn_checkpoint_every)

    # ------------------------------------------------------------------ one round
    def _accept(self, drafts: torch.Tensor, q_logits: torch.Tensor, p_logits: torch.Tensor,
                generator) -> tuple:
        """drafts [W], q_logits [W, V], p_logits [W+1, V] -> (number of drafts accepted, next token)."""
        w = drafts.numel()
        if self.temperature == 0.0:
            best = p_logits.argmax(dim=-1)  # [W+1]
            n = 0
            while n < w and int(drafts[n]) == int(best[n]):
                n += 1
            return n, int(best[n])
        p = _probs(p_logits, self.temperature)
        q = _probs(q_logits, self.temperature)
        for i in range(w):
            d = int(drafts[i])
            pi, qi = float(p[i, d]), float(q[i, d])
            if qi > 0 and _uniform(generator) * qi < pi:  # accept with prob min(1, p/q)
                continue
            resid = (p[i] - q[i]).clamp_min(0)
            total = float(resid.sum())
            # p == q up to rounding leaves no residual mass; then rejection had ~zero probability: sample p
            return i, _sample(resid / total if total > 0 else p[i], generator)
        return w, _sample(p[w], generator)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, generator: Optional[torch.Generator] = None
                 ) -> GenerationResult:
        """prompt_ids [T0] -> GenerationResult with .tokens [>= max_new_tokens] (fewer only after a stop token)."""
        target, drafter, k = self.target, self.drafter, self.block_size
        prompt = _as_prompt(prompt_ids, target.device)
        _check_length(target, prompt.numel(), max_new_tokens, k + 1)
        times = dict(prefill=0.0, draft=0.0, verify=0.0, commit=0.0, sample=0.0)
        t_start = time.perf_counter()
        fl = tuple(drafter.feature_layers)
        out: list = []
        if prompt.numel() == 1:
            # No trunk before the last token: run it once and sample the first new token from its logits.
            cache = target.prefill(prompt, feature_layers=fl, gdn_checkpoint_every=self.gdn_checkpoint_every)
            last = self._first_token(cache.logits[-1], generator)
            cache = dataclasses.replace(cache, logits=None)
            out.append(last)
        else:
            cache = target.prefill(prompt[:-1], feature_layers=fl, keep_logits=False,
                                   gdn_checkpoint_every=self.gdn_checkpoint_every)
            last = int(prompt[-1])
        times["prefill"] = time.perf_counter() - t_start
        accept_lengths, accepted_at = [], [0] * k
        stopped = "stop_token" if out and out[-1] in self.stop_token_ids else "length"
        while len(out) < max_new_tokens and stopped == "length":
            t0 = time.perf_counter()
            anchor = len(cache)
            toks, q_logits = drafter.sample(
                [cache.features], torch.tensor([anchor], device=target.device),
                torch.zeros(1, dtype=torch.long, device=target.device),
                torch.tensor([last], device=target.device), temperature=self.temperature, generator=generator)
            drafts, q_logits = toks[0, :k].to(target.device), q_logits[0, :k]
            t1 = time.perf_counter()
            chain = torch.cat([torch.tensor([last], device=target.device), drafts]).view(1, -1)
            p_logits = target.score(ProposalTree.from_branches([anchor - 1], chain.cpu()), cache)[0]  # [k+1, V]
            t2 = time.perf_counter()
            n, nxt = self._accept(drafts, q_logits, p_logits, generator)
            t3 = time.perf_counter()
            committed = [last] + [int(t) for t in drafts[:n]]
            new = committed[1:] + [nxt]
            for j, t in enumerate(new):  # a stop token ends the response: drop what follows it
                if t in self.stop_token_ids:
                    new, stopped = new[: j + 1], "stop_token"
                    break
            out.extend(new)
            accept_lengths.append(n + 1)
            for i in range(n):
                accepted_at[i] += 1
            last = nxt
            if len(out) < max_new_tokens and stopped == "length":  # the last round needs no commit
                cache = target.prefill(torch.tensor(committed, device=target.device), cache=cache,
                                       keep_logits=False)
            times["draft"] += t1 - t0
            times["verify"] += t2 - t1
            times["sample"] += t3 - t2
            times["commit"] += time.perf_counter() - t3
        return GenerationResult(
            tokens=torch.tensor(out, dtype=torch.long), accept_lengths=accept_lengths, accepted_at=accepted_at,
            block_size=k, wall_time=time.perf_counter() - t_start, times=times, stopped_by=stopped)

    def _first_token(self, logits: torch.Tensor, generator) -> int:
        if self.temperature == 0.0:
            return int(logits.argmax())
        return _sample(_probs(logits, self.temperature), generator)


@torch.no_grad()
def autoregressive(target, prompt_ids, max_new_tokens: int, temperature: float = 1.0,
                   generator: Optional[torch.Generator] = None, stop_token_ids: Sequence[int] = (),
                   gdn_checkpoint_every: int = 64) -> GenerationResult:
    """Plain decoding with the same cache machinery (one ``target.prefill`` per token): the baseline."""
    prompt = _as_prompt(prompt_ids, target.device)
    _check_length(target, prompt.numel(), max_new_tokens, 0)
    stops = set(int(t) for t in stop_token_ids)
    t_start = time.perf_counter()
    cache = (target.prefill(prompt[:-1], keep_logits=False, gdn_checkpoint_every=gdn_checkpoint_every)
             if prompt.numel() > 1 else None)
    last, out, stopped = prompt[-1:], [], "length"
    while len(out) < max_new_tokens:
        cache = target.prefill(last, cache=cache, keep_logits=True, gdn_checkpoint_every=gdn_checkpoint_every)
        logits = cache.logits[-1]
        cache = dataclasses.replace(cache, logits=None)
        tok = int(logits.argmax()) if temperature == 0.0 else _sample(_probs(logits, temperature), generator)
        out.append(tok)
        if tok in stops:
            stopped = "stop_token"
            break
        last = torch.tensor([tok], device=target.device)
    wall = time.perf_counter() - t_start
    return GenerationResult(tokens=torch.tensor(out, dtype=torch.long), accept_lengths=[1] * len(out),
                            accepted_at=[], block_size=0, wall_time=wall, times={}, stopped_by=stopped)
