"""Long-memory recall through each method's state: exact-match accuracy by distance, FP32 beside every method.

For each distance, ``examples`` prompts of :mod:`leapquant.eval.recall_tasks` run in one batch with one
group of rows per method (row group 0 is FP32, the model's own state; :func:`leapquant.patch` gives each
group its method's state):

1. the ``prefix`` tokens of text before the planted keys are prefilled by the model's own chunked kernel,
   and each method's state starts from that prefill's final state (the hand-off);
2. the planted keys and the ``distance`` tokens after them are fed ``chunk`` tokens per model call, and the
   linear-attention layers step every one of them through the method's state (so the keys reach the query
   only through that state, as in a long generation), while attention and MLPs run the chunk at once;
3. at each query the answer is decoded greedily, token by token, through the same state; the decoded
   tokens stay in the context before the next query.

An answer scores 1 when every decoded token equals the planted value. Per method and distance the report
holds ``accuracy`` (exact match), ``token_accuracy``, ``agree_fp32`` (decoded answers equal to FP32's),
``state_rel_err`` (``||S - S_fp32|| / ||S_fp32||`` over all linear layers after the last answer) and
``nonfinite`` (rows whose logits held a NaN or inf). The text is standard-library source (never seen in
training: the shipped checkpoints train on site-packages), as in ``leapquant eval``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import LeapQuantError
from .recall_tasks import TASKS, RecallExample, make_examples
from .stream import CachedStream

__all__ = [
    "METHOD_PRESETS",
    "RecallConfig",
    "evaluate_recall",
    "recall_table_rows",
    "resolve_methods",
    "score_examples",
    "state_table_rows",
]

# The rows of the paper's task table (per-step formats, the Table 2 ablation, LeapQuant at 8/6/4 bits and the
# adapted baselines): one name on the command line. FP32 always runs as the reference row.  LeapQuant at 6 and
# 4 bits runs twice: ours (``+ls``) and the paper's configuration, spelled out.
METHOD_PRESETS = {
    "paper-table": (
        "bf16",
        "int8",
        "fp8-e4m3",
        "int6",
        "int4",
        "int8/w16",
        "int8/w16+ct4",
        "leapquant-int8",
        "leapquant-int6",
        "leapquant-int4",
        "int6/w16+ct4+smooth",
        "int4/w16+ct8+smooth",
        "kvquant-int8",
        "quarot-int8",
        "turboquant-8",
    ),
    "int8-ablation": ("bf16", "int8", "int8/w16", "int8/w16+ct4", "leapquant-int8"),
    "smoke": ("int8", "leapquant-int8"),
}


def resolve_methods(names: Sequence[str]) -> tuple[str, ...]:
    """Method names with preset names (:data:`METHOD_PRESETS`) expanded, duplicates and ``fp32`` dropped."""
    out: list[str] = []
    for name in names:
        for m in METHOD_PRESETS.get(name, (name,)):
            if m != "fp32" and m not in out:
                out.append(m)
    return tuple(out)


@dataclass(frozen=True)
class RecallConfig:
    """What to score.

    Args:
        methods: method names (presets expanded by :func:`resolve_methods`) or saved layer plans
            (``*.json``, e.g. a ``leapquant-auto`` plan from ``leapquant calibrate``); FP32 always runs too.
        task: ``passkey`` or ``mqar``.
        distances: tokens from the planted keys to the (first) query.
        examples: prompts per distance, all in one batch per method.
        prefix: text tokens before the planted keys, prefilled by the model's own kernel.
        chunk: tokens per model call while streaming the context through the methods' states.
        seed: fixes the prompts (see :func:`~leapquant.eval.recall_tasks.make_examples`).
        backend: ``auto`` / ``reference`` / ``reference64`` / ``triton`` (see :func:`leapquant.patch`).
    """

    methods: tuple[str, ...] = METHOD_PRESETS["int8-ablation"]
    task: str = "passkey"
    distances: tuple[int, ...] = (1024, 4096, 16384)
    examples: int = 8
    prefix: int = 128
    chunk: int = 256
    seed: int = 0
    backend: str = "auto"

    def __post_init__(self) -> None:
        from ..methods import as_layer_methods, parse_method

        object.__setattr__(self, "methods", resolve_methods(self.methods))
        if self.task not in TASKS:
            raise LeapQuantError(f"recall: unknown task {self.task!r}; expected one of {', '.join(TASKS)}")
        if not self.distances or min(self.distances) < 1:
            raise LeapQuantError(f"recall: distances must be >= 1, got {list(self.distances)}")
        for name in ("examples", "prefix", "chunk"):
            if getattr(self, name) < 1:
                raise LeapQuantError(f"recall: {name} must be >= 1, got {getattr(self, name)}")
        # a saved layer plan (`leapquant calibrate --out PLAN.json`) is named by its file
        configs = {
            m: as_layer_methods(m) if m.strip().endswith(".json") else parse_method(m)
            for m in ("fp32", *self.methods)
        }
        object.__setattr__(self, "_configs", configs)

    def config_of(self, name: str):
        """The :class:`~leapquant.methods.MethodConfig` (or :class:`~leapquant.methods.LayerPlan`) of
        ``fp32`` or a method this config names."""
        return self._configs[name]


def score_examples(model, examples: Sequence[RecallExample], config: RecallConfig) -> dict:
    """FP32 and ``config.methods`` on ``examples`` (equal lengths), one batch: ``{method: numbers}``.

    Returns per method ``accuracy`` and ``token_accuracy`` (fractions), ``agree_fp32``, ``state_rel_err``,
    ``nonfinite`` (rows) and ``answers`` (decoded token ids ``[example][query]``). The model is unpatched
    after.
    """
    import torch

    from ..integrations import unpatch

    try:
        with torch.inference_mode():
            return _score(model, examples, config)
    finally:
        unpatch(model)


def _score(model, examples: Sequence[RecallExample], config: RecallConfig) -> dict:
    import torch

    from ..integrations import patch

    patched_rows = ("fp32", *config.methods)
    shapes = {(len(ex.context), ex.prefix, tuple(len(p) + len(a) for p, a in ex.queries)) for ex in examples}
    if len(shapes) != 1:
        raise LeapQuantError("recall: the examples of one batch must have equal lengths")
    groups, n = len(patched_rows), len(examples)
    dev = model.device
    ctx = torch.tensor([ex.context for ex in examples], device=dev).repeat(groups, 1)
    patched = patch(model, [config.config_of(m) for m in patched_rows], backend=config.backend)
    stream = CachedStream(model)
    cache = stream.cache
    bad = torch.zeros(groups * n, dtype=torch.bool, device=dev)

    def step(ids):  # next-token logits of the last position; the state advances through every token
        logits = stream(ids, logits_to_keep=1).logits[:, -1]
        bad.logical_or_(~torch.isfinite(logits).all(-1))
        return logits

    prefix = examples[0].prefix
    step(ctx[:, :prefix])
    for s in range(prefix, ctx.shape[1], config.chunk):
        step(ctx[:, s : s + config.chunk])
    exact = torch.zeros(groups * n, device=dev)
    tok_ok = torch.zeros(groups * n, device=dev)
    decoded = []
    answers_len = 0
    for q in range(len(examples[0].queries)):
        prompt = torch.tensor([ex.queries[q][0] for ex in examples], device=dev).repeat(groups, 1)
        answer = torch.tensor([ex.queries[q][1] for ex in examples], device=dev).repeat(groups, 1)
        logits = step(prompt)
        got = []
        for j in range(answer.shape[1]):
            nxt = logits.argmax(-1)
            got.append(nxt)
            if j + 1 < answer.shape[1] or q + 1 < len(examples[0].queries):
                logits = step(nxt[:, None])  # the decoded token, not the true one, enters the state
        got = torch.stack(got, 1)
        decoded.append(got)
        exact += (got == answer).all(1).float()
        tok_ok += (got == answer).float().sum(1)
        answers_len += answer.shape[1]
    states = patched.states(cache)
    queries = len(examples[0].queries)
    out = {}
    for i, name in enumerate(patched_rows):
        rows = slice(i * n, (i + 1) * n)
        same = torch.stack([(d[rows] == d[:n]).all(1) for d in decoded]).float().mean()
        num = sum(float((st[rows] - st[:n]).norm() ** 2) for st in states.values())
        den = sum(float(st[:n].norm() ** 2) for st in states.values())
        out[name] = {
            "accuracy": float(exact[rows].sum()) / (n * queries),
            "token_accuracy": float(tok_ok[rows].sum()) / (n * answers_len),
            "agree_fp32": float(same),
            "state_rel_err": (num / den) ** 0.5 if den > 0 else 0.0,
            "nonfinite": int(bad[rows].sum()),
            "answers": [[decoded[q][i * n + e].tolist() for q in range(queries)] for e in range(n)],
        }
    return out


def evaluate_recall(
    model,
    tokenizer,
    config: RecallConfig,
    *,
    text: str | None = None,
    text_source: str = "stdlib",
    on_partial: Callable[[dict], None] | None = None,
) -> dict:
    """Score FP32 and every method on the recall task at every distance (module docstring); JSON-ready dict.

    ``on_partial`` receives the report after each distance (``"complete": false`` until the last), so a run
    cut short keeps the distances it finished.
    """

    from ..integrations import linear_attention_layers, unpatch
    from ..integrations.transformers import linear_head_dims
    from ..methods import LayerPlan, as_layer_methods
    from .model_eval import stdlib_text

    rows = ("fp32", *config.methods)
    linear = [i for i, _ in linear_attention_layers(model)]
    longest = max(config.distances) + config.prefix
    files: list[str] = []
    if text is None:  # 4x the longest example: the examples' seeded offsets spread over the text
        text, files = stdlib_text(4 * longest)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    report = {
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "architecture": type(model).__name__,
        "layer_types": list(getattr(model.config, "layer_types", []) or []),
        "task": config.task,
        "pairs": TASKS[config.task].pairs,
        "examples": config.examples,
        "prefix": config.prefix,
        "chunk": config.chunk,
        "seed": config.seed,
        "backend": config.backend,
        "distances": [],
        "seconds": {},
        "complete": False,
        "text": {"source": text_source, "files": files[:50], "tokens": len(ids)},
        "methods": {
            m: {
                "bytes_per_element": as_layer_methods(config.config_of(m)).bytes_per_element(
                    *linear_head_dims(model), linear
                ),
                "window": config.config_of(m).window,
                **({"plan": config.config_of(m).name} if isinstance(config.config_of(m), LayerPlan) else {}),
            }
            for m in rows
        },
    }
    try:
        for d in config.distances:
            examples = make_examples(
                config.task, d, config.examples, ids, encode, seed=config.seed, prefix=config.prefix
            )
            t0 = time.perf_counter()
            scores = score_examples(model, examples, config)
            report["seconds"][str(d)] = round(time.perf_counter() - t0, 2)
            report["distances"].append(d)
            for m, row in scores.items():
                for key, value in row.items():
                    report["methods"][m].setdefault(key, {})[str(d)] = value
            report["values"] = report.get("values", {}) | {str(d): [ex.values for ex in examples]}
            if on_partial is not None and d != config.distances[-1]:
                on_partial(report)
    finally:
        unpatch(model)
    report["complete"] = True
    return report


def state_table_rows(report: dict) -> list[tuple[str, ...]]:
    """Rows for printing: method, then per distance the decoded answers equal to FP32's (``k/n``) and the
    state error after the last answer. Where accuracy cannot separate the methods (FP32 itself misses the
    keys), these still show how far each state is from FP32's."""
    n = report["examples"] * report.get("pairs", 1)
    out = []
    for name, row in report["methods"].items():
        agree, err = [], []
        for d in report["distances"]:
            if str(d) not in row["agree_fp32"]:
                agree.append("")
                err.append("")
                continue
            agree.append(f"{round(n * row['agree_fp32'][str(d)])}/{n}")
            err.append(f"{row['state_rel_err'][str(d)]:.2g}")
        out.append((name, *agree, *err))
    return out


def recall_table_rows(report: dict) -> list[tuple[str, ...]]:
    """Rows for printing: method, bytes/element, exact-match accuracy % (and non-finite rows) per distance;
    "not reached" where a run cut short (merged from several) never scored that distance."""
    out = []
    for name, row in report["methods"].items():
        cells = []
        for d in report["distances"]:
            if str(d) not in row["accuracy"]:
                cells.append("not reached")
                continue
            acc, bad = row["accuracy"][str(d)], row["nonfinite"][str(d)]
            cells.append(f"{100 * acc:.1f}" + (f" ({bad} non-finite)" if bad else ""))
        out.append((name, f"{row['bytes_per_element']:.3f}", *cells))
    return out
