# Two commands on a fresh machine:  make run   |   make test
PY ?= python3
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export GLOO_SOCKET_IFNAME ?= lo

.PHONY: run test test-quick lint bench setup setup-test

setup:
	PYTHON=$(PY) bash scripts/setup.sh

setup-test:
	PYTHON=$(PY) bash scripts/setup.sh test

## The whole pipeline on embedded defaults (embedded Prefect server, ./stoker-data, built-in corpus, tiny GPT on CPU)
run: setup
	$(PY) -m stoker.cli run $(ARGS)

## The whole test suite, on 2 pytest-xdist workers (PYTEST_WORKERS=0: one process)
PYTEST_WORKERS ?= 2
test: setup-test
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

## The quick subset: no flow run on a Prefect server, no notebook, no browser
test-quick: setup-test
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not e2e" $(PYTEST_ARGS)

## ruff: the format and the lint rules of pyproject.toml (fix: ruff format . && ruff check --fix .)
lint: setup-test
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

## Benchmarks: each prints a ratio against a baseline measured in the same run
bench: setup
	$(PY) -m benchmarks.run_all
