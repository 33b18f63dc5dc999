"""Check the plugin on a model in vLLM itself: the same prompts with vLLM's own state and with a LeapQuant
method, greedy, side by side; token agreement, logprobs, the state tensors as allocated, and the KV-cache
blocks vLLM fits in the same memory against the planner's prediction.

Run with the Python that has vLLM (each engine runs in a subprocess of its own)::

    python -m leapquant.integrations.vllm.check --tiny /tmp/tiny-qwen3-next --method leapquant-int8
    python -m leapquant.integrations.vllm.check --model /path/to/Qwen3-Next --json report.json

``--tiny DIR`` first writes a small random Qwen3-Next (3 GDN layers with grouped value heads of 128x128,
one full-attention layer, MoE) to ``DIR`` with transformers: no download needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

__all__ = [
    "PROMPT_LENGTHS",
    "compare",
    "engine_report",
    "make_tiny_qwen3_next",
    "planner_slot_bytes",
    "run_engine",
    "state_report",
]

PROMPT_LENGTHS = (5, 40, 130, 600)  # 600 > one 512-token block: a prefix-cache hit when asked again
UNRELATED_LENGTH = 70
TOP_LOGPROBS = 5
VLLM_CPU_BLOCK_SIZE = 128  # vLLM's default block size on the CPU, the unit its hybrid pages are padded to


def make_tiny_qwen3_next(
    path: str | Path,
    *,
    linear_layers: int = 3,
    value_heads: int = 4,
    key_heads: int = 2,
    head_dim: int = 128,
    seed: int = 0,
) -> Path:
    """A random bf16 Qwen3-Next checkpoint: ``linear_layers`` GDN layers then one full-attention layer, the
    last two layers MoE (vLLM's Qwen3-Next needs at least one), vocabulary 512."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    layers = linear_layers + 1
    config = Qwen3NextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * linear_layers + ["full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        decoder_sparse_step=1, mlp_only_layers=list(range(layers - 2)), tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    path = Path(path)
    model.save_pretrained(path)
    return path


def _prompt(length: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt) % 509 + 1 for i in range(length)]


def state_report(model) -> dict:
    """Inside a worker: each GDN layer's state tensors (dtype, per-slot shape) and a per-slot checksum."""
    import torch

    out = {}
    for name, module in model.named_modules():
        cache = getattr(module, "kv_cache", None)
        if getattr(module, "leapquant", "absent") == "absent" or not cache:
            continue
        slots = cache[0].shape[0]
        sums = torch.zeros(slots, dtype=torch.int64)
        for t in cache:
            flat = t.reshape(slots, -1).view(torch.uint8)
            weight = torch.arange(1, flat.shape[1] + 1, dtype=torch.int64)
            for lo in range(0, slots, 256):  # bounded temporaries: caches hold thousands of slots
                sums[lo : lo + 256] += (flat[lo : lo + 256].long() * weight).sum(1)
        out[name] = {"dtypes": [str(t.dtype) for t in cache], "shapes": [list(t.shape[1:]) for t in cache],
                     "slot_sums": sums.tolist()}  # fmt: skip
    return out


def engine_report(model: str, method: str | None, *, max_tokens: int = 24, prefix_caching: bool = True,
                  tp: int = 1, max_model_len: int = 1024) -> dict:  # fmt: skip
    """One engine (call under ``if __name__ == "__main__"``): the prompts at once, an unrelated prompt with
    per-slot checksums of the state tensors before and after, then the longest prompt again (a prefix-cache
    hit when caching is on)."""
    from vllm import LLM, SamplingParams

    # by its module path, not as __main__.state_report: workers unpickle the function by reference
    from leapquant.integrations.vllm.check import state_report

    # the baseline is vLLM's fp32 state, named: with "auto" its dtype follows vLLM's and transformers'
    # defaults for the model (bf16 for this tiny Qwen3-Next under transformers 5.19)
    if method:
        extra = {"additional_config": {"leapquant_method": method}}
    else:
        extra = {"mamba_ssm_cache_dtype": "float32"}
    if tp > 1:
        extra |= {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, seed=0,
              max_model_len=max_model_len, enable_prefix_caching=prefix_caching, **extra)  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_LOGPROBS, ignore_eos=True)

    def run(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [
            {"tokens": list(o.outputs[0].token_ids),
             "top": [{str(t): x.logprob for t, x in lp.items()} for lp in o.outputs[0].logprobs]}
            for o in outs
        ]  # fmt: skip

    prompts = [_prompt(n, i) for i, n in enumerate(PROMPT_LENGTHS)]
    batch = run(prompts)
    before = llm.apply_model(state_report)
    unrelated = run([_prompt(UNRELATED_LENGTH, 99)])
    after = llm.apply_model(state_report)
    again = run([prompts[-1]])
    cache = llm.llm_engine.vllm_config.cache_config
    report = {
        "method": method or "vllm-default", "prefix_caching": prefix_caching, "tp": tp,
        "num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
        "prompt_lengths": list(PROMPT_LENGTHS), "batch": batch, "unrelated": unrelated, "again": again,
        "layers": [],
    }  # fmt: skip
    # vLLM shares one cache tensor among a layer of each KV-cache group, so every GDN layer's view sees all
    # the blocks the unrelated request wrote: its own state slots, the other layers' and its KV pages. The
    # count is set by vLLM's block allocation, the same whichever state a layer keeps, unless a kernel writes
    # a slot it was not given.
    for rank_before, rank_after in zip(before, after, strict=True):
        for name, b in rank_before.items():
            sums = zip(b["slot_sums"], rank_after[name]["slot_sums"], strict=True)
            changed = sum(x != y for x, y in sums)
            report["layers"].append({"name": name, "dtypes": b["dtypes"], "shapes": b["shapes"],
                                     "slots_changed_by_unrelated": changed})  # fmt: skip
    return report


def run_engine(model: str, method: str | None, args) -> dict:
    """:func:`engine_report` in a fresh process (vLLM spawns workers and keeps global state). ``method``
    None is vLLM's own state; ``args`` has ``tp``, ``max_tokens``, ``prefix_caching`` and ``kv_cache_gib``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "leapquant.integrations.vllm.check", "--engine-only", "--model", model,
               "--json", str(out), "--tp", str(args.tp), "--max-tokens", str(args.max_tokens)]  # fmt: skip
        cmd += ["--method", method] if method else []
        cmd += [] if args.prefix_caching else ["--no-prefix-caching"]
        env = os.environ | {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # apply_model sends state_report
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)  # the report records this value
        if args.tp > 1:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp)))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            raise SystemExit(f"vLLM engine ({method or 'default state'}) failed:\n{tail}")
        return json.loads(out.read_text())


def compare(baseline: dict, method: dict, planner: dict | None) -> dict:
    """Greedy-token agreement (length of the equal prefix) and top-logprob gaps of ``method`` against
    ``baseline``, and its gain in KV-cache blocks (and the planner's, given ``planner_slot_bytes``)."""
    rows = []
    for base, got in zip(baseline["batch"], method["batch"], strict=True):
        agree = next((i for i, (x, y) in enumerate(zip(base["tokens"], got["tokens"])) if x != y),
                     len(base["tokens"]))  # fmt: skip
        # logprob gaps of the tokens both runs rank in their top TOP_LOGPROBS, where the contexts still agree
        pairs = zip(base["top"][:agree], got["top"][:agree])
        gaps = [abs(x[t] - y[t]) for x, y in pairs for t in x if t in y]
        # where greedy tokens part: how far the method's pick was below the baseline's in the baseline's own
        # distribution (a near-tie is a few bf16 roundings; a flip the state caused would be a clear margin)
        margin = None
        if agree < len(base["tokens"]):
            top = base["top"][agree]
            margin = top[str(base["tokens"][agree])] - top.get(str(got["tokens"][agree]), float("-inf"))
        gap = max(gaps, default=0.0)
        rows.append({"agree_prefix": agree, "of": len(base["tokens"]), "max_logprob_gap": gap,
                     "divergence_margin": margin})  # fmt: skip
    result = {"requests": rows, "block_gain": method["num_blocks"] / baseline["num_blocks"]}
    if planner:
        result["planner_gain"] = planner["baseline_slot_bytes"] / planner["method_slot_bytes"]
        result["planner_paged_gain"] = planner["baseline_page_bytes"] / planner["method_page_bytes"]
    return result


def planner_slot_bytes(model: str, method: str, tp: int, *, align_tokens: int = VLLM_CPU_BLOCK_SIZE) -> dict:
    """The planner's bytes of one vLLM state page (recurrent + conv state of one GDN layer on one rank) for
    vLLM's default fp32 state and for ``method``, as counted (``*_slot_bytes``) and as vLLM pads them
    (``*_page_bytes``): to whole attention pages of ``align_tokens`` tokens (vLLM's block size before its
    hybrid adjustment), so that one block holds either a layer's state or its KV of that many tokens."""
    from ...plan import load_shape, plan_memory

    shape = load_shape(model)
    plans = {m: plan_memory(shape, m, gpu_memory_gib=80, context=1) for m in ("fp32", method)}
    slot = {m: (p.state_bytes + p.conv_bytes) // (shape.linear_layers * tp) for m, p in plans.items()}
    # vLLM keeps max(1, kv_heads // tp) KV heads per rank; bf16 K and V per token of one attention layer
    token_bytes = max(1, shape.kv_heads // tp) * shape.head_dim * 2 * 2
    quantum = token_bytes * align_tokens
    page = {m: -(-b // quantum) * quantum for m, b in slot.items()}
    return {"baseline_slot_bytes": slot["fp32"], "method_slot_bytes": slot[method],
            "baseline_page_bytes": page["fp32"], "method_page_bytes": page[method]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m leapquant.integrations.vllm.check", description=__doc__.split("\n\n")[0]
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Qwen3-Next checkpoint directory vLLM can load")
    src.add_argument("--tiny", metavar="DIR", help="write a small random Qwen3-Next to DIR and check it")
    p.add_argument("--method", help="LeapQuant method (default leapquant-int8)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (CPU: one core each)")
    p.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per prompt (default 24)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument(
        "--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE, whole GiB (default 1)"
    )
    p.add_argument("--json", help="write the reports and the comparison here")
    p.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.tp, args.max_tokens, args.kv_cache_gib) < 1:
        p.error("--tp, --max-tokens and --kv-cache-gib must be >= 1")
    if args.engine_only:  # without --method: vLLM's own state
        report = engine_report(args.model, args.method, max_tokens=args.max_tokens,
                               prefix_caching=args.prefix_caching, tp=args.tp)  # fmt: skip
        Path(args.json).write_text(json.dumps(report))
        return 0
    args.method = args.method or "leapquant-int8"
    model = str(make_tiny_qwen3_next(args.tiny)) if args.tiny else args.model
    if not (Path(model) / "config.json").is_file():
        p.error(f"no config.json in {model}")
    baseline = run_engine(model, None, args)
    method = run_engine(model, args.method, args)
    planner = planner_slot_bytes(model, args.method, args.tp)
    result = compare(baseline, method, planner)
    for i, row in enumerate(result["requests"]):
        margin = row["divergence_margin"]
        parted = "" if margin is None else f", parted where the baseline's margin was {margin:.3g} nat"
        print(f"prompt {PROMPT_LENGTHS[i]:>4} tokens: first {row['agree_prefix']}/{row['of']} greedy tokens "
              f"equal, max |logprob gap| {row['max_logprob_gap']:.3g}{parted}")  # fmt: skip
    print(f"state tensors: {method['layers'][0]['dtypes']}")
    print(f"KV-cache blocks in the same memory: {baseline['num_blocks']} -> {method['num_blocks']} "
          f"({result['block_gain']:.3f}x; planner {result['planner_gain']:.3f}x, "
          f"{result['planner_paged_gain']:.3f}x in vLLM's padded pages); "
          f"block size {baseline['block_size']} -> {method['block_size']} tokens")  # fmt: skip
    if args.json:
        from ...eval.provenance import provenance

        how = provenance() | {
            "command": shlex.join(["python", "-m", "leapquant.integrations.vllm.check", *sys.argv[1:]]),
            "vllm": metadata.version("vllm-cpu"),
            "kv_cache_gib": args.kv_cache_gib,
        }
        reports = {"baseline": baseline, "method": method, "planner": planner, "comparison": result}
        Path(args.json).write_text(json.dumps(reports | {"provenance": how}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
