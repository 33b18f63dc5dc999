"""Long-memory recall prompts: keys planted a chosen number of tokens before their query, in ordinary text.

Two tasks, both written as Python lines so that they blend into the source code the byte models read:

* ``passkey``: one line ``passkey = 48213`` planted in the text; ``distance`` tokens after the start of that
  line comes the query, the line again up to its value (``passkey = ``), and the answer is the five digits.
* ``mqar`` (multi-query associative recall): ``pairs`` lines ``k_qzx = 7361`` planted one after another;
  ``distance`` tokens after the start of that block come the queries ``k_qzx = `` in a shuffled order,
  each answered by its four digits before the next query.

Everything is token ids, built piece by piece with the caller's ``encode`` (a byte tokenizer in this
project, any tokenizer in principle), so every length, and the distance, is exact in tokens. Examples are
a pure function of ``(seed, task, distance, index)`` and the filler text, whose length a run sizes to its
longest distance: the same prompts on every machine for the same distances (``recall-report --merge``
refuses runs that asked one distance on texts of other lengths).

Layout of one example (``prefix`` tokens of text, then the planted block, then text up to the query)::

    [text: prefix][\\n key = value\\n ... ][text ...][\\nkey = ][answer][\\nkey2 = ][answer2]...
                  ^ planted_at                        ^ planted_at + distance
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import LeapQuantError

__all__ = ["TASKS", "RecallExample", "RecallTask", "make_examples", "training_sequence"]


@dataclass(frozen=True)
class RecallTask:
    """One recall task's shape.

    Attributes:
        name: ``passkey`` or ``mqar``.
        pairs: keys planted (and queried) per example.
        key_letters: random lowercase letters per key name (0: the fixed name ``passkey``).
        digits: digits per value (leading zeros allowed, so every answer has the same length).
    """

    name: str
    pairs: int
    key_letters: int
    digits: int

    def key_value(self, rng: random.Random, taken: set[str]) -> tuple[str, str]:
        while True:
            key = (
                "passkey"
                if not self.key_letters
                else "k_" + "".join(rng.choice(string.ascii_lowercase) for _ in range(self.key_letters))
            )
            if key not in taken:
                taken.add(key)
                return key, "".join(rng.choice(string.digits) for _ in range(self.digits))

    @staticmethod
    def query(key: str) -> str:
        """A query: the key's line again up to its value (recall is copying the value from memory)."""
        return f"\n{key} = "

    @staticmethod
    def planted(kv: Sequence[tuple[str, str]]) -> str:
        """The planted block: a newline, then one ``key = value`` line per pair."""
        return "\n" + "".join(f"{k} = {v}\n" for k, v in kv)


TASKS = {
    "passkey": RecallTask("passkey", pairs=1, key_letters=0, digits=5),
    "mqar": RecallTask("mqar", pairs=4, key_letters=3, digits=4),
}


@dataclass(frozen=True)
class RecallExample:
    """One prompt. Token lists are plain ``list[int]``.

    Attributes:
        context: everything before the first query: ``prefix`` tokens of text, the planted block, more text.
        prefix: leading text tokens (the evaluation prefills them with the model's own kernel).
        planted_at: index in ``context`` where the planted block (its leading newline) starts.
        distance: tokens from ``planted_at`` to the start of the first query.
        queries: ``(prompt, answer)`` token lists, in the order asked.
        keys, values: the planted names and values, in the order asked.
    """

    context: list[int]
    prefix: int
    planted_at: int
    distance: int
    queries: list[tuple[list[int], list[int]]]
    keys: list[str]
    values: list[str]

    def tokens(self) -> list[int]:
        """The whole example with its answers (teacher forcing, training)."""
        out = list(self.context)
        for prompt, answer in self.queries:
            out += prompt + answer
        return out

    def answer_mask(self) -> list[bool]:
        """Per token of :meth:`tokens`: True on answer tokens."""
        mask = [False] * len(self.context)
        for prompt, answer in self.queries:
            mask += [False] * len(prompt) + [True] * len(answer)
        return mask


