"""RAC's per-expert block selection and residual scales in one kernel (Pallas, Triton backend).

For a grouped (MoE) W4A4 GEMM with ``online_batch`` selection, RAC picks one block set per
expert from the summed residual scores of the expert's GEMM rows, then gives every GEMM row a
residual decode scale (the amax of its selected blocks / 2688) and each selected block its E4M3
scale and code reciprocal (``quads_jax.quant.rac.select_residual``). Written in jnp that is a
scatter-add (the per-expert sums), a pairwise rank, a row reduction and two elementwise passes:
on the H200 (2026-12-03 trace of the decode step, batch 128) about 11 us of small XLA kernels
for gate_up and 8 us for down, per layer. Here it is one kernel per GEMM.

One program per expert ``e`` (``grid = (E,)``) walks the expert's GEMM rows ``[start_e,
start_e + group_sizes[e])`` twice, ``block_rows`` rows per step (a gather of their distinct
rows); the last expert also takes any rows past ``sum(group_sizes)``, as the jnp path's clipped
row experts do. It

1. sums the score rows ``scores[rows[i]]``, ranks the sums like
   ``rac.stable_descending_rank`` (ties to the lower block, NaN last) and keeps the top
   ``n_keep`` blocks;
2. for each row: ``g = decode_scale_from_amax(max(amax over the kept blocks))`` and the block
   scales and reciprocals of ``nvfp4.block_scales_f32_from_amax`` -- the same jnp functions the
   reference calls, traced into the kernel, so there is no second quantizer to drift.

Shapes: scores / amax float32 and finite bool ``[R, nb]`` (one row per distinct activation
row), rows int32 ``[M]`` (GEMM row -> distinct row), group_sizes int ``[E]``. Outputs: block
scales float32 ``[M, nb]`` (E4M3 values, 0 outside the selection), reciprocals float32
``[M, nb]`` (0 outside), mask bool ``[M, nb]``, decode scales float32 ``[M]``.

Triton needs power-of-two block shapes: ``nb`` and ``E`` are padded in the wrapper (scores with
NaN, which ranks after every real block and never before one; the pad columns are dropped).
The per-expert sums add a step's rows as a tree, then the steps in order: where float32
addition is inexact the last bit of a sum can differ from ``segment_sum``'s sequential order
(XLA's GPU scatter-add adds in any order anyway), and two sums within an ulp may then rank the
other way. With exactly representable sums (the tests) the results are bit-identical.

The row loop is serial per expert, so the kernel is for decode-sized GEMMs: ``MAX_ROWS``
bounds where ``pallas_kernels.w4a4_grouped`` uses it (prefill keeps the jnp path).

Measured on the H200 (2026-12-03, ``kernel_probe --rac-select``, traced): at uniform routing
(largest expert 15-17 rows) 7.5 / 6.5 us for gate_up / down against 14.1 / 10.7 us for the jnp
path's 8 kernels, but its time grows with the largest expert (55 rows: 18.8 us; 225: 41 us),
and in the rollout's decode step (random-init router) it took 14.3 + 11.1 us per layer: the
step was 18.66 ms against 18.47 with jnp. So it is off by default
(``W4A4MatmulConfig.rac_select_kernel``). A faster design would split the per-row scale coding
(parallel over row blocks) from the per-expert selection.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.vma import varying_operands
from quads_jax.quant import arith, nvfp4, ops, rac

# GEMM rows above which the grouped matmuls keep the jnp selection (prefill): an expert's rows
# are walked serially, ~2 048 per expert at 262 144 rows over 128 experts.
MAX_ROWS = 16384


@dataclasses.dataclass(frozen=True)
class RACSelectConfig:
    """block_rows: GEMM rows an expert's program loads per loop step (a power of two; most
    decode experts have fewer rows); num_warps: Triton warps per program; exact_division:
    divide with ``div.rn.f32`` on the GPU (False: Triton's approximate ``div.full.f32``)."""

    block_rows: int = 16
    num_warps: int = 4
    # False: the same division as XLA:GPU's jnp path. On the H200 XLA's float32 1 / x differs
    # from the IEEE quotient on 13.5 % of values (2026-12-03, kernel_probe --rac-select), and
    # the kernel with div.full.f32 matched the jnp path bit for bit (div.rn.f32: 8 388 of
    # 131 072 reciprocals differed). In interpret mode both are jnp's division.
    exact_division: bool = False

    def __post_init__(self):
        br = self.block_rows
        if not isinstance(br, int) or br < 1 or br & (br - 1):
            raise ValueError(f"RACSelectConfig.block_rows={br!r}: a power of two >= 1")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"RACSelectConfig.num_warps={self.num_warps}: one of 1, 2, 4, 8")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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


