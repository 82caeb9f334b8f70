# Two commands for a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Both create the virtual environment on first use; re-running them is cheap and idempotent.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK := requirements/ci.lock
TORCH := 2.13.0
# What the install reads besides the lock: setup.py copies the start-up hook's .pth into site-packages (a copy, also in
# an editable install), so a change to either reinstalls.
INSTALL_INPUTS := pyproject.toml setup.py nemo_is_plugin/adapters/nemo_rl/startup/nemo_is_plugin_startup.pth
# The third-party example objective (docs/writing_an_objective.md), installed editable so that the whole suite runs
# with another package's objective present; its pyproject.toml declares the entry point, so a change reinstalls.
EXAMPLE_INPUTS := examples/tapered_reinforce/pyproject.toml
STAMP := $(VENV)/.installed-$(shell cat $(INSTALL_INPUTS) $(EXAMPLE_INPUTS) $(LOCK) | cksum | cut -d' ' -f1)

.PHONY: setup lint test test-sweep demo bench bench-docs evidence lock clean golden golden-nemo-rl golden-nemo-rl-compat golden-verl golden-ctpo setup-stacks test-stacks lock-stacks golden-slime \
	golden-verl-loss-modes golden-verl-score-centering

# Every package at the exact version of $(LOCK), installed without resolution (--no-deps), then the project.
$(STAMP): $(INSTALL_INPUTS) $(EXAMPLE_INPUTS) $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(LOCK) pip
	# torch first, resolved with its own dependencies: the local CPU wheel here (pinned: an unpinned torch may pull a
	# multi-GB CUDA build), a CUDA build with its nvidia-* libraries on a GPU machine. The lock then sets the versions
	# of the packages it shares with torch (triton included: the tests' CPU interpreter needs 3.9).
	$(PY) -m pip install -q torch==$(TORCH)
	$(PY) -m pip install -q --no-deps -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pip install -q --no-deps --no-build-isolation -e examples/tapered_reinforce
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
	$(MAKE) test-stacks

# The opt-in exhaustive runs that `make test` skips (tests marked sweep; docs/testing.md): every golden case through
# the compiled loss epilogue (aot_eager), about 50 min on 2 cores.
test-sweep: setup
	NEMO_IS_TEST_SWEEP=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -m sweep tests

demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/nemo-is demo

bench: setup
	$(VENV)/bin/nemo-is bench

# docs/performance.md's CPU page from that run (the docs writers are the repository's tooling, tools/bench_docs)
bench-docs: bench
	$(PY) -m tools.bench_docs cpu bench_results/results.json

evidence: setup
	$(VENV)/bin/nemo-is evidence

# Regenerate a golden suite (tests/data/golden/<suite>) from a checkout of its host at the commit the suite's README
# names, into $(GOLDEN_OUT)/<suite>, and compare it with the committed suite case by case within the README's
# tolerances (exit 1 on a difference). docs/testing.md, "Refreshing the golden suites", says how to adopt a change.
# The verl loss-mode suite was written from the verl 0.9.1 release, which $(LOCK) installs: golden-verl-loss-modes
# runs that installed package (or, given VERL_LOSS_MODES=<checkout>, that checkout; the tag v0.9.1 reproduces it).
# `make golden NEMO_RL=... VERL=... CTPO=... SLIME=... VERL_SC=...` runs it and the targets whose checkout is given,
# and names the checkouts not given (their suites are skipped).
GOLDEN_OUT ?= runs/golden
GOLDEN_RUN = $(PY) -m tools.golden.$(1) --repo $(2) --out $(GOLDEN_OUT)/$(1) --check
GOLDEN_TARGETS := golden-verl-loss-modes $(if $(NEMO_RL),golden-nemo-rl golden-nemo-rl-compat) $(if $(VERL),golden-verl) $(if $(CTPO),golden-ctpo) \
	$(if $(SLIME),golden-slime) $(if $(VERL_SC),golden-verl-score-centering)
