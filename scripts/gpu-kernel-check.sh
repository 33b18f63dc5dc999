#!/usr/bin/env bash
# On the GPU machine: kernel tests at full size, then a launch-shape sweep of the LeapQuant kernels at
# N=512 against FLA fp32 and the per-step kernels. Writes logs and JSON to ${OUT:-out}.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pytest -q -x tests/test_leapquant_decode.py tests/test_per_step_decode.py 2>&1 | tee "$out/gpu-tests.log" | tail -5
lq() { python3 -m leapquant "$@"; }
lq bench kernel --family gdn,kda --n 512 -v fla-fp32 -v perstep-fp32 -v perstep-bf16 -v perstep-int8 \
  --json "$out/baselines.json" 2>&1 | tail -12
for bv in 32 64 128; do for w in 4 8; do
  lq bench kernel --family gdn,kda --n 512 -v leapquant-int8:step --step-bv $bv --step-warps $w \
    --json "$out/step-bv$bv-w$w.json" 2>&1 | grep -v "copy bandwidth"
done; done
for bw in 4 8 16; do
  lq bench kernel --family gdn,kda --n 512 -v leapquant-int8 --boundary-warps $bw --step-bv ${STEP_BV:-64} \
    --step-warps ${STEP_WARPS:-4} --json "$out/full-bw$bw.json" 2>&1 | grep -v "copy bandwidth"
done