def _div_rn(a, b) -> jax.Array:
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
    with arith.division(_div_rn if exact_division else None):
        _select_and_code(*refs, **static)


def _select_and_code(gs_ref, rows_ref, scores_ref, amax_ref, finite_ref,
                     s_ref, rcp_ref, mask_ref, g_ref, *, num_experts: int, nb: int,
                     n_keep: int, m: int, block_rows: int):
    e = pl.program_id(0)
    gs = gs_ref[...]  # [Ep]
    ids = jnp.arange(gs.shape[0])
    start = jnp.sum(jnp.where(ids < e, gs, 0))
    end = jnp.where(e == num_experts - 1, m, start + jnp.sum(jnp.where(ids == e, gs, 0)))
    steps = (end - start + block_rows - 1) // block_rows
    lane = jnp.arange(block_rows)
    real = jnp.arange(scores_ref.shape[1]) < nb

    def rows_at(c):  # the step's GEMM rows, whether each is the expert's, their distinct rows
        i0 = start + c * block_rows
        return i0, (i0 + lane) < end, rows_ref[pl.ds(i0, block_rows)]

    def add_scores(c, acc):
        _, valid, t = rows_at(c)
        return acc + jnp.sum(jnp.where(valid[:, None], scores_ref[t, :], 0.0), axis=0)

    total = jax.lax.fori_loop(0, steps, add_scores, jnp.zeros(real.shape, jnp.float32))
    total = jnp.where(real, total, jnp.nan)  # pad columns rank last (NaN)
    keep = ((rac.stable_descending_rank(total) < n_keep) & real)[None, :]

    def code_rows(c, carry):
        i0, valid, t = rows_at(c)
        a = amax_ref[t, :]
        g = nvfp4.decode_scale_from_amax(jnp.max(jnp.where(keep, a, 0.0), axis=1))  # [BR]
        s, r = nvfp4.block_scales_f32_from_amax(a, finite_ref[t, :] != 0, g[:, None])
        rows, ok = pl.ds(i0, block_rows), valid[:, None]
        pltriton.store(s_ref.at[rows, :], jnp.where(keep, s, 0.0), mask=ok)
        pltriton.store(rcp_ref.at[rows, :], jnp.where(keep, r, 0.0), mask=ok)
        pltriton.store(mask_ref.at[rows, :], jnp.broadcast_to(keep, s.shape).astype(jnp.int32),
                       mask=ok)
        pltriton.store(g_ref.at[rows, :], g[:, None], mask=ok)
        return carry

    jax.lax.fori_loop(0, steps, code_rows, 0)


