"""GPU benchmarks: CUDA-graph timing, byte models and reports, driven by ``leapquant bench``.

The roofs the decode roofline (:mod:`.roofline`) assumes when it is not measuring them live here, so the
command line can show them without importing torch.
"""

H200_COPY_GBPS = 4240.0
"""Device-to-device copy bandwidth, GB/s counting read + write, measured on the lent H200
(``timing.copy_bandwidth``: 4,240-4,280 across runs)."""
H200_GEMM_TFLOPS = 790.0
"""bf16 throughput of an ``8192^3`` matmul, TFLOP/s, measured on the lent H200 (``timing.gemm_tflops``:
789.7)."""
