"""State error of methods over a long continuation of a recorded trace (float64, CPU).

A model trace's records (``leapquant trace``) are the layer inputs; replaying them cycled to ``--tokens``
gives a long continuation with the model's own decays, keys and values, without running the model for 64K
tokens.  The exact trajectory and every method's :class:`~leapquant.methods.WindowedState` step through the
same records, and ``||S - S_exact|| / ||S_exact||`` per stream is printed every ``--every`` tokens.

    python scripts/long_state_error.py TRACE.npz --streams 22 -m int4/w16+ct8+smooth -m leapquant-int4 \
        -m leapquant-int8
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import torch

from leapquant.eval.provenance import provenance
from leapquant.methods import WindowedState, parse_method
from leapquant.traces import load_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--streams", required=True, help="comma-separated stream indices")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--every", type=int, default=4096)
    p.add_argument("-m", "--method", action="append", required=True)
    p.add_argument("--json", help="write the curves here")
    args = p.parse_args()
    rec = load_trace(args.trace).records
    streams = [int(s) for s in args.streams.split(",")]
    a, k, b, v, q = (getattr(rec, n)[streams].double() for n in ("a", "k", "b", "v", "q"))
    n, d_k, d_v = a.shape[1], k.shape[-1], v.shape[-1]
    states = {m: WindowedState(parse_method(m), len(streams), d_k, d_v) for m in args.method}
    exact = torch.zeros(len(streams), d_k, d_v, dtype=torch.float64)
    curves: dict[str, list] = {m: [] for m in args.method}
    start = time.time()
    for t in range(args.tokens):
        i = t % n  # the trace cycled
        u = v[:, i] - torch.einsum("skv,sk->sv", exact, b[:, i])
        exact = a[:, i, :, None] * exact + k[:, i, :, None] * u[:, None, :]
        for st in states.values():
            st.step(a[:, i], k[:, i], b[:, i], v[:, i], q[:, i])
        if (t + 1) % args.every == 0:
            ref = exact.flatten(1).norm(dim=1)
            for m, st in states.items():
                err = (st.materialize() - exact).flatten(1).norm(dim=1) / ref
                curves[m].append([t + 1, [round(float(x), 4) for x in err]])
            print(t + 1, f"{time.time() - start:.0f}s", {m: c[-1][1] for m, c in curves.items()}, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            command = shlex.join(["python", "scripts/long_state_error.py", *sys.argv[1:]])
            report = {"trace": args.trace, "streams": streams, "tokens": args.tokens, "curves": curves}
            json.dump({**report, "provenance": {**provenance(), "command": command}}, f)


if __name__ == "__main__":
    main()
