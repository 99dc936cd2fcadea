# Two entry points for a fresh machine with only Python 3.10+:
#   make demo   - train a small MLP with DDP on 2 CPU processes, show results and the MLflow run
#                 (installs only requirements-demo.txt: torch's CPU pin and MLflow)
#   make test   - lint, type-check and the whole test suite (which also builds the docs with
#                 warnings as errors and installs the wheel into a fresh venv); prints the
#                 slowest tests and the time per tier, and fails when tests/unit exceeds its
#                 time budget. Runs on TEST_WORKERS pytest-xdist workers (default 2; 0: one
#                 process): every Ray test on one worker, one after another
#   make test-smoke - one test per main path (a call, a failure, a resume, a notebook cell, a Ray
#                 call...), about a minute; the list is tests/tiers.py SMOKE
#   make test-unit - the unit tier alone (no gangs, a few fresh interpreters): its durations and budget
#                 (tests/conftest.py UNIT_BUDGET_S) are printed at the end
#   make test-fast - every test that needs no Ray, Jupyter kernel, browser, packaging or soak
#                 (what each module needs: tests/tiers.py), on TEST_WORKERS workers too
#   make docs   - the documentation (MkDocs + mkdocstrings) into ./site, warnings as errors
#   make dist   - wheel and sdist into ./dist
#   make soak   - the fault-injection soak (1000 runs, a fresh seed)
#   make soak-resume - resume exactness: 300 drawn trainings interrupted and continued, each
#                 compared bitwise with its uninterrupted run (tests/soak/test_resume_exactness.py)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
export MLFLOW_DISABLE_TELEMETRY ?= true
export NO_MKDOCS_2_WARNING ?= 1
export PYTHONPATH := $(CURDIR)/src$(if $(PYTHONPATH),:$(PYTHONPATH),)
# Many system tests wait (for processes to start, heartbeats, timeouts) as much as they
# compute: two workers on two cores take samples of the suite in 0.71-0.76 of the time
# of one process (docs/benchmarks.md, the test suite's run time).
# --dist loadgroup keeps the tests that tests/conftest.py groups (Ray, a module's shared
# server or kernel) on one worker.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup

.PHONY: demo test test-smoke test-unit test-fast soak soak-resume lint typecheck bench venv clean docs dist

venv: $(STAMP)

$(STAMP): requirements-dev.txt requirements-demo.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# the demo's own stamp: what it needs, not the development toolchain (a venv that has the
# dev set already satisfies it at once)
$(DEMO_STAMP): requirements-demo.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-demo.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) examples/mlp_ddp.py

test: $(STAMP)
	$(PY) -m ruff check src tests examples bench
	$(PY) -m ruff format --check src tests examples bench
	$(PY) -m mypy
	$(PY) -m pytest -q --durations=15 $(XDIST)

test-smoke: $(STAMP)
	$(PY) -m pytest -q -m smoke --durations=15

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not (ray or kernel or browser or packaging or soak)" --durations=15 $(XDIST)

soak: $(STAMP)
	GANGRUN_SOAK_RUNS=$${GANGRUN_SOAK_RUNS:-1000} GANGRUN_SOAK_SEED=$${GANGRUN_SOAK_SEED:-$$(od -An -N3 -tu4 /dev/urandom | tr -d " ")} \
		$(PY) -m pytest -q -s -m soak tests/soak/test_soak.py

soak-resume: $(STAMP)
	GANGRUN_RESUME_RUNS=$${GANGRUN_RESUME_RUNS:-300} GANGRUN_RESUME_SEED=$${GANGRUN_RESUME_SEED:-$$(od -An -N3 -tu4 /dev/urandom | tr -d " ")} \
		$(PY) -m pytest -q -s tests/soak/test_resume_exactness.py::test_resume_search

lint: $(STAMP)
	$(PY) -m ruff check src tests examples bench
	$(PY) -m ruff format --check src tests examples bench

typecheck: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) bench/run_all.py

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

dist: $(STAMP)
	$(PY) -m build --outdir dist .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site dist build
