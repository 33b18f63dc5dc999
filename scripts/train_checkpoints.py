#!/usr/bin/env python
"""Train the two small byte-level hybrid checkpoints of project issue 4 and save them in transformers format.

Per architecture (``--arch qwen35|kimi|both``) it

* builds a ~7M-parameter hybrid, 3 linear-attention : 1 full-attention layers, with real-size linear heads
  (key and value head dim 128): ``Qwen3_5ForCausalLM`` (Gated DeltaNet, 2 key / 4 value heads) or
  ``KimiLinearForCausalLM`` (KDA, 4 heads; MLA full attention; dense MLPs, no MoE), its shape from
  ``leapquant.plan.presets.byte_hybrid_config``, the one source ``leapquant memory`` also reads;
* initialises the decay gates so that half of the linear heads start with long memory (``init_gates``); with
  transformers' default initialisation almost every GDN head starts, and stays, at decay ~0;
* trains on the Python source in the interpreter's site-packages (never the standard library, which the
  evaluation harness reads), one byte per token, for ``--minutes`` of wall clock: AdamW, bf16 autocast,
  warmup + cosine decay, gradient clipping;
* saves ``OUT/<name>/`` (bf16 ``model.safetensors``, config, generation config, byte tokenizer), reloads
  it with ``from_pretrained`` and measures the shipped weights: held-out bits per byte (site-packages hold-out
  and a standard-library sample) and the decay distribution of every linear head, written to the model card
  ``README.md`` and to ``decay_stats.json``.

FLA stays off the path by default: FLA 0.6.0 refuses its gated GDN backward on Hopper with Triton < 3.7.1 (its
issue 640), and transformers picks FLA by itself whenever it is importable. ``fla`` and ``causal_conv1d`` are
blocked in ``sys.modules`` before transformers is imported; ``check_torch_paths`` then verifies that every
GDN/KDA/conv function resolved to transformers' torch reference, and exits otherwise. With
``LEAPQUANT_TRAIN_KERNELS=fla`` FLA's chunked kernels train instead (KDA's torch path trains ~7x fewer
tokens a second than GDN's), and with ``fla-kda`` GDN runs through FLA's KDA kernel (the scalar decay on
every key channel: the same recurrence, without the refused GDN backward), but only after
``check_kernel_paths`` has measured their outputs and gradients against a float64 loop on this GPU.

    H200:       python scripts/train_checkpoints.py --arch both --minutes 4 --out $OUT/ckpt
    CPU smoke:  python scripts/train_checkpoints.py --device cpu --tiny --out /tmp/ckpt
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import json
import math
import os
import platform
import site
import sys
import sysconfig
import time
import zlib
from pathlib import Path

START = time.time()
# LEAPQUANT_TRAIN_KERNELS: "torch" (default) keeps FLA off the path; "fla" lets transformers take FLA's
# chunked kernels, and "fla-kda" also runs GDN through FLA's KDA kernel (its GDN backward is refused on
# Hopper with Triton < 3.7.1); check_kernel_paths first measures them against a float64 loop on this GPU
# (refusing to train if they are wrong). causal_conv1d stays off either way.
TRAIN_KERNELS = os.environ.get("LEAPQUANT_TRAIN_KERNELS", "torch")
KERNEL_SETTINGS = ("torch", "fla", "fla-kda")
if TRAIN_KERNELS not in KERNEL_SETTINGS:
    raise SystemExit(
        f"error: LEAPQUANT_TRAIN_KERNELS must be one of {', '.join(KERNEL_SETTINGS)}, got {TRAIN_KERNELS!r}"
    )
BLOCKED = ("fla", "causal_conv1d") if TRAIN_KERNELS == "torch" else ("causal_conv1d",)


def block_kernel_packages() -> dict[str, str | None]:
    """Make ``import fla`` and ``import causal_conv1d`` fail: transformers then takes its torch path."""
    found = {}
    for name in BLOCKED:
        if sys.modules.get(name) is not None:
            raise SystemExit(f"error: {name} was imported before it could be blocked; run a fresh process")
        spec = importlib.util.find_spec(name) if name not in sys.modules else None
        found[name] = spec.origin if spec else None
        sys.modules[name] = None
    return found


FOUND_KERNELS = block_kernel_packages()
os.environ.setdefault("USE_HUB_KERNELS", "0")  # and no kernels-hub replacement

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    KimiLinearConfig,
    KimiLinearForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

from leapquant.plan.presets import BYTE_VOCAB, byte_hybrid_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the model card beside this script
from check_fla_backward import gdn_through_kda  # noqa: E402
from checkpoint_card import model_card  # noqa: E402

if TRAIN_KERNELS == "fla-kda":  # the layer calls this module global by name at every forward
    modeling_qwen3_5.torch_chunk_gated_delta_rule = gdn_through_kda

OFFSET, PAD, EOS = 3, 0, 1  # ids: 0 <pad>, 1 </s> (our file separator), 2 <unk>, byte b -> b + 3 (as ByT5)
VOCAB = BYTE_VOCAB
assert VOCAB == 256 + OFFSET
NAMES = {"qwen35": "qwen35-gdn-hybrid-byte", "kimi": "kimi-kda-hybrid-byte"}
FAMILIES = {"qwen35": "gdn", "kimi": "kda"}  # check_fla_backward's names
# vendored copies and backports of stdlib modules: never trained on (the eval reads the stdlib)
VENDORED = {"_distutils", "distutils", "importlib_metadata", "importlib_resources", "backports", "zipp"}
VENDORED |= {"tomli", "mock"}
LONG_BAND, SHORT_BAND = (1e-3, 1e-2), (1e-2, 1.0)  # -log(decay): decays 0.999..0.990 and 0.990..0.368
TORCH_PATHS = [("qwen3_5", "torch_chunk_gated_delta_rule"), ("qwen3_5", "torch_recurrent_gated_delta_rule")]
TORCH_PATHS += [("kimi_linear", f"{k}_kimi_delta_attention") for k in ("chunk", "recurrent")]
TORCH_PATHS += [(m, f"causal_conv1d_{f}") for m in ("qwen3_5", "kimi_linear") for f in ("fn", "update")]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte b -> id b + 3 (tokenizers' ByteLevel alphabet, no merges); special-token text is not matched."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's bytes-to-unicode table
    cs = bs + [256 + n for n in range(256 - len(bs))]
    bs += [b for b in range(256) if b not in bs]
    vocab = {"<pad>": PAD, "</s>": EOS, "<unk>": 2} | {chr(c): b + OFFSET for b, c in zip(bs, cs)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    return PreTrainedTokenizerFast(tokenizer_object=tok, split_special_tokens=True, **specials)


def resolved_paths() -> list[tuple[str, object, bool]]:
    """``(name, implementation, on_torch)`` of every GDN/KDA/conv function the models call: what
    transformers resolved it to, and whether that is its own torch reference."""
    out = []
    for model_name, fn_name in TORCH_PATHS:
        mod = importlib.import_module(f"transformers.models.{model_name}.modeling_{model_name}")
        fn = getattr(mod, fn_name)
        if fn is gdn_through_kda:
            out.append((f"modeling_{model_name}.{fn_name}", fn, False))
            continue
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
        on_torch = impl is not None and impl is getattr(fn, "__wrapped__", None)
        out.append((f"modeling_{model_name}.{fn_name}", impl, on_torch))
    return out


def check_torch_paths() -> list[str]:
    """Exit unless every linear-attention kernel of both models resolved to transformers' torch reference."""
    paths = resolved_paths()
    for name, impl, on_torch in paths:
        if not on_torch:
            raise SystemExit(
                f"error: {name} resolved to {impl!r}, not transformers' torch path (FLA's chunked backward "
                "is wrong on Hopper): refusing to train"
            )
    return [name for name, _, _ in paths]


