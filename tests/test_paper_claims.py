"""The paper's qualitative claims on synthetic traces of 4096 tokens with long-memory heads.

Output error must order as the paper's Table 2 ablation does (per-step INT8 > per-window > + compensator
tokens > + smoothing) and LeapQuant INT8 must beat per-step BF16, on both a GDN and a KDA trace.
"""

from __future__ import annotations

import pytest

from leapquant.eval.simulate import simulate
from leapquant.traces.synth import SynthConfig, synthesize

ABLATION = ("int8", "int8/w16", "int8/w16+ct4", "int8/w16+ct4+smooth")


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_ablation_ordering_and_leapquant_beats_bf16(family):
    trace = synthesize(SynthConfig(family=family, streams=4, tokens=4096, seed=11))
    report = simulate([trace], [*ABLATION, "bf16", "leapquant-int8"], checkpoints=4)["methods"]
    errors = [report[m]["output_rel_err"] for m in ABLATION]
    assert errors == sorted(errors, reverse=True), dict(zip(ABLATION, errors))
    assert report["leapquant-int8"]["output_rel_err"] == report["int8/w16+ct4+smooth"]["output_rel_err"]
    assert report["leapquant-int8"]["output_rel_err"] < report["bf16"]["output_rel_err"]
    assert report["leapquant-int8"]["final_state_rel_err"] < report["bf16"]["final_state_rel_err"]


def test_synthetic_traces_have_long_memory_and_are_reproducible():
    a = synthesize(SynthConfig(family="kda", streams=2, tokens=64, d_k=16, d_v=8, seed=3))
    b = synthesize(SynthConfig(family="kda", streams=2, tokens=64, d_k=16, d_v=8, seed=3))
    assert (a.records.k == b.records.k).all() and (a.records.a == b.records.a).all()
    assert float((a.records.a > 0.99).float().mean()) > 0.5
