"""Fingerprints of the tiny recipes' runs: the proof that a refactor changed no behaviour.

Runs tiny / tiny-gdn / tiny-qsa on the local and Ray backends, tiny with each other drafter kind (dspark,
dflash2; EAGLE-3 through recipes/tiny-eagle3.yaml), and tiny on every schedule of the step (two data-parallel workers, split roles on both backends,
batch-invariant, Draft-OPD and the two off-policy methods), each straight through and as a stop + resume, and
prints one sha256 per run over every checkpoint file and every metrics.jsonl / train_summary.json value that is not
a wall time, with the run's own (temporary) folder written as <out> (state.json and the summary name it; the
manifest and COMPLETE marker, sha256 of those files, are left out; Ray runs leave out the actor's randomly seeded
global torch RNG state, see _trainer_state), so two runs of the same code agree. state.json records the recipe: its
renamed keys (``specopd.config.RENAMED``) are hashed under their old names (``old_key_names``), so a fingerprint
taken before a rename compares with one taken after it. Compare the output before and after a change (`diff`):

    python tests/fingerprint_runs.py > before.txt   # on the base commit
    python tests/fingerprint_runs.py > after.txt    # on the change
    diff before.txt after.txt
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # read_trainer_state, run as `python tests/fingerprint_runs.py`
RECIPES = ["tiny", "tiny-gdn", "tiny-qsa"]
# (label, recipe, backends, overrides): every recipe as written (DFlash), then the other drafter kinds on tiny
RUNS = ([(recipe, recipe, ["local", "ray"], []) for recipe in RECIPES]
        + [("tiny+dspark", "tiny", ["local"], ["drafter.kind=dspark"]),
           ("tiny+dflash2", "tiny", ["local"], ["drafter.kind=dflash2"]),
           ("tiny-eagle3", "tiny-eagle3", ["local"], []),  # EAGLE-3 as its recipe writes it
           # every schedule of the step: data-parallel workers, split roles, batch-invariant, each method
           ("tiny+2workers", "tiny", ["local"], ["runtime.num_workers=2"]),
           ("tiny+split", "tiny", ["local", "ray"], ["runtime.roles=split"]),  # 1 target + 1 drafter worker
           ("tiny+invariant", "tiny", ["local"], ["trainer.batch_invariant=true", "runtime.num_workers=2"]),
           ("tiny+draft_opd", "tiny", ["local"], ["trainer.method=draft_opd"]),
           ("tiny+ce", "tiny", ["local"], ["trainer.method=offpolicy_ce"]),
           ("tiny+e2e_tv", "tiny", ["local"], ["trainer.method=offpolicy_e2e_tv"]),
           ("tiny-gdn-mtp", "tiny-gdn-mtp", ["local"], [])])  # the hybrid target's own MTP head
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
    # one thread, as a Ray actor with one CPU has: an fp32 matrix product's bits can depend on the thread count
    # (tiny-qsa's MoE expert products differ between 1 and 2), and fingerprints must agree across machines
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")


DERIVED = {"manifest.json", "COMPLETE"}  # sha256 of the other files (state.json names the run's folder)


def old_key_names(text: str) -> str:
    """JSON text with each renamed recipe key (``specopd.config.RENAMED``, "section.key" -> its new name) written back
    as its old name: the key's own name only, which is unique to its section (tests/test_recipe_sections.py)."""
    from specopd.config import RENAMED

    for old, new in RENAMED.items():
        text = text.replace(f'"{new.rpartition(".")[2]}":', f'"{old.rpartition(".")[2]}":')
    return text


def _text(path: Path, out: Path) -> str:
    """A text file with the run's folder (a random temporary name) written as <out> and the recipe's renamed keys
    under their old names."""
    return old_key_names(path.read_text().replace(str(out), "<out>"))


def _trainer_state(path: Path, ray: bool) -> bytes:
    """trainer_state.pt as the bytes of its values in a fixed order, read as a resume reads it
    (``read_trainer_state``: weights_only, numpy's RNG state as numpy's tuple, whichever form the file stores).
    Ray: without the worker actor's global torch RNG state, which starts from a random seed in every actor process
    (training draws from seeded generators only: the weights and optimizer state do not depend on it)."""
    import torch

    from specopd.runs.checkpoint import read_trainer_state

    sd = read_trainer_state(str(path))
    if ray:
        sd["worker_rng"] = {k: v for k, v in (sd.get("worker_rng") or {}).items() if k != "torch"}
    parts = []

    def walk(x, key):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{key}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{key}[{i}]")
        elif torch.is_tensor(x):
            raw = x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            parts.append(f"{key}:{x.dtype}:{tuple(x.shape)}".encode() + raw)
        else:
            parts.append(f"{key}={x!r}".encode())

    walk(sd, "")
    return b"".join(parts)


def fingerprint(out, ray: bool = False):
    h = hashlib.sha256()
    for f in sorted((out / "checkpoints").rglob("*")):
        if f.is_file() and f.name not in DERIVED:
            h.update(str(f.relative_to(out)).encode())
            if f.name == "trainer_state.pt":
                h.update(_trainer_state(f, ray))
            else:
                h.update(_text(f, out).encode() if f.suffix == ".json" else f.read_bytes())
    for line in _text(out / "metrics.jsonl", out).splitlines():
        h.update(json.dumps(_strip(json.loads(line)), sort_keys=True).encode())
    h.update(json.dumps(_strip(json.loads(_text(out / "train_summary.json", out))), sort_keys=True).encode())
    return h.hexdigest()[:16]


def check_kinds():
    """Exit naming the drafter kinds that no run trains: a new kind needs a run in RUNS."""
    from specopd.config import load_recipe
    from specopd.drafters.build import DRAFTERS

    kinds = {o.split("=", 1)[1] for *_, overrides in RUNS for o in overrides if o.startswith("drafter.kind=")}
    kinds |= {load_recipe(str(ROOT / "recipes" / f"{r}.yaml")).drafter.kind for _, r, _, ov in RUNS if not ov}
    if set(DRAFTERS) - kinds:
        sys.exit(f"no fingerprint run trains drafter kind(s) {sorted(set(DRAFTERS) - kinds)}: add them to RUNS")


def main():
    check_kinds()
    with tempfile.TemporaryDirectory() as tmp:
        for label, recipe, backends, overrides in RUNS:
            for backend in backends:
                be = [f"runtime.backend={backend}", *overrides]
                straight = Path(tmp) / f"{label}-{backend}-straight"
                train(recipe, straight, *be)
                resumed = Path(tmp) / f"{label}-{backend}-resumed"
                train(recipe, resumed, *be, "trainer.max_steps=20")
                train(recipe, resumed, *be)
                ray = backend == "ray"
                print(f"{label:14s} {backend:5s} straight {fingerprint(straight, ray)}  resumed "
                      f"{fingerprint(resumed, ray)}", flush=True)


if __name__ == "__main__":
    main()
