"""The window close as a CUDA C++ kernel (``close.cu``), built at run time by NVRTC through torch.

Same arithmetic as :func:`close.close_kernel` and :func:`naive.close_ref` (checked against both on the GPU,
``tests/test_close_cuda.py``), with the state of a closing head held whole in the registers of one 256-thread
block and rebuilt once, where the Triton close rebuilds it at each of its three passes.  It applies to
``d_k = d_v = 128`` (the head size of Qwen3.5/Qwen3-Next and Kimi-Linear), the scaled residuals
(``RESIDUAL_FORMATS[...].cuda_close``), least-squares scales (``+ls``: each channel's two sums reduced
across the 16 threads that hold it) and 0 to 4 or 8 tokens; :func:`unsupported` says why another pool
does not qualify, and those keep the Triton close.  The CPU (and the Triton interpreter) never runs it: CI
tests the Triton close, and the GPU runs check this one against it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ...errors import LeapQuantError
from ...formats.residual import CUDA_CLOSE_RESIDUALS
from ...methods.compensators import DROP_FRACTION
from ..pool import SHIFT_ORDER, LeapQuantPool, PoolConfig

__all__ = [
    "MAX_SHARED", "SOURCE", "THREADS", "build_offline", "compile_options", "launch_cuda_close", "prefetches",
    "shared_bytes", "unavailable", "unsupported", "unsupported_layout",
]  # fmt: skip

THREADS = 256  # one block per closing head: 16 x 16 threads of 8 x 8 state entries each
MAX_SHARED = 227 * 1024  # a block's shared memory on Hopper (opt-in), and below it on older GPUs: checked
BLOCKS_PER_SM = 2  # what the kernel's 128 registers a thread allow (__launch_bounds__(256, 2))
RESERVED_SHARED = 1024  # shared memory the driver reserves per block
SOURCE = Path(__file__).with_name("close.cu")  # shipped as package data (pyproject.toml)


def unsupported(cfg: PoolConfig) -> str | None:
    """Why the CUDA close does not apply to pools of ``cfg`` (``None``: it does)."""
    if (cfg.d_k, cfg.d_v) != (128, 128):
        return f"head size d_k={cfg.d_k}, d_v={cfg.d_v} (the CUDA close is built for 128 x 128)"
    if not cfg.format.cuda_close:
        return f"residual {cfg.residual!r} (the CUDA close takes {', '.join(CUDA_CLOSE_RESIDUALS)})"
    if cfg.compensators > 4 and cfg.compensators != 8:
        # its products take tokens four at a time: 5 to 7 would leave a partial group of four
        return f"{cfg.compensators} compensator tokens (the CUDA close takes 0 to 4, or 8)"
    if shared_bytes(cfg) > MAX_SHARED:
        return f"window {cfg.window}: {shared_bytes(cfg)} B of shared memory per block, over {MAX_SHARED}"
    return None


def unsupported_layout(pool: LeapQuantPool) -> str | None:
    """Why the CUDA close does not apply to ``pool``'s memory layout (``None``: it does): it takes the slot
    shifts (``LeapQuantPool.slot_shift``) as 32-bit integers.  Checked before the step, like
    :func:`unsupported`, so that such a pool closes with the Triton close instead of failing after its
    step has changed it."""
    shifts = pool.slot_shift()
    if any(not -(2**31) <= s < 2**31 for s in shifts):
        return f"slot shifts {shifts} do not fit 32-bit integers"
    return None


def unavailable() -> str | None:
    """Why this torch cannot build the CUDA close (``None``: it can)."""
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
    return None


def prefetches(cfg: PoolConfig, shared_per_sm: int) -> bool:
    """Whether the close stages each block's next head in shared memory (``LQ_PREFETCH``): where the staging
    area still lets ``BLOCKS_PER_SM`` blocks share an SM with ``shared_per_sm`` bytes.  Without it every
    head waits for its own loads; with it only a block's first does, but a block with one SM to itself
    would lose more than that (long windows)."""
    return BLOCKS_PER_SM * (shared_bytes(cfg, prefetch=True) + RESERVED_SHARED) <= shared_per_sm


def compile_options(cfg: PoolConfig, *, prefetch: bool = False) -> list[str]:
    """NVRTC options that specialise ``close.cu`` to pools of ``cfg`` (``prefetch``: :func:`prefetches`)."""
    defines = {
        "LQ_P": cfg.window,
        "LQ_R": cfg.compensators,
        "LQ_ITERS": cfg.power_iters,
        "LQ_RESIDUAL": cfg.format.code,
        "LQ_SMOOTH": int(cfg.smoothing),
        "LQ_VECTOR_DECAY": int(cfg.decay == "vector"),
        "LQ_REC16": int(cfg.records == "fp16"),
        "LQ_LS": int(cfg.method.least_squares_scales),
        "LQ_PREFETCH": int(prefetch),
        "LQ_DROP": repr(DROP_FRACTION),
    }
    # -lineinfo: line tables only (the code is the same), so that a profiler names close.cu's lines
    return ["-std=c++17", "-lineinfo", *(f"-D{k}={v}" for k, v in defines.items())]


def shared_bytes(cfg: PoolConfig, *, prefetch: bool = False) -> int:
    """Dynamic shared memory of one block (the ``SM_*`` layout of ``close.cu``), with or without the staging
    area of the next head's inputs."""
    k, v, p, r = cfg.d_k, cfg.d_v, cfg.window, cfg.compensators
    floats = p * k + p * v + r * k + r * v + k + r * v + r * k + 8 * 4 * k + 2 * k
    if prefetch:  # the inputs as stored: codes, channel scales, log decays, records, smoothing, fp16 tokens
        code_bits = 4 if cfg.format.code == 4 else 8
        decays = p * (k if cfg.decay == "vector" else 1)
        decay_floats = (decays * cfg.decay_dtype.itemsize + 15) // 16 * 4  # rounded up to 16 bytes
        record_bytes = 2 if cfg.records == "fp16" else 4
        floats += v * k * code_bits // 32 + v + decay_floats + (p * k + p * v) * record_bytes // 4
        floats += (k if cfg.smoothing else 0) + r * (k + v) // 2
    return 4 * floats


