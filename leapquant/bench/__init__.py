"""GPU benchmarks: CUDA-graph timing, byte models and reports, driven by ``leapquant bench``."""
