"""Accuracy of a method on a real model: FP32 and every method decoded side by side, teacher-forced.

The batch holds one row per method (row 0 is FP32, the model's own state), all fed the same held-out text
in chunks of ``EvalConfig.chunk`` tokens a model call; :func:`leapquant.patch` gives each row its method's
state, which steps through every chunk token by token. Per method we report

* ``kl``: mean KL(FP32 || method) of the next-token distributions, nats per token;
* ``top1_agreement``: fraction of steps whose arg-max token equals FP32's;
* ``nll``: mean negative log-likelihood of the true next token, nats per token;
* ``state_rel_err``: ``||S - S_fp32|| / ||S_fp32||`` over all linear-attention layers at the end, and the
  same per layer against decoded tokens (the paper's Figure 3);
* curves of KL and top-1 agreement per stretch between curve points, so a method's standing late in a long
  run can be read apart from its start (:func:`.eval_report.metrics_after`, ``eval-report --after N``);
* with ``generate``: free-running greedy decoding beside FP32 from 8 prompts taken along the text, the mean
  fraction of equal tokens and the median index of the first divergence.

The default text is source read from the running interpreter's standard library (never committed, never
seen in training: the shipped checkpoints train on site-packages), chosen deterministically.
"""

from __future__ import annotations

import hashlib
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..checkpoints import DEFAULT_CHECKPOINT, checkpoint_path, resolve_model
from ..checks import resolve_device
from ..errors import LeapQuantError
from .stream import CachedStream

__all__ = [
    "DEFAULT_EVAL_METHODS",
    "DEFAULT_MODEL",
    "EvalConfig",
    "evaluate_model",
    "load_model",
    "record_trace",
    "stdlib_text",
    "token_ids",
]

DEFAULT_MODEL = checkpoint_path(DEFAULT_CHECKPOINT)
# positions of a chunk scored together: float64 log-probabilities of every row over the vocabulary
_SCORED_AT_ONCE = 64
DEFAULT_EVAL_METHODS = ("bf16", "bf16/w16", "int8", "int8/w16", "int8/w16+ct4", "leapquant-int8")


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate.

    Args:
        methods: method names or saved layer plans (`*.json`); FP32 always runs as the reference row.
        tokens: teacher-forced decode steps scored.
        prefill: prompt tokens run through the model's own chunked kernel before decoding.
        curve_points: how many times the per-layer state error is sampled along the run.
        generate: methods to also run free-running greedy against FP32, for ``generate_tokens`` tokens.
        backend: ``auto`` / ``reference`` / ``reference64`` / ``triton`` (see :func:`leapquant.patch`).
        chunk: teacher-forced tokens per model call. Every method state still takes them one at a time
            (the patched layers step through a chunk token by token); the attention layers, MLPs and the
            scoring run over the chunk at once, which takes the per-token host work of transformers'
            modules off the loop. The scores equal a call per token's (``1``) up to the order of
            floating-point sums, and, for stochastic rounding, the order of the random draws (a chunk's
            tokens layer by layer). Chunks end at the curve points, where states are read and saved.
    """

    methods: tuple[str, ...] = DEFAULT_EVAL_METHODS
    tokens: int = 2048
    prefill: int = 64
    curve_points: int = 32
    generate: tuple[str, ...] = ()
    generate_tokens: int = 256
    backend: str = "auto"
    chunk: int = 256

    def __post_init__(self) -> None:
        from ..methods import load_plan, parse_method

        if not self.methods:
            raise LeapQuantError("eval: give at least one --method")
        # names become configs here, once; the run looks them up (config_of) by the name it reports under.
        # A saved layer plan (leapquant calibrate --out PLAN.json) is named by its file.
        configs = {
            m: load_plan(m) if m.strip().endswith(".json") else parse_method(m)
            for m in ("fp32", *self.methods, *self.generate)
        }
        object.__setattr__(self, "_configs", configs)
        extra = [m for m in self.generate if m not in self.methods]
        if extra:  # its greedy result is reported in the method's row: without a row it would be lost
            raise LeapQuantError(
                f"eval: --generate {extra[0]} needs the method among the evaluated ones too (-m {extra[0]})"
            )
        for name in ("tokens", "prefill", "curve_points", "generate_tokens", "chunk"):
            if getattr(self, name) < 1:
                raise LeapQuantError(f"eval: {name} must be >= 1, got {getattr(self, name)}")

    def config_of(self, name: str):
        """The :class:`~leapquant.methods.MethodConfig` (or :class:`~leapquant.methods.LayerPlan`) of a
        method this config names."""
        return self._configs[name]


def stdlib_text(min_bytes: int) -> tuple[str, list[str]]:
    """At least ``min_bytes`` of standard-library Python source (tests and site-packages excluded).

    Files are ordered by the SHA-1 of their path relative to the stdlib root, so the choice is the same
    on every machine with the same Python, and spread over the library rather than alphabetical.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not (
            {"site-packages", "dist-packages", "test", "tests", "idlelib"} & set(p.relative_to(root).parts)
        )
    ]
    files.sort(key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())
    parts, used, size = [], [], 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(f"# file: {p.relative_to(root)}\n{text}\n")
        used.append(str(p.relative_to(root)))
        size += len(parts[-1].encode())
        if size >= min_bytes:
            return "".join(parts), used
    raise LeapQuantError(f"the standard library at {root} holds fewer than {min_bytes} bytes of source")


