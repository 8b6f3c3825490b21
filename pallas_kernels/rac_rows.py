"""RAC's row pass: per-token NVFP4 activations and their residual's block statistics in one
kernel (Pallas, Triton backend).

Before RAC selects blocks (``quads_jax.quant.rac.select_residual``) every distinct activation
row is quantized and its residual ``R = x - dq(Q(x))`` reduced per 16-element block. In jnp
that is the quantizer's passes (block amax, block finiteness, block scales: separate reductions
XLA does not fuse) and a multi-output fusion for the residual: on the H100 (2026-12-05, the
nvfp4_rac decode step at batch 128, traced against its HLO) five to six kernels of 1.1-3.3 us
per RAC GEMM. Here one program per ``block_rows`` rows by ``block_k`` columns computes, from
the rows and their per-token decode scales ``g`` (the quantizer's own, ``nvfp4.
compute_global_scale(x, "row")``, an XLA row reduction before the kernel, as ``act_operands``):

- the MMA operand values ``e2m1 * s_b`` of ``Q(x)`` in the MMA dtype (exact), what
  ``nvfp4_quantize.mma_operand`` makes from the codes;
- the residual ``R`` in float32 (``x - (e2m1 * s_b) * g``, ``nvfp4.residual``'s arithmetic:
  exact products, so a fused multiply-add gives the same bits);
- the residual's block amax (finite elements only) and finiteness (``nvfp4.block_amax``), and
  the block scores of ``residual_l2`` / ``residual_l1`` (``rac.row_block_scores`` before its
  ``row_valid`` mask, which the caller applies).

The arithmetic is the quantizer's, traced into the kernel (``nvfp4.unscaled_block_values``,
``nvfp4.residual_from_values``, ``nvfp4.block_amax``), as in ``act_operands``.
Sums of 16 elements add in Triton's tree order: a score's last bit can differ from XLA's on
the GPU (as ``rac_select``'s sums), equal in the interpreter (the tests).

In the W4A4 path (``nvfp4_quantize``'s ``row_pass``) the residual itself is not written
(``with_residual=False``): ``rac_operands`` recomputes it from ``x`` and the values.

Shapes and dtypes: ``x`` ``[R, K]`` bf16 / f16 / f32 with K % 16 == 0, ``g`` float32 ``[R]``.
Outputs (``RowPass``): values ``[R, K]`` in ``dtype``, residual float32 ``[R, K]`` (None
without it), amax float32 and finite bool ``[R, K/16, 1]``, scores float32 ``[R, K/16]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.rac_operands import check_row_grid
from pallas_kernels.triton_grid import masked_index
from pallas_kernels.vma import varying_operands
from quads_jax.quant import nvfp4

BLOCK = nvfp4.BLOCK_SIZE
SCORES = ("residual_l2", "residual_l1")  # act_amax scores x, not R: the jnp path keeps it


@dataclasses.dataclass(frozen=True)
class RACRowsConfig:
    """block_rows: rows per program (a power of two); block_k: columns per program (a power of
    two, a multiple of 16; a smaller power of two where it does not divide K); num_warps:
    Triton warps per program; row_scales, scale_programs: below."""

    block_rows: int = 8
    block_k: int = 256
    num_warps: int = 4
    # row_scales: ``nvfp4_quantize``'s row pass lets the kernel compute the rows' decode
    # scales (``rac_row_pass(g=None)``). A program then holds whole rows; scale_programs: the
    # fewest programs wanted (its rows shrink from block_rows, down to 1, to reach them).
    row_scales: bool = False
    scale_programs: int = 128

    def __post_init__(self):
        check_row_grid(self)
        if not isinstance(self.scale_programs, int) or self.scale_programs < 1:
            raise ValueError(f"RACRowsConfig.scale_programs={self.scale_programs!r}: an int >= 1")

    def whole_row_block(self, r_rows: int) -> int:
        """Rows per program when programs hold whole rows: the largest power of two <=
        block_rows that leaves at least ``scale_programs`` programs for ``r_rows`` rows (1 if
        none does)."""
        br = self.block_rows
        while br > 1 and -(-r_rows // br) < self.scale_programs:
            br //= 2
        return br


class RowPass(NamedTuple):
    """The row pass's outputs (module docstring)."""

    values: jax.Array
    residual: jax.Array
    amax: jax.Array
    finite: jax.Array
    scores: jax.Array
    # The kernel's int8 finiteness [R, K/16] (1 = finite): what the selection kernel reads,
    # where ``finite`` (bool) would be a conversion pass of its own.
    finite_i8: jax.Array | None = None
    # float32 [R]: the rows' decode scales where the kernel computed them (``g=None``).
    g: jax.Array | None = None


def _blocks_per_program(nb: int, block_k: int) -> int:
    """The largest power of two <= block_k / 16 that divides the K/16 blocks."""
    p = block_k // BLOCK
    while nb % p:
        p //= 2
    return p