def _ids(span) -> list[int]:
    return span.tolist() if hasattr(span, "tolist") else list(span)  # numpy / torch spans: Python ints


def _example(task: RecallTask, distance: int, text: Sequence[int], encode: Callable[[str], list[int]],
             rng: random.Random, prefix: int) -> RecallExample:  # fmt: skip
    taken: set[str] = set()
    kv = [task.key_value(rng, taken) for _ in range(task.pairs)]
    planted = encode(task.planted(kv))
    gap = distance - len(planted)
    if gap < 0:
        raise LeapQuantError(
            f"recall: distance {distance} is shorter than the {task.name} planted block "
            f"({len(planted)} tokens)"
        )
    need = prefix + gap
    if len(text) <= need:
        raise LeapQuantError(f"recall: the text holds {len(text)} tokens, fewer than the {need + 1} needed")
    start = rng.randrange(len(text) - need)
    context = _ids(text[start : start + prefix]) + planted + _ids(text[start + prefix : start + need])
    asked = kv[:]
    rng.shuffle(asked)
    queries = [(encode(task.query(k)), encode(v)) for k, v in asked]
    return RecallExample(
        context=context,
        prefix=prefix,
        planted_at=prefix,
        distance=distance,
        queries=queries,
        keys=[k for k, _ in asked],
        values=[v for _, v in asked],
    )


def make_examples(
    task: str,
    distance: int,
    count: int,
    text: Sequence[int],
    encode: Callable[[str], list[int]],
    *,
    seed: int = 0,
    prefix: int = 128,
) -> list[RecallExample]:
    """``count`` examples of ``task`` with the planted block ``distance`` tokens before the first query.

    Args:
        task: ``passkey`` or ``mqar`` (see :data:`TASKS`).
        distance: tokens from the planted block's start to the first query's start.
        count: examples; all of them have the same token lengths (they batch without padding).
        text: token ids of ordinary text; each example cuts its own span at a seeded offset.
        encode: ``str -> list[int]`` of the model's tokenizer, without special tokens.
        seed: with ``task``, ``distance`` and the example's index, fixes everything about it.
        prefix: text tokens before the planted block.

    Raises:
        LeapQuantError: unknown task, bad sizes, or too little text.
    """
    if task not in TASKS:
        raise LeapQuantError(f"recall: unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if count < 1 or prefix < 1 or distance < 1:
        raise LeapQuantError(
            f"recall: count, prefix and distance must be >= 1, got {count}, {prefix}, {distance}"
        )
    # a string seed hashes with SHA-512 (random's version 2): the same stream on every machine
    return [
        _example(TASKS[task], distance, text, encode, random.Random(f"{seed}:{task}:{distance}:{i}"), prefix)
        for i in range(count)
    ]


def training_sequence(
    length: int,
    text: Sequence[int],
    encode: Callable[[str], list[int]],
    rng: random.Random,
    *,
    max_distance: int,
    min_distance: int = 16,
    tasks: Sequence[str] = tuple(TASKS),
) -> tuple[list[int], list[bool]]:
    """One training window of exactly ``length`` tokens: recall examples back to back, text between.

    Distances are log-uniform in ``[min_distance, max_distance]`` (a curriculum raises ``max_distance``);
    each example's prefix is a random 1..64 tokens of text. Returns ``(tokens, answer_mask)``.
    """
    tokens: list[int] = []
    mask: list[bool] = []
    while len(tokens) < length:
        task = TASKS[rng.choice(tuple(tasks))]
        sample = task.key_value(random.Random(0), set())
        floor = max(min_distance, len(encode(task.planted([sample] * task.pairs))) + 1)
        hi = max(floor, min(max_distance, length - len(tokens) - 64))
        distance = round(floor * (hi / floor) ** rng.random())
        ex = _example(task, distance, text, encode, rng, prefix=rng.randint(1, 64))
        tokens += ex.tokens()
        mask += ex.answer_mask()
    return tokens[:length], mask[:length]
