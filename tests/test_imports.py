"""Imports flow one way, down these layers (lowest last):

    cli -> mainjob / follow -> eval -> train -> distributed -> memory -> data -> runs -> models / drafters -> executors
        -> kernels

- eval reads a run (its checkpoints, its data split as training made it: ``specopd.train.data``) and never trains.
- train is the controller and the step; it places its workers (distributed), plans memory (memory), reads data
  (data) and writes runs (runs).
- distributed runs workers as Ray actors: it builds each with the factory train hands it and runs the functions
  train passes (``group.run(fn, ...)``), so it imports nothing of train.
- memory plans a step from the recipe, the data's shapes and the target's config (tiny targets included).
- data prepares and reads references; ``specopd prepare data`` locks its folder (runs).
- runs holds what a run leaves on disk: the folder's lock and its checkpoint folders.
- kernels and executors import nothing from ``specopd``: they are packages of their own.
- engines keep only the standard library at their top (serving engines run as their own processes).
- The leaves (config, errors, profiling, signals, the CPU feature probe) import only leaves; any module may import
  them.

No two folders import each other (a two-way tie, or a longer circle), and no two modules do.

The package is parsed with ``ast`` (nothing is imported). Every import counts, at module level or inside a
function: ``import a.b``, ``from a import b`` (relative ones resolved), and ``__import__("a.b")``,
``importlib.import_module("a.b")`` or any call whose first argument is the name of one of our modules (a
loader given a module's name). ``from pkg import sub`` is an import of the module ``pkg.sub``. The folders
kernels/ and executors/ are the modules ``specopd_kernels`` / ``specopd_executors`` (their installed names).
"""
from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folder -> import name (pyproject.toml's package-dir; the checkout's links specopd_kernels -> kernels, ...)
PACKAGES = {"specopd": "specopd", "executors": "specopd_executors", "kernels": "specopd_kernels"}

# lowest first: a module imports modules of its own layer and of the layers below, never above
LAYERS = [
    ("engines (stdlib only: serving engines run as their own processes)", ("specopd.engines",)),
    ("kernels", ("specopd_kernels",)),
    ("executors", ("specopd_executors",)),
    ("models / drafters", ("specopd.models", "specopd.drafters", "specopd.losses", "specopd.sampling",
                           "specopd.speculative", "specopd.tree")),
    ("runs (run folders: lock, checkpoints)", ("specopd.runs",)),
    ("data", ("specopd.data",)),
    ("memory", ("specopd.memory",)),
    ("distributed", ("specopd.distributed",)),
    ("train", ("specopd.train",)),
    ("eval", ("specopd.eval",)),
    ("jobs", ("specopd.mainjob", "specopd.follow")),
    ("cli", ("specopd.cli",)),
]
# import only leaves: the recipe root (specopd.config) and each component's section beside its code (which import
# only specopd.settings), so that any module can read a section and the root can import them all
LEAVES = ("specopd", "specopd.config", "specopd.settings", "specopd.errors", "specopd.profiling", "specopd.signals",
          "specopd.models.config", "specopd.drafters.config", "specopd.data.config", "specopd.train.config",
          "specopd.eval.config", "specopd.mainjob_config", "specopd.follow_config", "specopd_kernels.paths",
          "specopd_kernels.cpu_features")
STANDALONE = ("specopd_kernels", "specopd_executors")  # import nothing from specopd, leaves included
BELOW_JOBS = ("specopd/eval", "specopd/distributed", "specopd/train", "specopd/data", "specopd/runs", "specopd/drafters",
              "specopd/models", "executors", "kernels")
# (importer, imported) pairs excused from the layers and the ties
ALLOWED: set = set()


def _modules() -> dict:
    """module name -> path, for every .py file of the three packages."""
    out = {}
    for top, top_name in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    name = f"{top_name}.{os.path.relpath(path, os.path.join(ROOT, top))[:-3].replace(os.sep, '.')}"
                    out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(name: str, path: str, mods: dict) -> list:
    """[(imported module, line)] of one module: every import anywhere in it, see the module docstring."""
    is_pkg = path.endswith("__init__.py")
    out = []

    def add(target: str, line: int) -> None:
        while target and target not in mods:  # "a.b.func" -> "a.b"
            target = target.rpartition(".")[0]
        if target and target != name and (target, line) not in out:
            out.append((target, line))

    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                pkg = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            for a in node.names:
                full = f"{base}.{a.name}"
                add(full if full in mods else base, node.lineno)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            arg, fn = node.args[0].value, node.func
            fname = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if isinstance(arg, str) and (arg in mods or fname in ("__import__", "import_module")):
                add(arg, node.lineno)
    return out


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    return mods, {m: _imports(m, p, mods) for m, p in mods.items()}


