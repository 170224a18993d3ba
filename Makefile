# The two commands a newcomer types:  `make demo`  and  `make test`.
# Each creates .venv first (once), so a fresh clone needs nothing else.
#
# torch is pinned here, not in pyproject.toml: an unpinned `torch` pulls a
# multi-GB CUDA build. Users with a GPU keep their own build:
#     make test TORCH_SPEC="torch==2.13.0+cu130 --index-url https://download.pytorch.org/whl/cu130"
# or reuse an environment that already has torch: make test VENV=/path/to/env

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.adaptmem-installed
CONSTRAINTS := $(VENV)/constraints.txt
PYTEST_ARGS ?=

.PHONY: demo test test-all test-cuda lint format bench stress venv clean

demo: $(STAMP)
	$(PY) -m adaptmem.demo

# tests over 20 s on 2 cores are marked slow: `make test-all` runs them too
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# ruff's lint and its formatter's check (the configuration is in pyproject.toml); `make format` formats
lint: $(STAMP)
	$(VENV)/bin/ruff check adaptmem tests stress docs/examples
	$(VENV)/bin/ruff format --check adaptmem tests stress docs/examples

format: $(STAMP)
	$(VENV)/bin/ruff check --fix adaptmem tests stress docs/examples
	$(VENV)/bin/ruff format adaptmem tests stress docs/examples

test-cuda: $(STAMP)
	$(PY) -m pytest -q -m cuda $(PYTEST_ARGS)

# every benchmark runs even when one misses its target (each prints its verdict; the first
# is the longest): the loss head's headroom, how far longest_sequence() is off, variable lengths
bench: $(STAMP)
	-$(PY) -m stress.bench --json runs/bench.json
	-$(PY) -m stress.reach_accuracy --json runs/reach.json
	-$(PY) -m stress.variable_lengths --json runs/lengths.json
	-$(PY) -m stress.headroom --json runs/headroom.json

stress: $(STAMP)
	@for s in lengths pressure ooms soak probe drift; do \
		echo "== stress.scenario_$$s"; $(PY) -m stress.scenario_$$s || exit 1; done

venv: $(STAMP)

# $(CONSTRAINTS) pins the torch the venv has (the pinned CPU build, or the one you brought), so
# that no later install swaps it for another build: add packages with
#     .venv/bin/pip install -c .venv/constraints.txt timm
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	@$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(CONSTRAINTS)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	@touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
