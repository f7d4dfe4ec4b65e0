"""Checkpoints: ``<output_dir>/checkpoints/step-<N>/`` (N = completed optimizer steps), written atomically with a
manifest of sizes and sha256 that a resume verifies; a damaged one is moved aside, never deleted.
Contents, atomicity and integrity: specopd/runs/DESIGN.md ("Checkpoint folders").
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
from typing import Optional

import numpy as np
import torch

from specopd.drafters.layout import MANIFEST, MARKER, load_safetensors, save_safetensors, sha256_file, verify_folder
from specopd.errors import UserError, open_write, own_dir, remove_path, replacing
from specopd.runs.lock import pid_alive

_STEP = re.compile(r"^step-(\d+)$")
_TMP = re.compile(r"^\.(tmp|old|prune)-step-(\d+)-(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be written, or is incomplete / damaged; the message names it and the fix."""


class ForeignObjectsError(CheckpointError):
    """A trainer state that holds objects a checkpoint of ours never holds (code could run in them): not loaded,
    and not taken for damage either (a resume stops rather than going on from an older step)."""


def ckpt_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def controller_rng() -> dict:
    """The controller's RNG states as plain data (numpy's as ``numpy_rng_data``): a checkpoint stores them and
    loads them with ``weights_only=True``."""
    return {"python": random.getstate(), "numpy": numpy_rng_data(np.random.get_state()),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def numpy_rng_data(st: tuple) -> dict:
    """``np.random.get_state()`` (the MT19937 key is an ndarray, which pickles as numpy objects) as tensors and
    plain values."""
    name, key, pos, has_gauss, gauss = st
    return {"bit_generator": str(name), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}


def numpy_rng_state(data) -> tuple:
    """``numpy_rng_data`` back to the tuple ``np.random.set_state`` takes (an older checkpoint's tuple as is)."""
    if isinstance(data, dict):
        return (data["bit_generator"], data["key"].numpy().astype(np.uint32), data["pos"], data["has_gauss"],
                data["cached_gaussian"])
    return data


def seed_controller_rng(seed: int) -> None:
    """A fresh run starts the controller's python / numpy / torch RNGs from ``seed`` (they are saved in every
    checkpoint), so the same run writes byte-identical checkpoints in any process."""
    random.seed(int(seed))
    np.random.seed(int(seed) % 2 ** 32)
    torch.manual_seed(int(seed))


def set_controller_rng(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(numpy_rng_state(st["numpy"]))
    torch.set_rng_state(st["torch"])
    if st.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# ---------------------------------------------------------------------------------------------- files
def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems do not allow fsync on a directory
        pass


def _write_json(path: str, obj) -> None:
    with open_write(path) as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _manifest(folder: str) -> dict:
    files = {}
    for name in sorted(os.listdir(folder)):
        if name in (MANIFEST, MARKER):
            continue
        p = os.path.join(folder, name)
        files[name] = {"bytes": os.path.getsize(p), "sha256": sha256_file(p)}
    return files


# ---------------------------------------------------------------------------------------------- save
def save_checkpoint(output_dir: str, step: int, worker_state: dict, state: dict, keep_last: int = 2) -> str:
    """Write step-<step> atomically; update ``latest``; prune.

    Args:
        output_dir: the run folder.
        step: completed optimizer steps.
        worker_state: ``Worker.state_dict()``.
        state: JSON-able (data position, metrics).
        keep_last: prune to this many checkpoints.

    Returns:
        the folder.

    Raises ``CheckpointError`` (the cause chained) when the folder cannot be written; nothing of the earlier
    checkpoints is touched then, and the tmp folder is removed.
    """
    root = ckpt_root(output_dir)
    name = f"step-{int(step)}"

    def fill(tmp: str) -> None:
        os.mkdir(tmp)
        _write_files(tmp, step, worker_state, state)

    try:
        final = publish_folder(root, name, fill)
    except Exception as e:
        try:
            prev = find_latest(output_dir)
        except OSError:
            prev = None
        hint = ("the disk is full: free space" if isinstance(e, OSError) and e.errno == errno.ENOSPC
                else "fix the cause")
        raise CheckpointError(
            f"checkpoint {name} could not be written to {root}: {type(e).__name__}: {e}. The previous checkpoint "
            f"({prev or 'none'}) is intact; {hint}, then rerun the same command (trainer.resume=auto continues from "
            f"{'it' if prev else 'the start'})") from e
    prune(output_dir, keep_last)
    return final


def _write_files(tmp: str, step: int, worker_state: dict, state: dict) -> None:
    save_safetensors({k: v.contiguous() for k, v in worker_state["drafter"].items()},
                     os.path.join(tmp, "model.safetensors"),
                     metadata={"format": "pt", "kind": str(worker_state.get("drafter_kind", ""))})
    _fsync_file(os.path.join(tmp, "model.safetensors"))
    _write_json(os.path.join(tmp, "config.json"), worker_state["drafter_config"])
    with open_write(os.path.join(tmp, "trainer_state.pt"), "wb") as f:
        torch.save({"optimizer": worker_state.get("optimizer"), "scheduler": worker_state.get("scheduler"),
                    "worker_rng": worker_state.get("rng"), "controller_rng": controller_rng()}, f)
        f.flush()
        os.fsync(f.fileno())
    _write_json(os.path.join(tmp, "state.json"), {"step": int(step), **state})
    _write_json(os.path.join(tmp, MANIFEST), {"step": int(step), "files": _manifest(tmp)})
    _write_json(os.path.join(tmp, MARKER), {"step": int(step),
                                            "manifest_sha256": sha256_file(os.path.join(tmp, MANIFEST))})


# ---------------------------------------------------------------------------------------------- find
def complete_checkpoints(output_dir: str) -> list:
    """[(step, folder)] of a run's checkpoints with the completion marker, oldest first (not verified)."""
    return checkpoints_in(ckpt_root(output_dir))


def checkpoints_in(root: str) -> list:
    """[(step, folder)] of the step-N folders with the completion marker directly in ``root`` (a run's
    checkpoints/, or copies kept elsewhere), oldest first (not verified)."""
    if not os.path.isdir(root):
        return []
    out = []
    for n in os.listdir(root):
        m = _STEP.match(n)
        d = os.path.join(root, n)
        if m and os.path.isfile(os.path.join(d, MARKER)) and os.path.isfile(os.path.join(d, "state.json")):
            out.append((int(m.group(1)), d))
    return sorted(out)


def verify(path: str, checksums: bool = True) -> Optional[str]:
    """None when ``path`` is a complete, undamaged checkpoint; else what is wrong (one line).

    Checks the marker, the manifest (its own sha256 recorded in the marker; a manifest missing where the marker
    records one is damage), every listed file's size and, with ``checksums``, its sha256
    (``specopd.drafters.layout.verify_folder``). Checkpoints written before manifests existed (a marker without a
    manifest checksum) pass if their files are present (there is nothing to compare against)."""
    if not os.path.isdir(path):
        return "no such folder"
    if not os.path.isfile(os.path.join(path, MARKER)):
        return f"no {MARKER} marker (it was not fully written)"
    why = verify_folder(path, checksums=checksums)
    if why is not None:
        return why
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        missing = [f for f in ("model.safetensors", "config.json", "trainer_state.pt", "state.json")
                   if not os.path.isfile(os.path.join(path, f))]
        return f"missing {', '.join(missing)}" if missing else None
    return None


def newest_good(output_dir: str, below: Optional[int] = None) -> Optional[str]:
    """The newest complete checkpoint of a run that verifies with checksums (steps < ``below`` when given)."""
    for step, d in reversed(complete_checkpoints(output_dir)):
        if (below is None or step < below) and verify(d) is None:
            return d
    return None


def publish_folder(root: str, name: str, fill) -> str:
    """``<root>/<name>`` written whole, then ``<root>/latest`` = name: ``fill(tmp)`` builds the folder at
    ``<root>/.tmp-<name>-<pid>``, which is renamed into place (an earlier folder of that name is moved aside first,
    then dropped), then ``latest`` is replaced in one rename. Readers see no folder or a whole one, and ``latest``
    never names a half-written folder; the tmp is removed when anything fails. Checkpoints and the follow job's
    exports are published this way.

    Args:
        root: the folder holding the published folders and ``latest`` (made if missing; never a link).
        name: the folder's name.
        fill: ``fill(tmp)`` creates and fills the folder at the path ``tmp``.

    Returns:
        ``<root>/<name>``.
    """
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
    own_dir(root)
    remove_path(tmp)  # a killed save's leftover (or a planted link: dropped, never followed)
    try:
        fill(tmp)
        _fsync_dir(tmp)
        if os.path.isdir(final):  # published again under the same name: move the old one aside first, then drop it
            old = os.path.join(root, f".old-{name}-{os.getpid()}")
            remove_path(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        with replacing(os.path.join(root, "latest"), fsync=True, tmp=os.path.join(root, f".latest-{os.getpid()}")) as f:
            f.write(name + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def find_latest(output_dir: str) -> Optional[str]:
    """The newest complete checkpoint whose files have the sizes in its manifest (no checksums: cheap)."""
    for _, d in reversed(complete_checkpoints(output_dir)):
        if verify(d, checksums=False) is None:
            return d
    return None


def quarantine(path: str) -> str:
    """Move a damaged checkpoint aside (``step-<N>.damaged``, numbered if taken); returns the new path.
    It no longer counts as a checkpoint, and nothing of it is deleted."""
    dst = path.rstrip("/") + ".damaged"
    k = 1
    while os.path.exists(dst):
        k += 1
        dst = path.rstrip("/") + f".damaged-{k}"
    os.rename(path, dst)
    return dst


def recover(output_dir: str) -> list:
    """Tidy what a killed save left behind; returns notes of what was done.

    ``.old-step-N-<pid>`` (a re-save of step N killed between its two renames) is renamed back when
    ``step-N`` is missing; tmp, prune and latest leftovers of dead processes are removed."""
    root = ckpt_root(output_dir)
    if not os.path.isdir(root):
        return []
    notes = []
    for n in sorted(os.listdir(root)):
        p = os.path.join(root, n)
        if n.startswith(".latest-") and n[len(".latest-"):].isdigit() and not pid_alive(int(n[len(".latest-"):])):
            os.remove(p)
            continue
        m = _TMP.match(n)
        if not m or pid_alive(int(m.group(3))):
            continue
        kind, step = m.group(1), m.group(2)
        final = os.path.join(root, f"step-{step}")
        if kind == "old" and not os.path.isdir(final):
            os.rename(p, final)
            notes.append(f"restored step-{step} (a re-save of it was interrupted)")
        else:
            shutil.rmtree(p, ignore_errors=True)
    return notes


def prune(output_dir: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; older ones are renamed, then deleted."""
    ck = complete_checkpoints(output_dir)
    for step, d in ck[:-keep_last] if keep_last > 0 else []:
        gone = os.path.join(ckpt_root(output_dir), f".prune-step-{step}-{os.getpid()}")
        try:
            os.rename(d, gone)
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)


def move_aside(output_dir: str, stamp: Optional[int] = None) -> Optional[str]:
    """A fresh run in a used folder: ``checkpoints/`` -> ``checkpoints.before-<stamp>/`` (kept, not deleted)."""
    root = ckpt_root(output_dir)
    if not os.path.isdir(root) or not os.listdir(root):
        return None
    dst = f"{root}.before-{stamp or int(time.time())}"
    os.rename(root, dst)
    return dst


# ---------------------------------------------------------------------------------------------- load
def read_state(path: str) -> dict:
    """state.json of a checkpoint (step, data position, metrics, recipe); CheckpointError if unreadable."""
    try:
        with open(os.path.join(path, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: state.json is unreadable ({e})") from None


# An older checkpoint's numpy RNG state (a tuple holding a uint32 ndarray) pickles as these numpy globals: the
# array, its dtype (and uint32's dtype class) and the array's rebuilder under either of numpy's module names, the
# only objects beyond tensors and plain data a checkpoint of ours ever held. (The rebuilder is what an ndarray
# reduces to: no private numpy name is read.)
_REBUILD = np.zeros(0, np.uint32).__reduce__()[0]
_NUMPY_RNG_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32))] + [
    (_REBUILD, f"{m}.multiarray.{_REBUILD.__name__}") for m in ("numpy.core", "numpy._core")]


def read_trainer_state(path: str, map_location="cpu") -> dict:
    """``trainer_state.pt`` (optimizer, scheduler, worker and controller RNGs), loaded with ``weights_only=True``:
    tensors and plain data only, so a planted pickle runs nothing. An older checkpoint's numpy RNG state loads
    with exactly the numpy globals it needs allowed; any other object is a ``ForeignObjectsError`` naming the file
    (a checkpoint never holds one, and it could run code: it is not loaded). numpy's state comes back as the
    tuple ``np.random.set_state`` takes."""
    try:
        with torch.serialization.safe_globals(_NUMPY_RNG_GLOBALS):
            ts = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001  (unpickling errors of a damaged file have no common class)
        try:
            with torch.serialization.safe_globals(_NUMPY_RNG_GLOBALS):
                foreign = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception:  # noqa: BLE001  (a file that cannot even be disassembled is damaged)
            foreign = []
        if foreign:
            raise ForeignObjectsError(
                f"{path} holds objects a checkpoint never holds ({', '.join(foreign[:5])}): not loaded, as loading "
                f"them could run code. Someone else's file, not one specopd wrote: resume from a checkpoint you "
                f"trust (move that step folder away), or start afresh with trainer.resume=none") from None
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(ts, dict) or any(k not in ts for k in ("optimizer", "scheduler", "worker_rng")):
        raise CheckpointError(f"{path} is not a trainer state (a dict of optimizer, scheduler and worker_rng): give "
                              f"a checkpoint written by specopd")
    if isinstance(ts.get("controller_rng"), dict) and "numpy" in ts["controller_rng"]:
        ts["controller_rng"]["numpy"] = numpy_rng_state(ts["controller_rng"]["numpy"])
    return ts


def load_checkpoint(path: str, map_location="cpu", checksums: bool = True) -> dict:
    """-> {"worker_state": (for Worker.load_state_dict), "state": state.json, "controller_rng": ...}.

    Verifies the folder first; raises ``CheckpointError`` naming what is wrong when it is incomplete,
    damaged, cannot be read or holds objects other than tensors and plain data (``read_trainer_state``)."""
    why = verify(path, checksums=checksums)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} cannot be used: {why}")
    state = read_state(path)
    ts = read_trainer_state(os.path.join(path, "trainer_state.pt"), map_location)
    try:
        drafter = load_safetensors(os.path.join(path, "model.safetensors"))
    except Exception as e:  # noqa: BLE001  (SafetensorError, ...)
        raise CheckpointError(f"checkpoint {path} cannot be read: {type(e).__name__}: {e}") from None
    ws = {"drafter": drafter, "optimizer": ts["optimizer"], "scheduler": ts["scheduler"], "rng": ts["worker_rng"],
          "steps_done": int(state["step"])}
    return {"worker_state": ws, "state": state, "controller_rng": ts.get("controller_rng"), "path": path}
