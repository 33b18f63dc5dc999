"""Per-step state pools and decode (fp32/bf16/int8 re-quantized after every token): the kernel baselines.

:class:`PerStepPool` holds ``state [S, HV, V, K]`` (V-first like vLLM/SGLang) and, for int8, per-value-channel
fp32 ``scale [S, HV, V]``.  :func:`per_step_decode` takes the same inputs as
:func:`leapquant.ops.leapquant_decode.leapquant_decode`; its reference is the window-1 case of
:class:`~leapquant.methods.WindowedState` (``naive.py`` writes it out for the pool layout).
"""

from .decode import PerStepPool, per_step_decode, per_step_records, per_step_unsupported

__all__ = ["PerStepPool", "per_step_decode", "per_step_records", "per_step_unsupported"]
