"""benchmarks/aot_check.py: Triton kernels compile ahead of time for sm_90 / sm_100 on a machine without a GPU,
with registers, shared memory and spills read from the cubin (the full run is slow: ~1 min on 2 cores), and no
tl.dot block dim below 16; by default at the tiny recipes' shapes for sm_90, the recipes' shapes marked slow."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "aot_check.py")


TT36 = os.path.join(ROOT, ".tt36")  # triton 3.6.0 (the H200 machine's), `make tt36`: pip install --target .tt36


def _run(tmp_path, *args, timeout=600, triton_dir=None):
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(triton_dir or os.path.dirname(os.path.dirname(triton.__file__)), "triton",
                                       "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this triton has no bundled cuobjdump (the NVIDIA backend)")
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(([triton_dir] if triton_dir else []) + [ROOT, env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from an earlier run's cache
    r = subprocess.run([sys.executable, SCRIPT, "--json", str(out), *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_aot_one_kernel_reports_resources(tmp_path):
    """One small kernel for sm_90: the JSON rows carry the documented keys and real numbers."""
    r, rows = _run(tmp_path, "--only", "qsa_topk", "--arch", "90", "--jobs", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert rows and set(rows[0]) == {"kernel", "arch", "ok", "registers", "shared_bytes", "local_bytes"}
    assert rows[0]["arch"] == "sm_90" and rows[0]["ok"] and rows[0]["registers"] > 0 and rows[0]["local_bytes"] == 0
    assert "tree attention plan" in r.stdout


def test_aot_flags_failures(tmp_path):
    """An unknown arch is refused; a compile failure is a row with ok = False and a non-zero exit."""
    r, _ = _run(tmp_path, "--arch", "75", "--only", "qsa_topk")
    assert r.returncode == 2 and "unknown arch" in r.stderr
    from aot_kernels import compile_one

    job = ("broken", "specopd_kernels.qsa.indexer", "_topk_groups_fwd", {"nope": "*fp32"}, (), {}, {}, 90)
    row = compile_one(job)
    assert row["ok"] is False and "nope" in row["error"]


@pytest.mark.slow
def test_aot_every_kernel_sm90_sm100(tmp_path):
    """The CI gate: every kernel at the recipes' block sizes compiles for sm_90 and sm_100 without spills."""
    r, rows = _run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert {row["arch"] for row in rows} == {"sm_90", "sm_100"} and all(row["ok"] for row in rows)
    names = {row["kernel"].split("[")[0] for row in rows}
    assert names >= {"tree_attention", "gdn_chunk_wy", "gdn_chunk_h", "gdn_chunk_o", "gdn_replay",
                     "gdn_fused_recurrent", "qsa_index_scores", "qsa_topk", "qsa_sparse_attention"}


