#!/usr/bin/env python
"""Train byte-level checkpoints on Python source mixed with long-memory recall (project issue 21).

Builds on ``train_checkpoints.py`` (same data, tokenizer, gate initialisation, FLA blocking, held-out bits per
byte, decay statistics and model card) and adds:

* **models** (``--model``, repeatable): ``gdn-linear`` / ``kda-linear``, 8 linear-attention layers and no
  attention, so every long memory must live in the recurrent state; ``gdn-hybrid`` / ``kda-hybrid``, the
  3 : 1 hybrids of the shipped checkpoints; ``gdn-tiny``, a 4-layer all-GDN model with 32x32 states for
  the CPU tests. Shapes come from ``leapquant.plan.presets.byte_hybrid_config``.
* **warm start** (``--init-from DIR``, ``shipped`` or ``own``): every tensor whose name and shape match a
  trained checkpoint is copied (``shipped``: the shipped hybrid of the same family; ``own``: the shipped
  checkpoint of the model being trained when there is one, else the hybrid), so a 3-minute run continues
  from the shipped model; an all-linear model gets trained linear layers where the hybrid had them and fresh
  ones (gates initialised as in ``train_checkpoints.init_gates``) where it had attention.
* **task mixture**: a fraction ``--recall-fraction`` of the training windows are recall examples
  (``leapquant.eval.recall_tasks.training_sequence``: passkey and multi-query key-value lines planted in
  site-packages text, queries with their answers later in the window) and the rest plain text. The loss is
  the mean next-byte loss plus ``--answer-weight`` times the mean loss on answer bytes.
* **curriculum**: the longest planted distance grows log-linearly from ``--min-distance`` to
  ``--max-distance`` over the first ``--ramp`` of the time budget (short examples early: many per window).
* **report**: FP32 exact-match recall accuracy of the saved bf16 weights at ``--eval-distances`` through
  ``leapquant.eval.recall`` (the same scorer as ``leapquant recall``), in the model card and JSON.

    H200:  python scripts/train_recall.py --model gdn-linear --init-from shipped --minutes 3 --out OUT
    CPU:   python scripts/train_recall.py --model gdn-tiny --device cpu --minutes 4 --out /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import torch.nn.functional as F
import train_checkpoints as tc
from checkpoint_card import model_card
from transformers import AutoModelForCausalLM

from leapquant.eval.model_eval import DEFAULT_MODEL
from leapquant.eval.recall import RecallConfig, evaluate_recall
from leapquant.eval.recall_tasks import TASKS, training_sequence

# name -> (family, all linear?, tiny?)
MODELS = {
    "gdn-linear": ("qwen35", True, False),
    "gdn-hybrid": ("qwen35", False, False),
    "kda-linear": ("kimi", True, False),
    "kda-hybrid": ("kimi", False, False),
    "gdn-tiny": ("qwen35", True, True),
}
NAMES = {
    m: f"{'qwen35-gdn' if f == 'qwen35' else 'kimi-kda'}-{m.split('-')[1]}-recall-byte"
    for m, (f, *_) in MODELS.items()
}
MAX_BYTES = 30_000_000  # the limit on a shipped checkpoint


def encode(s: str) -> list[int]:
    return [b + tc.OFFSET for b in s.encode()]


def build(model: str):
    family, linear, tiny = MODELS[model]
    cfg = tc.build_config(family, tiny)
    if linear:
        cfg.layer_types = ["linear_attention"] * cfg.num_hidden_layers
    cls = tc.Qwen3_5ForCausalLM if family == "qwen35" else tc.KimiLinearForCausalLM
    return cls(cfg)


@torch.no_grad()
def warm_start(model, source: str, name: str) -> dict:
    """Copy every tensor of ``source``'s checkpoint whose name and shape match; returns what was copied.

    ``source``: a checkpoint directory, ``shipped`` (the shipped hybrid of ``name``'s family) or ``own``
    (the shipped checkpoint ``NAMES[name]`` itself if it exists: a longer run continues the last one).
    """
    hybrid = DEFAULT_MODEL.parent / tc.NAMES[MODELS[name][0]]
    shipped_self = DEFAULT_MODEL.parent / NAMES[name]
    if source == "own":
        path = shipped_self if (shipped_self / "config.json").is_file() else hybrid
    else:
        path = hybrid if source == "shipped" else Path(source)
    donor = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    own = model.state_dict()
    copied = [k for k, v in donor.items() if k in own and own[k].shape == v.shape]
    for k in copied:
        own[k].copy_(donor[k])
    fresh = sorted(
        {k.split(".")[2] for k in own if k not in copied and k.startswith("model.layers.")}, key=int
    )
    return {"from": str(path), "copied_tensors": len(copied), "tensors": len(own), "fresh_layers": fresh}


def batches(corpus: torch.Tensor, args, progress, gen: random.Random):
    """(tokens [B, seq], answer mask [B, seq]) on the CPU: recall windows and plain-text windows."""
    text = corpus.numpy()
    top = min(1.0, progress / args.ramp) if args.ramp > 0 else 1.0
    max_d = round(args.min_distance * (args.max_distance / args.min_distance) ** top)
    rows, masks = [], []
    for _ in range(args.batch):
        if gen.random() < args.recall_fraction:
            ids, mask = training_sequence(
                args.seq,
                text,
                encode,
                gen,
                max_distance=max_d,
                min_distance=args.min_distance,
                tasks=args.tasks,
            )
        else:
            off = gen.randrange(len(text) - args.seq)
            ids, mask = text[off : off + args.seq].tolist(), [False] * args.seq
        rows.append(ids)
        masks.append(mask)
    return torch.tensor(rows), torch.tensor(masks), max_d


def train(model, corpus: torch.Tensor, args, device, log) -> dict:
    groups = ([], [])
    for name, p in model.named_parameters():
        plain = p.ndim < 2 or any(s in name for s in ("A_log", "dt_bias", "norm", "embed", "conv1d"))
        groups[plain].append(p)
    opt = torch.optim.AdamW(
        [{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    gen, budget, steps, tokens, hist, skipped = random.Random(args.seed), args.minutes * 60, 0, 0, [], 0
    if args.deadline:  # a device call's end: this model's share of the time left, less its reporting
        budget = min(budget, (args.deadline - time.time()) / args.models_left - args.reserve)
        if budget < 30:
            raise SystemExit(f"error: --deadline leaves {budget:.0f} s of training for this model")
        log(f"  training budget {budget:.0f} s (--deadline)")
    t0 = last = time.time()
    model.train()
    while time.time() - t0 < budget and not (args.max_steps and steps >= args.max_steps):
        frac = (time.time() - t0) / budget
        lr = args.lr * min(1.0, (steps + 1) / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        x, mask, max_d = batches(corpus, args, frac, gen)
        x, mask = x.to(device).long(), mask.to(device)
        try:
            with tc.autocast(device):
                logits = model(input_ids=x[:, :-1], use_cache=False).logits
            ce = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(
                x.shape[0], -1
            )
            answer = mask[:, 1:]
            lm = ce.mean()
            ans = (ce * answer).sum() / answer.sum().clamp_min(1)
            (lm + args.answer_weight * ans).backward()
        except torch.cuda.OutOfMemoryError:
            # the GPU scripts ask for a large batch (on the torch chunked path a step's time seems to be
            # launches more than arithmetic); where it does not fit (another model shares the GPU, a
            # smaller card), halve it and go on
            if args.batch == 1:
                raise
            logits = ce = lm = ans = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            args.batch //= 2
            log(f"  out of memory at step {steps + 1}: batch now {args.batch}")
            continue
        lm, ans = lm.detach(), ans.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if not torch.isfinite(norm):  # one such step would poison AdamW's moments for good: skip it
            opt.zero_grad(set_to_none=True)
            skipped += 1
            log(f"  step {steps + 1}: gradient norm {float(norm)}, step skipped ({skipped} so far)")
            if skipped > 10:
                raise SystemExit(f"error: {skipped} steps with a non-finite gradient: stopping")
            continue
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps, tokens = steps + 1, tokens + x.numel()
        if steps in (1, 5, 20) or steps % 25 == 0 or args.log_every_step:
            acc = ((logits.argmax(-1) == x[:, 1:]) | ~answer).all(
                -1
            )  # windows whose every answer byte is right
            has = answer.any(-1)
            acc = float(acc[has].float().mean()) if has.any() else float("nan")
            now = time.time()
            hist.append(
                [steps, tokens, round(now - t0, 1), round(float(lm), 4), round(float(ans), 4), acc, max_d]
            )
            if steps in (1, 5, 20) or now - last > 15 or args.log_every_step:
                last = now
                log(
                    f"  step {steps:5d}  {tokens / 1e6:6.2f}M tokens  {now - t0:6.1f} s  "
                    f"text {float(lm):.3f}  answer {float(ans):.3f} nats  "
                    f"recall windows all-right {acc:.2f}  max distance {max_d}  "
                    f"lr {lr:.2e}"
                )
    sec = time.time() - t0
    return {
        "steps": steps,
        "tokens": tokens,
        "seconds": round(sec, 1),
        "tokens_per_s": round(tokens / sec),
        "micro_batch": args.batch,
        "accumulation": 1,
        "seq_len": args.seq,
        "lr": args.lr,
        "warmup": args.warmup,
        "skipped_steps": skipped,
        "history": hist,
    }


def fp32_recall(path: Path, args, device) -> dict:
    from leapquant.eval.model_eval import load_model

    model, tok = load_model(path, str(device))
    out = {}
    for task in args.tasks:  # the tasks it was trained on
        cfg = RecallConfig(
            methods=(),
            task=task,
            distances=tuple(args.eval_distances),
            examples=args.eval_examples,
            prefix=args.eval_prefix,
        )
        out[task] = evaluate_recall(model, tok, cfg)["methods"]["fp32"]["accuracy"]
    return out


def run_model(name: str, corpus: dict, args, device, torch_paths, log) -> dict:
    family = MODELS[name][0]
    out = Path(args.out) / NAMES[name]
    torch.manual_seed(args.seed)
    model = build(name)
    init = tc.init_gates(model)
    start = warm_start(model, args.init_from, name) if args.init_from else None
    n_params = tc.param_count(model)
    log(f"[{NAMES[name]}] {type(model).__name__}, {n_params:,} parameters; warm start {start}")
    tr = train(model.to(device), corpus["train"], args, device, log)
    log(f"[{NAMES[name]}] {tr['steps']} steps, {tr['tokens'] / 1e6:.1f}M tokens in {tr['seconds']} s")
    model.to(torch.bfloat16).save_pretrained(out)
    tc.byte_tokenizer().save_pretrained(out)
    del model
    (out / "model.safetensors").chmod(0o644)
    size = (out / "model.safetensors").stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(
            f"error: {out}/model.safetensors is {size / 1e6:.1f} MB, over the {MAX_BYTES / 1e6:.0f} MB limit"
        )
    shipped = AutoModelForCausalLM.from_pretrained(out).to(device)
    bpb, scored = {}, {}
    seq = min(args.seq, 2048)
    for key, part in (("site_packages_holdout", "val"), ("stdlib_sample", "stdlib")):
        bpb[key], scored[key] = tc.bits_per_byte(
            shipped, corpus[part], seq, 8, device, args.eval_bytes // seq
        )
    rows = tc.decay_stats(shipped, corpus["val"], seq, 8, args.decay_windows, device)
    del shipped
    recall = fp32_recall(out, args, device)
    log(f"[{NAMES[name]}] bits/byte {bpb}; decay medians {tc.decay_summary(rows)}; FP32 recall {recall}")
    report = {
        "name": NAMES[name],
        "arch": family,
        "class": None,
        "params": n_params,
        "safetensors_MiB": round(size / 2**20, 3),
        "bpb": bpb,
        "bpb_bytes": scored,
        "init_decay": init,
        "decay_tokens": len(tc.windows(corpus["val"], seq, args.decay_windows)) * seq,
        "decay_summary": tc.decay_summary(rows),
        "decay": rows,
        "train": tr,
        "data": corpus["info"],
        "warm_start": start,
        "recall_fp32": recall,
        "eval_distances": args.eval_distances,
        "mixture": {
            k: getattr(args, k)
            for k in ("recall_fraction", "answer_weight", "min_distance", "max_distance", "ramp", "seq")
        },
        "torch_paths": torch_paths,
        "blocked_packages": tc.FOUND_KERNELS,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else tc.platform.machine(),
        "versions": {
            "torch": torch.__version__,
            "transformers": tc.transformers.__version__,
            "python": tc.platform.python_version(),
        },
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    cfg = json.loads((out / "config.json").read_text())
    report["config"], report["class"] = cfg, cfg["architectures"][0]
    (out / "decay_stats.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "README.md").write_text(model_card(report, tc.VENDORED) + recall_card(report))
    return report


def recall_card(r: dict) -> str:
    m, w = r["mixture"], r["warm_start"]
    rows = "\n".join(
        f"| {task} | " + " | ".join(f"{100 * a:.1f}" for a in acc.values()) + " |"
        for task, acc in r["recall_fp32"].items()
    )
    start = (
        (
            f"Warm start: {w['copied_tensors']} of {w['tensors']} tensors copied from `{w['from']}` "
            f"(fresh layers: {w['fresh_layers'] or 'none'})."
        )
        if w
        else "Trained from scratch."
    )
    distances = (
        f"{m['min_distance']} up to a maximum that grows to {m['max_distance']} over the first "
        f"{100 * m['ramp']:.0f}% of\nthe run."
        if m["ramp"] > 0
        else f"{m['min_distance']} to {m['max_distance']} from the first step (no curriculum)."
    )
    return f"""
## Recall training (`scripts/train_recall.py`)

{start} {100 * m["recall_fraction"]:.0f}% of the {m["seq"]}-byte windows hold passkey and multi-query
key-value examples (`leapquant.eval.recall_tasks`) planted in the training text, the others plain text; loss
= next-byte loss + {m["answer_weight"]} x answer-byte loss. Planted distances log-uniform from
{distances}

FP32 exact-match recall (% of answers), saved bf16 weights, standard-library text, `leapquant recall`'s
scorer, distances {", ".join(str(d) for d in r["eval_distances"])} tokens:

| task | {" | ".join(str(d) for d in r["eval_distances"])} |
| --- |{" ---: |" * len(r["eval_distances"])}
{rows}
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", choices=list(MODELS), help="repeatable (default gdn-linear)")
    p.add_argument("--out", required=True, help="writes OUT/<name>/ per model")
    p.add_argument("--minutes", type=float, default=3.0, help="training wall clock per model")
    p.add_argument(
        "--init-from",
        help="a checkpoint DIR, 'shipped' (the shipped hybrid of the same family) or 'own' (the shipped "
        "checkpoint of this model if there is one, else the hybrid)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq", type=int, default=4096, help="bytes per training window")
    p.add_argument("--batch", type=int, default=8, help="windows per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=0, help="also stop after this many steps (0: time only)")
    p.add_argument(
        "--deadline", type=float, default=0,
        help="unix time by which every model must be trained, saved and reported (a device call's limit): "
        "shortens --minutes to fit, keeping --reserve seconds per model for the rest",
    )  # fmt: skip
    p.add_argument("--reserve", type=float, default=120, help="seconds per model after training (--deadline)")
    p.add_argument("--recall-fraction", type=float, default=0.5, help="share of windows with recall examples")
    p.add_argument(
        "--tasks", nargs="+", choices=list(TASKS), default=list(TASKS), help="recall tasks mixed in"
    )
    p.add_argument("--answer-weight", type=float, default=2.0, help="weight of the answer-byte loss")
    p.add_argument("--min-distance", type=int, default=32)
    p.add_argument("--max-distance", type=int, default=3072)
    p.add_argument("--ramp", type=float, default=0.6, help="share of the budget over which distances grow")
    p.add_argument("--max-bytes", type=int, default=160_000_000, help="cap on site-packages training bytes")
    p.add_argument("--eval-bytes", type=int, default=1 << 19)
    p.add_argument("--decay-windows", type=int, default=8)
    p.add_argument("--eval-distances", type=int, nargs="+", default=[1024, 3072])
    p.add_argument("--eval-examples", type=int, default=16)
    p.add_argument("--eval-prefix", type=int, default=64)
    p.add_argument("--log-every-step", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.model = args.model or ["gdn-linear"]
    args.models_left = 1  # models still to train in this process, counting the current one (main sets it)
    if not 0 <= args.recall_fraction <= 1 or args.min_distance < 1 or args.max_distance < args.min_distance:
        p.error("need 0 <= --recall-fraction <= 1 and 1 <= --min-distance <= --max-distance")
    if args.max_distance + 128 > args.seq:
        p.error(f"--max-distance {args.max_distance} leaves no room for a query in a {args.seq}-byte window")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # small models on a shared CPU: more threads only contend
    families = tuple(dict.fromkeys(tc.FAMILIES[MODELS[m][0]] for m in args.model))
    dims = tuple({tc.linear_head_dim(MODELS[m][0], MODELS[m][2]) for m in args.model})
    torch_paths = tc.check_kernel_paths(device, families, dims)

    def log(msg):
        print(msg, flush=True)

    log(
        f"torch {torch.__version__}, transformers {tc.transformers.__version__}, {device}; "
        f"models {args.model}"
    )
    corpus = tc.load_corpus(args.max_bytes, args.eval_bytes)
    log(f"data: {corpus['info']['train_files']} files, {corpus['info']['train_bytes'] / 1e6:.1f} MB")
    reports = {}
    for i, m in enumerate(args.model):
        args.models_left = len(args.model) - i
        reports[m] = run_model(m, corpus, args, device, torch_paths, log)
    log(
        f"done in {time.time() - tc.START:.0f} s: "
        + "; ".join(f"{r['name']} {r['bpb']} recall {r['recall_fp32']}" for r in reports.values())
    )
    return reports


if __name__ == "__main__":
    main()