@functools.partial(jax.jit, static_argnames=("ratio", "config", "interpret"))
def grouped_rac_selection(scores: jax.Array, amax: jax.Array, finite: jax.Array,
                          rows: jax.Array, group_sizes: jax.Array, *, ratio: float,
                          config: RACSelectConfig = RACSelectConfig(),
                          interpret: bool = False):
    """RAC selection per expert and the residual's scales per GEMM row (module docstring).

    Returns ``(scales f32 [M, nb], reciprocals f32 [M, nb], mask bool [M, nb], g f32 [M])``.
    """
    r_rows, nb = scores.shape
    if amax.shape != (r_rows, nb) or finite.shape != (r_rows, nb):
        raise ValueError(f"grouped_rac_selection: scores {scores.shape}, amax {amax.shape} and "
                         f"finite {finite.shape} must all be [R, nb]")
    if rows.ndim != 1 or group_sizes.ndim != 1:
        raise ValueError(f"grouped_rac_selection: rows {rows.shape} must be [M] and "
                         f"group_sizes {group_sizes.shape} [E]")
    m, e = rows.shape[0], group_sizes.shape[0]
    nbp, ep = _pow2(nb), _pow2(e)
    n_keep = rac.kept_blocks(ratio, nb)  # rac.select_blocks' count
    br = config.block_rows
    mp = m + br  # a step's rows [i0, i0 + br) stay inside: no clamped window in interpret mode
    pad = ((0, 0), (0, nbp - nb))
    scores_p = jnp.pad(scores.astype(jnp.float32), pad, constant_values=jnp.nan)
    amax_p = jnp.pad(amax.astype(jnp.float32), pad)
    finite_p = jnp.pad(finite.astype(jnp.int32), pad, constant_values=1)
    gs_p = jnp.pad(group_sizes.astype(jnp.int32), (0, ep - e))
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    rows_p = jnp.pad(rows.astype(jnp.int32), (0, br))
    vary, (gs_p, rows_p, scores_p, amax_p, finite_p) = varying_operands(
        gs_p, rows_p, scores_p, amax_p, finite_p)
    kernel = functools.partial(_kernel, num_experts=e, nb=nb, n_keep=n_keep, m=m,
                               block_rows=br,
                               exact_division=config.exact_division and not interpret)
    s, rcp, mask, g = pl.pallas_call(
        kernel,
        grid=(e,),
        in_specs=[whole((ep,)), whole((mp,)), whole((r_rows, nbp)), whole((r_rows, nbp)),
                  whole((r_rows, nbp))],
        out_specs=[whole((mp, nbp)), whole((mp, nbp)), whole((mp, nbp)), whole((mp, 1))],
        out_shape=[jax.ShapeDtypeStruct((mp, nbp), jnp.float32, **vary),
                   jax.ShapeDtypeStruct((mp, nbp), jnp.float32, **vary),
                   jax.ShapeDtypeStruct((mp, nbp), jnp.int32, **vary),
                   jax.ShapeDtypeStruct((mp, 1), jnp.float32, **vary)],
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="rac_select",
    )(gs_p, rows_p, scores_p, amax_p, finite_p)
    return s[:m, :nb], rcp[:m, :nb], mask[:m, :nb] != 0, g[:m, 0]


def grouped_rac_selection_reference(scores, amax, finite, rows, group_sizes, *, ratio: float):
    """The jnp path (``rac.selection_mask`` + the per-row scales of ``rac.select_residual``)
    on the same inputs: what the kernel must equal."""
    m, e = rows.shape[0], group_sizes.shape[0]
    # Each GEMM row's expert (w4a4_grouped.row_experts), rows past the groups in the last one.
    rexp = jnp.minimum(ops.count_le(jnp.cumsum(group_sizes), jnp.arange(m, dtype=jnp.int32)),
                       e - 1)
    recipe = types.SimpleNamespace(rac_selection="online_batch", rac_score="residual_l2",
                                   rac_ratio=ratio, rac_energy_target=None)
    mask = rac.selection_mask(scores, recipe, rows=rows, row_expert=rexp, num_experts=e)
    a, f = amax[rows], finite[rows]
    g = nvfp4.decode_scale_from_amax(jnp.max(jnp.where(mask, a, 0.0), axis=-1))
    s, r = nvfp4.block_scales_f32_from_amax(a, f, g[:, None])
    return jnp.where(mask, s, 0.0), jnp.where(mask, r, 0.0), mask, g
