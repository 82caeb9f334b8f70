# Two commands for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Both create the virtual environment on first use; re-running them is cheap and idempotent.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK := requirements/ci.lock
TORCH := 2.13.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | cksum | cut -d' ' -f1)

.PHONY: setup lint test demo bench evidence lock clean golden golden-usage golden-nemo-rl golden-nemo-rl-compat golden-verl golden-ctpo golden-slime

# Every package at the exact version of $(LOCK), installed without resolution (--no-deps), then the project.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(LOCK) pip
	# torch first, resolved with its own dependencies: the local CPU wheel here (pinned: an unpinned torch may pull a
	# multi-GB CUDA build), a CUDA build with its nvidia-* libraries on a GPU machine. The lock then sets the versions
	# of the packages it shares with torch (triton included: the tests' CPU interpreter needs 3.9).
	$(PY) -m pip install -q torch==$(TORCH)
	$(PY) -m pip install -q --no-deps -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

# Lint, format and type checks (seconds; mypy's cache makes a re-run near instant), before the test suite.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: setup lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests functional_tests

demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/nemo-is demo

bench: setup
	$(VENV)/bin/nemo-is bench

evidence: setup
	$(VENV)/bin/nemo-is evidence

# Regenerate a golden suite (tests/data/golden/<suite>) from a checkout of its host at the commit the suite's README
# names, into $(GOLDEN_OUT)/<suite>, and compare it with the committed suite case by case within the README's
# tolerances (exit 1 on a difference). docs/testing.md, "Refreshing the golden suites", says how to adopt a change.
# `make golden NEMO_RL=... VERL=... CTPO=... SLIME=...` runs the targets whose checkout is given.
GOLDEN_OUT ?= runs/golden
GOLDEN_RUN = $(PY) -m tools.golden.$(1) --repo $(2) --out $(GOLDEN_OUT)/$(1) --check
GOLDEN_TARGETS := $(if $(NEMO_RL),golden-nemo-rl golden-nemo-rl-compat) $(if $(VERL),golden-verl) $(if $(CTPO),golden-ctpo) \
	$(if $(SLIME),golden-slime)

golden: $(or $(strip $(GOLDEN_TARGETS)),golden-usage)

golden-usage:
	@echo "make golden: give at least one host checkout: NEMO_RL=<NVIDIA-NeMo/RL> VERL=<verl> CTPO=<horizon-llm/CTPO> SLIME=<THUDM/slime>"
	@exit 2

golden-nemo-rl: setup
	$(if $(NEMO_RL),,$(error set NEMO_RL to a checkout of NVIDIA-NeMo/RL))
	$(call GOLDEN_RUN,nemo_rl,$(NEMO_RL))

golden-nemo-rl-compat: setup
	$(if $(NEMO_RL),,$(error set NEMO_RL to a checkout of NVIDIA-NeMo/RL))
	$(call GOLDEN_RUN,nemo_rl_compat,$(NEMO_RL))

golden-verl: setup
	$(if $(VERL),,$(error set VERL to a checkout of verl-project/verl))
	$(call GOLDEN_RUN,verl_rollout_corr,$(VERL))

golden-ctpo: setup
	$(if $(CTPO),,$(error set CTPO to a checkout of horizon-llm/CTPO))
	$(call GOLDEN_RUN,ctpo,$(CTPO))

golden-slime: setup
	$(if $(SLIME),,$(error set SLIME to a checkout of THUDM/slime))
	$(call GOLDEN_RUN,slime,$(SLIME))

# Regenerate $(LOCK) after changing the dependencies in pyproject.toml: resolve the test environment in a scratch venv
# and freeze it. verl is installed without its declared dependencies (they pin a CUDA torch and downgrade omegaconf),
# with the few packages its loss module imports; triton runs the GPU log-prob kernel in its CPU interpreter in tests.
# Review `git diff $(LOCK)` (and run `make clean test`) before committing it.
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip "setuptools>=77"
	$(LOCK_VENV)/bin/python -m pip install -q torch==$(TORCH)
	$(LOCK_VENV)/bin/python -m pip install -q -e ".[test]" "transformers>=5.5.3,<5.11,!=5.6.0" "triton==3.9.0"
	$(LOCK_VENV)/bin/python -m pip install -q --no-deps "verl==0.9.1" "tensordict==0.10.0" "pyvers==0.1.0" \
		codetiming cloudpickle orjson
	{ sed -n '/^#/p' $(LOCK); $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable \
		| sed -E 's/^(torch==[^+]+)\+.*/\1/'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) $(LOCK_VENV) runs .pytest_cache .hypothesis .mypy_cache .ruff_cache
