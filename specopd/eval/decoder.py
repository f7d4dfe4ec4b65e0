"""Speculative decoding with a drafter and the target's trunk cache (the evaluation of a drafter): a single-sequence
user of ``specopd.speculative``, one target pass per round plus the prompt prefill; ``autoregressive`` is the
baseline. Design: specopd/eval/DESIGN.md ("Speculative decoding").
Why two plain-decoding loops: ``autoregressive`` is the timed one-sequence baseline (a ``prefill`` pass per token,
``pick_tokens``' draws like the speculative round's), ``specopd.data.prepare.generate_batch`` answers many prompts
in one packed pass per token with the references' multinomial top-p draw; one loop would change either's tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from specopd import speculative as spec
from specopd.drafters import pick_tokens


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
    rejection sampling. ``block_size`` verifies only the first k <= W draft tokens (None: all W =
    ``drafter.draft_len``). ``stop_token_ids``: generation ends after one of them (what the round drafted
    beyond it is dropped)."""

    def __init__(self, target, drafter: spec.BlockDrafter, temperature: float = 1.0, block_size: Optional[int] = None,
                 stop_token_ids: Sequence[int] = (), gdn_checkpoint_every: int = 64):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {temperature}")
        w = int(drafter.draft_len)
        if block_size is not None and not 1 <= int(block_size) <= w:
            raise ValueError(f"block_size must be in [1, {w}] (the drafter's drafted tokens per block); "
                             f"got {block_size}")
        self.target, self.drafter = target, drafter
        self.temperature = float(temperature)
        self.block_size = int(block_size) if block_size is not None else w
        self.stop_token_ids = set(int(t) for t in stop_token_ids)
        self.gdn_checkpoint_every = int(gdn_checkpoint_every)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, generator: Optional[torch.Generator] = None
                 ) -> GenerationResult:
        """prompt_ids [T0] -> GenerationResult with .tokens [>= max_new_tokens] (fewer only after a stop token)."""
        target, drafter, k, temp = self.target, self.drafter, self.block_size, self.temperature
        prompt = _as_prompt(prompt_ids, target.device)
        _check_length(target, prompt.numel(), max_new_tokens, k + 1)
        times = dict(prefill=0.0, draft=0.0, verify=0.0, commit=0.0, sample=0.0)
        t_start = time.perf_counter()
        seq = spec.start(target, prompt, drafter.feature_layers, self.gdn_checkpoint_every)
        times["prefill"] = time.perf_counter() - t_start
        out: list = []
        accept_lengths, accepted_at = [], [0] * k
        stopped = "length"
        while len(out) < max_new_tokens and stopped == "length":
            t0 = time.perf_counter()
            toks, q_logits = spec.draft(drafter, [seq], temp, generator)  # context cache + accepted features
            drafts, q_logits = toks[:, :k], q_logits[:, :k]
            t1 = time.perf_counter()
            p_logits, state = spec.verify(target, [seq], drafts)
            t2 = time.perf_counter()
            (n,), (nxt,) = spec.accept(drafts, q_logits, p_logits, temp, generator)
            t3 = time.perf_counter()
            new = [int(t) for t in drafts[0, :n]] + [nxt]
            for j, t in enumerate(new):  # a stop token ends the response: drop what follows it
                if t in self.stop_token_ids:
                    new, stopped = new[: j + 1], "stop_token"
                    break
            out.extend(new)
            accept_lengths.append(n + 1)
            for i in range(n):
                accepted_at[i] += 1
            if len(out) < max_new_tokens and stopped == "length":  # the last round needs no commit
                seq = spec.commit(target, [seq], state, [n], [nxt])[0]
            times["draft"] += t1 - t0
            times["verify"] += t2 - t1
            times["sample"] += t3 - t2
            times["commit"] += time.perf_counter() - t3
        return GenerationResult(
            tokens=torch.tensor(out, dtype=torch.long), accept_lengths=accept_lengths, accepted_at=accepted_at,
            block_size=k, wall_time=time.perf_counter() - t_start, times=times, stopped_by=stopped)


@torch.no_grad()
def autoregressive(target, prompt_ids, max_new_tokens: int, temperature: float = 1.0,
                   generator: Optional[torch.Generator] = None, stop_token_ids: Sequence[int] = (),
                   gdn_checkpoint_every: int = 64) -> GenerationResult:
    """Plain decoding with the same cache machinery (one ``target.prefill`` pass per token, caches growing by amortised
    appends, no GDN checkpoints): the baseline.

    Args:
        target: the TargetModel.
        prompt_ids: [T] the prompt.
        max_new_tokens: tokens to generate.
        temperature: 0 = greedy.
        generator: for T > 0.
        stop_token_ids: ids that end the generation.
        gdn_checkpoint_every: C of the prompt's prefill.

    Returns:
        GenerationResult (tokens: [n] the new tokens).
    """
    prompt = _as_prompt(prompt_ids, target.device)
    _check_length(target, prompt.numel(), max_new_tokens, 0)
    stops = set(int(t) for t in stop_token_ids)
    t_start = time.perf_counter()
    opts = dict(gdn_checkpoint_every=gdn_checkpoint_every, keep_checkpoints=False)
    cache = target.prefill(prompt[:-1], keep_logits=False, **opts) if prompt.numel() > 1 else None
    last, out, stopped = prompt[-1:], [], "length"
    while len(out) < max_new_tokens:
        cache = target.prefill(last, cache=cache, keep_logits=True, **opts)
        logits, cache.logits = cache.logits[-1], None
        dev = generator.device if generator is not None else logits.device  # CPU generators, GPU targets
        tok = int(pick_tokens(logits.to(dev), temperature, generator, kernel_paths=target.kernel_paths))
        out.append(tok)
        if tok in stops:
            stopped = "stop_token"
            break
        last = torch.tensor([tok], device=target.device)
    wall = time.perf_counter() - t_start
    return GenerationResult(tokens=torch.tensor(out, dtype=torch.long), accept_lengths=[1] * len(out),
                            accepted_at=[], block_size=0, wall_time=wall, times={}, stopped_by=stopped)
