"""Test setup: without a GPU, Triton kernels run on the CPU through the Triton interpreter."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # must be set before triton is imported anywhere; kernels then run with numpy on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # @triton.jit decides at decoration time whether a function is interpreted: import every jit function
    # (triton's own tl.sum, ... and our kernels) now, so a test that unsets the variable (the README's CPU
    # path) cannot leave compiled-only versions behind for the kernel tests that run after it
    import triton.language  # noqa: F401
    from fast_interpreter import install

    import leapquant.ops.leapquant_decode.close
    import leapquant.ops.leapquant_decode.fused_recurrent
    import leapquant.ops.per_step_decode.fused_recurrent  # noqa: F401

    install()
    # One intra-op thread. The two threads torch takes on a 2-core machine wait for each other at every op;
    # while any other process wants a core, each wait can last a scheduler time slice, and loops of small
    # ops ran 10-50x slower (the shipped-checkpoint drift test: 24 s alone, over 15 minutes beside another
    # job). Most of the suite's time is one-thread work anyway (the Triton interpreter, Python loops).
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # the same for the commands tests run in subprocesses
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _unpatch_models_after_each_test():
    """Tests that patch a transformers model without unpatching it must not leak into the next test."""
    yield
    mod = sys.modules.get("leapquant.integrations.transformers")
    if mod is not None:
        for patched in list(mod._LIVE_PATCHES):
            patched.unpatch()


def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        default=None,
        metavar="K/N",
        help="run only every N-th collected test, starting at the K-th (0 <= K < N): scripts/gpu-tests.sh "
        "splits a file whose kernel compilations take longer than one shard should",
    )


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is None:
        return
    try:
        k, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard wants K/N (two integers), got {shard!r}") from None
    if not 0 <= k < n:
        raise pytest.UsageError(f"--shard {shard}: K must be in 0..N-1")
    # round robin: the parametrizations of one test, which compile alike, spread over every shard
    keep = [item for i, item in enumerate(items) if i % n == k]
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k])
    items[:] = keep