def linear_head_dim(arch: str, tiny: bool) -> int:
    """The key (= value) head dim of the linear-attention layers of ``arch`` at this size."""
    fields = byte_hybrid_config(arch, tiny)
    return fields.get("linear_key_head_dim") or fields["linear_head_dim"]


def check_kernel_paths(device: torch.device, families=("gdn", "kda"), head_dims=(128,)) -> list[str]:
    """The linear-attention kernels training will run, checked: transformers' torch path (default), or with
    ``LEAPQUANT_TRAIN_KERNELS=fla`` (or ``fla-kda``: GDN through KDA's kernel) FLA's chunked kernels, whose
    outputs and gradients must first match a float64 loop on this GPU for ``families`` at ``head_dims``
    (``scripts/check_fla_backward.py``: fp32 and bf16 inputs, with and without states; FLA 0.6.0's refusal of
    the gated GDN backward on Hopper is lifted for that measurement). Exits with the reason otherwise."""
    if TRAIN_KERNELS == "torch":
        return check_torch_paths()
    if device.type != "cuda":
        raise SystemExit(
            f"error: LEAPQUANT_TRAIN_KERNELS={TRAIN_KERNELS} needs a CUDA GPU (FLA's kernels run only there)"
        )
    if TRAIN_KERNELS == "fla-kda":
        families = tuple(dict.fromkeys("gdn-kda" if f == "gdn" else f for f in families))
    names = []
    for name, impl, on_torch in resolved_paths():
        if on_torch != name.split(".")[1].startswith("causal_conv1d"):
            raise SystemExit(
                f"error: {name} resolved to {impl!r}: with LEAPQUANT_TRAIN_KERNELS={TRAIN_KERNELS} the "
                "linear attention must run FLA's kernels and the convolution transformers' torch path"
            )
        path = "torch" if on_torch else "fla chunk_kda" if impl is gdn_through_kda else "fla"
        names.append(f"{name} ({path})")
    from check_fla_backward import preflight

    result = preflight(families, head_dims=tuple(head_dims), unguard=True)
    if not result["ok"]:
        bad = [
            {k: r[k] for k in ("family", "dtype", "head_dim", "state", "tokens", "bad")}
            for r in result["failed"]
        ]
        raise SystemExit(
            f"error: FLA's chunked kernels failed their check on this GPU (tolerances "
            f"{result['tolerances']}; failed: {bad}; refused: {result['refused']}): refusing to train on "
            "them; unset LEAPQUANT_TRAIN_KERNELS for the torch path"
        )
    worst = max(e for r in result["rows"] for e in r["rel_err"].values())
    names.append(
        f"FLA checked against float64 ({len(result['rows'])} cases: {', '.join(families)}, head dims "
        f"{list(head_dims)}): worst relative error {worst:.1e} (Hopper guard lifted: {result['unguarded']})"
    )
    return names