def load_model(path: str | Path, device: str = "auto"):
    """``(model, tokenizer)`` from a local transformers folder or a shipped checkpoint's name, float32,
    eval mode, no network."""
    import torch

    path = resolve_model(path)
    device = resolve_device(device)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:  # no weights, bad config.json, an unknown model type
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LeapQuantError(f"model {path}: transformers cannot load it: {first}") from None
    # a folder without tokenizer files loads an empty tokenizer that makes no tokens at all
    if not tokenizer("leapquant", add_special_tokens=False)["input_ids"]:
        raise LeapQuantError(f"model {path}: its tokenizer makes no tokens (tokenizer files missing?)")
    return model.to(device).eval(), tokenizer


def token_ids(
    tokenizer,
    needed: int,
    source: str,
    text: str | None = None,
    gather: Callable[[int], tuple[str, list[str]]] = stdlib_text,
) -> tuple[list[int], str, list[str]]:
    """The first ``needed`` token ids of ``text``, with the text and the files it came from.

    Without ``text`` it comes from ``gather(min_bytes)``: 4 bytes a token at first (a byte-level tokenizer
    needs 1), doubled while the tokenizer packs more bytes into a token than that (large BPE vocabularies
    on source code can); ``gather`` raises when its corpus runs out. Given text that is too short raises,
    naming ``source``."""
    gathered, files, min_bytes = text is None, [], 4 * needed
    while True:
        if gathered:
            text, files = gather(min_bytes)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= needed:
            return ids[:needed], text, files
        if text and not ids:  # doubling the text would never help
            raise LeapQuantError(f"the tokenizer makes no tokens of {source}'s text")
        if not gathered:
            raise LeapQuantError(f"{source} has {len(ids)} tokens, fewer than the {needed} requested")
        min_bytes *= 2


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def evaluate_model(
    model,
    tokenizer,
    config: EvalConfig,
    *,
    text: str | None = None,
    text_source: str = "stdlib",
    on_step: Callable[[int], None] | None = None,
    on_partial: Callable[[dict], None] | None = None,
    checkpoint: str | Path | None = None,
    time_limit: float | None = None,
) -> dict:
    """Run the evaluation (see the module docstring); returns the report dict (JSON-ready).

    ``on_partial`` receives the report so far (``"complete": false``) at every curve point, so a run cut
    short still leaves its numbers.

    ``checkpoint``: a file (:mod:`leapquant.eval.resume`) written at every curve point; if it exists when
    the run starts, the run goes on from it (it must be of the same model, methods, settings and text).
    A finished run leaves only its report there, which the same call then returns at once.
    ``time_limit``: seconds of this call's decoding after which the run stops at the next curve point,
    checkpoint written, and returns its report so far (``"complete": false``); needs ``checkpoint``.
    """
    import torch

    from ..integrations import patch, unpatch
    from ..integrations.transformers import linear_head_dims
    from ..methods import as_layer_methods
    from . import resume

    if time_limit is not None and checkpoint is None:
        raise LeapQuantError("eval: a time limit needs a checkpoint, the file the run goes on from")
    if time_limit is not None and not time_limit >= 0:
        raise LeapQuantError(f"eval: the time limit must be >= 0 seconds, got {time_limit}")

    needed = config.prefill + config.tokens + 1
    # greedy prompts are spread over at least 4 prompt lengths each, whatever the teacher-forced length
    text_needed = max(needed, 4 * GREEDY_PROMPTS * config.prefill) if config.generate else needed
    text_ids, text, files = token_ids(tokenizer, text_needed, text_source, text)
    all_ids = torch.tensor(text_ids, device=model.device)
    ids = all_ids[:needed]
    rows = ("fp32", *config.methods)
    # a checkpoint's identity fingerprints the weights: computed only for runs that keep one
    identity = resume.run_identity(model, config, ids) if checkpoint is not None else None
    saved = resume.load_checkpoint(checkpoint, identity) if checkpoint and Path(checkpoint).exists() else None
    if saved is not None and saved.get("report") is not None:
        return saved["report"]  # the run was complete: its report, not a second run
    patched = patch(model, [config.config_of(r) for r in rows], backend=config.backend)
    head_dims = linear_head_dims(model)
    batch = ids[None].repeat(len(rows), 1)
    # accumulated on the device: no host sync per token, the CPU runs ahead of the GPU
    kl, nll, agree = (torch.zeros(len(rows), dtype=torch.float64, device=model.device) for _ in range(3))
    marks = sorted(
        {max(1, round(config.tokens * (i + 1) / config.curve_points)) for i in range(config.curve_points)}
    )
    curves: dict[int, list[list[float]]] = {}
    running: list[tuple[list[float], list[float]]] = []  # (KL sums, top-1 counts) per row at each mark

    def segments(done: list[int], which: int) -> dict[str, list[float]]:
        """Per method, the mean of KL (``which`` 0) or top-1 agreement (1) over each stretch of tokens
        between consecutive curve points."""
        out = {name: [] for i, name in enumerate(rows) if i}
        prev_mark, prev = 0, [0.0] * len(rows)
        for mark, sums in zip(done, running, strict=True):
            cur = sums[which]
            for i, name in enumerate(rows):
                if i:
                    out[name].append((cur[i] - prev[i]) / (mark - prev_mark))
            prev_mark, prev = mark, cur
        return out

    def report(n: int, states: dict, generated: dict) -> dict:
        methods = {}
        for i, name in enumerate(rows):
            if i == 0 and "fp32" not in config.methods:
                continue
            num = sum(float((st[i] - st[0]).norm() ** 2) for st in states.values())
            den = sum(float(st[0].norm() ** 2) for st in states.values())
            cfg = config.config_of(name)
            methods[name] = {
                "kl": float(kl[i] / n),
                "top1_agreement": float(agree[i] / n),
                "nll": float(nll[i] / n),
                "state_rel_err": (num / den) ** 0.5,
                "state_rel_err_by_layer": {str(layer): curves[layer][-1][i] for layer in curves},
                # a layer plan's averaged over the model's linear layers, its default's included
                "bytes_per_element": as_layer_methods(cfg).bytes_per_element(*head_dims, list(states)),
                "window": cfg.window,
            }
            if name in generated:
                methods[name]["generate"] = generated[name]
        done = [m for m in marks if m <= n]
        return {
            "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
            "architecture": type(model).__name__,
            "tokens": n,
            "complete": n == config.tokens,
            "prefill": config.prefill,
            "backend": config.backend,
            "chunk": config.chunk,
            # wall time of the teacher-forced decode so far: what a run of N tokens will take on this machine
            "decode_seconds": round(clock["before"] + clock["end"] - clock["start"], 2),
            **({"resumed_at": resumed_at} if resumed_at else {}),
            "text": {"source": text_source, "files": files[:50], "tokens_used": config.prefill + n + 1},
            "fp32": {"nll": float(nll[0] / n), "bits_per_token": float(nll[0] / n) / 0.6931471805599453},
            "linear_attention_layers": patched.layers,
            "methods": methods,
            "curves": {
                "tokens": done,
                "layers": {
                    str(layer): {name: [pt[i] for pt in pts] for i, name in enumerate(rows) if i}
                    for layer, pts in curves.items()
                },
                # the mean over the tokens since the previous curve point (segment j ends at tokens[j])
                "kl": segments(done, 0),
                "top1_agreement": segments(done, 1),
            },
        }

    clock = {"start": time.perf_counter(), "before": 0.0}
    resumed_at: list[int] = []
    try:
        with torch.inference_mode():
            stream = CachedStream(model)
            cache = stream.cache
            stream(batch[:, : config.prefill])
            first = 0
            if saved is not None:  # the prefill built every state; overwrite them with the saved ones
                resume.restore_cache(cache, saved["cache"], model.device)
                patched.restore(cache, saved["states"])
                resume.restore_rng(saved["rng"], model.device)
                stream.position = saved["position"]
                for acc, value in zip((kl, nll, agree), saved["sums"], strict=True):
                    acc.copy_(value)
                running[:] = [tuple(r) for r in saved["running"]]
                curves.update({int(k): v for k, v in saved["curves"].items()})
                first, clock["before"] = saved["step"], saved["decode_seconds"]
                resumed_at = [*saved["resumed_at"], first]
                saved = None  # restored: its tensors (a whole KV cache) need not stay in memory
                if on_step is not None:
                    on_step(first)
            step = first
            while step < config.tokens:
                # up to the next curve point: states are read (and saved) there
                n = min(config.chunk, next(m for m in marks if m > step) - step)
                t = config.prefill + step
                # [rows, n, vocab] in the model's dtype, alive until scored: a large vocabulary (150K+)
                # at chunk 256 makes it gigabytes, which --chunk lowers
                logits = stream(batch[:, t : t + n]).logits
                for s in range(0, n, _SCORED_AT_ONCE):  # float64 scores of a slice of positions at a time
                    logp = torch.log_softmax(logits[:, s : s + _SCORED_AT_ONCE].double(), dim=-1)
                    kl += (logp[:1].exp() * (logp[:1] - logp)).sum(-1).sum(-1)
                    nxt = ids[t + s + 1 : t + s + 1 + logp.shape[1]]
                    nll -= logp.gather(-1, nxt.expand(len(rows), -1)[..., None]).sum((-2, -1))
                    agree += (logp.argmax(-1) == logp[:1].argmax(-1)).double().sum(-1)
                del logits, logp
                step += n
                if step in marks:
                    running.append((kl.tolist(), agree.tolist()))
                    states = patched.states(cache)
                    for layer, st in states.items():
                        curves.setdefault(layer, []).append([_rel(st[i], st[0]) for i in range(len(rows))])
                    clock["end"] = time.perf_counter()
                    if checkpoint is not None and step < config.tokens:
                        resume.save_checkpoint(checkpoint, {
                            "identity": identity, "step": step, "position": stream.position,
                            "sums": [kl, nll, agree], "running": running, "curves": curves,
                            "decode_seconds": clock["before"] + clock["end"] - clock["start"],
                            "resumed_at": resumed_at, "cache": resume.snapshot_cache(cache),
                            "states": patched.snapshot(cache), "rng": resume.snapshot_rng(model.device),
                        })  # fmt: skip
                    if on_partial is not None and step < config.tokens:
                        on_partial(report(step, states, {}))
                    out_of_time = time_limit is not None and clock["end"] - clock["start"] >= time_limit
                    if out_of_time and step < config.tokens:
                        return report(step, states, {})
                if on_step is not None:
                    on_step(n)
            final = patched.states(cache)
            clock["end"] = time.perf_counter()
        with torch.inference_mode():  # no autograd graph across hundreds of free-running steps
            generated = {m: _greedy_against_fp32(model, all_ids, m, config) for m in config.generate}
    finally:
        unpatch(model)
    finished = report(config.tokens, final, generated)
    if checkpoint is not None:  # the report alone: a rerun of the command returns it without decoding
        resume.save_checkpoint(checkpoint, {"identity": identity, "step": config.tokens, "report": finished})
    return finished


