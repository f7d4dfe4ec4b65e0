"""benchmarks/compare_commits.py: the same benchmark in a clean copy of each commit, one table with the ratio (run
as a user runs it, in its own process: tests import nothing from benchmarks/)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compare_two_commits_prints_one_table_with_the_ratio(tmp_path):
    bench = ["benchmarks/bench_executors.py", "--kinds", "gqa", "--T", "20", "--branches", "3", "--W", "2",
             "--repeats", "1", "--hidden", "32", "--layers", "1", "--vocab", "64"]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compare_commits.py"), "HEAD", "HEAD",
                        "--rounds", "1", "--out", str(tmp_path), "--metric",
                        r"speedup=gqa(?:\s*\|[^|]*){9}\|\s*([0-9.]+)", "--", *bench],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "command: python " + " ".join(bench) in out and "CPU: " in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| wall s |") or ln.startswith("| speedup |")]
    assert len(rows) == 2 and all(ln.rstrip().endswith("x |") for ln in rows), out
    assert len(os.listdir(tmp_path)) == 2  # each run's output kept
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compare_commits.py"), "HEAD", "HEAD"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
