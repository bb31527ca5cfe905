# amp_lab: `make run` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: run test test-fast bench lint clean studies

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

bench: $(VENV)/.installed  ## overhead vs a bare loop + throughput table (python -m amp_lab.bench)
	$(PY) -m amp_lab.bench $(ARGS)

# Each study's CPU variant, then its report (verdicts, tables, overview.png) written into
# experiments/<study>/README.md; `make study-scaler_grid` runs one.
STUDIES := precision_modes scaler_grid fp16_lr_warmup grad_accum beyond_autocast
REPORT_scaler_grid := --by scaler.init_scale
REPORT_fp16_lr_warmup := --by lr.warmup_steps
REPORT_grad_accum := --by trainer.grad_accum,trainer.batch_size
REPORT_beyond_autocast := --ref bf16

studies: $(addprefix study-,$(STUDIES))  ## run every study's CPU variant and its report (CPU, minutes each)

study-%: $(VENV)/.installed
	rm -rf multirun/studies/$*
	OMP_NUM_THREADS=1 $(PY) -m amp_lab -m +experiment/cpu=$* logger=disabled \
		hydra.sweep.dir=multirun/studies/$*
	$(PY) -m amp_lab.report multirun/studies/$* $(REPORT_$*) --out experiments/$*/report \
		--readme experiments/$*/README.md

test: $(VENV)/.installed-dev  ## the whole suite, slow integration tests included
	$(PY) -m pytest $(ARGS)

test-fast: $(VENV)/.installed-dev  ## unit tests only
	$(PY) -m pytest -m "not slow" $(ARGS)

lint: $(VENV)/.installed-dev
	$(PY) -m ruff check amp_lab tests

clean:
	rm -rf outputs multirun .pytest_cache
