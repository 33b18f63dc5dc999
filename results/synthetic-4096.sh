#!/usr/bin/env bash
# Reproduces results/synthetic-4096.{json,png} (README "Results: synthetic traces"). CPU only, ~5 minutes.
set -euo pipefail
out=$(mktemp -d)
leapquant synth --family gdn --streams 8 --tokens 4096 --seed 0 --out "$out/gdn.npz"
leapquant synth --family kda --streams 8 --tokens 4096 --seed 1 --out "$out/kda.npz"
methods=(
  fp32 bf16 bf16/w16
  int8 int8/w16 int8/w16+ct4 int8/w16+ct4+smooth leapquant-int8
  fp8-e4m3 mxfp8 kvquant-int8 quarot-int8 turboquant-8
  int6 mxfp6-e2m3 nvfp6 kvquant-int6 quarot-int6 turboquant-6 int6/w16+ct4+smooth
  int4 mxfp4 nvfp4 kvquant-int4 quarot-int4 turboquant-4 int4/w16+ct8+smooth
)
args=()
for m in "${methods[@]}"; do args+=(-m "$m"); done
leapquant simulate "$out/gdn.npz" "$out/kda.npz" "${args[@]}" --quiet \
  --json results/synthetic-4096.json --plot results/synthetic-4096.png
