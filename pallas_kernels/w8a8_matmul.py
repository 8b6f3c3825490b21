"""FP8 W8A8 dense and grouped matmuls on Hopper (Mosaic GPU), the FP8 rollout arm's kernels.

``w8a8_matmul(x, w)`` / ``w8a8_grouped_matmul(x_sorted, w, group_sizes)``: activations are
quantized to E4M3 (``quads_jax.quant.fp8.quantize``, per token or per tensor) in an XLA fusion of
the same jitted program; ``fp8_tiles_mgpu`` multiplies them with the E4M3 weights on the FP8
tensor cores; one small XLA fusion sums K splits and applies the activation and per-channel
weight scales. Token tiles, the grouped tile plan and split-K are the NVFP4 kernels' own
(``w4a4_matmul`` / ``w4a4_grouped``), so both arms are scheduled alike. ``*_reference``: the same
math in jnp (f32 products of the dequantized operands).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_tiles_mgpu import (
    K_TILE,
    FP8GemmConfig,
    FP8Weights,
    fp8_tile_gemm,
    prepare_fp8_weights,
)
from pallas_kernels.layout import N_TILE
from pallas_kernels.nvfp4_tiles_mgpu import _num_sms
from pallas_kernels.w4a4_grouped import (
    _check_group_sizes,
    check_output_rows,
    check_source_rows,
    expected_tiles,
    grouped_block_m,
    output_row_slots,
    tile_plan,
)
from pallas_kernels.w4a4_matmul import (
    auto_k_splits,
    dense_plan,
    plain_operand,
    rows_from_tiles,
    source_tile_rows,
    stored_dtype,
    token_tiles,
)
from quads_jax.quant import fp8

ACT_GRANULARITIES = ("token", "tensor")
# The FP8 kernel's split-K stop (``auto_k_splits``' ``good_efficiency``): at 4096 x 57344 (448
# items at 0.848 of their waves) unsplit was 85.4 us against 88.6 split in two (H100,
# 2026-12-06), where the W4A4 kernel was faster split (its 0.85).
FP8_GOOD_WAVE_EFFICIENCY = 0.84


@dataclasses.dataclass(frozen=True)
class W8A8MatmulConfig:
    """Tuning of the FP8 matmuls.

    Attributes:
      block_m: tokens per tile, a multiple of 8 in [8, 256]; None: as the NVFP4 kernels.
      k_splits: split-K factor; None: ``auto_k_splits`` (``FP8_GOOD_WAVE_EFFICIENCY``).
      max_concurrent_steps: pipeline depth; num_sms: persistent CTAs (None: the device's).
      windowed_operands, tile_plan_kernel, tile_plan_block, tile_plan_warps: as
        ``W4A4MatmulConfig``.
      store_buffers: ``FP8GemmConfig.store_buffers``.
    """

    block_m: int | None = None
    k_splits: int | None = None
    max_concurrent_steps: int = 4
    num_sms: int | None = None
    windowed_operands: bool = True
    # As W4A4MatmulConfig's (the same plan kernel; not timed in the FP8 rollout arm yet).
    tile_plan_kernel: bool = True
    tile_plan_block: int = 8
    tile_plan_warps: int = 2
    store_buffers: int = 0

    def __post_init__(self):
        bm = self.block_m
        if bm is not None and (not isinstance(bm, int) or bm % 8 or not 8 <= bm <= 256):
            raise ValueError(f"W8A8MatmulConfig.block_m={bm!r}: None or a multiple of 8 in [8, 256]")
        self.gemm_config(self.k_splits or 1, self.num_sms)
        self.tile_plan_config()

    def gemm_config(self, k_splits: int, num_sms: int | None) -> FP8GemmConfig:
        """The tile kernel's config for a call with ``k_splits`` on ``num_sms`` SMs."""
        return FP8GemmConfig(k_splits, self.max_concurrent_steps, num_sms,
                             store_buffers=self.store_buffers)

    def tile_plan_config(self):
        """The ``tile_plan`` kernel's config (``tile_plan_block`` entries per program,
        ``tile_plan_warps`` warps), or None when it is off (the jnp plan)."""
        from pallas_kernels.tile_plan import plan_config

        return plan_config(self.tile_plan_kernel, self.tile_plan_block, self.tile_plan_warps)


def as_fp8_weights(w) -> FP8Weights:
    """Kernel-layout weights as they are; an ``FP8Tensor`` is converted (a full weight pass)."""
    if isinstance(w, FP8Weights):
        return w
    if isinstance(w, fp8.FP8Tensor):
        return prepare_fp8_weights(w)
    raise ValueError(f"w_q: expected an FP8Tensor or FP8Weights, got {type(w).__name__}")


def _check(x: jax.Array, w: FP8Weights, act_granularity: str) -> None:
    if act_granularity not in ACT_GRANULARITIES:
        raise ValueError(f"act_granularity={act_granularity!r}: one of {ACT_GRANULARITIES}")
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) not in fp8.FLOAT_DTYPES:
        raise ValueError(f"x: dtype {getattr(x, 'dtype', None)}; need bfloat16, float16 or float32")
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"x: shape {tuple(x.shape)} must be [M, K] with M >= 1")
    if x.shape[1] != w.k:
        raise ValueError(f"x: K={x.shape[1]} does not match the weight's K={w.k}")