GREEDY_PROMPTS = 8


def _greedy_against_fp32(model, ids, method: str, config: EvalConfig) -> dict:
    """Free-running greedy decoding of FP32 and ``method`` side by side from ``GREEDY_PROMPTS`` prompts.

    The prompts are ``config.prefill`` tokens long and start at evenly spaced offsets of the evaluation
    text: one prompt is a noisy measure (a near tie in FP32's own distribution flips under any perturbation).
    Reports the mean fraction of equal tokens, the median first divergence (``tokens`` where none) and the
    per-prompt values.
    """
    import torch

    from ..integrations import patch

    span = ids.numel() - config.prefill
    starts = [round(i * span / GREEDY_PROMPTS) for i in range(GREEDY_PROMPTS)]
    prompts = torch.stack([ids[s : s + config.prefill] for s in starts])
    patch(model, (config.config_of("fp32"), config.config_of(method)), backend=config.backend)
    stream = CachedStream(model)
    logits = stream(prompts.repeat(2, 1)).logits[:, -1]
    tokens = []
    for _ in range(config.generate_tokens):
        nxt = logits.argmax(-1)
        tokens.append(nxt.cpu())
        logits = stream(nxt[:, None]).logits[:, -1]
    seq = torch.stack(tokens, 1)
    ref, got = seq[:GREEDY_PROMPTS], seq[GREEDY_PROMPTS:]
    same = ref == got
    diverged = (~same).any(1)
    first = torch.where(
        diverged,
        (~same).float().argmax(1),
        torch.full_like(diverged, config.generate_tokens, dtype=torch.long),
    )
    return {
        "tokens": config.generate_tokens,
        "prompts": GREEDY_PROMPTS,
        "agreement": float(same.double().mean()),
        "first_divergence": float(first.double().quantile(0.5)),  # the middle two of 8 prompts averaged
        "first_divergence_per_prompt": [
            int(x) if d else None for x, d in zip(first.tolist(), diverged.tolist())
        ],
    }