GOLDEN_CHECKOUTS_MISSING := $(if $(NEMO_RL),,NEMO_RL=<NVIDIA-NeMo/RL>) $(if $(VERL),,VERL=<verl>) \
	$(if $(CTPO),,CTPO=<horizon-llm/CTPO>) $(if $(SLIME),,SLIME=<THUDM/slime>) \
	$(if $(VERL_SC),,VERL_SC=<verl at the score-centering suite's commit>)

golden: $(GOLDEN_TARGETS)
	$(if $(strip $(GOLDEN_CHECKOUTS_MISSING)),@echo "make golden: skipped the suites of the checkouts not given: $(strip $(GOLDEN_CHECKOUTS_MISSING))")

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

# The score-centering suite records a later verl commit than golden-verl's (its README): a second checkout, VERL_SC.
golden-verl-score-centering: setup
	$(if $(VERL_SC),,$(error set VERL_SC to a checkout of verl-project/verl at the commit tests/data/golden/verl_score_centering/README.md names))
	$(call GOLDEN_RUN,verl_score_centering,$(VERL_SC))

golden-verl-loss-modes: setup
	$(PY) -m tools.golden.verl_loss_modes $(if $(VERL_LOSS_MODES),--repo $(VERL_LOSS_MODES),--installed) \
		--out $(GOLDEN_OUT)/verl_loss_modes --check

# Regenerate $(LOCK) after changing the dependencies in pyproject.toml: resolve the test environment in a scratch venv
# and freeze it. verl is installed without its declared dependencies (they pin a CUDA torch and downgrade omegaconf),
# with the few packages its loss module imports, plus what its training step imports (TrainingWorker, the FSDP and
# Megatron engines: functional_tests/test_verl_step_*.py): accelerate, datasets (dill, multiprocess, pandas, xxhash),
# einops, fastapi (starlette, opentelemetry-api), mbridge, peft, uvicorn -- all without their own dependencies, at the
# versions tested; triton runs the GPU log-prob kernel in its CPU interpreter in tests.
# Review `git diff $(LOCK)` (and run `make clean test`) before committing it.
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip "setuptools>=77"
	$(LOCK_VENV)/bin/python -m pip install -q torch==$(TORCH)
	$(LOCK_VENV)/bin/python -m pip install -q -e ".[test]" "transformers>=5.5.3,<5.11,!=5.6.0" "triton==3.9.0"
	$(LOCK_VENV)/bin/python -m pip install -q --no-deps "verl==0.9.1" "tensordict==0.10.0" "pyvers==0.1.0" \
		codetiming cloudpickle orjson "accelerate==1.15.0" "datasets==5.2.0" "dill==0.4.1" "einops==0.8.2" \
		"fastapi==0.165.0" "mbridge==0.15.1" "multiprocess==0.70.19" "opentelemetry-api==1.45.2" "pandas==3.1.1" \
		"peft==0.21.2" "starlette==1.10.0" "uvicorn==0.54.0" "xxhash==4.1.0"
	# NeMo-RL's DTensor v1 worker's imports (functional_tests/test_nemo_rl_dtensor_step.py runs it from the pinned
	# source, which is not installable), beyond verl's step's above, without their trees
	$(LOCK_VENV)/bin/python -m pip install -q --no-deps "hydra-core==1.3.8" "antlr4-python3-runtime==4.9.3" \
		"pyzmq==27.3.0" "nvidia-ml-py==13.615.71" "prometheus-client==0.26.0"
	{ sed -n '/^#/p' $(LOCK); $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable \
		| sed -E 's/^(torch==[^+]+)\+.*/\1/'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)

# The hosts' current stacks (second tier of `make test`): NeMo-RL requires Python 3.13 with torch >= 2.11 and
# megatron-core 0.20 (through Megatron-Bridge). This tier runs the groups a trainer's host exercises (golden, common,
# loss, config, kernels, distributed, adapters, bad inputs, device guard) on Python 3.13, with the registry's torch (its
# CUDA build, which runs on a CPU too) and the newest megatron-core the package's ranges resolve, pinned in
# $(LOCK_STACKS). Its own venv and lock: nothing of the 3.11 environment above is shared. verl is not installed
# there, so the tests that import it skip (functional_tests/test_verl_*.py are not selected).
# TORCH_STACKS is the torch release tested; after changing it (or the dependencies), run `make lock-stacks`.
PYTHON_STACKS ?= $(shell PYENV_VERSION=3.13.0 pyenv which python3.13 2>/dev/null || command -v python3.13)
VENV_STACKS ?= .venv-313
PY_STACKS := $(VENV_STACKS)/bin/python
LOCK_STACKS := requirements/ci-py313.lock
TORCH_STACKS := 2.15.0
STAMP_STACKS := $(VENV_STACKS)/.installed-$(shell cat $(INSTALL_INPUTS) $(LOCK_STACKS) | cksum | cut -d' ' -f1)
STACKS_TESTS := tests/test_golden_nemo_rl.py tests/test_golden_nemo_rl_compat.py tests/test_golden_verl.py \
	tests/test_golden_ctpo.py tests/test_golden_verl_score_centering.py tests/test_nemo_rl_differential.py \
	tests/test_cuda_golden.py tests/test_cuda_entry_points.py tests/common tests/loss tests/config tests/kernels tests/distributed tests/adapters \
	tests/test_bad_inputs.py tests/test_device_guard.py functional_tests/test_megatron_cp_ep.py \
	functional_tests/test_nemo_rl_megatron_step.py

# As `setup`: torch first with its own dependencies (the nvidia-* libraries at the lock's versions), then the lock
# with --no-deps, then the project. The interpreter check stops a venv of another Python from passing as this tier.
$(STAMP_STACKS): $(INSTALL_INPUTS) $(LOCK_STACKS)
	@test -n "$(PYTHON_STACKS)" || { echo "test-stacks needs Python 3.13: set PYTHON_STACKS=/path/to/python3.13"; exit 1; }
	test -x $(PY_STACKS) || $(PYTHON_STACKS) -m venv $(VENV_STACKS)
	$(PY_STACKS) -c 'import sys; v = sys.version_info[:2]; assert v == (3, 13), f"$(VENV_STACKS) runs Python {v}, not 3.13"'
	$(PY_STACKS) -m pip install -q -c $(LOCK_STACKS) pip
	$(PY_STACKS) -m pip install -q -c $(LOCK_STACKS) torch==$(TORCH_STACKS)
	$(PY_STACKS) -m pip install -q --no-deps -r $(LOCK_STACKS)
	$(PY_STACKS) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV_STACKS)/.installed-*
	touch $(STAMP_STACKS)