# ----------------------------------------------------------------------------------------------------- data
def site_dirs() -> list[str]:
    paths, out = sysconfig.get_paths(), []
    for d in [*site.getsitepackages(), paths["purelib"], paths["platlib"]]:
        rp = os.path.realpath(d)
        if os.path.isdir(rp) and rp not in out:
            out.append(rp)
    return out


def stdlib_files() -> list[str]:
    std, sites, files = os.path.realpath(sysconfig.get_paths()["stdlib"]), site_dirs(), []
    for root, dirs, names in os.walk(std):
        skip = ("site-packages", "dist-packages", "__pycache__")
        dirs[:] = sorted(d for d in dirs if d not in skip and os.path.join(root, d) not in sites)
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    return files


def to_tokens(blobs: list[bytes]) -> torch.Tensor:
    """Bytes -> ByT5 ids (b + 3) as int16, each file followed by the separator EOS."""
    parts = []
    for b in blobs:
        parts += [np.frombuffer(b, np.uint8).astype(np.int16) + OFFSET, np.array([EOS], np.int16)]
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(1, np.int16))


def crc(prefix: str, rel: str) -> int:
    return zlib.crc32(f"{prefix}:{rel}".encode())


def load_corpus(max_bytes: int, eval_bytes: int, val_permille: int = 10) -> dict:
    """Site-packages ``*.py`` split by file into train / held-out (both capped), plus a stdlib sample.

    Deterministic: files are taken in crc32 order of their path relative to their site-packages directory (a
    byte cap then spreads over all packages); a file is held out when crc32('val:' + path) % 1000 < permille.
    """
    t0, std_dir, std = time.time(), os.path.realpath(sysconfig.get_paths()["stdlib"]), stdlib_files()
    std_hashes = {hashlib.sha1(Path(f).read_bytes()).digest() for f in std}
    cands, seen, skipped = [], set(), {"over_1MB": 0, "vendored_stdlib_dirs": 0, "stdlib_duplicates": 0}
    for sp in site_dirs():
        for root, dirs, names in os.walk(sp):
            skipped["vendored_stdlib_dirs"] += sum(d in VENDORED for d in dirs)
            dirs[:] = sorted(d for d in dirs if d not in VENDORED and d != "__pycache__")
            for path in (os.path.join(root, n) for n in sorted(names) if n.endswith(".py")):
                size, real = os.path.getsize(path), os.path.realpath(path)
                if real in seen or size == 0 or size > 1 << 20:  # nested site dirs, empty or huge files
                    skipped["over_1MB"] += size > 0
                    continue
                seen.add(real)
                rel = os.path.relpath(path, sp)
                cands.append((crc("order", rel), rel, path, crc("val", rel) % 1000 < val_permille))
    cands.sort()
    split = {False: ([], [], [max_bytes]), True: ([], [], [eval_bytes])}
    for _, rel, path, val in cands:
        blobs, rels, left = split[val]
        if left[0] <= 0:
            continue
        data = Path(path).read_bytes()
        if hashlib.sha1(data).digest() in std_hashes:
            skipped["stdlib_duplicates"] += 1
            continue
        blobs.append(data)
        rels.append(rel)
        left[0] -= len(data)
    (train, train_rels, _), (val, _, _) = split[False], split[True]
    pkgs: dict[str, int] = {}
    for rel, b in zip(train_rels, train):
        pkgs[rel.split(os.sep)[0]] = pkgs.get(rel.split(os.sep)[0], 0) + len(b)
    sample, total = [], 0
    for f in sorted(std, key=lambda f: crc("stdlib", os.path.relpath(f, std_dir))):
        if total >= eval_bytes:
            break
        sample.append((f, Path(f).read_bytes()))
        total += len(sample[-1][1])
    top = sorted(pkgs.items(), key=lambda kv: -kv[1])[:12]
    info = {
        "site_dirs": site_dirs(),
        "stdlib_dir": std_dir,
        "candidates": len(cands),
        "skipped": skipped,
        "train_files": len(train),
        "train_bytes": sum(map(len, train)),
        "val_files": len(val),
        "val_bytes": sum(map(len, val)),
        "val_rule": f"crc32('val:' + path) % 1000 < {val_permille}",
        "top_packages_MB": {k: round(v / 1e6, 2) for k, v in top},
        "stdlib_sample_files": len(sample),
        "stdlib_sample_rule": "stdlib .py files (no site-packages) in crc32('stdlib:' + path) order "
        "up to the byte cap, concatenated in path order",
        "load_seconds": round(time.time() - t0, 1),
    }
    stdlib = to_tokens([b for _, b in sorted(sample)])
    return {"train": to_tokens(train), "val": to_tokens(val), "stdlib": stdlib, "info": info}


