"""Test-suite settings.

- One intra-op thread: on 2-core CI machines torch's default thread pool makes tiny ops wait for the other
  core (~100 ms each), which dominates tiny-model tests.
- Tests write only to temporary folders: $SPECOPD_CACHE (prepared models and data, e.g. the ~0.5 GB SmolLM2
  conversion), matplotlib's and Triton's caches point into one folder for the test run, removed at the end
  (``SPECOPD_TEST_CACHE=DIR`` keeps a persistent cache for the tests instead, e.g. to skip re-converting
  SmolLM2 on every run). A ``TRITON_CACHE_DIR`` set by the caller is kept: the GPU check points every step at one
  shared folder, so kernels compiled in an earlier step (each of fla's autotuning configs too) are loaded, not
  rebuilt (``TRITON_CACHE_AUTOTUNING=1`` also keeps each autotuning's choice there, skipping its timing runs).
  Ray gets its auth token from the environment, so it writes no ~/.ray/auth_token.
  A check at the end of the run fails if the tests created anything in the repository's top level or in the user's
  ~/.cache/specopd.
- In a ``gpu`` test fp32 is IEEE fp32: cuDNN's and cuBLAS's TF32 switches are off for its duration.
- Under ``TRITON_INTERPRET=1`` the interpreter refuses a ``tl.dot`` block dim below 16, as a GPU compile does
  (``kernel_check.strict_interpreted_dots``).
"""
import os
import secrets
import shutil
import tempfile

import pytest
import torch

_SESSION_DIR = tempfile.mkdtemp(prefix="specopd-tests-")
os.environ["SPECOPD_CACHE"] = os.environ.get("SPECOPD_TEST_CACHE") or os.path.join(_SESSION_DIR, "cache")
os.environ["MPLCONFIGDIR"] = os.path.join(_SESSION_DIR, "matplotlib")
# isolated per run on the CPU; a caller's folder (the GPU check's shared one) is honoured: setdefault, not assignment
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_SESSION_DIR, "triton"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
if not os.environ.get("RAY_AUTH_TOKEN_PATH") and not os.path.isfile(os.path.expanduser("~/.ray/auth_token")):
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))  # else Ray writes ~/.ray/auth_token
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the main job's vLLM rows (specopd.eval.engine.judge_rows) start vLLM: off for every test that runs the main job;
# tests/test_vllm.py calls the judge itself
os.environ.setdefault("SPECOPD_VLLM_JUDGE", "0")
torch.set_num_threads(1)
if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreted executor tests (tests/test_executor_kernels.py)
    from kernel_check import strict_interpreted_dots

    strict_interpreted_dots()

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_USER_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "specopd")


def _snapshot() -> tuple:
    top = {n for n in os.listdir(_REPO) if n not in (".pytest_cache", "__pycache__")}
    cache = sorted((os.path.relpath(os.path.join(d, f), _USER_CACHE), os.path.getmtime(os.path.join(d, f)))
                   for d, _, fs in os.walk(_USER_CACHE) for f in fs) if os.path.isdir(_USER_CACHE) else []
    return top, cache


@pytest.fixture(scope="session", autouse=True)
def writes_only_to_temporary_folders():
    before = _snapshot()
    yield
    after = _snapshot()
    new_top = sorted(after[0] - before[0])
    assert not new_top, f"tests created {new_top} in the repository ({_REPO}); write to tmp_path instead"
    assert after[1] == before[1], f"tests wrote to the user's cache {_USER_CACHE}; use $SPECOPD_CACHE (tmp)"


@pytest.fixture(autouse=True)
def leaves_one_torch_thread():
    """Every test starts with one torch thread (set above) and must leave it so: fp32 matmuls round differently at
    2 threads on some CPUs (an AVX2 EPYC: [10, 64] @ [64, N] by ~2e-6, which a tiny GDN target grows to 2e-4), so a
    leaked thread count changes the bits of every later test."""
    yield
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
        pytest.fail(f"the test left torch at {n} threads: whatever set them must restore them")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def fp32_is_ieee_on_cuda(request):
    """In a ``gpu`` test fp32 means IEEE fp32: cuDNN runs fp32 convolutions in TF32 by default (the GDN conv's and
    qwen4_exp's PLE conv's torch paths), and a matmul setting could do the same, which would break fp32 bounds for a
    reason that is not ours. The settings are put back after the test."""
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture
def live_groups(monkeypatch):
    """``live_groups()``: the RayGroups this test made that started actors and are not shut down yet (a test reaches
    a run's actors through it, and checks that a failed or finished run closed its group)."""
    from specopd.distributed.ray_backend import RayGroup

    made, init = [], RayGroup.__init__

    def recording_init(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(RayGroup, "__init__", recording_init)
    return lambda: [g for g in made if getattr(g, "actors", None) and not g.closed]
