"""What a run depends on besides its recipe, fingerprinted: the data (prepared references, or a conversations file
with the tokenizer that tokenises it) and the target's weights (sha256, cached by path, size, mtime, inode and
ctime: an edit in place that keeps size and mtime, ``touch -r``, still changes the ctime); a resume whose inputs
changed is refused. Design: specopd/train/DESIGN.md ("Run inputs").
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Optional

from specopd.data.packaged import conversations_file
from specopd.drafters.layout import sha256_file
from specopd.errors import replacing

CACHE_FILE = ".fingerprints.json"
_WEIGHTS = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def _stat_key(path: str) -> list:
    """What a cached hash is valid for: size and mtime, which a user can set back (``touch -r``), and inode and
    ctime, which no user can (an edit or a replacement changes them)."""
    st = os.stat(path)
    return [int(st.st_size), int(st.st_mtime_ns), int(st.st_ino), int(st.st_ctime_ns)]


class _Cache:
    def __init__(self, output_dir: Optional[str]):
        self.path = os.path.join(output_dir, CACHE_FILE) if output_dir else None
        self.data, self.dirty = {}, False
        if self.path and os.path.isfile(self.path):
            try:
                with open(self.path) as f:
                    self.data = json.load(f)
            except (OSError, ValueError):
                self.data = {}

    def get(self, kind: str, path: str, compute):
        key = f"{kind}:{os.path.abspath(path)}"
        stamp = _stat_key(path)
        hit = self.data.get(key)
        if isinstance(hit, dict) and hit.get("stat") == stamp:
            return hit["value"]
        value = compute(path)
        self.data[key] = {"stat": stamp, "value": value}
        self.dirty = True
        return value

    def save(self) -> None:
        if not (self.dirty and self.path and os.path.isdir(os.path.dirname(self.path))):
            return
        try:
            with replacing(self.path) as f:
                json.dump(self.data, f)
        except OSError:  # a cache: failing to keep it costs a re-hash, nothing else
            pass


def _records_sha256(path: str) -> dict:
    """{records, sha256} over the fields of each line the trainer uses; a line that does not parse counts as
    its raw bytes (reading the data later names it with its line)."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            n += 1
            try:
                rec = json.loads(raw)
                used = [rec["input_ids"], rec.get("response_start", rec.get("prompt_len")), rec.get("split")]
                h.update(json.dumps(used, separators=(",", ":")).encode() + b"\n")
            except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested too deeply
                h.update(b"raw:" + raw.rstrip(b"\r\n") + b"\n")
    return {"records": n, "sha256": h.hexdigest()}


def data_file(cfg) -> Optional[str]:
    """The data file of a recipe: the prepared data.jsonl or the conversations file (None for synthetic data or
    a path that is not there)."""
    d = cfg.data
    if d.source not in ("prepared", "conversations") or not d.path:
        return None
    if d.source == "conversations":
        try:
            fp = conversations_file(d.path)
        except (ImportError, FileNotFoundError):  # a packaged name whose package is missing: loading names it
            return None
    else:
        fp = os.path.join(d.path, "data.jsonl") if os.path.isdir(d.path) else d.path
    return fp if os.path.isfile(fp) else None


def _file_sha256(path: str) -> dict:
    """{records: None, sha256} of a file's bytes (a conversations file: every byte can change the tokens)."""
    return {"records": None, "sha256": sha256_file(path)}


def _tokenizer_sha256(cfg) -> Optional[str]:
    """The hash of the target's tokenizer files (what turns conversations into tokens), or None when the target
    folder is not here."""
    folder = target_folder(cfg)
    if folder is None or cfg.model.is_tiny:
        return None
    from specopd.data.formats import tokenizer_hash  # imports transformers: only for conversations data

    try:
        return tokenizer_hash(folder)
    except (ImportError, OSError):
        return None


def target_folder(cfg) -> Optional[str]:
    """The target folder whose weights are fingerprinted: the HF folder, or the tiny target built under
    trainer.output_dir (once it exists); None when it is not on this machine."""
    m = cfg.model
    folder = (os.path.join(cfg.trainer.output_dir, f"tiny-target-{m.target[len('tiny:'):]}") if m.is_tiny
              else m.target)
    return folder if os.path.isfile(os.path.join(folder, "config.json")) else None


def input_fingerprints(cfg) -> dict:
    """{"data": {path, records, sha256[, tokenizer]} | None, "target": {"files": {name: sha256}} | None} of a
    recipe. Prepared data: sha256 over the fields of each record the trainer uses; a conversations file: sha256 of
    its bytes and of the tokenizer that tokenises it."""
    cache = _Cache(cfg.trainer.output_dir if os.path.isdir(cfg.trainer.output_dir) else None)
    out = {"data": None, "target": None}
    fp = data_file(cfg)
    if fp is not None and cfg.data.source == "conversations":
        out["data"] = {"path": os.path.abspath(fp), "source": "conversations",
                       **cache.get("bytes", fp, _file_sha256), "tokenizer": _tokenizer_sha256(cfg)}
    elif fp is not None:
        out["data"] = {"path": os.path.abspath(fp), **cache.get("records", fp, _records_sha256)}
    folder = target_folder(cfg)
    if folder is not None:
        names = sorted(n for n in os.listdir(folder) if n == "config.json" or n.endswith(_WEIGHTS))
        big = sum(os.path.getsize(os.path.join(folder, n)) for n in names)
        if big > 1 << 30 and not all(f"file:{os.path.abspath(os.path.join(folder, n))}" in cache.data for n in names):
            print(f"[inputs] hashing the target's files once ({big / 1e9:.1f} GB; cached in "
                  f"{cache.path or 'memory'})", file=sys.stderr, flush=True)
        out["target"] = {"folder": os.path.abspath(folder),
                         "files": {n: cache.get("file", os.path.join(folder, n), sha256_file) for n in names}}
    cache.save()
    return out


def input_changes(old: Optional[dict], new: dict) -> list:
    """What differs between a checkpoint's ``inputs`` and the inputs of now, one string each (empty: the same).
    Parts the checkpoint did not record (older checkpoints, a target not on this machine) are not compared."""
    if not old:
        return []
    out = []
    a, b = old.get("data"), new.get("data")
    if a and b and a.get("sha256") != b.get("sha256"):
        if b.get("records") is None:  # a conversations file: its bytes
            n = f"sha256 of the file {a['sha256'][:12]} -> {b['sha256'][:12]}"
        else:
            n = (f"{b['records']} records now, {a['records']} then" if a.get("records") != b.get("records") else
                 f"the same {b['records']} records, other content or order")
            n += f"; sha256 of its records {a['sha256'][:12]} -> {b['sha256'][:12]}"
        out.append(f"the data {b['path']} changed since the checkpoint ({n})")
    if a and b and a.get("tokenizer") and b.get("tokenizer") and a["tokenizer"] != b["tokenizer"]:
        out.append(f"the target's tokenizer changed since the checkpoint, so {b['path']} gives other tokens (sha256 "
                   f"of its files {a['tokenizer'][:12]} -> {b['tokenizer'][:12]})")
    a, b = (old.get("target") or {}).get("files"), (new.get("target") or {}).get("files")
    if a and b and a != b:
        changed = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
        what = ", ".join(f"{n} ({'new' if n not in a else 'gone' if n not in b else 'other content'})"
                         for n in changed[:4])
        out.append(f"the target in {new['target']['folder']} changed since the checkpoint: {what}"
                   f"{' ...' if len(changed) > 4 else ''}")
    return out
