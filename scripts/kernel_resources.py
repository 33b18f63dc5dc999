"""Compile the decode kernels for sm_90 on a machine without a GPU and print registers, spills and shared
memory (from the ptxas/cuobjdump that ship with Triton). Catches compile errors and register pressure before
spending device time. ``--sass`` adds static SASS counts of each kernel (instructions, local loads and stores
of spills, barriers, shuffles, tensor-core ops): what BENCHMARKS.md quotes for the close trials.

    python scripts/kernel_resources.py [--sass]

The CUDA close (``close.cu``) is compiled too when NVRTC is installed here (``pip install
nvidia-cuda-nvrtc``; the GPU machine builds it with its own at run time).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's GPU default; silences a 3.9 warning

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from leapquant.ops.leapquant_decode import close as cc
from leapquant.ops.leapquant_decode import fused_recurrent as lq

TARGET = GPUTarget("cuda", 90, 32)
HOPPER_SHARED_PER_SM = 228 * 1024  # H100 / H200: what decides the CUDA close's prefetch there
SASS = "--sass" in sys.argv[1:]
PAYLOAD = {0: "*fp32", 1: "*bf16", 2: "*i8", 3: "*fp8e4nv", 4: "*u8"}


def resources(kernel, pointers: dict, scalars: dict, consts: dict, warps: int, maxnreg: int | None = None):
    fn = kernel
    while not isinstance(fn, triton.runtime.JITFunction):  # unwrap @triton.heuristics
        fn = fn.fn
    names = fn.arg_names
    types = {n: pointers[n] for n in names if n in pointers}
    types.update(scalars)
    constexprs = {}
    for name, value in consts.items():
        types[name] = "constexpr"
        constexprs[(names.index(name),)] = value
    # a launch specializes pointers to 16-byte alignment; without the hint loads do not vectorize and the
    # registers counted here would be those of a kernel that never runs
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers if n in names}
    options = {"num_warps": warps, "maxnreg": maxnreg}
    compiled = triton.compile(ASTSource(fn=fn, signature=types, constexprs=constexprs, attrs=attrs),
                              target=TARGET, options=options)  # fmt: skip
    return cubin_report(compiled.asm["cubin"], f"shared {compiled.metadata.shared} B")


def cubin_report(cubin: bytes, shared: str) -> str:
    """Registers and spills of a cubin (and, with ``--sass``, its static SASS counts), from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout if SASS else ""
    os.unlink(f.name)
    reg, stack = re.search(r"REG:(\d+)", out).group(1), re.search(r"STACK:(\d+)", out).group(1)
    text = f"registers {reg}, stack (spills) {stack} B, {shared}"
    if SASS:
        lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
        ops = ("LDL", "STL", "BAR", "SHFL", "HMMA", "PRMT")
        counts = {op: sum(op in line for line in lines) for op in ops}
        text += f"; SASS {len(lines)} instructions, " + ", ".join(f"{k} {v}" for k, v in counts.items())
    return text


def cuda_close_resources(cfg, prefetch: bool | None = None) -> str:
    """Registers, spills and SASS counts of the CUDA close built for sm_90 by NVRTC (``prefetch``: staged or
    not; default: as an H100 builds it)."""
    from leapquant.ops.leapquant_decode import close_cuda

    if prefetch is None:
        prefetch = close_cuda.prefetches(cfg, HOPPER_SHARED_PER_SM)
    cubin = close_cuda.build_offline(cfg, prefetch=prefetch)
    shared = close_cuda.shared_bytes(cfg, prefetch=prefetch)
    return cubin_report(cubin, f"shared {shared} B dynamic, prefetch {'on' if prefetch else 'off'}")


def cuda_closes() -> None:
    from leapquant.methods import MethodConfig
    from leapquant.ops import PoolConfig
    from leapquant.ops.leapquant_decode.close_cuda import _libnvrtc

    try:
        _libnvrtc()
    except OSError:
        print("CUDA close: NVRTC is not installed here (pip install nvidia-cuda-nvrtc)")
        return
    cases = (("gdn", "int8", 16, 4), ("kda", "int8", 16, 4), ("gdn", "int4", 16, 8),
             ("kda", "fp8-e4m3", 32, 4), ("gdn", "int8", 8, 0))  # fmt: skip
    for family, residual, window, rank in cases:
        method = MethodConfig(residual, window=window, compensators=rank, smoothing=True)
        cfg = PoolConfig(method, heads=32, decay="vector" if family == "kda" else "scalar")
        print(f"CUDA close, {family} {residual} p={window} r={rank}: {cuda_close_resources(cfg)}")
        if window == 16 and rank == 4:  # the unstaged build (misaligned pools, older GPUs) must compile too
            print(f"CUDA close, {family} {residual} p={window} r={rank}: {cuda_close_resources(cfg, False)}")


# the pool's slot shifts (int arguments; unused by these contiguous-pool compiles, PAGED=False)
SHIFTS = {f"shift_{n}": "i64" for n in ("payload", "scale", "smooth", "comp_k", "comp_u", "rec_g", "rec_k",
                                          "rec_u", "pos")}  # fmt: skip


