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


def row_block_scores(x: jax.Array, r: jax.Array, score: str,
                     row_valid: jax.Array | None = None) -> jax.Array:
    """Per-row block scores ``[M, K/16]`` f32 of activations ``x`` and residual ``r``.

    ``row_valid``: None, or bool ``[M]``: the rows that are tokens. ``online_batch`` scores
    the GEMM's own tokens, so rows that are not (left padding, sequences that finished
    decoding) score 0: every score is >= 0, so they add nothing to the batch's or an expert's
    sum or maximum."""
    if score == "residual_l2":
        scores = jnp.sum(jnp.square(block_view(r)), axis=-1)
    elif score == "residual_l1":
        scores = jnp.sum(jnp.abs(block_view(r)), axis=-1)
    elif score == "act_amax":
        scores = jnp.max(jnp.abs(block_view(x.astype(jnp.float32))), axis=-1)
    else:
        raise ValueError(f"score={score!r}: must be residual_l2, residual_l1 or act_amax")
    return valid_row_scores(scores, row_valid)


def valid_row_scores(scores: jax.Array, row_valid: jax.Array | None) -> jax.Array:
    """``scores [M, K/16]`` with the rows that are not tokens (``row_valid`` False) at 0."""
    if row_valid is None:
        return scores
    return jnp.where(row_valid[:, None], scores, jnp.zeros((), scores.dtype))


def aggregate_scores(
    row_scores: jax.Array, score: str, row_expert: jax.Array | None, num_experts: int | None
) -> jax.Array:
    """Combine per-row scores into one score per block (``[K/16]``) or per expert block
    (``[E, K/16]``): sums for the residual norms, max for ``act_amax``."""
    if row_expert is None:
        return jnp.max(row_scores, 0) if score == "act_amax" else jnp.sum(row_scores, 0)
    if score == "act_amax":
        return jax.ops.segment_max(row_scores, row_expert, num_segments=num_experts)
    return ordered_segment_sum(row_scores, row_expert, num_experts)


def ordered_segment_sum(values: jax.Array, segment_ids: jax.Array,
                        num_segments: int) -> jax.Array:
    """``jax.ops.segment_sum(values, segment_ids, num_segments)`` added in one fixed order on
    every backend: the rows stably sorted by segment, a segmented prefix sum
    (``lax.associative_scan``, elementwise kernels), each segment's last prefix.

    ``segment_sum`` is a scatter-add, which XLA's GPU backend runs with atomics: its float32
    sums come out in any order, two block sums within an ulp rank either way, and RAC's block
    sets change from run to run. On an H100 (2026-12-07, bench_rollout digests) the
    nvfp4_rac rollout gave different tokens in two processes with the same seed; its prefill
    selects with this jnp path, the rollout's one float scatter-add. Measured there
    (scripts/probe_segment_sum.py): ``segment_sum``'s result changed in 8 of 8 repeats at
    65 536 and 262 144 rows, this function's in none; it costs 0.40-0.57 ms a call against
    0.09-0.70 (the rollout's prefill tok/s moved -0.6 %), and three nvfp4_rac processes
    then gave the same prefill state, tokens and log-probs.

    values ``[M, ...]``; segment_ids int ``[M]`` (ids outside ``[0, num_segments)`` are
    dropped, as ``segment_sum`` drops them); returns ``[num_segments, ...]`` in values' dtype,
    0 for empty segments. A non-finite value stays in its own segment's sum."""
    m = segment_ids.shape[0]
    if values.shape[:1] != (m,) or segment_ids.ndim != 1:
        raise ValueError(f"ordered_segment_sum: values {list(values.shape)} and segment_ids "
                         f"{list(segment_ids.shape)} need the same leading length M")
    if m == 0:
        return jnp.zeros((num_segments,) + values.shape[1:], values.dtype)
    order = jnp.argsort(segment_ids, stable=True)
    ids = segment_ids[order]
    rows = values[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])
    flags = starts.reshape((m,) + (1,) * (values.ndim - 1))

    def add_within_segment(a, b):  # (prefix, starts a segment): b's prefix restarts at a start
        (va, fa), (vb, fb) = a, b
        return jnp.where(fb, vb, va + vb), fa | fb

    prefix, _ = jax.lax.associative_scan(add_within_segment, (rows, flags))
    segment = jnp.arange(num_segments, dtype=ids.dtype)
    last = jnp.clip(jnp.searchsorted(ids, segment, side="right") - 1, 0, m - 1)
    present = (ids[last] == segment).reshape((num_segments,) + (1,) * (values.ndim - 1))
    return jnp.where(present, prefix[last], jnp.zeros((), values.dtype))


