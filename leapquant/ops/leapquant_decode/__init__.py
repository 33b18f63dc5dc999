"""LeapQuant decode ops on a state pool: one decode step (GDN/KDA or general records), prefill hand-off and
materialization.  The public API is in ``decode.py``, the kernel launches in ``launch.py``, the Triton
kernels in ``fused_recurrent.py`` (step) and ``close.py`` (window close, boundary), the CUDA window close in
``close.cu`` / ``close_cuda.py``, and the torch references every kernel is tested against in ``naive.py``.
"""

from .decode import leapquant_decode, leapquant_step_records, load_states, materialize_states
from .launch import LaunchConfig

__all__ = ["LaunchConfig", "leapquant_decode", "leapquant_step_records", "load_states", "materialize_states"]
