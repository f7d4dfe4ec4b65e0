"""Greedy replay AL equals real T = 0 speculative decoding (rounds, accept lengths, acceptance counts)."""
from __future__ import annotations

import pytest
import torch

from oracle import make_tiny_checkpoint
from specopd.drafters import build_drafter
from specopd.eval import SpeculativeDecoder
from specopd.eval.cli import evaluate_al
from specopd.eval.replay import greedy_continuations, replay_greedy_al
from specopd.models import load_target


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """1-layer llama with vocab 8: a random drafter's argmax matches the target's often enough to give rounds
    of every length."""
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("replay"), vocab_size=8, num_hidden_layers=1,
                                initializer_range=0.5)
    return load_target(path)


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("block_size", [None, pytest.param(2, marks=pytest.mark.slow)])
def test_replay_equals_speculative_decoding(small, block_size):
    prompts = prompts_of([1, 2, 7, 11], small.vocab_size)  # a 1-token prompt takes the decoder's other path
    n, seen = 20, set()
    for seed in range(2):
        drafter = build_drafter("dflash", small, num_layers=1, block_size=4, seed=seed)
        conts = greedy_continuations(small, prompts, n + 3)
        for stops in ((), (3,)):
            rep = replay_greedy_al(small, drafter, prompts, conts, n, stop_token_ids=stops, block_size=block_size,
                                   anchors_per_call=5)
            dec = SpeculativeDecoder(small, drafter, temperature=0.0, block_size=block_size, stop_token_ids=stops)
            real = [dec.generate(p, n).accept_lengths for p in prompts]
            assert rep["accept_lengths"] == real
            seen |= {x for r in real for x in r}
            ev = evaluate_al(small, drafter, prompts, n, 0.0, block_size=block_size, stop_token_ids=stops)
            for key in ("mean_al", "rounds", "new_tokens", "accepted_at", "reached_at", "per_position_acceptance",
                        "survival"):
                assert rep[key] == pytest.approx(ev[key]), key
    assert len(seen) > 2  # rounds of several lengths: the check is not vacuous


def test_replay_bad_inputs(small):
    drafter = build_drafter("dflash", small, num_layers=1, block_size=4, seed=0)
    p = prompts_of([4], small.vocab_size)
    with pytest.raises(ValueError, match="needs 13"):
        replay_greedy_al(small, drafter, p, [torch.zeros(12, dtype=torch.long)], 10)
    with pytest.raises(ValueError, match="block_size must be"):
        replay_greedy_al(small, drafter, p, [torch.zeros(20, dtype=torch.long)], 10, block_size=4)
    with pytest.raises(ValueError, match="one continuation per prompt"):
        replay_greedy_al(small, drafter, p, [], 10)
