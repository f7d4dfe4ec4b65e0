#!/usr/bin/env bash
# The GPU check in one command: the GPU questions, most valuable first, in one call of at most 330 s (`--plan`),
# every result written to OUT the moment it exists, so that a cut loses nothing already measured. Status, the
# device call line and the wheels: benchmarks/results/2026-12-07-h100-gpu-check-pending.md.
#
#   bash benchmarks/gpu_check.sh [--out DIR]              # on the GPU machine (one H100 / H200, no network)
#   bash benchmarks/gpu_check.sh --cpu-smoke [--out DIR]  # here: the same steps at toy sizes on the CPU
#   bash benchmarks/gpu_check.sh --plan [--cpu-smoke]     # each step with its time limit, and their total
#   bash benchmarks/gpu_check.sh --fetch-wheels           # here: the wheels the call carries, into .whl/
#   bash benchmarks/gpu_check.sh --vllm-v2 [--out DIR]    # on the GPU machine: the vllm_dflash2 step alone
#
# Steps in run order (the STEPS table; the question each answers, as in summary.json):
#   wheels          setup pip-installs benchmarks/gpu_wheels.txt's wheels from .whl/ (carried: no network there)
#                         into WORK: omegaconf on PYTHONPATH for every step, fla-core only for the fla steps
#   env             a     versions, the GPU, which packages import (find_spec: nothing compiles)
#   kernels         b     pytest -m gpu: the executors' Triton kernels against torch in fp32 and bf16 for every
#                         attention kind, packed prefill, the fused loss on CUDA, the kernels' own bf16 checks
#   flex            b     pytest -m gpu -k flex: the drafter's compiled flex_attention, forward and backward
#   train_step      c     benchmarks/gpu_step.py: a SpecOPD and a fair Draft-OPD step, Qwen3-8B-shaped random
#                         target, the recipe's DFlash drafter: supervised tokens/s, phases, GPU activity, memory
#   bench_kernels   speed benchmarks/bench_kernels.py --no-flex: the kernels at the recipes' shapes, row by row
#   fla             d     pytest -m gpu -k "fla or gdn" with fla on the path, one autotune config per kernel,
#                         TRITON_F32_DEFAULT=ieee (fla runs fp32 dots in TF32 on sm_90 otherwise)
#   fla_autotune    d     benchmarks/gpu_fla.py: fla's first call (its real autotuning, a fresh cache) vs the second
# Left out: benchmarks/bench_executors.py (packed scoring against per-branch recompute on toy targets; train_step's
# score phase answers it at Qwen3-8B size) and the old 3-step train of recipes/tiny.yaml (a toy target, held-out
# evaluation twice: train_step runs the trainer's step at a real size instead).
# Each step must end by the sum of the limits up to it (time an earlier step leaves flows on to the next); its
# commands get SIGINT there (pytest still writes its report; the Python steps keep their rows), KILL 15 s later.
# The steps share one Triton cache (WORK/triton, kept between runs on one machine), fla_autotune excepted.
# OUT (--out, else $OUT, else /tmp/specopd-gpu-check) receives at most 8 files: gpu_check.log, summary.json
# (rewritten as each step starts and ends: answered / failed / cut / not reached per step and per question),
# tests.xml, tests_flex.xml, tests_fla.xml, gpu_step.json, bench_kernels.json. Step logs and runs stay in WORK
# (default /tmp/specopd-gpu-check-work). The exit code is 0 when every question is answered.
set -uo pipefail
cd "$(dirname "$0")/.."

#  name             gpu_s cpu_s question
STEPS=(
  "wheels             10    30  setup"
  "env                15    60  a"
  "kernels            75   120  b"
  "flex               40    60  b"
  "train_step        125   120  c"
  "bench_kernels      15   120  speed"
  "fla                25    90  d"
  "fla_autotune       25    60  d"
)
VLLM_STEPS=("wheels 10 30 setup" "vllm_dflash2 300 0 vllm")
CARRY=(.whl)  # ignored paths the device call carries (carry: [".whl"]); everything else the steps read is tracked
KERNEL_TESTS=(tests/test_executor_gpu.py tests/test_losses.py tests/test_kernels_tree_attention.py
              tests/test_kernels_gdn.py tests/test_kernels_gdn_chunk.py tests/test_kernels_qsa.py)
