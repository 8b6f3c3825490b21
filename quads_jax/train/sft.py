"""Supervised warm start on task demonstrations, so that RL starts with a non-zero reward.

Each example becomes ``BOS + prompt + demonstration + EOS``, right-padded to one fixed width
(one compiled program); the loss is the token-mean cross-entropy of the demonstration and EOS
tokens under the *trainer* recipe (so QAT arms warm-start through the same fake-quant).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from quads_jax.rl.tasks import Example, prompt_batches
from quads_jax.train.state import TrainState


def encode_demonstrations(
    tokenizer: Any, examples: Sequence[Example], width: int | None = None
) -> dict[str, np.ndarray]:
    """Right-padded SFT arrays.

    Returns:
      ``tokens`` int32 ``[N, W]``, ``attention_mask`` bool ``[N, W]``, ``mask`` f32 ``[N, W]``
      (1 on demonstration and EOS tokens).
    """
    rows, masks = [], []
    for ex in examples:
        if not ex.demonstration:
            raise ValueError(f"example {ex.prompt!r} has no demonstration; SFT needs one")
        prompt = tokenizer.encode(ex.prompt, add_bos=True)
        answer = tokenizer.encode(ex.demonstration, add_eos=True)
        rows.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    w = width or max(len(r) for r in rows)
    if any(len(r) > w for r in rows):
        raise ValueError(f"width={w} is shorter than the longest demonstration row")
    tokens = np.full((len(rows), w), tokenizer.pad_id, np.int32)
    attn = np.zeros((len(rows), w), bool)
    mask = np.zeros((len(rows), w), np.float32)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        tokens[i, : len(r)] = r
        attn[i, : len(r)] = True
        mask[i, : len(r)] = m
    return {"tokens": tokens, "attention_mask": attn, "mask": mask}


def run_sft(
    state: TrainState,
    update: Callable,
    examples: Sequence[Example],
    *,
    tokenizer: Any,
    steps: int,
    batch_size: int,
    seed: int,
    put_batch: Callable[[dict[str, np.ndarray]], Any],
    log: Callable[[int, dict[str, float]], None],
    log_every: int = 10,
) -> TrainState:
    """``steps`` SFT updates of ``state`` on shuffled demonstration batches.

    Args:
      update: the jitted ``make_update_fn(sft_loss_fn(...))`` (one mini-batch per call).
      put_batch: places a ``[1, b, ...]`` numpy batch on the devices (sharded).
      log: called as ``log(step, metrics)`` every ``log_every`` steps and at the end.
    """
    width = max(len(tokenizer.encode(e.prompt)) + len(tokenizer.encode(e.demonstration))
                for e in examples) + 2
    batches = prompt_batches(tuple(examples), batch_size, seed=seed)
    for step, (_, batch) in zip(range(1, steps + 1), itertools.islice(batches, steps),
                                strict=True):
        arrays = encode_demonstrations(tokenizer, batch, width)
        state, metrics = update(state, put_batch({k: v[None] for k, v in arrays.items()}))
        if step % log_every == 0 or step == steps:
            log(step, {k: float(v) for k, v in jax.device_get(metrics).items()})
    return state
