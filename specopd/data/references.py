"""Reference data: prompts + target-regenerated responses, as token ids with a loss mask over the response.

``specopd prepare data`` writes ``<out>/data.jsonl`` (one record a line, appended as generation goes, so an
interrupted run resumes where it stopped) and ``<out>/meta.json`` (the settings; a resumed run must match them).
Record: ``{"id", "split": "train" | "heldout", "input_ids": [prompt + response], "response_start": n,
"prompt_len": n, "finish": "eos" | "length"}``; the loss covers ``input_ids[response_start:]``.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import sys
from typing import Optional

import torch

from specopd.errors import (TOO_DEEP, BadInputError, MissingPackageError, lone_surrogate, open_fd,
                            read_text_lines)

DATA_FILE = "data.jsonl"
META_FILE = "meta.json"
SPLITS = ("train", "heldout", "all")


# ---------------------------------------------------------------------------------------------- prompts
def read_prompts(path: str, limit: Optional[int] = None, vocab_size: Optional[int] = None,
                 stats: Optional[dict] = None) -> list:
    """A prompts file -> list of (id, messages). Two formats, told apart by the first non-empty line:

    - JSONL (that line is a JSON object): one ``{"prompt": str}`` or ``{"messages": [{"role", "content"}, ...]}``
      a line, optional "id"; a trailing assistant message is dropped (the target answers it). With ``vocab_size``
      a record may give token ids instead, ``{"input_ids": [int, ...]}`` (no chat template: for a target without
      a tokenizer): that prompt is (id, [int]).
    - plain text (anything else): every non-empty line is one user prompt, id ``line<N>``.

    A file that is one JSON array of such objects (pretty-printed, ``[`` on its first line) is read as those
    records, with a note; a byte-order mark is read as nothing.

    Args:
        path: the prompts file.
        limit: read only the first ``limit`` prompts (the rest of the file is counted, not parsed); None: all.
        vocab_size: the target's vocabulary, with which token-id records are accepted (None: text only).
        stats: filled with ``total``, the prompts in the file.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompts file {path!r} " + ("is a folder; give a JSONL or text file"
                                                            if os.path.isdir(path) else "does not exist"))
    st = stats if stats is not None else {}
    lines = ((ln, line.rstrip("\r\n")) for ln, line in read_text_lines(path, "prompts file") if line.strip())
    first = next(lines, None)
    if first is None:
        raise BadInputError(f"prompts file {path!r} holds no prompts (empty file?)")
    if first[1].lstrip().startswith("["):  # one JSON array, not one record a line
        text = "\n".join(t for _, t in [first, *lines])
        try:
            arr = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadInputError(f"{path}:{e.lineno}: the file starts with '[' but is not a JSON array ({e.msg}); "
                                f"give JSONL (one JSON object a line), a JSON array of objects, or plain text") from None
        except RecursionError:
            raise BadInputError(f"prompts file {path}: {TOO_DEEP}; give one JSON object a prompt") from None
        if not isinstance(arr, list) or not arr:
            raise BadInputError(f"prompts file {path!r} holds an empty JSON array; nothing to answer")
        print(f"[specopd] prompts file {path} holds one JSON array, not one object a line: read as {len(arr)} "
              f"records", file=sys.stderr, flush=True)
        st["total"] = len(arr)
        records = list(enumerate(arr[:limit], 1))
    else:
        taken = [first, *itertools.islice(lines, None if limit is None else max(0, limit - 1))]
        st["total"] = len(taken) if limit is None or len(taken) < limit else _nonempty_lines(path)
        if not first[1].lstrip().startswith("{"):
            return [(f"line{ln}", [{"role": "user", "content": text}]) for ln, text in taken]
        records = [(ln, _json_line(path, ln, line)) for ln, line in taken]
    out = []
    for ln, rec in records:
        prompt = _prompt(path, ln, rec, vocab_size)  # checks rec first
        out.append((str(rec.get("id", f"line{ln}")), prompt))
    ids = [i for i, _ in out]
    if len(set(ids)) != len(ids):
        raise BadInputError(f"prompts file {path!r} repeats ids; ids must be unique (resuming skips finished ids)")
    return out


