"""SIGTERM and SIGHUP (a kill; a closed terminal or ssh session) stop a run as Ctrl-C does: the checkpoint of the
completed steps is written, the workers, Ray and every process it started are shut down, and the CLI exits with
128 + the signal; the rerun resumes bitwise. A SIGTERM under tensor parallelism never ends in SIGABRT (Ray's
3 s alarm, dropped by ``specopd.signals.starting_ray``)."""
import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time

import pytest
import torch

from specopd.runs import checkpoint as ck
from specopd.signals import StopHandler
from specopd.train import phases
from specopd.train.checkpointer import Checkpointer
from tests.test_faults import STEPS, _args, _cli, _metrics, _same, _weights, straight  # noqa: F401 (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = ["runtime.backend=ray", "runtime.num_workers=1", "runtime.cpus_per_worker=1"]
LONG = "trainer.max_steps=100000"  # never done before the signal
# the CLI with Ray's shutdown held 4 s first (a slow machine): longer than the alarm Ray arms on SIGTERM
SLOW_SHUTDOWN = """import sys, time
from specopd.distributed.ray_backend import RayGroup
real = RayGroup.shutdown
def slow(self):
    if not self.closed:
        time.sleep(4)
    real(self)
RayGroup.shutdown = slow
from specopd.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(autouse=True)
def stop_signals_not_ignored():
    """These tests stop runs with SIGHUP and SIGINT. A test run started under ``nohup`` ignores SIGHUP, one started
    in the background by a shell without job control ignores SIGINT, and so does every child it starts (an ignored
    signal survives exec): the CLI then rightly keeps them ignored, which is another test's subject
    (``test_a_run_under_nohup_ignores_sighup``). Each test starts from Python's own dispositions."""
    before = (signal.signal(signal.SIGHUP, signal.SIG_DFL), signal.signal(signal.SIGINT, signal.default_int_handler))
    yield
    signal.signal(signal.SIGHUP, before[0])
    signal.signal(signal.SIGINT, before[1])


def _send_at_step(monkeypatch, sig: int, step: int, during_save: int = 0, as_ray: bool = False):
    """``sig`` to this process while step ``step`` runs (and ``during_save`` while the checkpoint is written);
    ``as_ray``: its exception turned into a plain KeyboardInterrupt, as ray.get / ray.wait do."""
    real_step, real_save = phases.colocated_step, Checkpointer.save
    calls = {"n": 0}

    def train_step(worker, *a):
        calls["n"] += 1
        if calls["n"] == step:
            h = signal.getsignal(sig)
            assert isinstance(h, StopHandler) or h == signal.SIG_IGN, f"the CLI left {sig} to {h}"
            try:
                os.kill(os.getpid(), sig)
            except KeyboardInterrupt:
                if not as_ray:
                    raise
                raise KeyboardInterrupt() from None
        return real_step(worker, *a)

    def save(self, group):
        if during_save:
            assert isinstance(signal.getsignal(during_save), StopHandler), "the CLI left this signal to another"
            os.kill(os.getpid(), during_save)
        return real_save(self, group)

    monkeypatch.setattr(phases, "colocated_step", train_step)
    monkeypatch.setattr(Checkpointer, "save", save)


@pytest.mark.parametrize("sig,as_ray", [(signal.SIGHUP, False), (signal.SIGTERM, False), (signal.SIGTERM, True)],
                         ids=["SIGHUP", "SIGTERM", "SIGTERM-as-Ray-raises-it"])
