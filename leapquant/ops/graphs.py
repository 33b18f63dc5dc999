"""What a failed CUDA graph capture leaves behind, and how to clear it.

A capture that runs a random op (``torch.rand``, dropout, sampling) and then fails, for instance at a host
synchronisation, ends without the generator's capture epilogue: torch's default CUDA generator keeps the
offset it counted for the graph that never ended, and the next random op outside a capture raises
"Offset increment outside graph capture encountered unexpectedly" (a later ``generate()`` that samples, a
benchmark that builds random inputs).  Only a capture that ends cleanly runs the epilogue that clears it,
so the callers that fall back to eager launches after a failed capture (``bench/timing.py``,
``integrations/backends.py``) begin and end an empty one.  This relies on torch (2.11 to 2.13 here)
registering the default generator with every capture: ``tests/test_cuda_graphs.py`` checks it on a GPU,
and is the test to rerun when torch changes.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["clear_failed_capture"]


def clear_failed_capture(device: torch.device | str | None = None) -> None:
    """Make random ops on ``device`` usable again after a capture on it failed (call it in the ``except``
    of the capture; harmless when no random op ran in it)."""
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device=device)
    with warnings.catch_warnings(), torch.cuda.stream(side):
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty": that is the point
        graph.capture_begin()
        graph.capture_end()
    graph.reset()