def _nonempty_lines(path: str) -> int:
    """The prompts of a JSONL / text prompts file, counted without decoding or parsing them."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _json_line(path: str, ln: int, line: str):
    """One line of a JSONL prompts file, parsed; ``BadInputError`` naming ``path:ln`` when it cannot be."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise BadInputError(f"{path}:{ln}: not valid JSON ({e.msg}); a JSONL prompts file needs one JSON object a "
                            f"line (or give plain text, one prompt a line, with no line starting with '{{')") from None
    except RecursionError:
        raise BadInputError(f"{path}:{ln}: {TOO_DEEP}; a prompt is one JSON object") from None


def _prompt(path: str, ln: int, rec, vocab_size: Optional[int]):
    """One JSONL prompt record -> its messages (or token ids, see ``read_prompts``); ``BadInputError`` naming
    ``path:ln`` for a bad one."""
    if isinstance(rec, dict) and "input_ids" in rec:
        if vocab_size is None:
            raise BadInputError(f"{path}:{ln}: a prompt given as token ids (input_ids) is read by `specopd eval "
                                f"--prompts` only; give text here ('prompt' or 'messages')")
        bad = token_ids_problem(rec["input_ids"], vocab_size)
        if bad is None and not rec["input_ids"]:
            bad = "input_ids is empty"
        if bad is not None:
            raise BadInputError(f"{path}:{ln}: {bad}; give the prompt's token ids in the target's vocabulary")
        return list(rec["input_ids"])
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        msgs = [{"role": "user", "content": rec["prompt"]}]
    elif isinstance(rec, dict) and isinstance(rec.get("messages"), list) and rec["messages"]:
        msgs = [dict(m) if isinstance(m, dict) else {} for m in rec["messages"]]
        if any(not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str) for m in msgs):
            raise BadInputError(f"{path}:{ln}: every message needs string 'role' and 'content'")
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            raise BadInputError(f"{path}:{ln}: 'messages' holds only assistant turns; nothing to answer")
    else:
        raise BadInputError(f"{path}:{ln}: expected {{\"prompt\": str}} or {{\"messages\": [...]}}"
                            + (" or {\"input_ids\": [...]}" if vocab_size is not None else "") + "; got keys "
                            f"{sorted(rec) if isinstance(rec, dict) else type(rec).__name__}")
    for what, text in [("'id'", rec.get("id"))] + [(f"message {k}'s content", m["content"]) for k, m in
                                                   enumerate(msgs)]:
        bad = lone_surrogate(text) if isinstance(text, str) else None
        if bad is not None:
            raise BadInputError(f"{path}:{ln}: {what} holds {bad}")
    return msgs


def token_ids_problem(ids, vocab_size: Optional[int]) -> Optional[str]:
    """What is wrong with a record's input_ids (None when they are valid token ids)."""
    if not isinstance(ids, list):
        return f"input_ids is a {type(ids).__name__}, not a list of token ids"
    for j, x in enumerate(ids):
        if type(x) is not int:  # noqa: E721  (bool and 3.0 / 3.7 are not token ids)
            return f"input_ids[{j}] = {json.dumps(x)} is not an integer token id"
        if x < 0:
            return f"input_ids[{j}] = {x} is negative"
        if vocab_size is not None and x >= vocab_size:
            return (f"input_ids[{j}] = {x}: token id {x} >= target vocab {vocab_size} (data prepared with another "
                    f"tokenizer?)")
    return None


