"""SIGTERM and SIGHUP stop a command as Ctrl-C does: ``Terminated`` (a KeyboardInterrupt) is raised in the main
thread, so a run writes the checkpoint of its completed steps and shuts its workers and Ray down; the CLI exits
with 128 + the signal's number. None of the three cuts a worker's optimizer step in two (``uninterrupted``).
A leaf (imports none of our modules). Design: specopd/DESIGN.md ("Signals").
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# main thread: uninterrupted()'s depth and the stop that arrived inside; the stop signal taken (stopped_by)
_STATE = {"depth": 0, "pending": None, "stop": None}


class Terminated(KeyboardInterrupt):
    """The process got ``signum``: SIGTERM (a kill, a scheduler) or SIGHUP (its terminal or ssh session closed)."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)

    @property
    def exit_code(self) -> int:
        """128 + the signal's number: what a shell reports for a process this signal ended."""
        return 128 + self.signum


def drop_hung_up_output() -> bool:
    """Point stdout / stderr at /dev/null where they are a terminal that hung up (every write to it fails with
    EIO, which would end the checkpoint's message and the shutdown after it); True if one was."""
    dropped = False
    for fd in (1, 2):
        try:
            os.write(fd, b"")  # a no-op on a working terminal, file or pipe
        except OSError as e:
            if e.errno != errno.EIO:  # e.g. a closed descriptor: not a hangup
                continue
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
            dropped = True
    return dropped


def _stop(e: BaseException) -> None:
    """Raise ``e`` now, or when the ``uninterrupted`` block the main thread is in ends."""
    if _STATE["depth"]:
        _STATE["pending"] = _STATE["pending"] or e
    else:
        raise e


@contextlib.contextmanager
def uninterrupted():
    """A state change that a stop must not cut in two (a worker's optimizer step and its step count): Ctrl-C,
    SIGTERM or SIGHUP arriving inside is raised once it is done. Signal handlers run in the main thread only, so
    elsewhere nothing needs holding."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE["depth"] += 1
    try:
        yield
    finally:
        _STATE["depth"] -= 1
        if not _STATE["depth"] and _STATE["pending"] is not None:
            e, _STATE["pending"] = _STATE["pending"], None
            raise e


class StopHandler:
    """The handler of SIGTERM / SIGHUP: raises ``Terminated`` once; later stop signals are ignored, so a second
    hangup (the kernel's and the shell's) cannot cut the checkpoint of the first short. SIGKILL and Ctrl-C still
    end the process."""

    def __init__(self):
        self.stopping = False

    def __call__(self, signum, frame):
        if signum == signal.SIGHUP:
            drop_hung_up_output()
        if not self.stopping:
            self.stopping = True
            _STATE["stop"] = Terminated(signum)
            _stop(_STATE["stop"])


def stopped_by(e: BaseException) -> Optional[Terminated]:
    """The stop signal that ``e`` stands for: ``e`` itself, or the one taken when ``e`` is the plain
    KeyboardInterrupt a library raised in its place (Ray does, for an exception raised by a signal handler while
    ray.get / ray.wait wait); None for anything else."""
    if isinstance(e, Terminated):
        return e
    return _STATE["stop"] if isinstance(e, KeyboardInterrupt) else None


def interrupt(signum, frame):
    """Ctrl-C: ``KeyboardInterrupt``, as Python's own handler, but held back inside ``uninterrupted``."""
    _stop(KeyboardInterrupt())


@contextlib.contextmanager
def stop_on_signals():
    """While inside, SIGTERM and SIGHUP raise ``Terminated`` in the main thread, and Ctrl-C its KeyboardInterrupt
    (both held back inside ``uninterrupted``); a ``Terminated`` leaves as itself. The previous handlers come back
    on exit. A signal that is ignored (``nohup``) stays ignored; any other handler (Python's default, one an
    earlier ``ray.init`` in this process left behind, or one a script calling ``main`` set) is replaced for the
    command and put back after it. Outside the main thread nothing changes (Python handles signals there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler, _STATE["stop"] = StopHandler(), None
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS + (signal.SIGINT,)}
    mine = {s: handler for s in STOP_SIGNALS if before[s] != signal.SIG_IGN}
    if before[signal.SIGINT] is signal.default_int_handler:
        mine[signal.SIGINT] = interrupt
    for s, h in mine.items():
        signal.signal(s, h)
    try:
        yield
    except KeyboardInterrupt as e:
        stop = stopped_by(e)
        if stop is None or stop is e:
            raise
        raise stop from e  # a plain KeyboardInterrupt raised in its place (Ray's): named again
    finally:
        for s in mine:  # None: a handler not set from Python (C code's); the default is the best we can restore
            signal.signal(s, signal.SIG_DFL if before[s] is None else before[s])
        _STATE["stop"] = None


@contextlib.contextmanager
def starting_ray():
    """Around ``ray.init`` (main thread; elsewhere nothing changes).

    - SIGTERM: ray.init sets a handler of its own (exit code 15) and, under it, its core worker installs absl's
      failure-signal handler, which logs "SIGTERM received" and arms ``alarm(3)`` to abort a crash handler that
      hangs: a SIGTERM whose checkpoint and shutdown took over 3 s ended in SIGABRT. The Python handler is put
      back as the C-level one (ours where the CLI stops on signals, Ray's otherwise), which drops absl's.
    - SIGHUP, where the driver stops on it: the processes Ray starts (raylet, GCS, agents and the workers they
      start) inherit SIGHUP ignored. They share the driver's process group, so a closed terminal would end them
      before the driver saves; the driver shuts them down itself. A hangup while Ray starts is acted on after.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    term, hup = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    if isinstance(hup, StopHandler):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # inherited through fork and exec
    try:
        yield
    finally:
        now = term if isinstance(term, StopHandler) else signal.getsignal(signal.SIGTERM)
        if now is not None:
            signal.signal(signal.SIGTERM, now)
        if isinstance(hup, StopHandler):
            signal.signal(signal.SIGHUP, hup)
    if isinstance(hup, StopHandler) and drop_hung_up_output():  # the terminal closed while Ray started
        hup(signal.SIGHUP, None)
