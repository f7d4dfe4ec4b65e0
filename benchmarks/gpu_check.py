"""The Python side of benchmarks/gpu_check.sh, one subcommand per job:

    python benchmarks/gpu_check.py env                                  # cheap facts, one per line, before any compile
    python benchmarks/gpu_check.py pytest [--one-autotune-config] ARGS  # pytest.main(ARGS), a cut keeps its report
    python benchmarks/gpu_check.py summary --work W --out D --mode M [--final]

``pytest``: SIGINT (the step's time limit) raises KeyboardInterrupt whatever the process inherited, so pytest still
writes its JUnit report and summary; ``--one-autotune-config`` keeps every Triton autotuner's first config
(``tests/fla_shims.first_config_only``: fla's correctness without its tuning). ``summary`` writes D/summary.json
from the step table and step records gpu_check.sh keeps in W (plan.txt, steps.txt), the JUnit reports and benchmark
rows in D and the step logs in W: per step answered / failed / cut / skipped / not reached, and per question the
same; ``--final`` also prints it (the log's last lines).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from specopd.errors import write_replace  # noqa: E402  (after the checkout is on sys.path)

QUESTIONS = {
    "setup": "the carried wheels install (no network there)",
    "a": "environment: versions, the GPU, which packages import",
    "b": "our kernels against torch (fp32 IEEE, bf16) per attention kind; flex fwd + bwd really run; the fused loss",
    "c": "a SpecOPD and a fair Draft-OPD step at Qwen3-8B size: supervised tokens/s, phases, GPU activity, "
         "peak memory against the plan",
    "d": "fla's own path: correct (one config per kernel), and how long its autotuning takes",
    "speed": "the kernels' speed at the recipes' shapes",
    "vllm": "a DFlash V2 export served by vLLM on the GPU against our counters (--vllm-v2)",
}
JUNIT = {"kernels": "tests.xml", "flex": "tests_flex.xml", "fla": "tests_fla.xml"}  # step -> its report in D
ROWS = {"train_step": "gpu_step.json", "bench_kernels": "bench_kernels.json"}  # step -> its rows in D
CUT_RCS = {"124", "137"}  # timeout's exit codes: the limit was reached (SIGINT, then KILL after the grace)
SKIP_RC = "3"  # a step that lacks what it needs (a wheel) says so and exits 3


# ---------------------------------------------------------------------------------------------- env
def env() -> int:
    """Versions, the GPU and which optional packages import: find_spec only (no import, no compile)."""
    import platform

    def line(k, v):
        print(f"{k}: {v}", flush=True)

    line("python", platform.python_version())
    import torch

    line("torch", f"{torch.__version__} (cuda {torch.version.cuda})")
    line("torch fp32 TF32", f"matmul {torch.backends.cuda.matmul.allow_tf32}, cudnn {torch.backends.cudnn.allow_tf32}"
         " (a fp32 reference on CUDA is exact only where False)")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        line("gpu", f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
    else:
        line("gpu", "none (torch.cuda.is_available() is False)")
    for mod in ("triton", "omegaconf", "fla", "flash_attn", "pynvml", "yaml", "einops", "transformers", "ray"):
        line(f"import {mod}", _where(mod))
    line("torch varlen_attn", "yes" if _spec("torch.nn.attention.varlen") else "no")
    from specopd.profiling import gpu_unavailable_reason

    line("nvml", gpu_unavailable_reason() or "samples this GPU")
    for k in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "TRITON_F32_DEFAULT", "PYTHONPATH"):
        line(f"env {k}", os.environ.get(k, "-"))
    return 0


def _spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _where(mod: str) -> str:
    spec = _spec(mod)
    if spec is None:
        return "no"
    from importlib.metadata import PackageNotFoundError, version

    dist = {"fla": "fla-core", "yaml": "PyYAML", "pynvml": "nvidia-ml-py", "flash_attn": "flash-attn"}.get(mod, mod)
    try:
        ver = version(dist)
    except PackageNotFoundError:
        ver = "?"
    return f"yes {ver} ({os.path.dirname(spec.origin or '') or spec.submodule_search_locations})"


# ---------------------------------------------------------------------------------------------- pytest
class StopAtSignal:
    """pytest plugin: once SIGINT has come, the session stops after the current test, also when the
    KeyboardInterrupt itself was swallowed (raised inside a ``__del__`` or a thread's callback)."""

    def __init__(self):
        self.session, self.hit = None, False

    def pytest_sessionstart(self, session):
        self.session = session

    def pytest_runtest_logfinish(self, nodeid, location):  # noqa: ARG002 - pytest's hook signature
        if self.hit and self.session is not None:
            self.session.shouldstop = "SIGINT (the step's time limit)"


def run_pytest(argv: list) -> int:
    stop = StopAtSignal()

    def interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
        stop.hit = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    if argv[:1] == ["--one-autotune-config"]:
        argv = argv[1:]
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import fla_shims  # tests/fla_shims.py

        fla_shims.first_config_only()
    import pytest

    return int(pytest.main(argv, plugins=[stop]))


# ---------------------------------------------------------------------------------------------- summary
def read_plan(work: str) -> list:
    """[(step, limit_s, question)] in run order, as gpu_check.sh wrote them."""
    with open(os.path.join(work, "plan.txt")) as f:
        return [(p[0], int(p[1]), p[2]) for p in (line.split() for line in f) if len(p) >= 3]


def read_records(work: str) -> dict:
    """{step: {"limit": s, "rc": str | None, "seconds": int | None}} from steps.txt ("start NAME LIMIT" and
    "end NAME RC SECONDS" lines)."""
    out: dict = {}
    path = os.path.join(work, "steps.txt")
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for p in (line.split() for line in f):
            if p[:1] == ["start"] and len(p) >= 3:
                out[p[1]] = {"limit": int(p[2]), "rc": None, "seconds": None}
            elif p[:1] == ["end"] and len(p) >= 4 and p[1] in out:
                out[p[1]].update(rc=p[2], seconds=int(p[3]))
    return out


def junit(path: str) -> dict:
    """Counts and the failed tests of a pytest JUnit report."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    n["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None][:30]
    return n


def autotune_lines(log: str) -> dict:
    """Triton's TRITON_PRINT_AUTOTUNING lines in a step log: kernels tuned and their seconds."""
    fns = re.findall(r"Triton autotuning for function (\S+?),", log)
    secs = [float(x) for x in re.findall(r"finished after ([0-9.]+)s", log)]
    return {"kernels_tuned": len(fns), "seconds": round(sum(secs), 2), "per_kernel": list(zip(fns, secs))}


def detail(step: str, work: str, out: str) -> dict:
    """What a step left behind: test counts, benchmark rows, env lines, autotuning times."""
    d: dict = {}
    if step in JUNIT and os.path.exists(os.path.join(out, JUNIT[step])):
        try:
            d["tests"] = junit(os.path.join(out, JUNIT[step]))
        except ET.ParseError as e:
            d["tests"] = f"unreadable report: {e}"
    if step in ROWS and os.path.exists(os.path.join(out, ROWS[step])):
        with open(os.path.join(out, ROWS[step])) as f:
            doc = json.load(f)
        rows = doc["rows"] if isinstance(doc, dict) else doc
        d["rows"] = len(rows)
        d["errors"] = [r for r in rows if "error" in r]
        if step == "train_step":
            d["results"] = [r for r in rows if r.get("kind") in ("setup", "method", "result", "cut")]
    log = os.path.join(work, f"{step}.log")
    if os.path.exists(log):
        with open(log, errors="replace") as f:
            text = f.read()
        if step == "env":
            d["facts"] = [x for x in text.splitlines() if ": " in x and not x.startswith("==")]
        if step == "fla_autotune":
            d["triton_autotuning"] = autotune_lines(text)
            d["rows"] = [json.loads(x) for x in text.splitlines() if x.startswith("{\"kind\"")]
        if step in ("wheels",) or "lacks:" in text:
            d["notes"] = [x for x in text.splitlines() if "lacks:" in x or "installed" in x][:10]
    return d


def step_status(rec, mode: str, d: dict) -> str:
    if rec is None:
        return "not reached"
    rc = rec["rc"]
    if rc is None:
        return "cut (the call ended during it)"
    if rc in CUT_RCS:
        return "cut at its limit"
    if rc == SKIP_RC:
        return "skipped (lacks what it needs)"
    if rc != "0":
        return "failed"
    t = d.get("tests")
    if mode == "gpu" and isinstance(t, dict) and t["passed"] == 0:
        return "failed (no test passed: every one skipped?)"
    return "answered"


def question_status(states: list) -> str:
    """answered: every step answered; failed: one failed or was cut; else not reached (one never ran or lacked
    what it needs)."""
    if all(s == "answered" for s in states):
        return "answered"
    if any(s.startswith(("failed", "cut")) for s in states):
        return "failed"
    return "not reached"


def summary(work: str, out: str, mode: str, final: bool, wall: int) -> int:
    plan, recs = read_plan(work), read_records(work)
    steps = []
    for name, limit, q in plan:
        d = detail(name, work, out)
        rec = recs.get(name)
        steps.append(dict(step=name, question=q, limit_s=limit, status=step_status(rec, mode, d),
                          rc=rec and rec["rc"], seconds=rec and rec["seconds"], detail=d))
    questions = {}
    for q in dict.fromkeys(s["question"] for s in steps):
        mine = [s for s in steps if s["question"] == q]
        questions[q] = {"question": QUESTIONS.get(q, q), "status": question_status([s["status"] for s in mine]),
                        "steps": {s["step"]: s["status"] for s in mine}}
    doc = {"mode": mode, "wall_s": wall, "plan_total_s": sum(p[1] for p in plan), "questions": questions,
           "steps": steps}
    write_replace(os.path.join(out, "summary.json"), json.dumps(doc, indent=1, default=str))
    if not final:
        return 0
    print(f"gpu_check ({mode}) done in {wall} s (plan {doc['plan_total_s']} s); summary: {out}/summary.json")
    for s in steps:
        t = s["detail"].get("tests")
        tests = (f"  [{t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped]"
                 if isinstance(t, dict) else "")
        print(f"  step {s['step']:<16} {s['status']:<32} rc={s['rc']} {s['seconds']} s / {s['limit_s']} s{tests}")
    for q, v in questions.items():
        print(f"  question {q:<6} {v['status']:<12} {v['question']}")
    return 0 if all(v["status"] == "answered" for v in questions.values()) else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["env"]:
        return env()
    if argv[:1] == ["pytest"]:
        return run_pytest(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", choices=["summary"])
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--wall", type=int, default=0)
    ap.add_argument("--final", action="store_true")
    a = ap.parse_args(argv)
    return summary(a.work, a.out, a.mode, a.final, a.wall)


if __name__ == "__main__":
    sys.exit(main())
