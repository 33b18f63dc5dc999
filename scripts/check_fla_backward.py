#!/usr/bin/env python
"""Are FLA's chunked GDN and KDA kernels right on this GPU, forward and backward? (GPU only.)

The training scripts keep FLA off the path because FLA 0.6.0's chunked GDN backward gives wrong gradients
on Hopper (its issue 640), which leaves KDA training on transformers' torch path at ~1/7 of GDN's tokens
per second (``scripts/gpu-train-recall.sh``: 1.6M tokens in 6.5 minutes, too few to learn the recall task).
This script measures whether each kernel may be trusted: ``chunk_gated_delta_rule`` and ``chunk_kda``
(q/k L2-normalised in the kernel) against a float64 token loop with FLA's semantics (decay before the delta
read), outputs and the gradients of every input, on random inputs of a few chunk lengths, at the given head
dims, with q/k/v/beta in fp32 and in bf16 (as autocast hands them over in training), and both with an
initial and a final state and without (as training calls it). It prints one line per case and writes a
JSON with ``--json``; exit status 1 if any relative error exceeds its dtype's tolerance (NaN included) or
FLA refuses a case. The tolerances sit at a few times the honest rounding (bf16 outputs alone give ~2e-3)
and well below the errors of the miscompilations FLA's issues report (dk off by ~50% in its issue 984).

Measured on an H100 with Triton 3.6.0 and FLA 0.6.0 (2026-12-05): FLA itself refuses the GDN backward
(``chunk_bwd_dqkwg`` raises "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results ...
upgrade Triton to >= 3.7.1 or install tilelang"). That run stopped at the refusal, before the KDA cases;
refusals are now recorded and the other cases go on, and ``--unguard-hopper`` lifts the refusal to
measure the kernel. Family ``gdn-kda`` is the way around it: GDN computed by KDA's kernel with the scalar
decay on every key channel (:func:`gdn_through_kda`), checked against the GDN loop.

    python scripts/check_fla_backward.py --json out/fla-backward.json      # on the GPU, FLA installed
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F


def reference(q, k, v, g, beta, h0, scale: float):
    """float64 token loop: ``S' = Diag(exp g) S; u = beta (v - S'^T k); S = S' + k u^T; o = S^T (scale q)``.

    Shapes (FLA's): ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H]`` (GDN) or ``[B, T, H, K]``
    (KDA), ``beta [B, T, H]``, ``h0 [B, H, K, V]``; returns ``o [B, T, H, V]`` and the final state.
    """
    q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    s = h0
    outs = []
    for t in range(q.shape[1]):
        a = g[:, t].exp()
        s = s * (a[..., None, None] if a.ndim == 2 else a[..., None])
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t]))
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, scale * q[:, t]))
    return torch.stack(outs, 1), s


def inputs(family: str, b: int, t: int, h: int, d: int, seed: int, device):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(b, t, h, d), rnd(b, t, h, d), rnd(b, t, h, d)
    shape = (b, t, h, d) if family == "kda" else (b, t, h)
    # log decays spread over short and long memories, as in a trained model's gates
    g = -torch.exp(rnd(*shape) * 1.5 - 3.0)
    beta = torch.sigmoid(rnd(b, t, h))
    h0 = rnd(b, h, d, d) * 0.1
    return [x.to(device) for x in (q, k, v, g, beta, h0)]


# largest relative error accepted per dtype of q/k/v/beta (the kernels' dots run tf32 / bf16)
TOLERANCES = {"float32": 5e-3, "bfloat16": 1e-2}


def gdn_through_kda(
    query, key, value, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **layer_kwargs,
):  # fmt: skip
    """Gated DeltaNet's chunked step computed by FLA's KDA kernel, with GDN's signature.

    GDN is KDA whose per-key-channel log decay is the head's scalar ``g [B, T, H]`` on every channel, so
    ``chunk_kda(g=g[..., None].expand(B, T, H, K))`` gives the same outputs and final state, and autograd
    sums KDA's per-channel ``dg`` back onto ``g``. It exists because FLA 0.6.0 refuses its own gated GDN
    backward on Hopper with Triton < 3.7.1 (its issue 640, a miscompiled transpose in ``chunk_bwd_dqkwg``,
    which KDA's backward does not call). ``layer_kwargs``: what transformers' layer forwards beyond the
    kernel's arguments, dropped as transformers' own kernel wrapper drops them. Returns ``(o, final_state)``.
    """
    from fla.ops.kda import chunk_kda

    g_k = g[..., None].expand(*g.shape, key.shape[-1]).contiguous()
    return chunk_kda(query, key, value, g=g_k, beta=beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     cu_seqlens=cu_seqlens)  # fmt: skip


# the kernels checked: "gdn-kda" is GDN (scalar decays, GDN's reference) run by KDA's kernel
FAMILIES = ("gdn", "gdn-kda", "kda")


def run_fla(family: str, q, k, v, g, beta, h0, scale: float):
    """FLA's chunked kernel; ``h0=None``: no initial state and no final state (training's call)."""
    if family == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    elif family == "gdn-kda":
        fn = gdn_through_kda
    else:
        from fla.ops.kda import chunk_kda as fn
    return fn(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=h0 is not None,
              use_qk_l2norm_in_kernel=True)  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(family: str, t: int, seed: int, device, dtype: torch.dtype = torch.float32, d: int = 128,
          state: bool = True) -> dict:  # fmt: skip
    """One case: head dim ``d``; ``q, k, v, beta`` in ``dtype`` (the float64 reference starts from the same
    rounded values, so only the kernel's own error counts), ``g`` in fp32; with ``state`` an fp32 initial
    state and the final state's gradient path, else neither."""
    b, h = 2, 4
    scale = d**-0.5
    base = inputs(family, b, t, h, d, seed, device)
    rounded = (0, 1, 2, 4)  # q, k, v, beta
    base = [x.to(dtype).double() if i in rounded else x for i, x in enumerate(base)]
    if not state:
        base[5] = torch.zeros_like(base[5])
    ref_in = [x.clone().requires_grad_() for x in base]
    fla_in = [
        (x.to(dtype) if i in rounded else x.float()).clone().requires_grad_() for i, x in enumerate(base)
    ]
    o_ref, s_ref = reference(*ref_in, scale)
    o_fla, s_fla = run_fla(family, *fla_in[:5], fla_in[5] if state else None, scale)
    # one random projection of the outputs, so every gradient path is exercised
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    w_o = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64).to(device)
    w_s = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64).to(device)
    loss_ref = (o_ref * w_o).sum() + ((s_ref * w_s).sum() if state else 0.0)
    loss_fla = (o_fla.double() * w_o).sum() + ((s_fla.double() * w_s).sum() if state else 0.0)
    loss_ref.backward()
    loss_fla.backward()
    names = ("q", "k", "v", "g", "beta") + (("h0",) if state else ())
    errors = {"o": rel(o_fla, o_ref)} | ({"final_state": rel(s_fla, s_ref)} if state else {})
    n_in = len(names)  # without states, h0 is a constant zero: no gradient to compare
    grads = zip(names, fla_in[:n_in], ref_in[:n_in], strict=True)
    errors |= {f"d{n}": rel(x.grad, r.grad) for n, x, r in grads}
    return {
        "family": family,
        "tokens": t,
        "head_dim": d,
        "state": state,
        "seed": seed,
        "dtype": str(dtype).removeprefix("torch."),
        "rel_err": errors,
    }


