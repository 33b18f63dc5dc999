#!/usr/bin/env bash
# On the GPU machine: the decode kernels on vLLM's paged state layout (variant suffix ':paged', the pool inside
# vLLM-style pages) against the same kernels on a contiguous pool and FLA's fp32 kernel, in one run, with the
# CUDA close (the default for paged pools too since 457fb18) and the Triton close. FLA comes from the wheels
# in .whl (carry it: fla-core and flash-linear-attention 0.6.0). Writes ${OUT:-out}/paged.*.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
timeout "${BENCH_SECONDS:-420}" python3 -m leapquant bench kernel --family gdn,kda --n "${SIZES:-512,1024}" \
  -v fp32:fla -v leapquant-int8 -v leapquant-int8:paged -v leapquant-int8:paged:triton-close \
  -v leapquant-int8:step -v leapquant-int8:paged:step --json "$out/paged.json" --markdown "$out/paged.md" 2>&1 | tee "$out/paged.log" | tail -30
