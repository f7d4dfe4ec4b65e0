"""The executor tests again with kernels="triton": the Triton kernels run interpreted on the CPU, which needs
TRITON_INTERPRET=1 before any kernel module is imported, so they run in a fresh pytest process (``-k triton``
selects the "triton" instances of the ``kernels`` fixture in each file; the same files run with "torch" in this
process). The interpreter is slow (a Python loop per Triton program), so the default set runs one instance of
each executor path (score, verify + commit, prefill extension, packed prefill, per kind) and ``make test-kernels``
(marker ``interpret_full``) the whole files. Also: selecting the kernels (load_target / model.kernels) fails clearly where they cannot run."""
import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

from kernel_check import interpreter_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAST = [  # one instance per executor path and kind (~3 min on 2 cores)
    "tests/test_executor_gqa.py",  # all of it: tree attention is quick to interpret
    "tests/test_executor_gdn.py::test_triton_kernels_are_launched[qwen3_5_text-triton]",
    "tests/test_executor_qsa.py::test_triton_kernels_are_launched[no-ple-triton]",
    "tests/test_executor_gdn.py::test_branches_match_sequential[qwen3_5_text-triton-5-16]",
    "tests/test_executor_gdn.py::test_general_trees_match_sequential[qwen3_next-triton]",
    "tests/test_executor_qsa.py::test_general_tree[no-ple-triton]",
    "tests/test_commit.py::test_commit_equals_prefill[qwen3_next-triton-True-13-5]",
    "tests/test_commit.py::test_commit_equals_prefill[qwen4_exp_text-triton-False-7-9]",
    "tests/test_executor_packed.py::test_packed_prefill_equals_one_by_one[triton-qwen3_5_text]",
]
# the rest (~27 min on the shared 2-core machine with every QSA instance, ~20 without the PLE ones: the PLE conv
# has no kernel, and the no-PLE target runs the same QSA and GDN kernels)
SLOW = ["tests/test_executor_gqa.py", "tests/test_executor_gdn.py", "tests/test_commit.py",
        "tests/test_executor_packed.py"] + [
    f"tests/test_executor_qsa.py::{t}[no-ple-triton{p}]" for t, p in [
        ("test_prefill_matches_plain_and_nbytes", ""), ("test_chain_branches_edge_anchors", "-1"),
        ("test_chain_branches_edge_anchors", "-5"), ("test_general_tree", ""),
        ("test_packed_trunks_equal_one_by_one", ""), ("test_prefill_extension", ""),
        ("test_triton_kernels_are_launched", "")]]


def _interpreted_pytest(targets, timeout):
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu and not slow",
                        "-k", "triton", *targets], cwd=ROOT, env=interpreter_env(), capture_output=True, text=True,
                       timeout=timeout)
    out = r.stdout + r.stderr
    m = re.search(r"(\d+) passed", out)
    assert r.returncode == 0 and m and int(m.group(1)) > 0, out[-6000:]
    assert "failed" not in out.splitlines()[-1], out[-6000:]
    return int(m.group(1))


def test_executors_with_triton_kernels_interpreted():
    """fp32 exactness (~1e-5) of every executor kind through its Triton kernels: one instance per path."""
    assert _interpreted_pytest(FAST, timeout=1800) >= len(FAST)


@pytest.mark.interpret_full
def test_all_executor_tests_with_triton_kernels_interpreted():
    """The executor test files with kernels="triton" (~20 min on 2 cores; 126 instances passed here): too long
    for CI's 15-minute test budget, so it runs on demand (``make test-kernels``); CI runs the FAST subset above
    and every kernel's own tests against its naive reference (tests/test_kernels_*.py)."""
    assert _interpreted_pytest(SLOW, timeout=5400) > 100


def test_kernel_selection_errors_name_the_fix(tmp_path, monkeypatch):
    from oracle import make_tiny_checkpoint
    from specopd.config import RecipeError, load_recipe
    from specopd.models import load_target

    path = make_tiny_checkpoint("llama", tmp_path)
    with pytest.raises(ValueError, match="kernels must be one of"):
        load_target(path, kernels="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            load_target(path, kernels="triton")
    target = load_target(path, kernels="torch")
    assert target.kernels == "torch" and load_target(path).kernels == "auto"
    target.kernels = "triton"  # changed later: the executors refuse with the same message
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            target.prefill(torch.arange(5))
    assert load_recipe(None, ["model.kernels=torch"]).model.kernels == "torch"
    assert load_recipe(None).model.kernels == "auto"
    with pytest.raises(RecipeError, match="model.kernels"):
        load_recipe(None, ["model.kernels=fast"])


def test_kernels_option_routes_each_executor(tmp_path, monkeypatch):
    """kernels="torch" never calls a Triton launcher, and "auto" is torch on the CPU; the executors read the
    choice from the target (``target.kernels``) unless a cache's options name one."""
    import specopd_executors.base as base

    seen = []
    real = base.resolve_kernels
    monkeypatch.setattr(base, "resolve_kernels", lambda o, d: seen.append(real(o, d)) or seen[-1])
    for mod in ("specopd_executors.gqa", "specopd_executors.gdn", "specopd_executors.qsa"):
        monkeypatch.setattr(importlib.import_module(mod), "resolve_kernels", base.resolve_kernels)
    from oracle import make_tiny_checkpoint
    from specopd.models import load_target
    from specopd.tree import ProposalTree

    target = load_target(make_tiny_checkpoint("qwen3_5_text", tmp_path))
    cache = target.prefill(torch.arange(20) + 4)
    target.score(ProposalTree.from_branches([3, 19], [[5, 6], [7, 8]]), cache)
    assert seen and set(seen) == {"torch"}
    assert {"gdn", "gqa"} <= set(target.layer_kinds)
