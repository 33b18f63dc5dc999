#!/usr/bin/env bash
# On the GPU machine (see BENCHMARKS.md): the kernel benchmark with launch tuning, the kernel tests at full
# size, and a tarball of the Triton cache so the next run skips compilation. Writes to ${OUT:-out}.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -f .triton-cache/cache.tgz ]; then mkdir -p ~/.triton && tar xzf .triton-cache/cache.tgz -C ~/.triton; fi
variants=${VARIANTS:-"fla-fp32 perstep-bf16 perstep-int8 int8/w16 int8/w16+ct4 leapquant-int8 leapquant-int8:step"}
vargs=(); for v in $variants; do vargs+=(-v "$v"); done
timeout "${BENCH_SECONDS:-330}" python3 -m leapquant bench kernel --family "${FAMILIES:-gdn,kda}" \
  --n "${SIZES:-512,64,128,256,1024}" ${TUNE:---tune} "${vargs[@]}" ${LAUNCH:-} \
  --json "$out/kernel.json" --markdown "$out/kernel.md" --plot "$out/kernel.png" 2>&1 | tee "$out/bench.log" | grep -v "^tune" | tail -40
if [ -n "${TESTS:-full or untouched}" ]; then
  timeout "${TEST_SECONDS:-150}" python3 -m pytest -q tests/test_leapquant_decode.py tests/test_per_step_decode.py \
    -k "${TESTS:-full or untouched}" 2>&1 | tee "$out/gpu-tests.log" | tail -4
fi
tar czf "$out/triton-cache.tgz" -C ~/.triton cache && ls -la "$out"
