"""The factored-start trial's timing (2026-12-03T16:51Z, H200; rows: close-factored-start-in-step-trial.json).

On the GPU machine, from the repository root (the JSON of 16:51Z was written before ``--breakdown`` told a
step's launches apart by order; it groups them by stream):

    git apply --include='leapquant/ops/*' results/close-factored-start-in-step-trial.patch
    python3 results/close-factored-start-in-step-trial-driver.py

Times ``leapquant-int8`` (N=512, GDN and KDA) with the fit's first product from a pass over rebuilt rows, and
from the state's factors (the codes' part from the closing heads' step, with 4 and 1 warps per program), each
with a profiled graph replay (``bench kernel --breakdown``).
"""

import json
import os
from dataclasses import replace

from leapquant.bench.kernel import KernelCase, bench_variant
from leapquant.ops.leapquant_decode import LaunchConfig

out = []
for fam in ("gdn", "kda"):
    case = KernelCase(family=fam, n=512, heads=32, key_heads=16 if fam == "gdn" else 32)
    base = LaunchConfig.tuned("scalar" if fam == "gdn" else "vector", 4)
    configs = (
        ("rebuilt", replace(base, factored_start=False)),
        ("factored-w4", base),
        ("factored-w1", replace(base, start_warps=1)),
    )
    for name, lc in configs:
        row = bench_variant("leapquant-int8", case, launch=lc, breakdown=True)
        row["config"] = name
        out.append(row)
        bd = row["breakdown"]
        print(fam, name, f"{row['ms'] * 1e3:.1f} us graph-timed; profiled {bd['span_us']:.1f} us")
        for k in bd["kernels"][:4]:
            span = f"[{k['start_us']:.1f}, {k['end_us']:.1f}]"
            print(f"   {k['kernel'][:20]} #{k['launch']} {k['us']:.1f} us {span}")
with open(os.path.join(os.environ.get("OUT", "."), "trial.json"), "w") as f:
    json.dump(out, f, indent=1)
