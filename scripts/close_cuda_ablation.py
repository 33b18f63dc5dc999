"""Time the CUDA window close with parts left out (``LQ_ABLATE`` in ``close.cu``): where its time goes.

The states these closes leave are wrong: this is timing only.  Each row is ``bench kernel``'s
``leapquant-int8`` (or ``--variant``) with the close run after the step (no side stream), profiled so the
close's own duration is reported beside the step's.

    python scripts/close_cuda_ablation.py [--family gdn,kda] [--n 512] [--variant M] [--masks 0,1,2,4,8]
        [--source close.cu] [--no-prefetch] [--json F]

``--source`` times another copy of ``close.cu`` (an A/B of a kernel change on one machine: run it once with
the copy of the old kernel and once without); ``--no-prefetch`` builds it without staging the next head
(``LQ_PREFETCH=0``). A ``--source`` that predates ``LQ_PREFETCH`` is built and launched without it, so that
it does not run with the staging area's shared memory reserved and unused.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from leapquant.bench.kernel import KernelCase, bench_variant
from leapquant.bench.timing import copy_bandwidth
from leapquant.bench.variants import parse_variant
from leapquant.errors import LeapQuantError
from leapquant.eval.provenance import provenance
from leapquant.ops.leapquant_decode import LaunchConfig, close_cuda

PARTS = {1: "rank-one updates of the rebuild", 2: "fit", 4: "quantization arithmetic", 8: "Gram-Schmidt"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="gdn,kda")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--variant", default="leapquant-int8")
    ap.add_argument("--masks", default="0,1,2,4,8")
    ap.add_argument("--source", default=None, help="a close.cu to build instead of the shipped one")
    ap.add_argument("--no-prefetch", action="store_true", help="build with LQ_PREFETCH=0")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.source is not None:
        source = Path(args.source)
        if not source.is_file():
            ap.error(f"--source {source}: no such file")
        close_cuda.SOURCE = source
        args.no_prefetch |= "LQ_PREFETCH" not in source.read_text()
    if args.no_prefetch:
        close_cuda.prefetches = lambda cfg, shared_per_sm: False
    options = close_cuda.compile_options
    rows = []
    try:
        variant = parse_variant(args.variant)
    except LeapQuantError as exc:
        ap.error(str(exc))
    method = variant.method
    print(f"copy bandwidth {copy_bandwidth():.0f} GB/s")
    for family in args.family.split(","):
        case = KernelCase(family=family, n=args.n, key_heads=16 if family == "gdn" else 32)
        decay = "scalar" if family == "gdn" else "vector"
        launch = replace(LaunchConfig.tuned(decay, method.compensators, method.codec), close_impl="cuda",
                         overlap_close=False)  # fmt: skip
        for mask in (int(m) for m in args.masks.split(",")):
            close_cuda.compile_options = lambda cfg, *, prefetch=False, mask=mask: [
                *options(cfg, prefetch=prefetch),
                f"-DLQ_ABLATE={mask}",
            ]
            close_cuda._kernel.cache_clear()
            row = bench_variant(variant, case, launch=launch, breakdown=True)
            row["ablate"] = mask
            row["left_out"] = [name for bit, name in PARTS.items() if mask & bit]
            close = [
                k for k in row["breakdown"].get("kernels", []) if k["kernel"].startswith("leapquant_close")
            ]
            close_us = close[0]["us"] if close else float("nan")
            left = ", ".join(row["left_out"]) or "full"
            print(f"{family} mask {mask} ({left}): step {row['ms'] * 1e3:.1f} us, close {close_us:.1f} us")
            rows.append(row)
    close_cuda.compile_options = options
    if args.json:
        source = str(close_cuda.SOURCE) if args.source is not None else "shipped close.cu"
        with open(args.json, "w") as f:
            prefetch = "off" if args.no_prefetch else "where close_cuda.prefetches says"
            meta = {"source": source, "prefetch": prefetch}
            json.dump({"provenance": provenance(cuda=True), **meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