FLA_TESTS=(tests/test_fla.py tests/test_executor_gpu.py tests/test_kernels_gdn_chunk.py)
# test_tensor_parallel.py's -m gpu tests need two GPUs: not here

MODE=gpu
ACTION=run
DEST="${OUT:-/tmp/specopd-gpu-check}"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) MODE=cpu ;;
    --vllm-v2) MODE=vllm_v2 ;;
    --plan) ACTION=plan ;;
    --fetch-wheels) ACTION=fetch ;;
    --out) DEST="$2"; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument $1 (use --cpu-smoke, --plan, --fetch-wheels, --vllm-v2, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
[ "$MODE" = vllm_v2 ] && STEPS=("${VLLM_STEPS[@]}")
PY="${PYTHON:-python3}"

plan() {  # one line per step: name, limit (s), question; then the total
  local row name gpu_s cpu_s q limit total=0
  for row in "${STEPS[@]}"; do
    read -r name gpu_s cpu_s q <<< "$row"
    limit=$([ "$MODE" = cpu ] && echo "$cpu_s" || echo "$gpu_s")
    printf '%-16s %4d s  %s\n' "$name" "$limit" "$q"
    total=$((total + limit))
  done
  echo "total $total s"
}

wheel_list() { sed 's/#.*//' benchmarks/gpu_wheels.txt | awk 'NF {print $1}'; }

fetch_wheels() {  # here (PyPI reachable): the listed wheels for the GPU machine's Python 3.12, into .whl/
  git check-ignore -q .whl || echo "warning: git does not ignore .whl here: add the line /.whl/ to its info/exclude"
  mkdir -p .whl
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $(wheel_list) || return 1
  du -sh .whl
}

case "$ACTION" in
  plan) plan; exit 0 ;;
  fetch) fetch_wheels; exit $? ;;
esac

