"""DFlash V2 training is reproducible on several CPU threads: the selector's codebook gradients do not depend on the
thread count, two identical runs write the same bytes, and a stop + resume ends where a straight run does.

The tests run torch on two threads (and put it back to one): at one thread every op adds in a fixed order, so a
thread-dependent sum (the backward of indexing a codebook with recurring tokens) only shows with several."""
import hashlib
import json
import os

import pytest
import torch

from specopd.drafters.dflash2 import CandidateSelector
from specopd.runs import checkpoint as ck
from specopd.train.loop import train
from tiny_runs import tiny_recipe

STEPS = 4
# enough branches that the selector's backward is split across threads: 8 x 8 branches x 4 slots x 8 candidates
SHAPE = ["drafter.kind=dflash2", "data.batch_size=8", "trainer.anchors_per_seq=8", "drafter.block_size=5",
         "trainer.eval_heldout=false"]


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _run(out, *extra):
    train(tiny_recipe(str(out), SHAPE + [f"trainer.max_steps={STEPS}", *extra]), progress=False)
    return ck.find_latest(str(out))


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _equal(a, b, where=""):
    """Assert two loaded trainer states hold the same values (tensors bitwise), naming the first difference."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            _equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif hasattr(a, "tolist"):  # a numpy array (an RNG state)
        assert a.tolist() == b.tolist(), where
    else:
        assert repr(a) == repr(b), where


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A straight STEPS-step V2 run on two threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = tmp_path_factory.mktemp("v2-straight")
        return out, _run(out)
    finally:
        torch.set_num_threads(old)


def test_selector_gradients_do_not_depend_on_threads(two_threads):
    """pair_scores' backward on recurring tokens: the same bits at two threads, every time, as at one."""
    g = torch.Generator().manual_seed(0)
    sel = CandidateSelector(hidden=16, vocab=12, rank=64)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(generator=g)
    gate = torch.randn(64, 4, 64, generator=g)
    prev = torch.randint(0, 12, (64, 4, 8), generator=g)  # 2048 lookups of 12 rows: every row recurs
    ids = torch.randint(0, 12, (64, 4, 8), generator=g)
    weight = torch.randn(64, 4, 8, 8, generator=g)

    def grads():
        sel.zero_grad(set_to_none=True)
        (sel.pair_scores(gate, prev, ids) * weight).sum().backward()
        return [sel.predecessor_codebook.grad.clone(), sel.successor_codebook.grad.clone()]

    torch.set_num_threads(1)
    one = grads()
    torch.set_num_threads(2)
    for _ in range(10):
        for a, b in zip(grads(), one):
            assert torch.equal(a, b)


def test_two_identical_v2_runs_write_identical_bytes(straight, tmp_path, two_threads):
    _, first = straight
    again = _run(tmp_path)
    for name in ("model.safetensors", "trainer_state.pt"):
        assert _sha(os.path.join(first, name)) == _sha(os.path.join(again, name)), name


def test_v2_stop_and_resume_equals_a_straight_run(straight, tmp_path, two_threads):
    """Two steps, then resume=auto to STEPS: the same weights (bytes), optimizer / scheduler / RNG states and
    losses as the straight run."""
    out, first = straight
    _run(tmp_path, f"trainer.max_steps={STEPS // 2}")
    resumed = _run(tmp_path, "trainer.resume=auto")
    assert os.path.basename(resumed) == os.path.basename(first) == f"step-{STEPS}"
    assert _sha(os.path.join(resumed, "model.safetensors")) == _sha(os.path.join(first, "model.safetensors"))
    a, b = ck.load_checkpoint(first), ck.load_checkpoint(resumed)
    _equal({k: v for k, v in a["worker_state"].items() if k != "drafter"},
           {k: v for k, v in b["worker_state"].items() if k != "drafter"})
    _equal(a["controller_rng"], b["controller_rng"])

    def losses(d):
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [(m["step"], m["loss"]) for m in map(json.loads, f)]

    assert losses(out) == losses(tmp_path) and len(losses(out)) == STEPS
