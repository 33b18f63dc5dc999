"""Test setup: without a GPU, Triton kernels run on the CPU through the Triton interpreter."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # must be set before triton is imported anywhere; kernels then run with numpy on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _unpatch_models_after_each_test():
    """Tests that patch a transformers model without unpatching it must not leak into the next test."""
    yield
    mod = sys.modules.get("leapquant.integrations.transformers")
    if mod is not None:
        for patched in list(mod._LIVE_PATCHES):
            patched.unpatch()
