"""RAC's two W4A4 B operands, stacked, in one kernel (Pallas, Triton backend).

With RAC the tile kernels (``nvfp4_tiles_mgpu``, ``stack_operands``) read one stacked array
``[2, P, Kp]`` as row windows (``token_tiles``): at each of its ``P`` rows the GEMM row
``window_rows[p]`` (``>= M``: a zero row), operand 0 that row's quantized activation values
``e2m1 * s_b`` (rows of the distinct rows' ``b0``), operand 1 its RAC residual coded on the
fly, ``round_to_e2m1(r[src] * rcp[row]) * s[row]`` per 16-element block
(``quads_jax.quant.rac.SelectedResidual.unscaled``). Written in jnp this is a row gather of
``b0``, the residual's per-element coding with gathered per-block scales and a concatenate: on
the H200 (2026-12-04, c1e04e4, decode step at batch 128) one XLA fusion of 20.5 us for
gate_up's 1 936 x 2048 window rows and 8.2 us for down's, per layer, where the plain path's
single operand takes 6.1 and 5.1 us. Here one program writes ``block_rows`` window rows by
``block_k`` columns of both operands: the index composition (window row -> GEMM row ->
distinct row) happens in registers, the distinct rows stay in L2, and the output is written
once.

Measured on the H200 (2026-12-04, 22273a2, ``kernel_probe --rac-operands``, traced): 8.3 us
for gate_up's ``[2, 1936, 2048]`` (1.9 TB/s written) and 4.4 us for down's ``[2, 1936, 768]``,
bit-identical to the jnp path; block_rows 4 / 16 and 2 warps within 0.6 us. In the decode step
at batch 128: 8.2 + 4.4 us per layer against 20.5 + 8.2, the step 16.17 against 17.08 ms.

The arithmetic is ``SelectedResidual.unscaled``'s own (``nvfp4.round_to_e2m1_value`` traced
into the kernel: float32 products, compares and adds of exact steps), so the result is
bit-identical to the jnp path (tests, and ``kernel_probe --rac-operands`` on the GPU).

With ``residual_of=(x, g)`` (the rollout's per-token RAC: ``pallas_kernels.rac_rows`` wrote
the values without a float32 residual) each program recomputes its rows' residual from the
activations and the values (``nvfp4.residual_from_values``, bit-identical): 2 bytes of ``x``
per element read instead of 4 of ``r``, and no pass writes ``r`` at all.

With ``coded=(a, g)`` (RAC's jnp block selection: ``rac.SelectedResidual.amax`` is set) the
programs code the residual's block scales and reciprocals themselves from one float32
``[M, K/16]`` array carrying each block's amax, finiteness and selection
(``rac.coded_block_amax`` / ``rac.scales_from_coded_amax``, bit-identical): XLA no longer
writes two ``[M, K/16]`` float32 arrays for the kernel to read back. On the H100 (2026-12-06,
2db87d0, ``kernel_probe --trace-grouped --trace-tokens 1024``) the grouped RAC prefill call
went from 286 us in 18 kernels to 276 in 16.

Shapes and dtypes: ``b0`` ``[R0, K]`` in the MMA dtype, ``r`` float32 ``[R, K]``, ``scales`` /
``reciprocals`` float32 ``[M, K/16]``, ``window_rows`` int32 ``[P]``, ``q_rows`` / ``r_rows``
None (GEMM row = distinct row) or int32 ``[M]``. Output ``[2, P, Kp]`` in ``b0``'s dtype, K
zero-padded to ``Kp`` (a multiple of ``block_k``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import rac_select
from pallas_kernels.token_tiles import ROW_ALIGN
from pallas_kernels.triton_grid import check_num_warps, check_pow2_fields, pow2_at_least
from pallas_kernels.vma import varying_operands
from pallas_kernels.w4a4_matmul import _pad_k
from quads_jax.quant import arith, nvfp4, rac

BLOCK = nvfp4.BLOCK_SIZE


PADDING_ROWS = ("zeros", "skip", "nan")


@dataclasses.dataclass(frozen=True)
class RACOperandsConfig:
    """block_rows: window rows per program (a power of two); block_k: columns per program (a
    power of two, a multiple of 16, dividing ``Kp``); num_warps: Triton warps per program.

    padding_rows: what the window rows without a GEMM row (``window_rows[p] >= M``: a group's
    alignment padding, the layout's tail) hold. "zeros": written as zeros, as the jnp path
    does (the default). "skip": not written (about half the kernel's bytes at the decode step:
    1 936 window rows for 1 024 GEMM rows); they keep whatever the buffer held, which only
    token slots that no GEMM row reads back multiply (a wgmma column per slot, a scale of 0,
    a slot ``rows_from_tiles`` never gathers), so the GEMM result is the same unless that
    garbage is read elsewhere. "nan": "skip" into a buffer first filled with NaN (a full extra
    write): the tests' proof that the result does not depend on those rows.
    Opt-in (``W4A4MatmulConfig.rac_operand_padding``): on the H200 (b79a63f, BENCHMARKS
    "rac_operands padding rows left unwritten") "skip" took 8.0 / 4.5 us against 8.2 / 4.4
    (gate_up / down) and the rollout step 16.25 against 16.29 ms: at these sizes the kernel
    is bound by its latency, not its bytes.

    recompute_placed: with ``placed`` (``rac_stacked_operands``), each row's operand values
    are recomputed from the ``x`` block the residual reads anyway
    (``nvfp4.unscaled_block_values``, ``rac_rows``' own arithmetic: the same bits) instead of
    read back from the placed buffer: 2 bytes per element less to read. Off by default: on an
    H100 (2026-12-06, 8 192 rows x K = 2048) the kernel took 59.5-59.9 us with it against
    44.4-45.0 without (the arithmetic costs more than the reads it saves).
    """

    block_rows: int = 8
    block_k: int = 256
    num_warps: int = 4
    padding_rows: str = "zeros"
    recompute_placed: bool = False

    def __post_init__(self):
        check_row_grid(self)
        if self.padding_rows not in PADDING_ROWS:
            raise ValueError(f"RACOperandsConfig.padding_rows={self.padding_rows!r}: one of "
                             f"{PADDING_ROWS}")


def check_row_grid(config) -> None:
    """A rows x columns Triton grid config (``block_rows``, ``block_k``, ``num_warps``): a
    ``ValueError`` naming the field and what it must be."""
    check_pow2_fields(config, "block_rows", "block_k")
    if config.block_k < BLOCK:
        raise ValueError(f"{type(config).__name__}.block_k={config.block_k}: at least {BLOCK}")
    check_num_warps(config)


def window_program(wr_ref, m: int, block_rows: int, blocks_k: int):
    """A window-operand program's rows and columns (``blocks_k`` 16-element blocks) and its
    rows' GEMM rows: ``(rows, cols, valid [BP], gemm_row [BP])``, empty rows (``>= m``) read
    row 0 (zeroed or skipped by the caller's store)."""
    rows = pl.ds(pl.program_id(0) * block_rows, block_rows)
    cols = pl.ds(pl.program_id(1) * blocks_k, blocks_k)
    gemm_row = wr_ref[rows]
    valid = gemm_row < m
    return rows, cols, valid, jnp.where(valid, gemm_row, 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OperandSelection:
    """RAC's per-expert block selection computed inside the operand kernel
    (``rac_stacked_operands(select=...)``) instead of by ``pallas_kernels.rac_select`` before
    it: what that kernel reads, and its settings.

    scores / amax float32 and finite int8 (nonzero: finite) ``[R, K/16]``: the distinct rows'
    residual block scores (before the ``row_valid`` mask), block amax and finiteness (the row
    pass's, ``pallas_kernels.rac_rows``); group_sizes int ``[E]``; row_valid None or int8 /
    bool ``[R]`` (the rows that are tokens: only they vote); ratio: RAC's block ratio; config:
    ``rac_select.RACSelectConfig`` (its ``block_rows`` and ``exact_division``: the same walk,
    sums and division as that kernel, so the result is the same bits).
    """

    scores: jax.Array
    amax: jax.Array
    finite: jax.Array
    group_sizes: jax.Array
    row_valid: jax.Array | None = None
    ratio: float = dataclasses.field(default=0.5, metadata={"static": True})
    config: rac_select.RACSelectConfig = dataclasses.field(
        default=rac_select.RACSelectConfig(), metadata={"static": True})


def selects_in_kernel(config: RACOperandsConfig) -> bool:
    """Whether a kernel of this config can take ``select=``: each program's window rows are
    one expert's (``block_rows`` divides ``ROW_ALIGN``) and the output is not the aliased
    NaN-filled test buffer (``padding_rows`` "nan")."""
    return ROW_ALIGN % config.block_rows == 0 and config.padding_rows != "nan"


def _program_selection(sel_refs, rows_ref, gemm_row, valid, src, cols, idx_cols, *, m: int,
                       num_experts: int, nb: int, ch: int, n_keep: int, block_rows: int,
                       has_valid: bool):
    """The selection of one program's expert for its rows and columns: ``(coded block amax
    [BP, blocks_k], decode scales [BP])``, ``rac_select``'s arithmetic and values.

    The program's window rows are one expert's (the plan's layout starts each group at a
    multiple of ``ROW_ALIGN`` rows, and ``block_rows`` divides it): the expert of its first
    GEMM row. Its sums, ranks and each row's largest kept amax are ``rac_select``'s own
    functions over the same row windows and column chunks; the program's columns take their
    selection from the chunks' (one rank, so a column's block and its row's decode scale can
    never disagree)."""
    gs_ref, *rest = sel_refs
    valid_ref = rest.pop(0) if has_valid else None
    scores_ref, amax_ref, finite_ref = rest
    gs = gs_ref[...]
    ends = jnp.cumsum(gs)
    first_row = jnp.min(jnp.where(valid, gemm_row, m))
    e = jnp.minimum(jnp.sum((ends <= first_row).astype(jnp.int32)), num_experts - 1)
    start, end = rac_select.expert_range(gs, e, num_experts, m)
    chunks = [pl.ds(c * ch, ch) for c in range(nb // ch)]
    idx = [c * ch + jnp.arange(ch) for c in range(len(chunks))]
    _, _, t, votes = rac_select.step_window(rows_ref, valid_ref, start, end, 0, m, block_rows)
    first = rac_select.step_scores(scores_ref, t, votes, chunks)
    sums = rac_select.summed_scores(first, rows_ref, valid_ref, scores_ref, start, end, m,
                                    block_rows, chunks)
    keep = rac_select.kept(sums, idx, n_keep)
    g_res = nvfp4.decode_scale_from_amax(
        rac_select.selected_amax(keep, [amax_ref[src, c] for c in chunks]))
    keep_cols = sum(jnp.sum((k[None, :] & (i[None, :] == idx_cols[:, None])).astype(jnp.int32),
                            axis=1) for k, i in zip(keep, idx, strict=True)) > 0
    coded = rac.code_block_amax(keep_cols[None, :], amax_ref[src, cols],
                                finite_ref[src, cols] != 0)
    return coded, g_res


def _kernel(wr_ref, *refs, m: int, has_q: bool, has_r: bool, block_rows: int,
            blocks_k: int, write_empty: bool, aliased: bool, recompute: bool, placed: bool,
            coded: bool, recompute_placed: bool = False, select: dict | None = None,
            exact_division: bool = False):
    refs = list(refs)
    q_ref = refs.pop(0) if has_q else None
    rr_ref = refs.pop(0) if has_r else None
    if select is not None:  # ... x, g, <selection inputs>, out, decode scales out
        g_out_ref, out_ref = refs.pop(), refs.pop()
        n_sel = 4 + select["has_valid"]
        sel_refs, refs = refs[-n_sel:], [*refs[:-n_sel], None, None, out_ref]
    # The buffer the output aliases: NaN-filled ("nan": never read), or rac_rows' placed
    # values (operand 0 of the window rows that have a GEMM row: read, not written again).
    buf_ref = refs.pop(-2) if aliased or placed else None
    b0_ref = None if placed else refs.pop(0)
    if recompute:
        x_ref, g_ref, s_ref, rcp_ref, out_ref = refs
    else:
        r_ref, s_ref, rcp_ref, out_ref = refs
    rows, cols, valid, g = window_program(wr_ref, m, block_rows, blocks_k)
    q_src = q_ref[g] if has_q else g
    r_src = rr_ref[g] if has_r else g
    keep = valid[:, None, None]
    xb = x_ref[q_src, cols, :].astype(jnp.float32) if recompute else None
    g_x = g_ref[q_src][:, None, None] if recompute else None
    if placed and recompute_placed:  # rac_rows' arithmetic on the x block read below anyway
        act = jnp.where(keep, nvfp4.unscaled_block_values(xb, g_x), 0.0)
    elif placed:  # the window rows' own values; rows without a GEMM row hold anything: masked
        act = jnp.where(keep, buf_ref[0, rows, cols, :], 0)  # [BP, blocks_k, 16]
    else:
        act = b0_ref[q_src, cols, :]  # [BP, blocks_k, 16]
    if recompute:  # r_src is q_src: the residual of the row's own values, nvfp4.residual's
        r = nvfp4.residual_from_values(xb, act.astype(jnp.float32), g_x)
    else:
        r = r_ref[r_src, cols, :]
    if select is not None:  # the expert's selection, coded here (OperandSelection)
        idx_cols = pl.program_id(1) * blocks_k + jnp.arange(blocks_k)
        # rac_select's division for its part (the decode scales), this kernel's for the codes
        with arith.division(rac_select.div_rn if exact_division else None):
            coded_cols, g_res = _program_selection(sel_refs, q_ref, g, valid, q_src, cols,
                                                   idx_cols, m=m, **select)
        s, rcp = rac.scales_from_coded_amax(coded_cols, g_res[:, None])
        # Each row's decode scale once (the first column's program); 0 for empty rows, as
        # rows_or_fill gives the jnp path's slot scales.
        pltriton.store(g_out_ref.at[rows], jnp.where(valid, g_res, 0.0),
                       mask=jnp.broadcast_to(pl.program_id(1) == 0, valid.shape))
    elif coded:  # s_ref / rcp_ref: the coded block amax [M, nb] and the decode scales [M]
        s, rcp = rac.scales_from_coded_amax(s_ref[g, cols], rcp_ref[g][:, None])
    else:
        s, rcp = s_ref[g, cols], rcp_ref[g, cols]
    y = r * rcp[..., None]
    res = nvfp4.round_to_e2m1_value(y) * s[..., None]
    # Rows without a GEMM row: zeros, or left as they are (RACOperandsConfig.padding_rows).
    # Placed: operand 0 is already in place where a row has a GEMM row; only the empty rows'
    # zeros are written.
    mask = None if write_empty else jnp.broadcast_to(keep, act.shape)[None]
    mask0 = jnp.broadcast_to(~keep, act.shape)[None] if placed else mask
    for a, val in enumerate((jnp.where(keep, act, 0), jnp.where(keep, res, 0.0))):
        if a == 0 and placed and not write_empty:
            continue
        # Operand a as a 1-long slice, not an int index: the interpreter's masked store takes
        # slices and arrays only.
        pltriton.store(out_ref.at[pl.ds(a, 1), rows, cols, :],
                       val.astype(out_ref.dtype)[None], mask=mask0 if a == 0 else mask)


@functools.partial(jax.jit, static_argnames=("k_pad", "config", "interpret"))
def rac_stacked_operands(b0: jax.Array, r: jax.Array, scales: jax.Array,
                         reciprocals: jax.Array, window_rows: jax.Array,
                         q_rows: jax.Array | None = None, r_rows: jax.Array | None = None, *,
                         k_pad: int, config: RACOperandsConfig = RACOperandsConfig(),
                         interpret: bool = False,
                         residual_of: tuple[jax.Array, jax.Array] | None = None,
                         placed: jax.Array | None = None,
                         coded: tuple[jax.Array, jax.Array] | None = None,
                         select: OperandSelection | None = None):
    """The stacked operands ``[2, P, Kp]`` (module docstring).

    ``coded``: None, or ``(a float32 [M, K/16], g float32 [M])``: ``rac.coded_block_amax``
    of the residual and its decode scales; ``scales`` and ``reciprocals`` are then None and
    each program codes its blocks' scales and reciprocals itself
    (``rac.scales_from_coded_amax``: bit-identical), so no XLA pass writes them first.

    ``residual_of``: None, or ``(x [R0, K], g float32 [R0])``, the activations whose values
    ``b0`` holds and their decode scales; ``r`` is then None and each residual row is
    recomputed in the kernel (``nvfp4.residual_from_values``: bit-identical) from ``x`` and
    ``b0`` at the row's ``q_rows`` entry (``r_rows`` must be None): 2 bytes of ``x`` read per
    element instead of 4 of a float32 residual that no pass has to write first.

    ``placed``: None, or ``rac_rows``' stacked ``[2, P, K]`` buffer (``window_of_row``) whose
    operand 0 already holds each window row's values where it has a GEMM row (``b0`` None,
    ``residual_of`` given, ``q_rows`` None: GEMM row = row of ``x``; ``Kp == K`` and ``P`` a
    multiple of ``block_rows``). The output is that buffer: operand 0 is read there (for the
    residual) and written only at the empty rows, operand 1 everywhere, so the values cross
    memory once instead of being written, read and written again.

    ``select``: None, or an ``OperandSelection``: each program selects its expert's blocks
    itself (``rac_select``'s walk, sums, rank and coding, traced into this kernel) from the
    distinct rows' block statistics, instead of reading ``coded`` from ``rac_select``: one
    kernel and its ``[M, K/16]`` output fewer. ``scales``, ``reciprocals`` and ``coded`` are
    then None, ``residual_of`` is given, ``placed`` None, ``Kp == K``, ``window_rows`` is the
    grouped plan's layout (each group starts at a multiple of ``ROW_ALIGN`` rows, which
    ``block_rows`` divides: a program's rows are one expert's), and the result is ``(stacked
    [2, P, Kp], decode scales float32 [P])``: each window row's residual decode scale (0 for
    empty rows), the slot scales of operand 1. Every program of a column repeats its
    expert's selection (a decode step's expert holds a few rows: reading their scores again
    costs less than a kernel launch and a round trip through memory)."""
    sel_args, sel_static = (), None
    if select is not None:
        if (scales is not None or reciprocals is not None or coded is not None
                or residual_of is None or placed is not None or r is not None
                or not selects_in_kernel(config)):
            raise ValueError(
                "rac_stacked_operands: select needs scales, reciprocals, coded, r and placed "
                "None, residual_of=(x, g), padding_rows 'zeros' or 'skip' and block_rows "
                f"dividing {ROW_ALIGN} (got block_rows={config.block_rows}, padding_rows="
                f"{config.padding_rows!r})")
        x_sel = residual_of[0]
        m_sel = x_sel.shape[0] if q_rows is None else q_rows.shape[0]
        nb_sel = x_sel.shape[1] // BLOCK
        r_sel = x_sel.shape[0]
        if (select.scores.shape != (r_sel, nb_sel) or select.amax.shape != (r_sel, nb_sel)
                or select.finite.shape != (r_sel, nb_sel) or select.group_sizes.ndim != 1
                or (select.row_valid is not None and select.row_valid.shape != (r_sel,))
                or k_pad != x_sel.shape[1]):
            raise ValueError(
                f"rac_stacked_operands: select's scores {select.scores.shape}, amax "
                f"{select.amax.shape}, finite {select.finite.shape} must be [R, K/16] = "
                f"[{r_sel}, {nb_sel}], group_sizes [E] (got {select.group_sizes.shape}), "
                f"row_valid None or [R], and k_pad={k_pad} must be K={x_sel.shape[1]}")
        e = select.group_sizes.shape[0]
        gs = select.group_sizes.astype(jnp.int32)
        if pow2_at_least(e) != e:  # empty groups past E: no row is theirs
            gs = jnp.pad(gs, (0, pow2_at_least(e) - e))
        valid = () if select.row_valid is None else (select.row_valid.astype(jnp.int8),)
        sel_args = (gs, *valid, select.scores.astype(jnp.float32),
                    select.amax.astype(jnp.float32), select.finite.astype(jnp.int8))
        sel_static = dict(num_experts=e, nb=nb_sel, ch=rac_select.chunk(nb_sel),
                          n_keep=rac.kept_blocks(select.ratio, nb_sel),
                          block_rows=min(select.config.block_rows,
                                         1 << (m_sel.bit_length() - 1)),
                          has_valid=select.row_valid is not None)
        # The GEMM rows' count and blocks for the checks below, as coded would give them.
        scales = jax.ShapeDtypeStruct((m_sel, nb_sel), jnp.float32)
    if coded is not None:
        if scales is not None or reciprocals is not None:
            raise ValueError("rac_stacked_operands: pass scales and reciprocals or coded=(a, "
                             "g), not both")
        scales, g_coded = coded
        if g_coded.shape != scales.shape[:1]:
            raise ValueError(f"rac_stacked_operands: coded g {g_coded.shape} must be [M] = "
                             f"[{scales.shape[0]}]")
    m, nb = scales.shape
    if (residual_of is None) == (r is None):
        raise ValueError("rac_stacked_operands: pass r or residual_of=(x, g), not both")
    if placed is not None:
        p = window_rows.shape[0]
        x_shape = residual_of[0].shape if residual_of is not None else None
        if (b0 is not None or residual_of is None or q_rows is not None
                or placed.shape != (2, p, k_pad) or x_shape != (m, k_pad)
                or p % config.block_rows or config.padding_rows == "nan"):
            raise ValueError(
                f"rac_stacked_operands: placed {placed.shape} needs b0 None, residual_of with "
                f"x [M, Kp] = [{m}, {k_pad}] (got {x_shape}), q_rows None, the shape [2, P, Kp] "
                f"= [2, {p}, {k_pad}] with P a multiple of block_rows={config.block_rows}, and "
                "padding_rows 'zeros' or 'skip'")
        # Shape and dtype only: the kernel reads the buffer itself.
        b0 = jax.ShapeDtypeStruct((m, k_pad), placed.dtype)
    if residual_of is not None:
        x, g_x = residual_of
        if r_rows is not None or x.shape != b0.shape or g_x.shape != (b0.shape[0],):
            raise ValueError(f"rac_stacked_operands: residual_of x {x.shape}, g {g_x.shape} "
                             f"must be [R0, K] = {b0.shape} and [R0], with r_rows None")
        r = x
    k = r.shape[1]
    if b0.shape[1] != k or nb * BLOCK != k or (coded is None and select is None
                                               and reciprocals.shape != (m, nb)):
        rcp_shape = None if reciprocals is None else reciprocals.shape
        raise ValueError(f"rac_stacked_operands: b0 {b0.shape}, r {r.shape}, scales "
                         f"{scales.shape} and reciprocals {rcp_shape} must be [R0, K], "
                         f"[R, K], [M, K/16], [M, K/16] (coded: reciprocals None)")
    if k_pad < k or k_pad % config.block_k:
        raise ValueError(f"rac_stacked_operands: k_pad={k_pad} must be >= K={k} and a "
                         f"multiple of block_k={config.block_k}")
    for name, idx in (("window_rows", window_rows), ("q_rows", q_rows), ("r_rows", r_rows)):
        if idx is not None and (idx.ndim != 1 or idx.dtype != jnp.int32):
            raise ValueError(f"rac_stacked_operands: {name} {idx.dtype}{list(idx.shape)}; need "
                             "int32 [n]")
    for name, idx in (("q_rows", q_rows), ("r_rows", r_rows)):
        if idx is not None and idx.shape[0] != m:
            raise ValueError(f"rac_stacked_operands: {name} has {idx.shape[0]} rows; need M={m}")
    nbp = k_pad // BLOCK
    b0_args = () if placed is not None else (_pad_k(b0, k_pad).reshape(b0.shape[0], nbp, BLOCK),)
    if residual_of is None:
        r_args = (_pad_k(r.astype(jnp.float32), k_pad).reshape(r.shape[0], nbp, BLOCK),)
    else:
        r_args = (_pad_k(residual_of[0], k_pad).reshape(r.shape[0], nbp, BLOCK),
                  residual_of[1].astype(jnp.float32))
    if select is not None:
        scale_args = sel_args
    else:
        scale_args = (_pad_k(scales.astype(jnp.float32), nbp),
                      coded[1].astype(jnp.float32) if coded is not None
                      else _pad_k(reciprocals.astype(jnp.float32), nbp))
    index_args = [a for a in (q_rows, r_rows) if a is not None]
    aliased = config.padding_rows == "nan"
    kernel = functools.partial(_kernel, m=m, has_q=q_rows is not None,
                               has_r=r_rows is not None, block_rows=config.block_rows,
                               blocks_k=config.block_k // BLOCK,
                               write_empty=config.padding_rows == "zeros", aliased=aliased,
                               recompute=residual_of is not None, placed=placed is not None,
                               coded=coded is not None,
                               recompute_placed=config.recompute_placed, select=sel_static,
                               exact_division=(select is not None and not interpret
                                               and select.config.exact_division))
    return window_operand_call(kernel, window_rows, m, (*index_args, *b0_args, *r_args,
                                                         *scale_args),
                               (2,), k_pad, b0.dtype, config, interpret, "rac_operands",
                               poisoned=aliased, into=placed, row_output=select is not None)


def window_operand_call(kernel, window_rows: jax.Array, m: int, args: tuple, lead: tuple,
                        k_pad: int, dtype, config: RACOperandsConfig, interpret: bool,
                        name: str, poisoned: bool = False,
                        into: jax.Array | None = None, row_output: bool = False):
    """Run a window-operand kernel (``rac_operands``, ``act_operands``): one program per
    ``config.block_rows`` window rows by ``config.block_k`` columns, its first operand the
    window rows padded with empty rows (``m``) to a whole number of programs, then ``args``,
    every one whole. Output ``lead + [P, k_pad]`` in ``dtype``; ``poisoned``: into a
    NaN-filled buffer the output aliases (``padding_rows="nan"``); ``into``: into this buffer
    (``lead + [P, k_pad]``, aliased, passed to the kernel last before the output);
    ``row_output``: a second output, float32 ``[P]`` (one value per window row), returned
    with the first."""
    p = window_rows.shape[0]
    bp = config.block_rows
    p_pad = -(-p // bp) * bp
    wr = window_rows if p_pad == p else jnp.pad(window_rows, (0, p_pad - p), constant_values=m)
    out_shape = (*lead, p_pad, k_pad // BLOCK, BLOCK)
    if into is not None:
        poison, poisoned = (into.astype(dtype).reshape(out_shape),), True
    else:
        poison = (jnp.full(out_shape, jnp.nan, dtype),) if poisoned else ()
    vary, args = varying_operands(wr, *args, *poison)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
    shapes = [jax.ShapeDtypeStruct(out_shape, dtype, **vary)]
    if row_output:
        shapes.append(jax.ShapeDtypeStruct((p_pad,), jnp.float32, **vary))
    outs = pl.pallas_call(
        kernel,
        grid=(p_pad // bp, k_pad // config.block_k),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(o) for o in shapes],
        out_shape=shapes,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        input_output_aliases={len(args) - 1: 0} if poisoned else {},
        name=name,
    )(*args)
    out = outs[0].reshape(*lead, p_pad, k_pad)
    out = out if p_pad == p else out[..., :p, :]
    return (out, outs[1][:p]) if row_output else out


def rac_stacked_operands_reference(b0, r, scales, reciprocals, window_rows, q_rows=None,
                                   r_rows=None, *, k_pad: int) -> jax.Array:
    """The jnp path (``w4a4_matmul.operand_rows`` without the kernel) on the same inputs."""
    m = scales.shape[0]
    q_src = window_rows if q_rows is None else rac.rows_or_fill(q_rows, window_rows,
                                                                  b0.shape[0])
    act = rac.rows_or_fill(b0, q_src, 0)
    sel = rac.SelectedResidual(r=r.astype(jnp.float32), scales=scales,
                               reciprocals=reciprocals, mask=scales != 0,
                               global_scale=jnp.ones((m,), jnp.float32), rows=r_rows)
    res = sel.unscaled(window_rows).astype(b0.dtype)
    pad = ((0, 0), (0, k_pad - b0.shape[1]))
    return jnp.stack([jnp.pad(act, pad), jnp.pad(res, pad)])
