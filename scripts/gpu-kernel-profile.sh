#!/usr/bin/env bash
# On the GPU machine: Nsight Compute on one decode step of one layer (N=512, HV=32, K=V=128, $VARIANT),
# the step kernel and the window close, so that "where the time goes" in BENCHMARKS.md is read from counters
# (issue slots, stall reasons, occupancy) instead of inferred from timings. Eager launches (--no-graph);
# ncu replays each profiled kernel and restores the memory it writes, so the in-place update is profiled.
#   FAMILY="gdn kda" N=512 CLOSE_ARGS="--close-programs 2" scripts/gpu-kernel-profile.sh
# SOURCE=1: instead, warp stall samples per source line of the window close (one launch; the CUDA close is
# built with -lineinfo, and its NVRTC program is named leapquant_close.cu, so a copy under that name sits
# in the working directory while ncu imports it), summarized by scripts/ncu_source_summary.py into
# $out/ncu-source-$family-$VARIANT.md. VARIANT picks the method (default leapquant-int8) in both modes.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
--section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis"
variant=${VARIANT:-leapquant-int8}
for family in ${FAMILY:-gdn}; do
  if [ -n "${SOURCE:-}" ]; then
    tag="$family-$variant"
    if [ -e leapquant_close.cu ]; then echo "leapquant_close.cu exists here: move it away first" >&2; exit 2; fi
    cp leapquant/ops/leapquant_decode/close.cu leapquant_close.cu
    timeout "${PROFILE_SECONDS:-200}" ncu --clock-control none --import-source yes --section SourceCounters \
        --section WarpStateStats --section InstructionStats --section LaunchStats --section SpeedOfLight \
        --kernel-name regex:"leapquant_close|close_kernel" --launch-skip 20 --launch-count 1 -o "$out/close-$tag" \
        python3 -m leapquant bench kernel --family "$family" --n "${N:-512}" -v "$variant" ${CLOSE_ARGS:-} \
        --no-graph > "$out/ncu-source-run-$tag.log" 2>&1
    ncu -i "$out/close-$tag.ncu-rep" --page details > "$out/ncu-close-$tag.txt" 2>&1
    ncu -i "$out/close-$tag.ncu-rep" --page source --csv --print-source cuda,sass > "$out/close-$tag.csv"
    python3 scripts/ncu_source_summary.py "$out/close-$tag.csv" > "$out/ncu-source-$tag.md"
    rm -f "$out/close-$tag.csv" leapquant_close.cu
    grep -E "Duration|Executed Instructions  " "$out/ncu-close-$tag.txt"
    head -40 "$out/ncu-source-$tag.md"
    continue
  fi
  log="$out/ncu-$family-$variant.txt"
  # skip warm-up launches; profile one step: the closing heads' step, their close, the other heads' step
  timeout "${PROFILE_SECONDS:-120}" ncu --clock-control none $sections \
      --kernel-name regex:"step_.*kernel|close" --launch-skip "${SKIP:-60}" --launch-count 3 \
      python3 -m leapquant bench kernel --family "$family" --n "${N:-512}" -v "$variant" ${CLOSE_ARGS:-} \
      --no-graph > "$log" 2>&1
  echo "== $family: $(grep -c 'Section: ' "$log") sections in $log"
  grep -E "^  [a-z_]+kernel|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|\
No Eligible|Executed Instructions  |Block Limit Registers|Block Limit Shared|Stall|Compute \(SM\) Thr|Memory Thr" \
      "$log" | head -60
done