def _layer(m: str):
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(m == p or m.startswith(p + ".") for p in prefixes):
            return i
    return None


def _folder(m: str) -> str:
    """The folder (or top-level module) a module belongs to: ``specopd.train.loop`` -> ``specopd.train``,
    ``specopd.memory`` -> itself, ``specopd_kernels.gated_delta.replay`` -> ``specopd_kernels.gated_delta``."""
    return ".".join(m.split(".")[:2])


def _folder_ties(imports: dict) -> list:
    """Groups of folders that import one another (two-way ties and longer circles), ``ALLOWED`` pairs aside.
    Leaves are left out: they import only leaves (``test_imports_flow_down_the_layers``), so none closes a circle,
    and a folder holding a leaf (e.g. ``specopd/eval/config.py``, its recipe section, which the recipe root imports)
    is not tied to whoever reads that section."""
    edges: dict = {}
    for m, ts in imports.items():
        for t, _ in ts:
            if _tie_edge(m, t):
                edges.setdefault(_folder(m), set()).add(_folder(t))
    return _cycles({a: sorted(b) for a, b in edges.items()})


def _tie_edge(m: str, t: str) -> bool:
    """Whether module m importing t ties their folders: other folders, neither a leaf, not an allowed pair."""
    return _folder(m) != _folder(t) and m not in LEAVES and t not in LEAVES and (m, t) not in ALLOWED


