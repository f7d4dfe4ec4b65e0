"""Conversation data in the formats users have (SpecForge, ShareGPT, OpenAI; JSONL / JSON / Parquet): read,
checked, put through the target's chat template with a loss mask on assistant turns, cached. Details:
specopd/data/DESIGN.md ("Conversations").
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Optional

import torch
from tqdm import tqdm

from specopd.data.references import split_of
from specopd.drafters.layout import sha256_file
from specopd.errors import (TOO_DEEP, UTF8_BOM, BadInputError, LinkedPathError, MissingInputError,
                            MissingPackageError, lone_surrogate, own_dir, replacing)

ROLES = {"system": "system", "user": "user", "assistant": "assistant",  # SpecForge / OpenAI
         "human": "user", "gpt": "assistant"}                           # ShareGPT
CACHE_VERSION = 3  # 3: lone surrogates and too-deep nesting are bad records; 2: an unknown "split" is bad data
BAD_LINES = ("error", "skip")
DUPLICATE_IDS = ("keep", "drop_repeats", "error")  # data.duplicate_ids
TOKENISE_BATCH = 512  # conversations a fast tokenizer encodes in one call (on every core)
SPLITS = ("train", "heldout")
FIX = "fix or remove it, or set data.bad_lines=skip to skip bad records and count them"
WHOLE_FILE_FIX = "fix the file (a .json file is one document: skipping bad records cannot read past this)"


class DataError(BadInputError):
    """A bad record in a conversations file; the message names the file, the line (or row) and the fix.
    ``skippable``: whether skipping bad records (``data.bad_lines=skip``, ``--bad-lines skip``) would get past it
    (False for a .json document that cannot be read on)."""

    def __init__(self, where: str, reason: str, msg: str, fix: Optional[str] = None, skippable: bool = True):
        fix = fix or (FIX if skippable else WHOLE_FILE_FIX)
        super().__init__(f"{where}: {msg}; {fix}")
        self.where, self.reason, self.msg, self.skippable = where, reason, msg, skippable


class _Bad(Exception):
    def __init__(self, reason: str, msg: str):
        super().__init__(msg)
        self.reason, self.msg = reason, msg


# ---------------------------------------------------------------------------------------------- raw records
def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


class _LineCounter:
    """``_line_of`` for positions that only grow: counts the newlines since the last position asked, so that
    numbering every record of a large JSON array reads the text once (counting from 0 each time is quadratic)."""

    def __init__(self, text: str):
        self.text, self.pos, self.line = text, 0, 1

    def __call__(self, pos: int) -> int:
        if pos < self.pos:
            return _line_of(self.text, pos)
        self.line += self.text.count("\n", self.pos, pos)
        self.pos = pos
        return self.line


def check_conversations_file(path: str) -> None:
    """A ``MissingInputError`` naming the fix when ``path`` is a folder or is not there."""
    if os.path.isdir(path):
        raise MissingInputError(f"conversations file {path!r} is a folder; give a .jsonl, .json or .parquet file of "
                                f"conversations (data.path, or prepare data --from)")
    if not os.path.isfile(path):
        raise MissingInputError(f"conversations file {path!r} does not exist (data.path, or prepare data --from): "
                                f"give a .jsonl, .json or .parquet file of conversations")


def _raw_records(path: str) -> list:
    """path -> [(where "file:line" | "file:row N", record | _Bad)] in file order. A UTF-8 byte-order mark is
    read as nothing; a .jsonl file that holds one (pretty-printed) JSON array is read as that array, with a note."""
    check_conversations_file(path)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        return _parquet_records(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM):]
    if ext == ".jsonl" and _one_json_array(raw):
        print(f"[data] {path} holds one JSON array (a .json document, e.g. pretty-printed), not one record a line: "
              f"read as a JSON array (name it .json to say so)", file=sys.stderr, flush=True)
        return _json_array_records(path, raw)
    if ext == ".json" or (ext != ".jsonl" and raw.lstrip()[:1] == b"["):
        return _json_array_records(path, raw)
    out = []
    for ln, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{ln}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            out.append((where, _Bad("not_utf8", f"bytes that are not UTF-8 at column {e.start + 1} "
                                                f"({line[e.start:e.start + 4]!r})")))
            continue
        try:
            out.append((where, json.loads(text)))
        except json.JSONDecodeError as e:
            out.append((where, _Bad("not_json", f"not valid JSON ({e.msg} at column {e.colno})")))
        except RecursionError:
            out.append((where, _Bad("too_deep", TOO_DEEP)))
    return out


def _one_json_array(raw: bytes) -> bool:
    """Whether a .jsonl file's text is one JSON array spread over lines (its first line alone is not JSON)."""
    if raw.lstrip()[:1] != b"[":
        return False
    first = raw.lstrip().split(b"\n", 1)[0]
    try:
        json.loads(first)
        return False  # a whole array on the first line: JSONL (whose records are then not objects)
    except ValueError:
        return True


