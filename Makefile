# amp_lab: `make run` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: run test test-fast bench doctor-bench lint clean

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

doctor-bench: $(VENV)/.installed  ## the doctor on its failure cases (CPU, ~3 min): figures
	$(PY) -m amp_lab.doctor --suite $(ARGS)

test: $(VENV)/.installed-dev  ## the whole suite, slow integration tests included
	$(PY) -m pytest $(ARGS)

test-fast: $(VENV)/.installed-dev  ## unit tests only
	$(PY) -m pytest -m "not slow" $(ARGS)

lint: $(VENV)/.installed-dev
	$(PY) -m ruff check amp_lab tests

clean:
	rm -rf outputs multirun .pytest_cache
