"""Verifiable tasks generated from a seed, with train and held-out splits.

A task yields :class:`Example` records: a ``prompt`` the policy continues, the ``answer`` the
reward checks, and a ``demonstration`` (a correct completion) for the supervised warm start.
Tasks are looked up by name in :data:`TASKS`, so an experiment picks one in its config:

* ``arithmetic``: ``"417+85="`` -> ``"502"``; multi-digit ``+ - *`` with carries/borrows, digit
  counts from ``min_digits`` to ``max_digits``.
* ``countdown``: ``"7 3 25 2>31:"`` -> an expression over the given numbers, each used at most
  once, that evaluates to the target (checked by a safe parser, never ``eval``).
* ``jsonl``: a user's file, one ``{"prompt": ..., "answer": ...}`` object per line.

Splits are disjoint by construction: every generated prompt is hashed, and the held-out split
is drawn first and removed from the training pool.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Callable, Iterator
from typing import Literal

from quads_jax.config import check, check_choice

ARITH_OPS = ("+", "-", "*")


@dataclasses.dataclass(frozen=True)
class Example:
    """One task instance.

    Attributes:
      prompt: text the policy continues (no chat template; the char tokenizer reads it as is).
      answer: the reference the reward checks (an integer as text for both built-in tasks).
      demonstration: a correct completion of ``prompt`` for SFT ("" when none is known).
      numbers: countdown only: the numbers the expression may use.
    """

    prompt: str
    answer: str
    demonstration: str = ""
    numbers: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Which task, its difficulty and the split sizes.

    Attributes:
      name: a key of :data:`TASKS`.
      seed: seeds the generator; the same seed gives the same splits.
      num_train / num_eval: sizes of the training pool and of the held-out split.
      min_digits / max_digits: arithmetic operand lengths (difficulty knob).
      ops: arithmetic operators to draw from, a subset of ``+ - *``.
      countdown_numbers: how many numbers a countdown instance offers.
      countdown_max_number: the largest number offered.
      path: jsonl only: the file to read; ``eval_fraction`` of it is held out.
      eval_fraction: jsonl only: held-out fraction in (0, 1).
    """

    name: Literal["arithmetic", "countdown", "jsonl"] = "arithmetic"
    seed: int = 0
    num_train: int = 2000
    num_eval: int = 64
    min_digits: int = 1
    max_digits: int = 2
    ops: tuple[str, ...] = ("+",)
    countdown_numbers: int = 3
    countdown_max_number: int = 10
    path: str = ""
    eval_fraction: float = 0.1

    def __post_init__(self) -> None:
        own = "TaskConfig"
        check_choice(own, "name", self.name, tuple(TASKS))
        check(own, "num_train", self.num_train, self.num_train >= 1, "an integer >= 1")
        check(own, "num_eval", self.num_eval, self.num_eval >= 1, "an integer >= 1")
        check(own, "min_digits", self.min_digits, 1 <= self.min_digits <= 18, "1..18")
        check(
            own, "max_digits", self.max_digits,
            self.min_digits <= self.max_digits <= 18, f"{self.min_digits}..18 (>= min_digits)",
        )
        check(
            own, "ops", self.ops, len(self.ops) > 0 and set(self.ops) <= set(ARITH_OPS),
            f"a non-empty subset of {list(ARITH_OPS)}",
        )
        check(own, "countdown_numbers", self.countdown_numbers, 2 <= self.countdown_numbers <= 6,
              "2..6")
        check(own, "countdown_max_number", self.countdown_max_number,
              2 <= self.countdown_max_number <= 1000, "2..1000")
        check(own, "eval_fraction", self.eval_fraction, 0.0 < self.eval_fraction < 1.0,
              "a number in (0, 1)")
        check(own, "path", self.path, self.name != "jsonl" or bool(self.path),
              "a JSONL file path when name is 'jsonl'")


@dataclasses.dataclass(frozen=True)
class TaskSplits:
    """The training pool and the held-out split of one task."""

    train: tuple[Example, ...]
    eval: tuple[Example, ...]


