"""Verifiable rewards: safe answer parsing, bounded in time and length, never ``eval``.

Every parser here is linear in its (truncated) input: responses are cut to ``max_chars``
before any work, integers longer than ``MAX_INT_DIGITS`` are compared as digit strings (Python's
``int()`` refuses > 4300 digits), and countdown expressions go through a small recursive-descent
parser with a depth limit and bounded intermediate values. Any garbage gives reward 0.

Rewards are looked up by name in :data:`REWARDS`; ``auto`` picks the one matching the task.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Literal

import numpy as np

from quads_jax.config import check, check_choice
from quads_jax.rl.tasks import Example

MAX_INT_DIGITS = 64
MAX_EXPR_DEPTH = 16
MAX_EXPR_ABS = 10**12
_INT_RE = re.compile(r"-?\d+")
_STRICT_INT_RE = re.compile(r"\s*-?\d+\s*")
_EXPR_CHARS_RE = re.compile(r"[\d+\-*/() ]+")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """How responses are scored.

    Attributes:
      name: a key of :data:`REWARDS`, or ``auto`` (the reward of the task in use).
      format_weight: added to the reward when the response is well-formed (0 turns it off).
      max_chars: responses are truncated to this many characters before parsing.
    """

    name: Literal["auto", "exact_int", "countdown"] = "auto"
    format_weight: float = 0.0
    max_chars: int = 1024

    def __post_init__(self) -> None:
        check_choice("RewardConfig", "name", self.name, ("auto", *REWARDS))
        check("RewardConfig", "format_weight", self.format_weight,
              0.0 <= self.format_weight <= 1.0, "a number in [0, 1]")
        check("RewardConfig", "max_chars", self.max_chars, 1 <= self.max_chars <= 1 << 20,
              "an integer in [1, 2**20]")


def _normalise_int(text: str) -> str | None:
    """Canonical digit string of an integer literal, or None when it is too long."""
    neg = text.startswith("-")
    digits = text.lstrip("-").lstrip("0") or "0"
    if len(digits) > MAX_INT_DIGITS:
        return None
    return "-" + digits if neg and digits != "0" else digits


def parse_final_int(text: str, *, max_chars: int = 1024) -> str | None:
    """The last integer literal in ``text`` (canonical digits), or None if there is none."""
    text = text[:max_chars]
    matches = _INT_RE.findall(text)
    return _normalise_int(matches[-1]) if matches else None


def exact_int_reward(response: str, example: Example, max_chars: int) -> tuple[bool, bool]:
    """(correct, well_formed): the final integer equals the answer; the response is one int."""
    response = response[:max_chars]
    got = parse_final_int(response, max_chars=max_chars)
    want = _normalise_int(example.answer.strip()) if _INT_RE.fullmatch(example.answer.strip()) \
        else None
    correct = got is not None and got == want
    return correct, bool(_STRICT_INT_RE.fullmatch(response))


class _ExprParser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := INT | '(' expr ')' | '-' factor.  Exact rational arithmetic, bounded."""

    def __init__(self, text: str):
        self.tokens = re.findall(r"\d+|[+\-*/()]", text)
        self.pos = 0
        self.literals: list[int] = []

    def parse(self) -> Fraction:
        value = self._expr(0)
        if self.pos != len(self.tokens):
            raise ValueError("trailing tokens")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        tok = self._peek()
        if tok is None:
            raise ValueError("unexpected end")
        self.pos += 1
        return tok

    @staticmethod
    def _bounded(value: Fraction) -> Fraction:
        if abs(value) > MAX_EXPR_ABS or value.denominator > MAX_EXPR_ABS:
            raise ValueError("value out of range")
        return value

    def _expr(self, depth: int) -> Fraction:
        value = self._term(depth)
        while self._peek() in ("+", "-"):
            op = self._take()
            rhs = self._term(depth)
            value = self._bounded(value + rhs if op == "+" else value - rhs)
        return value

    def _term(self, depth: int) -> Fraction:
        value = self._factor(depth)
        while self._peek() in ("*", "/"):
            op = self._take()
            rhs = self._factor(depth)
            if op == "/" and rhs == 0:
                raise ValueError("division by zero")
            value = self._bounded(value * rhs if op == "*" else value / rhs)
        return value

    def _factor(self, depth: int) -> Fraction:
        if depth > MAX_EXPR_DEPTH:
            raise ValueError("too deep")
        tok = self._take()
        if tok == "(":
            value = self._expr(depth + 1)
            if self._take() != ")":
                raise ValueError("missing )")
            return value
        if tok == "-":
            return -self._factor(depth + 1)
        if tok.isdigit():
            if len(tok) > 12:
                raise ValueError("literal too long")
            self.literals.append(int(tok))
            return Fraction(int(tok))
        raise ValueError(f"unexpected {tok!r}")


def evaluate_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """Value and integer literals of an arithmetic expression over ``+ - * / ( )``, or None."""
    text = text.strip()
    if not text or not _EXPR_CHARS_RE.fullmatch(text):
        return None
    parser = _ExprParser(text)
    try:
        return parser.parse(), parser.literals
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def countdown_reward(response: str, example: Example, max_chars: int) -> tuple[bool, bool]:
    """(correct, well_formed): the expression reaches the target using offered numbers only."""
    expr = response[:max_chars].strip()
    result = evaluate_expression(expr)
    if result is None:
        return False, False
    value, literals = result
    available = Counter(example.numbers)
    used_ok = not (Counter(literals) - available)
    target = _normalise_int(example.answer.strip())
    correct = used_ok and value.denominator == 1 and str(value.numerator) == target
    return correct, True


RewardFn = Callable[[str, Example, int], tuple[bool, bool]]
REWARDS: dict[str, RewardFn] = {"exact_int": exact_int_reward, "countdown": countdown_reward}
TASK_REWARDS = {"arithmetic": "exact_int", "countdown": "countdown", "jsonl": "exact_int"}


def compute_rewards(
    responses: Sequence[str],
    examples: Sequence[Example],
    config: RewardConfig,
    *,
    task_name: str = "arithmetic",
) -> tuple[np.ndarray, np.ndarray]:
    """Score each response against its example.

    Returns:
      rewards: float32 ``[N]``, ``correct + format_weight * well_formed``.
      correct: bool ``[N]`` (the pass indicator for pass@1).
    """
    if len(responses) != len(examples):
        raise ValueError(
            f"responses has {len(responses)} items but examples has {len(examples)}; "
            "they must match one to one"
        )
    name = TASK_REWARDS.get(task_name, "exact_int") if config.name == "auto" else config.name
    fn = REWARDS[name]
    rewards = np.zeros(len(responses), np.float32)
    correct = np.zeros(len(responses), bool)
    for i, (resp, ex) in enumerate(zip(responses, examples, strict=True)):
        ok, formed = fn(resp, ex, config.max_chars)
        correct[i] = ok
        rewards[i] = float(ok) + config.format_weight * float(formed)
    return rewards, correct
