"""Rollout + scoring (the RL step's first half) and the pass@1 evaluation.

Both run the *rollout* engine (``quads_jax.sampler.generate`` on the synced rollout params with
the rollout recipe): what is evaluated is the policy as it is deployed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from quads_jax.rl.rewards import RewardConfig, compute_rewards
from quads_jax.rl.tasks import Example
from quads_jax.sampler import (
    FINISH_LENGTH,
    Rollout,
    SamplerConfig,
    generate,
    generate_continuous,
    left_pad,
)
from quads_jax.sampler.continuous import batch_row_steps, row_steps


def prompt_width(tokenizer: Any, examples: Sequence[Example]) -> int:
    """The longest BOS + prompt of ``examples``: pad every batch to it, so that the sampler and
    the trainer see one shape per run (no recompilation when a batch's prompts are shorter)."""
    return max(len(tokenizer.encode(ex.prompt, add_bos=True)) for ex in examples)


def encode_prompts(
    tokenizer: Any, examples: Sequence[Example], width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """BOS + prompt ids, left-padded to ``width`` (default: the longest in the batch):
    ``(tokens int32 [B, P], mask bool [B, P])``."""
    rows = [tokenizer.encode(ex.prompt, add_bos=True) for ex in examples]
    tokens, mask = left_pad(rows, tokenizer.pad_id)
    if width is not None:
        if width < tokens.shape[1]:
            raise ValueError(f"width={width} is shorter than the longest prompt "
                             f"({tokens.shape[1]} tokens)")
        extra = width - tokens.shape[1]
        tokens = np.pad(tokens, ((0, 0), (extra, 0)), constant_values=tokenizer.pad_id)
        mask = np.pad(mask, ((0, 0), (extra, 0)), constant_values=False)
    return tokens, mask


def calibration_batch(tokenizer: Any, examples: Sequence[Example], n: int) -> np.ndarray:
    """The static calibration batch (``sampler.calibration.calibrate``): BOS + prompt +
    demonstration of the first ``n`` examples, each cut to the shortest row's length, so every
    token is real (no padding): int32 ``[min(n, len(examples)), T]``."""
    if not examples or n < 1:
        raise ValueError(f"calibration_batch: need n >= 1 and examples, got n={n} and "
                         f"{len(examples)} examples")
    rows = [tokenizer.encode(ex.prompt + ex.demonstration, add_bos=True) for ex in examples[:n]]
    width = min(len(r) for r in rows)
    return np.asarray([r[:width] for r in rows], np.int32)


def decode_responses(tokenizer: Any, rollout: Rollout) -> list[str]:
    """The response text of every row (special tokens such as EOS dropped)."""
    tokens = np.asarray(rollout.tokens)[:, rollout.prompt_length:]
    mask = np.asarray(rollout.response_mask)[:, rollout.prompt_length:]
    return [tokenizer.decode(t[m]) for t, m in zip(tokens, mask, strict=True)]


@dataclasses.dataclass
class ScoredRollout:
    """A rollout with its decoded responses and rewards.

    Attributes:
      rollout: the sampler's output, ``R = len(examples) * n_samples`` rows.
      examples: the example of every row (repeated n_samples times).
      responses: decoded response text per row.
      rewards: f32 ``[R]``; correct: bool ``[R]``; truncated: bool ``[R]``.
      seconds: wall time of ``generate`` (blocked until ready).
      new_tokens: response tokens generated.
      row_steps: decode rows x decode steps run (with continuous batching: summed over its
        segments; else the batch x its longest response); ``new_tokens / row_steps`` is the
        share of the decode batch that did useful work.
    """

    rollout: Rollout
    examples: list[Example]
    responses: list[str]
    rewards: np.ndarray
    correct: np.ndarray
    truncated: np.ndarray
    seconds: float
    new_tokens: int
    row_steps: int


def rollout_and_score(
    rollout_params: Any,
    examples: Sequence[Example],
    rng: jax.Array,
    *,
    tokenizer: Any,
    model_config: Any,
    recipe: Any,
    sampler_config: SamplerConfig,
    reward_config: RewardConfig,
    task_name: str,
    width: int | None = None,
    decode_rows: int = 0,
    segment_steps: int = 32,
) -> ScoredRollout:
    """Sample ``sampler_config.n_samples`` responses per example and score them (prompts
    left-padded to ``width`` when given). ``decode_rows`` > 0: continuous batching on that
    many rows, refilled every ``segment_steps`` (``RolloutSection``); 0: one batch."""
    prompts, prompt_mask = encode_prompts(tokenizer, examples, width)
    start = time.perf_counter()
    segments = None
    if decode_rows:
        rollout, segments = generate_continuous(
            rollout_params, prompts, rng, sampler_config, model_config=model_config,
            recipe=recipe, prompt_mask=prompt_mask, batch_rows=decode_rows,
            segment_steps=segment_steps)
    else:
        rollout = generate(rollout_params, prompts, rng, sampler_config,
                           model_config=model_config, recipe=recipe, prompt_mask=prompt_mask)
    rollout = jax.block_until_ready(rollout)
    seconds = time.perf_counter() - start
    lengths = np.asarray(rollout.response_length)
    rows = [ex for ex in examples for _ in range(sampler_config.n_samples)]
    responses = decode_responses(tokenizer, rollout)
    rewards, correct = compute_rewards(responses, rows, reward_config, task_name=task_name)
    return ScoredRollout(
        rollout=rollout,
        examples=rows,
        responses=responses,
        rewards=rewards,
        correct=correct,
        truncated=np.asarray(rollout.finish_reason) == FINISH_LENGTH,
        seconds=seconds,
        new_tokens=int(lengths.sum()),
        row_steps=batch_row_steps(lengths) if segments is None else row_steps(segments),
    )


def evaluate_pass_at_1(
    rollout_params: Any,
    examples: Sequence[Example],
    rng: jax.Array,
    *,
    k: int,
    temperature: float,
    base: SamplerConfig,
    **kwargs: Any,
) -> dict[str, float]:
    """pass@1 averaged over ``k`` samples per held-out prompt, plus reward and greedy pass.

    Returns ``eval/pass@1`` (mean correctness of all ``len(examples) * k`` samples),
    ``eval/reward`` and ``eval/response_len``.
    """
    cfg = dataclasses.replace(base, n_samples=k, temperature=temperature, greedy=False)
    scored = rollout_and_score(rollout_params, examples, rng, sampler_config=cfg, **kwargs)
    return {
        "eval/pass@1": float(scored.correct.mean()),
        "eval/reward": float(scored.rewards.mean()),
        "eval/response_len": float(np.asarray(scored.rollout.response_length).mean()),
    }