# --------------------------------------------------------------------------------------------------- models
def build_config(arch: str, tiny: bool):
    """The transformers config: the shape from ``leapquant.plan`` (the same fields ``leapquant memory`` reads
    back from the saved config.json), plus the token ids and the saved dtype."""
    fields = byte_hybrid_config(arch, tiny)
    del fields["model_type"]
    extra = dict(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, max_position_embeddings=8192)
    extra["dtype"] = "bfloat16"  # the saved dtype; training keeps fp32 master weights
    return (Qwen3_5TextConfig if arch == "qwen35" else KimiLinearConfig)(**fields, **extra)


def build_model(arch: str, tiny: bool):
    return (Qwen3_5ForCausalLM if arch == "qwen35" else KimiLinearForCausalLM)(build_config(arch, tiny))


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied tensors count once


def linear_layers(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, GDN module or KDA forget gate) for every linear-attention layer."""
    types = model.config.layer_types
    layers = [(i, ly) for i, ly in enumerate(model.model.layers) if types[i] == "linear_attention"]
    return [
        (i, ly.linear_attn if hasattr(ly, "linear_attn") else ly.self_attn.forget_gate) for i, ly in layers
    ]


def band(u: float) -> float:
    """u in [0, 1) -> -log(decay): [0, .5) log-spaced over LONG_BAND, [.5, 1) over SHORT_BAND."""
    (lo, hi), t = (LONG_BAND, 2 * u) if u < 0.5 else (SHORT_BAND, 2 * u - 1)
    return math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo)))


@torch.no_grad()
def init_gates(model) -> dict[str, list[float]]:
    """Start half of the linear heads with long memory; returns the initial decay per layer and head.

    Both families compute ``g = -exp(A_log) * softplus(x + dt_bias)``, ``x`` a small input projection (~0 at
    init). We set ``A_log = 0`` and ``dt_bias = softplus^-1(target)``: at ``x = 0`` the decay ``exp(g)`` is
    the target, and for small targets ``log(-g)`` moves additively with ``x`` (Mamba2/FLA parameterisation).
    Nothing is frozen. A head of rank r < H/2 in its layer gets -log(decay) log-spaced in LONG_BAND (decay
    0.999..0.990), the others in SHORT_BAND (0.990..0.37); ranks alternate over the heads so that grouped GDN
    value heads sharing a key head get one long and one short target. GDN: one target per value head, offset
    by layer; KDA: the head's band is spread over its key channels, and ranks rotate by layer.
    """
    out, lin = {}, linear_layers(model)
    for j, (i, mod) in enumerate(lin):
        gdn = hasattr(mod, "num_v_heads")
        H = mod.num_v_heads if gdn else mod.num_heads
        rank = [(h % 2) * ((H + 1) // 2) + h // 2 for h in range(H)]
        if gdn:
            tgt = torch.tensor([band((rank[h] + (j + 0.5) / len(lin)) / H) for h in range(H)])
        else:
            K = mod.head_dim
            tgt = torch.tensor(
                [[band(((rank[h] + j) % H + (c + 0.5) / K) / H) for c in range(K)] for h in range(H)]
            )
        mod.A_log.zero_()
        mod.dt_bias.copy_((tgt + torch.log(-torch.expm1(-tgt))).flatten())  # inverse softplus
        out[str(i)] = [round(v, 5) for v in torch.exp(-tgt).view(H, -1).mean(-1).tolist()]
    return out


# ------------------------------------------------------------------------------------------- train and eval
def windows(tokens: torch.Tensor, seq: int, n: int) -> torch.Tensor:
    """The first n non-overlapping windows of seq + 1 tokens (inputs and shifted targets)."""
    n = min(n, (len(tokens) - 1) // seq)
    return tokens[torch.arange(n)[:, None] * seq + torch.arange(seq + 1)[None]].long()


def autocast(device):
    return torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def bits_per_byte(model, tokens, seq: int, batch: int, device, max_windows: int) -> tuple[float, int]:
    """Held-out bits per byte and bytes scored: each byte after a window's first once, separators excluded."""
    model.eval()
    w, nll, count = windows(tokens, seq, max_windows), 0.0, 0
    for s in range(0, len(w), batch):
        x = w[s : s + batch].to(device)
        with autocast(device):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        lp = torch.log_softmax(logits.float(), -1).gather(-1, x[:, 1:, None])[..., 0]
        mask = x[:, 1:] != EOS
        nll -= lp[mask].sum().item()
        count += int(mask.sum())
    return round(nll / max(count, 1) / math.log(2), 4), count


