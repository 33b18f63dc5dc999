"""Allocate what ``leapquant memory`` plans and compare the bytes: weights, state, conv, KV, checkpoints.

    python scripts/memory_check.py --model qwen3.5-9b --batch 64 --context 4096 \\
        --prefix-cache-interval 1024 -m fp32 -m leapquant-int8 --json memory-check.json

Weights are random bf16 tensors of the model's real shapes (``--layers N`` keeps N decoder layers in the
model's linear:full ratio, for models that do not fit); the recurrent state is allocated by the library
itself (``LeapQuantPool.allocate`` / ``PerStepPool.allocate`` per linear layer) where a kernel pool exists,
everything else as plain tensors of the planned shapes.  Each group is measured by the bytes its tensors
request, which must equal the plan exactly: on CUDA the caching allocator's ``requested_bytes`` (its
``allocated_bytes`` are reported beside them, not checked: a request served from a cached block that is too
small to split counts the whole block, so they depend on what was freed before), on the CPU (no CUDA, or
``--device cpu``) the sum of tensor storage bytes.  Prints a table, writes JSON, exits 1 when a group is off.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from leapquant.errors import LeapQuantError
from leapquant.eval.provenance import provenance
from leapquant.methods import parse_method
from leapquant.ops.per_step_decode import PerStepPool
from leapquant.ops.pool import LeapQuantPool, PoolConfig
from leapquant.plan import buffer_plan, load_shape
from leapquant.plan.memory import state_layout

GROUPS = ("weights", "state", "conv", "kv", "checkpoint_state", "checkpoint_conv")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="preset or config.json path (as leapquant memory)")
    p.add_argument("--layers", type=int, help="keep N decoder layers (linear:full ratio kept); default all")
    p.add_argument("--batch", type=int, required=True, help="requests B")
    p.add_argument("--context", type=int, required=True, help="tokens per request")
    p.add_argument("--prefix-cache-interval", type=int, help="a checkpoint per this many tokens")
    p.add_argument(
        "--method", "-m", action="append", help="state method; repeat (default fp32, leapquant-int8)"
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--no-weights", action="store_true", help="skip the weights")
    p.add_argument("--json", required=True, metavar="OUT", help="where to write the JSON report")
    return p.parse_args(argv)


def reduced_shape(shape, layers: int | None):
    if layers is None:
        return shape
    if not 1 <= layers <= shape.layers:
        raise LeapQuantError(f"--layers must be in 1..{shape.layers}, got {layers}")
    full = min(layers - 1, round(layers * shape.full_layers / shape.layers)) if shape.full_layers else 0
    if shape.full_layers and layers > 1:
        full = max(full, 1)
    return shape.reduced(layers - full, full)


class Meter:
    """Bytes the tensors a block allocates ask for (CUDA: the allocator's requested bytes; CPU: storage
    bytes), and on CUDA the allocator's allocated bytes for them (``None`` on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device

    def _stats(self) -> tuple[int, int]:
        if torch.cuda.get_allocator_backend() != "native":  # cudaMallocAsync keeps no requested bytes
            raise LeapQuantError(
                f"the CUDA allocator backend is {torch.cuda.get_allocator_backend()!r}: the check reads the "
                "native caching allocator's requested bytes (unset PYTORCH_CUDA_ALLOC_CONF=backend:...)"
            )
        stats = torch.cuda.memory_stats(self.device)
        if "requested_bytes.all.current" not in stats:
            raise LeapQuantError(
                f"torch {torch.__version__}: its CUDA allocator does not count requested bytes"
            )
        return stats["requested_bytes.all.current"], stats["allocated_bytes.all.current"]

    def __call__(self, allocate) -> tuple[list[torch.Tensor], int, int | None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            requested, allocated = self._stats()
            tensors = allocate()
            torch.cuda.synchronize(self.device)
            requested_after, allocated_after = self._stats()
            return tensors, requested_after - requested, allocated_after - allocated
        tensors = allocate()
        return tensors, sum(t.untyped_storage().nbytes() for t in tensors), None


def allocate_specs(specs, device, random_init: bool = False) -> list[torch.Tensor]:
    """``count`` tensors per spec: zeros, or (weights) normal(0, 0.02) for 16/32-bit floats."""
    out = []
    for b in specs:
        dtype = getattr(torch, b.dtype)
        for _ in range(b.count):
            t = torch.zeros(b.shape, dtype=dtype, device=device)
            if random_init and dtype.is_floating_point and t.element_size() > 1:
                t.normal_(0.0, 0.02)
            out.append(t)
    return out


def allocate_state(shape, method, batch, specs, device) -> list[torch.Tensor]:
    """The live state through the library's own pools where one exists (one pool per linear layer)."""
    kind, _ = state_layout(shape, method, batch)
    if kind == "pool":
        cfg = PoolConfig(
            parse_method(method), heads=shape.heads_v, d_k=shape.d_k, d_v=shape.d_v, decay=shape.decay
        )
        pools = [LeapQuantPool.allocate(cfg, slots=batch, device=device) for _ in range(shape.linear_layers)]
        return [t for p in pools for t in p.tensors.values()]
    if kind == "per-step":
        args = (parse_method(method).codec, batch, shape.heads_v, shape.d_k, shape.d_v)
        pools = [PerStepPool.allocate(*args, device=device) for _ in range(shape.linear_layers)]
        return [t for p in pools for t in (p.state, p.scale) if t is not None]
    return allocate_specs(specs, device)


def check(args) -> dict:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    shape = reduced_shape(load_shape(args.model), args.layers)
    methods = list(dict.fromkeys(args.method or ("fp32", "leapquant-int8")))
    meter = Meter(device)
    kw = dict(batch=args.batch, context=args.context, prefix_interval=args.prefix_cache_interval)
    report = {
        "model": shape.name,
        "layers": {"linear": shape.linear_layers, "full": shape.full_layers},
        "batch": args.batch,
        "context": args.context,
        "prefix_cache_interval": args.prefix_cache_interval,
        "device": str(device),
        "measure": "CUDA allocator requested bytes" if device.type == "cuda" else "sum of storage nbytes",
        "methods": {},
    }
    weights = []
    if not args.no_weights:
        wspecs = [b for b in buffer_plan(shape, methods[0], **kw) if b.group == "weights"]
        weights, measured, allocated = meter(lambda: allocate_specs(wspecs, device, random_init=True))
        report["weights"] = _row(wspecs, measured, allocated)
    for method in methods:
        plan = buffer_plan(shape, method, **kw, weights=False)
        rows = {}
        for group in GROUPS[1:]:
            specs = [b for b in plan if b.group == group]
            if not specs:
                continue
            if group == "state":
                held, measured, allocated = meter(
                    lambda s=specs, m=method: allocate_state(shape, m, args.batch, s, device)
                )
            else:
                held, measured, allocated = meter(lambda s=specs: allocate_specs(s, device))
            rows[group] = _row(specs, measured, allocated)
            del held
        report["methods"][method] = rows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del weights
    return report


def _row(specs, measured: int, allocated: int | None) -> dict:
    row = {"planned": sum(b.nbytes for b in specs), "measured": measured}
    if allocated is not None:
        row["allocated"] = allocated
    return row


def verdict(report: dict) -> list[str]:
    """Groups whose measured (requested) bytes differ from the plan."""
    rows = [("weights", "weights", report["weights"])] if "weights" in report else []
    rows += [(m, g, r) for m, groups in report["methods"].items() for g, r in groups.items()]
    return [
        f"{method}/{group}: planned {r['planned']} B, measured {r['measured']} B"
        for method, group, r in rows
        if r["measured"] != r["planned"]
    ]


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"memory check: {report['model']}, B={report['batch']}, context {report['context']}, "
                  f"{report['device']} ({report['measure']})", title_justify="left")  # fmt: skip
    for col in ("method", "group", "planned B", "measured B", "measured / planned", "allocator blocks B"):
        table.add_column(col, justify="left" if col in ("method", "group") else "right")
    rows = [("-", "weights", report["weights"])] if "weights" in report else []
    rows += [(m, g, r) for m, groups in report["methods"].items() for g, r in groups.items()]
    for method, group, r in rows:
        ratio = r["measured"] / r["planned"] if r["planned"] else float("nan")
        blocks = f"{r['allocated']:,}" if "allocated" in r else "-"
        table.add_row(method, group, f"{r['planned']:,}", f"{r['measured']:,}", f"{ratio:.6f}", blocks)
    Console(width=200).print(table)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        report = check(args)
    except LeapQuantError as exc:
        print(f"memory_check: error: {exc}", file=sys.stderr)
        return 2
    report["mismatches"] = verdict(report)
    report["provenance"] = provenance(cuda=report["device"].startswith("cuda"))
    print_table(report)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    for line in report["mismatches"]:
        print(f"MISMATCH {line}")
    return 1 if report["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