def _json_array_records(path: str, raw: bytes) -> list:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # the whole file is one document: nothing to skip to
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}", "not_utf8",
                        f"bytes that are not UTF-8 ({raw[e.start:e.start + 4]!r}); a .json file is one "
                        f"document, so it cannot be read past them (JSONL can skip a bad line)",
                        fix="save the file as UTF-8", skippable=False) from None
    dec, i = json.JSONDecoder(), 0
    ws = " \t\r\n"
    while i < len(text) and text[i] in ws:
        i += 1
    if text[i:i + 1] != "[":
        raise DataError(f"{path}:{_line_of(text, i)}", "not_json",
                        "a .json conversations file must hold a JSON array of records ([{...}, {...}])",
                        fix="for one record a line, name the file .jsonl", skippable=False)
    out, i = [], i + 1
    line = _LineCounter(text)  # records' line numbers in one pass over the text, not a count from 0 per record
    while True:
        while i < len(text) and text[i] in ws:
            i += 1
        if text[i:i + 1] == "]":
            return out
        try:
            rec, j = dec.raw_decode(text, i)
        except RecursionError:  # too deep for the parser: its brackets still say where it ends
            j = _value_end(text, i)
            if j < 0:
                raise DataError(f"{path}:{line(i)}", "too_deep", f"{TOO_DEEP}, and the file ends inside it",
                                skippable=False) from None
            rec = _Bad("too_deep", TOO_DEEP)
        except json.JSONDecodeError as e:
            if not _cut_off(text, e):
                raise DataError(f"{path}:{e.lineno}", "not_json", f"not valid JSON ({e.msg} at column {e.colno})",
                                skippable=False) from None
            # the file ends inside a record (a partial download or copy): the records before it are whole
            byte = len(text[:i].encode("utf-8"))
            out.append((f"{path}:{_line_of(text, i)} (byte {byte})",
                        _Bad("truncated", f"the file ends inside a record of the JSON array ({len(raw) - byte} bytes "
                                          f"after its start, no closing ']'): {len(out)} complete records come "
                                          f"before it")))
            return out
        out.append((f"{path}:{line(i)}", rec))
        i = j
        while i < len(text) and text[i] in ws:
            i += 1
        if text[i:i + 1] == ",":
            i += 1
        elif i >= len(text):
            out.append((f"{path}:{_line_of(text, i)} (byte {len(raw)})",
                        _Bad("truncated", f"the file ends after record {len(out)} of the JSON array, without its "
                                          f"closing ']': {len(out)} complete records come before it")))
            return out
        elif text[i:i + 1] != "]":
            raise DataError(f"{path}:{_line_of(text, i)}", "not_json", "not valid JSON (expected ',' or ']' after a "
                                                                     "record of the array)", skippable=False)