def _operand(rng: random.Random, config: TaskConfig) -> int:
    digits = rng.randint(config.min_digits, config.max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def arithmetic_example(rng: random.Random, config: TaskConfig) -> Example:
    """``a op b =`` with the exact integer result as answer and demonstration."""
    a, b = _operand(rng, config), _operand(rng, config)
    op = rng.choice(config.ops)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return Example(prompt=f"{a}{op}{b}=", answer=str(value), demonstration=str(value))


def countdown_example(rng: random.Random, config: TaskConfig) -> Example:
    """Numbers and a target reachable by construction; the construction is the demonstration."""
    numbers = [rng.randint(1, config.countdown_max_number) for _ in range(config.countdown_numbers)]
    used = rng.randint(2, len(numbers))
    order = rng.sample(range(len(numbers)), used)
    expr, value = str(numbers[order[0]]), numbers[order[0]]
    for i in order[1:]:
        op = rng.choice(("+", "-", "*"))
        n = numbers[i]
        # Parenthesise the running expression so that left-to-right construction is what the
        # standard precedence parser in rewards.py evaluates.
        expr = f"({expr}){op}{n}" if op == "*" and any(c in expr for c in "+-") else f"{expr}{op}{n}"
        value = value + n if op == "+" else value - n if op == "-" else value * n
    prompt = " ".join(str(n) for n in numbers) + f">{value}:"
    return Example(prompt=prompt, answer=str(value), demonstration=expr, numbers=tuple(numbers))


def _generated_splits(make: Callable[[random.Random, TaskConfig], Example]):
    def build(config: TaskConfig) -> TaskSplits:
        rng = random.Random(config.seed)
        held_out: dict[str, Example] = {}
        tries = 0
        # Held-out first: it must be unique and stays fixed when num_train changes.
        while len(held_out) < config.num_eval and tries < 100 * config.num_eval:
            ex = make(rng, config)
            held_out.setdefault(ex.prompt, ex)
            tries += 1
        train: list[Example] = []
        tries = 0
        while len(train) < config.num_train and tries < 100 * config.num_train:
            ex = make(rng, config)
            tries += 1
            if ex.prompt not in held_out:
                train.append(ex)
        if len(held_out) < config.num_eval or not train:
            raise ValueError(
                f"TaskConfig too small a problem space for num_eval={config.num_eval}: "
                f"only {len(held_out)} distinct prompts; raise max_digits or lower num_eval"
            )
        return TaskSplits(train=tuple(train), eval=tuple(held_out.values()))

    return build


def load_jsonl(path: str | os.PathLike) -> list[Example]:
    """Read ``{"prompt": str, "answer": str|int, "demonstration"?: str}`` lines."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{os.fspath(path)}:{lineno}: not JSON ({err.msg})") from None
            if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
                raise ValueError(
                    f"{os.fspath(path)}:{lineno}: expected an object with 'prompt' and 'answer'"
                )
            out.append(
                Example(
                    prompt=str(row["prompt"]),
                    answer=str(row["answer"]),
                    demonstration=str(row.get("demonstration", row["answer"])),
                )
            )
    if not out:
        raise ValueError(f"{os.fspath(path)}: no examples")
    return out


def _jsonl_splits(config: TaskConfig) -> TaskSplits:
    examples = load_jsonl(config.path)
    random.Random(config.seed).shuffle(examples)
    n_eval = max(1, min(len(examples) - 1, round(config.eval_fraction * len(examples))))
    if len(examples) < 2:
        raise ValueError(f"TaskConfig.path={config.path!r}: needs >= 2 examples for two splits")
    return TaskSplits(train=tuple(examples[n_eval:]), eval=tuple(examples[:n_eval]))


TASKS: dict[str, Callable[[TaskConfig], TaskSplits]] = {
    "arithmetic": _generated_splits(arithmetic_example),
    "countdown": _generated_splits(countdown_example),
    "jsonl": _jsonl_splits,
}


def make_task(config: TaskConfig) -> TaskSplits:
    """Build the splits of the task named in ``config``."""
    return TASKS[config.name](config)


def prompt_batches(
    examples: tuple[Example, ...], batch_size: int, *, seed: int, start: int = 0
) -> Iterator[tuple[int, list[Example]]]:
    """Endless epochs of shuffled prompt batches, resumable from a data position.

    Yields ``(position, batch)`` where ``position`` counts batches since the start; pass the
    next position as ``start`` to resume exactly (the shuffle of epoch e is seeded by seed + e).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is invalid; allowed: an integer >= 1")
    per_epoch = max(1, len(examples) // batch_size)
    position = start
    while True:
        epoch, offset = divmod(position, per_epoch)
        order = list(range(len(examples)))
        random.Random(seed + epoch).shuffle(order)
        if len(order) < batch_size:  # a tiny pool: repeat it to fill the batch
            order = (order * (batch_size // len(order) + 1))[:batch_size]
        idx = order[offset * batch_size : (offset + 1) * batch_size]
        yield position, [examples[i] for i in idx]
        position += 1
