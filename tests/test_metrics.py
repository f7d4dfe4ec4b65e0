"""Metrics sinks (trainer.loggers; specopd.train.metrics): metrics.jsonl stays the source of truth, and TensorBoard,
wandb (offline) and mlflow (file store) each get every number of it under one naming scheme, read back here with
each tool's own reader (TensorBoard's EventAccumulator, wandb's record protobufs, MlflowClient)."""
from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import zlib

import pytest
import torch

from specopd.train import metrics as M

BAR = ("train/loss", "train/expected_al", "heldout/expected_al", "train/supervised_tokens_per_s")  # the progress bar


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def run_tiny(out, loggers, extra=()):
    from specopd.train.loop import train
    from tiny_runs import tiny_recipe

    cfg = tiny_recipe(str(out), ["trainer.eval_every=2", f"trainer.loggers={json.dumps(list(loggers))}",
                                 "profile.enabled=true"] + list(extra))
    return train(cfg, progress=False)


def jsonl(out) -> list:
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def read_tensorboard(log_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def read_wandb_offline(run_file) -> list:
    """History rows of an offline .wandb file: wandb's record log (7-byte header ':W&B' + magic + version, then
    32 KiB blocks of records with a crc32 / length / type header), parsed with wandb's own Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    b = open(run_file, "rb").read()
    assert b[:4] == b":W&B"
    pos, recs, buf = 7, [], b""
    while pos + 7 <= len(b):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        crc, n, t = struct.unpack("<IHB", b[pos:pos + 7])
        data, pos = b[pos + 7:pos + 7 + n], pos + 7 + n
        if t == 0:
            continue
        assert zlib.crc32(data, zlib.crc32(bytes([t]))) & 0xFFFFFFFF == crc
        if t == 1:
            recs.append(data)
        elif t == 2:
            buf = data
        elif t == 3:
            buf += data
        elif t == 4:
            recs.append(buf + data)
    rows = []
    for d in recs:
        r = pb.Record()
        r.ParseFromString(d)
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def test_scalars_one_naming_scheme():
    rec = {"step": 3, "time": 1.0, "loss": 0.5, "expected_al": 1.7, "alpha": [0.6, 0.2], "branches": 8,
           "supervised_tokens": 16, "supervised_tokens_per_s": 100.0, "step_s": 0.16, "lr": 1e-3, "grad_norm": 2.0,
           "phase_s": {"prefill": 0.1, "score": 0.05}, "skipped": True, "heldout_expected_al": 1.5,
           "heldout_alpha": [0.4, 0.1], "heldout_branches": 4, "heldout_eval_s": 0.2}
    assert M.scalars(rec) == {
        "train/loss": 0.5, "train/expected_al": 1.7, "train/alpha/pos_1": 0.6, "train/alpha/pos_2": 0.2,
        "train/branches": 8.0, "train/supervised_tokens": 16.0, "train/supervised_tokens_per_s": 100.0,
        "train/step_s": 0.16, "train/lr": 1e-3, "train/grad_norm": 2.0, "train/phase_s/prefill": 0.1,
        "train/phase_s/score": 0.05, "train/skipped": 1.0, "heldout/expected_al": 1.5, "heldout/alpha/pos_1": 0.4,
        "heldout/alpha/pos_2": 0.1, "heldout/branches": 4.0, "heldout/eval_s": 0.2}


def test_every_sink_holds_every_metric_of_metrics_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    have = [n for n in ("wandb", "mlflow") if M.importlib.util.find_spec(n) is not None]
    for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(k, str(tmp_path / "wandb-home"))  # nothing written outside tmp_path
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    out = tmp_path / "run"
    run_tiny(out, ["jsonl", "tensorboard"] + have)
    lines = jsonl(out)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    want = {r["step"]: M.scalars(r) for r in lines}
    names = set().union(*want.values())
    assert set(BAR) <= names and {"train/alpha/pos_1", "train/alpha/pos_3", "heldout/alpha/pos_3",
                                  "train/phase_s/prefill", "train/phase_s/score", "train/phase_s/loss_backward",
                                  "train/phase_s/optimizer"} <= names
    # TensorBoard, read back with its own reader (values are stored as float32)
    tb = read_tensorboard(out / "tensorboard")
    assert set(tb) == names
    for tag, pts in tb.items():
        assert pts == [(s, f32(w[tag])) for s, w in sorted(want.items()) if tag in w], tag
    assert [s for s, _ in tb["heldout/expected_al"]] == [2, 4]
    if "wandb" in have:
        files = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert len(files) == 1
        rows = read_wandb_offline(files[0])
        assert [r["_step"] for r in rows] == [1, 2, 3, 4]
        for r in rows:
            assert {k: v for k, v in r.items() if not k.startswith("_")} == want[r["_step"]]
    if "mlflow" in have:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri="file:" + str(out / "mlruns"))
        run_id = open(out / "mlflow_run_id").read().strip()
        run = client.get_run(run_id)
        assert set(run.data.metrics) == names and run.info.status == "FINISHED"
        assert run.data.params["trainer.method"] == "specopd" and run.data.params["data.batch_size"] == "4"
        for tag in names:
            hist = client.get_metric_history(run_id, tag)
            assert [(m.step, m.value) for m in hist] == [(s, w[tag]) for s, w in sorted(want.items()) if tag in w]


def test_tensorboard_after_resume_matches_metrics_jsonl(tmp_path):
    """A run interrupted after its step-2 checkpoint but with steps 3-4 logged: the resumed run's TensorBoard
    events for steps 3-4 replace the old ones (purge_step), as metrics.jsonl's lines do."""
    pytest.importorskip("tensorboard")
    from specopd.runs import checkpoint as ck

    out = tmp_path / "run"
    run_tiny(out, ["tensorboard"], ["trainer.save_every=2"])
    first = jsonl(out)
    shutil.rmtree(out / "checkpoints" / "step-4")
    os.remove(out / "train_summary.json")
    assert ck.find_latest(str(out)).endswith("step-2")
    run_tiny(out, ["tensorboard"], ["trainer.save_every=2", "trainer.lr=0.01"])  # steps 3-4 differ now
    lines = jsonl(out)
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and lines[:2] == first[:2] and lines[3]["loss"] != first[3]["loss"]
    tb = read_tensorboard(out / "tensorboard")
    assert tb["train/loss"] == [(r["step"], f32(r["loss"])) for r in lines]


def test_a_fresh_run_in_a_used_folder_starts_new_sink_runs(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    run_tiny(out, ["tensorboard"], ["trainer.max_steps=2"])
    run_tiny(out, ["tensorboard"], ["trainer.max_steps=3", "trainer.resume=none", "trainer.lr=0.02"])
    assert len(glob.glob(str(out / "tensorboard.before-*"))) == 1
    lines = jsonl(out)
    assert read_tensorboard(out / "tensorboard")["train/loss"] == [(r["step"], f32(r["loss"])) for r in lines]


def test_missing_extra_is_named_before_the_run_starts(tmp_path, monkeypatch):
    from specopd.train.loop import train
    from tiny_runs import tiny_recipe

    real = M.importlib.util.find_spec
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(M.MissingExtraError, match=r"pip install -e \.\[wandb\]"):
        M.check_loggers(["jsonl", "wandb"])
    with pytest.raises(M.MissingExtraError, match="remove wandb from trainer.loggers"):
        train(tiny_recipe(str(tmp_path / "r"), ["trainer.loggers=[jsonl,wandb]"]), progress=False)
    assert not os.path.exists(tmp_path / "r" / "metrics.jsonl")
    from specopd.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="trainer.loggers='swanlab'"):
        load_recipe(None, ["trainer.loggers=[jsonl,swanlab]"])


def test_a_failing_sink_is_turned_off_and_jsonl_goes_on(tmp_path):
    class Broken:
        name = "tensorboard"

        def log(self, step, record):
            raise OSError("disk full")

        def close(self):
            pass

    said = []
    lg = M.MetricsLogger([M.JsonlSink(str(tmp_path / "m.jsonl")), Broken()], warn=said.append)
    lg.log({"step": 1, "loss": 1.0})
    lg.log({"step": 2, "loss": 0.5})
    lg.close()
    assert [json.loads(x)["step"] for x in open(tmp_path / "m.jsonl")] == [1, 2]
    assert len(said) == 1 and "tensorboard logger failed (OSError: disk full)" in said[0]
