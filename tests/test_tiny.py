"""Tiny targets built by several processes at once (Ray workers of one run share the output folder)."""
import json
import os
import shutil

import pytest

from specopd.models import tiny
from specopd.models.tiny import build_tiny_target

TINY = {"vocab_size": 64, "num_hidden_layers": 1}


def _files(d):
    return sorted(os.listdir(d))


def test_the_loser_of_the_rename_race_uses_the_winners_folder(tmp_path, monkeypatch):
    winner = build_tiny_target("llama", str(tmp_path / "winner"), overrides=TINY)
    out = str(tmp_path / "run" / "tiny-target-llama")
    os.makedirs(os.path.dirname(out))
    real = os.rename
    calls = []

    def rename(src, dst):  # another worker renames its finished folder in just before us
        if not calls:
            shutil.copytree(winner, dst)
        calls.append((src, dst))
        return real(src, dst)

    monkeypatch.setattr(tiny.os, "rename", rename)
    stamp = os.stat(os.path.join(winner, "model.safetensors")).st_size
    assert build_tiny_target("llama", out, overrides=TINY) == out
    assert len(calls) == 1  # the rename failed (the folder was there); the winner's folder was kept, not replaced
    assert _files(out) == _files(winner) and os.stat(os.path.join(out, "model.safetensors")).st_size == stamp
    assert _files(os.path.dirname(out)) == ["tiny-target-llama"]  # our temporary folder is gone


def test_a_stale_target_is_replaced_and_a_matching_one_reused(tmp_path):
    out = str(tmp_path / "t")
    build_tiny_target("llama", out, seed=0, overrides=TINY)
    with open(os.path.join(out, "tiny.json")) as f:
        assert json.load(f)["seed"] == 0
    mtime = os.stat(os.path.join(out, "model.safetensors")).st_mtime_ns
    build_tiny_target("llama", out, seed=0, overrides=TINY)
    assert os.stat(os.path.join(out, "model.safetensors")).st_mtime_ns == mtime  # reused
    build_tiny_target("llama", out, seed=1, overrides=TINY)
    with open(os.path.join(out, "tiny.json")) as f:
        assert json.load(f)["seed"] == 1
    assert _files(tmp_path) == ["t"]  # neither the temporary nor the moved-aside folder is left


def test_a_half_written_marker_counts_as_not_built(tmp_path):
    out = str(tmp_path / "t")
    build_tiny_target("llama", out, overrides=TINY)
    with open(os.path.join(out, "tiny.json"), "w") as f:
        f.write("{")
    build_tiny_target("llama", out, overrides=TINY)
    with open(os.path.join(out, "tiny.json")) as f:
        assert json.load(f)["model_type"] == "llama"


def test_other_rename_errors_are_raised(tmp_path, monkeypatch):
    def rename(src, dst):
        raise PermissionError(13, "Permission denied", dst)

    monkeypatch.setattr(tiny.os, "rename", rename)
    with pytest.raises(PermissionError):
        build_tiny_target("llama", str(tmp_path / "t"), overrides=TINY)
