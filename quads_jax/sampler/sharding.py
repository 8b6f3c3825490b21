"""Data-parallel rollout: the decode state's rows split over the mesh's batch axes.

Under ``jax.set_mesh`` (the RL loop samples under its trainer mesh) the sampler's jitted
programs constrain every row-major array they carry (the prompts, the KV cache's rows and its
shared prefix's groups, the sampled tokens, log-probs and flags) to be split over the batch
axes (``quads_jax.train.mesh.BATCH_AXES``, those that divide the row count), so each device
decodes its share of the rows. Without it the prompts enter replicated and every device would
decode every row. The model's row-wise work follows by propagation; kernels, whose custom calls
XLA cannot split, take their rows inside a ``shard_map`` (the MoE block's, and the decode
attention's in ``models.layers.decode_attend``). Without a mesh, or with one whose batch axes
are all size 1, every function here returns its input unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from quads_jax.train.mesh import batch_axes_dividing


def row_axes(n_rows: int) -> tuple[str, ...]:
    """The current mesh's batch axes that split ``n_rows`` rows (empty: no split)."""
    return batch_axes_dividing(jax.sharding.get_abstract_mesh(), n_rows)


def constrain_rows(x: jax.Array | None, axis: int = 0, n_rows: int | None = None):
    """``x`` with its ``axis`` (``n_rows`` long: the rows) split over ``row_axes(n_rows)``, the
    other axes replicated; None stays None."""
    if x is None:
        return None
    axes = row_axes(x.shape[axis] if n_rows is None else n_rows)
    if not axes:
        return x
    spec = [None] * x.ndim
    spec[axis] = axes
    return jax.lax.with_sharding_constraint(x, P(*spec))


def constrain_cache(cache):
    """A ``models.KVCache`` with rows (k, v: axis 1; mask, row_group: axis 0) and prefix
    groups (prefix_k, prefix_v: axis 1; prefix_mask: axis 0) split."""
    return dataclasses.replace(
        cache, k=constrain_rows(cache.k, 1), v=constrain_rows(cache.v, 1),
        mask=constrain_rows(cache.mask), row_group=constrain_rows(cache.row_group),
        prefix_k=constrain_rows(cache.prefix_k, 1), prefix_v=constrain_rows(cache.prefix_v, 1),
        prefix_mask=constrain_rows(cache.prefix_mask))


def constrain_state(state):
    """A ``sampler.engine.DecodeState`` with every row-major leaf split (expert ids: axis 1)."""
    return dataclasses.replace(
        state, cache=constrain_cache(state.cache),
        last_token=constrain_rows(state.last_token),
        prompt_length=constrain_rows(state.prompt_length), done=constrain_rows(state.done),
        finish_reason=constrain_rows(state.finish_reason),
        response_length=constrain_rows(state.response_length),
        tokens=constrain_rows(state.tokens), logprobs=constrain_rows(state.logprobs),
        expert_ids=constrain_rows(state.expert_ids, 1),
        prompt_expert_ids=constrain_rows(state.prompt_expert_ids, 1))
