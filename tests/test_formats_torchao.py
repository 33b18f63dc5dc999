"""MX and NVFP4 against torchao 0.18 as an oracle: scales, element codes and dequantized values, bit-exact.

torchao blocks run along the last dimension, so our ``[..., d_k, d_v]`` state is transposed to the V-first
``[..., d_v, d_k]`` layout before calling it (blocks along keys in both).  The edge cases where torchao's
eager path departs from the OCP spec / hardware are pinned down at the end (see leapquant/formats/mx.py and
nvfp.py for which behaviour we follow and why).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import unpack_uint4
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

from leapquant.formats import get_format

F32 = torch.float32
MX_CASES = (
    ("mxfp8", torch.float8_e4m3fn),
    ("mxfp8-e5m2", torch.float8_e5m2),
    ("mxfp6-e2m3", "fp6_e2m3"),
    ("mxfp6-e3m2", "fp6_e3m2"),
    ("mxfp4", torch.float4_e2m1fn_x2),
)
RULES = (("", ScaleCalculationMode.FLOOR), ("-rceil", ScaleCalculationMode.RCEIL))


def wide_state(shape, seed):
    """Gaussian entries spread over +-20 binades per element and +-30 per value column (float32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x = x * torch.exp2(torch.randint(-20, 21, shape, generator=g).float())
    col = (*shape[:-2], 1, shape[-1])
    return x * torch.exp2(torch.randint(-30, 31, col, generator=g).float())


def torchao_mx(x, elem_dtype, mode):
    """(E8M0 codes [..., d_v, n], element codes [..., d_v, d_k], dequantized [..., d_k, d_v]) from torchao."""
    scale, data = to_mx(x.transpose(-1, -2).contiguous(), elem_dtype, 32, mode)
    deq = to_dtype(data, scale, elem_dtype, 32, F32).transpose(-1, -2)
    if elem_dtype == torch.float4_e2m1fn_x2:
        codes = unpack_uint4(data)
    elif isinstance(elem_dtype, str):
        codes = data  # fp6: unpacked uint8 codes
    else:
        codes = data.view(torch.uint8)
    return scale.view(torch.uint8), codes, deq


@pytest.mark.parametrize(("suffix", "mode"), RULES, ids=("floor", "rceil"))
@pytest.mark.parametrize(("name", "elem_dtype"), MX_CASES, ids=[c[0] for c in MX_CASES])
@pytest.mark.parametrize("shape", ((3, 128, 48), (64, 5)), ids=("3x128x48", "64x5"))
def test_mx_matches_torchao(name, elem_dtype, suffix, mode, shape):
    x = wide_state(shape, seed=len(shape))
    f = get_format(name + suffix)
    q = f.quantize(x)
    scale, codes, deq = torchao_mx(x, elem_dtype, mode)
    assert torch.equal(q["scale"].transpose(-1, -2), scale)
    assert torch.equal(q["codes"].transpose(-1, -2), codes)
    assert torch.equal(f.dequantize(q, F32), deq)
    assert torch.equal(f.fake_quantize(x), deq)


def torchao_nvfp4(head):
    """torchao's two-level NVFP4 of one ``[d_k, d_v]`` head (d_k a multiple of 16)."""
    xt = head.transpose(0, 1).contiguous()
    t = NVFP4Tensor.to_nvfp4(xt, per_tensor_scale=per_tensor_amax_to_scale(xt.abs().amax()))
    return t, t.dequantize(F32).transpose(0, 1)


@pytest.mark.parametrize(
    ("shape", "spread"),
    (((2, 64, 32), 0), ((3, 128, 16), 20), ((1, 100, 9), 6)),
    ids=("2x64x32", "wide", "dk100"),
)
def test_nvfp4_matches_torchao(shape, spread):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=g)
    if spread:  # blocks far below the head's amax exercise the clamp at E4M3's min normal
        x = x * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=g).float())
    f = get_format("nvfp4")
    q = f.quantize(x)
    y = f.dequantize(q, F32)
    d_k = shape[-2]
    pad = -d_k % 16  # torchao needs whole blocks; zero padding changes no block maximum
    for h in range(shape[0]):
        t, ref = torchao_nvfp4(torch.nn.functional.pad(x[h], (0, 0, 0, pad)))
        assert q["tensor_scale"][h].item() == t.per_tensor_scale.item()
        assert torch.equal(q["block_scale"][h].transpose(0, 1).view(torch.uint8), t.scale.view(torch.uint8))
        assert torch.equal(q["codes"][h].transpose(0, 1), unpack_uint4(t.qdata)[:, :d_k])
        assert torch.equal(y[h], ref[:d_k])


# ---------------------------------------------------------------- documented departures from torchao


def test_mx_floor_code0_round_trip():
    # Block amax 2^-125 with E4M3: floor exponent -125 - 8 clamps to -127 (code 0).  torchao divides by
    # 2^-126 (its scale is clamped to the fp32 min normal) yet multiplies back by 2^-127, halving the block;
    # the spec's scale is 2^-127 both ways, which we follow, so the block survives exactly.
    x = torch.zeros(32, 1)
    x[0, 0], x[1, 0] = 2.0**-125, -(2.0**-128)
    scale, _, deq = torchao_mx(x, torch.float8_e4m3fn, ScaleCalculationMode.FLOOR)
    f = get_format("mxfp8")
    q = f.quantize(x)
    assert q["scale"].item() == scale.item() == 0
    assert torch.equal(f.dequantize(q), x)
    assert torch.equal(deq, x / 2)


def test_mx_rceil_code0_round_trip():
    # descale = amax / 448 = 2^-128 rounds up to 2^-128, clamps to 2^-127 (code 0).  torchao (like
    # TransformerEngine) then multiplies the data by 1.0 rather than 2^127, so the block flushes to zero;
    # we use the true reciprocal, and 448 * 2^-128 / 2^-127 = 224 is exact in E4M3.
    x = torch.zeros(32, 1)
    x[0, 0] = 448 * 2.0**-128
    scale, _, deq = torchao_mx(x, torch.float8_e4m3fn, ScaleCalculationMode.RCEIL)
    f = get_format("mxfp8-rceil")
    q = f.quantize(x)
    assert q["scale"].item() == scale.item() == 0
    assert torch.equal(f.dequantize(q), x)
    assert not deq.any()


def test_mx_rceil_exact_ceiling():
    # descale = 2^-10 (1 + 2^-22): its float32 log2 rounds to -10.0, so torchao's eager fallback picks
    # 2^-10 and saturates the block max; hardware (cvt.rp.satfinite.ue8m0) and we round up to 2^-9.
    x = torch.zeros(32, 1)
    x[0, 0] = (1.5 + 1.5 * 2.0**-22) * 2.0**-8
    scale, _, _ = torchao_mx(x, torch.float4_e2m1fn_x2, ScaleCalculationMode.RCEIL)
    q = get_format("mxfp4-rceil").quantize(x)
    assert scale.item() == 127 - 10 and q["scale"].item() == 127 - 9


def test_nvfp4_zero_head():
    # torchao's per-tensor scale of an all-zero tensor is 0 and its block scales 0/0 = NaN; ours stays
    # finite (tensor scale floored at 2^-120, block scales at E4M3's min normal 2^-6) and decodes to zero.
    x = torch.zeros(16, 4)
    _, ref = torchao_nvfp4(x)
    assert ref.isnan().all()
    f = get_format("nvfp4")
    assert torch.equal(f.fake_quantize(x), x)
