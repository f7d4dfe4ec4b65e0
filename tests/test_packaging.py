"""The wheel carries every C source and header the CPU kernels build from on first use (kernels/cbuild.py): an
installed specopd without them would fall back to torch without a word."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_wheel_holds_every_c_source_and_header(tmp_path):
    src = tmp_path / "src"
    for name in ("specopd", "executors", "kernels"):
        shutil.copytree(os.path.join(ROOT, name), src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = glob.glob(str(tmp_path / "dist" / "specopd-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    want = sorted(os.path.relpath(p, ROOT) for ext in ("c", "h")
                  for p in glob.glob(os.path.join(ROOT, "kernels", "**", f"*.{ext}"), recursive=True))
    assert want and [w for w in want if w not in names] == []


def test_no_other_distribution_installs_our_top_level_names():
    """transformers 5.25 requires Hugging Face's `kernels` distribution, whose import name is our kernels/ package's:
    with both installed, transformers imports ours and every model load fails. pyproject pins transformers below 5.25;
    this names the clash if an environment brings such a distribution in anyway."""
    import importlib.metadata as md
    owners = md.packages_distributions()
    clashes = {name: sorted(set(owners.get(name, [])) - {"specopd"}) for name in ("specopd", "executors", "kernels")}
    clashes = {k: v for k, v in clashes.items() if v}
    assert clashes == {}, (f"installed distributions also provide {clashes}; uninstall them "
                           f"(`pip uninstall {' '.join(sorted({d for v in clashes.values() for d in v}))}`) or keep "
                           f"transformers <5.25 as pyproject.toml pins it")