def _value_end(text: str, i: int) -> int:
    """The end of the JSON array / object that starts at ``text[i]``, by counting brackets outside strings (no
    recursion, no validation), or -1 when the text ends first."""
    depth, k, n = 0, i, len(text)
    while k < n:
        c = text[k]
        if c == '"':
            k += 1
            while k < n and text[k] != '"':
                k += 2 if text[k] == "\\" else 1
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return k + 1
        k += 1
    return -1


def _cut_off(text: str, e: json.JSONDecodeError) -> bool:
    """Whether a decoding error is the end of the text arriving inside a value (a truncated file), not bad JSON."""
    return e.msg.startswith("Unterminated string") or e.pos >= len(text.rstrip())


def _parquet_records(path: str) -> list:
    try:
        import pyarrow.parquet as pq  # optional extra (.[parquet])
    except ImportError:
        raise MissingPackageError(f"reading {path} needs pyarrow: `pip install -e .[parquet]` (or give JSONL / "
                                  f"JSON)") from None
    rows = pq.read_table(path).to_pylist()
    return [(f"{path}:row {i}", r) for i, r in enumerate(rows, 1)]


def count_records(path: str) -> Optional[int]:
    """Records in a conversations file without parsing them (JSONL: non-empty lines; Parquet: its row count;
    JSON: None), or None when the file does not exist (yet)."""
    if not os.path.isfile(path):
        return None
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional extra (.[parquet])
        except ImportError:
            return None
        return int(pq.ParquetFile(path).metadata.num_rows)
    if ext == ".json":
        return None
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


# ---------------------------------------------------------------------------------------------- validation
def _content(m: dict, key: str) -> str:
    c = m.get(key)
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # OpenAI content parts
        texts = []
        for part in c:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _Bad("bad_message", f"message content parts must be {{'type': 'text', 'text': str}} (got "
                                          f"{str(part)[:60]})")
            texts.append(part["text"])
        return "".join(texts)
    raise _Bad("bad_message", f"a message has no string {key!r} (got {type(c).__name__})")


def _text(s: str, what: str) -> str:
    """``s``, or ``_Bad`` when it is not text a tokenizer can read (a lone surrogate)."""
    bad = lone_surrogate(s)
    if bad is not None:
        raise _Bad("bad_unicode", f"{what} holds {bad}")
    return s


def normalise(rec) -> tuple:
    """One record -> (id or None, [{"role": system|user|assistant, "content": str}], split or None); raises
    ``_Bad`` (reason, message) for a record that cannot be trained on."""
    try:
        return _normalise(rec)
    except RecursionError:  # a value nested nearly as deep as the parser allows (repr, str of it)
        raise _Bad("too_deep", TOO_DEEP) from None


def _normalise(rec) -> tuple:
    if not isinstance(rec, dict):
        raise _Bad("not_an_object", f"expected a JSON object with 'conversations' or 'messages', got "
                                    f"{type(rec).__name__}")
    turns = rec.get("conversations", rec.get("messages"))
    if turns is None:
        raise _Bad("no_conversation", f"no 'conversations' (SpecForge / ShareGPT) or 'messages' (OpenAI) key; "
                                      f"keys: {sorted(rec)[:8]}")
    if not isinstance(turns, list):
        raise _Bad("no_conversation", f"'conversations' / 'messages' must be a list, got {type(turns).__name__}")
    if not turns:
        raise _Bad("empty_conversation", "the conversation is empty")
    msgs = []
    for k, m in enumerate(turns):
        if not isinstance(m, dict):
            raise _Bad("bad_message", f"message {k} is not an object")
        if m.get("from") is not None and m.get("role") is None:  # ShareGPT (Parquet rows may carry both keys)
            role_raw, content = m["from"], _content(m, "value")
        else:
            role_raw, content = m.get("role"), _content(m, "content")
        role = ROLES.get(role_raw.lower()) if isinstance(role_raw, str) else None
        if role is None:
            raise _Bad("unknown_role", f"message {k} has role {role_raw!r}; known roles: system, user, assistant "
                                       f"(ShareGPT: system, human, gpt)")
        msgs.append({"role": role, "content": _text(content, f"message {k}'s content")})
    if not any(m["role"] == "assistant" for m in msgs):
        raise _Bad("no_assistant_turn", "the conversation has no assistant turn (nothing to train on)")
    rid = rec.get("id")
    if isinstance(rid, str):
        _text(rid, "the record's 'id'")
    split = rec.get("split")
    if split is not None and split not in SPLITS:
        raise _Bad("unknown_split", f"'split' is {split!r}; records may say 'train' or 'heldout' (or leave 'split' "
                                    f"out: the split is then by id, data.heldout)")
    return (None if rid is None else str(rid)), msgs, split


