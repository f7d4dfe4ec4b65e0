"""One writer per folder: an exclusive lock on a run folder (``trainer.output_dir``) or a data folder
(``specopd prepare data --out``), held for the whole run; a second writer is refused (``RunLockedError``).
Stale locks and re-entrancy: specopd/runs/DESIGN.md ("Run lock").
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Optional

from specopd.errors import UserError, make_dir, open_fd

LOCK_FILE = ".specopd.lock"
_HELD: dict = {}  # realpath of the folder -> [fd, depth, pid] of this process's locks (a forked child holds none)


class RunLockedError(UserError):
    """Another process holds the folder's lock; the message names its pid, host and start time."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (ours always does)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(folder: str) -> Optional[dict]:
    """What ``<folder>/.specopd.lock`` records (pid, host, started, command), or None (no lock / empty)."""
    try:
        with open(os.path.join(folder, LOCK_FILE)) as f:
            text = f.read()
        rec = json.loads(text) if text.strip() else None
        return rec if isinstance(rec, dict) else None
    except (OSError, ValueError):
        return None


def busy(folder: str) -> Optional[str]:
    """Who holds ``folder``'s lock right now ("pid N on host H (...)"), or None; writes nothing (``--dry-run``)."""
    path = os.path.join(folder, LOCK_FILE)
    if not os.path.lexists(path) or os.path.realpath(folder) in _HELD:
        return None
    try:
        fd = open_fd(path, os.O_RDONLY)  # a link: LinkedPathError, as the run would say
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError as e:
        return _describe(read_holder(folder)) if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK) else None
    finally:
        os.close(fd)


def _describe(h: Optional[dict]) -> str:
    if not h:
        return "another process (it has not recorded itself yet)"
    started = h.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {h.get('pid')} on host {h.get('host')} (started {when}: {h.get('command', '?')})"


def _open(path: str) -> int:
    """The lock file, never through a link (a planted one would have us truncate the file it points at)."""
    return open_fd(path, os.O_RDWR | os.O_CREAT, 0o644)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def acquire(folder: str, what: str = "trainer.output_dir") -> int:
    """Take the lock of ``folder`` (made when missing); returns its descriptor. ``RunLockedError`` when another
    live process holds it. See the module docstring."""
    make_dir(folder, what)
    key = os.path.realpath(folder)
    if key in _HELD and _HELD[key][2] == os.getpid():
        _HELD[key][1] += 1
        return _HELD[key][0]
    path = os.path.join(folder, LOCK_FILE)
    host = socket.gethostname()
    for _ in range(5):
        try:
            fd = _open(path)
        except OSError as e:
            raise UserError(f"{what}={folder!r}: cannot create its lock file {path} ({e.strerror}); give a "
                            f"writable folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without file locks
                print(f"[lock] warning: {what}={folder}: this filesystem has no file locks ({e.strerror}); running "
                      f"without the one-writer lock", file=sys.stderr)
                _HELD[key] = [_open(path), 1, os.getpid()]
                return _HELD[key][0]
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            h = read_holder(folder)
            if h and h.get("host") == host and isinstance(h.get("pid"), int) and not pid_alive(h["pid"]):
                print(f"[lock] {what}={folder}: the lock of {_describe(h)} is stale (that process is gone, the "
                      f"lock lives on in an inherited descriptor); taking it over", file=sys.stderr)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            raise RunLockedError(
                f"{what}={folder!r} is in use by {_describe(h)}: one writer per folder. Wait for it to finish (or "
                f"stop it), or give another {what}") from None
        if not _same_file(fd, path):  # replaced by a takeover between our open and our flock: try again
            os.close(fd)
            continue
        prev = read_holder(folder)
        if prev and prev.get("pid") != os.getpid():
            print(f"[lock] {what}={folder}: taking over the lock left by {_describe(prev)}, which ended without "
                  f"releasing it (killed?)", file=sys.stderr)
        rec = {"pid": os.getpid(), "host": host, "started": time.time(), "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(rec).encode() + b"\n", 0)
        _HELD[key] = [fd, 1, os.getpid()]
        return fd
    raise RunLockedError(f"{what}={folder!r}: its lock file {path} keeps being replaced by another process; give "
                         f"another {what}")


def release(folder: str) -> None:
    """Undo one ``acquire`` of ``folder``; the last one empties the lock file and drops the lock."""
    key = os.path.realpath(folder)
    held = _HELD.get(key)
    if held is None or held[2] != os.getpid():
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[key]
    fd = held[0]
    try:
        if _same_file(fd, os.path.join(folder, LOCK_FILE)):
            os.ftruncate(fd, 0)
    except OSError:
        pass
    finally:
        os.close(fd)  # closing the descriptor drops the flock


@contextlib.contextmanager
def run_lock(folder: str, what: str = "trainer.output_dir"):
    """``with run_lock(out): ...``: hold the folder's lock for the block (see ``acquire``)."""
    acquire(folder, what)
    try:
        yield
    finally:
        release(folder)
