#!/usr/bin/env bash
# The GPU check in one command (one H200: <= 8 minutes, no network; see benchmarks/results/2026-12-01-h200-gpu-check-pending.md).
#
#   bash benchmarks/gpu_check.sh [--out DIR]               # on the GPU machine (CUDA)
#   bash benchmarks/gpu_check.sh --cpu-smoke [--out DIR]   # here: every step at toy sizes on the CPU
#   bash benchmarks/gpu_check.sh --vllm-v2 [--out DIR]     # on the GPU machine: the vllm_dflash2 step alone
#
# Steps (each under its own time limit, together 550 s on the GPU; a failing step does not stop the others; the
# exit code is non-zero if any failed). Limits from compile times measured on the CPU (no GPU run yet): our Triton
# kernels compile in ~2.3 s each for sm_90 (benchmarks/aot_check.py, triton 3.6: 23 in 52 s on one core), fla's
# recorded launches in ~4.6 s each (tests/test_fla.py: 6 in 28 s); fla autotunes 42 configs per shape: ~100-200 s
# on its first shape (the env step's fla_verified), hence env 90 s + tests 200 s; bench rows are written as each
# finishes, so a step cut by its limit still reports what it measured. Move seconds after the first run.
#   wheels          pip-installs .whl/*.whl (fla-core, omegaconf, antlr4-python3-runtime; carried in the working
#                   tree, see that results file) into a target folder on PYTHONPATH: that machine has no network
#   env             versions: torch, triton, GPU, fla, flash-attn, torch varlen_attn
#   tests           pytest -m gpu -v -rA: executors' Triton kernels vs torch (fp32 exact, bf16 noise), packed
#                   prefill (backend asserted), fla vs our chunk kernel and the recurrence (tests/test_fla.py),
#                   drafter flex_attention fwd + bwd, the fused loss on CUDA, the kernels' own bf16 checks
#   bench_kernels   benchmarks/bench_kernels.py at the 8B / 27B / qwen4_exp shapes (TFLOP/s, GB/s) -> JSON
#   bench_executors benchmarks/bench_executors.py: whole-target prefill + score, kernels torch vs triton -> JSON
#   train           3 SpecOPD steps of recipes/tiny.yaml on the GPU, in-process (runtime.backend=local: no Ray)
#   vllm_dflash2    (--vllm-v2 only, its own command: <= 300 s, beyond the 550 s above) NOT RUN YET on a GPU:
#                   benchmarks/vllm_v2_check.py trains a tiny DFlash V2 drafter, exports it, serves it in vLLM on the
#                   first GPU ($SPECOPD_VLLM_PYTHON: a GPU build of vLLM >= 0.32; model runner V2, the only one with
#                   the DFlash2 speculator) and compares vLLM's counters with ours (specopd serve-check's judge);
#                   rc 3 = skipped (no vLLM there). The CPU's vLLM cannot draft with V2: no CPU-smoke form.
# OUT (--out, default $OUT if set, else /tmp/specopd-gpu-check) receives three files (the device tool brings back
# at most 8): gpu_check.log (everything printed), tests.xml (pytest's JUnit report) and summary.json (each step's
# exit code and seconds, the env report and both benchmarks' JSON rows). Step logs, benchmark JSON and the
# training run are written under WORK (default /tmp/specopd-gpu-check-work).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
DEST="${OUT:-/tmp/specopd-gpu-check}"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) MODE=cpu ;;
    --vllm-v2) MODE=vllm_v2 ;;
    --out) DEST="$2"; shift ;;
    -h|--help) sed -n 2,26p "$0"; exit 0 ;;
    *) echo "unknown argument $1 (use --cpu-smoke, --vllm-v2, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