def unguard_hopper() -> bool:
    """Lift FLA 0.6.0's refusal of the gated ``chunk_bwd_dqkwg`` on Hopper with Triton in [3.4, 3.7.1).

    Its issue 640 traces the bug to a Triton miscompilation (FLA's fix, its pull request 826, works around a
    transpose of a chunk-sized tile), so no head dim is safe by construction: lifting the refusal is sound
    only where :func:`preflight` has then measured the gradients right on the same machine and shapes.
    Returns whether the guard applied here.
    """
    import fla.ops.common.chunk_o as chunk_o

    guarded = bool(chunk_o.IS_NVIDIA_HOPPER)
    chunk_o.IS_NVIDIA_HOPPER = False  # read by the guard alone once the module is imported
    return guarded


def preflight(
    families,
    tokens=(64, 200, 512),
    *,
    head_dims=(128,),
    dtypes=("float32", "bfloat16"),
    tolerances: dict | None = None,
    unguard: bool = False,
) -> dict:
    """Check FLA's chunked kernels of ``families`` (of :data:`FAMILIES`) on this GPU before training on them:
    every family, dtype, head dim, chunk length, with and without states.  Returns ``{"ok", "unguarded",
    "rows", "refused", "failed", "tolerances"}``; ``ok`` only if no case was refused and every error is
    within its dtype's tolerance (a NaN fails)."""
    tol = {**TOLERANCES, **(tolerances or {})}
    device = torch.device("cuda")
    unguarded = unguard_hopper() if unguard else False
    rows, refused = [], []
    for f in families:
        for dt in dtypes:
            for d in head_dims:
                for state in (True, False):
                    for i, t in enumerate(tokens):
                        case = {"family": f, "tokens": t, "dtype": dt, "head_dim": d, "state": state}
                        try:
                            rows.append(check(f, t, i, device, getattr(torch, dt), d, state))
                        except RuntimeError as e:
                            refused.append(case | {"error": str(e).splitlines()[0]})
    failed = [
        r | {"bad": [k for k, e in r["rel_err"].items() if not e <= tol[r["dtype"]]]}
        for r in rows
        if not all(e <= tol[r["dtype"]] for e in r["rel_err"].values())
    ]
    ok = bool(rows) and not refused and not failed
    return {"ok": ok, "unguarded": unguarded, "rows": rows, "refused": refused, "failed": failed,
            "tolerances": tol}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 200, 512])
    p.add_argument(
        "--head-dims", type=int, nargs="+", default=[128], help="key = value head dims (default 128)"
    )
    p.add_argument(
        "--dtypes", nargs="+", choices=tuple(TOLERANCES), default=list(TOLERANCES),
        help="dtypes of q, k, v, beta (training hands FLA bf16 under autocast)",
    )  # fmt: skip
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--unguard-hopper", action="store_true",
        help="lift FLA's refusal of the gated GDN backward on Hopper (see unguard_hopper) to measure it",
    )  # fmt: skip
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: FLA's kernels need a GPU")
    import fla

    result = preflight(args.families, args.tokens, head_dims=args.head_dims, dtypes=args.dtypes,
                       unguard=args.unguard_hopper)  # fmt: skip
    for r in result["refused"]:  # FLA refuses a kernel it knows to be wrong here (its issue 640)
        print(f"{r['family']} {r['dtype']} d={r['head_dim']} state={r['state']} T={r['tokens']:4d}: "
              f"REFUSED by FLA: {r['error']}")  # fmt: skip
    tol = result["tolerances"]
    for r in result["rows"]:
        errs = r["rel_err"]
        bad = [k for k, e in errs.items() if not e <= tol[r["dtype"]]]
        cells = " ".join(f"{k} {e:.1e}" for k, e in errs.items())
        verdict = "FAIL " + ",".join(bad) if bad else "ok"
        print(f"{r['family']} {r['dtype']} d={r['head_dim']} state={r['state']} T={r['tokens']:4d}: {cells}  "
              f"{verdict}")  # fmt: skip
    out = result | {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "fla": getattr(fla, "__version__", None),
        "triton": __import__("triton").__version__,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
