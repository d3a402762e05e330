# genq: `make run` starts the local stack, `make test` runs the whole suite.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0

.PHONY: install test lint run services bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel first, so the open `torch>=2.4` range installs nothing more.
	$(PIP) install -q "torch==$(TORCH_VERSION)" || $(PIP) install -q "torch>=2.4"
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

services:
	bash scripts/services.sh

# The local stack without Docker (Procfile via honcho; .env is read if present): API on :8000, a worker,
# beat (the reconciler) and Flower on :5555, against the local Postgres and Redis.
run: install services
	$(VENV)/bin/honcho run $(VENV)/bin/genq db create
	$(VENV)/bin/honcho run $(VENV)/bin/alembic upgrade head
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/honcho start

test: install services
	$(VENV)/bin/pytest -q tests

# What CI checks before the tests (and .pre-commit-config.yaml before each commit): formatting, lint, types.
lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
