"""Plain W4A4's B operand straight from the activations, in one kernel (Pallas, Triton).

Without RAC the tile kernels read one operand ``[P, Kp]`` as row windows (``token_tiles``): at
each of its ``P`` rows the GEMM row ``window_rows[p]`` (``>= M``: a zero row), that row's
NVFP4-quantized activation values ``e2m1 * s_b`` (the global scale ``g`` is applied in the
kernels' epilogue). In jnp that is the quantizer's passes over the distinct rows (block amax
and finiteness, block scales, codes) and a gather that decodes the codes into the window rows:
on the H200 (2026-12-04, b79a63f, nvfp4 decode step at batch 128, traced) six kernels of 1-6
us per GEMM (gate_up 14.6 us, down 12 us per layer). Here one program quantizes ``block_rows``
window rows by ``block_k`` columns of their distinct rows (which stay in L2) and writes the
values once; only the per-row decode scale ``g`` (an amax over the whole row) is computed
before, by XLA (``nvfp4.compute_global_scale``, the quantizer's own).

The arithmetic is the quantizer's own, traced into the kernel: ``nvfp4.block_amax``'s rule,
``nvfp4.block_scales_f32_from_amax`` (exact E4M3 rounding, the explicit reciprocal) and
``nvfp4.round_to_e2m1_value``. Triton's float32 division is XLA:GPU's (bit-identical on the
H200, ``rac_select``'s finding), so the result equals the jnp path bit for bit (tests in
interpret mode; ``kernel_probe --act-operands`` on the GPU: 0 values differ).

Measured on the H200 (2026-12-04, 8619555, traced): gate_up's ``[1936, 2048]`` 10.6 us (12.8
us with the row-scale reduce, 3 kernels, against the jnp path's 14.9 us in 7), down's ``[1936,
768]`` 5.1 us (7.6 against 10.7 in 6). It is bound by its arithmetic, not its write (floor /
time 0.29 / 0.24): each window row re-quantizes its distinct row.

Shapes and dtypes: ``x`` ``[R, K]`` (bf16 / f16 / f32, K % 16 == 0), ``g`` float32 ``[R]``,
``window_rows`` int32 ``[P]``, ``q_rows`` None (GEMM row = distinct row) or int32 ``[M]``.
Output ``[P, Kp]`` in ``dtype`` (float16 / bfloat16: exact), K zero-padded to ``Kp``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.rac_operands import RACOperandsConfig, window_operand_call, window_program
from pallas_kernels.w4a4_matmul import _pad_k
from quads_jax.quant import nvfp4

BLOCK = nvfp4.BLOCK_SIZE

# The window-operand kernels share one tuning dataclass (block_rows, block_k, num_warps,
# padding_rows): the same grid over window rows and columns.
ActOperandsConfig = RACOperandsConfig


def _kernel(wr_ref, *refs, m: int, has_q: bool, block_rows: int, blocks_k: int,
            write_empty: bool):
    refs = list(refs)
    q_ref = refs.pop(0) if has_q else None
    x_ref, g_ref, out_ref = refs
    rows, cols, valid, g_idx = window_program(wr_ref, m, block_rows, blocks_k)
    src = q_ref[g_idx] if has_q else g_idx
    xb = x_ref[src, cols, :].astype(jnp.float32)  # [BP, blocks_k, 16]
    vals = nvfp4.unscaled_block_values(xb, g_ref[src][:, None, None])
    keep = valid[:, None, None]
    mask = None if write_empty else jnp.broadcast_to(keep, vals.shape)
    pltriton.store(out_ref.at[rows, cols, :], jnp.where(keep, vals, 0.0).astype(out_ref.dtype),
                   mask=mask)


@functools.partial(jax.jit, static_argnames=("k_pad", "dtype", "config", "interpret"))
def act_window_operand(x: jax.Array, g: jax.Array, window_rows: jax.Array,
                       q_rows: jax.Array | None = None, *, k_pad: int, dtype=jnp.float16,
                       config: ActOperandsConfig | None = None,
                       interpret: bool = False) -> jax.Array:
    """The windowed operand ``[P, Kp]`` (module docstring); config None: the defaults."""
    config = config or ActOperandsConfig()
    if (x.ndim != 2 or x.shape[1] % BLOCK
            or jnp.dtype(x.dtype) not in nvfp4.FLOAT_DTYPES):
        raise ValueError(f"act_window_operand: x {x.dtype}{list(x.shape)} must be a float "
                         f"[R, K] with K % {BLOCK} == 0")
    r_rows, k = x.shape
    if g.shape != (r_rows,):
        raise ValueError(f"act_window_operand: g {list(g.shape)} must be [R] = [{r_rows}]")
    if k_pad < k or k_pad % config.block_k:
        raise ValueError(f"act_window_operand: k_pad={k_pad} must be >= K={k} and a multiple "
                         f"of block_k={config.block_k}")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"act_window_operand: dtype {dtype}; float16 or bfloat16")
    for name, idx in (("window_rows", window_rows), ("q_rows", q_rows)):
        if idx is not None and (idx.ndim != 1 or idx.dtype != jnp.int32):
            raise ValueError(f"act_window_operand: {name} {idx.dtype}{list(idx.shape)}; need "
                             "int32 [n]")
    if config.padding_rows == "nan":
        raise ValueError("act_window_operand: padding_rows 'nan' is rac_operands' test mode; "
                         "use 'zeros' or 'skip'")
    m = r_rows if q_rows is None else q_rows.shape[0]
    xb = _pad_k(x, k_pad).reshape(r_rows, k_pad // BLOCK, BLOCK)
    kernel = functools.partial(_kernel, m=m, has_q=q_rows is not None,
                               block_rows=config.block_rows, blocks_k=config.block_k // BLOCK,
                               write_empty=config.padding_rows == "zeros")
    args = (*(() if q_rows is None else (q_rows,)), xb, g.astype(jnp.float32))
    return window_operand_call(kernel, window_rows, m, args, (), k_pad, dtype, config,
                               interpret, "act_operands")


def row_decode_scales(x: jax.Array) -> jax.Array:
    """float32 ``[R]``: the per-token decode scale ``g`` of each row of ``x [R, K]``, the
    quantizer's own (``nvfp4.compute_global_scale(x, "row")``)."""
    return nvfp4.compute_global_scale(x, "row")[:, 0]


def act_window_operand_reference(x, window_rows, q_rows=None, *, k_pad: int,
                                 dtype=jnp.float16) -> jax.Array:
    """The jnp path (per-token ``nvfp4_quantize`` then ``w4a4_matmul.plain_operand``)."""
    from pallas_kernels import nvfp4_quantize as aq
    from pallas_kernels.w4a4_matmul import plain_operand, source_tile_rows

    acts = aq.nvfp4_quantize(x, act_scale_mode="per_token")
    b0, g0 = aq.mma_operand(acts.q, dtype)
    idx = window_rows if q_rows is None else source_tile_rows(q_rows, b0.shape[0], window_rows)
    return plain_operand(b0, idx, dtype, k_pad, g0)[0]