def train(model, data: torch.Tensor, args, device, log) -> dict:
    groups = ([], [])  # weight decay on matrices only: never on gates, norms, embeddings
    for name, p in model.named_parameters():
        plain = p.ndim < 2 or any(s in name for s in ("A_log", "dt_bias", "norm", "embed", "conv1d"))
        groups[plain].append(p)
    param_groups = [{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(param_groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    data, gen = data.to(device), torch.Generator(device=device).manual_seed(args.seed)
    micro, accum, budget, steps, tokens, hist = args.batch, 1, args.minutes * 60, 0, 0, []
    run_loss, run_n, lv = 0.0, 0, float("nan")  # loss summed on the device between logging points
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = last = time.time()
    model.train()
    while time.time() - t0 < budget and not (args.max_steps and steps >= args.max_steps):
        frac = (time.time() - t0) / budget
        lr = args.lr * min(1.0, (steps + 1) / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        try:
            total = 0.0
            for _ in range(accum):
                off = torch.randint(0, len(data) - args.seq - 1, (micro, 1), device=device, generator=gen)
                x = data[off + torch.arange(args.seq, device=device)].long()
                with autocast(device):
                    loss = model(input_ids=x, labels=x, use_cache=False).loss
                (loss / accum).backward()
                total += loss.detach().float() / accum
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            if micro == 1 or steps > 0:
                raise
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            micro, accum = micro // 2, accum * 2
            log(f"  out of memory: now micro-batch {micro} x {accum} accumulation steps")
            continue
        steps, tokens = steps + 1, tokens + micro * accum * args.seq
        run_loss, run_n = run_loss + total, run_n + 1
        if steps in (1, 5, 20, 50) or steps % 25 == 0 or args.tiny:
            lv, now, run_loss, run_n = float(run_loss) / run_n, time.time(), 0.0, 0  # mean since last point
            hist.append([steps, tokens, round(now - t0, 1), round(lv, 4), round(lr, 6)])
            if steps in (1, 5, 20, 50) or now - last > 15 or args.tiny:
                last = now
                log(
                    f"  step {steps:5d}  {tokens / 1e6:7.2f}M tokens  {now - t0:6.1f} s  loss {lv:.4f} nats "
                    f"({lv / math.log(2):.3f} bits)  lr {lr:.2e}  {tokens / (now - t0):,.0f} tokens/s"
                )
    if device.type == "cuda":
        torch.cuda.synchronize()
    sec, cuda = time.time() - t0, device.type == "cuda"
    return {
        "steps": steps,
        "tokens": tokens,
        "seconds": round(sec, 1),
        "tokens_per_s": round(tokens / sec),
        "micro_batch": micro,
        "accumulation": accum,
        "seq_len": args.seq,
        "lr": args.lr,
        "warmup": args.warmup,
        "last_train_loss_bits": round(lv / math.log(2), 4),
        "history": hist,
        "peak_gpu_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }


def quantiles(x: torch.Tensor, prefix: str = "") -> dict[str, float]:
    x = x.float().flatten()
    q = torch.quantile(x[:: -(-len(x) // 2**24)], torch.tensor([0.1, 0.5, 0.9])).tolist()  # size cap 2**24
    return {prefix + k: round(v, 5) for k, v in zip(("p10", "p50", "p90", "mean"), [*q, x.mean().item()])}


@torch.no_grad()
def decay_stats(model, tokens, seq: int, batch: int, n_windows: int, device) -> list[dict]:
    """exp(g) per linear layer and head over held-out tokens (KDA: over tokens and channels; per channel)."""
    captured: dict[int, list[torch.Tensor]] = {}

    def gdn_hook(m, args, kwargs, i):  # recompute g from the layer input exactly as the layer does
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        g = -m.A_log.float().exp() * F.softplus(m.in_proj_a(h).float() + m.dt_bias.float())
        captured.setdefault(i, []).append(g.exp().flatten(0, 1).cpu())  # [B*T, HV]

    def kda_hook(m, args, out, i):  # the forget gate returns g [B, T, H, K]
        captured.setdefault(i, []).append(out.float().exp().flatten(0, 1).cpu())

    hooks = []
    for i, mod in linear_layers(model):
        if hasattr(mod, "num_v_heads"):
            hook = mod.register_forward_pre_hook(lambda m, a, k, i=i: gdn_hook(m, a, k, i), with_kwargs=True)
            hooks.append(hook)
        else:
            hooks.append(mod.register_forward_hook(lambda m, a, o, i=i: kda_hook(m, a, o, i)))
    model.eval()
    w = windows(tokens, seq, n_windows)
    for s in range(0, len(w), batch):
        with autocast(device):
            model(input_ids=w[s : s + batch, :-1].to(device), use_cache=False)
    for hook in hooks:
        hook.remove()
    rows = []
    for i, parts in sorted(captured.items()):
        d = torch.cat(parts)
        for h in range(d.shape[1]):
            row = {"layer": i, "head": h, **quantiles(d[:, h])}
            if d.ndim == 3:
                med = d[:, h].median(0).values  # per key channel: median over tokens
                row.update(quantiles(med, "channel_median_"))
                row["channels_median_ge_0.99"] = round((med >= 0.99).float().mean().item(), 4)
            rows.append(row)
    return rows


def decay_summary(rows: list[dict]) -> dict[str, int]:
    p = [r["p50"] for r in rows]
    return {
        "heads": len(p),
        "median>=0.99": sum(v >= 0.99 for v in p),
        "0.9<=median<0.99": sum(0.9 <= v < 0.99 for v in p),
        "0.5<=median<0.9": sum(0.5 <= v < 0.9 for v in p),
        "median<0.5": sum(v < 0.5 for v in p),
    }


# -------------------------------------------------------------------------------------------- model card
# ----------------------------------------------------------------------------------------------------- main
def run_arch(arch: str, corpus: dict, args, device, torch_paths: list[str], log) -> dict:
    name = NAMES[arch] + ("-smoke" if args.tiny else "")
    out = Path(args.out) / name
    torch.manual_seed(args.seed)
    model = build_model(arch, args.tiny)
    init, n_params = init_gates(model), param_count(model)
    log(f"[{name}] {type(model).__name__}, {n_params:,} parameters ({2 * n_params / 2**20:.2f} MiB in bf16)")
    log(f"[{name}] initial decays (layer: per head): {init}")
    tr = train(model.to(device), corpus["train"], args, device, log)
    log(f"[{name}] {tr['steps']} steps, {tr['tokens'] / 1e6:.1f}M tokens in {tr['seconds']} s")
    model.to(torch.bfloat16).save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    del model
    (out / "model.safetensors").chmod(0o644)  # safetensors writes it owner-only
    size = (out / "model.safetensors").stat().st_size
    if not args.tiny and size >= 15 * 2**20:
        raise SystemExit(f"error: {out}/model.safetensors is {size / 2**20:.2f} MiB, over the 15 MiB limit")
    shipped = AutoModelForCausalLM.from_pretrained(out).to(device)  # measure exactly what is shipped (bf16)
    bpb, scored = {}, {}
    for key, part in (("site_packages_holdout", "val"), ("stdlib_sample", "stdlib")):
        n_win = args.eval_bytes // args.seq
        bpb[key], scored[key] = bits_per_byte(shipped, corpus[part], args.seq, args.eval_batch, device, n_win)
    rows = decay_stats(shipped, corpus["val"], args.seq, args.eval_batch, args.decay_windows, device)
    log(f"[{name}] bits/byte {bpb}; decay medians {decay_summary(rows)}")
    report = {
        "name": name,
        "arch": arch,
        "class": type(shipped).__name__,
        "params": n_params,
        "safetensors_MiB": round(size / 2**20, 3),
        "bpb": bpb,
        "bpb_bytes": scored,
        "init_decay": init,
        "decay_tokens": len(windows(corpus["val"], args.seq, args.decay_windows)) * args.seq,
        "decay_summary": decay_summary(rows),
        "decay": rows,
        "train": tr,
        "data": corpus["info"],
        "config": {k: v for k, v in shipped.config.to_dict().items() if not k.startswith("_")},
        "torch_paths": torch_paths,
        "blocked_packages": FOUND_KERNELS,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    (out / "decay_stats.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "README.md").write_text(model_card(report, VENDORED))
    return report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["qwen35", "kimi", "both"], default="both")
    p.add_argument("--out", required=True, help="writes OUT/<name>/ per architecture")
    p.add_argument("--minutes", type=float, default=4.0, help="training wall clock per architecture")
    p.add_argument(
        "--total-minutes",
        type=float,
        default=9.25,
        help="whole run, from process start: training budgets shrink to end by then",
    )
    p.add_argument("--reserve", type=float, default=30.0, help="seconds kept per architecture for save, eval")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="CPU smoke: tiny configs, 3 steps, 2 MB of data")
    p.add_argument("--seq", type=int, default=2048, help="bytes per training window")
    p.add_argument("--batch", type=int, default=None, help="windows per step (default 16 for GDN, 8 for KDA)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=0, help="also stop after this many steps (0: time only)")
    p.add_argument("--max-bytes", type=int, default=160_000_000, help="cap on site-packages training bytes")
    p.add_argument("--eval-bytes", type=int, default=1 << 19, help="cap on held-out and stdlib bytes scored")
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--decay-windows", type=int, default=8, help="held-out windows for the decay statistics")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.max_bytes, args.eval_bytes = min(args.seq, 128), min(args.max_bytes, 2000000), 1 << 14
        args.max_steps, args.warmup, args.decay_windows = args.max_steps or 3, min(args.warmup, 2), 2
        args.batch = args.batch or 2
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    archs = ["qwen35", "kimi"] if args.arch == "both" else [args.arch]
    families = tuple(FAMILIES[a] for a in archs)
    dims = tuple({linear_head_dim(a, args.tiny) for a in archs})
    torch_paths = check_kernel_paths(device, families, dims)  # fp32 matmuls stay fp32: no TF32

    def log(msg):
        print(msg, flush=True)

    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}")
    log(f"blocked packages (found at): {FOUND_KERNELS}")
    log(f"linear attention kernels ({TRAIN_KERNELS}): {', '.join(torch_paths)}")
    corpus = load_corpus(args.max_bytes, args.eval_bytes)
    log(f"data: {json.dumps(corpus['info'])}")
    reports = {}
    for k, arch in enumerate(archs):
        a = argparse.Namespace(**vars(args))
        a.batch = args.batch or (16 if arch == "qwen35" else 8)
        left = (START + 60 * args.total_minutes - time.time()) / (len(archs) - k) - args.reserve
        a.minutes = max(0.25, min(args.minutes, left / 60))
        if a.minutes < args.minutes and not args.tiny:
            log(f"[{arch}] training budget cut to {a.minutes:.2f} min to end within --total-minutes")
        reports[arch] = run_arch(arch, corpus, a, device, torch_paths, log)
    log(
        f"done in {time.time() - START:.0f} s: "
        + "; ".join(f"{r['name']} {r['bpb']}" for r in reports.values())
    )
    return reports


if __name__ == "__main__":
    main()
