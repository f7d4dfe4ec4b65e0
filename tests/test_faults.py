"""Faults and rough edges: damaged checkpoints, failed saves, SIGKILL across saves, resumes where the world
changed, NaN guards, over-long prompts, recipe history, finished runs. Every failing path: a clear message,
no traceback, nothing lost."""
import errno
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from specopd.cli import main
from specopd.runs import checkpoint as ck
from specopd.train.checkpointer import recipe_changes
from specopd.train.loop import train
from specopd.train.step import NonFiniteError
from tiny_runs import TINY_TEST_OVERRIDES, tiny_recipe

STEPS = 6


def _cfg(out, *extra):
    return tiny_recipe(str(out), [f"trainer.max_steps={STEPS}", "trainer.eval_heldout=false", *extra])


def _args(out, *extra):
    """The same run as ``_cfg`` as CLI arguments (``specopd train - ...`` with no recipe file)."""
    return TINY_TEST_OVERRIDES + ["model.target=tiny:llama", f"trainer.output_dir={out}",
                                  f"trainer.max_steps={STEPS}", "trainer.eval_heldout=false", *extra]


def _cli(capsys, out, *extra):
    """Run ``specopd train`` in-process on a temporary recipe; returns (exit code, stdout, stderr)."""
    recipe = os.path.join(str(out) + ".recipe.yaml")
    if not os.path.isfile(recipe):
        open(recipe, "w").write("seed: 0\n")
    capsys.readouterr()
    rc = main(["train", recipe, *_args(out, *extra)])
    o = capsys.readouterr()
    return rc, o.out, o.err


def _weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def _metrics(out):
    return [json.loads(x) for x in open(os.path.join(str(out), "metrics.jsonl"))]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(_cfg(out), progress=False)
    return str(out)


# ---------------------------------------------------------------------------------------------- integrity
def test_manifest_lists_every_file_and_is_written_last(straight):
    d = ck.find_latest(straight)
    man = json.load(open(os.path.join(d, ck.MANIFEST)))
    assert set(man["files"]) == {"model.safetensors", "config.json", "trainer_state.pt", "state.json"}
    for name, meta in man["files"].items():
        assert os.path.getsize(os.path.join(d, name)) == meta["bytes"]
        assert ck.sha256_file(os.path.join(d, name)) == meta["sha256"]
    marker = json.load(open(os.path.join(d, ck.MARKER)))
    assert marker["manifest_sha256"] == ck.sha256_file(os.path.join(d, ck.MANIFEST))
    assert ck.verify(d) is None
    # every kind of damage is named
    bad = os.path.join(os.path.dirname(straight), "damaged-copy")
    for damage, expect in (("truncate", "has .* bytes, the manifest says"), ("flip", "sha256"),
                           ("remove", "missing"), ("manifest", "does not match the checksum")):
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(d, bad)
        f = os.path.join(bad, "model.safetensors")
        if damage == "truncate":
            os.truncate(f, os.path.getsize(f) // 2)
        elif damage == "flip":
            b = bytearray(open(f, "rb").read())
            b[-1] ^= 0xFF
            open(f, "wb").write(bytes(b))
        elif damage == "remove":
            os.remove(f)
        else:
            open(os.path.join(bad, ck.MANIFEST), "a").write(" ")
        import re

        assert re.search(expect, ck.verify(bad)), (damage, ck.verify(bad))
        with pytest.raises(ck.CheckpointError, match="cannot be used"):
            ck.load_checkpoint(bad)


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(straight, tmp_path, capsys):
    out = tmp_path / "run"
    train(_cfg(out, "trainer.save_every=2", "trainer.keep_last=3", "trainer.max_steps=4"), progress=False)
    newest = os.path.join(out, "checkpoints", "step-4")
    f = os.path.join(newest, "model.safetensors")
    os.truncate(f, os.path.getsize(f) - 100)  # marker present, weights cut short
    capsys.readouterr()
    rc, stdout, err = _cli(capsys, out, "trainer.save_every=2", "trainer.keep_last=3")
    assert rc == 0, err
    assert f"{newest} cannot be used: model.safetensors has" in stdout and "truncated" in stdout
    assert f"moved it aside to {newest}.damaged" in stdout
    assert "resuming from" in stdout and "step-2" in stdout and "Traceback" not in stdout + err
    assert os.path.isfile(os.path.join(newest + ".damaged", "model.safetensors"))  # kept for inspection
    assert _same(_weights(ck.find_latest(str(out))), _weights(ck.find_latest(straight)))
    assert [m["step"] for m in _metrics(out)] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in _metrics(out)] == [m["loss"] for m in _metrics(straight)]