# Above this many pairwise comparisons (rows x nb x nb) ``select_blocks`` ranks by sorting.
PAIRWISE_RANK_LIMIT = 1 << 24


def stable_descending_rank(scores: jax.Array) -> jax.Array:
    """int32 ``[..., nb]``: each block's position in a stable descending sort of its row (the
    ``argsort(argsort(-scores, stable=True))`` of jnp, NaN last), from pairwise comparisons: one
    fused reduction instead of two sorts, which are separate kernels on a GPU and ran in every
    RAC matmul of a decode step. Elementwise ops (``sorts_before``, which the RAC selection
    kernel ``pallas_kernels.rac_select`` sums chunk by chunk) and one sum."""
    nb = scores.shape[-1]
    idx = jnp.arange(nb)
    return jnp.sum(sorts_before(scores[..., None, :], idx[None, :], scores[..., :, None],
                                idx[:, None]), axis=-1, dtype=jnp.int32)


def sorts_before(score_j, j, score_i, i) -> jax.Array:
    """Whether block ``j`` comes before block ``i`` in a stable descending sort of scores (NaN
    last; equal scores: the lower index first), elementwise over broadcast operands: the
    comparison ``stable_descending_rank`` sums, and the RAC selection kernel sums chunk by
    chunk (``pallas_kernels.rac_select``)."""
    a, b = -score_i, -score_j
    nan_a, nan_b = jnp.isnan(a), jnp.isnan(b)
    before = (b < a) | (nan_a & ~nan_b)  # j sorts strictly before i
    tie = (b == a) | (nan_a & nan_b)
    return before | (tie & (j < i))


def kept_blocks(ratio: float, num_blocks: int) -> int:
    """How many of ``num_blocks`` blocks a selection at ``ratio`` keeps (at most, with an
    energy target): ``max(1, round(ratio * num_blocks))``."""
    return max(1, int(round(ratio * num_blocks)))