def test_a_stop_signal_checkpoints_the_completed_steps_and_resumes_bitwise(straight, tmp_path, monkeypatch, capsys,
                                                                           sig, as_ray):
    """SIGHUP / SIGTERM during step 3: the checkpoint of step 2 (a second stop signal during its save is ignored),
    exit 128 + the signal, the handlers put back; the rerun ends bitwise equal to an uninterrupted run. Also when
    Ray raises the signal's exception as a plain KeyboardInterrupt."""
    name = signal.Signals(sig).name
    other = signal.SIGTERM if sig == signal.SIGHUP else signal.SIGHUP
    _send_at_step(monkeypatch, sig, 3, during_save=other, as_ray=as_ray)
    out = tmp_path / "run"
    before = [signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM)]  # e.g. Ray's, after an in-process ray.init
    rc, stdout, err = _cli(capsys, out)
    assert rc == 128 + sig, err
    assert f"run interrupted by {name}; checkpoint of step 2 written to {out}" in stdout
    assert f"specopd: error: interrupted by {name}" in err and "Traceback" not in err
    assert ck.find_latest(str(out)).endswith("step-2") and ck.verify(ck.find_latest(str(out))) is None
    assert [signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM)] == before  # put back
    monkeypatch.undo()
    rc, stdout, err = _cli(capsys, out)
    assert rc == 0, err
    assert _same(_weights(ck.find_latest(str(out))), _weights(ck.find_latest(straight)))
    assert [m["step"] for m in _metrics(out)] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stop_inside_the_optimizer_step_waits_for_its_end(straight, tmp_path, monkeypatch, capsys, sig):
    """A stop that arrives between step 3's AdamW update and its step count is raised once the count is done:
    the checkpoint is of step 3 as it is (not step 3's weights labelled step 2) and the rerun is bitwise."""
    real = torch.optim.lr_scheduler.LambdaLR.step
    calls = {"n": 0}

    def scheduler_step(self, *a, **k):
        calls["n"] += 1  # 1: the scheduler's construction, then one per step
        if calls["n"] == 4:
            os.kill(os.getpid(), sig)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", scheduler_step)
    out = tmp_path / "run"
    rc, stdout, err = _cli(capsys, out)
    assert rc == 128 + sig, err
    assert f"checkpoint of step 3 written to {out}" in stdout
    monkeypatch.undo()
    rc, _, err = _cli(capsys, out)
    assert rc == 0, err
    assert _same(_weights(ck.find_latest(str(out))), _weights(ck.find_latest(straight)))


def test_a_run_under_nohup_ignores_sighup(tmp_path, monkeypatch, capsys):
    """SIGHUP set to be ignored before the CLI starts (``nohup``) stays ignored: the run finishes."""
    _send_at_step(monkeypatch, signal.SIGHUP, 3)
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        rc, _, err = _cli(capsys, tmp_path / "run")
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
    assert rc == 0, err
    assert ck.find_latest(str(tmp_path / "run")).endswith(f"step-{STEPS}")


def test_a_handler_left_by_someone_else_is_replaced_for_the_command_and_put_back(tmp_path, monkeypatch, capsys):
    """A SIGTERM handler set before the CLI runs (an earlier in-process ``ray.init`` leaves one that exits with 15,
    or a script calling ``main`` set its own) is replaced while the command runs, so the run stops with its
    checkpoint and 143, and is put back after."""
    called = []

    def theirs(signum, frame):
        called.append(signum)

    _send_at_step(monkeypatch, signal.SIGTERM, 3)
    before = signal.signal(signal.SIGTERM, theirs)
    try:
        rc, stdout, err = _cli(capsys, tmp_path / "run")
        assert signal.getsignal(signal.SIGTERM) is theirs
    finally:
        signal.signal(signal.SIGTERM, before)
    assert rc == 143 and not called, err
    assert f"checkpoint of step 2 written to {tmp_path / 'run'}" in stdout