def test_explicit_resume_of_a_damaged_checkpoint_is_a_clear_error(straight, tmp_path, capsys):
    d = tmp_path / "ckpt"
    shutil.copytree(ck.find_latest(straight), d)
    b = bytearray(open(d / "trainer_state.pt", "rb").read())
    b[len(b) // 2] ^= 0x55
    open(d / "trainer_state.pt", "wb").write(bytes(b))
    rc, stdout, err = _cli(capsys, tmp_path / "run", f"trainer.resume={d}")
    assert rc == 1 and "Traceback" not in err
    assert f"trainer.resume={d}" in err and "trainer_state.pt does not match its sha256" in err
    assert "trainer.resume=auto" in err
    assert not os.path.exists(tmp_path / "run" / "recipe.yaml")  # nothing written for a refused run


@pytest.mark.parametrize("fault", ["raise_in_write", "enospc"])
def test_failed_save_keeps_the_previous_checkpoint_and_resumes(straight, tmp_path, monkeypatch, capsys, fault):
    """A save at step 4 fails (an exception inside a file write / a full disk): the run stops with a clear
    message, step-2 stays intact, no tmp folder is left, and the rerun ends equal to a straight run."""
    out = tmp_path / "run"
    import safetensors.torch as st

    real_json, real_save = ck._write_json, st.save_file

    def boom_json(path, obj):
        if os.path.basename(path) == "state.json" and "step-4" in path:
            raise RuntimeError("injected failure while writing state.json")
        return real_json(path, obj)

    def full_disk(tensors, path, metadata=None):
        if "step-4" in path:
            with open(path, "wb") as f:
                f.write(b"\0" * 10)  # a few bytes made it before the disk filled up
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_save(tensors, path, metadata=metadata)

    if fault == "raise_in_write":
        monkeypatch.setattr(ck, "_write_json", boom_json)
    else:
        monkeypatch.setattr(st, "save_file", full_disk)
    rc, stdout, err = _cli(capsys, out, "trainer.save_every=2")
    assert rc == 1 and "Traceback" not in err
    assert "checkpoint step-4 could not be written" in err and "step-2" in err and "is intact" in err
    if fault == "enospc":
        assert "No space left on device" in err and "the disk is full: free space" in err
    root = os.path.join(out, "checkpoints")
    assert [s for s, _ in ck.complete_checkpoints(str(out))] == [2]
    assert ck.verify(os.path.join(root, "step-2")) is None
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]
    monkeypatch.undo()
    rc, stdout, err = _cli(capsys, out, "trainer.save_every=2")
    assert rc == 0, err
    assert _same(_weights(ck.find_latest(str(out))), _weights(ck.find_latest(straight)))
    assert [m["step"] for m in _metrics(out)] == list(range(1, STEPS + 1))


# ---------------------------------------------------------------------------------------------- SIGKILL
def _child(out: str, overrides: list, kill_at: int) -> None:
    """A training process that SIGKILLs itself at its ``kill_at``-th checkpoint file operation (0: never)."""
    import specopd.runs.checkpoint as ckm
    from specopd.train.loop import train as run
    from tiny_runs import tiny_recipe as recipe

    torch.set_num_threads(1)
    count = [0]

    def point():
        count[0] += 1
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(fn):
        def inner(*a, **k):
            point()
            r = fn(*a, **k)
            point()
            return r
        return inner

    for name in ("_write_json", "_fsync_file", "sha256_file"):
        setattr(ckm, name, wrap(getattr(ckm, name)))
    for name in ("rename", "replace"):
        setattr(os, name, wrap(getattr(os, name)))
    shutil.rmtree = wrap(shutil.rmtree)
    run(recipe(out, overrides), progress=False)