def _cycles(edges: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_parser_sees_every_kind_of_import(tmp_path):
    """The checks below can fail: each import form is found (module level, in a function, relative, dynamic)."""
    pkg = tmp_path / "specopd"
    (pkg / "train").mkdir(parents=True)
    for f in ("__init__.py", "mainjob.py", "cli.py", "train/__init__.py", "train/data.py"):
        (pkg / f).write_text("")
    (pkg / "train" / "loop.py").write_text(
        "import specopd.cli\n"
        "from . import data\n"
        "def f():\n    from specopd.mainjob import run\n"
        "def g():\n    return __import__('specopd.mainjob', fromlist=['run'])\n"
        "def h(load):\n    return load('specopd.cli', 'main')\n")
    mods = {"specopd": "", "specopd.mainjob": "", "specopd.cli": "", "specopd.train": "", "specopd.train.data": ""}
    got = _imports("specopd.train.loop", str(pkg / "train" / "loop.py"), mods)
    assert got == [("specopd.cli", 1), ("specopd.train.data", 2), ("specopd.mainjob", 4), ("specopd.mainjob", 6),
                   ("specopd.cli", 8)]
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _folder("specopd.train.loop") == _folder("specopd.train") == "specopd.train"
    assert _folder("specopd.memory") == "specopd.memory" and _folder("specopd_kernels.gated_delta.replay") == "specopd_kernels.gated_delta"
    ties = _folder_ties({"specopd.data.prepare": [("specopd.train.lock", 3)],
                         "specopd.train.data": [("specopd.data.formats", 5)],
                         "specopd.train.loop": [("specopd.distributed.ray_backend", 7)]})
    assert ties == [["specopd.data", "specopd.train"]]


def test_no_import_cycles(graph):
    _, imports = graph
    cycles = _cycles({m: sorted({t for t, _ in ts}) for m, ts in imports.items()})
    assert not cycles, "modules that import one another in a circle (function-level imports included): " + \
        "; ".join(" <-> ".join(c) for c in cycles)


def test_nothing_below_the_jobs_imports_mainjob_or_cli(graph):
    mods, imports = graph
    bad = [f"{os.path.relpath(mods[m], ROOT)}:{line} imports {t}" for m, ts in imports.items() for t, line in ts
           if t in ("specopd.mainjob", "specopd.cli")
           and any(os.path.relpath(mods[m], ROOT).startswith(d + os.sep) for d in BELOW_JOBS)]
    assert not bad, bad


def test_imports_flow_down_the_layers(graph):
    """Down the layers of the module docstring, never upwards; the leaves (the recipe root and its sections,
    settings, errors, profiling, signals, the kernel path choices, the CPU feature probe) import only leaves; a
    submodule imports its siblings' modules, not its own package (whose __init__ re-exports them)."""
    mods, imports = graph
    unplaced = [m for m in mods if _layer(m) is None and m not in LEAVES]
    assert not unplaced, f"modules in no layer of this test: {unplaced} (add them to LAYERS)"
    bad = []
    for m, ts in imports.items():
        for t, line in ts:
            where = f"{os.path.relpath(mods[m], ROOT)}:{line}"
            if m in LEAVES and t not in LEAVES:
                bad.append(f"{where}: the leaf {m} imports {t}")
            elif m not in LEAVES and t not in LEAVES and _layer(t) > _layer(m) and (m, t) not in ALLOWED:
                bad.append(f"{where}: {m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]}), a layer above")
            if m.startswith(t + ".") and t != "specopd":
                bad.append(f"{where}: {m} imports its own package {t} (import the sibling module instead)")
    assert not bad, "\n".join(bad)


def test_no_two_folders_import_each_other(graph):
    """Folder A imports folder B and B imports A (or a longer circle): a tie the layers would hide if both sat
    in one layer. Each arrow between the tied folders is named."""
    mods, imports = graph
    bad = []
    for group in _folder_ties(imports):
        bad.append(" <-> ".join(group) + ":")
        bad += [f"  {os.path.relpath(mods[m], ROOT)}:{line} imports {t}" for m, ts in sorted(imports.items())
                for t, line in ts if _tie_edge(m, t) and _folder(m) in group and _folder(t) in group]
    assert not bad, "folders that import one another (function-level imports included):\n" + "\n".join(bad)


def test_kernels_and_executors_import_nothing_from_specopd(graph):
    """kernels/ and executors/ are packages of their own below specopd: not even its leaves."""
    mods, imports = graph
    bad = [f"{os.path.relpath(mods[m], ROOT)}:{line} imports {t}" for m, ts in imports.items() for t, line in ts
           if m.split(".")[0] in STANDALONE and t.split(".")[0] == "specopd"]
    assert not bad, "\n".join(bad)


def test_public_names_stay_where_they_are():
    """The public API (docs/architecture.md) and the names other areas import from the package roots."""
    from specopd.drafters import (DRAFTERS, DFlash2Drafter, DFlashDrafter, DraftContext, DrafterConfig, Drafter,
                                  DSparkDrafter, build_drafter, choose_mask, default_target_layer_ids, export_drafter,
                                  export_folder, load_drafter, pick_tokens, serving_commands, shift_tokens)
    from specopd.eval import SpeculativeDecoder
    from specopd.losses import e2e_tv_loss
    from specopd.models import MODEL_TYPES, RunContext, TargetCache, TargetModel, load_target, register_model
    from specopd.models.base import DecoderLayer, VerifyState
    from specopd.models.common import causal_mask, masked_attention, sdpa_attention
    from specopd.tree import ProposalTree

    assert sorted(DRAFTERS) == ["dflash", "dflash2", "dspark", "eagle3"] and Drafter is DFlashDrafter
    assert DRAFTERS["dspark"] is DSparkDrafter and issubclass(DSparkDrafter, DFlashDrafter)
    assert DRAFTERS["dflash2"] is DFlash2Drafter and issubclass(DFlash2Drafter, DFlashDrafter)
    assert {"llama", "qwen3", "qwen3_next", "qwen3_5", "qwen4_exp"} <= set(MODEL_TYPES)
    assert all(issubclass(c, TargetModel) for c in MODEL_TYPES.values())
    assert all(isinstance(c, type) for c in (DraftContext, DrafterConfig, SpeculativeDecoder, RunContext, TargetCache,
                                             DecoderLayer, VerifyState, ProposalTree))
    assert all(callable(f) for f in (build_drafter, choose_mask, default_target_layer_ids, export_drafter,
                                     export_folder, load_drafter, pick_tokens, serving_commands, shift_tokens,
                                     e2e_tv_loss, load_target, register_model, causal_mask, masked_attention,
                                     sdpa_attention))


def test_kernels_and_executors_are_imported_by_their_installed_names():
    """``specopd_kernels.x``, never ``kernels.x`` (and so for executors), in the packages, the tests and the
    benchmarks, in imports and in module names given as strings: the folder name works only from a checkout's root and
    there answers for another distribution's ``kernels``. A bare ``import kernels`` is Hugging Face's and allowed."""
    mods = _modules()
    old = {folder + m[len(name):]: p for folder, name in PACKAGES.items() if folder != name for m, p in mods.items()
           if m == name or m.startswith(name + ".")}
    bad = []
    for top in ("specopd", "executors", "kernels", "tests", "benchmarks"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for path in (os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py")):
                found = _imports("", path, old)
                for node in ast.walk(ast.parse(open(path).read(), path)):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        target = node.value if re.fullmatch(r"[\w.]+", node.value) else ""
                        while target and target not in old:
                            target = target.rpartition(".")[0]
                        found += [(target, node.lineno)] if target else []
                bad += [f"{os.path.relpath(path, ROOT)}:{line}: {t}" for t, line in found if t not in PACKAGES]
    assert not bad, "use specopd_kernels / specopd_executors:\n" + "\n".join(sorted(set(bad)))
