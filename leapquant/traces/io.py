"""Trace files: general-form records of one or more (layer, head) streams, stored as ``.npz``.

Arrays (``S`` streams, ``T`` records; a single-stream file may drop the leading ``S`` axis):

========  ================  ==========================================================
key       shape             meaning
========  ================  ==========================================================
``a``     ``[S, T, d_k]``   decay per key channel in [0, 1]: ``exp(g)``, not ``g``
``k``     ``[S, T, d_k]``   write key (step size folded in)
``b``     ``[S, T, d_k]``   read vector of the delta rule (zeros without it)
``v``     ``[S, T, d_v]``   value
``q``     ``[S, T, d_k]``   query (scale folded in)
``S0``    ``[S, d_k, d_v]`` optional initial state (e.g. the state after prefill)
``emit``  ``[T]`` bool      optional: records that produce an output (sub-steps do not)
``readout`` scalar str      optional: ``post`` (o_t = S_t^T q_t, default) or ``pre`` (S_{t-1}, RWKV6)
``meta``  scalar str        optional JSON: model, layers, heads, how the trace was made
========  ================  ==========================================================

Floats may be float16/32/64; they are read as float64.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..checks import check_input_file, check_output_file
from ..errors import LeapQuantError
from ..recurrences.records import Records

__all__ = ["Trace", "load_trace", "save_trace"]

_REQUIRED = ("a", "k", "b", "v", "q")
# decays are exp(-x) <= 1; a little slack for one computed a rounding step above 1
_DECAY_SLACK = 1e-3


@dataclass
class Trace:
    """Records of ``S`` streams (``records`` tensors are ``[S, T, d]``), optional ``S0 [S, d_k, d_v]``."""

    records: Records
    initial_state: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)
    name: str = "trace"

    @property
    def streams(self) -> int:
        return self.records.k.shape[0]


def save_trace(
    path: str | Path,
    records: Records,
    initial_state: torch.Tensor | None = None,
    meta: dict | None = None,
) -> Path:
    """Write records with leading stream dims (flattened to ``S``) to ``path``, a ``.npz`` file in an
    existing folder."""
    flat = records.flatten() if records.k.ndim > 2 else records
    # always [S, T, d] (a single stream too), so that S0 [S, d_k, d_v] reads back with the records
    arrays = {n: (x := getattr(flat, n)).detach().cpu().reshape(-1, *x.shape[-2:]).numpy() for n in _REQUIRED}
    if initial_state is not None:
        arrays["S0"] = initial_state.reshape(-1, *initial_state.shape[-2:]).detach().cpu().numpy()
    if records.emit is not None:
        arrays["emit"] = records.emit.cpu().numpy()
    if records.readout != "post":
        arrays["readout"] = np.array(records.readout)
    arrays["meta"] = np.array(json.dumps(meta or {}))
    path = check_output_file(path, "trace", (".npz",))
    with open(path, "wb") as fh:  # by name, numpy would add ".npz" to "X.NPZ"
        np.savez_compressed(fh, **arrays)
    return path


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace; every problem raises a one-line :class:`LeapQuantError`."""
    path = check_input_file(path, "trace")
    try:
        data = np.load(path, allow_pickle=False)
        # np.load goes by content, not name: a .npy (renamed or not) comes back as one array
        if isinstance(data, np.lib.npyio.NpzFile):
            with data:
                arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise LeapQuantError(f"trace {path}: not a readable .npz file ({exc.__class__.__name__})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise LeapQuantError(f"trace {path}: holds a single .npy array, not a .npz trace (see save_trace)")
    missing = [key for key in _REQUIRED if key not in arrays]
    if missing:
        raise LeapQuantError(f"trace {path}: missing array(s) {', '.join(missing)} (needs a, k, b, v, q)")
    tensors = {}
    for key in (*_REQUIRED, "S0"):
        if key not in arrays:
            continue
        x = arrays[key]
        if x.dtype.kind != "f":
            raise LeapQuantError(f"trace {path}: array {key} has dtype {x.dtype}, expected a float type")
        tensors[key] = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
    k = tensors["k"]
    if k.ndim == 2:
        tensors = {n: x.unsqueeze(0) if n != "S0" or x.ndim == 2 else x for n, x in tensors.items()}
        k = tensors["k"]
    if k.ndim != 3:
        raise LeapQuantError(f"trace {path}: k must be [T, d_k] or [S, T, d_k], got shape {tuple(k.shape)}")
    s, t, d_k = k.shape
    for key in ("a", "b", "q"):
        if tensors[key].shape != k.shape:
            raise LeapQuantError(
                f"trace {path}: {key} has shape {tuple(tensors[key].shape)}, expected {(s, t, d_k)} like k"
            )
    v = tensors["v"]
    if v.ndim != 3 or v.shape[:2] != (s, t):
        raise LeapQuantError(f"trace {path}: v has shape {tuple(v.shape)}, expected {(s, t)} + (d_v,)")
    if t == 0 or d_k == 0 or v.shape[2] == 0:
        raise LeapQuantError(f"trace {path}: empty trace (shape {(s, t, d_k)})")
    s0 = tensors.get("S0")
    if s0 is not None and s0.shape != (s, d_k, v.shape[2]):
        raise LeapQuantError(f"trace {path}: S0 has shape {tuple(s0.shape)}, expected {(s, d_k, v.shape[2])}")
    for key, x in tensors.items():
        if not torch.isfinite(x).all():
            where = tuple((~torch.isfinite(x)).nonzero()[0].tolist())
            raise LeapQuantError(f"trace {path}: array {key} has a NaN or Inf at index {where}")
    a = tensors["a"]
    if bool(((a < 0) | (a > 1 + _DECAY_SLACK)).any()):
        lo, hi = float(a.min()), float(a.max())
        hint = "; log decays g? store a = exp(g)" if hi <= 0 else ""
        raise LeapQuantError(
            f"trace {path}: decays a must lie in [0, 1], got values in [{lo:.4g}, {hi:.4g}]{hint}"
        )
    emit = None
    if "emit" in arrays:
        e = arrays["emit"]
        if e.shape != (t,) or e.dtype.kind not in "bui":
            raise LeapQuantError(f"trace {path}: emit must be a bool array of shape ({t},)")
        emit = torch.from_numpy(e.astype(bool))
    readout = str(arrays["readout"]) if "readout" in arrays else "post"
    meta = {}
    if "meta" in arrays:
        try:
            meta = json.loads(str(arrays["meta"]))
        except json.JSONDecodeError:
            raise LeapQuantError(f"trace {path}: meta is not valid JSON") from None
    try:
        records = Records(
            a=tensors["a"], k=k, b=tensors["b"], v=v, q=tensors["q"], emit=emit, readout=readout
        )
    except LeapQuantError as exc:
        raise LeapQuantError(f"trace {path}: {exc}") from None
    return Trace(records=records, initial_state=s0, meta=meta, name=path.stem)
