"""What ``specopd follow`` watches: the policy versions an RL trainer saves (a folder per version, taken once
complete) and the rollouts it appends (one JSONL file or a folder of them, read line by line as lines complete).
The rules: specopd/follow/DESIGN.md ("A complete policy folder", "Rollouts").
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Optional

from specopd.errors import TOO_DEEP, BadInputError

VERSION_NAME = re.compile(r"^(?:[A-Za-z][A-Za-z_-]*)?(\d+)$")  # letters, then the version: v3, step-30, 30


def version_of(name: str) -> Optional[int]:
    """The policy version a folder name gives: letters then the number (``v3``, ``step-30``, ``global_step_30``,
    ``30``); None for other names (a writer's temporary folder such as ``v3.tmp-123``, ``.v3``, ``latest``)."""
    m = VERSION_NAME.match(name)
    return int(m.group(1)) if m else None


def safetensors_problem(path: str) -> Optional[str]:
    """What makes a .safetensors file incomplete (None: complete): its header must be readable JSON and the file
    exactly as long as the header says (8 + header + the end of the last tensor's bytes)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{os.path.basename(path)} has no header yet ({size} bytes)"
            n = struct.unpack("<Q", head)[0]
            if n > size - 8:
                return f"{os.path.basename(path)} is shorter than its header ({size} bytes)"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"{os.path.basename(path)} cannot be read ({e})"
    if not isinstance(header, dict):
        return f"{os.path.basename(path)}'s header is not a JSON object"
    ends = [int(v["data_offsets"][1]) for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    want = 8 + n + max(ends, default=0)
    if size != want:
        return f"{os.path.basename(path)} has {size} bytes, its header says {want}"
    return None


def policy_problem(folder: str, marker: str = "") -> Optional[str]:
    """Why ``folder`` is not (yet) a complete policy version, None when it is: config.json parses; the weights are
    ``model.safetensors`` complete by its header, or ``model.safetensors.index.json`` parses and every shard it
    names is there and complete; ``marker`` (``follow.complete_marker``), when given, exists."""
    if marker and not os.path.isfile(os.path.join(folder, marker)):
        return f"no {marker} marker yet"
    try:
        with open(os.path.join(folder, "config.json")) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"config.json is missing or incomplete ({type(e).__name__})"
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"model.safetensors.index.json is incomplete ({type(e).__name__})"
        for s in shards:
            why = safetensors_problem(os.path.join(folder, s))
            if why is not None:
                return why
        return None if shards else "model.safetensors.index.json names no shard"
    if os.path.isfile(single):
        return safetensors_problem(single)
    return "no model.safetensors or model.safetensors.index.json yet"


def complete_policies(root: str, marker: str = "") -> list:
    """[(version, folder)] of the complete policy folders in ``root``, oldest version first (``policy_problem``);
    two folders of one version: BadInputError naming both."""
    if not os.path.isdir(root):
        raise BadInputError(f"follow.policies={root!r} is not a folder; give the folder the RL trainer saves its policy "
                            f"versions in")
    out: dict = {}
    for name in sorted(os.listdir(root)):
        v, path = version_of(name), os.path.join(root, name)
        if v is None or not os.path.isdir(path) or policy_problem(path, marker) is not None:
            continue
        if v in out:
            raise BadInputError(f"follow.policies: {out[v]} and {path} are both policy version {v}; keep one")
        out[v] = path
    return sorted(out.items())


class RolloutReader:
    """Reads the complete lines appended to ``follow.rollouts`` (a JSONL file, or a folder of ``*.jsonl`` read in
    name order): ``poll`` returns the new records with their position (file, byte offset, line), ``consumed``
    marks records taken, and ``state`` / the ``state`` argument save and restore what was read and not yet
    consumed, so that a resumed run reads each line once."""

    def __init__(self, path: str, state: Optional[dict] = None):
        self.path = path
        self.files: dict = {}  # name -> {"read_to": byte offset, "lines": lines read, "pending": [[offset, line]]}
        self.restored: list = []  # records read again from a saved state's pending positions (the next poll's)
        for name, st in (state or {}).items():
            self.files[name] = {"read_to": int(st["read_to"]), "lines": int(st["lines"]), "pending": []}
            for off, ln in st["pending"]:
                self.restored.append(self._record(name, int(off), int(ln), self._line_at(name, int(off))))

    def _names(self) -> list:
        if os.path.isdir(self.path):
            return sorted(n for n in os.listdir(self.path) if n.endswith(".jsonl") and not n.startswith("."))
        if os.path.isfile(self.path):
            return [""]
        return []

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name) if name else self.path

    def _line_at(self, name: str, off: int) -> bytes:
        with open(self._file(name), "rb") as f:
            f.seek(off)
            return f.readline()

    def _record(self, name: str, off: int, ln: int, raw: bytes) -> dict:
        where = f"{self._file(name)}:{ln}"
        try:
            rec = json.loads(raw)
        except RecursionError:
            raise BadInputError(f"{where}: {TOO_DEEP}") from None
        except ValueError as e:
            raise BadInputError(f"{where}: not a JSON record ({e}); fix the line (records are never skipped)") from None
        if not isinstance(rec, dict) or type(rec.get("policy_version")) is not int:  # noqa: E721
            raise BadInputError(f"{where}: a rollout is a JSON object with an integer policy_version (the policy "
                                f"version that sampled it); got {json.dumps(rec)[:120]}")
        self.files.setdefault(name, {"read_to": 0, "lines": 0, "pending": []})["pending"].append([off, ln])
        return {"where": where, "pos": (name, off), "record": rec}

    def poll(self) -> list:
        """The rollouts whose lines completed since the last call (a line without its newline waits), in file and
        line order; each {"where": "file:line", "pos", "record"}."""
        out, self.restored = self.restored, []
        for name in self._names():
            st = self.files.setdefault(name, {"read_to": 0, "lines": 0, "pending": []})
            if os.path.getsize(self._file(name)) < st["read_to"]:
                raise BadInputError(f"{self._file(name)} is shorter than the {st['read_to']} bytes already read: "
                                    f"rollout files are only appended to; restore it, or start a new follow run "
                                    f"(another trainer.output_dir)")
            with open(self._file(name), "rb") as f:
                f.seek(st["read_to"])
                data = f.read()
            end = data.rfind(b"\n") + 1
            off = st["read_to"]
            for raw in data[:end].splitlines(keepends=True):
                st["lines"] += 1
                if raw.strip():
                    out.append(self._record(name, off, st["lines"], raw))
                off += len(raw)
            st["read_to"] = off
        return out

    def consumed(self, items: list) -> None:
        """``items`` (as ``poll`` gave them) are taken: a saved state no longer lists them."""
        done = {tuple(i["pos"]) for i in items}
        for name, st in self.files.items():
            st["pending"] = [p for p in st["pending"] if (name, p[0]) not in done]

    def state(self) -> dict:
        """What was read (per file: bytes, lines) and what of it is not consumed yet: JSON."""
        return {n: {"read_to": st["read_to"], "lines": st["lines"], "pending": [list(p) for p in st["pending"]]}
                for n, st in self.files.items()}
