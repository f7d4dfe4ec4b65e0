"""CPU use of the main job per stage: how many cores each stage keeps busy, and who (our process, Ray, vLLM).

    python benchmarks/stage_cpu.py [--json OUT.json] [--log OUT.log] -- \
        specopd train recipes/smollm2-135m-dflash.yaml trainer.max_steps=4 eval.prompts=8 eval.max_new_tokens=16

    python benchmarks/stage_cpu.py --tables BEFORE.log AFTER.log   # the printed tables of two runs: identical?

Runs the command, passes its output through (and into ``--log``), and samples the CPU time of its whole process
tree (the job, Ray's processes, vLLM's) every ``--interval`` seconds with psutil. A stage starts at the job's
``[specopd] == N/5 ...`` line and ends at the next (the last one, export included, at the command's end). Per
stage it prints the wall time, the CPU seconds and their ratio: the cores kept busy on average (2.0 = both cores of
a 2-core machine). CPU time is counted per process (its own, not its children's), so a machine shared with other
work lowers the wall-clock numbers but not who used what; compare before / after runs taken alternately.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

import psutil

STAGE = re.compile(r"^\[specopd\] == (?:\d+/\d+ )?(.*)")
TABLES = re.compile(r"^(vLLM judge: |Acceptance length)")
TABLE_END = re.compile(r"^(verdict: |final drafter: )")
NOT_NUMBERS = re.compile(r"^(measured |vLLM tokens/s: )")  # when and how fast: not the job's result


def tables(path: str) -> list:
    """The result lines a main-job log prints (vLLM's judge blocks, the before / after table), without the date,
    commit and speed lines, its output folder written as <out>."""
    text = open(path).read()
    m = re.search(r"log in (\S+)/vllm-judge/vllm", text) or re.search(r"final drafter:\s+(\S+)/checkpoints/", text)
    out, keep, lines = (m.group(1) if m else None), False, []
    for line in text.splitlines():
        keep = keep or bool(TABLES.match(line))
        if keep and not NOT_NUMBERS.match(line):
            lines.append(line.replace(out, "<out>") if out else line)
        if TABLE_END.match(line):
            keep = False
    return lines


def compare_tables(a: str, b: str) -> int:
    """Prints the result lines of two logs that differ; 0 when every one is identical."""
    import difflib

    la, lb = tables(a), tables(b)
    if not la:
        print(f"{a}: no result tables found")
        return 1
    diff = list(difflib.unified_diff(la, lb, a, b, lineterm="", n=0))
    print("\n".join(diff) if diff else f"identical: the {len(la)} result lines of {a} and {b}")
    return 1 if diff else 0


def group_of(proc: psutil.Process, root_pid: int) -> str:
    """Who a process is: vllm (the vLLM runner and its children), ray (Ray's processes and workers), job (the
    command itself), other."""
    try:
        chain = [proc] + proc.parents()
        lines = [" ".join(p.cmdline()) for p in chain if p.pid != root_pid]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    if proc.pid == root_pid:
        return "job"
    if any("vllm_runner" in c or "vllm" in c.split(" ")[0] for c in lines):
        return "vllm"
    if any("ray" in c or "raylet" in c or "gcs_server" in c for c in lines):
        return "ray"
    return "other"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--json", help="write the per-stage numbers here")
    p.add_argument("--log", help="write the command's output here too")
    p.add_argument("--tables", nargs=2, metavar=("A.log", "B.log"),
                   help="compare the result lines two runs printed instead (exit 1 when any differs)")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.tables:
        return compare_tables(*a.tables)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("give the command after --")
    t_start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    stages = [{"stage": "start", "t0": 0.0}]
    log = open(a.log, "w") if a.log else None

    def read():
        for line in proc.stdout:
            sys.stdout.write(line)
            if log:
                log.write(line)
            m = STAGE.match(line)
            if m:
                stages.append({"stage": m.group(1).strip(), "t0": time.perf_counter() - t_start})

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    root = psutil.Process(proc.pid)
    seen: dict = {}  # (pid, create_time) -> (cpu seconds so far, group)
    cpu: dict = {}  # stage index -> group -> cpu seconds

    def sample():
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        here = cpu.setdefault(len(stages) - 1, {})
        for q in procs:
            try:
                key = (q.pid, q.create_time())
                t = q.cpu_times()
                now = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            was, g = seen.get(key, (0.0, None))
            g = g or group_of(q, root.pid)
            seen[key] = (now, g)
            here[g] = here.get(g, 0.0) + max(0.0, now - was)

    while proc.poll() is None:
        sample()
        time.sleep(a.interval)
    reader.join()
    end = time.perf_counter() - t_start
    rows = []
    for i, s in enumerate(stages):
        wall = (stages[i + 1]["t0"] if i + 1 < len(stages) else end) - s["t0"]
        by = {g: round(v, 1) for g, v in sorted(cpu.get(i, {}).items())}
        total = sum(cpu.get(i, {}).values())
        rows.append({"stage": s["stage"], "wall_s": round(wall, 1), "cpu_s": round(total, 1),
                     "cores_busy": round(total / wall, 2) if wall > 0 else None, "cpu_s_by": by})
    total_cpu = sum(r["cpu_s"] for r in rows)
    print(f"\nCPU use per stage ({os.cpu_count()} cores here; cores busy = CPU s / wall s of the job's process tree)")
    print(f"{'stage':<60}{'wall s':>9}{'CPU s':>9}{'cores':>7}  CPU s by process")
    for r in rows:
        print(f"{r['stage'][:58]:<60}{r['wall_s']:>9.1f}{r['cpu_s']:>9.1f}{(r['cores_busy'] or 0):>7.2f}  "
              + ", ".join(f"{g} {v:.1f}" for g, v in r["cpu_s_by"].items()))
    print(f"{'total':<60}{end:>9.1f}{total_cpu:>9.1f}{total_cpu / max(end, 1e-9):>7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cmd": cmd, "rc": proc.returncode, "wall_s": round(end, 1), "stages": rows,
                       "cores": os.cpu_count()}, f, indent=1)
    if log:
        log.close()
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
