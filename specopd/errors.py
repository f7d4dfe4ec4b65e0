"""Errors a user can cause, in one place (a leaf: imports none of our modules): the CLI prints a ``UserError``'s
message and exits with code 2, without a traceback; anything else is a bug and keeps its traceback.
Design: docs/architecture.md ("User errors").
"""
from __future__ import annotations

import errno
import math
import os
from typing import Optional

UTF8_BOM = b"\xef\xbb\xbf"  # what some editors put at the start of a UTF-8 file; read as nothing


class UserError(Exception):
    """A mistake in what the user gave; the message names the cause and the fix (CLI: exit 2, no traceback)."""


class BadInputError(UserError, ValueError):
    """A file a user named cannot be used as given (bad encoding, bad record, wrong kind of path)."""


class MissingInputError(UserError, FileNotFoundError):
    """A file or folder a user named is not there (or is not the kind of path asked for)."""


class DamagedFolderError(UserError, ValueError):
    """A checkpoint / drafter folder whose files do not match its manifest (or cannot be read)."""


class FolderNotEmptyError(UserError, FileExistsError):
    """An output folder already holds files that a write would replace or mix with."""


class MissingPackageError(UserError, ImportError):
    """A package the user's input needs (a packaged dataset, a file format's reader) is not installed; the message
    names it and the pip command."""


# a JSON value nested deeper than the parser's recursion limit (json raises RecursionError): bad data, not a bug
TOO_DEEP = "lists / objects nested too deeply to read (more levels than the JSON reader's recursion limit)"


def lone_surrogate(text: str) -> Optional[str]:
    """Where ``text`` holds half of a UTF-16 surrogate pair (a JSON escape such as ``\\ud800`` alone: no character,
    and not UTF-8, so a tokenizer refuses it) and the fix, in words; None for proper text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"a lone UTF-16 surrogate ({text[e.start]!r}, half a character pair) at character {e.start + 1}: "
                f"not text a tokenizer can read (write the character itself, or a whole \\ud83d\\ude00-style pair)")
    return None


def is_finite_number(x) -> bool:
    """False for float NaN / +-inf; True for every other value (ints, strings, ...)."""
    return not (isinstance(x, float) and not math.isfinite(x))


def nonfinite_keys(obj, prefix: str = "") -> list:
    """Dotted keys (``trainer.lr``, ``trainer.betas[1]``) of every NaN / inf float in a nested dict / list."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += nonfinite_keys(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += nonfinite_keys(v, f"{prefix}[{i}]")
    elif not is_finite_number(obj):
        out.append(prefix)
    return out


def dir_problem(path: str, writable: bool = True) -> Optional[str]:
    """Why ``path`` cannot be (or become) a folder we write into, or None: it is a file, a component above it is
    a file, or (``writable``) the nearest existing folder above it is not writable."""
    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        return "it is a file, not a folder"
    q = p
    while not os.path.exists(q):
        parent = os.path.dirname(q)
        if parent == q:
            break
        q = parent
    if not os.path.isdir(q):
        return f"{q!r} above it is a file, not a folder"
    if writable and not os.access(q, os.W_OK | os.X_OK):
        return f"{q!r} is not writable" if q != p else "it is not writable"
    return None


def make_dir(path: str, what: str) -> str:
    """``os.makedirs(path, exist_ok=True)``, a ``BadInputError`` naming ``what`` (e.g. ``trainer.output_dir``)
    and the fix when the folder cannot be made; returns ``path``."""
    why = dir_problem(path)
    if why is None:
        try:
            os.makedirs(path, exist_ok=True)
            return path
        except OSError as e:
            why = e.strerror or str(e)
            if e.errno == errno.ENOSPC:
                why += " (the disk is full)"
    raise BadInputError(f"{what}={path!r} cannot be used as a folder: {why}; give a writable folder")


def output_file_problem(path: str) -> Optional[str]:
    """Why a file cannot be written at ``path`` (``--json PATH``), or None."""
    p = os.path.abspath(path)
    if os.path.isdir(p):
        return "it is a folder; give a file name (e.g. out.json)"
    why = dir_problem(os.path.dirname(p))
    if why is not None:
        return f"its folder cannot be written ({why})"
    if os.path.exists(p) and not os.access(p, os.W_OK):
        return "it is not writable"
    return None


def read_text_lines(path: str, what: str):
    """(line number, text) of a UTF-8 text file (a byte-order mark at its start is dropped); a ``BadInputError``
    naming ``what``, the file and the line of the first byte that is not UTF-8."""
    with open(path, "rb") as f:
        for ln, raw in enumerate(f, 1):
            if ln == 1 and raw.startswith(UTF8_BOM):
                raw = raw[len(UTF8_BOM):]
            try:
                yield ln, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadInputError(f"{what} {path}:{ln}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                    f"{e.start + 1}); save the file as UTF-8") from None


def read_text(path: str, what: str) -> str:
    """A whole UTF-8 text file; a ``BadInputError`` naming the file and line when it is not UTF-8."""
    return "".join(t for _, t in read_text_lines(path, what))