# ---------------------------------------------------------------------------------------------- as processes
class Run:
    """``specopd train`` in a session of its own (``terminal``: with a pty as its controlling terminal, as in a
    shell); ``code``: a ``python -c`` program that stands for ``python -m specopd.cli``."""

    def __init__(self, tmp_path, extra: list, terminal: bool, code: str = ""):
        self.out = str(tmp_path / "run")
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text("seed: 0\n")
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        cmd = [sys.executable] + (["-c", code] if code else ["-m", "specopd.cli"])
        cmd += ["train", str(recipe), *_args(self.out, *extra)]
        self.seen, self.log = b"", None
        if terminal:
            self.master, slave = pty.openpty()
            self.p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave,
                                      start_new_session=True,
                                      preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
            os.close(slave)
        else:
            self.master, self.log = None, tmp_path / "log.txt"
            with open(self.log, "wb") as log:
                self.p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def drain(self, timeout: float) -> None:
        """Read the terminal (a full pty blocks the run) for up to ``timeout`` seconds."""
        if self.master is None:
            return time.sleep(timeout)
        if select.select([self.master], [], [], timeout)[0]:
            try:
                self.seen += os.read(self.master, 1 << 16)
            except OSError:  # the run closed its side
                time.sleep(timeout)

    def output(self) -> str:
        if self.log is not None:
            self.seen = self.log.read_bytes()
        return self.seen.decode(errors="replace")[-3000:]

    def wait_for_steps(self, n: int, limit_s: float = 300) -> None:
        path, end = os.path.join(self.out, "metrics.jsonl"), time.time() + limit_s
        while not (os.path.isfile(path) and len(open(path).readlines()) >= n):
            if self.p.poll() is not None or time.time() > end:
                self.p.kill()
                pytest.fail(f"no {n} steps (exit {self.p.poll()}):\n{self.output()}")
            self.drain(0.2)

    def hang_up(self) -> None:
        """Close the terminal, as a closed window or ssh session does: the kernel sends SIGHUP to the session's
        leader (here the run) and later writes to the terminal fail; the shell, which leads the session in real
        life, sends SIGHUP to its foreground job: the run's process group, Ray's raylet, GCS and agents in it."""
        os.close(self.master)
        self.master = None
        os.killpg(self.p.pid, signal.SIGHUP)

    def wait(self, limit_s: float = 120) -> int:
        end = time.time() + limit_s
        while self.p.poll() is None and time.time() < end:
            self.drain(0.2)
        if self.p.poll() is None:
            self.p.kill()
            pytest.fail(f"still running {limit_s:g} s after the signal:\n{self.output()}")
        return self.p.returncode

    def left(self, limit_s: float = 20) -> list:
        """The live processes of the run's session (Ray's included), waiting up to ``limit_s`` for them to go."""
        end = time.time() + limit_s
        while True:
            alive = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    stat = open(f"/proc/{pid}/stat").read()
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                state, _, _, session = stat.rpartition(")")[2].split()[:4]
                if int(session) == self.p.pid and state != "Z":  # a zombie has ended
                    alive.append(f"{pid} {cmd[:120]}")
            if not alive or time.time() > end:
                return alive
            time.sleep(0.5)

    def checkpoint_step(self) -> int:
        d = ck.find_latest(self.out)
        assert d is not None and ck.verify(d) is None, d
        return int(os.path.basename(d).split("-")[1])


def test_a_closed_terminal_stops_a_local_run_with_its_checkpoint(tmp_path):
    """The run's terminal closes (the kernel's SIGHUP; every later write to it fails): exit 129, a checkpoint of
    the completed steps that verifies."""
    run = Run(tmp_path, [LONG], terminal=True)
    run.wait_for_steps(3)
    run.hang_up()
    assert run.wait() == 128 + signal.SIGHUP
    assert run.checkpoint_step() >= 3
    assert run.left() == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["terminal", "kill"])
def test_sighup_to_a_ray_driver_checkpoints_and_leaves_no_process(tmp_path, how):
    """A Ray run's terminal closes (SIGHUP to the driver, the raylet, GCS and agents in its process group) or the
    driver alone gets SIGHUP: exit 129, a checkpoint of the completed steps, and no process of the run left
    (ray::DashboardAgent, ray::RuntimeEnvAgent, workers)."""
    run = Run(tmp_path, RAY + [LONG], terminal=True)
    run.wait_for_steps(3)
    if how == "terminal":
        run.hang_up()
    else:
        run.p.send_signal(signal.SIGHUP)
    assert run.wait() == 128 + signal.SIGHUP, run.output()
    assert run.checkpoint_step() >= 3
    assert run.left() == []


@pytest.mark.slow
def test_sigterm_under_tensor_parallel_never_aborts(tmp_path):
    """SIGTERM to the driver of a runtime.tensor_parallel=2 run, three times (each resuming the one before), its
    shutdown held 4 s: Ray armed a 3 s SIGABRT alarm with every SIGTERM, which a slower exit ran into. Each run
    exits 143 with a checkpoint of its completed steps and leaves no process."""
    done = 0
    for _ in range(3):
        run = Run(tmp_path, RAY + ["runtime.tensor_parallel=2", LONG], terminal=False, code=SLOW_SHUTDOWN)
        run.wait_for_steps(done + 2)
        run.p.send_signal(signal.SIGTERM)
        assert run.wait() == 128 + signal.SIGTERM, run.output()
        assert "SIGTERM received" not in run.output()  # Ray's handler, which armed the alarm, never ran
        assert run.checkpoint_step() >= done + 2
        done = run.checkpoint_step()
        assert run.left() == []
