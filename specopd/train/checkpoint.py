"""Checkpoints: ``<output_dir>/checkpoints/step-<N>/`` (N = completed optimizer steps).

A step folder holds the drafter as ``model.safetensors`` + ``config.json`` (loadable with
``specopd.drafters.load_drafter``), ``trainer_state.pt`` (optimizer, scheduler, the worker's and the
controller's RNG states: python, numpy, torch, cuda), ``state.json`` (step, data position, metrics), and
the ``COMPLETE`` marker, written last. The folder is written as ``.tmp-step-<N>-<pid>`` and renamed when
complete; ``checkpoints/latest`` (text: the folder name) is replaced atomically (tmp file + os.replace).
Only the newest ``keep_last`` complete checkpoints are kept. ``find_latest`` returns the newest *complete*
checkpoint and ignores half-written ones (tmp folders, folders without the marker).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Optional

import torch

MARKER = "COMPLETE"
_STEP = re.compile(r"^step-(\d+)$")


def ckpt_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def controller_rng() -> dict:
    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_controller_rng(st: dict) -> None:
    import numpy as np

    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if st.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(output_dir: str, step: int, worker_state: dict, state: dict, keep_last: int = 2) -> str:
    """Write step-<step> atomically from ``worker_state`` (Worker.state_dict()) and ``state`` (JSON-able:
    data position, metrics); update ``latest``; prune to ``keep_last``. Returns the folder."""
    from safetensors.torch import save_file

    root = ckpt_root(output_dir)
    os.makedirs(root, exist_ok=True)
    name = f"step-{int(step)}"
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in worker_state["drafter"].items()},
              os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt", "kind": str(worker_state.get("drafter_kind", ""))})
    _write_json(os.path.join(tmp, "config.json"), worker_state["drafter_config"])
    torch.save({"optimizer": worker_state.get("optimizer"), "scheduler": worker_state.get("scheduler"),
                "worker_rng": worker_state.get("rng"), "controller_rng": controller_rng()},
               os.path.join(tmp, "trainer_state.pt"))
    _write_json(os.path.join(tmp, "state.json"), {"step": int(step), **state})
    _write_json(os.path.join(tmp, MARKER), {"step": int(step)})
    if os.path.isdir(final):  # re-saving the same step: move the old one aside first, then drop it
        old = os.path.join(root, f".old-{name}-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    latest_tmp = os.path.join(root, f".latest-{os.getpid()}")
    with open(latest_tmp, "w") as f:
        f.write(name + "\n")
    os.replace(latest_tmp, os.path.join(root, "latest"))
    prune(output_dir, keep_last)
    return final


def complete_checkpoints(output_dir: str) -> list:
    """[(step, folder)] of complete checkpoints, oldest first."""
    root = ckpt_root(output_dir)
    if not os.path.isdir(root):
        return []
    out = []
    for n in os.listdir(root):
        m = _STEP.match(n)
        d = os.path.join(root, n)
        if m and os.path.isfile(os.path.join(d, MARKER)) and os.path.isfile(os.path.join(d, "state.json")):
            out.append((int(m.group(1)), d))
    return sorted(out)


def find_latest(output_dir: str) -> Optional[str]:
    ck = complete_checkpoints(output_dir)
    return ck[-1][1] if ck else None


def prune(output_dir: str, keep_last: int) -> None:
    ck = complete_checkpoints(output_dir)
    for _, d in ck[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(d, ignore_errors=True)


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """-> {"worker_state": (for Worker.load_state_dict), "state": state.json, "controller_rng": ...}."""
    from safetensors.torch import load_file

    if not os.path.isfile(os.path.join(path, MARKER)):
        raise FileNotFoundError(f"{path!r} is not a complete checkpoint (no {MARKER} marker: it was not fully "
                                f"written); resume from another one, e.g. trainer.resume=auto")
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    ts = torch.load(os.path.join(path, "trainer_state.pt"), map_location=map_location, weights_only=False)
    drafter = load_file(os.path.join(path, "model.safetensors"))
    ws = {"drafter": drafter, "optimizer": ts["optimizer"], "scheduler": ts["scheduler"], "rng": ts["worker_rng"],
          "steps_done": int(state["step"])}
    return {"worker_state": ws, "state": state, "controller_rng": ts.get("controller_rng"), "path": path}
