"""Greedy (T = 0) speculative decoding replayed on the target's greedy continuation: the same AL and acceptance
counts as ``evaluate_al(..., temperature=0)`` without a target verification pass per round (no speed numbers).
Why it is exact: specopd/eval/DESIGN.md ("Greedy replay").
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from tqdm import tqdm

from specopd.data.prepare import generate_batch


@torch.no_grad()
def greedy_continuations(target, prompts: Sequence[torch.Tensor], num_tokens: int, batch_size: int = 32,
                         progress: bool = False) -> list:
    """The target's greedy continuation of each prompt (no stop token: verification runs past an end-of-sequence token
    too); several prompts decode together (``generate_batch``).

    Args:
        target: the TargetModel.
        prompts: list of [T_i] token ids.
        num_tokens: tokens per continuation.
        batch_size: prompts decoded together.
        progress: a progress bar.

    Returns:
        list of [num_tokens] LongTensors.
    """
    out = []
    bar = tqdm(total=len(prompts) * num_tokens, desc="greedy continuations", unit="tok", disable=not progress)
    for b in range(0, len(prompts), batch_size):
        part = [torch.as_tensor(p, dtype=torch.long) for p in prompts[b: b + batch_size]]
        res = generate_batch(target, part, num_tokens, 0.0, 1.0, [None] * len(part), set(), on_tokens=bar.update)
        out += [torch.tensor(r, dtype=torch.long) for r, _ in res]
    bar.close()
    return out


@torch.no_grad()
def replay_greedy_al(target, drafter, prompts: Sequence[torch.Tensor], continuations: Sequence[torch.Tensor],
                     max_new_tokens: int, stop_token_ids: Sequence[int] = (), block_size: Optional[int] = None,
                     anchors_per_call: int = 64) -> dict:
    """The T = 0 acceptance of real speculative decoding, replayed on the target's greedy continuations: one drafter
    call per ``anchors_per_call`` anchors instead of one target pass per round.

    Args:
        target: the TargetModel.
        drafter: the drafter.
        prompts: list of [T_i] token ids.
        continuations: the target's greedy continuations, at least ``max_new_tokens + W`` tokens each.
        max_new_tokens: tokens decoded per prompt.
        stop_token_ids: ids that end a generation.
        block_size: verify only the first k draft tokens (default: all W).
        anchors_per_call: anchors per drafter call (memory: [anchors_per_call, W, V] logits).

    Returns:
        the keys of ``evaluate_al`` that involve no timing: mean_al (incl. bonus), rounds, new_tokens, accepted_at /
        reached_at [W], per_position_acceptance, survival, accept_lengths (per prompt), block_size, temperature (0.0),
        num_prompts, max_new_tokens.
    """
    w_all = int(drafter.draft_len)  # W drafted tokens (block_size counts the anchor)
    k = w_all if block_size is None else int(block_size)
    if not 1 <= k <= w_all:
        raise ValueError(f"block_size must be in [1, {w_all}] (the drafter's drafted tokens per block); got {block_size}")
    if len(prompts) != len(continuations) or not prompts:
        raise ValueError(f"need one continuation per prompt and at least one prompt; got {len(prompts)} prompts, "
                         f"{len(continuations)} continuations")
    stops = {int(t) for t in stop_token_ids}
    fl = tuple(drafter.feature_layers)
    dev = target.device
    was_training = drafter.training
    drafter.eval()
    accepted_at, per_prompt, new_tokens = [0] * k, [], 0
    try:
        for p, c in zip(prompts, continuations):
            p = torch.as_tensor(p, dtype=torch.long).reshape(-1).to(dev)
            c = torch.as_tensor(c, dtype=torch.long).reshape(-1).to(dev)
            if p.numel() == 0:
                raise ValueError("an empty prompt: generation needs at least one prompt token")
            if c.numel() < max_new_tokens + k:
                raise ValueError(f"a continuation has {c.numel()} tokens; replaying {max_new_tokens} new tokens with "
                                 f"{k} drafts a round needs {max_new_tokens + k} (greedy_continuations(..., "
                                 f"max_new_tokens + block_size))")
            seq = torch.cat([p, c])  # [L + C]
            # the real decoder (specopd.speculative.start): prompt[:-1] prefilled, prompt[-1] the first anchor
            # (a 1-token prompt: anchor 0 with an empty context)
            first = p.numel() - 1
            out = []
            last = first + max_new_tokens - 1  # no round starts past this anchor
            feats = target.prefill(seq[: last], feature_layers=fl, keep_logits=False).features  # rows < anchor
            anchors = torch.arange(first, last + 1, device=dev)
            match = []
            for s in range(0, anchors.numel(), anchors_per_call):
                a = anchors[s: s + anchors_per_call]
                if getattr(drafter, "autoregressive", False):  # EAGLE-3: rows read the trunk's next tokens
                    toks = drafter.unroll([feats], [seq], a, torch.zeros_like(a), 0.0)[1]
                else:
                    toks, _ = drafter.sample([feats], a, torch.zeros_like(a), seq[a], temperature=0.0)
                ref = seq[a[:, None] + 1 + torch.arange(k, device=dev)]  # [n, k]
                match.append((toks[:, :k].to(dev) == ref).long().cumprod(1).sum(1))
            match = torch.cat(match).tolist()  # accepted drafts of a round anchored at first + i
            lengths, a = [], first
            stopped = False
            while len(out) < max_new_tokens and not stopped:
                n = match[a - first]
                new = seq[a + 1: a + n + 2].tolist()
                for j, t in enumerate(new):  # a stop token ends the response
                    if t in stops:
                        new, stopped = new[: j + 1], True
                        break
                out += new
                lengths.append(n + 1)
                for i in range(n):
                    accepted_at[i] += 1
                a += n + 1
            per_prompt.append(lengths)
            new_tokens += len(out)
    finally:
        drafter.train(was_training)
    rounds = sum(len(x) for x in per_prompt)
    reached = [rounds] + accepted_at[:-1]
    return dict(mean_al=sum(map(sum, per_prompt)) / max(1, rounds), rounds=rounds, new_tokens=new_tokens,
                block_size=k, temperature=0.0, num_prompts=len(prompts), max_new_tokens=int(max_new_tokens),
                accepted_at=accepted_at, reached_at=reached,
                per_position_acceptance=[x / r if r else None for x, r in zip(accepted_at, reached)],
                survival=[x / max(1, rounds) for x in accepted_at], accept_lengths=per_prompt)
