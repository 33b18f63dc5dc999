"""The model card (``README.md``) that ``train_checkpoints.py`` writes beside each checkpoint."""

from __future__ import annotations

CARD = """---
library_name: transformers
tags: [linear-attention, {tags}, byte-level, leapquant]
---

# {name}

A {mparams:.2f}M-parameter byte-level {family} {kind} trained from scratch for a few minutes on Python
source, shipped by leapquant as a small real model for studying quantized recurrent state. A test subject,
not a useful language model.

## Architecture

`{cls}`, {layers} layers, {ratio} (`{pattern}`), hidden {hidden}, MLP {mlp}.
Linear layers: {heads}, key and value head dim {dk} ({dk}x{dk} state per head). Full layers: {full}.
Vocabulary {vocab}, one token per byte: 0 `<pad>`, 1 `</s>` (file separator), 2 `<unk>`, byte b = id b + 3
(ByT5's numbering; a `tokenizers` ByteLevel tokenizer without merges that adds no special tokens and never
matches special-token strings inside text, so text round-trips byte for byte). Weights bf16, {mib:.2f} MiB.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
ids = tok("import os\\n", return_tensors="pt").input_ids  # [[108, 112, 115, ...]]: byte + 3
print(tok.decode(model.generate(ids, max_new_tokens=64)[0]))
```

## Data

The `*.py` files of the training machine's site-packages ({site_dirs}); the standard library was never
read for training. {candidates} non-empty candidate files; skipped: files over 1 MB ({over}), vendored
stdlib copies and backports ({vendored} directories named {vendored_names}), exact copies of stdlib files
({dups}). Held out by file: `{val_rule}`. Train: {train_files} files, {train_mb:.1f} MB (byte cap; files
taken in crc32 order of their path so that the cap spreads over all packages); held out: {val_files}
files, {val_mb:.2f} MB. Largest packages in the training set (MB): {top}. Standard-library sample (evaluation
only): {std_files} files, {std_rule}.

## Training

{steps} steps, {mtokens:.1f}M tokens (bytes) in {seconds:.0f} s ({tps:,} tokens/s) on {device},
micro-batch {micro} x {accum} accumulation of {seq}-byte random windows. AdamW (betas 0.9/0.95, weight
decay 0.1 on weight matrices, none on gates, norms, embeddings), peak lr {lr}, {warmup}-step warmup then
cosine to 10% over the wall-clock budget, gradient clipping 1.0, bf16 autocast over fp32 master weights.
{kernels} torch {torch}, transformers {transformers}, Python {python}.
Command: `{command}`.

## Held-out bits per byte (shipped bf16 weights)

| text | bytes scored | bits/byte |
| --- | ---: | ---: |
| site-packages hold-out | {val_n:,} | {val_bpb:.4f} |
| standard-library sample | {std_n:,} | {std_bpb:.4f} |

{seq}-byte windows; every byte after a window's first is predicted once; separators are not counted.

## Long memory: what was done and why

With transformers' default initialisation (GDN: `dt_bias = 1`, `A ~ U(0.01, 16)`, so that the decay
`exp(-A softplus(1))` is near 0 for almost every head) a short run leaves most heads forgetting every
token: the gradient through `exp(g)` vanishes there and they never recover. That hides the effect under
study, since quantization error accumulates in long-memory states. So the gates start spread: `A_log = 0`
and `dt_bias = softplus^-1(-log target)`; half of the heads of each layer (alternating, so that grouped
value heads sharing a key head get one of each) start log-uniformly at decay 0.999-0.990, the others at
0.990-0.37 ({how}). Nothing is frozen, gates get no weight decay, and windows are {seq} bytes long so that
long memory pays. Initial decays (layer: per head{init_note}): `{init}`.

## Decay distribution after training: exp(g) over {decay_tokens:,} held-out tokens

Head medians: {summary}.

{table}
"""


def kernel_sentence(paths: list[str], kda: bool) -> str:
    """What ran the linear layers in training, from the report's ``torch_paths``: transformers' torch path
    (FLA blocked), or FLA's kernels with the float64 check they passed on the training GPU."""
    path = paths[2 if kda else 0]
    if "(fla" not in path:
        return (
            f"The linear layers ran through transformers' own torch chunked path (`{path}`): FLA was "
            "blocked, its chunked backward being wrong on Hopper."
        )
    checked = next(p for p in paths if p.startswith("FLA checked"))
    via = (
        "FLA's KDA kernel with the head's decay on every key channel (the same recurrence; FLA 0.6.0 refuses "
        "its own GDN backward on Hopper with Triton < 3.7.1)"
        if "chunk_kda" in path
        else "FLA's chunked kernel"
    )
    return f"The linear layers ran through {via} (`{path}`), after a check on the same GPU: {checked}."