def chitchat_data() -> dict:
    """chitchat-dataset's conversations (id -> {"messages": [[{"text": ...}, ...] per turn], ...})."""
    try:
        import chitchat_dataset  # optional data package
    except ImportError:
        raise MissingPackageError("the chat text comes from the PyPI package chitchat-dataset; run "
                                  "`pip install --no-deps chitchat-dataset`, or pass --prompts FILE.jsonl") from None
    with open(os.path.join(os.path.dirname(chitchat_dataset.__file__), "dataset.json")) as f:
        return json.load(f)


def chitchat_prompts() -> list:
    """First user turn of every chitchat-dataset conversation -> list of (conversation id, messages)."""
    out = []
    for cid, conv in chitchat_data().items():
        msgs = conv.get("messages") or []
        text = "\n".join(u["text"] for u in msgs[0] if u.get("text")).strip() if msgs else ""
        if text:
            out.append((cid, [{"role": "user", "content": text}]))
    return out


def split_of(prompt_id: str, seed: int, heldout_fraction: float) -> str:
    """Train / held-out, fixed by (seed, id) alone: independent of order, --num and resumption."""
    return "heldout" if random.Random(f"{seed}:{prompt_id}").random() < heldout_fraction else "train"


# ---------------------------------------------------------------------------------------------- shard I/O
def read_records(path: str) -> list:
    """All complete records of a data.jsonl (a torn last line, from a killed run, is ignored); a line that is not
    JSON is a ``BadInputError`` naming file:line."""
    recs = []
    if not os.path.isfile(path):
        return recs
    for ln, line in read_text_lines(path, "reference data"):  # a byte-order mark is read as nothing
        if not line.endswith("\n"):
            break  # torn write
        if line.strip():
            try:
                recs.append(json.loads(line))
            except (json.JSONDecodeError, RecursionError) as e:
                why = TOO_DEEP if isinstance(e, RecursionError) else f"not valid JSON ({e.msg})"
                raise BadInputError(f"{path}:{ln}: {why}; a data.jsonl holds one JSON record a line (`specopd "
                                    f"prepare data` writes it; prepare it again)") from None
    return recs


def repair_tail(path: str) -> None:
    """Cut a torn last line so that appending continues on a line boundary."""
    if not os.path.isfile(path):
        return
    with os.fdopen(open_fd(path, os.O_RDWR), "rb+") as f:  # never through a link (it would cut another file)
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def append_record(f, rec: dict) -> None:
    f.write(json.dumps(rec) + "\n")
    f.flush()
    os.fsync(f.fileno())


def _data_path(path: str) -> str:
    if os.path.isdir(path):
        p = os.path.join(path, DATA_FILE)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{path!r} has no {DATA_FILE}; run `specopd prepare data --out {path}` first")
        return p
    if os.path.isfile(path):
        return path
    raise FileNotFoundError(f"reference data {path!r} does not exist; run `specopd prepare data --out DIR` first")


def load_references(path: str, split: str = "train", max_len: Optional[int] = None) -> list:
    """Prepared references -> list of ``{"input_ids": LongTensor [T], "response_start": int, "id": str}``.

    path: the ``--out`` folder (or its data.jsonl); split: train | heldout | all; max_len cuts sequences to
    that many tokens (records whose response would be empty after the cut are dropped).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    out = []
    for r in read_records(_data_path(path)):
        if split != "all" and r.get("split", "train") != split:
            continue
        ids = r["input_ids"][:max_len] if max_len else r["input_ids"]
        start = int(r.get("response_start", r.get("prompt_len", 0)))
        if start >= len(ids):
            continue
        out.append({"input_ids": torch.tensor(ids, dtype=torch.long), "response_start": start,
                    "id": str(r.get("id", len(out)))})
    return out


def heldout_prompts(path: str, num: Optional[int] = None) -> list:
    """Prompt ids [T] (the part before the response) of the held-out references."""
    refs = load_references(path, "heldout")
    if not refs:
        raise ValueError(f"{path!r} has no held-out references (prepare data with --heldout-fraction > 0)")
    return [r["input_ids"][: r["response_start"]] for r in refs[:num]]