def read_conversations(path: str, bad_lines: str = "error", stats: Optional[dict] = None) -> list:
    """A conversations file -> [(where, id, messages, split)] (``normalise``d). Bad records raise ``DataError``
    (``bad_lines="error"``) or are skipped and counted in ``stats["bad"]`` by reason (``"skip"``); ids default
    to ``line<N>`` / ``row<N>``."""
    st = stats if stats is not None else {}
    out = []
    for where, rec in _raw_records(path):
        try:
            if isinstance(rec, _Bad):
                raise rec
            rid, msgs, split = normalise(rec)
        except _Bad as b:
            _bad(st, where, b.reason, b.msg, bad_lines)
            continue
        out.append((where, rid or _default_id(where), msgs, split))
    return out


def _bad(st: dict, where: str, reason: str, msg: str, bad_lines: str) -> None:
    if bad_lines != "skip":
        raise DataError(where, reason, msg)
    bad = st.setdefault("bad", {})
    bad[reason] = bad.get(reason, 0) + 1
    ex = st.setdefault("bad_examples", [])
    if len(ex) < 5:
        ex.append(f"{where}: {msg}")
    st.setdefault("first_bad", {}).setdefault(reason, f"{where}: {msg}")  # one example of every kind


def conversation_prompts(path: str, bad_lines: str = "error", stats: Optional[dict] = None,
                         opening_context: bool = False) -> list:
    """``specopd prepare data --from FILE``: each conversation's prompt (its messages before the first assistant
    turn: system + user) -> [(id, messages)], the list ``prepare_data(prompts=...)`` takes; the target then
    regenerates the answer. Later turns are not kept (they answer the original reply, not the target's);
    ``stats["later_turns_dropped"]`` counts conversations that had some. A conversation that opens with an
    assistant turn (ShareGPT's chunks of longer chats often do) has no prompt and is bad data, unless
    ``opening_context``: then its prompt runs up to the first assistant turn after a user turn, the opening
    replies kept as context (as its trunk has them).

    Args:
        path: the conversations file; bad_lines: ``error`` or ``skip`` (``data.bad_lines``); stats: filled with the
        counts; opening_context: see above.
    """
    st = stats if stats is not None else {}
    st.setdefault("later_turns_dropped", 0)
    out, seen = [], set()
    for where, rid, msgs, _ in read_conversations(path, bad_lines, st):
        first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), 0)
        start = first_user if opening_context else 0
        k = next((i for i in range(start, len(msgs)) if msgs[i]["role"] == "assistant"), len(msgs))
        if k == 0 or not any(m["role"] == "user" for m in msgs[:k]):
            _bad(st, where, "no_user_prompt", "the first assistant turn has no user turn before it (no prompt "
                                             "to answer)", bad_lines)
            continue
        if rid in seen:
            _bad(st, where, "duplicate_id", f"id {rid!r} repeats an earlier record's (prepare data resumes by id, "
                                            f"so ids must be unique)", bad_lines)
            continue
        seen.add(rid)
        st["later_turns_dropped"] += int(k + 1 < len(msgs))
        out.append((rid, msgs[:k]))
    if not out:
        raise ValueError(f"{path}: no conversation with a user prompt")
    return out


