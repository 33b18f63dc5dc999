#!/usr/bin/env bash
# On the GPU machine: the vLLM adapter tests (tests/test_vllm_adapter.py: vLLM-shaped GDN/KDA metadata over a
# paged pool, the Triton kernels on pages against a contiguous pool and the reference), the decode-kernel
# tests that touch the pool's addressing (untouched slots, hand-off round trips, gates, bit-exact codes) and
# the CUDA close's tests, with the card and versions they ran on. Writes ${OUT:-out}/vllm-adapter-gpu.log.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  date -u +"%Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  timeout 200 python3 -m pytest -q -rfE tests/test_vllm_adapter.py 2>&1
  timeout 150 python3 -m pytest -q -rfE tests/test_leapquant_decode.py -k "touched or round_trips or gate or bit_exact" 2>&1
  timeout 150 python3 -m pytest -q -rfE tests/test_close_cuda.py 2>&1
} | tee "$out/vllm-adapter-gpu.log" | tail -25
