"""W4A16: NVFP4 weights, unquantized bf16 activations (the QAT-only ablation arm).

The same Mosaic GPU tile kernel as W4A4, with the bf16 activations as the B operand (exact) and
the weight decoded to bf16 (``e2m1 * s``, exact); the weight's global scale is applied in f32 in
the epilogue, so the result is ``x @ (e2m1 * s)^T * g`` with f32 accumulation. The weights must
be in the bfloat16 kernel layout (an f16 MMA would round bf16 activations).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.w4a4_grouped import (
    _check_group_sizes,
    expected_tiles,
    grouped_block_m,
    tile_plan,
)
from pallas_kernels.w4a4_matmul import (
    W4A4MatmulConfig,
    _check,
    as_kernel_weights,
    plain_operand,
    run_dense,
    run_tiles,
    token_tiles,
)
from quads_jax.quant import nvfp4

_BF16_CONFIG = W4A4MatmulConfig(mma_dtype="bfloat16")


def _weights(w_q, config: W4A4MatmulConfig):
    w = as_kernel_weights(w_q, "bfloat16")
    if w.mma_dtype != "bfloat16":
        raise ValueError(
            f"w_q: kernel layout with mma_dtype={w.mma_dtype!r}; W4A16 needs 'bfloat16' "
            "(prepare_w4a4_weights(..., mma_dtype='bfloat16'))"
        )
    return w


def _operand(x: jax.Array, index: jax.Array, w) -> tuple[tuple[jax.Array], tuple[jax.Array]]:
    """The bf16 rows ``x[index]`` as the kernel's one B operand, scale 1 (0 for zero rows)."""
    rows, scale = plain_operand(x, index, jnp.bfloat16, w.k_pad)
    return (rows,), (scale,)


def w4a16_matmul(
    x: jax.Array, w_q, *, config: W4A4MatmulConfig | None = None, interpret: bool = False
) -> jax.Array:
    """``x [M, K] @ dq(W)^T`` -> ``[M, N]`` in ``x.dtype``; ``w_q`` NVFP4Tensor or bf16 layout."""
    config = config or _BF16_CONFIG
    w = _weights(w_q, config)
    if w.stacked:
        raise ValueError("w_q: stacked experts; use w4a16_grouped_matmul")
    _check(x, w)
    return run_dense(lambda idx: _operand(x, idx, w), x.shape[0], w, config, interpret,
                     x.dtype)


def w4a16_grouped_matmul(
    x_sorted: jax.Array,
    w_q,
    group_sizes: jax.Array,
    *,
    config: W4A4MatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Grouped W4A16 on rows sorted by expert: ``[M, N]`` in ``x_sorted.dtype``."""
    config = config or _BF16_CONFIG
    w = _weights(w_q, config)
    if not w.stacked:
        raise ValueError("w_q: a dense [N, K] weight; w4a16_grouped_matmul needs [E, N, K]")
    _check(x_sorted, w)
    m, e = x_sorted.shape[0], w.num_experts
    gs = _check_group_sizes(group_sizes, e, m)
    block_m = config.block_m or grouped_block_m(m, e)
    row_index, tile_expert, num_tiles, row_slot, row0, window_rows = tile_plan(
        gs, m, block_m, config.tile_plan_config(), interpret)
    tiles, slot_g = token_tiles(lambda idx: _operand(x_sorted, idx, w), row_index, row0,
                                window_rows, config.windowed_operands)
    return run_tiles(tiles, slot_g, row_slot, w, tile_expert, num_tiles, config, interpret,
                     x_sorted.dtype, live_tiles=expected_tiles(m, e, block_m))


def w4a16_matmul_reference(x: jax.Array, w_q: nvfp4.NVFP4Tensor) -> jax.Array:
    """``x @ dq(W)^T`` in float32 (weight dequantized with its global scale), in ``x.dtype``."""
    wd = nvfp4.dequantize(w_q, jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), wd.T, precision="highest")
    return y.astype(x.dtype)


def w4a16_grouped_matmul_reference(
    x_sorted: jax.Array, w_q: nvfp4.NVFP4Tensor, group_sizes: jax.Array
) -> jax.Array:
    """Grouped reference with ``jax.lax.ragged_dot`` in float32."""
    gs = _check_group_sizes(group_sizes, w_q.shape[0], x_sorted.shape[0])
    wd = jnp.swapaxes(nvfp4.dequantize(w_q, jnp.float32), 1, 2)
    y = jax.lax.ragged_dot(
        x_sorted.astype(jnp.float32), wd, gs, precision=jax.lax.Precision.HIGHEST
    )
    return y.astype(x_sorted.dtype)