# ---------------------------------------------------------------------------------------------- tokenising
def _render(tok, msgs, gen: bool = False) -> str:
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def assistant_spans(tok, messages: list) -> tuple:
    """(text, [(start, end)] character spans of every assistant turn in the chat-formatted text).

    A turn's span starts after the template's assistant header (the prompt a served request ends with:
    ``messages[:i]`` rendered with the generation prompt) and ends after its end-of-turn token (``messages[:i+1]``
    rendered, trailing whitespace off: the target never generates the newline after it). Templates whose render
    of a prefix is not a prefix of the whole (e.g. ones that render the last turn differently) fall back to the
    turn's content located in the text, plus the eos token when it follows right after."""
    text = _render(tok, messages)
    spans, cur = [], 0
    eos = getattr(tok, "eos_token", None)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(tok, messages[:i], gen=True) if i else ""
        start = len(head) if i and text.startswith(head) and len(head) >= cur else None
        if start is None:
            at = text.find(m["content"], cur)
            if at < 0:
                raise _Bad("template_error", f"the chat template does not reproduce assistant turn {i}'s text")
            start = at
        upto = _render(tok, messages[: i + 1])
        if text.startswith(upto) and len(upto) > start:
            end = len(upto.rstrip())
        else:
            at = text.find(m["content"], start)
            end = (at if at >= 0 else start) + len(m["content"])
            if eos and text.startswith(eos, end):
                end += len(eos)
        spans.append((start, max(start, end)))
        cur = end
    return text, spans


def encode_chat(tok, messages: list) -> tuple:
    """messages -> (token ids [T], loss mask [T] of 0/1): the whole conversation through the target's chat
    template (one tokenisation of the whole text, as a serving engine sees it); a token is masked (1) when it
    starts inside an assistant span (``assistant_spans``)."""
    text, spans = assistant_spans(tok, messages)
    return _encode_spans(tok, text, spans, _tokenise(tok, [text])[0])


def _tokenise(tok, texts: list) -> list:
    """texts -> per text (ids, token start offsets or None): one batch call (a fast tokenizer encodes a batch on
    every core, each text exactly as alone)."""
    fast = bool(getattr(tok, "is_fast", False))
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=fast)
    offs = enc["offset_mapping"] if fast else [None] * len(texts)
    return [(list(ids), [int(s) for s, _ in o] if o is not None else None) for ids, o in zip(enc["input_ids"], offs)]


def _encode_spans(tok, text: str, spans: list, encoded: tuple) -> tuple:
    """``encode_chat``'s ids and loss mask from the text's tokenisation ``encoded`` = (ids, start offsets or
    None)."""
    ids, starts = encoded
    if starts is None:  # slow tokenizer: token boundaries from the tokenisation of each span boundary's prefix
        starts = _prefix_starts(tok, text, ids, spans)
    mask, k = [0] * len(ids), 0
    for t, s in enumerate(starts):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k < len(spans) and spans[k][0] <= s < spans[k][1]:
            mask[t] = 1
    return ids, mask


def _prefix_starts(tok, text: str, ids: list, spans: list) -> list:
    """Per token a character position on the right side of every span boundary (slow tokenizers only)."""
    cuts = sorted({c for sp in spans for c in sp})
    starts, prev_n, prev_c = [], 0, 0
    for c in cuts + [len(text)]:
        n = len(tok(text[:c], add_special_tokens=False)["input_ids"]) if c < len(text) else len(ids)
        starts += [prev_c] * (n - prev_n)
        prev_n, prev_c = n, c
    return starts[: len(ids)]


def tokenizer_files(target_dir: str) -> list:
    """The names of the tokenizer's files in ``target_dir`` (vocabulary, merges, config, chat template), sorted."""
    return [n for n in sorted(os.listdir(target_dir))
            if n.startswith(("tokenizer", "special_tokens_map", "added_tokens", "chat_template", "vocab", "merges"))
            or n.endswith((".model", ".tiktoken"))]