def test_sigkill_at_random_points_across_saves_20_times(tmp_path):
    """20 SIGKILLs (14 at random checkpoint file operations inside the process, 6 at random times from
    outside), each followed by a resume: every complete checkpoint verifies after every kill, and the
    finished run's metrics (each step once) and weights equal an uninterrupted run's."""
    # enough saves that 20 kills (<= 40 file operations or <= 1.5 s each) cannot finish the run first: at 160 steps
    # a quiet machine finished it within the 20th attempt's 1.5 s (exit 0 instead of a kill)
    steps = 480
    ov = ["trainer.max_steps=%d" % steps, "trainer.save_every=2", "trainer.keep_last=2", "trainer.eval_heldout=false"]
    ref = tmp_path / "straight"
    train(tiny_recipe(str(ref), ov), progress=False)
    out = str(tmp_path / "killed")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "safetensors.torch", "specopd.train.loop",  # start fast
                                "specopd.train.worker", "specopd.train.group", "specopd.models", "specopd.drafters"])
    rng = random.Random(0)
    kills = 0
    for attempt in range(20):
        inside = attempt % 10 not in (3, 6, 9)  # 14 inside, 6 from outside
        p = ctx.Process(target=_child, args=(out, ov, rng.randint(1, 40) if inside else 0))
        p.start()
        if not inside:
            time.sleep(rng.uniform(0.3, 1.5))
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        p.join(120)
        assert p.exitcode in (-signal.SIGKILL, 0), p.exitcode
        kills += p.exitcode == -signal.SIGKILL
        for _, d in ck.complete_checkpoints(out):
            assert ck.verify(d) is None, (attempt, d, ck.verify(d))
        assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.endswith(".damaged")] \
            if os.path.isdir(os.path.join(out, "checkpoints")) else True
    assert kills == 20, kills
    p = ctx.Process(target=_child, args=(out, ov, 0))
    p.start()
    p.join(300)
    assert p.exitcode == 0
    got, want = _metrics(out), _metrics(ref)
    assert [m["step"] for m in got] == list(range(1, steps + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    assert _same(_weights(ck.find_latest(out)), _weights(ck.find_latest(str(ref))))


# ---------------------------------------------------------------------------------------------- world changed
def test_resume_with_other_worker_counts_is_bitwise_the_same(tmp_path, monkeypatch, capsys):
    """trainer.batch_invariant: steps 1-2 on 1 worker, 3-4 on 2 workers, 5-6 on 3 workers (a batch of 5
    samples: uneven shards; each part stopped by an interrupt after its checkpoint) equal 6 steps on 1 worker
    bit for bit: metrics and weights."""
    inv = ["trainer.batch_invariant=true", "data.batch_size=5", "trainer.save_every=2"]
    ref = tmp_path / "one"
    train(_cfg(ref, *inv), progress=False)
    out = tmp_path / "changing"
    real = ck.save_checkpoint
    for workers, stop in ((1, 2), (2, 4), (3, None)):
        fired = []

        def save_then_stop(*a, **k):
            r = real(*a, **k)
            if a[1] == stop and not fired:
                fired.append(1)
                raise KeyboardInterrupt  # preempted right after the checkpoint of step `stop`
            return r

        monkeypatch.setattr(ck, "save_checkpoint", save_then_stop)
        capsys.readouterr()
        if stop is None:
            train(_cfg(out, *inv, f"runtime.num_workers={workers}"), progress=False)
        else:
            with pytest.raises(KeyboardInterrupt):
                train(_cfg(out, *inv, f"runtime.num_workers={workers}"), progress=False)
        if workers > 1:
            said = capsys.readouterr().out
            assert f"runtime.num_workers {workers - 1} -> {workers}" in said and "bitwise the same" in said
    a, b = _metrics(ref), _metrics(out)
    assert [m["step"] for m in b] == list(range(1, STEPS + 1))
    for k in ("loss", "alpha", "expected_al", "grad_norm", "lr", "branches"):
        assert [m[k] for m in a] == [m[k] for m in b], k
    assert _same(_weights(ck.find_latest(str(ref))), _weights(ck.find_latest(str(out))))


def test_recipe_changes_that_matter_are_refused_others_continue(straight, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    ckpt = ck.find_latest(str(out))
    recipe_before = open(out / "recipe.yaml").read() if os.path.isfile(out / "recipe.yaml") else None
    for change, key in (("drafter.block_size=5", "drafter.block_size 4 -> 5"),
                        ("model.target=tiny:qwen3_next", "model.target 'tiny:llama' -> 'tiny:qwen3_next'"),
                        ("seed=7", "seed 0 -> 7")):
        rc, stdout, err = _cli(capsys, out, change, "trainer.max_steps=8")
        assert rc == 1 and "Traceback" not in err, err
        assert f"cannot resume from {ckpt}" in err and key in err
        assert "trainer.output_dir" in err and "drafter.init_from" in err
        assert ck.find_latest(str(out)) == ckpt and ck.verify(ckpt) is None
        assert (open(out / "recipe.yaml").read() if recipe_before is not None else None) == recipe_before
    rc, stdout, err = _cli(capsys, out, "trainer.max_steps=8", "trainer.save_every=4", "trainer.lr=0.005")
    assert rc == 0, err
    assert "do not change the run: trainer.max_steps 6 -> 8 (the cosine LR schedule now ends there)" in stdout
    assert "trainer.save_every 0 -> 4" in stdout.split("take effect")[0]
    assert "take effect from step 7 on" in stdout and "trainer.lr 0.003 -> 0.005" in stdout
    assert [m["step"] for m in _metrics(out)] == list(range(1, 9))
    assert _metrics(out)[6]["lr"] == pytest.approx(0.005 * _lr_factor(6, warm=1, total=8))
    refused, same, here = recipe_changes({"model": {"target": "/a"}}, {"model": {"target": "/b"}}, "fp", "fp")
    assert not refused and "the same model" in same[0]


def _lr_factor(s, warm, total, min_ratio=0.1):
    from specopd.train.worker import lr_lambda

    return lr_lambda(warm, total, min_ratio)(s)


def test_deterministic_switch_turns_on_torch_deterministic_algorithms(tmp_path):
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        s = train(_cfg(tmp_path, "trainer.deterministic=true", "trainer.max_steps=2"), progress=False)
        assert torch.are_deterministic_algorithms_enabled() and s["steps"] == 2
        assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


# ---------------------------------------------------------------------------------------------- guards
def _poison(monkeypatch, bad_steps: set, how: str):
    """Make the loss (how="loss") or one gradient (how="grad") non-finite at the given 1-based steps."""
    from specopd.train import phases

    real = phases.loss_backward
    calls = {"n": 0}

    def loss_backward(worker, proposals, p_logits, denom):
        calls["n"] += 1
        if calls["n"] in bad_steps and how == "loss":
            p_logits = torch.full_like(p_logits, float("nan"))
        m = real(worker, proposals, p_logits, denom)
        if calls["n"] in bad_steps and how == "grad":
            worker.params[0].grad.view(-1)[0] = float("inf")
        return m

    monkeypatch.setattr(phases, "loss_backward", loss_backward)


@pytest.mark.parametrize("how", ["loss", "grad"])
def test_nonfinite_steps_are_skipped_and_logged(straight, tmp_path, monkeypatch, capsys, how):
    out = tmp_path / "run"
    _poison(monkeypatch, {3, 4}, how)
    train(_cfg(out, "trainer.save_every=1", "trainer.keep_last=10"), progress=False)
    said = capsys.readouterr().out
    assert "step 3: loss" in said and "update skipped (1 in a row" in said and "(2 in a row" in said
    lines = _metrics(out)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert [m.get("skipped", False) for m in lines] == [False, False, True, True, False, False]
    w = {k: _weights(os.path.join(out, "checkpoints", f"step-{k}")) for k in (2, 3, 4, 5)}
    assert _same(w[2], w[3]) and _same(w[3], w[4]) and not _same(w[4], w[5])  # no update at steps 3 and 4
    o2, o4 = (ck.read_trainer_state(os.path.join(out, "checkpoints", f"step-{k}", "trainer_state.pt"))
              ["optimizer"]["state"] for k in (2, 4))
    assert all(torch.equal(o2[i]["exp_avg"], o4[i]["exp_avg"]) for i in o2)  # AdamW's moments untouched


def test_nonfinite_steps_in_a_row_stop_the_run_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _poison(monkeypatch, {3, 4, 5}, "loss")
    rc, stdout, err = _cli(capsys, out, "trainer.max_nonfinite_steps=3", "trainer.save_every=2",
                           "trainer.keep_last=3")
    assert rc == 1 and "Traceback" not in err
    assert "stopped at step 5" in err and "3 steps in a row (steps 3-5)" in err and "after step 2" in err
    p = os.path.join(str(out), "checkpoints", "step-5")
    assert f"Checkpoint written: {p} (the last one before these steps: {os.path.dirname(p)}/step-2)" in err
    assert "trainer.lr" in err
    assert ck.verify(p) is None
    assert _same(_weights(p), _weights(os.path.join(str(out), "checkpoints", "step-2")))
    with pytest.raises(NonFiniteError):  # the same through the Python API
        _poison(monkeypatch, {1, 2, 3}, "grad")
        train(_cfg(tmp_path / "api", "trainer.max_nonfinite_steps=3"), progress=False)


def test_prompts_longer_than_the_target_context_are_dropped_and_counted(tmp_path, capsys):
    from types import SimpleNamespace

    from specopd.train.data import load_dataset

    recs = [{"input_ids": list(range(1, 30)), "prompt_len": 5},    # fits
            {"input_ids": list(range(1, 40)), "prompt_len": 20},   # prompt >= context 16: dropped
            {"input_ids": list(range(1, 12)), "prompt_len": 16},   # prompt >= context (and no response)
            {"input_ids": list(range(1, 9)), "prompt_len": 8}]     # no response token
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = tiny_recipe(str(tmp_path), ["data.source=prepared", f"data.path={p}", "data.seq_len=64"])
    target = SimpleNamespace(vocab_size=256, config=SimpleNamespace(max_position_embeddings=16))
    capsys.readouterr()
    data = load_dataset(cfg, target)
    said = capsys.readouterr().out
    assert len(data) == 1 and data[0]["input_ids"].numel() == 16  # cut to the context
    assert "[data] of 4 records, 2 dropped: prompt of >= 16 tokens, longer than the target's context" in said
    assert "1 dropped: no response token" in said and "1 cut to the target's context of 16 tokens" in said
    syn = tiny_recipe(str(tmp_path), ["data.seq_len=20"])
    with pytest.raises(ValueError, match="data.seq_len=20 is longer than the target's context"):
        load_dataset(syn, target)


# ---------------------------------------------------------------------------------------------- side effects
def test_failed_validation_leaves_the_old_recipe_and_a_history_keeps_changed_ones(straight, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    first = open(out / "recipe.yaml").read()
    rc, stdout, err = _cli(capsys, out, "trainer.resume=none", "model.target=/nonexistent/target")
    assert rc != 0 and "Traceback" not in err and "/nonexistent/target" in err
    assert open(out / "recipe.yaml").read() == first  # the old run's recipe is still there
    assert not os.path.isdir(out / "recipe.history")
    assert ck.find_latest(str(out)) is not None  # and its checkpoints
    rc, stdout, err = _cli(capsys, out, "trainer.max_steps=7")  # a changed recipe: the old one is kept
    assert rc == 0, err
    hist = os.listdir(out / "recipe.history")
    assert len(hist) == 1 and open(out / "recipe.history" / hist[0]).read() == first
    assert "max_steps: 7" in open(out / "recipe.yaml").read()


def test_fresh_run_in_a_used_folder_moves_the_old_run_aside(straight, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    old_ckpt = _weights(ck.find_latest(str(out)))
    rc, stdout, err = _cli(capsys, out, "trainer.resume=none", "trainer.max_steps=2")
    assert rc == 0, err
    assert "moved aside" in stdout
    aside = [n for n in os.listdir(out) if n.startswith("checkpoints.before-")]
    assert len(aside) == 1 and _same(_weights(os.path.join(out, aside[0], f"step-{STEPS}")), old_ckpt)
    assert [n for n in os.listdir(out) if n.startswith("metrics.before-")]
    assert [m["step"] for m in _metrics(out)] == [1, 2]


def test_finished_run_started_again_says_it_is_complete(straight, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = open(out / "metrics.jsonl").read()
    t0 = time.time()
    rc, stdout, err = _cli(capsys, out)
    assert rc == 0 and time.time() - t0 < 30
    assert f"is complete: its checkpoint {ck.find_latest(str(out))} is at step {STEPS}" in stdout
    assert f"trainer.max_steps={2 * STEPS}" in stdout and "trainer.resume=none" in stdout
    assert open(out / "metrics.jsonl").read() == before
    rc, stdout, err = _cli(capsys, out, f"trainer.max_steps={STEPS + 2}")  # the advice works
    assert rc == 0 and [m["step"] for m in _metrics(out)] == list(range(1, STEPS + 3))


def test_dry_run_notes_of_the_main_job_agree(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPD_CACHE", str(tmp_path / "empty"))
    recipe = os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2-135m-dflash-chitchat.yaml")
    # data.path in the run folder: the recipe's own (runs/...) exists once `make demo` has run in this checkout
    assert main(["train", recipe, f"trainer.output_dir={tmp_path / 'run'}",
                 f"data.path={tmp_path / 'run' / 'data' / 'train.jsonl'}", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "written by the main job on first use" in text and "prepared by the main job on first use" in text
    assert "before training" not in text and "run `specopd prepare" not in text
    assert not os.path.exists(tmp_path / "run")  # a dry run writes nothing


def test_resume_with_a_drafter_of_another_shape_is_refused(straight, tmp_path, capsys):
    """drafter.init_from (ignored on resume) names a 2-layer drafter: the resume of the 1-layer run is refused
    clearly, naming the change and where it comes from, not with a raw state_dict traceback."""
    other = tmp_path / "two-layers"
    train(_cfg(other, "drafter.num_layers=2", "trainer.max_steps=1"), progress=False)
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    rc, stdout, err = _cli(capsys, out, f"drafter.init_from={ck.find_latest(str(other))}",
                           f"trainer.max_steps={STEPS + 1}")
    assert rc == 1 and "Traceback" not in err
    assert f"cannot resume from {ck.find_latest(str(out))}" in err
    assert "drafter.num_layers 1 -> 2 (the drafter of drafter.init_from=" in err
