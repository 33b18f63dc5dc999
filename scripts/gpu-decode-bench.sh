#!/usr/bin/env bash
# On the GPU machine (see BENCHMARKS.md): `leapquant bench decode` on the 8-layer Qwen3.5-9B- and
# Kimi-Linear-48B-A3B-shaped hybrids. Default grid ("star", 14 configurations): batch 64/128/256/512 at
# context 4K (paper Figure 8) plus contexts 1K/2K/8K at batch 512 (Figure 10); backends FLA fp32, our per-step
# bf16 and LeapQuant int8; --profile adds the ablations, a profiler trace per backend and the roofline.
# Writes decode.json, decode.md, decode.png, decode.log and gpu.txt to ${OUT:-out}, and a tarball of the
# Triton cache (put it at .triton-cache/cache.tgz to skip compilation next time).
# Estimated wall time on an H200: 3-5 minutes (about 1 minute of Triton compilation on a cold cache, then
# ~7 s per configuration); BENCH_SECONDS (default 450) caps it, and the JSON is rewritten after every row.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -f .triton-cache/cache.tgz ]; then mkdir -p ~/.triton && tar xzf .triton-cache/cache.tgz -C ~/.triton; fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$out/gpu.txt"
start=$(date +%s)
timeout "${BENCH_SECONDS:-450}" python3 -m leapquant bench decode --model "${MODELS:-both}" \
  --batch ${BATCHES:-64 128 256 512} --context ${CONTEXTS:-1024 2048 4096 8192} --grid "${GRID:-star}" \
  --main-context "${MAIN_CONTEXT:-4096}" --backends ${BACKENDS:-fp32:fla bf16 leapquant-int8} ${PROFILE---profile} \
  --json "$out/decode.json" --markdown "$out/decode.md" --plot "$out/decode.png" 2>&1 | tee "$out/decode.log"
status=${PIPESTATUS[0]}
echo "bench decode: exit $status after $(( $(date +%s) - start )) s" | tee -a "$out/decode.log"
if [ "$status" -ne 0 ] && [ -f "$out/decode.json" ]; then  # cut short: tables and plot from what was saved
  python3 - "$out" <<'EOF'
import json, sys
from leapquant.bench.decode_run import decode_markdown, plot_decode
out = sys.argv[1]
report = json.load(open(f"{out}/decode.json"))
open(f"{out}/decode.md", "w").write(decode_markdown(report))
plot_decode(report, f"{out}/decode.png")
EOF
fi
tar czf "$out/triton-cache.tgz" -C ~/.triton cache 2>/dev/null; ls -la "$out"