def tokenizer_hash(target_dir: str) -> str:
    """sha256 over the tokenizer's files in ``target_dir`` (``tokenizer_files``) and the transformers version
    (which renders the template)."""
    import transformers  # optional (dev / demo extra)

    h = hashlib.sha256(f"transformers {transformers.__version__}\n".encode())
    for n in tokenizer_files(target_dir):
        h.update(n.encode())
        with open(os.path.join(target_dir, n), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- the dataset
def _default_id(where: str) -> str:
    loc = where.rsplit(":", 1)[1]
    return "row" + loc[4:] if loc.startswith("row ") else f"line{loc}"


def tokenise_file(path: str, tok) -> list:
    """Every record of ``path`` in file order, tokenised: ``(where, "ok", id, split, ids [T] int32, mask [T]
    bool)`` or ``(where, "bad", reason, message)`` (bad records are kept as such: ``data.bad_lines`` decides
    later, so the cache does not depend on it)."""
    items = []
    for where, rec in _raw_records(path):
        try:
            if isinstance(rec, _Bad):
                raise rec
            rid, msgs, split = normalise(rec)
            try:
                text, spans = assistant_spans(tok, msgs)
            except _Bad:
                raise
            except Exception as e:  # noqa: BLE001  (the template refused the conversation)
                raise _Bad("template_error", f"the target's chat template failed on it: {str(e)[:200]}") from None
        except _Bad as b:
            items.append((where, "bad", b.reason, b.msg))
            continue
        items.append((where, "text", rid, split, text, spans))
    todo = [i for i, it in enumerate(items) if it[1] == "text"]
    bar = tqdm(total=len(todo), desc=f"tokenising {os.path.basename(path)}", unit="conv", leave=False,
               disable=len(todo) < TOKENISE_BATCH)
    for b in range(0, len(todo), TOKENISE_BATCH):
        part = todo[b: b + TOKENISE_BATCH]
        for i, enc in zip(part, _tokenise(tok, [items[i][4] for i in part])):
            where, _, rid, split, text, spans = items[i]
            ids, mask = _encode_spans(tok, text, spans, enc)
            items[i] = ((where, "ok", rid or _default_id(where), split, torch.tensor(ids, dtype=torch.int32),
                         torch.tensor(mask, dtype=torch.bool)) if any(mask) else
                        (where, "bad", "no_assistant_turn", "no assistant token after the chat template"))
        bar.update(len(part))
    bar.close()
    return items


def _cache_paths(path: str, key: str, output_dir: str) -> list:
    stem = os.path.basename(path)
    name = f"{stem}.{key[:24]}.pt"
    return [os.path.join(os.path.dirname(os.path.abspath(path)), ".specopd-cache", name),
            os.path.join(output_dir, "data", f"conversations-{name}")]


def cache_items_ok(data) -> bool:
    """Whether a loaded tokenisation cache has ``tokenise_file``'s structure: a list of ``(where, "ok", id,
    split, ids, mask)`` and ``(where, "bad", reason, message)`` tuples."""
    if not isinstance(data, list):
        return False
    for item in data:
        if not isinstance(item, (tuple, list)) or len(item) < 2 or not isinstance(item[0], str):
            return False
        if item[1] == "ok":
            if len(item) != 6 or not (isinstance(item[4], torch.Tensor) and isinstance(item[5], torch.Tensor)):
                return False
            if item[4].shape != item[5].shape or item[3] not in (None, *SPLITS):
                return False
        elif item[1] != "bad" or len(item) != 4:
            return False
    return True


def _cached_tokenise(path: str, tok, target_dir: str, output_dir: str, st: dict) -> dict:
    check_conversations_file(path)
    key = hashlib.sha256(f"v{CACHE_VERSION}:{sha256_file(path)}:{tokenizer_hash(target_dir)}".encode()).hexdigest()
    places = _cache_paths(path, key, output_dir)
    for p in places:
        if os.path.isfile(p):
            try:
                data = torch.load(p, map_location="cpu", weights_only=True)
            except Exception:  # noqa: BLE001  (a damaged cache is rebuilt)
                continue
            if cache_items_ok(data):  # a file of another structure (another version, a stray file) is rebuilt
                st["cache"] = {"path": p, "hit": True}
                return data
    data = tokenise_file(path, tok)
    st["cache"] = {"path": None, "hit": False}  # unless a place below takes it
    for p in places:  # beside the data; the run folder when that is not writable
        try:
            own_dir(os.path.dirname(p))
            with replacing(p, "wb") as f:
                torch.save(data, f)
            st["cache"] = {"path": p, "hit": False}
            break
        except (OSError, LinkedPathError):  # a link there is not followed: the next place
            continue
    return data


def build_cache(path: str, tok, target_dir: str, output_dir: str) -> dict:
    """Tokenise ``path`` into its cache once (the controller does it before starting Ray workers, so that they
    read it instead of each tokenising the file).

    Args:
        path: the conversations file; tok: the target's tokenizer; target_dir: its folder (hashed into the key);
        output_dir: the run folder (where the cache goes when the data's folder is not writable).

    Returns:
        {"path": the cache file (None if nothing could be written), "hit": whether it existed already}.
    """
    st: dict = {}
    _cached_tokenise(path, tok, target_dir, output_dir, st)
    return st["cache"]


def conversation_samples(path: str, tok, target_dir: str, output_dir: str, seq_len: int, context: Optional[int],
                         overlong: str = "truncate", bad_lines: str = "error", seed: int = 1234,
                         heldout: float = 0.125, stats: Optional[dict] = None, duplicate_ids: str = "keep") -> list:
    """The trainer's samples of a conversations file: [{"input_ids" [T] long, "prompt_len" (the first assistant
    token), "loss_mask" [T] bool, "split", "id"}].

    Args:
        path: JSONL / JSON / Parquet conversations file (``data.path``).
        tok: the target's tokenizer (``specopd.data.prepare.load_tokenizer``); target_dir: where it lives (hashed
            for the cache key); output_dir: the run folder (cache fallback).
        seq_len, context: a conversation longer than ``min(seq_len, context)`` tokens is cut there
            (``overlong="truncate"``) or dropped (``"drop"``); one longer than the target's ``context`` itself is
            bad data (``bad_lines`` decides: error or skip + count).
        seed, heldout: split by conversation id (``references.split_of``) unless the record carries ``split``.
        stats: filled with the counts (``records``, ``bad`` by reason, ``truncated``, ``dropped_overlong``,
            ``duplicate_id_other_content``, ``duplicate_exact``, ``dropped_duplicates``, ``cache``); nothing is
            dropped without a count there.
        duplicate_ids: a record whose id an earlier one has (``DUPLICATE_IDS``): trained too (``keep``), left out
            (``drop_repeats``), or a ``DataError`` naming both lines (``error``); counted in every case.

    Returns:
        list of sample dicts (indexed by sample id).
    """
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"data.overlong={overlong!r}: use truncate or drop")
    if duplicate_ids not in DUPLICATE_IDS:
        raise ValueError(f"data.duplicate_ids={duplicate_ids!r}: use one of {list(DUPLICATE_IDS)}")
    st = stats if stats is not None else {}
    st.update(source="conversations", path=os.path.abspath(path), records=0, truncated=0, dropped_overlong=0,
              duplicate_id_other_content=0, duplicate_exact=0, dropped_duplicates=0, duplicate_ids=duplicate_ids)
    items = _cached_tokenise(path, tok, target_dir, output_dir, st)
    limit = min(seq_len, context) if context else seq_len
    out, seen = [], {}  # seen: id -> its first record (where, split, ids, mask)
    for item in items:
        w = item[0]
        st["records"] += 1
        if item[1] == "bad":
            _bad(st, w, item[2], item[3], bad_lines)
            continue
        _, _, rid, split, ids, mask = item
        if rid in seen and not _first_of_id(st, seen[rid], item, duplicate_ids):
            continue
        seen.setdefault(rid, (w, split, ids, mask))
        if context and ids.numel() > context:
            _bad(st, w, "longer_than_context", f"the conversation is {ids.numel()} tokens after the chat template, "
                                               f"longer than the target's context ({context} tokens, "
                                               f"max_position_embeddings)", bad_lines)
            continue
        if ids.numel() > limit:
            if overlong == "drop":
                st["dropped_overlong"] += 1
                continue
            st["truncated"] += 1
            ids, mask = ids[:limit], mask[:limit]
            if not bool(mask.any()):
                st["dropped_no_assistant_in_limit"] = st.get("dropped_no_assistant_in_limit", 0) + 1
                continue
        first = int(torch.nonzero(mask)[0])
        out.append({"input_ids": ids.long(), "prompt_len": first, "loss_mask": mask.clone(), "id": rid,
                    "split": split or split_of(rid, seed, heldout)})
    st["conversations"] = len(out)
    if not out:
        raise ValueError(f"{path}: no usable conversation of {st['records']} records ({_note(st)})")
    return out


