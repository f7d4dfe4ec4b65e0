"""Errors a user can cause, in one place (a leaf: imports none of our modules): the CLI prints a ``UserError``'s
message and exits with code 2, without a traceback; anything else is a bug and keeps its traceback. And the
one owner of how the tool writes a file (``open_write``, ``replacing``, ``own_dir``): never through a symbolic link.
Design: specopd/DESIGN.md ("User errors").
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
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


class LinkedPathError(UserError):
    """A path the tool writes is a symbolic link: writing would follow it out of its folder, so nothing is
    written (``linked_path_error`` words it)."""


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


def linked_path_error(path: str) -> LinkedPathError:
    """The refusal of a write through the link ``path``: it names the link and the fix."""
    try:
        to = f" (to {os.readlink(path)!r})"
    except OSError:
        to = ""
    return LinkedPathError(f"{path} is a symbolic link{to}: SpecOPD does not write through a link in a folder it "
                           f"writes (a folder from someone else could point one at any file of yours); remove the "
                           f"link, or give another folder")


def refuse_link(path: str) -> str:
    """``path``, or a ``LinkedPathError`` when it is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        raise linked_path_error(path)
    return path


def remove_path(path: str) -> None:
    """Remove what is at ``path``: a link (the link, never what it points at), a file or a folder tree (whose links
    are removed, not followed); nothing there is fine."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def own_dir(path: str) -> str:
    """``os.makedirs(path, exist_ok=True)`` for a folder the tool makes inside one the user named (``checkpoints/``,
    a cache folder): a link there is refused (``LinkedPathError``), not followed. Returns ``path``."""
    os.makedirs(refuse_link(path), exist_ok=True)
    return refuse_link(path)


_WRITE_FLAGS = {"w": os.O_TRUNC, "a": os.O_APPEND, "x": os.O_EXCL}


def open_fd(path: str, flags: int, mode: int = 0o666) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)``: a ``LinkedPathError`` naming ``path`` when it is a
    symbolic link, which is never followed."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise linked_path_error(path) from None
        raise


def _open_fd(path: str, mode: str) -> int:
    return open_fd(path, os.O_WRONLY | os.O_CREAT | _WRITE_FLAGS[mode[0]])


def open_write(path: str, mode: str = "w", **kw):
    """``open(path, mode)`` for writing (``w`` or ``a``, with ``b`` for bytes; ``x`` refuses anything there, a
    link too) that never follows a symbolic link at ``path`` (``O_NOFOLLOW``: a ``LinkedPathError`` naming it), so
    a planted link cannot send the write, or the truncation, to a file elsewhere. ``kw``: as ``open``."""
    if mode.replace("b", "") not in _WRITE_FLAGS:
        raise ValueError(f"open_write: {mode!r} is not a write mode (w, a or x, with b for bytes)")
    return os.fdopen(_open_fd(path, mode), mode, **kw)


@contextlib.contextmanager
def _fresh_tmp(path: str, tmp: Optional[str]):
    """(tmp path, descriptor) of a new file made here (``O_EXCL | O_NOFOLLOW``; whatever is at its name, a link
    or a file a killed run left, is unlinked first: the link itself, never its target); renamed over ``path``
    after the block, removed when the block raises."""
    tmp = tmp or f"{path}.tmp-{os.getpid()}"
    try:
        fd = _open_fd(tmp, "x")
    except FileExistsError:
        os.unlink(tmp)
        fd = _open_fd(tmp, "x")
    try:
        yield tmp, fd
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def replacing_path(path: str, tmp: Optional[str] = None):
    """``with replacing_path(p) as t: writer(t)``: the block writes the fresh file ``t`` (default
    ``<p>.tmp-<pid>``, made here, never a link), which then replaces ``p`` in one rename: a reader never sees half
    a file, and a link at ``p`` is replaced, never followed. For writers that take a path (safetensors); when the
    block raises, ``t`` is removed and ``p`` is untouched."""
    with _fresh_tmp(path, tmp) as (t, fd):
        os.close(fd)
        yield t


@contextlib.contextmanager
def replacing(path: str, mode: str = "w", fsync: bool = False, tmp: Optional[str] = None, **kw):
    """``with replacing(p) as f: f.write(...)``: as ``replacing_path``, the block writing the open tmp file.

    Args:
        path: the file to replace.
        mode: ``w`` or ``wb``.
        fsync: the tmp file is on disk before the rename.
        tmp: the tmp file's name (default ``<path>.tmp-<pid>``).
        kw: as ``open`` (encoding, newline).
    """
    with _fresh_tmp(path, tmp) as (_, fd), os.fdopen(fd, mode, **kw) as f:
        yield f
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def write_replace(path: str, data, fsync: bool = False) -> None:
    """``path`` = ``data`` (str or bytes) through ``replacing``: whole or not at all, never through a link."""
    with replacing(path, "wb" if isinstance(data, bytes) else "w", fsync=fsync) as f:
        f.write(data)


def output_file_problem(path: str) -> Optional[str]:
    """Why a file cannot be written at ``path`` (``--json PATH``), or None."""
    p = os.path.abspath(path)
    if os.path.islink(p):
        return "it is a symbolic link (never written through); give a path that is not a link"
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
