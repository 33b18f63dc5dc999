#!/usr/bin/env bash
# On the GPU machine (see BENCHMARKS.md): the kernel benchmark (main variants over batch sizes, the
# window/rank sweep; TUNE=--tune re-runs the launch-shape search), the kernel tests at full size, and a tarball
# of the Triton cache so that the next run skips compilation. Writes everything to ${OUT:-out}.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -f .triton-cache/cache.tgz ]; then mkdir -p ~/.triton && tar xzf .triton-cache/cache.tgz -C ~/.triton; fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$out/gpu.txt"
timeout "${BENCH_SECONDS:-300}" python3 -m leapquant bench kernel --family "${FAMILIES:-gdn,kda}" \
  --n "${SIZES:-512,64,128,256,1024}" ${TUNE:-} --sweep-at "${SWEEP_AT:-512}" \
  --json "$out/kernel.json" --markdown "$out/kernel.md" --plot "$out/kernel.png" 2>&1 | tee "$out/bench.log" | tail -12
if [ -n "${TESTS-full or touched or bit_exact or round_trips or general or fit_options or token_scratch or outlives or gate or per_step or cuda or log_decay}" ]; then
  timeout "${TEST_SECONDS:-240}" python3 -m pytest -q tests/test_leapquant_decode.py tests/test_per_step_decode.py tests/test_close_cuda.py \
    -k "${TESTS-full or touched or bit_exact or round_trips or general or fit_options or token_scratch or outlives or gate or per_step or cuda or log_decay}" 2>&1 | tee "$out/gpu-tests.log" | tail -4
fi
tar czf "$out/triton-cache.tgz" -C ~/.triton cache && ls -la "$out"