setup-stacks: $(STAMP_STACKS)

test-stacks: setup-stacks
	OMP_NUM_THREADS=1 $(PY_STACKS) -m pytest -q $(STACKS_TESTS)

# Regenerate $(LOCK_STACKS) as `lock` does, on Python 3.13: the registry's torch $(TORCH_STACKS), then the test extra
# resolved around it (megatron-core: the newest release the `demo` extra allows).
LOCK_VENV_STACKS := .venv-lock-313
lock-stacks:
	rm -rf $(LOCK_VENV_STACKS)
	$(PYTHON_STACKS) -m venv $(LOCK_VENV_STACKS)
	$(LOCK_VENV_STACKS)/bin/python -m pip install -q --upgrade pip "setuptools>=77"
	$(LOCK_VENV_STACKS)/bin/python -m pip install -q torch==$(TORCH_STACKS)
	$(LOCK_VENV_STACKS)/bin/python -m pip install -q -e ".[test]"
	# NeMo-RL's Megatron worker's light imports (functional_tests/test_nemo_rl_megatron_step.py runs its train from the
	# pinned source), without their trees: transformers with huggingface_hub (httpx, httpcore, anyio, h11), tokenizers,
	# safetensors, regex, tqdm; pyzmq, nvidia-ml-py, prometheus-client, hydra-core with antlr4 4.9.3
	$(LOCK_VENV_STACKS)/bin/python -m pip install -q --no-deps "transformers==5.10.4" "huggingface_hub==1.33.0" \
		"tokenizers==0.22.2" "safetensors==0.8.0" "regex==2026.11.15" "tqdm==4.70.1" "httpx==0.28.1" \
		"httpcore==1.0.9" "anyio==4.16.0" "h11==0.16.0" "pyzmq==27.3.0" "nvidia-ml-py==13.615.71" \
		"prometheus-client==0.26.0" "hydra-core==1.3.8" "antlr4-python3-runtime==4.9.3"
	{ sed -n '/^#/p' $(LOCK_STACKS); $(LOCK_VENV_STACKS)/bin/python -m pip freeze --all --exclude-editable; } \
		> $(LOCK_STACKS).new
	mv $(LOCK_STACKS).new $(LOCK_STACKS)
	rm -rf $(LOCK_VENV_STACKS)

clean:
	rm -rf $(VENV) $(LOCK_VENV) $(VENV_STACKS) $(LOCK_VENV_STACKS) runs .pytest_cache .hypothesis .mypy_cache .ruff_cache
