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

``rac_coded_operands`` (``RACOperandsConfig.code_scales``, opt-in until measured on the GPU)
also codes the residual's scales here: each program recomputes its rows' decode scales from
the distinct rows' block amax and the selection table (``rac.selection_table``: one block set
per expert, read through each GEMM row's expert) and its blocks' scales and reciprocals with
``nvfp4``'s functions, and writes the decode scale of each window row; on the H200 the jnp
path coded them in three XLA kernels per GEMM before this one (the per-row max, the decode
scale, the block scales and reciprocals ``[M, K/16]``).

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

from pallas_kernels.vma import varying_operands
from pallas_kernels.w4a4_matmul import _pad_k
from quads_jax.quant import nvfp4

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
    Not yet measured on the GPU: "skip" is opt-in (``W4A4MatmulConfig.rac_operand_padding``).

    code_scales: ``operand_rows`` calls ``rac_coded_operands`` where the residual allows
    (``SelectedResidual.row_scaled`` with its block amax): the residual's decode scales, block
    scales and reciprocals are coded in this kernel from the block amax and the selection
    table, not by three XLA kernels before it (opt-in until measured on the GPU).
    """

    block_rows: int = 8
    block_k: int = 256
    num_warps: int = 4
    padding_rows: str = "zeros"
    code_scales: bool = False

    def __post_init__(self):
        for name in ("block_rows", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"RACOperandsConfig.{name}={v!r}: a power of two >= 1")
        if self.block_k < BLOCK:
            raise ValueError(f"RACOperandsConfig.block_k={self.block_k}: at least {BLOCK}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"RACOperandsConfig.num_warps={self.num_warps}: one of 1, 2, 4, 8")
        if self.padding_rows not in PADDING_ROWS:
            raise ValueError(f"RACOperandsConfig.padding_rows={self.padding_rows!r}: one of "
                             f"{PADDING_ROWS}")


def window_program(wr_ref, m: int, block_rows: int, blocks_k: int):
    """A window-operand program's rows and columns (``blocks_k`` 16-element blocks) and its
    rows' GEMM rows: ``(rows, cols, valid [BP], gemm_row [BP])``, empty rows (``>= m``) read
    row 0 (zeroed or skipped by the caller's store)."""
    rows = pl.ds(pl.program_id(0) * block_rows, block_rows)
    cols = pl.ds(pl.program_id(1) * blocks_k, blocks_k)
    gemm_row = wr_ref[rows]
    valid = gemm_row < m
    return rows, cols, valid, jnp.where(valid, gemm_row, 0)


def _coded_scales(amax_ref, fin_ref, table_ref, trow_ref, g, r_src, cols):
    """``code_scales``: a window-row block's residual scales and reciprocals ``[BP, blocks_k]``
    and its rows' decode scales ``[BP]``, coded as ``rac.select_residual`` codes them: the
    row's decode scale from its selected blocks' largest amax (the whole row; padded columns
    are unselected zeros), then each block's scale and reciprocal, zero outside the
    selection."""
    t = trow_ref[g]
    whole_row = jnp.where(table_ref[t, :] != 0, amax_ref[r_src, :], 0.0)  # [BP, nb2]
    g1 = nvfp4.decode_scale_from_amax(jnp.max(whole_row, axis=1))  # [BP]
    keep = table_ref[t, cols] != 0
    s, rcp = nvfp4.block_scales_f32_from_amax(amax_ref[r_src, cols], fin_ref[r_src, cols] != 0,
                                              g1[:, None])
    return jnp.where(keep, s, 0.0), jnp.where(keep, rcp, 0.0), g1


def _kernel(wr_ref, *refs, m: int, has_q: bool, has_r: bool, block_rows: int,
            blocks_k: int, write_empty: bool, aliased: bool, code_scales: bool = False):
    refs = list(refs)
    q_ref = refs.pop(0) if has_q else None
    rr_ref = refs.pop(0) if has_r else None
    n_in = 6 if code_scales else 4  # b0, r, then scales + reciprocals or what codes them
    if aliased:  # the NaN-filled buffer the output aliases: never read here
        del refs[n_in]
    (b0_ref, r_ref, *scale_refs), (out_ref, *g_out) = refs[:n_in], refs[n_in:]
    rows, cols, valid, g = window_program(wr_ref, m, block_rows, blocks_k)
    q_src = q_ref[g] if has_q else g
    r_src = rr_ref[g] if has_r else g
    if code_scales:
        s, rcp, g1 = _coded_scales(*scale_refs, g, r_src, cols)
    else:
        s_ref, rcp_ref = scale_refs
        s, rcp = s_ref[g, cols], rcp_ref[g, cols]
    act = b0_ref[q_src, cols, :]  # [BP, blocks_k, 16]
    res = nvfp4.round_to_e2m1_value(r_ref[r_src, cols, :] * rcp[..., None]) * s[..., None]
    keep = valid[:, None, None]
    # Rows without a GEMM row: zeros, or left as they are (RACOperandsConfig.padding_rows).
    mask = None if write_empty else jnp.broadcast_to(keep, act.shape)[None]
    for a, val in enumerate((jnp.where(keep, act, 0), jnp.where(keep, res, 0.0))):
        # Operand a as a 1-long slice, not an int index: the interpreter's masked store takes
        # slices and arrays only.
        pltriton.store(out_ref.at[pl.ds(a, 1), rows, cols, :],
                       val.astype(out_ref.dtype)[None], mask=mask)
    if code_scales:  # each window row's decode scale (0: empty), from the first column block
        first = jnp.broadcast_to(pl.program_id(1) == 0, valid.shape)
        pltriton.store(g_out[0].at[rows], jnp.where(valid, g1, 0.0), mask=first)


def _check_rows(fn: str, m: int, **index) -> None:
    """The index arrays (None or int32 vectors; those but ``window_rows`` of length M)."""
    for name, idx in index.items():
        if idx is not None and (idx.ndim != 1 or idx.dtype != jnp.int32):
            raise ValueError(f"{fn}: {name} {idx.dtype}{list(idx.shape)}; need int32 [n]")
        if idx is not None and name != "window_rows" and idx.shape[0] != m:
            raise ValueError(f"{fn}: {name} has {idx.shape[0]} rows; need M={m}")


@functools.partial(jax.jit, static_argnames=("k_pad", "config", "interpret"))
def rac_stacked_operands(b0: jax.Array, r: jax.Array, scales: jax.Array,
                         reciprocals: jax.Array, window_rows: jax.Array,
                         q_rows: jax.Array | None = None, r_rows: jax.Array | None = None, *,
                         k_pad: int, config: RACOperandsConfig = RACOperandsConfig(),
                         interpret: bool = False) -> jax.Array:
    """The stacked operands ``[2, P, Kp]`` (module docstring)."""
    m, nb = scales.shape
    k = r.shape[1]
    if b0.shape[1] != k or nb * BLOCK != k or reciprocals.shape != (m, nb):
        raise ValueError(f"rac_stacked_operands: b0 {b0.shape}, r {r.shape}, scales "
                         f"{scales.shape} and reciprocals {reciprocals.shape} must be [R0, K], "
                         f"[R, K], [M, K/16], [M, K/16]")
    if k_pad < k or k_pad % config.block_k:
        raise ValueError(f"rac_stacked_operands: k_pad={k_pad} must be >= K={k} and a "
                         f"multiple of block_k={config.block_k}")
    _check_rows("rac_stacked_operands", m, window_rows=window_rows, q_rows=q_rows,
                r_rows=r_rows)
    nbp = k_pad // BLOCK
    b0_blocks = _pad_k(b0, k_pad).reshape(b0.shape[0], nbp, BLOCK)
    r_blocks = _pad_k(r.astype(jnp.float32), k_pad).reshape(r.shape[0], nbp, BLOCK)
    s = _pad_k(scales.astype(jnp.float32), nbp)
    rcp = _pad_k(reciprocals.astype(jnp.float32), nbp)
    index_args = [a for a in (q_rows, r_rows) if a is not None]
    aliased = config.padding_rows == "nan"
    kernel = functools.partial(_kernel, m=m, has_q=q_rows is not None,
                               has_r=r_rows is not None, block_rows=config.block_rows,
                               blocks_k=config.block_k // BLOCK,
                               write_empty=config.padding_rows == "zeros", aliased=aliased)
    return window_operand_call(kernel, window_rows, m, (*index_args, b0_blocks, r_blocks, s, rcp),
                               (2,), k_pad, b0.dtype, config, interpret, "rac_operands",
                               poisoned=aliased)


def window_operand_call(kernel, window_rows: jax.Array, m: int, args: tuple, lead: tuple,
                        k_pad: int, dtype, config: RACOperandsConfig, interpret: bool,
                        name: str, poisoned: bool = False, row_outputs: int = 0):
    """Run a window-operand kernel (``rac_operands``, ``act_operands``): one program per
    ``config.block_rows`` window rows by ``config.block_k`` columns, its first operand the
    window rows padded with empty rows (``m``) to a whole number of programs, then ``args``,
    every one whole. Output ``lead + [P, k_pad]`` in ``dtype``; ``poisoned``: into a
    NaN-filled buffer the output aliases (``padding_rows="nan"``); ``row_outputs``: that many
    float32 ``[P]`` outputs more (one value per window row), returned after it."""
    p = window_rows.shape[0]
    bp = config.block_rows
    p_pad = -(-p // bp) * bp
    wr = window_rows if p_pad == p else jnp.pad(window_rows, (0, p_pad - p), constant_values=m)
    out_shape = (*lead, p_pad, k_pad // BLOCK, BLOCK)
    poison = (jnp.full(out_shape, jnp.nan, dtype),) if poisoned else ()
    vary, args = varying_operands(wr, *args, *poison)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
    row_shape = jax.ShapeDtypeStruct((p_pad,), jnp.float32, **vary)
    outs = pl.pallas_call(
        kernel,
        grid=(p_pad // bp, k_pad // config.block_k),
        in_specs=[whole(a) for a in args],
        out_specs=[pl.BlockSpec(out_shape, lambda i, j: (0,) * len(out_shape))]
        + [whole(row_shape)] * row_outputs,
        out_shape=[jax.ShapeDtypeStruct(out_shape, dtype, **vary)] + [row_shape] * row_outputs,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        input_output_aliases={len(args) - 1: 0} if poisoned else {},
        name=name,
    )(*args)
    out = outs[0].reshape(*lead, p_pad, k_pad)
    out = out if p_pad == p else out[..., :p, :]
    if not row_outputs:
        return out
    return (out, *(r[:p] for r in outs[1:]))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("k_pad", "config", "interpret"))
def rac_coded_operands(b0: jax.Array, r: jax.Array, amax: jax.Array, finite: jax.Array,
                       mask_table: jax.Array, mask_rows: jax.Array | None,
                       window_rows: jax.Array, q_rows: jax.Array | None = None,
                       r_rows: jax.Array | None = None, *, k_pad: int,
                       config: RACOperandsConfig = RACOperandsConfig(),
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``rac_stacked_operands`` with the residual's scales coded in the kernel: from the
    distinct rows' block amax ``amax`` (float32 ``[R, K/16]``) and finiteness ``finite``
    (bool ``[R, K/16]``) and the selection as a table (``mask_table`` bool ``[Q, K/16]``,
    ``mask_rows`` int32 ``[M]`` or None: row i's mask is ``mask_table[mask_rows[i]]``,
    ``rac.selection_table``). Each GEMM row's decode scale is ``decode_scale_from_amax`` of
    its selected blocks' largest amax (``SelectedResidual.row_scaled``). Returns the stacked
    operands ``[2, P, Kp]`` and each window row's decode scale float32 ``[P]`` (0 for empty
    rows): bit for bit ``rac_stacked_operands`` of ``rac.select_residual``'s scales and
    ``rows_or_fill(global_scale, window_rows, 0)``."""
    k = r.shape[1]
    nb = k // BLOCK
    m = mask_table.shape[0] if mask_rows is None else mask_rows.shape[0]
    if (b0.shape[1] != k or k % BLOCK or amax.shape != (r.shape[0], nb)
            or finite.shape != amax.shape or mask_table.ndim != 2 or mask_table.shape[1] != nb):
        raise ValueError(f"rac_coded_operands: b0 {b0.shape}, r {r.shape}, amax {amax.shape}, "
                         f"finite {finite.shape} and mask_table {mask_table.shape} must be "
                         f"[R0, K], [R, K], [R, K/16], [R, K/16], [Q, K/16]")
    if k_pad < k or k_pad % config.block_k:
        raise ValueError(f"rac_coded_operands: k_pad={k_pad} must be >= K={k} and a "
                         f"multiple of block_k={config.block_k}")
    if mask_rows is None:
        mask_rows = jnp.arange(m, dtype=jnp.int32)
    _check_rows("rac_coded_operands", m, window_rows=window_rows, q_rows=q_rows,
                r_rows=r_rows, mask_rows=mask_rows)
    # Whole rows of the per-block arrays are loaded (the decode scale's max): Triton shapes
    # are powers of two, so their columns are padded (amax 0, unselected, finite).
    nbp, nb2 = k_pad // BLOCK, _pow2(k_pad // BLOCK)
    b0_blocks = _pad_k(b0, k_pad).reshape(b0.shape[0], nbp, BLOCK)
    r_blocks = _pad_k(r.astype(jnp.float32), k_pad).reshape(r.shape[0], nbp, BLOCK)
    a = _pad_k(amax.astype(jnp.float32), nb2)
    f = jnp.pad(finite.astype(jnp.int32), ((0, 0), (0, nb2 - nb)), constant_values=1)
    tab = _pad_k(mask_table.astype(jnp.int32), nb2)
    index_args = [x for x in (q_rows, r_rows) if x is not None]
    aliased = config.padding_rows == "nan"
    kernel = functools.partial(_kernel, m=m, has_q=q_rows is not None,
                               has_r=r_rows is not None, block_rows=config.block_rows,
                               blocks_k=config.block_k // BLOCK,
                               write_empty=config.padding_rows == "zeros", aliased=aliased,
                               code_scales=True)
    return window_operand_call(kernel, window_rows, m,
                               (*index_args, b0_blocks, r_blocks, a, f, tab, mask_rows),
                               (2,), k_pad, b0.dtype, config, interpret, "rac_operands",
                               poisoned=aliased, row_outputs=1)


def rac_stacked_operands_reference(b0, r, scales, reciprocals, window_rows, q_rows=None,
                                   r_rows=None, *, k_pad: int) -> jax.Array:
    """The jnp path (``w4a4_matmul.operand_rows`` without the kernel) on the same inputs."""
    from quads_jax.quant import rac

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