def select_blocks(
    scores: jax.Array, ratio: float, energy_target: float | None = None
) -> jax.Array:
    """Boolean mask ``[..., nb]`` of the highest-scoring blocks along the last axis.

    Keeps ``max(1, round(ratio * nb))`` blocks (ties: lower block index first). With
    ``energy_target`` (the adaptive variant) it keeps the fewest top blocks whose summed score
    reaches ``energy_target`` of the total, capped at that count.
    """
    nb = scores.shape[-1]
    n_keep = kept_blocks(ratio, nb)
    small = scores.size * nb <= PAIRWISE_RANK_LIMIT
    if energy_target is None and small:
        return stable_descending_rank(scores) < n_keep
    order = jnp.argsort(-scores, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    keep_sorted = jnp.arange(nb) < n_keep
    if energy_target is not None:
        sorted_scores = jnp.take_along_axis(scores, order, axis=-1)
        before = jnp.cumsum(sorted_scores, axis=-1) - sorted_scores
        total = jnp.sum(scores, axis=-1, keepdims=True)
        keep_sorted = keep_sorted & (before < energy_target * total)
    return jnp.take_along_axis(jnp.broadcast_to(keep_sorted, scores.shape), rank, axis=-1)


def selection_mask(
    scores: jax.Array,
    recipe: QuantRecipe,
    *,
    rows: jax.Array | None = None,
    row_expert: jax.Array | None = None,
    num_experts: int | None = None,
    static_blocks: jax.Array | None = None,
) -> jax.Array:
    """Mask ``[M, K/16]`` of the blocks RAC compensates in each GEMM row, per
    ``recipe.rac_selection``, from the per-row block scores of ``row_block_scores``.

    Args:
      scores: float32 ``[R, K/16]``, one row per distinct activation row.
      rows: None (GEMM row ``i`` is score row ``i``, M = R) or int32 ``[M]``: GEMM row ``i`` is
        score row ``rows[i]`` (a MoE token's k slots share its scores; ``online_token`` then
        ranks each distinct row once).
      row_expert: int32 ``[M]`` expert of each GEMM row for grouped GEMMs (None: dense).
      static_blocks: bool ``[K/16]`` or ``[E, K/16]`` for ``rac_selection="static"``.
    """
    sel = recipe.rac_selection
    m = scores.shape[0] if rows is None else rows.shape[0]
    if sel == "static":
        if static_blocks is None:
            raise ValueError(
                "rac_selection='static' needs calibrated blocks: pass the weight as a "
                "rac.CalibratedWeight with rac_blocks (see rac.calibrate_blocks)"
            )
        if row_expert is not None and static_blocks.ndim == 2:
            return static_blocks[row_expert]
        return jnp.broadcast_to(static_blocks, (m, static_blocks.shape[-1]))
    if sel == "online_token":
        chosen = select_blocks(scores, recipe.rac_ratio, recipe.rac_energy_target)
        return chosen if rows is None else chosen[rows]
    per_row = scores if rows is None else scores[rows]
    agg = aggregate_scores(per_row, recipe.rac_score, row_expert, num_experts)
    chosen = select_blocks(agg, recipe.rac_ratio, recipe.rac_energy_target)
    if row_expert is None:
        return jnp.broadcast_to(chosen, per_row.shape)
    return chosen[row_expert]


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
    # Static selection ignores the scores (a jitted caller never computes them).
    return selection_mask(row_block_scores(x, r, recipe.rac_score), recipe,
                          row_expert=row_expert, num_experts=num_experts,
                          static_blocks=static_blocks)


def masked_residual(r: jax.Array, mask: jax.Array) -> jax.Array:
    """``R`` with the unselected blocks zeroed: ``[M, K]`` f32."""
    return (block_view(r) * mask[..., None].astype(r.dtype)).reshape(r.shape)


def rows_or_fill(a: jax.Array, index: jax.Array, fill) -> jax.Array:
    """``a[index]`` along axis 0, ``fill`` where ``index`` is past the last row (an empty GEMM
    row or tile slot; the W4A4 wrappers' tile slots use it too). A bounds-checked gather that
    XLA fuses into its consumer: concatenating a fill row first was a kernel of its own on the
    H200."""
    return jnp.take(a, index, axis=0, mode="fill", fill_value=fill)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelectedResidual:
    """RAC's quantized residual ``Q(R_S)`` of M GEMM rows, held as what it is made of.

    A GEMM row's ``Q(R_S)`` is its distinct row's residual times each block's code reciprocal,
    rounded to E2M1, times the block's E4M3 scale: the scales and reciprocals are per GEMM row
    and block (``[M, K/16]``, small; zero outside the selection, which masks the block), the
    residual per distinct row. ``codes(index)`` / ``unscaled(index)`` code any set of GEMM rows
    from those in one elementwise pass, so the W4A4 kernels' token tiles are built straight from
    the distinct rows' residual: no ``[M, K]`` masked residual, no separate quantizer pass over
    it and no per-slot scale computation in between (on the H200 those were several XLA kernels
    per RAC GEMM of the decode step). For finite inputs the codes are bit-identical to
    ``nvfp4.quantize_codes(masked_residual(r[rows], mask), ...)`` with the recipe's residual
    scale mode; an unselected block is zero even where ``r`` is not finite.

    Attributes:
      r: float32 ``[R, K]``: ``x - dq(Q(x))`` of the distinct activation rows.
      scales: float8_e4m3fn ``[M, K/16]``: block scales (0 outside the selection); float32
        holding the same E4M3 values in the W4A4 operand path's materialized copy.
      reciprocals: float32 ``[M, K/16]``: ``1 / (s_b * g)`` (0 outside the selection and for
        zero or non-finite blocks), as ``nvfp4.block_scales_from_amax``.
      mask: bool ``[M, K/16]``: the selected blocks of each GEMM row.
      global_scale: float32 ``[M]``: each GEMM row's residual decode scale.
      rows: None (M = R, row ``i`` is ``r``'s row ``i``) or int32 ``[M]``: each GEMM row's
        distinct row.
      amax / finite: None, or float32 / bool ``[M, K/16]``: each GEMM row's residual block
        amax (finite elements) and finiteness before the selection, what ``scales`` and
        ``reciprocals`` are coded from (``nvfp4.block_scales_f32_from_amax`` with
        ``global_scale``, zero outside ``mask``): a kernel that codes them itself
        (``coded_block_amax``) reads these instead, and XLA drops the scales' own pass.
      coded: None, or float32 ``[M, K/16]``: ``code_block_amax`` of the selection, as the
        selection kernel wrote it (``scales``, ``reciprocals`` and ``mask`` are then XLA
        expressions of it that only a consumer other than ``rac_operands`` computes).
      dtype: the logical dtype of the codes (the activations').
    """

    r: jax.Array
    scales: jax.Array
    reciprocals: jax.Array
    mask: jax.Array
    global_scale: jax.Array
    rows: jax.Array | None = None
    amax: jax.Array | None = None
    finite: jax.Array | None = None
    coded: jax.Array | None = None
    dtype: jnp.dtype = dataclasses.field(default=jnp.dtype(jnp.bfloat16), metadata={"static": True})
    # None, or what the selector computed beside the selection for the kernels that consume
    # it (``pallas_kernels.rac_select``: the tile kernels' epilogue scales).
    selector_extra: jax.Array | None = None

    @property
    def has_coded_amax(self) -> bool:
        """Whether ``coded_block_amax`` can give a kernel the coded block amax."""
        return self.coded is not None or self.amax is not None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.mask.shape[0], self.r.shape[-1])

    def _gemm_rows(self, index: jax.Array | None):
        """(scaled residual blocks ``[..., K/16, 16]``, scales, decode scales) of GEMM rows
        ``index`` (all rows when None; M = a zero row with decode scale 1)."""
        if index is None and self.rows is None:
            r, s, rcp, g = self.r, self.scales, self.reciprocals, self.global_scale
        else:
            if index is None:
                index = jnp.arange(self.mask.shape[0], dtype=jnp.int32)
            src = index if self.rows is None else rows_or_fill(
                self.rows, index, self.r.shape[0])
            r = rows_or_fill(self.r, src, 0.0)
            s = rows_or_fill(self.scales, index, 0.0)
            rcp = rows_or_fill(self.reciprocals, index, 0.0)
            g = rows_or_fill(self.global_scale, index, 1.0)
        return block_view(r) * rcp[..., None], s, g

    def codes(self, index: jax.Array | None = None) -> nvfp4.NVFP4Codes:
        """``Q(R_S)`` of GEMM rows ``index`` (int32, any shape ``I``; M = a zero row, for an
        empty tile slot) or of all M rows: codes ``I + [K]``, E4M3 scales ``I + [K/16]``,
        decode scale ``I + [1]`` (1 for a zero row)."""
        y, s, g = self._gemm_rows(index)
        codes = nvfp4.round_to_e2m1_code(y)  # y is 0 (or NaN: code 0) outside the selection
        return nvfp4.NVFP4Codes(codes=codes.reshape(y.shape[:-2] + (-1,)), scales=s,
                                global_scale=g[..., None], dtype=self.dtype)

    def unscaled(self, index: jax.Array | None = None) -> jax.Array:
        """``nvfp4.unscaled_values(self.codes(index))`` (float32 ``e2m1 * s_b``, ``I + [K]``),
        computed without the codes (``nvfp4.round_to_e2m1_value``): what the kernels' operand
        tiles hold, in one elementwise pass."""
        y, s, _ = self._gemm_rows(index)
        vals = nvfp4.round_to_e2m1_value(y) * s.astype(jnp.float32)[..., None]
        return vals.reshape(y.shape[:-2] + (-1,))

    def masked(self) -> jax.Array:
        """``R_S``: float32 ``[M, K]`` residual of each GEMM row, unselected blocks zero."""
        r = self.r if self.rows is None else self.r[self.rows]
        return masked_residual(r, self.mask)