def _kernel(x_ref, *refs, block_rows: int, blocks_k: int, chunks: int, score: str,
            with_residual: bool, placed: int | None, own_scales: bool):
    refs = list(refs)
    g_ref = None if own_scales else refs.pop(0)
    place_ref = refs.pop(0) if placed is not None else None
    vals_ref = refs.pop(0)
    r_ref = refs.pop(0) if with_residual else None
    amax_ref, fin_ref, score_ref, *g_out = refs
    rows = pl.ds(pl.program_id(0) * block_rows, block_rows)
    if not own_scales:
        cols = pl.ds(pl.program_id(1) * blocks_k, blocks_k)
        _row_chunk(x_ref[rows, cols, :], g_ref[rows][:, None, None], rows, cols, place_ref,
                   vals_ref, r_ref, amax_ref, fin_ref, score_ref, score=score, placed=placed)
        return
    # The program holds whole rows: every chunk loaded at once and kept in registers, their
    # decode scales (the quantizer's finite amax over the chunks, then its division), then
    # each chunk as above. (Re-reading each chunk after the amax, 16 rounds of dependent loads
    # for gate_up's rows, made the kernel 3x slower on an H100.)
    col = [pl.ds(c * blocks_k, blocks_k) for c in range(chunks)]
    xs = [x_ref[rows, cols, :] for cols in col]
    amax = functools.reduce(jnp.maximum, [nvfp4.finite_amax(x, "expert") for x in xs])
    g = nvfp4.decode_scale_from_amax(amax)  # [BR, 1, 1]
    pltriton.store(g_out[0].at[rows], g[:, 0, 0])
    for x, cols in zip(xs, col, strict=True):
        _row_chunk(x, g, rows, cols, place_ref, vals_ref, r_ref, amax_ref, fin_ref,
                   score_ref, score=score, placed=placed)


def _row_chunk(x, g, rows, cols, place_ref, vals_ref, r_ref, amax_ref, fin_ref, score_ref,
               *, score: str, placed: int | None):
    """One program's rows x columns ``x [BR, blocks_k, 16]``: values, residual statistics
    (module docstring)."""
    xb = x.astype(jnp.float32)
    vals = nvfp4.unscaled_block_values(xb, g)  # e2m1 * s_b: exact in f16 / bf16
    r = nvfp4.residual_from_values(xb, vals, g)  # nvfp4.residual's arithmetic
    r_amax, r_finite = nvfp4.block_amax(r)
    sc = jnp.sum(r * r if score == "residual_l2" else jnp.abs(r), axis=-1)
    if placed is None:
        pltriton.store(vals_ref.at[rows, cols, :], vals.astype(vals_ref.dtype))
    else:  # each row to its window row of operand 0 (the stacked buffer's first P rows)
        dest = place_ref[rows]
        ok = dest < placed  # the pad rows of the last program: not written
        # Every dimension an index array (the interpreter's masked store takes no mix of
        # arrays and slices): rows scattered, columns and lanes in order.
        blocks_k = vals.shape[1]
        col = cols.start + jnp.arange(blocks_k, dtype=jnp.int32)
        # (The buffer holds 2 * placed rows: a masked row's index past them.)
        pltriton.store(vals_ref.at[masked_index(ok, dest, 2 * placed)[:, None, None],
                                   col[None, :, None],
                                   jnp.arange(BLOCK, dtype=jnp.int32)[None, None, :]],
                       vals.astype(vals_ref.dtype),
                       mask=jnp.broadcast_to(ok[:, None, None], vals.shape))
    if r_ref is not None:
        pltriton.store(r_ref.at[rows, cols, :], r)
    pltriton.store(amax_ref.at[rows, cols], r_amax[..., 0])
    # int8: a quarter of int32's bytes written here and read by the selection's XLA pass
    pltriton.store(fin_ref.at[rows, cols], r_finite[..., 0].astype(jnp.int8))
    pltriton.store(score_ref.at[rows, cols], sc)


@functools.partial(jax.jit, static_argnames=("score", "dtype", "config", "interpret",
                                             "with_residual", "windows"))