def test_aot_tiny_recipes_sm90(tmp_path):
    """The default gate for the tiny recipes' targets (recipes/tiny*.yaml: GQA head dim 16, qwen4_exp's GDN K = V = 8,
    QSA and its indexer at 16): every kernel compiles for sm_90 in fp32 (the tiny recipes' dtype) and bf16, at the
    block sizes its launcher picks, with no tl.dot block dim below 16 (``aot_kernels.strict_dot_rule``)."""
    r, rows = _run(tmp_path, "--shapes", "tiny", "--arch", "90", "--dtypes", "fp32,bf16", "--jobs", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert rows and all(row["ok"] for row in rows), [row for row in rows if not row["ok"]]
    assert {row["kernel"].split("[")[0] for row in rows} >= {
        "tree_attention", "gdn_chunk_wy", "gdn_chunk_h", "gdn_chunk_o", "gdn_replay", "gdn_fused_recurrent",
        "qsa_index_scores", "qsa_topk", "qsa_sparse_attention"}
    assert {"gdn_chunk_wy[tiny:qwen4_exp fp32]", "gdn_chunk_o[tiny:qwen4_exp bf16]"} <= {row["kernel"] for row in rows}


def test_aot_refuses_dot_dims_below_16(monkeypatch):
    """A launch with a tl.dot block dim of 8 (the GDN chunk kernel at K = 8 with BK = 8, as its launcher picked it
    before the padding) is a failed row: the compilers here accept it (triton 3.9 for fp32 and bf16), a GPU's
    triton 3.6 refuses it, and the AOT check must too. The rule is scoped to the compile: triton is left as found."""
    pytest.importorskip("triton")
    from triton.backends.nvidia import compiler as nv

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # as benchmarks/aot_check.py: triton 3.9's default, no warning

    import aot_kernels

    before = nv.min_dot_size
    tiny = [v for v in aot_kernels.variants(("bf16",), aot_kernels.tiny_shapes())
            if v[0] == "gdn_chunk_o[tiny:qwen4_exp bf16]"]
    label, module, kernel, ptrs, floats, constexprs, options = tiny[0]
    assert constexprs["K"] == 8 and constexprs["BK"] == 16  # the launcher pads K = 8 to tl.dot's 16
    row = aot_kernels.compile_one((label, module, kernel, ptrs, floats, {**constexprs, "BK": 8}, options, 90))
    assert row["ok"] is False and ">= 16" in row["error"], row
    assert nv.min_dot_size is before


def test_dot_rules():
    """specopd_kernels.dot: block sizes are powers of two >= 16; fp32 inputs get IEEE dots; and every tl.dot in kernels/
    names its input precision (triton's default for fp32 operands is TF32 on sm_80+)."""
    import ast
    import glob

    import torch

    from specopd_kernels.dot import dot_block, dot_precision

    assert [dot_block(n) for n in (1, 8, 16, 17, 100, 128, 256)] == [16, 16, 16, 32, 128, 128, 256]
    assert dot_precision(torch.float32) == "ieee" and dot_precision(torch.bfloat16) == "tf32"
    dots = []
    for path in glob.glob(os.path.join(ROOT, "kernels", "**", "*.py"), recursive=True):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.dot":
                dots.append((os.path.relpath(path, ROOT), node.lineno, {k.arg for k in node.keywords}))
    assert len(dots) >= 10, dots
    assert all("input_precision" in kw for _, _, kw in dots), [d for d in dots if "input_precision" not in d[2]]


def test_aot_covers_every_launched_kernel():
    """Every Triton kernel in kernels/ (each one an executor launches) has an AOT variant at the recipes' shapes,
    and the variants use the executors' shapes (GDN q / k expanded to the value heads: HQ = H)."""
    pytest.importorskip("triton")
    import aot_kernels

    variants = aot_kernels.variants()
    covered = {(v[1], v[2]) for v in variants}
    missing = aot_kernels.launched_kernels() - covered
    assert not missing, f"kernels without an AOT variant: {sorted(missing)}"
    assert {"8B", "27B", "qwen4_exp"} <= {v[0].split("[")[1].split()[0] for v in variants}
    for v in variants:
        if v[2] in ("_chunk_wy_fwd", "_chunk_h_fwd", "_chunk_o_fwd", "_replay_fwd"):
            assert v[5]["HQ"] == v[5]["H"], v[0]
    tiny = aot_kernels.tiny_shapes()  # every kernel at the tiny recipes' shapes too, from their recipe files
    assert set(tiny) == {"tiny:llama", "tiny:qwen3_next", "tiny:qwen4_exp"}, tiny
    assert tiny["tiny:qwen4_exp"]["gdn"] == (4, 8, 8) and tiny["tiny:qwen4_exp"]["indexer"] == (8, 16, 4)
    missing = aot_kernels.launched_kernels() - {(v[1], v[2]) for v in aot_kernels.variants(("fp32",), tiny)}
    assert not missing, f"kernels without a tiny AOT variant: {sorted(missing)}"


def _tt36():
    if not os.path.isfile(os.path.join(TT36, "triton", "__init__.py")):
        pytest.skip("triton 3.6 is not installed in .tt36: run `make tt36` (pip install --no-deps --target .tt36 "
                    "triton==3.6.0)")
    return TT36


def test_aot_triton36_one_kernel(tmp_path):
    """The H200 machine's triton (3.6, from .tt36) compiles one kernel for sm_90 through the same script."""
    r, rows = _run(tmp_path, "--only", "qsa_topk", "--arch", "90", "--jobs", "1", triton_dir=_tt36())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "triton 3.6.0" in r.stdout and rows and rows[0]["ok"] and rows[0]["local_bytes"] == 0


@pytest.mark.slow
def test_aot_triton36_bf16_and_fp32_sm90(tmp_path):
    """Under triton 3.6 every kernel compiles for sm_90 in its bf16 and fp32 variants at the recipes' shapes;
    spills are only the measured, explained ones (aot_check.KNOWN_SPILLS; fp32 variants reported, not failed)."""
    r, rows = _run(tmp_path, "--arch", "90", "--dtypes", "bf16,fp32", triton_dir=_tt36(), timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "triton 3.6.0" in r.stdout
    assert {row["kernel"].split("[")[0] for row in rows} >= {"tree_attention", "gdn_chunk_o", "qsa_index_scores"}
    assert any(" fp32 " in row["kernel"] or row["kernel"].endswith("fp32]") for row in rows)
    bf16_spills = [row for row in rows if " bf16" in row["kernel"] and row["local_bytes"]]
    assert all(row["local_bytes"] <= 16 for row in bf16_spills), bf16_spills


def test_conftest_keeps_a_callers_triton_cache_dir(tmp_path):
    """tests/conftest.py: a TRITON_CACHE_DIR set by the caller (the GPU check's one shared folder, so kernels and fla's
    autotuning configs compiled in an earlier step are reused) is the one the tests use; without one the tests get a
    fresh folder of their own, removed at the end of the run."""
    code = ("import os, sys; sys.path.insert(0, 'tests'); import conftest; d = os.environ['TRITON_CACHE_DIR']; "
            "conftest.pytest_sessionfinish(None, 0); print(d)")
    shared = str(tmp_path / "shared")
    for given in (shared, None):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
        if given:
            env["TRITON_CACHE_DIR"] = given
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        got = r.stdout.strip().splitlines()[-1]
        if given:
            assert got == shared
        else:
            assert os.path.basename(os.path.dirname(got)).startswith("specopd-tests-"), got
            assert not os.path.exists(os.path.dirname(got))  # the run's own folder is gone