WORK="${GPU_CHECK_WORK:-/tmp/specopd-gpu-check-work}"
mkdir -p "$DEST" "$WORK"
rm -f "$WORK"/*.json "$WORK"/*.log
: > "$WORK/steps.txt"
exec > >(tee "$DEST/gpu_check.log") 2>&1
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Triton keeps autotune results in its cache (triton >= 3.4): fla's kernels autotune 42 configs per new shape (4
# cumsum + 6 kkt_solve + 9 recompute_w_u + 4 state + 3 output + 16 conv, counted in fla-core 0.6.0) once, in
# the env step's fla check, not again in every later process
export TRITON_CACHE_AUTOTUNING=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
T_START=$(date +%s)
echo "gpu_check mode=$MODE out=$DEST commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')"

step() {  # step NAME LIMIT_S CMD...: run with a time limit, log to WORK/NAME.log, record rc and seconds
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "== $name (limit ${limit}s): $*"
  t0=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
  rc=${PIPESTATUS[0]}
  echo "== $name: rc=$rc, $(( $(date +%s) - t0 )) s"
  echo "$name $rc $(( $(date +%s) - t0 ))" >> "$WORK/steps.txt"
}

# -- wheels (the GPU machine cannot reach a registry)
if ls .whl/*.whl >/dev/null 2>&1; then
  SITE=/tmp/specopd-site
  step wheels 10 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$SITE"  # after the repo; the machine's own packages keep precedence
else
  echo "no .whl/*.whl: fla-core / omegaconf come from the environment, if at all"
fi

if [ "$MODE" = vllm_v2 ]; then  # the V2 serving check alone (one device command; see the header)
  step vllm_dflash2 300 "$PY" benchmarks/vllm_v2_check.py --work "$WORK/vllm_v2" --json "$WORK/vllm_dflash2.json"
else
step env 90 "$PY" - <<'EOF'
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
try:
    import triton; print("triton", triton.__version__)
except ImportError:
    print("triton missing")
from kernels.gated_delta.fla_chunk import fla_available
print("fla-core importable:", fla_available())
if torch.cuda.is_available() and fla_available():
    from kernels.gated_delta.fla_chunk import fla_verified
    print("fla agrees with our chunk kernel (GDN auto prefill uses fla):", fla_verified("cuda"))
print("flash-attn importable:", importlib.util.find_spec("flash_attn") is not None)
print("torch varlen_attn:", importlib.util.find_spec("torch.nn.attention.varlen") is not None)
print("omegaconf importable:", importlib.util.find_spec("omegaconf") is not None)
EOF

# pytest: -v -rA --tb=short: every test's outcome, and each failure's assertion with its values (not -q)
PYTEST=("$PY" -m pytest -v -rA --tb=short -p no:cacheprovider -m gpu --junitxml "$DEST/tests.xml")
GPU_TESTS=(tests/test_executor_gpu.py tests/test_fla.py tests/test_losses.py tests/test_kernels_tree_attention.py
           tests/test_kernels_gdn.py tests/test_kernels_gdn_chunk.py tests/test_kernels_qsa.py
           tests/test_tensor_parallel.py)  # its NCCL twins (target, vocab-parallel loss, V2) need two GPUs
if [ "$MODE" = gpu ]; then
  step tests 200 "${PYTEST[@]}" "${GPU_TESTS[@]}"
  step bench_kernels 150 "$PY" benchmarks/bench_kernels.py --repeats 10 --json "$WORK/bench_kernels.json"
  step bench_executors 60 "$PY" benchmarks/bench_executors.py --device cuda --dtype bfloat16 --kinds gqa,gdn,qsa \
    --T 2048 --branches 64 --W 15 --hidden 1024 --layers 4 --vocab 32000 --repeats 3 --kernels torch,triton \
    --json "$WORK/bench_executors.json"
  step train 40 "$PY" -m specopd.cli train recipes/tiny.yaml model.device=cuda runtime.backend=local \
    trainer.max_steps=3 trainer.save_every=0 "trainer.output_dir=$WORK/train" trainer.resume=none
else
  step tests 120 "${PYTEST[@]}" tests/test_executor_gpu.py
  step bench_kernels 900 env TRITON_INTERPRET=1 "$PY" benchmarks/bench_kernels.py --tiny --json "$WORK/bench_kernels.json"
  step bench_executors 300 "$PY" benchmarks/bench_executors.py --device cpu --kinds gqa,gdn,qsa --T 40 \
    --branches 3 --W 3 --hidden 32 --layers 2 --vocab 64 --repeats 1 --kernels torch --json "$WORK/bench_executors.json"
  step train 300 "$PY" -m specopd.cli train recipes/tiny.yaml trainer.max_steps=2 trainer.save_every=0 \
    "trainer.output_dir=$WORK/train" trainer.resume=none
fi
fi

"$PY" - "$DEST" "$WORK" "$MODE" "$(( $(date +%s) - T_START ))" <<'EOF'
import json, os, sys
dest, work, mode, wall = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
steps = [dict(zip(("step", "rc", "seconds"), line.split())) for line in open(os.path.join(work, "steps.txt"))]
out = {"mode": mode, "wall_s": wall, "steps": steps}
if os.path.exists(os.path.join(work, "env.log")):
    out["env"] = open(os.path.join(work, "env.log")).read().splitlines()
for name in ("bench_kernels", "bench_executors", "vllm_dflash2"):
    p = os.path.join(work, name + ".json")
    if os.path.exists(p):
        out[name] = json.load(open(p))
json.dump(out, open(os.path.join(dest, "summary.json"), "w"), indent=1)
print(f"gpu_check ({mode}) done in {wall} s:", ", ".join(f"{s['step']} rc={s['rc']} ({s['seconds']} s)" for s in steps))
print("summary:", os.path.join(dest, "summary.json"))
skipped = [s["step"] for s in steps if s["step"] == "vllm_dflash2" and s["rc"] == "3"]  # no vLLM on that machine
if skipped:
    print("skipped (no vLLM there):", ", ".join(skipped))
sys.exit(1 if any(s["rc"] != "0" and s["step"] not in skipped for s in steps) else 0)
EOF
