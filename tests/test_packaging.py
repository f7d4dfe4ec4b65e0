"""Packaging: the folders kernels/ and executors/ install as specopd_kernels / specopd_executors (pyproject.toml's
package-dir), names no other distribution uses; the wheel carries every module and every C source the CPU kernels
build from on first use (kernels/cbuild.py); a checkout on sys.path is one whole copy (its links specopd_kernels ->
kernels, specopd_executors -> executors); and Hugging Face's `kernels`, which transformers >= 5.25 requires, loads
beside ours, even from the repository root."""
from __future__ import annotations

import glob
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from test_imports import PACKAGES as INSTALLED  # folder -> import name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINKS = {name: folder for folder, name in INSTALLED.items() if name != folder}  # specopd_kernels -> kernels, ...


def _copy_checkout(dst) -> str:
    """The three packages, their links, pyproject.toml and README.md of this checkout, copied to ``dst``."""
    for folder in INSTALLED:
        shutil.copytree(os.path.join(ROOT, folder), os.path.join(dst, folder),
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    for name, folder in LINKS.items():
        os.symlink(folder, os.path.join(dst, name))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), os.path.join(dst, name))
    return str(dst)


def _installed_path(folder: str, path: str) -> str:
    """Where the file ``path`` of the checkout folder ``folder`` lies in the wheel."""
    return "/".join([INSTALLED[folder], *os.path.relpath(path, os.path.join(ROOT, folder)).split(os.sep)])


def _python(code: str, cwd, pythonpath: list, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, pythonpath)))
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_checkout_links_each_installed_name_to_its_folder():
    assert LINKS == {"specopd_executors": "executors", "specopd_kernels": "kernels"}
    assert {name: os.readlink(os.path.join(ROOT, name)) for name in LINKS} == LINKS


def test_the_wheel_holds_every_module_c_source_and_header_under_the_installed_names(tmp_path):
    """Under pyproject.toml's package-dir; every package listed in its ``packages`` (one missing there would be
    missing here while an editable install still finds it)."""
    src = _copy_checkout(tmp_path / "src")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = glob.glob(str(tmp_path / "dist" / "specopd-*.whl"))
    names = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    want = {_installed_path(folder, p) for folder in INSTALLED for ext in ("py", "c", "h")
            for p in glob.glob(os.path.join(ROOT, folder, "**", f"*.{ext}"), recursive=True)}
    assert any(n.endswith(".c") for n in want) and any(n.startswith("specopd_executors/") for n in want)
    assert sorted(want - names) == [] and sorted(n for n in names if n.endswith((".py", ".c", ".h"))) == sorted(want)


def test_no_other_distribution_installs_our_top_level_names():
    owners = md.packages_distributions()
    clashes = {name: sorted(set(owners.get(name, [])) - {"specopd"}) for name in INSTALLED.values()}
    clashes = {k: v for k, v in clashes.items() if v}
    assert clashes == {}, f"installed distributions also provide {clashes}"


def test_a_checkout_on_sys_path_runs_its_own_kernels_and_executors(tmp_path):
    """``PYTHONPATH=<checkout>`` (how the tests' subprocesses, the benchmarks and compare_commits.py run one copy)
    imports that checkout's kernels and executors, in any order, not an installed copy's (this one's, in CI)."""
    copy = _copy_checkout(tmp_path / "copy")
    mods = ("specopd_kernels.tree_attention.naive", "specopd_executors", "specopd")
    r = _python(f"import {', '.join(mods)}\nfor m in ({', '.join(mods)}): print(m.__file__)", tmp_path, [copy])
    assert r.returncode == 0, r.stderr[-2000:]
    assert [os.path.realpath(f) for f in r.stdout.split()] == [os.path.join(os.path.realpath(copy), *p) for p in (
        ("kernels", "tree_attention", "naive.py"), ("executors", "__init__.py"), ("specopd", "__init__.py"))]


def test_the_kernels_folder_does_not_answer_for_the_name_kernels(tmp_path):
    """From a checkout's root (on sys.path first) ``import kernels`` loads another distribution's ``kernels`` in the
    folder's place, whatever was imported before; with none the folder stays itself (as before the rename: an older
    transformers imports the name to probe it and must not fail). ``-S``: no site-packages, so the only other
    ``kernels`` is the stand-in made here."""
    copy = _copy_checkout(tmp_path / "copy")
    (tmp_path / "site" / "kernels").mkdir(parents=True)
    (tmp_path / "site" / "kernels" / "__init__.py").write_text("OWNER = 'another distribution'\n")
    (tmp_path / "site" / "kernels" / "layer.py").write_text("MODE = 1\n")
    r = _python("import specopd_kernels, kernels, kernels.layer; print(kernels.OWNER, kernels.layer.__file__)", copy,
                [copy, tmp_path / "site"], "-S")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == f"another distribution {tmp_path / 'site' / 'kernels' / 'layer.py'}"
    r = _python("import kernels; print(kernels.__file__)", copy, [copy], "-S")
    assert r.returncode == 0 and r.stdout.strip() == os.path.join(copy, "kernels", "__init__.py"), r.stderr


LOAD_BESIDE = """
import json, sys
import torch
from oracle import hf_logits, make_tiny_checkpoint, rel_err

path = make_tiny_checkpoint("llama", sys.argv[1], seed=0)
ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
ref = hf_logits(path, ids)  # transformers loads the target (and, >= 5.25, Hugging Face's kernels) before specopd
hf_kernels = sys.modules["kernels"].__file__ if "kernels" in sys.modules else None
import kernels
import specopd_executors, specopd_kernels
from specopd.models import load_target
err = rel_err(load_target(path)(ids), ref)
print(json.dumps(dict(hf_kernels=hf_kernels, kernels=kernels.__file__, ours=specopd_kernels.__file__,
                      executors=specopd_executors.__file__, err=err)))
"""


def test_hugging_face_kernels_and_ours_load_in_one_process_from_the_repository_root(tmp_path):
    """transformers loads a tiny llama target while the repository root is sys.path[0] (``python -c`` there, as
    ``python -m pytest`` / ``python -m specopd.cli`` put it), Hugging Face's ``kernels`` imported first; then our
    kernels and executors load under their installed names from this checkout, and our target matches
    transformers' logits."""
    try:
        dist = md.distribution("kernels")
    except md.PackageNotFoundError:
        pytest.fail("Hugging Face's `kernels` is not installed: pip install -e '.[dev]' (the dev extra names it)")
    import transformers

    theirs = os.path.realpath(dist.locate_file("kernels/__init__.py"))
    r = subprocess.run([sys.executable, "-c", LOAD_BESIDE, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert os.path.realpath(got["kernels"]) == theirs
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 25):
        assert got["hf_kernels"] is not None  # transformers >= 5.25 imports it to load a model
    assert got["hf_kernels"] is None or os.path.realpath(got["hf_kernels"]) == theirs
    assert [os.path.realpath(got["ours"]), os.path.realpath(got["executors"])] == [
        os.path.join(os.path.realpath(ROOT), folder, "__init__.py") for folder in ("kernels", "executors")]
    assert got["err"] <= 1e-4
