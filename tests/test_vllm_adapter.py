"""The vLLM metadata adapter (no vLLM import): mixed prefill/decode batches over a paged pool laid out as vLLM
lays out a layer's state pages, against a per-request replay and the dense fp32 recurrence.

On a GPU the same tests run the Triton kernels (the adapter gathers the paged slots for them); on the CPU
the reference ops, plus one case through the kernels in the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

from leapquant.errors import LeapQuantError
from leapquant.integrations.vllm.adapter import (
    LinearAttentionBatch,
    paged_pool,
    pool_config,
    pool_view,
    reference_prefill,
    run_linear_attention,
)
from leapquant.methods import parse_method
from leapquant.ops.leapquant_decode import leapquant_decode, load_states, materialize_states
from leapquant.ops.pool import LeapQuantPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONV_BYTES = 96  # a stand-in for the conv state vLLM keeps first in every page


def poisoned_pool(cfg, slots: int, page_bytes: int, gen: torch.Generator):
    """Pool tensors packed per slot into pages of ``page_bytes`` as vLLM's ``MambaBase.bind_kv_cache`` does
    (conv state first), every byte random: poison for any slot the adapter must leave alone."""
    pages, pool = paged_pool(cfg, slots, lead_bytes=CONV_BYTES, page_bytes=page_bytes, device=DEVICE)
    pages.copy_(torch.randint(-128, 128, pages.shape, dtype=torch.int8, generator=gen))
    for t in pool.tensors.values():  # finite floats (random bytes may be NaN), positions 0; prefill resets
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=gen).to(DEVICE, t.dtype))
    pool.tensors["pos"].zero_()
    return pages, pool


def token_stream(family: str, length: int, h: int, hv: int, d: int, gen: torch.Generator):
    def rnd(*shape, scale=1.0):
        return (torch.randn(length, *shape, generator=gen) * scale).to(DEVICE)

    a = rnd(hv, d) if family == "kda" else rnd(hv)
    return {"q": rnd(h, d), "k": rnd(h, d), "v": rnd(hv, d), "a": a, "b": rnd(hv)}


# requests: (slot, chunks) where a chunk is a prefill length or "d" for one decode token. The steps below are
# vLLM-ordered batches (decodes first, then prefills); C's prompt is prefilled in two chunks.
STEPS = [
    {"prefill": [("A", 5), ("B", 3)]},
    {"decode": ["A", "B"], "prefill": [("C", 4)]},
    {"decode": ["A", "B"], "prefill": [("C", 2)]},
    *[{"decode": ["A", "B", "C"], "pad": 2}] * 9,
    {"decode": ["C", "A"], "prefill": [("B", 3)]},  # B gets more prompt after decoding (has_initial_state)
    *[{"decode": ["B", "C", "A"]}] * 3,
]
SLOTS = {"A": 3, "B": 7, "C": 5}


def _gates(family, hv, d):
    a_log = torch.linspace(-2.0, 0.5, hv, device=DEVICE)
    dt_bias = torch.linspace(-0.5, 0.5, hv * d if family == "kda" else hv, device=DEVICE)
    return a_log, dt_bias


def run_scenario(family: str, method: str, backend: str, *, h=1, hv=2, d=32, seed=0, paged=True, nan_at=None):
    """STEPS through the adapter: per-request outputs, the pool, its pages and their copy from before.
    ``paged=False``: the same start on a contiguous copy of the pool (``pages`` is then that copy's);
    ``nan_at=(request, token, head)``: a NaN in that token's first value channel."""
    gen = torch.Generator().manual_seed(seed)
    decay = "vector" if family == "kda" else "scalar"
    cfg = pool_config(parse_method(method), heads=hv, d_k=d, d_v=d, decay=decay)
    # whole 4 KiB pages, as vLLM's are whole attention pages: Triton specializes the slot shifts on
    # divisibility by 16, and the same specialization as a contiguous pool's keeps the kernels' bits equal
    page = -(-(CONV_BYTES + cfg.bytes_per_slot()) // 4096) * 4096
    pages, pool = poisoned_pool(cfg, 10, page, gen)
    assert pool.paged
    if not paged:
        pool = LeapQuantPool(cfg, {name: t.contiguous() for name, t in pool.tensors.items()})
        assert not pool.paged
        pages = torch.cat([t.reshape(10, -1).view(torch.uint8) for t in pool.tensors.values()], 1)
    before = pages.clone()
    a_log, dt_bias = _gates(family, hv, d)
    total = {r: sum(n for st in STEPS for rr, n in st.get("prefill", []) if rr == r)
             + sum(r in st.get("decode", []) for st in STEPS) for r in SLOTS}  # fmt: skip
    streams = {r: token_stream(family, total[r], h, hv, d, gen) for r in SLOTS}
    if nan_at is not None:
        streams[nan_at[0]]["v"][nan_at[1], nan_at[2], 0] = float("nan")
    seen = dict.fromkeys(SLOTS, 0)
    outputs = {r: [] for r in SLOTS}
    prefill = lambda *x: reference_prefill(*x, A_log=a_log, dt_bias=dt_bias)  # noqa: E731
    for step in STEPS:
        rows = [(r, 1) for r in step.get("decode", [])] + list(step.get("prefill", []))
        slices = {}
        cu = [0]
        for r, n in rows:
            slices[r] = (seen[r], seen[r] + n)
            cu.append(cu[-1] + n)
        n_dec = len(step.get("decode", []))
        pad = step.get("pad", 0)
        slots = [SLOTS[r] for r, _ in rows] + [-1] * pad
        fields = {}
        for name in ("q", "k", "v", "a", "b"):
            parts = [streams[r][name][lo:hi] for r, (lo, hi) in slices.items()]
            parts += [torch.zeros_like(parts[0][:1])] * pad
            fields[name] = torch.cat(parts)
        prefills = step.get("prefill", [])
        batch = LinearAttentionBatch(
            num_prefills=len(prefills),
            num_prefill_tokens=sum(n for _, n in prefills),
            num_decodes=n_dec,
            num_decode_tokens=n_dec,
            num_actual_tokens=cu[-1] + pad,
            non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32, device=DEVICE),
            non_spec_query_start_loc=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
            has_initial_state=torch.tensor([seen[r] > 0 for r, _ in rows], device=DEVICE)
            if prefills
            else None,
        )
        out = torch.full((cu[-1] + pad, hv, d), float("nan"), device=DEVICE)
        run_linear_attention(pool, batch, *fields.values(), A_log=a_log, dt_bias=dt_bias, prefill=prefill,
                             out=out, backend=backend)  # fmt: skip
        for i, (r, (_, hi)) in enumerate(slices.items()):
            outputs[r].append(out[cu[i] : cu[i + 1]])
            seen[r] = hi
        assert not out[cu[-1] :].any(), "padded rows must read zeros"
    outputs = {r: torch.cat(o) for r, o in outputs.items()}
    return outputs, pool, pages, before, streams, (a_log, dt_bias), cfg


def replay(family, cfg, streams, gates, backend):
    """Each request alone on a contiguous one-slot pool through the public ops, chunk by chunk as STEPS feeds
    it: what the adapter must reproduce from the shared paged pool."""
    a_log, dt_bias = gates
    out = {}
    for r in SLOTS:
        pool = LeapQuantPool.allocate(cfg, 1, device=DEVICE)
        slot = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        s, pos, parts = streams[r], 0, []
        for step in STEPS:
            n = dict(step.get("prefill", [])).get(r)
            if r in step.get("decode", []):
                x = [s[f][pos : pos + 1] for f in ("q", "k", "v", "a", "b")]
                parts.append(leapquant_decode(pool, slot, *x, A_log=a_log, dt_bias=dt_bias, beta_sigmoid=True,
                                              backend=backend))  # fmt: skip
                pos += 1
            if n:
                init = materialize_states(pool, slot, backend=backend) if pos else torch.zeros(
                    1, cfg.heads, cfg.d_k, cfg.d_v, device=DEVICE)  # fmt: skip
                x = [s[f][pos : pos + n] for f in ("q", "k", "v", "a", "b")]
                cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
                o, final = reference_prefill(*x, init, cu, A_log=a_log, dt_bias=dt_bias)
                load_states(pool, slot, final, backend=backend)
                parts.append(o)
                pos += n
        out[r] = torch.cat(parts)
    return out


def dense(family, streams, gates):
    """The exact fp32 trajectory of each request (no quantization)."""
    a_log, dt_bias = gates
    out = {}
    for r, s in streams.items():
        n = s["q"].shape[0]
        hv, d = s["v"].shape[1:]
        init = torch.zeros(1, hv, d, d, device=DEVICE)
        cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
        out[r] = reference_prefill(*s.values(), init, cu, A_log=a_log, dt_bias=dt_bias)[0]
    return out


def untouched(pages, before):
    used = set(SLOTS.values())
    return all(torch.equal(pages[i], before[i]) for i in range(pages.shape[0]) if i not in used)


CASES = [
    # (family, method)
    ("gdn", "int8/w4+ct2+smooth"),
    ("gdn", "int4/w4+ct2+smooth"),
    ("kda", "int8/w4+ct2+smooth"),
    ("kda", "fp8-e4m3/w4+ct1"),
]


@pytest.mark.parametrize(("family", "method"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_adapter_matches_replay_and_tracks_fp32(family, method):
    backend = "auto"
    outputs, pool, pages, before, streams, gates, cfg = run_scenario(family, method, backend)
    assert untouched(pages, before), "a slot outside the batch changed"
    expected = replay(family, cfg, streams, gates, backend)
    exact = dense(family, streams, gates)
    for r in SLOTS:
        if DEVICE == "cpu":  # same reference ops in the same order: identical
            assert torch.equal(outputs[r], expected[r].to(outputs[r].dtype)), r
        else:
            torch.testing.assert_close(outputs[r], expected[r].float(), rtol=1e-3, atol=1e-3)
        err = ((outputs[r] - exact[r]).norm() / exact[r].norm()).item()
        assert err < (0.08 if "int4" in method else 0.02), (r, err)
    # windows closed along the way: 12+ decode tokens for A and C at window 4
    assert pool.pos[SLOTS["A"], 0].item() == (sum("A" in s.get("decode", []) for s in STEPS)) % cfg.window


@pytest.mark.parametrize("method", ["int8/w4+ct2+smooth", "bf16/w4"], ids=["int8", "bf16-no-scales"])
def test_a_prefill_left_non_finite_poisons_its_heads_not_the_engine(method, caplog):
    """Request B's first prompt token carries a NaN in value head 0 (an overflow upstream). Raising there
    (``load_states`` refuses non-finite states) would end the engine and every request in it; instead B's
    head 0 is stored as NaN, so its outputs stay non-finite through decode and window closes, as an fp32
    state's would, an error names the slot, and every other head and request computes what it computes
    without the NaN."""
    import logging

    clean, _, _, _, _, _, _ = run_scenario("gdn", method, "auto", seed=5)
    with caplog.at_level(logging.ERROR, logger="leapquant.integrations.vllm.adapter"):
        got = run_scenario("gdn", method, "auto", seed=5, nan_at=("B", 0, 0))
    outputs, pool, pages, before = got[:4]
    assert f"slot(s) [{SLOTS['B']}] (heads [0])" in caplog.text
    assert untouched(pages, before)
    same = torch.equal if DEVICE == "cpu" else lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    for r in ("A", "C"):
        assert same(outputs[r], clean[r]), r
    assert same(outputs["B"][:, 1], clean["B"][:, 1])
    assert not torch.isfinite(outputs["B"][:, 0]).all(-1).any()  # every token after the NaN
    states = materialize_states(pool, torch.tensor([SLOTS["B"]], dtype=torch.int32, device=DEVICE))
    assert not torch.isfinite(states[0, 0]).any() and torch.isfinite(states[0, 1]).all()


PAGED_CASES = [("gdn", "int8/w4+ct2+smooth"), ("kda", "int4/w4+ct2+smooth")]


@pytest.mark.parametrize(("family", "method"), PAGED_CASES, ids=[f"{f}-{m}" for f, m in PAGED_CASES])
def test_kernels_on_pages_match_kernels_on_a_contiguous_pool(family, method):
    """The kernels (Triton; the interpreter on a CPU) read and write a paged pool through per-tensor slot
    shifts: the same bits as on a contiguous copy, and close to the reference."""
    got = run_scenario(family, method, "triton", seed=3)
    flat = run_scenario(family, method, "triton", seed=3, paged=False)
    ref = run_scenario(family, method, "reference", seed=3)
    assert untouched(got[2], got[3])
    # the kernels sum in other orders than the reference: a code can round the other way at a tie, one
    # quantization step, which is 1/7 of a channel's scale at 4 bits
    tol = 1e-2 if "int4" in method else 2e-3
    for r in SLOTS:
        assert torch.equal(got[0][r], flat[0][r]), r
        torch.testing.assert_close(got[0][r], ref[0][r], rtol=tol, atol=tol)
    for name, t in got[1].tensors.items():
        assert torch.equal(t, flat[1].tensors[name]), name


def test_pool_view_rejects_a_wrong_layout():
    cfg = pool_config(parse_method("leapquant-int8"), heads=2, d_k=32, d_v=32, decay="scalar")
    gen = torch.Generator().manual_seed(0)
    _, pool = poisoned_pool(cfg, 4, CONV_BYTES + cfg.bytes_per_slot(), gen)
    tensors = list(pool.tensors.values())
    with pytest.raises(LeapQuantError, match="state tensors given"):
        pool_view(cfg, tensors[:-1])
    with pytest.raises(LeapQuantError, match=r"state payload is torch\.uint8"):
        pool_view(cfg, [tensors[0].view(torch.uint8), *tensors[1:]])
    with pytest.raises(LeapQuantError, match="has no pool layout"):
        pool_config(parse_method("fp32"), heads=2, d_k=32, d_v=32, decay="scalar")


def test_the_plugin_switch_parses_the_method_where_it_enters():
    from types import SimpleNamespace

    from leapquant.integrations.vllm import configured_method

    def config(extra):
        return SimpleNamespace(additional_config=extra)

    assert configured_method(config({})) is None
    assert configured_method(config({"leapquant_method": "leapquant-int8"})) == parse_method("leapquant-int8")
    with pytest.raises(LeapQuantError, match="is not a method"):
        configured_method(config({"leapquant_method": "leapqant-int8"}))
    with pytest.raises(LeapQuantError, match="must be a method name string"):
        configured_method(config({"leapquant_method": 8}))


def test_speculative_batches_are_refused():
    cfg = pool_config(parse_method("leapquant-int8"), heads=2, d_k=32, d_v=32, decay="scalar")
    pool = LeapQuantPool.allocate(cfg, 2, device=DEVICE)
    batch = LinearAttentionBatch(0, 0, 0, 0, 2, torch.zeros(0, dtype=torch.int32), torch.zeros(1), None, 1)
    with pytest.raises(LeapQuantError, match="speculative"):
        run_linear_attention(pool, batch, *[torch.zeros(2, 2, 32)] * 5, A_log=torch.zeros(2), dt_bias=None,
                             prefill=reference_prefill, out=torch.zeros(2, 2, 32))  # fmt: skip