def rac_row_pass(x: jax.Array, g: jax.Array | None, *, score: str = "residual_l2",
                 dtype=jnp.float16, config: RACRowsConfig | None = None,
                 interpret: bool = False, with_residual: bool = True,
                 window_of_row: jax.Array | None = None, windows: int | None = None) -> RowPass:
    """The row pass of rows ``x [R, K]`` with decode scales ``g [R]`` (module docstring).
    ``g`` None: the kernel computes each row's decode scale itself, the quantizer's
    (``nvfp4.compute_global_scale(x, "row")``; ``RowPass.g``), each program holding whole
    rows: the XLA row reduction and its select before the kernel drop out.
    ``with_residual=False``: the float32 residual is not written (``RowPass.residual`` None;
    ``rac_operands`` recomputes it from ``x`` and the values: half the kernel's bytes).

    ``window_of_row`` (int32 ``[R]``, each row's row of a windowed operand of ``windows`` rows,
    distinct, every row placed): the values are written there, into operand 0 of a stacked
    ``[2, windows, K]`` buffer (``RowPass.values``) whose other rows and operand 1 are left
    for ``rac_operands(placed=...)`` to write: the prefill layout where each row fills one
    window row, so the values are written once, in place, and not copied again."""
    config = config or RACRowsConfig()
    if x.ndim != 2 or x.shape[1] % BLOCK or jnp.dtype(x.dtype) not in nvfp4.FLOAT_DTYPES:
        raise ValueError(f"rac_row_pass: x {x.dtype}{list(x.shape)} must be a float [R, K] "
                         f"with K % {BLOCK} == 0")
    r_rows, k = x.shape
    if g is not None and g.shape != (r_rows,):
        raise ValueError(f"rac_row_pass: g {list(g.shape)} must be [R] = [{r_rows}] or None")
    if score not in SCORES:
        raise ValueError(f"rac_row_pass: score={score!r}: one of {SCORES} (act_amax scores "
                         "the activations: the jnp path)")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"rac_row_pass: dtype {dtype}; float16 or bfloat16")
    if (window_of_row is None) != (windows is None) or (
            window_of_row is not None and (window_of_row.shape != (r_rows,)
                                           or window_of_row.dtype != jnp.int32
                                           or windows < r_rows)):
        raise ValueError(f"rac_row_pass: window_of_row {getattr(window_of_row, 'shape', None)} "
                         f"and windows={windows} go together: int32 [R] = [{r_rows}] and an "
                         f"int >= R")
    nb = k // BLOCK
    own_scales = g is None
    br = config.whole_row_block(r_rows) if own_scales else config.block_rows
    r_pad = -(-r_rows // br) * br
    g = () if own_scales else (g.astype(jnp.float32),)
    if r_pad != r_rows:  # whole programs; the pad rows' outputs are dropped
        x = jnp.pad(x, ((0, r_pad - r_rows), (0, 0)))
        g = tuple(jnp.pad(a, (0, r_pad - r_rows), constant_values=1.0) for a in g)
        if window_of_row is not None:
            window_of_row = jnp.pad(window_of_row, (0, r_pad - r_rows), constant_values=windows)
    bk = _blocks_per_program(nb, config.block_k)
    xb = x.reshape(r_pad, nb, BLOCK)
    extra = (*g, *(() if window_of_row is None else (window_of_row,)))
    vary, (xb, *extra) = varying_operands(xb, *extra)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    # Placed values: the stacked [2, windows] buffer as [2 * windows] rows (operand 0 first).
    vals_rows = r_pad if windows is None else 2 * windows
    shapes = [((vals_rows, nb, BLOCK), dtype), ((r_pad, nb, BLOCK), jnp.float32),
              ((r_pad, nb), jnp.float32), ((r_pad, nb), jnp.int8), ((r_pad, nb), jnp.float32)]
    if not with_residual:
        del shapes[1]
    if own_scales:
        shapes.append(((r_pad,), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_kernel, block_rows=br, blocks_k=bk, chunks=nb // bk, score=score,
                          with_residual=with_residual, placed=windows, own_scales=own_scales),
        grid=(r_pad // br, 1 if own_scales else nb // bk),
        in_specs=[whole(a.shape) for a in (xb, *extra)],
        out_specs=[whole(s) for s, _ in shapes],
        out_shape=[jax.ShapeDtypeStruct(s, d, **vary) for s, d in shapes],
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="rac_rows",
    )(xb, *extra)
    outs = list(outs)
    g_out = outs.pop() if own_scales else None
    vals, r, amax, fin, sc = outs if with_residual else (outs[0], None, *outs[1:])
    vals = vals.reshape(r_pad, k) if windows is None else vals.reshape(2, windows, k)
    out = RowPass(vals, None if r is None else r.reshape(r_pad, k),
                  amax[..., None], (fin > 0)[..., None], sc, fin, g_out)
    if r_pad == r_rows:
        return out
    placed = windows is not None
    return RowPass(*(a if a is None or (placed and a is vals) else a[:r_rows] for a in out))


def rac_row_pass_reference(x: jax.Array, score: str = "residual_l2",
                           dtype=jnp.float16) -> tuple[RowPass, jax.Array]:
    """The jnp path on the same rows: ``(RowPass, g [R])`` from the per-token quantizer,
    ``nvfp4.residual``, ``nvfp4.block_amax`` and ``rac.row_block_scores``."""
    from quads_jax.quant import rac

    q = nvfp4.quantize_activations(x, "per_token")
    vals = nvfp4.unscaled_values(q).astype(dtype)
    r = nvfp4.residual(x, q)
    amax, finite = nvfp4.block_amax(rac.block_view(r))
    return (RowPass(vals, r, amax, finite, rac.row_block_scores(x, r, score),
                    finite[..., 0].astype(jnp.int8)),
            q.global_scale[:, 0])