def select_residual(
    x: jax.Array,
    q: nvfp4.NVFP4Codes,
    recipe,
    *,
    act_scale_mode: str,
    rows: jax.Array | None = None,
    row_expert: jax.Array | None = None,
    num_experts: int | None = None,
    static_blocks: jax.Array | None = None,
    selector=None,
    row_valid: jax.Array | None = None,
    row_stats=None,
) -> SelectedResidual:
    """RAC's block selection and residual scales for activations ``x [R, K]`` quantized to
    ``q``: the one construction of ``Q(R_S)`` for the trainer-side reference (``ops``) and the
    kernels' pre-pass (``pallas_kernels.nvfp4_quantize``).

    Args:
      recipe: a ``QuantRecipe`` or anything with its ``rac_*`` fields (``RACConfig``).
      act_scale_mode: the activations' mode; with ``rac_residual_scale="separate"`` the
        residual gets one decode scale per GEMM row, or one for all rows under ``per_batch``;
        ``"shared"`` reuses ``q``'s.
      rows / row_expert / num_experts / static_blocks: as ``selection_mask``.
      row_valid: None, or bool per row of ``x``: as ``row_block_scores``.
      selector: None, or a function ``(scores, amax, finite, row_valid, act_scales) -> (coded,
        g[, extra])`` of the distinct rows' float32 block scores (before the ``row_valid``
        mask), amax and finiteness ``[R, K/16]`` (bool, or the row pass's int8) and their
        activation decode scales ``[R]`` (``q``'s, float32) that computes what the rest of
        this function does, as ``code_block_amax`` of the selection ``[M, K/16]`` and the
        decode scales ``[M]``, in one kernel (``pallas_kernels.rac_select``, for the
        configurations its ``supports`` accepts; it traces this module's and ``nvfp4``'s
        functions). ``extra`` (optional): kept as ``SelectedResidual.selector_extra``.
      row_stats: None, or ``(r, amax, finite, scores[, finite_i8])`` of the distinct rows as
        computed here (``scores`` before the ``row_valid`` mask; ``r`` None: computed here,
        where a consumer needs it): ``pallas_kernels.rac_rows``'s one-kernel row pass
        (``finite_i8``: its int8 finiteness, what a selector reads without a conversion).
    """
    finite_raw = None
    if row_stats is None:
        r = nvfp4.residual(x, q)
        amax, finite = nvfp4.block_amax(block_view(r))  # [R, K/16, 1]
        raw_scores = row_block_scores(x, r, recipe.rac_score)
    else:
        r, amax, finite, raw_scores, *finite_raw = row_stats
        finite_raw = finite_raw[0] if finite_raw else None
        r = nvfp4.residual(x, q) if r is None else r
    if selector is not None:
        coded, g, *extra = selector(
            raw_scores, amax[..., 0], finite[..., 0] if finite_raw is None else finite_raw,
            row_valid, jnp.asarray(q.global_scale, jnp.float32).reshape(-1))
        s, rcp = scales_from_coded_amax(coded, g[:, None])
        return SelectedResidual(r=r, scales=s.astype(jnp.float8_e4m3fn), reciprocals=rcp,
                                mask=~(coded < 0), global_scale=g, rows=rows, coded=coded,
                                dtype=jnp.dtype(x.dtype),
                                selector_extra=extra[0] if extra else None)
    scores = valid_row_scores(raw_scores, row_valid)
    if rows is not None:
        amax, finite = amax[rows], finite[rows]
    mask = selection_mask(scores, recipe, rows=rows, row_expert=row_expert,
                          num_experts=num_experts, static_blocks=static_blocks)
    m = mask.shape[0]
    if recipe.rac_residual_scale == "shared":
        g = jnp.asarray(q.global_scale, jnp.float32).reshape(-1)
        g = jnp.broadcast_to(g, (m,)) if g.size == 1 else (g if rows is None else g[rows])
    else:
        g = residual_decode_scales(mask, amax[..., 0], act_scale_mode)
    s, rcp = nvfp4.block_scales_from_amax(amax, finite, g[:, None, None])
    return SelectedResidual(
        r=r, scales=jnp.where(mask, s, jnp.zeros((), s.dtype)),
        reciprocals=jnp.where(mask, rcp[..., 0], 0.0), mask=mask, global_scale=g, rows=rows,
        amax=amax[..., 0], finite=finite[..., 0], dtype=jnp.dtype(x.dtype))


