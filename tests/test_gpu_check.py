"""benchmarks/gpu_check.sh, the one-call GPU check: its plan fits the call (330 s, so that a corrected rerun fits
the 15 minutes of device time), fla's steps come last, every file it reads travels with the call (tracked by git,
or under a path the call carries), its wheels are pinned, its summary says answered / failed / cut / not reached
per step and per question, the random target it trains on is the tiny targets' construction, and (slow) its CPU
rehearsal walks every step. The scripts run as programs: tests import nothing from benchmarks/."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
PLAN_LIMIT_S = 330  # one call, so that a corrected rerun and two machine starts fit 15 minutes of device time
CPU_SMOKE_LIMIT_S = 900  # the CPU rehearsal: within 15 minutes on 2 cores
REPO_PATH = re.compile(r"(?<![\w./$-])((?:benchmarks|tests|recipes|specopd|kernels|executors)/[\w./*-]*[\w*]|\.\w+/)")


def plan(*flags) -> tuple:
    """([(step, limit_s, question)], total) from ``gpu_check.sh --plan``."""
    out = subprocess.run(["bash", SCRIPT, "--plan", *flags], capture_output=True, text=True, check=True).stdout
    rows = [(m[1], int(m[2]), m[3]) for m in re.finditer(r"^(\S+)\s+(\d+) s\s+(\S+)$", out, re.M)]
    total = re.search(r"^total (\d+) s$", out, re.M)
    assert rows and total, out
    return rows, int(total[1])


def test_plan_fits_one_call_and_runs_fla_last():
    rows, total = plan()
    assert sum(r[1] for r in rows) == total <= PLAN_LIMIT_S
    assert all(r[1] > 0 for r in rows)
    questions = [q for _, _, q in rows if q in "abcd"]  # in order of value: environment, kernels, the step, fla
    assert questions == sorted(questions) and questions[0] == "a" and rows[-1][2] == "d", rows
    assert rows[0][0] == "wheels"  # what the others import is installed first


def test_cpu_rehearsal_plan_fits_fifteen_minutes():
    rows, total = plan("--cpu-smoke")
    assert [r[0] for r in rows] == [r[0] for r in plan()[0]]  # the same steps
    assert total <= CPU_SMOKE_LIMIT_S


def carried(script: str) -> list:
    m = re.search(r"^CARRY=\(([^)]*)\)", script, re.M)
    assert m, "gpu_check.sh declares the paths its call carries: CARRY=(...)"
    return m[1].split()


def untravelled_reads(script: str, tracked: set, carry: list) -> list:
    """Repository paths named in ``script`` that are neither tracked (a glob must match a tracked file) nor under
    a carried path: what the device call would not bring along."""
    bad = []
    for path in sorted(set(REPO_PATH.findall(script))):
        if any(path == c + "/" or path.startswith(c + "/") for c in carry):
            continue
        pat = re.compile(re.escape(path).replace(r"\*", "[^/]*") + "$")
        if not any(pat.match(t) for t in tracked):
            bad.append(path)
    return bad


def tracked_files() -> set:
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")) and \
            not os.path.isfile(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_every_file_the_check_reads_is_tracked_or_carried():
    with open(SCRIPT) as f:
        script = f.read()
    tracked = tracked_files()
    assert untravelled_reads(script, tracked, carried(script)) == []
    assert carried(script) == [".whl"]  # the call line of the pending results file carries exactly this


def test_a_read_of_an_untracked_file_is_caught():
    tracked = {"benchmarks/gpu_step.py", "tests/test_fla.py"}
    script = ('limited "$PY" benchmarks/gpu_step.py --recipe recipes/not-tracked.yaml\n'
              'ls .whl/fla_core-*.whl .gl/x.deb tests/test_*.py benchmarks/*.json\n')
    assert untravelled_reads(script, tracked, [".whl"]) == [".gl/", "benchmarks/*.json", "recipes/not-tracked.yaml"]


def test_wheels_are_pinned_one_version_each():
    with open(os.path.join(ROOT, "benchmarks", "gpu_wheels.txt")) as f:
        specs = [line.split("#")[0].split()[0] for line in f if line.split("#")[0].strip()]
    names = [s.split("==")[0] for s in specs]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][\w.]*", s) for s in specs), specs
    assert len(set(names)) == len(names) and {"omegaconf", "fla-core"} <= set(names)


def write_run(work, out, steps: list, records: list, junit: dict) -> None:
    os.makedirs(work, exist_ok=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(work, "plan.txt"), "w") as f:
        f.writelines(f"{n} {lim} {q}\n" for n, lim, q in steps)
    with open(os.path.join(work, "steps.txt"), "w") as f:
        f.writelines(line + "\n" for line in records)
    for name, (passed, failed, skipped) in junit.items():
        cases = (['<testcase classname="t" name="ok"/>'] * passed
                 + ['<testcase classname="t" name="bad"><failure message="x"/></testcase>'] * failed
                 + ['<testcase classname="t" name="skip"><skipped message="x"/></testcase>'] * skipped)
        with open(os.path.join(out, name), "w") as f:
            f.write(f'<testsuites><testsuite tests="{passed + failed + skipped}" failures="{failed}" errors="0" '
                    f'skipped="{skipped}">{"".join(cases)}</testsuite></testsuites>')


def summarize(tmp_path, steps, records, junit, mode="gpu") -> tuple:
    work, out = str(tmp_path / "work"), str(tmp_path / "out")
    write_run(work, out, steps, records, junit)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "summary", "--work", work,
                        "--out", out, "--mode", mode, "--final"], capture_output=True, text=True)
    with open(os.path.join(out, "summary.json")) as f:
        return p, json.load(f)


def test_summary_says_per_step_and_question_answered_failed_cut_or_not_reached(tmp_path):
    steps = [("env", 15, "a"), ("kernels", 80, "b"), ("flex", 40, "b"), ("train_step", 120, "c"),
             ("fla", 25, "d"), ("fla_autotune", 15, "d")]
    records = ["start env 15", "end env 0 3", "start kernels 92", "end kernels 124 92", "start flex 40",
               "end flex 0 30", "start train_step 130", "end train_step 0 100", "start fla 25", "end fla 3 1"]
    p, s = summarize(tmp_path, steps, records, {"tests.xml": (5, 0, 1), "tests_flex.xml": (0, 0, 2)})
    st = {x["step"]: x["status"] for x in s["steps"]}
    assert st == {"env": "answered", "kernels": "cut at its limit",
                  "flex": "failed (no test passed: every one skipped?)", "train_step": "answered",
                  "fla": "skipped (lacks what it needs)", "fla_autotune": "not reached"}
    assert {q: v["status"] for q, v in s["questions"].items()} == {"a": "answered", "b": "failed", "c": "answered",
                                                                   "d": "not reached"}
    kernels = next(x for x in s["steps"] if x["step"] == "kernels")
    assert kernels["detail"]["tests"]["passed"] == 5 and kernels["detail"]["tests"]["skipped"] == 1
    assert p.returncode == 1 and "question b      failed" in p.stdout, p.stdout + p.stderr
    # a step started but never ended (the call was killed during it); on the CPU a skipped test is no failure
    p, s = summarize(tmp_path, steps[:2], ["start env 15", "end env 0 3", "start kernels 92"],
                     {"tests.xml": (0, 0, 3)}, mode="cpu")
    assert [x["status"] for x in s["steps"]] == ["answered", "cut (the call ended during it)"]
    p, s = summarize(tmp_path, steps[:1], ["start env 15", "end env 0 3"], {}, mode="cpu")
    assert p.returncode == 0 and s["questions"]["a"]["status"] == "answered"


def test_random_target_draws_the_tiny_targets_weights_in_place(tmp_path):
    from specopd.models import load_target
    from specopd.models.tiny import build_tiny_target, random_target, tiny_config

    for mt in ("llama", "qwen3_next"):
        ref = load_target(build_tiny_target(mt, str(tmp_path / mt), seed=5), dtype=torch.bfloat16)
        got = random_target(tiny_config(mt, {})[0], dtype="bfloat16", device="cpu", seed=5)
        a, b = ref.state_dict(), got.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        assert got.kernels == "auto" and not any(p.requires_grad for p in got.parameters()) and not got.training


@pytest.mark.slow
def test_cpu_smoke_walks_every_step(tmp_path):
    """The rehearsal end to end (~1-2 minutes on 2 cores): every question answered at toy sizes, the step's table
    has both methods and their ratio, and OUT holds no more files than the device call brings back (8)."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_WORK=str(work), OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    p = subprocess.run(["bash", SCRIPT, "--cpu-smoke", "--out", str(out)], capture_output=True, text=True, env=env,
                       timeout=CPU_SMOKE_LIMIT_S + 60)
    wheels = all(any(f.startswith(n.replace("-", "_") + "-") for f in os.listdir(os.path.join(ROOT, ".whl")))
                 for n in ("omegaconf", "fla-core")) if os.path.isdir(os.path.join(ROOT, ".whl")) else False
    assert p.returncode == (0 if wheels else 1), p.stdout[-4000:] + p.stderr[-2000:]
    with open(out / "summary.json") as f:
        s = json.load(f)
    want = {q: "answered" for q in s["questions"]}
    want["setup"] = "answered" if wheels else "not reached"  # no .whl here: the wheels step names what it lacks
    assert {q: v["status"] for q, v in s["questions"].items()} == want, s["questions"]
    with open(out / "gpu_step.json") as f:
        rows = json.load(f)["rows"]
    assert {r["method"] for r in rows if r["kind"] == "method"} == {"specopd", "draft_opd"}
    assert next(r for r in rows if r["kind"] == "result")["ratio"] > 0
    assert next(r for r in rows if r["kind"] == "setup")["read_by"].startswith("PyYAML")  # as without omegaconf
    assert len(os.listdir(out)) <= 8
