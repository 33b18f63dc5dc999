#!/usr/bin/env bash
# On the GPU machine (see RESULTS.md): `leapquant eval` of the shipped checkpoints, the paper's Table 2
# ablation and the 8/6/4-bit comparison of its Table 1 (each split over two processes), side by side (each
# process is bound by kernel launches, the GPU and 16 cores have room for all of them). Every process writes
# its JSON at each of 32 curve points, so a run cut by EVAL_SECONDS keeps what it measured ("complete": false).
# CHECKPOINTS=DIR (e.g. .eval-checkpoints, ignored by git, so that it stays on a warm device machine between
# calls): each process also saves its run there (leapquant eval --checkpoint) and stops at the first curve
# point after EVAL_SECONDS - STOP_MARGIN seconds; the same command in the next call goes on from there, and
# a process whose run is complete writes its report again at once. TABLES=plans evaluates every calibrated
# plan of the model (results/auto/MODEL.plan*.json). CHUNK: tokens per model call (leapquant eval --chunk).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# each process is launch-bound: without a cap, 8 processes x 16 intra-op threads oversubscribe the 16 cores
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ -f .triton-cache/cache.tgz ]; then mkdir -p ~/.triton && tar xzf .triton-cache/cache.tgz -C ~/.triton; fi
# Without MPS the GPU time-slices the eight contexts: every tiny kernel of a launch-bound process then waits
# for a context switch (run 1 reached 1-2K tokens in 8 minutes). MPS lets their kernels share the GPU.
if [ "${MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon started" && trap 'echo quit | nvidia-cuda-mps-control' EXIT
else
  echo "MPS not used: processes are time-sliced"
fi
tokens=${TOKENS:-16384}
table2="-m bf16 -m bf16/w16 -m int8 -m int8/w16 -m int8/w16+ct4 -m leapquant-int8 --generate int8 --generate leapquant-int8"
bits8="-m int8 -m mxfp8 -m kvquant-int8 -m quarot-int8 -m turboquant-8 -m leapquant-int8"
# LeapQuant at 6 and 4 bits as the paper configures it (the tables in RESULTS.md); leapquant-int6/int4 add +ls
bits6="-m int6 -m mxfp6-e2m3 -m nvfp6 -m kvquant-int6 -m quarot-int6 -m turboquant-6 -m int6/w16+ct4+smooth"
bits4="-m int4 -m mxfp4 -m nvfp4 -m kvquant-int4 -m quarot-int4 -m turboquant-4 -m int4/w16+ct8+smooth"
# the same tables split over two processes each (a process is launch-bound: halves finish in ~half the time);
# the halves are merged into eval-MODEL-bitsN.json below
bits8a="-m int8 -m mxfp8 -m kvquant-int8"; bits8b="-m quarot-int8 -m turboquant-8 -m leapquant-int8"
bits6a="-m int6 -m mxfp6-e2m3 -m nvfp6 -m kvquant-int6"; bits6b="-m quarot-int6 -m turboquant-6 -m int6/w16+ct4+smooth"
bits4a="-m int4 -m mxfp4 -m nvfp4 -m kvquant-int4"; bits4b="-m quarot-int4 -m turboquant-4 -m int4/w16+ct8+smooth"
pids=()
for model in ${MODELS:-qwen35-gdn-hybrid-byte kimi-kda-hybrid-byte}; do
  for table in ${TABLES:-table2 bits8a bits8b bits6a bits6b bits4a bits4b}; do
    resume=()
    if [ -n "${CHECKPOINTS:-}" ]; then
      mkdir -p "$CHECKPOINTS"
      resume=(--checkpoint "$CHECKPOINTS/eval-$model-$table.pt" \
              --time-limit $(( ${EVAL_SECONDS:-480} - ${STOP_MARGIN:-120} )))
    fi
    if [ "$table" = plans ]; then  # every calibrated plan of this model (leapquant calibrate)
      methods=(); for f in results/auto/"$model".plan*.json; do [ -f "$f" ] && methods+=(-m "$f"); done
      if [ ${#methods[@]} = 0 ]; then echo "$model: no results/auto/$model.plan*.json, no plans run"; continue; fi
    else
      read -ra methods <<< "${!table}"
    fi
    timeout "${EVAL_SECONDS:-480}" python3 -m leapquant eval --model "$model" "${methods[@]}" "${resume[@]}" \
      ${CHUNK:+--chunk $CHUNK} \
      --tokens "$tokens" --quiet --json "$out/eval-$model-$table.json" > "$out/eval-$model-$table.log" 2>&1 &
    pids+=($!)
  done
done
for p in "${pids[@]}"; do wait "$p"; done
for model in ${MODELS:-qwen35-gdn-hybrid-byte kimi-kda-hybrid-byte}; do
  for t in bits8 bits6 bits4; do
    a="$out/eval-$model-${t}a.json"; b="$out/eval-$model-${t}b.json"
    if [ -f "$a" ] && [ -f "$b" ]; then
      python3 -m leapquant eval-report "$a" "$b" --merge "$out/eval-$model-$t.json" > "$out/eval-$model-$t.md"
    fi
  done
done
tail -n 14 "$out"/eval-*.log; cat "$out"/eval-*.md 2>/dev/null
# the device returns at most 8 files: one archive holds every JSON and log
tar czf "$out/eval.tgz" -C "$out" $(cd "$out" && ls eval-*) && rm -f "$out"/eval-*
