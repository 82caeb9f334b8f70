# Two commands for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Both create the virtual environment on first use; re-running them is cheap and idempotent.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup test demo bench evidence clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the local CPU wheel; an unpinned torch may pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# verl for the adapter's functional test: its registry only; a full `.[verl]` would pull its whole training
	# stack and downgrade omegaconf, so install it without dependencies plus the few its loss module imports.
	$(PY) -m pip install -q --no-deps "verl==0.9.1" "tensordict==0.10.0" "pyvers==0.1.0" codetiming cloudpickle orjson
	$(PY) -m pip install -q "transformers>=5.5.3,<5.11,!=5.6.0"
	# triton runs the GPU log-prob kernel in its CPU interpreter (tests/distributed/test_fused_linear_triton.py).
	$(PY) -m pip install -q "triton==3.9.0"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests functional_tests

demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/nemo-is demo

bench: setup
	$(VENV)/bin/nemo-is bench

evidence: setup
	$(VENV)/bin/nemo-is evidence

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
