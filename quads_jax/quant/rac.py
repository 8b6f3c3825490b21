"""Residual Activation Compensation (RAC), the jnp reference (QUADS_SPEC section 4).

For a W4A4 GEMM ``y0 = Q(x) @ Q(W)^T`` the activation residual ``R = x - dq(Q(x))`` is scored
per 16-channel K-block; the chosen blocks ``S`` are quantized again and multiplied with the
*same* weight codes: ``y = y0 + Q(R_S) @ Q(W)[:, S]^T``.

The reference writes the selection as a boolean block mask ``[M, K/16]`` per row and zeroes the
residual outside ``S``: quantizing the zero-padded residual gives the same codes, block scales
and (per-token or per-batch) global scale as quantizing the gathered ``R[:, S]``, and zero
blocks add nothing, so ``Q(R_masked) @ Q(W)^T`` equals ``Q(R_S) @ Q(W)[:, S]^T`` up to f32
summation order. Kernels may gather (``X_aug = [Q(x) | Q(R_S)]``) instead.

Selection modes: ``online_batch`` (one block set per GEMM, per expert for grouped GEMMs, from
the GEMM's own rows), ``online_token`` (each row its own set), ``static`` (calibrated set, from
``calibrate_blocks`` at weight sync, stored with the weight in a ``CalibratedWeight``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from quads_jax.quant import nvfp4
from quads_jax.quant.recipe import QuantRecipe

BLOCK = nvfp4.BLOCK_SIZE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CalibratedWeight:
    """A weight leaf plus what static calibration chose for it (built by the weight sync).

    Attributes:
      weight: the master array or packed ``NVFP4Tensor`` ``[..., N, K]``.
      rac_blocks: bool ``[..., K/16]`` (``[E, K/16]`` for stacked experts): the static RAC
        block set, or None.
      act_global_scale: float32 activation decode scale for ``act_scale_mode="static"``:
        ``[]`` for a dense weight, ``[E]`` for stacked experts (leading layer axes allowed).
    """

    weight: object
    rac_blocks: jax.Array | None = None
    act_global_scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)


def block_view(x: jax.Array) -> jax.Array:
    """``[M, K]`` -> ``[M, K/16, 16]``."""
    return x.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK, BLOCK))


def row_block_scores(x: jax.Array, r: jax.Array, score: str) -> jax.Array:
    """Per-row block scores ``[M, K/16]`` f32 of activations ``x`` and residual ``r``."""
    if score == "residual_l2":
        return jnp.sum(jnp.square(block_view(r)), axis=-1)
    if score == "residual_l1":
        return jnp.sum(jnp.abs(block_view(r)), axis=-1)
    if score == "act_amax":
        return jnp.max(jnp.abs(block_view(x.astype(jnp.float32))), axis=-1)
    raise ValueError(f"score={score!r}: must be residual_l2, residual_l1 or act_amax")


def aggregate_scores(
    row_scores: jax.Array, score: str, row_expert: jax.Array | None, num_experts: int | None
) -> jax.Array:
    """Combine per-row scores into one score per block (``[K/16]``) or per expert block
    (``[E, K/16]``): sums for the residual norms, max for ``act_amax``."""
    if row_expert is None:
        return jnp.max(row_scores, 0) if score == "act_amax" else jnp.sum(row_scores, 0)
    if score == "act_amax":
        return jax.ops.segment_max(row_scores, row_expert, num_segments=num_experts)
    return jax.ops.segment_sum(row_scores, row_expert, num_segments=num_experts)


# Above this many pairwise comparisons (rows x nb x nb) ``select_blocks`` ranks by sorting.
PAIRWISE_RANK_LIMIT = 1 << 24


def _stable_descending_rank(scores: jax.Array) -> jax.Array:
    """int32 ``[..., nb]``: each block's position in a stable descending sort of its row (the
    ``argsort(argsort(-scores, stable=True))`` of jnp, NaN last), from pairwise comparisons: one
    fused reduction instead of two sorts, which are separate kernels on a GPU and ran in every
    RAC matmul of a decode step."""
    key = -scores
    a, b = key[..., :, None], key[..., None, :]  # a: block i, b: block j
    nan_a, nan_b = jnp.isnan(a), jnp.isnan(b)
    before = (b < a) | (nan_a & ~nan_b)  # j sorts strictly before i
    tie = (b == a) | (nan_a & nan_b)
    nb = scores.shape[-1]
    earlier = jnp.arange(nb)[None, :] < jnp.arange(nb)[:, None]  # j < i
    return jnp.sum(before | (tie & earlier), axis=-1, dtype=jnp.int32)


def select_blocks(
    scores: jax.Array, ratio: float, energy_target: float | None = None
) -> jax.Array:
    """Boolean mask ``[..., nb]`` of the highest-scoring blocks along the last axis.

    Keeps ``max(1, round(ratio * nb))`` blocks (ties: lower block index first). With
    ``energy_target`` (the adaptive variant) it keeps the fewest top blocks whose summed score
    reaches ``energy_target`` of the total, capped at that count.
    """
    nb = scores.shape[-1]
    n_keep = max(1, int(round(ratio * nb)))
    small = scores.size * nb <= PAIRWISE_RANK_LIMIT
    if energy_target is None and small:
        return _stable_descending_rank(scores) < n_keep
    order = jnp.argsort(-scores, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    keep_sorted = jnp.arange(nb) < n_keep
    if energy_target is not None:
        sorted_scores = jnp.take_along_axis(scores, order, axis=-1)
        before = jnp.cumsum(sorted_scores, axis=-1) - sorted_scores
        total = jnp.sum(scores, axis=-1, keepdims=True)
        keep_sorted = keep_sorted & (before < energy_target * total)
    return jnp.take_along_axis(jnp.broadcast_to(keep_sorted, scores.shape), rank, axis=-1)


def block_mask(
    x: jax.Array,
    r: jax.Array,
    recipe: QuantRecipe,
    *,
    row_expert: jax.Array | None = None,
    num_experts: int | None = None,
    static_blocks: jax.Array | None = None,
) -> jax.Array:
    """Per-row mask ``[M, K/16]`` of the blocks RAC compensates, per ``recipe.rac_selection``.

    Args:
      x: activations ``[M, K]``; r: their residual ``[M, K]`` f32.
      row_expert: int32 ``[M]`` expert of each row for grouped GEMMs (None: dense).
      static_blocks: bool ``[K/16]`` or ``[E, K/16]`` for ``rac_selection="static"``.
    """
    sel = recipe.rac_selection
    if sel == "static":
        if static_blocks is None:
            raise ValueError(
                "rac_selection='static' needs calibrated blocks: pass the weight as a "
                "rac.CalibratedWeight with rac_blocks (see rac.calibrate_blocks)"
            )
        if row_expert is not None and static_blocks.ndim == 2:
            return static_blocks[row_expert]
        return jnp.broadcast_to(static_blocks, (x.shape[0], static_blocks.shape[-1]))
    scores = row_block_scores(x, r, recipe.rac_score)
    if sel == "online_token":
        return select_blocks(scores, recipe.rac_ratio, recipe.rac_energy_target)
    agg = aggregate_scores(scores, recipe.rac_score, row_expert, num_experts)
    chosen = select_blocks(agg, recipe.rac_ratio, recipe.rac_energy_target)
    if row_expert is None:
        return jnp.broadcast_to(chosen, scores.shape)
    return chosen[row_expert]


def masked_residual(r: jax.Array, mask: jax.Array) -> jax.Array:
    """``R`` with the unselected blocks zeroed: ``[M, K]`` f32."""
    return (block_view(r) * mask[..., None].astype(r.dtype)).reshape(r.shape)


def captured_energy(r: jax.Array, mask: jax.Array) -> jax.Array:
    """Diagnostic ``|R_S|^2 / |R|^2`` (1 where R is 0), scalar f32."""
    total = jnp.sum(jnp.square(r))
    kept = jnp.sum(jnp.square(masked_residual(r, mask)))
    return jnp.where(total > 0, kept / jnp.where(total > 0, total, 1.0), 1.0)


def calibrate_blocks(
    x_calib: jax.Array,
    recipe: QuantRecipe,
    *,
    row_expert: jax.Array | None = None,
    num_experts: int | None = None,
) -> jax.Array:
    """Static RAC calibration: the block set of each weight from a calibration batch.

    Scores the calibration activations ``x_calib [M, K]`` (grouped: rows routed to
    ``row_expert [M]``) exactly like ``online_batch`` and returns bool ``[K/16]`` (dense) or
    ``[E, K/16]`` (experts), to be stored in ``CalibratedWeight.rac_blocks``.
    """
    from quads_jax.quant.ops import act_quantize  # ops imports this module

    x2 = x_calib.reshape(-1, x_calib.shape[-1])
    qx = act_quantize(x2, recipe)
    r = nvfp4.residual(x2, qx)
    scores = row_block_scores(x2, r, recipe.rac_score)
    agg = aggregate_scores(scores, recipe.rac_score, row_expert, num_experts)
    return select_blocks(agg, recipe.rac_ratio, recipe.rac_energy_target)


def calibrate_act_scale(
    x_calib: jax.Array, *, row_expert: jax.Array | None = None, num_experts: int | None = None
) -> jax.Array:
    """Static activation global decode scale from a calibration batch: ``[]`` or ``[E]``."""
    a = jnp.max(jnp.abs(x_calib.astype(jnp.float32)), axis=-1)
    amax = jnp.max(a) if row_expert is None else jax.ops.segment_max(a, row_expert, num_experts)
    return nvfp4.decode_scale_from_amax(jnp.maximum(amax, 0.0))
