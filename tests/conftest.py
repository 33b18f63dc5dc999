"""Test setup: without a GPU, Triton kernels run on the CPU through the Triton interpreter."""

import os

import torch

if not torch.cuda.is_available():
    # must be set before triton is imported anywhere; kernels then run with numpy on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
