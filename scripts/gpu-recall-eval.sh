#!/usr/bin/env bash
# On the GPU machine: the issue-21 task table, `leapquant recall` with the paper-table methods, one process per
# method under MPS (every process streams each distance token by token through FP32 and its method: it is
# bound by kernel launches, and the GPU and 16 cores have room for all of them), merged by recall-report.
#
#   MODEL      default qwen35-gdn-linear-recall-byte (a checkpoint name)
#   TASK       passkey (default) or mqar
#   DISTANCES  default "4096 16384 65536"
#   EXAMPLES   prompts per distance (default 8)
#   METHODS    default: the paper-table preset, one process each
#   EVAL_SECONDS  per process (default 540); a process writes its JSON after every distance
#
# With FLA's wheels in .whl (carry it), the FP32 rows run the model's own FLA kernels, as a served model
# would, instead of transformers' per-token torch fallback (a dozen launches per layer and token).
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ -f .triton-cache/cache.tgz ]; then mkdir -p ~/.triton && tar xzf .triton-cache/cache.tgz -C ~/.triton; fi
if [ "${MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon started" && trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
model=${MODEL:-qwen35-gdn-linear-recall-byte}
task=${TASK:-passkey}
methods=${METHODS:-$(python3 -c 'from leapquant.eval.recall import METHOD_PRESETS; print(*METHOD_PRESETS["paper-table"])')}
pids=(); i=0
for m in $methods; do
  timeout "${EVAL_SECONDS:-540}" python3 -m leapquant recall --model "$model" -m "$m" --task "$task" \
    --distances ${DISTANCES:-4096 16384 65536} --examples "${EXAMPLES:-8}" \
    --json "$out/recall-$task-$i.json" > "$out/recall-$task-$i.log" 2>&1 &
  pids+=($!); i=$((i + 1))
done
for p in "${pids[@]}"; do wait "$p"; done
name=$(basename "$model")
python3 -m leapquant recall-report "$out"/recall-"$task"-*.json --merge "$out/recall-$name-$task.json" \
  --plot "$out/recall-$name-$task.png" | tee "$out/recall-$name-$task.md"
tail -n 3 "$out"/recall-"$task"-*.log
# the device returns at most 8 files: one archive holds every per-method JSON and log
tar czf "$out/recall-parts.tgz" -C "$out" $(cd "$out" && ls recall-"$task"-*) && rm -f "$out"/recall-"$task"-*
