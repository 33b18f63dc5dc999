"""Model-native parameters -> general-form records (paper eq. 1, Appendix A, Table 4).

``RECURRENCES[family]`` is the family's records function (native per-token tensors in FLA's layouts ->
:class:`Records`), ``NATIVE_REFERENCES[family]`` the family's own recurrence written as its reference
implementation computes it, and ``RECURRENCE_INFO[family]`` its decay kind, records per token and the size
of one buffered update ``(d_i, k_i, u_i)`` (Table 4, last column).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import LeapQuantError
from .delta import (
    deltanet_records,
    deltaproduct_records,
    gated_deltanet_records,
    gdn_gates,
    kda_gates,
    kda_records,
    naive_recurrent_delta_rule,
    naive_recurrent_gated_delta_product,
    naive_recurrent_gated_delta_rule,
    naive_recurrent_kda,
)
from .linear import (
    gla_records,
    hgrn2_gates,
    hgrn2_records,
    l2norm,
    linear_attention_records,
    mamba2_gates,
    mamba2_records,
    mamba2_skip,
    naive_recurrent_gla,
    naive_recurrent_hgrn2,
    naive_recurrent_linear_attention,
    naive_recurrent_mamba2,
    naive_recurrent_retnet,
    naive_recurrent_rwkv6,
    retnet_gammas,
    retnet_records,
    rwkv6_bonus,
    rwkv6_records,
)
from .records import Records, exact_recurrence
from .rwkv7 import naive_recurrent_rwkv7, rwkv7_records

__all__ = [
    "CONSTANT_SCALAR",
    "DATA_SCALAR",
    "DATA_VECTOR",
    "IDENTITY",
    "NATIVE_REFERENCES",
    "RECURRENCES",
    "RECURRENCE_INFO",
    "Records",
    "RecurrenceInfo",
    "decay_kind",
    "deltanet_records",
    "deltaproduct_records",
    "exact_recurrence",
    "gated_deltanet_records",
    "gdn_gates",
    "gla_records",
    "hgrn2_gates",
    "hgrn2_records",
    "kda_gates",
    "kda_records",
    "l2norm",
    "linear_attention_records",
    "mamba2_gates",
    "mamba2_records",
    "mamba2_skip",
    "naive_recurrent_delta_rule",
    "naive_recurrent_gated_delta_product",
    "naive_recurrent_gated_delta_rule",
    "naive_recurrent_gla",
    "naive_recurrent_hgrn2",
    "naive_recurrent_kda",
    "naive_recurrent_linear_attention",
    "naive_recurrent_mamba2",
    "naive_recurrent_retnet",
    "naive_recurrent_rwkv6",
    "naive_recurrent_rwkv7",
    "retnet_gammas",
    "retnet_records",
    "rwkv6_bonus",
    "rwkv6_records",
    "rwkv7_records",
    "values_per_record",
]

# Decay kinds of Appendix A.
IDENTITY = "identity"
CONSTANT_SCALAR = "constant scalar"
DATA_SCALAR = "data-dependent scalar"
DATA_VECTOR = "data-dependent vector"


@dataclass(frozen=True)
class RecurrenceInfo:
    """What one family's records look like.

    Attributes:
        family: registry name.
        decay_kind: one of ``IDENTITY``, ``CONSTANT_SCALAR``, ``DATA_SCALAR``, ``DATA_VECTOR``.
        records_per_token: records per token (``None``: ``n``, DeltaProduct's ``num_householder``).
        delta: whether the records carry a delta read (``b != 0``).
        readout: ``"post"`` or ``"pre"`` (RWKV6 reads ``S_{t-1}``).
    """

    family: str
    decay_kind: str
    records_per_token: int | None = 1
    delta: bool = False
    readout: str = "post"

    def values_per_record(self, d_k: int, d_v: int) -> int:
        """Values in one buffered update ``(d_i, k_i, u_i)``, Table 4's last column.

        A decay that is the identity or a per-head constant is not buffered (it is known per head), a
        data-dependent scalar costs one value and a data-dependent vector ``d_k``.  For RWKV7 this is the
        erase record (vector decay); its pure-write record has identity decay and needs ``d_k + d_v``.
        """
        decay = {IDENTITY: 0, CONSTANT_SCALAR: 0, DATA_SCALAR: 1, DATA_VECTOR: d_k}[self.decay_kind]
        return decay + d_k + d_v


RECURRENCES: dict[str, Callable[..., Records]] = {
    "linear_attention": linear_attention_records,
    "retnet": retnet_records,
    "mamba2": mamba2_records,
    "gla": gla_records,
    "rwkv6": rwkv6_records,
    "hgrn2": hgrn2_records,
    "deltanet": deltanet_records,
    "gated_deltanet": gated_deltanet_records,
    "kda": kda_records,
    "deltaproduct": deltaproduct_records,
    "rwkv7": rwkv7_records,
}

NATIVE_REFERENCES: dict[str, Callable] = {
    "linear_attention": naive_recurrent_linear_attention,
    "retnet": naive_recurrent_retnet,
    "mamba2": naive_recurrent_mamba2,
    "gla": naive_recurrent_gla,
    "rwkv6": naive_recurrent_rwkv6,
    "hgrn2": naive_recurrent_hgrn2,
    "deltanet": naive_recurrent_delta_rule,
    "gated_deltanet": naive_recurrent_gated_delta_rule,
    "kda": naive_recurrent_kda,
    "deltaproduct": naive_recurrent_gated_delta_product,
    "rwkv7": naive_recurrent_rwkv7,
}

RECURRENCE_INFO: dict[str, RecurrenceInfo] = {
    info.family: info
    for info in (
        RecurrenceInfo("linear_attention", IDENTITY),
        RecurrenceInfo("retnet", CONSTANT_SCALAR),
        RecurrenceInfo("mamba2", DATA_SCALAR),
        RecurrenceInfo("gla", DATA_VECTOR),
        RecurrenceInfo("rwkv6", DATA_VECTOR, readout="pre"),
        RecurrenceInfo("hgrn2", DATA_VECTOR),
        RecurrenceInfo("deltanet", IDENTITY, delta=True),
        RecurrenceInfo("gated_deltanet", DATA_SCALAR, delta=True),
        RecurrenceInfo("kda", DATA_VECTOR, delta=True),
        # Gated DeltaProduct; the ungated variant (g=None) has identity decay.
        RecurrenceInfo("deltaproduct", DATA_SCALAR, records_per_token=None, delta=True),
        RecurrenceInfo("rwkv7", DATA_VECTOR, records_per_token=2, delta=True),
    )
}


def _info(family: str) -> RecurrenceInfo:
    try:
        return RECURRENCE_INFO[family]
    except KeyError:
        raise LeapQuantError(
            f"unknown recurrence family {family!r}; expected one of {', '.join(RECURRENCE_INFO)}"
        ) from None


def decay_kind(family: str) -> str:
    """The family's decay kind: identity, constant scalar, data-dependent scalar or data-dependent vector."""
    return _info(family).decay_kind


def values_per_record(family: str, d_k: int, d_v: int) -> int:
    """Values in one buffered update ``(d_i, k_i, u_i)`` of ``family`` (Table 4's last column)."""
    return _info(family).values_per_record(d_k, d_v)
