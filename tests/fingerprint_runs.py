"""Fingerprints of the tiny recipes' runs: the proof that a refactor changed no behaviour.

Runs tiny / tiny-gdn / tiny-qsa on the local and Ray backends, each straight through and as a stop + resume, and
prints one sha256 per run over every checkpoint file and every metrics.jsonl / train_summary.json value that is not
a wall time. Compare the output before and after a change (`diff`):

    python tests/fingerprint_runs.py > before.txt   # on the base commit
    python tests/fingerprint_runs.py > after.txt    # on the change
    diff before.txt after.txt

The runs go to one fixed folder (``RUNS``): their path is in what is hashed (each state.json keeps the recipe,
trainer.output_dir included, and the manifest and marker hash state.json), so runs in a random temporary folder
never compare. One fingerprint run at a time.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["tiny", "tiny-gdn", "tiny-qsa"]
RUNS = Path(tempfile.gettempdir()) / "specopd-fingerprint-runs"
TIMING = {"step_s", "supervised_tokens_per_s", "phase_s", "time", "wall_s", "elapsed_s", "sup_tok_s", "tokens_per_s"}


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in sorted(obj.items()) if k not in TIMING and not k.endswith("_s")
                and "time" not in k and "per_s" not in k}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def train(recipe, out, *overrides):
    cmd = [sys.executable, "-m", "specopd.cli", "train", str(ROOT / "recipes" / f"{recipe}.yaml"),
           f"trainer.output_dir={out}", *overrides]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")


def fingerprint(out):
    h = hashlib.sha256()
    for f in sorted((out / "checkpoints").rglob("*")):
        if f.is_file():
            h.update(str(f.relative_to(out)).encode())
            h.update(f.read_bytes())
    for line in (out / "metrics.jsonl").read_text().splitlines():
        h.update(json.dumps(_strip(json.loads(line)), sort_keys=True).encode())
    h.update(json.dumps(_strip(json.loads((out / "train_summary.json").read_text())), sort_keys=True).encode())
    return h.hexdigest()[:16]


def main():
    if RUNS.exists():
        sys.exit(f"{RUNS} exists: another fingerprint run is using it, or a killed one left it (remove it first)")
    RUNS.mkdir(parents=True)
    try:
        for recipe in RECIPES:
            for backend in ["local", "ray"]:
                be = [f"runtime.backend={backend}"]
                straight = RUNS / f"{recipe}-{backend}-straight"
                train(recipe, straight, *be)
                resumed = RUNS / f"{recipe}-{backend}-resumed"
                train(recipe, resumed, *be, "trainer.max_steps=20")
                train(recipe, resumed, *be)
                print(f"{recipe:10s} {backend:5s} straight {fingerprint(straight)}  resumed {fingerprint(resumed)}",
                      flush=True)
    finally:
        shutil.rmtree(RUNS, ignore_errors=True)


if __name__ == "__main__":
    main()
