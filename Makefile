# amp_lab: `make run` and `make test` do all the set-up on a fresh machine; `make help` lists
# every target (the `## ` comment after a target is its line there).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# pytest workers for make test / test-fast (pytest-xdist); auto: one per CPU. A test file runs
# whole in one worker (--dist loadfile): its module fixtures (a sweep, a wheel) are built once.
TEST_JOBS ?= auto
SOURCES := amp_lab hydra_plugins benchmarks tests

.PHONY: help run test test-fast bench doctor-bench warnings-bench studies check lint format-check typecheck format clean

help:  ## this list of targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-13s %s\n", $$1, $$2}' \
		$(MAKEFILE_LIST)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when pyproject.toml changes; the package itself is installed editable.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -e '.[dev]'
	touch $@

run: $(VENV)/.installed  ## the default experiment (test_convnext on digits, fp32, CPU is fine)
	$(PY) -m amp_lab $(ARGS)

bench: $(VENV)/.installed  ## overhead vs a bare loop, throughput (+ compile_cache, feed, peer: benchmarks/)
	$(PY) -m benchmarks.bench $(ARGS)

doctor-bench: $(VENV)/.installed  ## the doctor on its failure cases (CPU, ~3 min): figures
	$(PY) -m benchmarks.doctor_suite $(ARGS)

warnings-bench: $(VENV)/.installed  ## the early warnings' lead time and false alarms (CPU)
	$(PY) -m benchmarks.lead_time $(ARGS)

# Each study's CPU variant, then its report along the axis its config names (report.by), written into
# experiments/<study>/README.md; `make study-scaler_grid` runs one (1-6 min each: 138 jobs in 21
# minutes on 2 cores at load 4-7, one job at a time).
STUDIES := precision_modes scaler_grid fp16_lr_warmup grad_accum beyond_autocast optimizer_state \
	recipe_precision fsdp_precision pure_bf16_updates silent_noops attention_logits \
	lr_per_precision
# a study of N-rank jobs runs its sweep under torchrun (each rank runs every job, one group each)
LAUNCH_fsdp_precision := -m torch.distributed.run --nproc_per_node=2

studies: $(addprefix study-,$(STUDIES))  ## every study's CPU variant and its report (CPU: 423 jobs; ~50 min without lr_per_precision's 90)

study-%: $(VENV)/.installed
	rm -rf multirun/studies/$*
	OMP_NUM_THREADS=1 $(PY) $(LAUNCH_$*) -m amp_lab -m +experiment/cpu=$* logger=disabled \
		hydra.sweep.dir=multirun/studies/$*
	$(PY) -m amp_lab report multirun/studies/$* --out experiments/$*/report \
		--readme experiments/$*/README.md

test: $(VENV)/.installed-dev  ## the whole suite, slow integration tests included
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile $(ARGS)

test-fast: $(VENV)/.installed-dev  ## unit tests only (-m "not slow"), about 4 minutes on 2 cores
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile -m "not slow" $(ARGS)

check: lint format-check typecheck  ## what CI checks before the tests: lint, format, types

lint: $(VENV)/.installed-dev  ## ruff check
	$(PY) -m ruff check $(SOURCES)

format-check: $(VENV)/.installed-dev  ## ruff format --check (changes nothing; `make format` does)
	$(PY) -m ruff format --check $(SOURCES)

typecheck: $(VENV)/.installed-dev  ## mypy on the package, zero errors ([tool.mypy] in pyproject)
	$(PY) -m mypy

format: $(VENV)/.installed-dev  ## ruff format, rewriting the files
	$(PY) -m ruff format $(SOURCES)

clean:  ## remove run outputs and caches
	rm -rf outputs multirun .pytest_cache .mypy_cache .ruff_cache
