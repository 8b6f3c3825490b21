"""RAC's per-expert block selection in one kernel, coded for ``rac_operands`` (Pallas, Triton).

For a grouped (MoE) W4A4 GEMM with ``online_batch`` selection, RAC picks one block set per
expert from the summed residual scores of the expert's GEMM rows (the rows that are tokens),
then each GEMM row gets a residual decode scale (the amax of its selected blocks / 2688), and
the stacked-operand kernel (``pallas_kernels.rac_operands``) codes each selected block's E4M3
scale and reciprocal from the block's amax itself. Written in jnp the selection was (when
measured) a zero-fill and scatter-add (the per-expert sums; a segmented scan since session 45,
``rac.ordered_segment_sum``), a pairwise rank, a masked row reduction
writing the coded block amax (``rac.code_block_amax``) and the decode scales: five XLA
kernels per GEMM, on an H100 (2026-12-06, 04546c3, batch-128 decode step, traced) 10.3 us for
gate_up and 8.3 us for down per layer, plus a launch gap each. Here it is one kernel per GEMM,
writing the same two arrays: the coded amax ``[M, K/16]`` and the decode scales ``[M]``.

One program per expert ``e`` (``grid = (E,)``) walks the expert's GEMM rows ``[start_e,
start_e + group_sizes[e])`` twice, ``block_rows`` rows per step (a gather of their distinct
rows; the last expert also takes any rows past ``sum(group_sizes)``, as the jnp path's clipped
row experts do):

1. sums the score rows ``scores[rows[i]]`` of the rows that are tokens, ranks the sums like
   ``rac.stable_descending_rank`` (``rac.sorts_before``: ties to the lower block, NaN last),
   keeps the top ``n_keep`` blocks;
2. for each row: ``g = decode_scale_from_amax(max(amax over the kept blocks))`` and the coded
   amax ``rac.code_block_amax(keep, amax, finite)``: the jnp functions the reference calls,
   traced into the kernel, so there is no second implementation to drift.

The blocks are handled in column chunks of the largest power of two dividing ``K/16`` (at
most 128; Triton's arrays are powers of two), the rank as chunk-by-chunk comparisons, so no
array is padded and no output sliced (either would be an XLA pass of its own). Windows of
rows stay inside ``[0, M)`` (a step near the end is moved back and masks the rows before its
own): the interpreter clamps windows that cross the end.

The per-expert sums add a step's rows as a tree, then the steps in order: where float32
addition is inexact the last bit of a sum can differ from the jnp path's order
(``rac.ordered_segment_sum``: a segmented prefix scan; both orders are fixed, so each path
repeats its own bits), and two sums within an ulp may then rank the other way. With exactly
representable sums (the tests) the results are bit-identical.

Measured on an H100 (2026-12-06, d126d0a, ``kernel_probe --rac-select``, traced, 1 024 GEMM
rows over 128 experts): 6.0 / 3.6 us for gate_up / down against 12.9 / 10.0 us for the jnp
path alone (7 kernels), equal on the GPU; in the batch-128 decode step 5.8 + 3.5 us per layer,
144 kernels per step fewer, the step 8.67 against 8.84 ms (``h200_next.sh rsel3``). An expert's
rows are walked serially: with one expert holding 225 of 1 024 rows, down's call took 12.4
us against the jnp path's 10.4.

History: the first version of this kernel (session 9, 2026-12-03) also coded every row's
block scales and reciprocals (four ``[M, K/16]`` outputs) and took 14.3 + 11.1 us per layer on
the H200, no faster than the jnp path; it was off by default until ``rac_operands`` learned to
code the scales itself.

Shapes: scores / amax float32 and finite bool or int8 (nonzero: finite) ``[R, K/16]`` (one
row per distinct activation row), rows None or int32 ``[M]`` (GEMM row -> distinct row),
group_sizes int ``[E]``, row_valid None or bool / int ``[R]``. Outputs float32: coded ``[M,
K/16]``, decode scales ``[M]``; with ``tiles`` (``SlotScales``) also the tile kernels'
token-slot scales ``[T, 2, block_m]`` (``grouped_rac_selection``).
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.triton_grid import (
    check_num_warps,
    check_pow2_fields,
    masked_index,
    pow2_at_least,
)
from pallas_kernels.vma import varying_operands
from quads_jax.quant import arith, nvfp4, ops, rac

# GEMM rows above which the grouped matmuls keep the jnp selection (prefill): an expert's rows
# are walked serially, ~2 048 per expert at 262 144 rows over 128 experts.
MAX_ROWS = 16384


@dataclasses.dataclass(frozen=True)
class RACSelectConfig:
    """block_rows: GEMM rows an expert's program loads per loop step (a power of two; a decode
    step's experts have ~8 rows at batch 128 under uniform routing, a random-init router's
    largest ~55); num_warps: Triton warps per program; exact_division: divide with
    ``div.rn.f32`` on the GPU (False: Triton's approximate ``div.full.f32``)."""

    block_rows: int = 32
    num_warps: int = 4
    # False: the same division as XLA:GPU's jnp path. On the H200 XLA's float32 1 / x differs
    # from the IEEE quotient on 13.5 % of values (2026-12-03, kernel_probe --rac-select), and
    # the kernel with div.full.f32 matched the jnp path bit for bit (div.rn.f32: 8 388 of
    # 131 072 reciprocals differed). In interpret mode both are jnp's division.
    exact_division: bool = False

    def __post_init__(self):
        check_pow2_fields(self, "block_rows")
        check_num_warps(self)


def chunk(nb: int) -> int:
    """Columns per chunk: the largest power of two that divides ``nb``, at most 128."""
    return min(nb & -nb, 128)


def supports(rac_config, act_scale_mode: str) -> bool:
    """Whether the kernel computes this RAC configuration (else the jnp path runs):
    ``online_batch`` selection by a summed residual score, a fixed ratio, the residual's own
    per-row decode scale, NVFP4 residual, per-token activation scales."""
    return (rac_config.rac_selection == "online_batch"
            and rac_config.rac_score in ("residual_l2", "residual_l1")
            and rac_config.rac_energy_target is None
            and rac_config.rac_residual_scale == "separate"
            and rac_config.rac_residual_format == "nvfp4"
            and act_scale_mode == "per_token")


def div_rn(a, b) -> jax.Array:
    """Correctly rounded float32 ``a / b`` in a Triton kernel (its ``/`` is the approximate
    ``div.full.f32``): the IEEE quotient of the CPU path. XLA:GPU's own division is not IEEE
    either, so the default (``RACSelectConfig.exact_division=False``) matches the GPU's jnp
    path and this is the option."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    (out,) = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


def _kernel(*refs, exact_division: bool, **static):
    # With exact_division the traced quantizer functions divide with div.rn.f32 on the GPU
    # (arith.division); otherwise with Triton's '/', as XLA:GPU's jnp path does (bit-identical
    # on the H200). The interpreter always runs jnp's division.
    with arith.division(div_rn if exact_division else None):
        _select(*refs, **static)


def group_offset(sizes: jax.Array, e):
    """``(sum(sizes[:e]), sizes[e])`` of a per-expert vector, by masked sums (Triton has no
    gather from registers)."""
    ids = jnp.arange(sizes.shape[0])
    return jnp.sum(jnp.where(ids < e, sizes, 0)), jnp.sum(jnp.where(ids == e, sizes, 0))


def expert_range(gs: jax.Array, e, num_experts: int, m: int):
    """Expert ``e``'s GEMM rows ``[start, end)`` from the group sizes ``gs`` (padded with
    empty groups); the last expert also takes the rows past ``sum(gs)``, as the jnp path's
    clipped row experts do."""
    start, size = group_offset(gs, e)
    end = jnp.where(e == num_experts - 1, m, start + size)
    return start, end


def step_window(rows_ref, valid_ref, start, end, c, m: int, block_rows: int):
    """Loop step ``c`` of an expert's walk: ``(i0, ours, t, votes)``: the step's first row,
    which of its ``block_rows`` rows are the step's, their distinct rows (``rows_ref`` None:
    the GEMM rows themselves) and which of them vote (the step's rows that are tokens). A
    window stays inside ``[0, M)``: a step past the end moves back and masks its first rows."""
    s_c = start + c * block_rows
    i0 = jnp.minimum(s_c, m - block_rows)
    r = i0 + jnp.arange(block_rows)
    ours = (r >= s_c) & (r < jnp.minimum(s_c + block_rows, end))
    t = r if rows_ref is None else rows_ref[pl.ds(i0, block_rows)]
    votes = ours & (valid_ref[t] != 0) if valid_ref is not None else ours
    return i0, ours, t, votes


def step_scores(scores_ref, t, votes, cols) -> list:
    """The voting rows' scores ``[block_rows, n]`` at each column slice of ``cols``."""
    return [jnp.where(votes[:, None], scores_ref[t, c], 0.0) for c in cols]


def summed_scores(first: list, rows_ref, valid_ref, scores_ref, start, end, m: int,
                  block_rows: int, cols) -> tuple:
    """Per column slice of ``cols``: the expert's summed voting scores, from ``first`` (the
    first step's ``step_scores``, loaded by the caller) and the steps after it in order (a
    step's rows add as a tree)."""
    def add(c, acc):
        _, _, t, votes = step_window(rows_ref, valid_ref, start, end, c, m, block_rows)
        return tuple(a + jnp.sum(v, axis=0)
                     for a, v in zip(acc, step_scores(scores_ref, t, votes, cols), strict=True))

    steps = (end - start + block_rows - 1) // block_rows
    return jax.lax.fori_loop(1, steps, add, tuple(jnp.sum(v, axis=0) for v in first))


def kept(sums, idx, n_keep: int) -> list:
    """Per chunk (its summed scores and block indices): which of its blocks rank among the
    ``n_keep`` first of all the chunks' blocks (``rac.stable_descending_rank``'s order:
    ``rac.sorts_before``; each block's rank counts the blocks of every chunk before it)."""
    return [sum(jnp.sum(rac.sorts_before(sj[None, :], ij[None, :], si[:, None], ii[:, None]),
                        axis=1, dtype=jnp.int32)
                for sj, ij in zip(sums, idx, strict=True)) < n_keep
            for si, ii in zip(sums, idx, strict=True)]


def selected_amax(keep, amax) -> jax.Array:
    """float32 ``[rows]``: each row's largest block amax over the kept blocks (chunk by
    chunk), what its residual decode scale is made from."""
    sel = None
    for a, k in zip(amax, keep, strict=True):
        part = jnp.max(jnp.where(k[None, :], a, 0.0), axis=1)
        sel = part if sel is None else jnp.maximum(sel, part)
    return sel


@dataclasses.dataclass(frozen=True)
class SlotScales:
    """What the selection kernel needs to also write the tile kernels' token-slot scales
    (``token_tiles``' ``[T, 2, block_m]``, before the weights' scales, which the tile kernel
    applies itself: ``nvfp4_tile_gemm(expert_scales=...)``): tiles of ``block_m`` rows (a power
    of two), ``num_tiles`` of them (``tile_plan.num_tiles_bound``)."""

    block_m: int
    num_tiles: int


class _ExpertTiles:
    """One expert program's tiles of the slot scales, flattened ``[T * 2 * block_m]``: tile
    ``t``'s operand ``a`` slot ``s`` at ``(t * 2 + a) * block_m + s``."""

    def __init__(self, slots: SlotScales, out_ref, first_tile, n_rows):
        self.bm, self.out_ref = slots.block_m, out_ref
        self.size = slots.num_tiles * 2 * slots.block_m
        self.first_tile, self.n_rows = first_tile, n_rows

    def store_rows(self, local, ours, act_g, res_g):
        """Rows ``local`` (within the expert's group) of a walk step: their two scales, the
        activations' and the residual's decode scale, at their tile slots; rows past the group
        (the last expert's rows past the groups) belong to no tile."""
        live = ours & (local < self.n_rows)  # ours: the step's rows, so local >= 0
        base = (self.first_tile + local // self.bm) * (2 * self.bm) + local % self.bm
        for a, g in enumerate((act_g, res_g)):
            pltriton.store(self.out_ref.at[masked_index(live, base + a * self.bm, self.size)],
                           g, mask=live)


def expert_tiles(gs, e, num_experts: int, slots: SlotScales, out_ref) -> _ExpertTiles:
    """Expert ``e``'s tiles (the tile plan's: ``ceil(rows / block_m)`` per expert, in expert
    order): writes zeros where no row will land (its last tile's slots past its rows, and this
    program's share of the tiles past every expert's, ``e``, ``e + E``, ...), then returns the
    writer of its rows' scales. ``gs``: the group sizes, padded with empty groups."""
    bm, t_max = slots.block_m, slots.num_tiles
    counts = (gs + (bm - 1)) // bm
    first, tiles = group_offset(counts, e)
    _, n = group_offset(gs, e)
    total = jnp.sum(counts)
    lane = jnp.arange(2 * bm)
    last = first + tiles - 1
    tail = (lane % bm) >= n - (last - first) * bm  # the last tile's slots past the rows
    size = t_max * 2 * bm
    ok = tail & (n > 0)
    pltriton.store(out_ref.at[masked_index(ok, last * (2 * bm) + lane, size)],
                   jnp.zeros((2 * bm,), jnp.float32), mask=ok)
    for i in range(-(-t_max // num_experts)):  # the tiles no expert has
        dead = total + e + i * num_experts
        ok = jnp.broadcast_to(dead < t_max, lane.shape)
        pltriton.store(out_ref.at[masked_index(ok, dead * (2 * bm) + lane, size)],
                       jnp.zeros((2 * bm,), jnp.float32), mask=ok)
    return _ExpertTiles(slots, out_ref, first, n)


def _select(gs_ref, *refs, num_experts: int, nb: int, ch: int, n_keep: int, m: int,
            block_rows: int, has_rows: bool, has_valid: bool, slots: SlotScales | None):
    refs = list(refs)
    rows_ref = refs.pop(0) if has_rows else None
    valid_ref = refs.pop(0) if has_valid else None
    act_ref = refs.pop(0) if slots is not None else None
    scores_ref, amax_ref, finite_ref, coded_ref, g_ref, *slot_ref = refs
    start, end = expert_range(gs_ref[...], pl.program_id(0), num_experts, m)
    tiles = None if slots is None else expert_tiles(
        gs_ref[...], pl.program_id(0), num_experts, slots, slot_ref[0])
    br = block_rows
    chunks = [pl.ds(c * ch, ch) for c in range(nb // ch)]

    def loads(c):  # a step's rows and their scores (of the rows that are tokens), amax, finite
        i0, ours, t, votes = step_window(rows_ref, valid_ref, start, end, c, m, br)
        return (i0, ours, t, step_scores(scores_ref, t, votes, chunks),
                [amax_ref[t, cols] for cols in chunks],
                [finite_ref[t, cols] != 0 for cols in chunks])

    # The first step's loads are issued together, before the rank, and its rows are coded from
    # registers after it: at decode an expert's rows fit one step, and its amax and finiteness
    # then cost no second round of dependent loads.
    i0, ours, t, first_scores, first_amax, first_finite = loads(0)
    sums = summed_scores(first_scores, rows_ref, valid_ref, scores_ref, start, end, m, br,
                         chunks)
    keep = kept(sums, [c * ch + jnp.arange(ch) for c in range(len(chunks))], n_keep)

    def code(i0, ours, t, amax, finite):
        sel = selected_amax(keep, amax)
        rows = pl.ds(i0, br)
        for a, f, k, cols in zip(amax, finite, keep, chunks, strict=True):
            pltriton.store(coded_ref.at[rows, cols], rac.code_block_amax(k[None, :], a, f),
                           mask=ours[:, None])
        g = nvfp4.decode_scale_from_amax(sel)
        pltriton.store(g_ref.at[rows], g, mask=ours)
        if tiles is not None:
            tiles.store_rows(i0 + jnp.arange(br) - start, ours, act_ref[t], g)

    def code_rows(c, carry):
        i0, ours, t, _, amax, finite = loads(c)
        code(i0, ours, t, amax, finite)
        return carry

    code(i0, ours, t, first_amax, first_finite)
    steps = (end - start + br - 1) // br
    jax.lax.fori_loop(1, steps, code_rows, 0)


@functools.partial(jax.jit, static_argnames=("ratio", "config", "interpret", "tiles"))
def grouped_rac_selection(scores: jax.Array, amax: jax.Array, finite: jax.Array,
                          rows: jax.Array | None, group_sizes: jax.Array, *, ratio: float,
                          row_valid: jax.Array | None = None,
                          config: RACSelectConfig = RACSelectConfig(),
                          interpret: bool = False,
                          tiles: SlotScales | None = None,
                          act_scales: jax.Array | None = None):
    """RAC selection per expert, coded per GEMM row (module docstring).

    Returns ``(coded float32 [M, nb], g float32 [M])``: ``rac.code_block_amax`` of the
    selection and the residual's decode scales. ``rows`` None: the GEMM rows are the score
    rows themselves (M = R; no index array is read, none has to be made).

    ``tiles``: None, or a ``SlotScales`` with ``act_scales`` float32 ``[R]``: a third output,
    the token-slot scales float32 ``[T, 2, block_m]`` of the tile plan (``token_tiles``'
    scales, bit for bit): each GEMM row's activation decode scale (``act_scales`` of its
    distinct row) and residual decode scale at its tile slot, 0 in empty slots and unused
    tiles."""
    r_rows, nb = scores.shape
    if amax.shape != (r_rows, nb) or finite.shape != (r_rows, nb):
        raise ValueError(f"grouped_rac_selection: scores {scores.shape}, amax {amax.shape} and "
                         f"finite {finite.shape} must all be [R, nb]")
    if (rows is not None and rows.ndim != 1) or group_sizes.ndim != 1:
        raise ValueError(f"grouped_rac_selection: rows {getattr(rows, 'shape', None)} must "
                         f"be None or [M] and group_sizes {group_sizes.shape} [E]")
    if row_valid is not None and row_valid.shape != (r_rows,):
        raise ValueError(f"grouped_rac_selection: row_valid {row_valid.shape} must be [R] = "
                         f"[{r_rows}]")
    m, e = r_rows if rows is None else rows.shape[0], group_sizes.shape[0]
    ep = pow2_at_least(e)
    n_keep = rac.kept_blocks(ratio, nb)  # rac.select_blocks' count
    br = min(config.block_rows, 1 << (m.bit_length() - 1))  # a window fits in [0, M)
    gs = group_sizes.astype(jnp.int32)
    if ep != e:  # empty groups past E: no row is theirs
        gs = jnp.pad(gs, (0, ep - e))
    # int8 finiteness (the row pass's) is read as it is; bool as int8 (Triton's i1 loads).
    fin = finite if finite.dtype == jnp.int8 else finite.astype(jnp.int8)
    valid = () if row_valid is None else (
        row_valid if row_valid.dtype == jnp.int8 else row_valid.astype(jnp.int8),)
    slots, tile_args = tiles, ()
    if slots is not None:
        bm = slots.block_m
        if bm < 1 or bm & (bm - 1) or act_scales is None or act_scales.shape != (r_rows,):
            raise ValueError(f"grouped_rac_selection: tiles' block_m={bm} must be a power of "
                             f"two and act_scales {getattr(act_scales, 'shape', None)} [R] = "
                             f"[{r_rows}]")
        tile_args = (act_scales.astype(jnp.float32),)
    args = (gs, *(() if rows is None else (rows.astype(jnp.int32),)), *valid, *tile_args,
            scores.astype(jnp.float32),
            amax.astype(jnp.float32), fin)
    vary, args = varying_operands(*args)
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_kernel, num_experts=e, nb=nb, ch=chunk(nb), n_keep=n_keep,
                               m=m, block_rows=br, has_rows=rows is not None,
                               has_valid=row_valid is not None, slots=slots,
                               exact_division=config.exact_division and not interpret)
    shapes = [(m, nb), (m,)] + ([] if slots is None else [(slots.num_tiles * 2 * slots.block_m,)])
    outs = pl.pallas_call(
        kernel,
        grid=(e,),
        in_specs=[whole(a.shape) for a in args],
        out_specs=[whole(sh) for sh in shapes],
        out_shape=[jax.ShapeDtypeStruct(sh, jnp.float32, **vary) for sh in shapes],
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="rac_select",
    )(*args)
    if slots is None:
        return tuple(outs)
    coded, g, flat = outs
    return coded, g, flat.reshape(slots.num_tiles, 2, slots.block_m)


def grouped_rac_selection_reference(scores, amax, finite, rows, group_sizes, *, ratio: float,
                                    row_valid=None):
    """The jnp path (``rac.selection_mask``, ``rac.residual_decode_scales`` and
    ``rac.code_block_amax``, as ``rac.select_residual`` runs them) on the same inputs: what
    the kernel must equal."""
    if rows is None:
        rows = jnp.arange(scores.shape[0], dtype=jnp.int32)
    m, e = rows.shape[0], group_sizes.shape[0]
    # Each GEMM row's expert (w4a4_grouped.row_experts), rows past the groups in the last one.
    rexp = jnp.minimum(ops.count_le(jnp.cumsum(group_sizes), jnp.arange(m, dtype=jnp.int32)),
                       e - 1)
    recipe = types.SimpleNamespace(rac_selection="online_batch", rac_score="residual_l2",
                                   rac_ratio=ratio, rac_energy_target=None)
    mask = rac.selection_mask(rac.valid_row_scores(scores, row_valid), recipe, rows=rows,
                              row_expert=rexp, num_experts=e)
    a, f = amax[rows], finite[rows] != 0
    return rac.code_block_amax(mask, a, f), rac.residual_decode_scales(mask, a, "per_token")
