# Two entry points for a fresh machine with only Python 3.10+:
#   make demo   - train a small MLP with DDP on 2 CPU processes, show results and the MLflow run
#   make test   - run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export MLFLOW_DISABLE_TELEMETRY ?= true
export PYTHONPATH := $(CURDIR)/src$(if $(PYTHONPATH),:$(PYTHONPATH),)

.PHONY: demo test test-fast soak lint typecheck bench venv clean

venv: $(STAMP)

$(STAMP): requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/mlp_ddp.py

test: $(STAMP)
	$(PY) -m ruff check src tests examples bench
	$(PY) -m ruff format --check src tests examples bench
	$(PY) -m mypy
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests/unit

soak: $(STAMP)
	GANGRUN_SOAK_RUNS=$${GANGRUN_SOAK_RUNS:-1000} GANGRUN_SOAK_SEED=$${GANGRUN_SOAK_SEED:-$$(od -An -N3 -tu4 /dev/urandom | tr -d " ")} \
		$(PY) -m pytest -q -s -m soak tests/soak

lint: $(STAMP)
	$(PY) -m ruff check src tests examples bench
	$(PY) -m ruff format --check src tests examples bench

typecheck: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
