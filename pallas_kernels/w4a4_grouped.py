"""Grouped (MoE) NVFP4 W4A4 matmul on tokens sorted by expert, a drop-in for a grouped linear.

``w4a4_grouped_matmul(x_sorted [M, K], w [E, N, K], group_sizes [E])``: rows
``[start_e, start_e + group_sizes[e])`` multiply expert ``e``. The rows of each expert are cut
into token tiles of ``block_m`` (megablox-style metadata built in jnp: at most
``M // block_m + E`` tiles, the real count read by the kernel at run time), gathered into a
tile array, multiplied by the shared tile kernel with a per-tile expert index, and scattered
back. Experts without tokens cost nothing but a skipped work item: their weights are not read.
Rows past ``sum(group_sizes)`` come out as zeros (as ``jax.lax.ragged_dot``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import nvfp4_quantize as aq
from pallas_kernels import rac_select
from pallas_kernels.nvfp4_tiles_mgpu import ROW_ALIGN
from pallas_kernels.tile_plan import (
    TilePlanConfig,
    num_tiles_bound,
    tile_plan_kernel,
    window_len,
)
from pallas_kernels.w4a4_matmul import (
    W4A4MatmulConfig,
    _check,
    act_operand_rows,
    as_kernel_weights,
    operand_rows,
    run_tiles,
    tile_block_bits,
    token_tiles,
)
from quads_jax.quant import nvfp4, ops
from quads_jax.quant.rac import SelectedResidual


def grouped_block_m(m: int, num_experts: int) -> int:
    """Tokens per tile: twice the average group size, as a power of two in [8, 64], so that
    most groups fit one tile (a group split over two tiles reads its expert's weight twice)."""
    avg = max(1, -(-m // num_experts))
    return int(min(64, max(8, 1 << (2 * avg - 1).bit_length())))


def _check_group_sizes(group_sizes, num_experts: int, m: int) -> jax.Array:
    gs = jnp.asarray(group_sizes)
    if gs.shape != (num_experts,) or not jnp.issubdtype(gs.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes: shape {tuple(gs.shape)} dtype {gs.dtype}; need int [{num_experts}]"
        )
    if not isinstance(gs, jax.core.Tracer):  # concrete: check now (traced sizes cannot raise)
        host = np.asarray(gs)
        if host.sum() > m or (host < 0).any():
            raise ValueError(
                f"group_sizes: sum {host.sum()} (min {host.min()}) must be >= 0 per group and "
                f"<= M={m} rows of x_sorted"
            )
    return gs.astype(jnp.int32)


def row_experts(group_sizes: jax.Array, m: int) -> jax.Array:
    """int32 ``[M]`` expert of each sorted row (E for rows past the last group)."""
    return ops.count_le(jnp.cumsum(group_sizes), jnp.arange(m, dtype=jnp.int32))


def _aligned_starts(group_sizes: jax.Array, align: int):
    """int32 ``[E]`` each group's first sorted row, and its first and past-the-end laid-out
    rows when every group starts at a multiple of ``align``."""
    starts = jnp.cumsum(group_sizes) - group_sizes
    padded = -(-group_sizes // align) * align
    padded_ends = jnp.cumsum(padded)
    return starts, padded_ends - padded, padded_ends


def window_of_rows(group_sizes: jax.Array, row_expert: jax.Array, windows: int) -> jax.Array:
    """int32 ``[M]``: each sorted row's row in ``aligned_group_rows``' layout (``ROW_ALIGN``),
    ``windows`` for rows past the groups (``row_expert`` = E, ``row_experts``' value): the
    inverse of the plan's ``window_rows``, by arithmetic. (A scatter of ``arange(P)`` through
    ``window_rows`` was two XLA kernels, its fill and the scatter, ~2.5 us on the H100.)"""
    e = group_sizes.shape[0]
    starts, padded_starts, _ = _aligned_starts(group_sizes, ROW_ALIGN)
    g = jnp.minimum(row_expert, e - 1)
    pos = padded_starts[g] + jnp.arange(row_expert.shape[0], dtype=jnp.int32) - starts[g]
    return jnp.where(row_expert < e, pos, windows).astype(jnp.int32)


def aligned_group_rows(group_sizes: jax.Array, m: int, align: int, length: int):
    """The groups' rows laid out in order, each group starting at a multiple of ``align``
    rows: ``(rows, padded_starts, padded_ends)``; ``rows`` int32 ``[length]`` is the sorted row
    at each laid-out row (``m`` for padding and past the groups), ``padded_starts`` /
    ``padded_ends`` int32 ``[E]`` each group's laid-out range."""
    e = group_sizes.shape[0]
    starts, padded_starts, padded_ends = _aligned_starts(group_sizes, align)
    p = jnp.arange(length, dtype=jnp.int32)
    pe = jnp.minimum(ops.count_le(padded_ends, p), e - 1)
    p_local = p - padded_starts[pe]
    rows = jnp.where((p < padded_ends[-1]) & (p_local < group_sizes[pe]), starts[pe] + p_local,
                     m)
    return rows, padded_starts, padded_ends


def tile_plan(group_sizes: jax.Array, m: int, block_m: int,
              kernel: TilePlanConfig | None = None, interpret: bool = False):
    """Token-tile metadata for sorted rows.

    Returns ``(row_index [T, block_m], tile_expert [T], num_tiles [1], row_slot [M], row0 [T],
    window_rows [P])``: ``row_index`` is the GEMM row of each tile slot (``m`` = empty),
    ``row_slot`` the flat slot ``t * block_m + r`` of each GEMM row (``T * block_m`` for rows
    past the groups). The kernels read tile ``t`` as the window of rows ``[row0[t], row0[t] +
    block_m)`` of an operand laid out as ``window_rows`` (the GEMM row at each of its ``P``
    rows, ``m`` = a zero row; ``token_tiles.TokenTiles``): the groups in order, each starting
    at a multiple of ``ROW_ALIGN`` (Mosaic GPU copies whole 8-row tiles), so ``P`` is
    ``tile_plan.window_len`` (``m + (ROW_ALIGN - 1) * min(E, m) + block_m``, rounded up)
    bounds every window; a window's slots past its group hold padding or the next group's rows
    (empty slots). ``row0`` is 0 past the live tiles. ``kernel``: a
    ``pallas_kernels.tile_plan.TilePlanConfig`` computes the same arrays in one Pallas kernel
    (``interpret``: in the Triton interpreter); None: jnp.
    """
    return plan_and_row_experts(group_sizes, m, block_m, kernel, interpret)[:6]


def plan_and_row_experts(group_sizes: jax.Array, m: int, block_m: int,
                         kernel: TilePlanConfig | None = None, interpret: bool = False):
    """``tile_plan``'s six arrays and ``row_experts(group_sizes, m)`` (int32 ``[M]``)."""
    if kernel is not None:
        return tile_plan_kernel(group_sizes, m, block_m, config=kernel, interpret=interpret)
    e = group_sizes.shape[0]
    t_max = num_tiles_bound(m, e, block_m)
    starts = jnp.cumsum(group_sizes) - group_sizes
    tiles = -(-group_sizes // block_m)
    tile_ends = jnp.cumsum(tiles)
    tile_starts = tile_ends - tiles
    t = jnp.arange(t_max, dtype=jnp.int32)
    te = jnp.minimum(ops.count_le(tile_ends, t), e - 1)
    first = starts[te] + (t - tile_starts[te]) * block_m
    rows = first[:, None] + jnp.arange(block_m, dtype=jnp.int32)[None, :]
    live_tile = t < tile_ends[-1]
    live = live_tile[:, None] & (rows < (starts + group_sizes)[te][:, None])
    row_index = jnp.where(live, rows, m)
    rexp = row_experts(group_sizes, m)
    valid = rexp < e
    re = jnp.minimum(rexp, e - 1)
    local = jnp.arange(m, dtype=jnp.int32) - starts[re]
    slot = (tile_starts[re] + local // block_m) * block_m + local % block_m
    row_slot = jnp.where(valid, slot, t_max * block_m)
    # The aligned layout: group g at padded_starts[g], its rows in order, then zero rows.
    window_rows, padded_starts, _ = aligned_group_rows(group_sizes, m, ROW_ALIGN,
                                                       window_len(m, e, block_m))
    row0 = jnp.where(live_tile, padded_starts[te] + (t - tile_starts[te]) * block_m, 0)
    return (row_index, te, tile_ends[-1:].astype(jnp.int32), row_slot, row0.astype(jnp.int32),
            window_rows, rexp)


def expected_tiles(m: int, num_experts: int, block_m: int) -> int:
    """The token tiles a balanced routing of ``m`` rows fills (static, for the split-K choice):
    one per expert that can get a row, or the rows' own count if larger, at most
    ``tile_plan``'s ``T``. Planning with ``T`` itself (the worst case) took split-K on the
    decode step's gate_up (1 024 rows over 128 experts: ~130 live tiles of T = 192), which made
    the kernel store float32 partial sums for an extra pass to add."""
    return min(num_tiles_bound(m, num_experts, block_m),
               max(min(num_experts, m), -(-m // block_m)))


def _static_rows(scale, rexp: jax.Array, e: int):
    """A calibrated activation scale ``[]`` or per expert ``[E]`` as a per-row array."""
    if scale is None or jnp.ndim(scale) == 0:
        return scale
    return jnp.asarray(scale, jnp.float32).reshape(e)[jnp.minimum(rexp, e - 1)]


def _grouped_acts(x, rexp, e, act_scale_mode, rac, rac_blocks, act_global_scale,
                  source_rows=None, selector=None, row_valid=None, row_pass=None):
    """Quantized activations of sorted rows; RAC's online_batch selection is per expert (over
    the rows that are tokens, with ``row_valid``)."""
    return aq.nvfp4_quantize(
        x, act_scale_mode=act_scale_mode, rac_config=rac,
        row_expert=jnp.minimum(rexp, e - 1), num_experts=e, static_blocks=rac_blocks,
        static_scale=_static_rows(act_global_scale, rexp, e), source_rows=source_rows,
        rac_selector=selector, row_valid=row_valid, row_pass=row_pass,
    )


def rac_selector(rac, act_scale_mode: str, group_sizes: jax.Array, source_rows, m: int,
                 config: W4A4MatmulConfig, interpret: bool, tiles=None):
    """The RAC selection kernel as ``rac.select_residual``'s ``selector`` for a grouped GEMM of
    ``m`` rows, or None (no RAC, ``config.rac_select_kernel`` off, more than
    ``rac_select.MAX_ROWS`` rows, or a configuration the kernel does not compute: the jnp path
    runs). ``tiles``: None, or a ``rac_select.SlotScales``: the selection also returns the
    tile kernels' token-slot scales (``SelectedResidual.selector_extra``)."""
    if (rac is None or not config.rac_select_kernel or m > rac_select.MAX_ROWS
            or not rac_select.supports(rac, act_scale_mode)):
        return None
    cfg = select_config(config)

    def select(scores, amax, finite, row_valid, act_scales):
        # no source rows: the kernel reads the score rows as the GEMM rows (no iota array)
        return rac_select.grouped_rac_selection(
            scores, amax, finite, source_rows, group_sizes, ratio=rac.rac_ratio,
            row_valid=row_valid, config=cfg, interpret=interpret, tiles=tiles,
            act_scales=None if tiles is None else act_scales)

    return select


def selection_tiles(config: W4A4MatmulConfig, e: int, m: int, block_m: int):
    """``rac_selector``'s ``tiles`` where the selection kernel writes the token-slot scales
    (``rac_select_slot_scales``, ``block_m`` a power of two), else None."""
    if not config.rac_select_slot_scales or block_m & (block_m - 1):
        return None
    return rac_select.SlotScales(block_m, num_tiles_bound(m, e, block_m))


def select_config(config: W4A4MatmulConfig) -> rac_select.RACSelectConfig:
    """The selection's ``RACSelectConfig``, in ``rac_select`` and in ``rac_operands``."""
    return rac_select.RACSelectConfig(block_rows=config.rac_select_block_rows)


def values_placement(window_rows: jax.Array, source_rows, m: int, k_pad: int, k: int,
                     config: W4A4MatmulConfig, group_sizes: jax.Array,
                     row_expert: jax.Array):
    """``rac_rows``' placement ``(window_of_row [M], P)`` for ``rac_placed_values``, or None
    where it does not apply: off, ``source_rows`` given, fewer than ``prefill_min_rows`` rows,
    the stacked ``rac_operands`` path off, K padded, or ``P`` not a whole number of its
    programs. ``window_of_row`` inverts the plan's ``window_rows`` (each GEMM row has exactly
    one window row; ``window_of_rows`` from the groups and the rows' experts)."""
    ocfg = config.rac_operands_config(prefill=True)
    p = window_rows.shape[0]
    if (not config.rac_placed_values or source_rows is not None or ocfg is None
            or not config.is_prefill(m)
            or k_pad != k or p % ocfg.block_rows or ocfg.padding_rows == "nan"):
        return None
    return window_of_rows(group_sizes, row_expert, p), p


def check_source_rows(source_rows, num_rows: int, name: str = "source_rows",
                      of: str = "rows of x") -> jax.Array:
    """``source_rows`` (or the index called ``name``) must be an int vector with values in
    ``[0, num_rows)`` (checked when concrete); returns it as int32."""
    sr = jnp.asarray(source_rows)
    if sr.ndim != 1 or not jnp.issubdtype(sr.dtype, jnp.integer):
        raise ValueError(f"{name}: {sr.dtype}{list(sr.shape)}; need an int vector")
    if not isinstance(sr, jax.core.Tracer) and sr.size:
        values = np.asarray(sr)  # numpy: a concrete index inside a jit trace stays concrete
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= num_rows:
            raise ValueError(f"{name}: values in [{lo}, {hi}]; need [0, {num_rows}) ({of})")
    return sr.astype(jnp.int32)


def check_output_rows(output_rows, m: int) -> jax.Array | None:
    """None, or ``output_rows`` as int32 (an int vector in ``[0, M)``, checked when concrete)."""
    if output_rows is None:
        return None
    return check_source_rows(output_rows, m, "output_rows", "rows of the GEMM")


def output_row_slots(row_slot: jax.Array, output_rows: jax.Array | None) -> jax.Array:
    """The tile slot of each row of the result: ``row_slot`` (int32 ``[M]``), or with
    ``output_rows`` (the GEMM rows wanted, in order; ``check_output_rows``)
    ``row_slot[output_rows]``: the kernel's read-back and the caller's reordering as one
    gather (a MoE block's unsort)."""
    return row_slot if output_rows is None else row_slot[output_rows]


def w4a4_grouped_matmul(
    x_sorted: jax.Array,
    w_q,
    group_sizes: jax.Array,
    *,
    act_scale_mode: str = "per_token",
    rac: aq.RACConfig | None = None,
    rac_blocks: jax.Array | None = None,
    act_global_scale: jax.Array | None = None,
    config: W4A4MatmulConfig | None = None,
    interpret: bool = False,
    source_rows: jax.Array | None = None,
    row_valid: jax.Array | None = None,
    output_rows: jax.Array | None = None,
) -> jax.Array:
    """Grouped ``Y[rows of e] = Q(x) @ Q(W_e)^T`` (+ RAC): ``[M, N]`` in ``x_sorted.dtype``
    (``[M', N]`` with ``output_rows``).

    Args:
      x_sorted: ``[M, K]`` bf16 rows sorted by expert.
      w_q: ``NVFP4Tensor [E, N, K]`` (one global scale per expert or per tensor) or stacked
        ``W4A4Weights``.
      group_sizes: int ``[E]`` rows per expert, summing to at most M.
      act_scale_mode / rac / rac_blocks (``[E, K/16]`` for static selection) /
        act_global_scale (``[]`` or ``[E]``, static mode): as ``w4a4_matmul``; online_batch RAC
        selects blocks per expert.
      source_rows: None, or int32 ``[M]``: ``x_sorted`` holds distinct rows ``[R, K]`` and the
        sorted rows are ``x_sorted[source_rows]`` (a MoE token's k slots): per-token activations
        are quantized once per distinct row and gathered into the tiles (same result).
      row_valid: None, or bool per row of ``x_sorted``: the rows that are tokens; RAC's
        online_batch selection scores only those (``rac.selection_mask``).
      output_rows: None, or int32 ``[M']`` in ``[0, M)``: return ``Y[output_rows]``, read back
        from the kernel's tiles in that order (one gather instead of two).
    """
    config = config or W4A4MatmulConfig()
    w = as_kernel_weights(w_q, config.mma_dtype)
    if not w.stacked:
        raise ValueError("w_q: a dense [N, K] weight; w4a4_grouped_matmul needs [E, N, K]")
    _check(x_sorted, w)
    if source_rows is not None:
        source_rows = check_source_rows(source_rows, x_sorted.shape[0])
    m = x_sorted.shape[0] if source_rows is None else source_rows.shape[0]
    e = w.num_experts
    gs = _check_group_sizes(group_sizes, e, m)
    output_rows = check_output_rows(output_rows, m)
    block_m = config.block_m or grouped_block_m(m, e)
    (row_index, tile_expert, num_tiles, row_slot, row0, window_rows,
     rexp) = plan_and_row_experts(gs, m, block_m, config.tile_plan_config(), interpret)
    plain = config.act_operands_config() if rac is None and act_scale_mode == "per_token" else None
    residual_blocks = acts = selection = None
    if plain is not None:
        def operand_of(idx):
            return act_operand_rows(x_sorted, source_rows, idx, w.mma_dtype, w.k_pad, plain,
                                    interpret)
    else:
        selector = rac_selector(rac, act_scale_mode, gs, source_rows, m, config, interpret,
                                selection_tiles(config, e, m, block_m))
        acts = _grouped_acts(x_sorted, rexp, e, act_scale_mode, rac, rac_blocks,
                             act_global_scale, source_rows, selector, row_valid,
                             config.rac_row_pass(interpret, values_placement(
                                 window_rows, source_rows, m, w.k_pad, x_sorted.shape[1],
                                 config, gs, rexp)))

        # Decode calls: the operand kernel selects each expert's blocks itself (the selector's
        # call above is then unused, and XLA drops it).
        selection = ((gs, rac.rac_ratio, select_config(config))
                     if selector is not None and config.rac_select_in_operands
                     and not config.is_prefill(m) else None)

        def operand_of(idx):
            return operand_rows(acts, idx, w.mma_dtype, w.k_pad, config.materialize_operands,
                                config.rac_operands_config(config.is_prefill(m)), interpret,
                                selection)

        if config.rac_selected_wgmmas and acts.mask is not None:
            residual_blocks = tile_block_bits(acts.mask, row_index, w.k_pad)
    tiles, slot_g = token_tiles(operand_of, row_index, row0, window_rows,
                                config.windowed_operands)
    # The selection kernel's token-slot scales, where it wrote them and its selection is the
    # one used (XLA then drops token_tiles' scale fusions).
    token_scales = (acts.residual.selector_extra
                  if acts is not None and selection is None
                  and isinstance(acts.residual, SelectedResidual) else None)
    return run_tiles(tiles, slot_g, output_row_slots(row_slot, output_rows), w, tile_expert,
                     num_tiles, config, interpret, x_sorted.dtype,
                     live_tiles=expected_tiles(m, e, block_m),
                     wide=config.wide_decode(m, rac=rac is not None, k_pad=w.k_pad),
                     residual_blocks=residual_blocks, token_scales=token_scales,
                     narrow=config.narrow_tiles and not config.is_prefill(m))


def w4a4_grouped_matmul_reference(
    x_sorted: jax.Array,
    w_q: nvfp4.NVFP4Tensor,
    group_sizes: jax.Array,
    *,
    act_scale_mode: str = "per_token",
    rac: aq.RACConfig | None = None,
    rac_blocks: jax.Array | None = None,
    act_global_scale: jax.Array | None = None,
    row_valid: jax.Array | None = None,
) -> jax.Array:
    """jnp reference: per-row expert weights, dequantized, float32; ``[M, N]`` in x's dtype."""
    m, e = x_sorted.shape[0], w_q.shape[0]
    gs = _check_group_sizes(group_sizes, e, m)
    rexp = row_experts(gs, m)
    acts = _grouped_acts(x_sorted, rexp, e, act_scale_mode, rac, rac_blocks, act_global_scale,
                         row_valid=row_valid)
    wd = nvfp4.dequantize(w_q, jnp.float32)  # [E, N, K]
    a = sum(aq.dequantized_sum(acts))
    y = jax.lax.ragged_dot(a, jnp.swapaxes(wd, 1, 2), gs, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x_sorted.dtype)