def residual_decode_scales(mask: jax.Array, amax: jax.Array, act_scale_mode: str) -> jax.Array:
    """float32 ``[M]``: the residual's own decode scale of each GEMM row
    (``rac_residual_scale="separate"``) from its selected blocks' amax (``mask`` / ``amax``
    ``[M, K/16]``), one for all rows under ``per_batch``."""
    sel = jnp.max(jnp.where(mask, amax, 0.0), axis=-1)  # [M]
    if act_scale_mode == "per_batch":
        sel = jnp.broadcast_to(jnp.max(sel), sel.shape)
    return nvfp4.decode_scale_from_amax(sel)


def code_block_amax(mask, amax, finite) -> jax.Array:
    """Elementwise: the amax where the block is selected and finite, NaN where selected and not
    finite, -1 outside the selection (an amax is >= 0): ``coded_block_amax``'s values, which
    the selection kernel also writes (``pallas_kernels.rac_select``)."""
    return jnp.where(mask, jnp.where(finite, amax, jnp.nan), -1.0)


def coded_block_amax(res: SelectedResidual) -> jax.Array:
    """float32 ``[M, K/16]``: ``res``'s block amax with its finiteness and selection folded
    in (``code_block_amax``), for a kernel that codes the block scales itself
    (``pallas_kernels.rac_operands``). ``res.coded`` when a selection kernel wrote it, else
    from ``res.amax`` / ``res.finite``, which must then be set."""
    if res.coded is not None:
        return res.coded
    if res.amax is None or res.finite is None:
        raise ValueError("coded_block_amax: the SelectedResidual has neither coded amax nor "
                         "amax / finite: use its scales and reciprocals")
    return code_block_amax(res.mask, res.amax, res.finite)


def scales_from_coded_amax(a: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(scales, reciprocals)`` float32 of ``coded_block_amax``'s ``a [..., nb]`` with the
    rows' decode scales ``g`` (broadcastable): ``SelectedResidual``'s ``scales`` (as float32
    E4M3 values) and ``reciprocals``, bit for bit. Elementwise only: the operand kernel traces
    it."""
    selected = ~(a < 0)  # NaN (selected, not finite) compares False
    finite = ~jnp.isnan(a)
    s, rcp = nvfp4.block_scales_f32_from_amax(jnp.where(finite, a, 0.0), finite, g)
    return jnp.where(selected, s, 0.0), jnp.where(selected, rcp, 0.0)


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