def _libnvrtc():
    """NVRTC from the ``nvidia-cuda-nvrtc`` wheel, else from the library path (``OSError`` if neither)."""
    import ctypes
    import glob
    import os
    import sys

    try:
        import nvidia  # noqa: F401 - the namespace package of NVIDIA's CUDA wheels
    except ImportError:
        return ctypes.CDLL("libnvrtc.so")
    for root in getattr(sys.modules["nvidia"], "__path__", []):
        for lib in sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*"))):
            return ctypes.CDLL(lib)
    return ctypes.CDLL("libnvrtc.so")


def build_offline(cfg: PoolConfig, *, prefetch: bool, arch: str = "sm_90") -> bytes:
    """The close for pools of ``cfg`` built by NVRTC for ``arch`` without a GPU: the cubin.

    The launcher builds a variant only when a GPU first closes such a pool, so a variant that does not
    compile (say the unstaged one, which misaligned pools and pre-Ampere GPUs take) would otherwise fail
    only there; CI builds them all with this (``nvidia-cuda-nvrtc``), and ``scripts/kernel_resources.py``
    reads their registers and spills.  Raises ``OSError`` without NVRTC and :class:`LeapQuantError` with
    the compiler's log if the source does not compile.
    """
    import ctypes

    lib = _libnvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.read_bytes(), b"close.cu", 0, None, None) != 0:
        raise LeapQuantError("NVRTC could not create a program from close.cu")
    try:
        options = [f"--gpu-architecture={arch}", *compile_options(cfg, prefetch=prefetch)]
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        size = ctypes.c_size_t()
        if lib.nvrtcCompileProgram(prog, len(options), opts) != 0:
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise LeapQuantError(
                f"close.cu does not compile for {arch} ({' '.join(options)}):\n{log.value.decode()}"
            )
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.cache
def _kernel(cfg: PoolConfig, device: int, aligned: bool = True):
    """The close built for ``cfg`` on ``device``, and its dynamic shared memory in bytes.  ``aligned``: every
    head of every slot starts on 16 bytes (the tensors and their slot shifts), as the staging copies need (a
    pool carved out of another buffer, or pages padded to less, might not: it closes without them)."""
    reason = unavailable()
    if reason is not None:
        raise LeapQuantError(
            f"the CUDA close cannot be built: {reason}; use LaunchConfig(close_impl='triton')"
        )
    props = torch.cuda.get_device_properties(device)
    # cp.async needs compute capability 8.0 (Ampere) or later
    prefetch = aligned and (props.major, props.minor) >= (8, 0)
    prefetch = prefetch and prefetches(cfg, props.shared_memory_per_multiprocessor)
    shared = shared_bytes(cfg, prefetch=prefetch)
    with torch.cuda.device(device):
        kernel = torch.cuda._compile_kernel(
            SOURCE.read_text(), "leapquant_close", nvcc_options=compile_options(cfg, prefetch=prefetch)
        )
        kernel.set_shared_memory_config(shared)
    return kernel, shared


def launch_cuda_close(pool: LeapQuantPool, blocks: int) -> None:
    """Close the windows of the heads the step kernel listed (``pool.close_list()``), ``blocks`` persistent
    blocks on the current stream (CUDA-graph capturable: one ``cuLaunchKernel``)."""
    from ...methods.smoothing import SMOOTHING_FLOOR

    cfg = pool.config
    # callers decide once a step (launch.resolve_close); this guards direct calls
    reason = unsupported(cfg) or unsupported_layout(pool)
    if reason is not None:
        raise LeapQuantError(f"the CUDA close does not apply: {reason}")
    t = pool.tensors
    dummy = t["pos"]
    list_, count = pool.close_list()
    shifts = pool.slot_shift()  # SHIFT_ORDER; all 0 unless the pool is a view over an engine's pages
    args = [
        list_, count, t["payload"], t["scale"], t.get("smooth", dummy), t.get("comp_k", dummy),
        t.get("comp_u", dummy), t["rec_g"], t["rec_k"], t["rec_u"], t["pos"], float(SMOOTHING_FLOOR),
        float(cfg.format.qmax), cfg.heads, *shifts,
    ]  # fmt: skip
    # the staging copies move 16-byte pieces: every head of every slot must start on 16 bytes
    aligned = all(t.data_ptr() % 16 == 0 for t in pool.tensors.values()) and all(
        shift * pool.tensors[name].element_size() % 16 == 0
        for name, shift in zip(SHIFT_ORDER, shifts, strict=True)
        if name in pool.tensors
    )
    with torch.cuda.device(pool.device):  # the pool's device and its current stream, not the caller's device
        kernel, shared = _kernel(cfg, torch.cuda.current_device(), aligned)
        kernel(grid=(blocks, 1, 1), block=(THREADS, 1, 1), args=args, shared_mem=shared)