def main() -> None:
    # rec_g: GDN's fp32 running sums, KDA's fp16 per-token decays (pool.PoolConfig.decay_dtype)
    decay_ptr = {"scalar": "*fp32", "vector": "*fp16", False: "*fp32", True: "*fp16"}
    common = dict(rec_g="*fp32", rec_k="*fp16", rec_u="*fp16", pos="*i32", scale_v="*fp32", smooth="*fp32",
                  comp_k="*fp16", comp_u="*fp16", payload=PAYLOAD[2])  # fmt: skip
    step_ptrs = dict(common, q="*bf16", k="*bf16", v="*bf16", g="*fp32", beta="*bf16", b_read="*i32",
                     o="*bf16", slots="*i32", close_list="*i32", close_count="*i32",
                     closing="*i8")  # fmt: skip
    for decay, bv, warps in (("scalar", 8, 1), ("vector", 32, 4)):
        consts = dict(H=16, HV=32, K=128, V=128, P=16, R=4, BV=bv, BP=16, BR=4, NATIVE=True,
                      USE_QK_L2NORM=True, BETA_SIGMOID=False, RESIDUAL=3, SMOOTH=True, READ_PRE=False,
                      ADVANCE=True, SUBSET=0, STAGES=2, FAST_CVT=True, VECTOR_DECAY=decay == "vector",
                      HAS_DT_BIAS=False, GATE_IN_KERNEL=False, A_log=None, dt_bias=None,
                      PAGED=False)  # fmt: skip
        ptrs = dict(step_ptrs, payload=PAYLOAD[3], rec_g=decay_ptr[decay])
        print(f"step kernel (CUDA cores), {decay} decay, fp8, BV={bv}, {warps} warps:",
              resources(lq.step_kernel, ptrs, {"qk_scale": "fp32", **SHIFTS}, consts, warps))  # fmt: skip
    # (decay, codes, tokens, rows per chunk, warps, stages, register cap): the shipped launches
    # (LaunchConfig.tuned: int8 BV=64 two stages; packed int4 three stages at 168 registers), then others
    tc_shapes = (("scalar", 2, 4, 64, 1, 2, None), ("vector", 2, 4, 64, 1, 2, None),
                 ("scalar", 4, 8, 64, 1, 3, 168), ("vector", 4, 8, 64, 1, 3, 168),
                 ("scalar", 4, 8, 64, 1, 2, None), ("scalar", 2, 0, 64, 1, 2, None),
                 ("scalar", 4, 0, 64, 1, 2, None), ("scalar", 2, 0, 16, 1, 3, None),
                 ("vector", 2, 4, 32, 2, 3, None))  # fmt: skip
    for decay, code, rank, bv, warps, stages, maxnreg in tc_shapes:
        consts = dict(H=16, HV=32, K=128, V=128, P=16, R=rank, BV=bv, BP=16, STAGES=stages, NATIVE=True,
                      USE_QK_L2NORM=True,
                      BETA_SIGMOID=False, RESIDUAL=code, SMOOTH=True, READ_PRE=False, ADVANCE=True,
                      SUBSET=1,
                      VECTOR_DECAY=decay == "vector", HAS_DT_BIAS=False, GATE_IN_KERNEL=False, A_log=None,
                      dt_bias=None, PAGED=False)  # fmt: skip
        ptrs = dict(step_ptrs, payload=PAYLOAD[code], rec_g=decay_ptr[decay])
        print(f"step kernel (tensor cores), {decay} decay, {'int4' if code == 4 else 'int8'}, r={rank}, "
              f"BV={bv}, {warps} warps, {stages} stages, maxnreg {maxnreg}:",
              resources(lq.step_tc_kernel, ptrs, {"qk_scale": "fp32", **SHIFTS}, consts, warps,
                        maxnreg))  # fmt: skip
    close_ptrs = dict(common, close_list="*i32", close_count="*i32", token_scratch="*fp16")
    scalars = {"smooth_floor": "fp32", "qmax": "fp32", **SHIFTS}
    # (tokens, vector decay, rows per chunk, warps, register cap, token-value scratch)
    shapes = ((4, False, 32, 4, None, True), (4, True, 32, 4, None, True), (8, False, 32, 4, None, True),
              (0, False, 32, 4, None, False), (4, False, 16, 4, 128, True), (4, True, 16, 4, 128, True),
              (4, False, 32, 4, 128, True), (4, False, 32, 4, 128, False), (4, True, 32, 4, 128, True),
              (4, True, 32, 4, 128, False))  # fmt: skip
    for rank, decay, bv, warps, maxnreg, scratch in shapes:
        br = 1 << max(0, rank - 1).bit_length()
        consts = dict(HV=32, K=128, V=128, P=16, R=rank, BV=bv, BR=br, BP=16, ITERS=1, RESIDUAL=2,
                      SMOOTH=True, VECTOR_DECAY=decay, REC16=True, TOKEN_SCRATCH=scratch,
                      PAGED=False, LS=False)  # fmt: skip
        ptrs = dict(close_ptrs, rec_g=decay_ptr[decay])
        usage = resources(cc.close_kernel, ptrs, scalars, consts, warps, maxnreg)
        kind = "vector" if decay else "scalar"
        print(f"chunked close, r={rank}, {kind} decay, BV={bv}, {warps} warps, maxnreg {maxnreg}, "
              f"token scratch {scratch}: {usage}")  # fmt: skip
    boundary_ptrs = dict(common, slots="*i32", dense="*fp32")
    for mode in (cc.MODE_LOAD, cc.MODE_MATERIALIZE):
        consts = dict(HV=32, K=128, V=128, P=16, R=4, BV=32, BR=4, BP=16, MODE=mode, DENSE_KV=True, ITERS=8,
                      RESIDUAL=2, SMOOTH=True, VECTOR_DECAY=False, REC16=True, PAGED=False,
                      LS=False)  # fmt: skip
        usage = resources(cc.boundary_kernel, boundary_ptrs, scalars, consts, 4)
        print(f"boundary kernel, {'load' if mode == cc.MODE_LOAD else 'materialize'}, 4 warps: {usage}")
    cuda_closes()


if __name__ == "__main__":
    main()
