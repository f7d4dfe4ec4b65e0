"""Checkpoints: atomic layout, keep-last, resume = straight run (bitwise, CPU), half-written ones ignored."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from specopd.runs import checkpoint as ck
from specopd.train.loop import train
from tiny_runs import tiny_recipe

STEPS = 6


def _cfg(out, *extra):
    return tiny_recipe(str(out), [f"trainer.max_steps={STEPS}", "trainer.eval_heldout=false", *extra])


def _weights(run_dir, step):
    return load_file(os.path.join(run_dir, "checkpoints", f"step-{step}", "model.safetensors"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(_cfg(out), progress=False)
    return str(out)


def test_layout_and_latest_pointer(straight):
    root = os.path.join(straight, "checkpoints")
    assert open(os.path.join(root, "latest")).read().strip() == f"step-{STEPS}"
    d = os.path.join(root, f"step-{STEPS}")
    for f in ("model.safetensors", "config.json", "trainer_state.pt", "state.json", ck.MARKER):
        assert os.path.isfile(os.path.join(d, f)), f
    st = json.load(open(os.path.join(d, "state.json")))
    assert st["step"] == STEPS and "data_position" in st
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # no tmp leftovers
    # the drafter folder loads with the public loader
    from specopd.drafters import load_drafter
    from specopd.train.worker import Worker

    w = Worker(_cfg(straight))
    dr = load_drafter(d, w.target)
    saved = _weights(straight, STEPS)
    assert saved.keys() == dr.state_dict().keys()
    assert all(torch.equal(v.cpu(), saved[k]) for k, v in dr.state_dict().items())
    assert not all(torch.equal(v.cpu(), w.drafter.state_dict()[k]) for k, v in dr.state_dict().items())  # trained


def test_resume_is_bitwise_identical_and_ignores_half_written(straight, tmp_path):
    """...with trainer.eval_every on (the straight run has it off): the periodic held-out evaluation changes
    no training number, and a resumed run logs it at the same steps."""
    out = str(tmp_path)
    every = ("trainer.save_every=3", "trainer.keep_last=3", "trainer.eval_every=2")
    # run to 6 saving every 3, then pretend the step-6 save never happened and a later one was cut short
    train(_cfg(out, *every), progress=False)
    first = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    root = os.path.join(out, "checkpoints")
    import shutil

    shutil.rmtree(os.path.join(root, "step-6"))
    os.makedirs(os.path.join(root, ".tmp-step-6-99999"))  # killed while writing
    open(os.path.join(root, ".tmp-step-6-99999", "model.safetensors"), "wb").write(b"\0" * 10)
    os.makedirs(os.path.join(root, "step-9"))  # renamed folder without the marker: not complete
    open(os.path.join(root, "step-9", "state.json"), "w").write('{"step": 9}')
    assert ck.find_latest(out) == os.path.join(root, "step-3")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert len(f.readlines()) == 6
    train(_cfg(out, *every), progress=False)  # resume=auto -> step-3
    a, b = _weights(straight, STEPS), _weights(out, STEPS)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # metrics: steps 4-6 of the first attempt moved aside, not lost; the file has each step once
    steps = [json.loads(x)["step"] for x in open(os.path.join(out, "metrics.jsonl"))]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert len(open(os.path.join(out, "metrics.jsonl.orphaned")).readlines()) == 3
    straight_loss = [json.loads(x)["loss"] for x in open(os.path.join(straight, "metrics.jsonl"))]
    resumed_loss = [json.loads(x)["loss"] for x in open(os.path.join(out, "metrics.jsonl"))]
    assert straight_loss == resumed_loss
    resumed = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [(m["step"], m["heldout_expected_al"]) for m in resumed if "heldout_expected_al" in m] == \
        [(m["step"], m["heldout_expected_al"]) for m in first if "heldout_expected_al" in m]
    assert [m["step"] for m in resumed if "heldout_expected_al" in m] == [2, 4, 6]
    assert os.path.isfile(os.path.join(out, "heldout_al.png"))


def test_interrupted_run_writes_a_checkpoint_and_resumes(straight, tmp_path, monkeypatch):
    from specopd.train import phases

    real = phases.colocated_step
    calls = {"n": 0}

    def flaky(worker, *a):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # e.g. Ctrl-C / preemption during step 3
        return real(worker, *a)

    monkeypatch.setattr(phases, "colocated_step", flaky)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tmp_path), progress=False)
    assert ck.find_latest(str(tmp_path)).endswith("step-2")
    monkeypatch.setattr(phases, "colocated_step", real)
    train(_cfg(tmp_path), progress=False)
    a, b = _weights(straight, STEPS), _weights(str(tmp_path), STEPS)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_keep_last_prunes_old_checkpoints(tmp_path):
    ws = {"drafter": {"w": torch.zeros(2)}, "drafter_config": {"kind": "dflash"}, "optimizer": None,
          "scheduler": None, "rng": None}
    for s in (1, 2, 3, 4):
        ck.save_checkpoint(str(tmp_path), s, ws, {"data_position": {"epoch": 0, "offset": 0}}, keep_last=2)
    assert [s for s, _ in ck.complete_checkpoints(str(tmp_path))] == [3, 4]
    assert ck.find_latest(str(tmp_path)).endswith("step-4")
    with pytest.raises(ck.CheckpointError, match="cannot be used: no such folder"):
        ck.load_checkpoint(str(tmp_path / "checkpoints" / "nope"))