def record_trace(
    model,
    tokenizer,
    tokens: int,
    *,
    text: str | None = None,
    text_source: str = "stdlib",
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
):
    """General-form records (float32) of ``layers`` x ``heads`` over ``tokens`` tokens, and trace metadata.

    The text runs once through the model's own chunked kernels (FP32 state); the records are those of the
    exact trajectory, so ``leapquant simulate`` can replay them through any method on any machine.
    """
    import torch

    from ..integrations import linear_attention_layers, patch, unpatch
    from ..methods import as_layer_methods
    from ..recurrences import Records
    from ..recurrences.delta import gated_deltanet_records, kda_records

    text_ids, text, files = token_ids(tokenizer, tokens, text_source, text)
    ids = torch.tensor(text_ids, device=model.device)
    available = [idx for idx, _ in linear_attention_layers(model)]
    chosen = list(layers) if layers else available
    for idx in chosen:
        if idx not in available:
            raise LeapQuantError(f"layer {idx} is not a linear-attention layer; those are {available}")
    captured = {}

    def recorder(layer_idx, q, k, v, g, beta, l2norm):
        if layer_idx in chosen:
            captured[layer_idx] = (*(x.detach().double().cpu() for x in (q, k, v, g, beta)), l2norm)

    # the trace runs under FP32 through the caller's own patch where there is one (its methods are put
    # back after), so that recording never leaves a patched model unpatched
    previous = getattr(model, "_leapquant_patch", None)
    patched = patch(model, "fp32") if previous is None else previous
    saved_methods = patched.methods
    patched.methods = (as_layer_methods("fp32"),)
    patched.set_recorder(recorder)
    try:
        with torch.inference_mode():
            CachedStream(model)(ids[None])
    finally:
        patched.set_recorder(None)
        patched.methods = saved_methods
        if previous is None:
            unpatch(model)
    parts = []
    family = None
    for idx in chosen:
        q, k, v, g, beta, l2norm = captured[idx]
        family = "kda" if g.ndim == 4 else "gdn"
        fn = kda_records if family == "kda" else gated_deltanet_records
        rec = fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=l2norm)
        hv = rec.k.shape[1]
        picked = list(heads) if heads else list(range(hv))
        if any(h < 0 or h >= hv for h in picked):
            raise LeapQuantError(f"--heads must be in [0, {hv}), got {picked}")
        parts.append([getattr(rec, n)[0, picked].float() for n in ("a", "k", "b", "v", "q")])
    records = Records(*(torch.cat([p[i] for p in parts]) for i in range(5)))
    meta = {
        "family": family,
        "layers": chosen,
        "heads": list(heads) if heads else "all",
        "tokens": tokens,
        "text": {"source": text_source, "files": files[:50]},
        "streams": "layer-major: streams of layer layers[0] first, heads in order",
    }
    return records, meta
