"""Triton helpers of :mod:`leapquant.ops.common` against their exact definitions (interpreted on the CPU)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from leapquant.ops.common import divide_by_reciprocal
from leapquant.ops.leapquant_decode.close import _start_vectors

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 1024


@triton.jit
def _divide_kernel(a, b, fast, exact, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b_a, b_b = tl.load(a + o), tl.load(b + o)
    b_y = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), b_b)
    tl.store(fast + o, divide_by_reciprocal(b_a, b_b, b_y))
    tl.store(exact + o, tl.math.div_rn(b_a, b_b))


def _floats(sign: torch.Tensor, gen: torch.Generator, lo: int, hi: int, n: int) -> torch.Tensor:
    """fp32 with uniformly random mantissas and exponents in ``[lo, hi]``, signs from ``sign`` (1: negative),
    and a quarter of the mantissas at the extremes (all ones, all zeros but the last bits): the hard cases of
    reciprocal-based division are divisors whose significand is close to 2 or to 1."""
    mant = torch.randint(0, 1 << 23, (n,), generator=gen, dtype=torch.int64)
    edge = torch.randint(0, 64, (n,), generator=gen, dtype=torch.int64)
    pick = torch.randint(0, 8, (n,), generator=gen, dtype=torch.int64)
    mant = torch.where(pick == 0, (1 << 23) - 1 - edge, torch.where(pick == 1, edge, mant))
    exp = torch.randint(lo, hi + 1, (n,), generator=gen, dtype=torch.int64) + 127
    bits = ((exp << 23) | mant) - (sign << 31)  # the sign bit set, as int32 two's complement
    return bits.to(torch.int32).view(torch.float32)


@pytest.mark.parametrize(
    ("a_range", "b_range"),
    [
        pytest.param((-90, 90), (-30, 30), id="wide"),
        pytest.param((-3, 3), (-3, 3), id="unit"),
        pytest.param((-64, -60), (55, 60), id="small-over-large"),
        pytest.param((80, 90), (-30, -20), id="large-over-small"),
    ],
)
def test_divide_by_reciprocal_is_correctly_rounded(a_range, b_range):
    """Where the close uses it (normal dividends, divisors and quotients), one multiply and four FMAs from the
    correctly rounded reciprocal give ``div_rn``'s quotient, bit for bit; exact quotients too."""
    n = (1 << 22) if DEVICE == "cuda" else (1 << 14)
    gen = torch.Generator().manual_seed(sum(a_range) * 7 + sum(b_range))
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64)
    a = _floats(sign, gen, *a_range, n)
    b = _floats(torch.zeros_like(sign), gen, *b_range, n)
    k = torch.randint(-300, 300, (n // 8,), generator=gen).float()
    a[: n // 8] = k * b[: n // 8]  # exact quotients (integers): the remainder is zero
    a, b = a.to(DEVICE), b.to(DEVICE)
    fast, exact = torch.empty_like(a), torch.empty_like(a)
    _divide_kernel[(n // BLOCK,)](a, b, fast, exact, BLOCK=BLOCK)
    assert torch.isfinite(exact).all()
    bad = (fast.view(torch.int32) != exact.view(torch.int32)).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ, e.g. {a[bad[:3]].tolist()} / {b[bad[:3]].tolist()}"


@triton.jit
def _hash_kernel(out, d_v, R: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr):
    o_v = tl.program_id(0) * BV + tl.arange(0, BV)
    o_r = tl.arange(0, BR)
    mask = (o_r < R)[:, None] & (o_v < d_v)[None, :]
    tl.store(out + o_r[:, None] * d_v + o_v[None, :], _start_vectors(o_r, o_v), mask=mask)


@pytest.mark.parametrize(
    ("d_v", "rank"), [pytest.param(4096, 8, id="4096x8"), pytest.param(96, 3, id="96x3-ragged")]
)
def test_kernel_start_vectors_are_the_reference_hash(d_v, rank):
    """The close's uint32 hash (32-bit wrapping multiplies) gives the reference's int64 +-1 start vectors,
    element for element, over value rows far beyond any head dimension."""
    from leapquant.methods.compensators import start_vectors

    out = torch.empty(rank, d_v, device=DEVICE)
    _hash_kernel[(triton.cdiv(d_v, 128),)](out, d_v, R=rank, BR=triton.next_power_of_2(rank), BV=128)
    ref = start_vectors(d_v, rank, dtype=torch.float32, device=DEVICE).T
    assert torch.equal(out, ref)
