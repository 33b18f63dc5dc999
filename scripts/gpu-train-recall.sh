#!/usr/bin/env bash
# On one H200 (torch 2.11+cu130, transformers 5.17; FLA stays off the training path unless KERNELS=fla[-kda], after
# its gradients were checked on the GPU): train the recall checkpoints of issue 21 side by side, one process
# per model under MPS (each is bound by the torch path's kernel launches, so three share the GPU at little
# cost to each).
#
#   MINUTES   training wall clock per model (default 5; every process also needs ~1-2 min for data loading,
#             saving, held-out bits/byte, decay statistics and its FP32 recall check)
#   MODELS    default "gdn-linear gdn-hybrid kda-linear" (also: kda-hybrid, gdn-tiny)
#   INIT      default "shipped": warm start from the shipped hybrid of the same family
#   EXTRA     more train_recall.py flags, e.g. "--max-distance 3072 --seq 4096"
#   GDN_BATCH windows per step of the GDN models (default 32)
#   KERNELS   torch (default), fla: FLA's chunked kernels (carry .whl with FLA's wheels), or fla-kda: the
#             same with GDN run by FLA's KDA kernel (FLA 0.6.0 refuses its GDN backward on Hopper with
#             Triton < 3.7.1); measured against a float64 loop on this GPU before training
#             (train_checkpoints.check_kernel_paths), which refuses to train on them if they are wrong
#   DEADLINE  unix time by which every process must have saved and reported (a device call's limit): each
#             model's training is shortened to fit (train_recall.py --deadline)
#   TINY      1: also train gdn-tiny, the CI-sized model, in a fourth process (default 0: the shipped one was
#             trained on a 2-core CPU in 10 minutes, the command in its model card)
#
# Device time: MINUTES + ~2 minutes. Output: $OUT/recall-ckpt-NAME.tgz.part-* (each checkpoint) and
# $OUT/train-*.log.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out/ckpt"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ "${MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon started" && trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # scripts/ import leapquant from this tree
export LEAPQUANT_TRAIN_KERNELS=${KERNELS:-torch}
if [ "$LEAPQUANT_TRAIN_KERNELS" != torch ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || { echo "KERNELS=$LEAPQUANT_TRAIN_KERNELS needs FLA's wheels in .whl"; exit 2; }
fi
# KDA's torch chunked path holds ~55 GB at batch 4 (its decay mask is [B, H, chunks, 64, 64, K]): beside the
# GDN processes that fits an H200's 141 GB but not an H100's 80 GB (seen: out of memory), so halve it there
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
kda_batch=4; [ "${gpu_mib:-0}" -lt 100000 ] && kda_batch=2
[ "$LEAPQUANT_TRAIN_KERNELS" != torch ] && kda_batch=${KDA_BATCH:-16}  # FLA's chunks hold no [.., 64, 64, K] mask
pids=()
for model in ${MODELS:-gdn-linear gdn-hybrid kda-linear}; do
  # GDN's torch path took 1.2 s a step at batch 8 x 4096 bytes on an H100 (~28K tokens/s), which for a 7M-
  # parameter model suggests launches, not arithmetic, so a larger batch should buy tokens at little cost
  # in steps (not yet measured at 32); train_recall.py halves a batch that runs out of memory.
  # KDA's path runs ~7x fewer tokens/s and holds far more memory per window: a small batch.
  batch=16; case $model in kda-*) batch=$kda_batch ;; gdn-*) batch=${GDN_BATCH:-32} ;; esac
  python3 scripts/train_recall.py --model "$model" --init-from "${INIT:-shipped}" --minutes "${MINUTES:-5}" \
    --batch "$batch" --out "$out/ckpt" ${DEADLINE:+--deadline $DEADLINE} ${EXTRA:-} > "$out/train-$model.log" 2>&1 &
  pids+=($!)
done
# the CI-sized all-GDN model (32x32 states, < 1 MB) on short passkey prompts, in the same wall clock: a model
# that really recalls, for the CPU test (tests/test_recall.py)
if [ "${TINY:-0}" = 1 ]; then
  python3 scripts/train_recall.py --model gdn-tiny --minutes "${MINUTES:-5}" --out "$out/ckpt" --seq 512 \
    --batch 32 --min-distance 16 --max-distance 256 --tasks passkey --recall-fraction 1 --answer-weight 4 \
    --lr 3e-3 --eval-distances 64 256 --eval-prefix 16 > "$out/train-gdn-tiny.log" 2>&1 &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p" || echo "a training process failed (exit $?)"; done
grep -h "^\[\|done in\|error" "$out"/train-*.log | cut -c1-400
# the device returns files of at most 16 MB, and one 8-layer checkpoint is ~15 MB: an archive per model, cut
# into 15 MB parts (rejoin: cat recall-ckpt-NAME.tgz.part-* | tar xz)
for dir in "$out"/ckpt/*/; do
  name=$(basename "$dir")
  tar czf - -C "$out/ckpt" "$name" | split -b 15m - "$out/recall-ckpt-$name.tgz.part-"
done
rm -rf "$out/ckpt"