def _first_of_id(st: dict, first: tuple, item: tuple, policy: str) -> bool:
    """Count ``item`` (a tokenised record, see ``tokenise_file``) as a repeat of the id of ``first`` (where,
    split, ids, mask), exact or with other content; -> whether to keep it (``data.duplicate_ids``)."""
    w, _, rid, split, ids, mask = item
    same = first[1] == split and torch.equal(first[2], ids) and torch.equal(first[3], mask)
    st["duplicate_exact" if same else "duplicate_id_other_content"] += 1
    how = "the same conversation" if same else "another conversation"
    st.setdefault("first_duplicate", f"{w}: id {rid!r} again ({how}; first at {first[0]})")
    if policy == "error":
        raise DataError(w, "duplicate_id", f"id {rid!r} repeats the id of the record at {first[0]} ({how})",
                        fix="give every record its own id, or set data.duplicate_ids=drop_repeats (keep the first "
                            "of each id) or data.duplicate_ids=keep (train every record)")
    if policy == "drop_repeats":
        st["dropped_duplicates"] += 1
        return False
    return True


def _note(st: dict) -> str:
    said = [f"{n} bad ({r})" for r, n in sorted((st.get("bad") or {}).items())]
    if st.get("truncated"):
        said.append(f"{st['truncated']} truncated")
    if st.get("dropped_overlong"):
        said.append(f"{st['dropped_overlong']} dropped as longer than the limit (data.overlong=drop)")
    if st.get("dropped_no_assistant_in_limit"):
        said.append(f"{st['dropped_no_assistant_in_limit']} dropped: no assistant token within the limit")
    other, exact = st.get("duplicate_id_other_content", 0), st.get("duplicate_exact", 0)
    if other or exact:
        said.append(f"repeated ids: {other} with another conversation, {exact} exact copies " + (
            f"({st['dropped_duplicates']} dropped: data.duplicate_ids=drop_repeats keeps the first of each id)"
            if st.get("dropped_duplicates")
            else "(trained too: data.duplicate_ids=keep; drop_repeats keeps the first of each id)"))
    return "; ".join(said) or "nothing dropped"


def stats_note(st: dict, limit: int) -> Optional[str]:
    """One line of what ``conversation_samples`` skipped, cut, dropped or found repeated (None when nothing)."""
    n = _note(st)
    if n == "nothing dropped":
        return None
    ex = st.get("bad_examples") or []
    return (f"[data] {st['records']} conversations in {st.get('path')}: {n} (limit {limit} tokens)"
            + (f"; first bad: {ex[0]}" if ex else "") + (f"; first repeat: {st['first_duplicate']}"
                                                          if st.get("first_duplicate") else ""))