def model_card(r: dict, vendored: set[str]) -> str:
    """The model card of one trained checkpoint from its run report ``r``."""
    c, t, d, kda = r["config"], r["train"], r["data"], r["arch"] == "kimi"
    dk = c["linear_head_dim"] if kda else c["linear_key_head_dim"]
    cols = ["p10", "p50", "p90", "mean"]
    if kda:
        cols += [f"channel_median_{k}" for k in ("p10", "p50", "p90")] + ["channels_median_ge_0.99"]
    table = ["| layer | head | init | " + " | ".join(cols) + " |", "| ---: " * (len(cols) + 3) + "|"]
    for row in r["decay"]:
        init = r["init_decay"][str(row["layer"])][row["head"]]
        vals = " | ".join(f"{row[k]:.4f}" for k in cols)
        table.append(f"| {row['layer']} | {row['head']} | {init:.4f} | {vals} |")
    if kda:
        table += [
            "",
            "p10/p50/p90/mean: over all tokens and key channels of the head; channel_median_*: "
            f"quantiles over the {dk} key channels of each channel's median decay; last column: "
            "fraction of channels whose median decay is at least 0.99.",
        ]
    heads = (
        f"{c['linear_num_heads']} KDA heads (decay per key channel)"
        if kda
        else f"{c['linear_num_key_heads']} key / {c['linear_num_value_heads']} value GDN heads (decay/head)"
    )
    full = (
        "MLA ({num_attention_heads} heads, kv_lora_rank {kv_lora_rank}, no RoPE)"
        if kda
        else "gated attention ({num_attention_heads} q / {num_key_value_heads} kv heads of {head_dim}, "
        "partial RoPE)"
    )
    how = (
        f"KDA: each head's band is spread over its {dk} key channels, bands rotate by layer"
        if kda
        else "GDN: one decay per value head, offset by layer"
    )
    n_full = c["layer_types"].count("full_attention")
    n_lin = len(c["layer_types"]) - n_full
    ratio = (f"{n_lin // n_full} linear-attention : 1 full-attention" if n_full
             else "every layer linear attention, no attention layer")  # fmt: skip
    return CARD.format(
        ratio=ratio,
        kind="hybrid" if n_full else "all-linear-attention model",
        tags="kda, kimi-linear" if kda else "gated-deltanet, qwen3.5",
        name=r["name"],
        mparams=r["params"] / 1e6,
        family="Kimi-Linear (KDA)" if kda else "Qwen3.5 (Gated DeltaNet)",
        cls=r["class"],
        layers=c["num_hidden_layers"],
        pattern=", ".join(x.split("_")[0] for x in c["layer_types"]),
        hidden=c["hidden_size"],
        mlp=f"{c['intermediate_size']}" + (" (dense in every layer, no MoE)" if kda else ""),
        heads=heads,
        dk=dk,
        full=full.format(**c) if n_full else "none",
        vocab=c["vocab_size"],
        mib=r["safetensors_MiB"],
        site_dirs=", ".join(d["site_dirs"]),
        candidates=d["candidates"],
        over=d["skipped"]["over_1MB"],
        vendored=d["skipped"]["vendored_stdlib_dirs"],
        vendored_names=", ".join(sorted(vendored)),
        dups=d["skipped"]["stdlib_duplicates"],
        val_rule=d["val_rule"],
        train_files=d["train_files"],
        train_mb=d["train_bytes"] / 1e6,
        val_files=d["val_files"],
        val_mb=d["val_bytes"] / 1e6,
        top=", ".join(f"{k} {v}" for k, v in d["top_packages_MB"].items()),
        std_files=d["stdlib_sample_files"],
        std_rule=d["stdlib_sample_rule"],
        steps=t["steps"],
        mtokens=t["tokens"] / 1e6,
        seconds=t["seconds"],
        tps=t["tokens_per_s"],
        device=r["device"],
        micro=t["micro_batch"],
        accum=t["accumulation"],
        seq=t["seq_len"],
        lr=t["lr"],
        warmup=t["warmup"],
        kernels=kernel_sentence(r["torch_paths"], kda),
        command=r["command"],
        val_n=r["bpb_bytes"]["site_packages_holdout"],
        val_bpb=r["bpb"]["site_packages_holdout"],
        std_n=r["bpb_bytes"]["stdlib_sample"],
        std_bpb=r["bpb"]["stdlib_sample"],
        how=how,
        init_note=", mean over key channels" if kda else "",
        init=r["init_decay"],
        decay_tokens=r["decay_tokens"],
        summary=r["decay_summary"],
        table="\n".join(table),
        **r["versions"],
    )