WORK="${GPU_CHECK_WORK:-/tmp/specopd-gpu-check-work}"
SITE="$WORK/site"             # omegaconf: on the path of every step
FLA_SITE="$WORK/site-fla"     # fla-core: on the path of the env and fla steps only (fla goes last)
mkdir -p "$DEST" "$WORK"
rm -f "$WORK"/*.json "$WORK"/*.log "$WORK/steps.txt"
plan | sed '$d' | awk '{print $1, $2, $4}' > "$WORK/plan.txt"
exec > >(tee "$DEST/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TRITON_CACHE_DIR="$WORK/triton" TRITON_CACHE_AUTOTUNING=1  # tests/conftest.py keeps a caller's cache dir
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
T_START=$(date +%s)
echo "gpu_check mode=$MODE out=$DEST work=$WORK commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')"

limited() {  # CMD...: run until this step's deadline (STEP_END): SIGINT then, KILL 15 s later
  local left=$((STEP_END - $(date +%s)))
  timeout -s INT -k 15 "$(( left > 1 ? left : 1 ))" "$@"
}

need_fla() {  # fla-core importable with FLA_SITE on the path, else say what is lacking
  PYTHONPATH="$PYTHONPATH:$FLA_SITE" "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("fla") is None)' \
    && return 0
  echo "lacks: fla-core (not installed here, and no .whl/fla_core-*.whl carried: see benchmarks/gpu_wheels.txt)"
  return 1
}

PYTEST=(benchmarks/gpu_check.py pytest -v -rA --tb=short -p no:cacheprovider -m gpu)

step_wheels() {  # each listed wheel from .whl/ into SITE (fla-core into FLA_SITE); a missing one is named
  local spec name ver file dest lacking=0
  for spec in $(wheel_list); do
    name=${spec%%==*}; ver=${spec#*==}
    file=$(ls .whl/"${name//-/_}"-"$ver"-*.whl 2>/dev/null | head -1)
    if [ -z "$file" ]; then
      echo "lacks: .whl/${name//-/_}-$ver-*.whl (here: bash benchmarks/gpu_check.sh --fetch-wheels; carry .whl)"
      lacking=1
      continue
    fi
    dest=$SITE; [ "$name" = fla-core ] && dest=$FLA_SITE
    limited "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dest" \
      "$file" && echo "installed $file into $dest" || return 1
  done
  return $((lacking ? 3 : 0))
}

step_env() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  PYTHONPATH="$PYTHONPATH:$FLA_SITE" limited "$PY" benchmarks/gpu_check.py env
}

step_kernels() {
  limited "$PY" "${PYTEST[@]}" -k "not flex" --junitxml "$DEST/tests.xml" "${KERNEL_TESTS[@]}"
}

step_flex() {
  limited "$PY" "${PYTEST[@]}" -k flex --junitxml "$DEST/tests_flex.xml" tests/test_executor_gpu.py
}

step_train_step() {
  local args=(--recipe recipes/qwen3-8b-dflash-8gpu.yaml --json "$DEST/gpu_step.json" --work "$WORK/gpu_step")
  if [ "$MODE" = gpu ]; then
    limited "$PY" benchmarks/gpu_step.py "${args[@]}" --batch 4 --seq-len 2048 --anchors 64 --warmup 1 --steps 2
  else  # toy sizes, and the recipe read as where omegaconf is missing
    limited "$PY" benchmarks/gpu_step.py "${args[@]}" --tiny --no-omegaconf
  fi
}

step_bench_kernels() {
  if [ "$MODE" = gpu ]; then
    limited "$PY" benchmarks/bench_kernels.py --no-flex --repeats 5 --json "$DEST/bench_kernels.json"
  else
    TRITON_INTERPRET=1 limited "$PY" benchmarks/bench_kernels.py --tiny --no-flex --json "$DEST/bench_kernels.json"
  fi
}

step_fla() {  # fla's correctness, every autotuner on its first config (the tuning is fla_autotune's)
  need_fla || return 3
  TRITON_F32_DEFAULT=ieee PYTHONPATH="$PYTHONPATH:$FLA_SITE" limited "$PY" "${PYTEST[@]:0:2}" --one-autotune-config \
    "${PYTEST[@]:2}" -k "fla or gdn" --junitxml "$DEST/tests_fla.xml" "${FLA_TESTS[@]}"
}

step_fla_autotune() {  # fla's real autotuning at qwen4_exp's GDN shape, in a fresh Triton cache
  need_fla || return 3
  rm -rf "$WORK/triton-fla"
  if [ "$MODE" = gpu ]; then
    TRITON_CACHE_DIR="$WORK/triton-fla" TRITON_PRINT_AUTOTUNING=1 PYTHONPATH="$PYTHONPATH:$FLA_SITE" \
      limited "$PY" benchmarks/gpu_fla.py --T 2048 --heads 32 --dim 128 --dtypes bfloat16 --json "$WORK/fla.json"
  else
    TRITON_CACHE_DIR="$WORK/triton-fla" TRITON_INTERPRET=1 PYTHONPATH="$PYTHONPATH:$FLA_SITE" \
      limited "$PY" benchmarks/gpu_fla.py --tiny --json "$WORK/fla.json"
  fi
}

step_vllm_dflash2() {  # NOT RUN YET on a GPU: needs $SPECOPD_VLLM_PYTHON (a GPU build of vLLM >= 0.32); rc 3 = none
  limited "$PY" benchmarks/vllm_v2_check.py --work "$WORK/vllm_v2" --json "$WORK/vllm_dflash2.json"
}

summary() {  # summary.json from what the steps left so far (--final: and the closing lines)
  "$PY" benchmarks/gpu_check.py summary --work "$WORK" --out "$DEST" --mode "$MODE" \
    --wall "$(( $(date +%s) - T_START ))" "$@"
}

run_steps() {  # each step by its deadline (the sum of the limits up to it); a step that cannot start is not reached
  local row name gpu_s cpu_s q limit t0 rc deadline=$T_START
  for row in "${STEPS[@]}"; do
    read -r name gpu_s cpu_s q <<< "$row"
    limit=$([ "$MODE" = cpu ] && echo "$cpu_s" || echo "$gpu_s")
    deadline=$((deadline + limit))
    STEP_END=$deadline
    if [ $((deadline - $(date +%s))) -lt 3 ]; then
      echo "== $name: not reached (its deadline has passed)"
      continue
    fi
    echo "start $name $((deadline - $(date +%s)))" >> "$WORK/steps.txt"
    summary
    echo "== $name (question $q): until $((deadline - T_START)) s"
    t0=$(date +%s)
    "step_$name" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc, $(( $(date +%s) - t0 )) s"
    echo "end $name $rc $(( $(date +%s) - t0 ))" >> "$WORK/steps.txt"
    summary
  done
}

run_steps
summary --final