def _act_scale(qx: fp8.FP8Tensor, m: int) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(qx.scale, jnp.float32).reshape(-1, 1), (m, 1))


def _run(qx: fp8.FP8Tensor, w, plan, config, interpret, out_dtype,
         source_rows: jax.Array | None = None, live_tiles: int | None = None) -> jax.Array:
    """Token tiles (``plan`` = ``(row_index, tile_expert, num_tiles, row_slot, row0,
    window_rows)``, as ``w4a4_grouped.tile_plan``) through the kernel; the scales are applied
    in its epilogue: ``[M, N]`` (``source_rows``: the GEMM rows' rows of ``qx``, as
    ``w8a8_grouped_matmul``; ``live_tiles`` as ``w4a4_matmul.run_tiles``)."""
    row_index, tile_expert, num_tiles, row_slot, row0, window_rows = plan
    r = qx.data.shape[0]
    act_scale = _act_scale(qx, r)[:, 0]

    def operand_of(index):
        src = index if source_rows is None else source_tile_rows(source_rows, r, index)
        rows, scale = plain_operand(qx.data, src, jnp.float8_e4m3fn, w.k_pad, act_scale)
        return (rows,), (scale,)

    tiles, (act,) = token_tiles(operand_of, row_index, row0, window_rows,
                                config.windowed_operands)
    num_sms = config.num_sms or _num_sms()
    k_splits = config.k_splits or auto_k_splits(
        (live_tiles or row_index.shape[0]) * (w.n_pad // N_TILE), w.k_pad // K_TILE, num_sms,
        good_efficiency=FP8_GOOD_WAVE_EFFICIENCY)
    cfg = config.gemm_config(k_splits, num_sms)
    out = fp8_tile_gemm(tiles, w, tile_expert, num_tiles, config=cfg, interpret=interpret,
                        col_scales=act[:, None],  # [T, 1, block_m]
                        out_dtype=stored_dtype(out_dtype, k_splits))
    return rows_from_tiles(out, row_slot, w.n, out_dtype)


def w8a8_matmul(x: jax.Array, w_q, *, act_granularity: str = "token",
                config: W8A8MatmulConfig | None = None, interpret: bool = False) -> jax.Array:
    """``Y = Q8(x) @ Q8(W)^T``: ``[M, N]`` in ``x.dtype``.

    Args:
      x: ``[M, K]`` activations. w_q: ``FP8Tensor [N, K]`` or ``FP8Weights`` (from weight sync).
      act_granularity: "token" (one scale per row) or "tensor".
    """
    config = config or W8A8MatmulConfig()
    w = as_fp8_weights(w_q)
    if w.stacked:
        raise ValueError(f"w_q: stacked weight of {w.num_experts} experts; use w8a8_grouped_matmul")
    _check(x, w, act_granularity)
    m = x.shape[0]
    qx = fp8.quantize(x, granularity=act_granularity)
    row_index, tile_expert, num_tiles, row0 = dense_plan(m, config.block_m)
    plan = (row_index, tile_expert, num_tiles, m, row0, row_index.reshape(-1))
    return _run(qx, w, plan, config, interpret, x.dtype)


def w8a8_grouped_matmul(x_sorted: jax.Array, w_q, group_sizes: jax.Array, *,
                        act_granularity: str = "token", config: W8A8MatmulConfig | None = None,
                        interpret: bool = False,
                        source_rows: jax.Array | None = None,
                        output_rows: jax.Array | None = None) -> jax.Array:
    """Grouped ``Y[rows of e] = Q8(x) @ Q8(W_e)^T``: ``[M, N]``; rows past the groups are 0.

    Args:
      x_sorted: ``[M, K]`` rows sorted by expert. w_q: ``FP8Tensor [E, N, K]`` or stacked
        ``FP8Weights``. group_sizes: int ``[E]`` rows per expert, summing to at most M.
      source_rows: None, or int32 ``[M]`` with ``x_sorted`` the distinct rows: the sorted rows
        are ``x_sorted[source_rows]``; per-token scales are then computed once per distinct
        row (as ``w4a4_grouped_matmul``; same result).
      output_rows: None, or int32 ``[M']`` in ``[0, M)``: return ``Y[output_rows]`` (as
        ``w4a4_grouped_matmul``).
    """
    config = config or W8A8MatmulConfig()
    w = as_fp8_weights(w_q)
    if not w.stacked:
        raise ValueError("w_q: a dense [N, K] weight; w8a8_grouped_matmul needs [E, N, K]")
    _check(x_sorted, w, act_granularity)
    if source_rows is not None:
        source_rows = check_source_rows(source_rows, x_sorted.shape[0])
        if act_granularity != "token":  # a tensor scale spans the GEMM's rows
            x_sorted, source_rows = x_sorted[source_rows], None
    m = x_sorted.shape[0] if source_rows is None else source_rows.shape[0]
    e = w.num_experts
    gs = _check_group_sizes(group_sizes, e, m)
    output_rows = check_output_rows(output_rows, m)
    qx = fp8.quantize(x_sorted, granularity=act_granularity)
    block_m = config.block_m or grouped_block_m(m, e)
    row_index, tile_expert, num_tiles, row_slot, row0, window_rows = tile_plan(
        gs, m, block_m, config.tile_plan_config(), interpret)
    plan = (row_index, tile_expert, num_tiles, output_row_slots(row_slot, output_rows), row0,
            window_rows)
    return _run(qx, w, plan, config, interpret, x_sorted.dtype,
                source_rows, live_tiles=expected_tiles(m, e, block_m))


def w8a8_reference(x: jax.Array, w_q: fp8.FP8Tensor, group_sizes: jax.Array | None = None, *,
                   act_granularity: str = "token") -> jax.Array:
    """jnp reference, dense (``group_sizes`` None) or grouped: f32 products of the dequantized
    operands; ``[M, N]`` in ``x.dtype``."""
    xd = fp8.dequantize(fp8.quantize(x, granularity=act_granularity), jnp.float32)
    wd = fp8.dequantize(w_q, jnp.float32)
    if group_sizes is None:
        y = jnp.dot(xd, wd.T, precision="highest")
    else:
        gs = jnp.asarray(group_sizes, jnp.int32)
        y = jax.lax.ragged_dot(xd, jnp.swapaxes(wd, 1, 2), gs, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)
