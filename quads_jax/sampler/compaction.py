"""Decode with batch compaction: finished rows leave the batch instead of riding along.

RL responses differ wildly in length; in ``generate`` a finished row still runs through every
decode step until the longest one ends. ``generate_compacting`` decodes in segments of
``segment_steps``; after a segment, when the rows still running fit in half the batch or less,
it gathers them (cache rows included) into a smaller batch (a power of two, so at most
``log2(rows)`` decode programs are compiled) and goes on. Finished rows are written back into
full-size result buffers, and the ``Rollout`` is assembled at the end as ``generate`` does.

All rows share the cache slot index (``KVCache.length``), so moving rows between batches needs
no re-layout. Sampling uses one key per step for the whole batch, so samples differ from
``generate``'s (greedy decoding gives the same tokens); a given rng gives the same rollout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax.config import check
from quads_jax.sampler import engine
from quads_jax.sampler.engine import DecodeState, Rollout, SamplerConfig

# DecodeState fields holding one entry per row, and their row axis.
_ROW_FIELDS = {"last_token": 0, "prompt_length": 0, "done": 0, "finish_reason": 0,
               "response_length": 0, "tokens": 0, "logprobs": 0, "expert_ids": 1,
               "prompt_expert_ids": 1}


@jax.jit
def _gather_rows(state: DecodeState, rows: jax.Array) -> DecodeState:
    """The state restricted to ``rows`` (int32 ``[r]``), cache rows included."""
    cache = state.cache
    cache = dataclasses.replace(cache, k=jnp.take(cache.k, rows, axis=1),
                                v=jnp.take(cache.v, rows, axis=1),
                                mask=jnp.take(cache.mask, rows, axis=0))
    if cache.has_prefix:  # the shared prefix stays; the rows keep their groups
        cache = dataclasses.replace(cache, row_group=jnp.take(cache.row_group, rows, axis=0))
    fields = {f: None if getattr(state, f) is None else jnp.take(getattr(state, f), rows, axis=a)
              for f, a in _ROW_FIELDS.items()}
    return dataclasses.replace(state, cache=cache, **fields)


@jax.jit
def _scatter_rows(full: DecodeState, part: DecodeState, rows: jax.Array) -> DecodeState:
    """``full`` (no cache) with its ``rows`` replaced by every row of ``part``."""
    fields = {}
    for f, axis in _ROW_FIELDS.items():
        dst, src = getattr(full, f), getattr(part, f)
        if dst is None:
            continue
        index = (slice(None),) * axis + (rows,)
        fields[f] = dst.at[index].set(src)
    return dataclasses.replace(full, **fields)


def _bucket(rows: int, minimum: int) -> int:
    """The smallest power of two >= rows (at least ``minimum``)."""
    return max(minimum, 1 << max(rows - 1, 0).bit_length())


def generate_compacting(
    rollout_params,
    prompts,
    rng: jax.Array,
    config: SamplerConfig,
    *,
    model_config,
    recipe=None,
    prompt_mask=None,
    segment_steps: int = 64,
    min_rows: int = 8,
) -> tuple[Rollout, list[int]]:
    """``generate`` with finished rows dropped from the running batch (module docstring).

    Args:
      segment_steps: decode steps between compaction checks (each check reads ``done`` on the
        host).
      min_rows: the batch never shrinks below this many rows.
      (the rest as in ``engine.generate``)

    Returns:
      ``(rollout, rows_per_segment)``: the Rollout of ``B * n_samples`` rows and the batch size
      each decode segment ran with.
    """
    for name, value in (("segment_steps", segment_steps), ("min_rows", min_rows)):
        check("generate_compacting", name, value, isinstance(value, int) and value >= 1,
              "an int >= 1")
    state = engine.prefill(rollout_params, prompts, rng, config, model_config=model_config,
                           recipe=recipe, prompt_mask=prompt_mask)
    # A copy: decode donates (deletes) the buffers of the state it is given.
    full = jax.jit(lambda s: jax.tree.map(jnp.copy, s))(dataclasses.replace(state, cache=None))
    rows = jnp.arange(state.done.shape[0], dtype=jnp.int32)
    sizes = []
    while True:
        sizes.append(int(rows.shape[0]))
        state = engine.decode(rollout_params, state, config, model_config=model_config,
                              recipe=recipe, max_steps=segment_steps)
        done = np.asarray(state.done)
        if done.all() or int(state.step) >= config.max_new_tokens:
            break
        active = np.flatnonzero(~done)
        size = _bucket(active.size, min_rows)
        if size >= rows.shape[0]:
            continue
        full = _scatter_rows(full, state, rows)
        # Fill the bucket with finished rows: they are done, so they only feed masked slots.
        keep = np.concatenate([active, np.flatnonzero(done)[: size - active.size]])
        keep = jnp.asarray(keep, jnp.int32)
        state, rows = _gather_rows(state, keep), rows[keep]
    full = _scatter_rows(full, state, rows)
    full = dataclasses.replace(full, step=state.step)
    if prompt_mask is None:
        prompt_mask = np.ones(np.shape(prompts), bool)
    return engine.finish(full, prompts, config, prompt_mask=prompt_mask), sizes
