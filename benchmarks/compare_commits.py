"""Two commits side by side: the same benchmark command run in a clean copy of each, one table with the ratio.

    python benchmarks/compare_commits.py BASE HEAD [--rounds 3] [--metric NAME=REGEX ...] [--out DIR] \
        -- benchmarks/bench_executors.py --kinds gqa --T 256 --branches 16 --W 8 --repeats 3

Each commit is copied with ``git archive`` into a temporary folder (committed files only: a change must be
committed to be measured), and the command runs there with that copy first on ``PYTHONPATH``, so each commit
measures its own code and nothing keeps an old code path alive. Runs alternate (BASE, HEAD, BASE, ...) so that a
change of load on a shared machine hits both alike. The table gives the median wall time of the command and of
each ``--metric`` (the number its regular expression's group captures first in the command's output; e.g. the
speedup column of ``bench_executors.py``'s gqa row: ``--metric 'speedup=gqa(?:\\s*\\|[^|]*){9}\\|\\s*([0-9.]+)'``),
HEAD / BASE, the exact command, the commits and the CPU. ``--out DIR`` keeps every run's output.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()


def cpu_name() -> str:
    """The CPU's model name and its number of cores available here (Linux; else the platform's name)."""
    import platform

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


def checkout(commit: str, into: str) -> str:
    """The committed files of ``commit`` in a new folder under ``into``; returns the folder."""
    folder = os.path.join(into, commit)
    os.makedirs(folder)
    archive = subprocess.Popen(["git", "-C", ROOT, "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", folder], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {commit} failed")
    return folder


def run(folder: str, command: list, timeout: float) -> tuple:
    """(wall seconds, output) of ``command`` run in ``folder`` with that copy first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *command], cwd=folder, env=env, capture_output=True, text=True,
                       timeout=timeout)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{shlex.join(command)} failed in {folder} (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return wall, r.stdout + r.stderr


def parse_metrics(specs: list) -> list:
    out = []
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--metric {spec!r}: give NAME=REGEX (the regex captures one number)")
        out.append((name, re.compile(pattern)))
    return out


def value(pattern, output: str):
    m = pattern.search(output)
    return float(m.group(1)) if m else None


def table(labels: dict, values: dict) -> str:
    """Rows: metric, BASE median, HEAD median, HEAD / BASE."""
    base, head = list(labels)
    lines = [f"| metric | {labels[base]} | {labels[head]} | {head} / {base} |", "|---|---|---|---|"]
    for name, per in values.items():
        b, h = (statistics.median(v) if v and None not in v else None for v in (per[base], per[head]))
        ratio = f"{h / b:.3f}x" if b and h is not None else "-"
        lines.append(f"| {name} | {'-' if b is None else f'{b:.4g}'} | {'-' if h is None else f'{h:.4g}'} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: compare_commits.py BASE HEAD [options] -- SCRIPT [ARGS ...]", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the commit to compare against (any git revision)")
    ap.add_argument("head", help="the commit measured against it")
    ap.add_argument("--rounds", type=int, default=3, help="runs of the command per commit, alternating")
    ap.add_argument("--metric", action="append", default=[], help="NAME=REGEX: a number from the output")
    ap.add_argument("--out", help="keep each run's output in this folder")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    args = ap.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        ap.error("give the benchmark command after --")
    metrics = parse_metrics(args.metric)
    shas = {"BASE": git("rev-parse", "--short", args.base), "HEAD": git("rev-parse", "--short", args.head)}
    labels = {"BASE": f"BASE {args.base} ({shas['BASE']})", "HEAD": f"HEAD {args.head} ({shas['HEAD']})"}
    values = {name: {"BASE": [], "HEAD": []} for name in ["wall s", *(n for n, _ in metrics)]}
    with tempfile.TemporaryDirectory(prefix="specopd-compare-") as tmp:
        full = {"BASE": git("rev-parse", args.base), "HEAD": git("rev-parse", args.head)}
        folders = {"BASE": checkout(full["BASE"], tmp)}
        folders["HEAD"] = folders["BASE"] if full["HEAD"] == full["BASE"] else checkout(full["HEAD"], tmp)
        for k, folder in folders.items():
            if not os.path.isfile(os.path.join(folder, command[0])):
                raise SystemExit(f"{command[0]} does not exist at {labels[k]}")
        for i in range(args.rounds):
            for k in (("BASE", "HEAD") if i % 2 == 0 else ("HEAD", "BASE")):
                wall, output = run(folders[k], command, args.timeout)
                values["wall s"][k].append(wall)
                for name, pattern in metrics:
                    values[name][k].append(value(pattern, output))
                print(f"round {i + 1} {labels[k]}: {wall:.1f} s", flush=True)
                if args.out:
                    os.makedirs(args.out, exist_ok=True)
                    with open(os.path.join(args.out, f"{k.lower()}-{shas[k]}-round{i + 1}.txt"), "w") as f:
                        f.write(output)
    print()
    print(f"command: python {shlex.join(command)}")
    print(f"commits: BASE {args.base} = {shas['BASE']}, HEAD {args.head} = {shas['HEAD']}; {args.rounds} rounds each, "
          f"alternating; medians")
    print(f"CPU: {cpu_name()}")
    print(table(labels, values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
