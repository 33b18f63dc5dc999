#!/usr/bin/env bash
# On a GPU machine: the whole test suite in five shards side by side (one GPU; compiling the kernels takes
# most of the time), each shard's log in ${OUT:-out}/tests-NAME.log, a summary at the end. The kernel tests
# run at full size on the device, the CUDA close is checked against the Triton close, and the tests that
# only a GPU can run (CUDA graphs, captures) run too.
#
# FLA (the fp32:fla baseline of the bench tests) goes on the path only for the kernel shards, from
# FLA_PATH (e.g. a `pip install --target` of its wheels): where FLA is importable, transformers 5 hands the
# recurrences of the tests' CPU models to FLA's Triton kernels, which take CUDA tensors only.
# PYTEST_ARGS are added to every shard (e.g. -k "not kimi-kda-linear-recall" where a checkpoint is absent).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
limit=${TEST_SECONDS:-1500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-3}  # five shards share the cores
shard() {
  local name=$1 path=$2; shift 2
  (PYTHONPATH="$path" timeout "$limit" python3 -m pytest -q -rfE -p no:cacheprovider ${PYTEST_ARGS:-} "$@" \
    > "$out/tests-$name.log" 2>&1; echo "exit status $?" >> "$out/tests-$name.log") &
}
with_fla=".${FLA_PATH:+:$FLA_PATH}"
shard close "$with_fla" tests/test_close_cuda.py tests/test_cuda_graphs.py
shard decode "$with_fla" tests/test_leapquant_decode.py
shard bench "$with_fla" tests/test_per_step_decode.py tests/test_kernel_helpers.py tests/test_vllm_adapter.py \
  tests/test_bench_decode.py tests/test_bench_roofline.py
shard models . tests/test_transformers_integration.py tests/test_transformers_caches.py tests/test_eval_resume.py \
  tests/test_bench_generate.py tests/test_cli_runs.py
shard rest . $(ls tests/test_*.py | grep -v -e close_cuda -e cuda_graphs -e leapquant_decode -e per_step_decode \
  -e kernel_helpers -e vllm_adapter -e bench_decode -e bench_roofline -e transformers_ -e eval_resume \
  -e bench_generate -e cli_runs)
wait
for f in "$out"/tests-*.log; do echo "$(basename "$f" .log): $(grep -E 'passed|failed|error|no tests ran' "$f" | tail -1) ($(tail -1 "$f"))"; done
grep -h -e '^FAILED' -e '^ERROR' "$out"/tests-*.log
