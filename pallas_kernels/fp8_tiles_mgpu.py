"""The Mosaic GPU (Hopper) FP8 E4M3 tile GEMM: the W8A8 arm's dense and grouped kernel.

Computes, for every token tile ``t < num_tiles`` (``num_tiles`` read at run time)::

    out[t, s, 0, m, n] = sum_{k in split s} W_e[n, k] * B[t, m, k],   e = tile_expert[t]

with ``W`` and ``B`` E4M3 and the product on the FP8 tensor cores (``wgmma`` e4m3 x e4m3, f32
accumulation), both operands straight from shared memory: nothing is decoded, so one compute
warpgroup (wgmma M = 128: two instructions per K step) keeps up with the copies. The epilogue
applies the per-channel weight scales and the token slots' activation scales (``col_scales``)
and stores the caller's dtype, token-major (as the NVFP4 kernel); K splits are summed outside.

Same schedule as ``nvfp4_tiles_mgpu`` (swap-AB: weight rows are the wgmma M side, tokens the N
side; a TMA warpgroup; a persistent grid over (token tile, 128-row weight tile, K split)), so the
FP8 arm of the rollout benchmark is built with the same care as the NVFP4 one. Weights are stored
tile after tile (``FP8Weights``), so each pipeline step reads one contiguous 16 KB block.

Accuracy: the products are exact, but Hopper's FP8 tensor cores accumulate with fewer bits than
f32 (DeepSeek-V3's report: about 14 on H800), so the result is close to, not bit-equal with, an
f32 product of the dequantized operands (the GPU benchmark reports the error); the NVFP4 path's
f16 MMA is exact. This is the FP8 product any FP8 engine computes on this chip.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.layout import N_TILE, tile_rows, untile_rows
from pallas_kernels.nvfp4_tiles_mgpu import (
    ROW_ALIGN,
    _num_sms,
    check_col_scales,
    check_schedule,
    pipeline_stages,
    ring_store,
    run_work_items,
    store_slots,
    work_item,
)
from pallas_kernels.token_tiles import TokenTiles
from quads_jax.quant import fp8

K_TILE = 128  # K bytes per row per pipeline step: one 128-byte swizzle row of E4M3 values
SMEM_BYTES = 232448 - 4096


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Weights:
    """E4M3 weights in the kernel layout.

    Attributes:
      data: float8_e4m3fn ``[E, Np // 128, (Kp // 128) * 128, 128]``: the ``[E, Np, Kp]`` matrix
        (zero padded) in 128 x 128 tiles stored tile after tile (``layout.tile_rows``).
      scale: float32 ``[E, Np]`` decode scale per output channel (zero in the padding).
      n, k: logical N and K (static); stacked: False for a dense ``[N, K]`` weight.
    """

    CODES_NDIM = 4  # data's rank for one weight; leading axes beyond it are stacked layers

    data: jax.Array
    scale: jax.Array
    n: int = dataclasses.field(metadata={"static": True})
    k: int = dataclasses.field(metadata={"static": True})
    stacked: bool = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return ((self.num_experts,) if self.stacked else ()) + (self.n, self.k)

    @property
    def num_experts(self) -> int:
        return int(self.data.shape[0])

    @property
    def n_pad(self) -> int:
        return int(self.data.shape[1]) * N_TILE

    @property
    def k_pad(self) -> int:
        return int(self.data.shape[2]) // N_TILE * K_TILE

    @property
    def nbytes(self) -> int:
        return int(self.data.size + self.scale.size * 4)


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def prepare_fp8_weights(w_q: fp8.FP8Tensor) -> FP8Weights:
    """``FP8Tensor`` ``[N, K]`` or ``[E, N, K]`` (granularity tensor or channel) -> kernel layout.
    Call once at weight sync."""
    if not isinstance(w_q, fp8.FP8Tensor):
        raise ValueError(f"w_q: expected an FP8Tensor, got {type(w_q).__name__}")
    if w_q.granularity not in ("tensor", "channel") or len(w_q.shape) not in (2, 3):
        raise ValueError(
            f"w_q: granularity {w_q.granularity!r}, shape {w_q.shape}; the FP8 kernels take "
            "[N, K] or [E, N, K] weights with 'tensor' or 'channel' scales"
        )
    stacked = len(w_q.shape) == 3
    data = w_q.data if stacked else w_q.data[None]
    e, n, k = data.shape
    scale = jnp.broadcast_to(jnp.asarray(w_q.scale, jnp.float32).reshape(
        (e if stacked and w_q.granularity == "channel" else 1), -1), (e, n))
    n_pad, k_pad = _round_up(n, N_TILE), _round_up(k, K_TILE)
    data = jnp.pad(data, ((0, 0), (0, n_pad - n), (0, k_pad - k)))
    return FP8Weights(
        data=tile_rows(data, K_TILE),
        scale=jnp.pad(scale, ((0, 0), (0, n_pad - n))),
        n=n, k=k, stacked=stacked,
    )


def dequantize_fp8_weights(w: FP8Weights) -> jax.Array:
    """float32 ``[E, N, K]`` decoded weights (the layout's jnp reference)."""
    vals = untile_rows(w.data).astype(jnp.float32) * w.scale[:, :, None]
    return vals[:, : w.n, : w.k]


@dataclasses.dataclass(frozen=True)
class FP8GemmConfig:
    """Tuning of ``fp8_tile_gemm``.

    Attributes:
      k_splits: K ranges computed by different CTAs; must divide ``Kp // 128``.
      max_concurrent_steps: pipeline depth (SMEM stages of weights + activations).
      num_sms: persistent CTAs; None = the device's SM count.
      chain_items: chain the work items' pipelines (``nvfp4_tiles_mgpu.run_work_items``).
      store_buffers: how the epilogue's copies wait (``TileGemmConfig.store_buffers``).
    """

    k_splits: int = 1
    max_concurrent_steps: int = 4
    num_sms: int | None = None
    chain_items: bool = True
    store_buffers: int = 0

    def __post_init__(self):
        check_schedule(self)


def _swizzled() -> tuple:
    return (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))


def fp8_tile_gemm(
    b_tiles: TokenTiles | tuple[jax.Array],
    w: FP8Weights,
    tile_expert: jax.Array,
    num_tiles: jax.Array,
    *,
    config: FP8GemmConfig,
    col_scales: jax.Array,
    out_dtype=jnp.float32,
    interpret: bool = False,
) -> jax.Array:
    """Run the kernel.

    Args:
      b_tiles: ``TokenTiles`` of one float8_e4m3fn operand ``[R, Kp]`` (windows of ``block_m``
        rows), or one gathered array ``[T, block_m, Kp]`` (a tuple).
      w: the weights in kernel layout, ``E`` matrices ``[Np, Kp]``.
      tile_expert: int32 ``[T]``, the matrix each token tile multiplies.
      num_tiles: int32 ``[1]``; tiles ``t >= num_tiles[0]`` are skipped (their output is garbage).
      col_scales: float32 ``[T, 1, block_m]`` token-slot scales: the epilogue multiplies by them
        and by the tile's per-channel weight scales (``w.scale``) and stores ``out_dtype``.
    Returns:
      ``[T, k_splits, 1, block_m, Np]`` scaled partial sums (the module docstring's ``out``) in
      ``out_dtype``.
    """
    n_pad, k_pad = w.n_pad, w.k_pad
    tiles = TokenTiles.of(b_tiles)
    tiles.check(k_pad, (jnp.float8_e4m3fn,))
    if tiles.num_operands != 1:
        raise ValueError(f"b_tiles: {tiles.num_operands} operands; the FP8 kernel takes one")
    (b,) = tiles.operands()
    t_max, block_m = tiles.num_tiles, tiles.block_m
    if tile_expert.shape != (t_max,):
        raise ValueError(f"tile_expert: shape {tuple(tile_expert.shape)}; need [{t_max}] (one "
                         "per tile)")
    k_steps_total = k_pad // K_TILE
    if k_steps_total % config.k_splits:
        raise ValueError(
            f"FP8GemmConfig.k_splits={config.k_splits} does not divide the {k_steps_total} K "
            f"steps of {K_TILE} (K padded to {k_pad})")
    k_steps = k_steps_total // config.k_splits
    n_tiles = n_pad // N_TILE
    num_sms = config.num_sms or _num_sms()
    out_dtype = jnp.dtype(out_dtype)
    check_col_scales(col_scales, (t_max, 1, block_m))
    stage_bytes = N_TILE * K_TILE + block_m * K_TILE
    slots = store_slots(config)
    stages = pipeline_stages(config.max_concurrent_steps, k_steps,
                             (SMEM_BYTES - slots * N_TILE * block_m * out_dtype.itemsize)
                             // stage_bytes)

    in_specs = [
        plgpu.BlockSpec((N_TILE, K_TILE), lambda k: (k, 0), transforms=_swizzled()),
        plgpu.BlockSpec((block_m, K_TILE), lambda k: (0, k), transforms=_swizzled()),
    ]

    def kernel(tile_expert_gmem, num_tiles_gmem, row0_gmem, w_gmem, ws_gmem, cs_gmem, b_gmem,
               out_gmem, out_smem):
        def get_pipeline(body, compute_context, state=None):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(k_steps,), memory_registers=40, in_specs=in_specs, wg_axis="wg",
                num_compute_wgs=1, max_concurrent_steps=stages, compute_context=compute_context,
                pipeline_state=state)

        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
                w_gmem.at[0, 0], b_gmem.at[pl.ds(0, block_m)]),
            collective_axes="wg",
        )
        def _pipeline_scope(pipeline_allocs):
            def work_body(idx, local):
                split, ni, t = work_item(idx, config.k_splits, n_tiles)
                expert = tile_expert_gmem[t]

                def compute_context(eval_pipeline):
                    def acc_scope(acc_ref):
                        # Scales loaded before the K loop, so their latency hides behind it.
                        rows = ws_gmem.at[expert, pl.ds(ni * N_TILE, N_TILE)]
                        row_s = plgpu.load(rows, layout=plgpu.Layout.WGMMA.reduce(1),
                                           optimized=False)
                        col_s = plgpu.load(cs_gmem.at[t, 0], layout=plgpu.Layout.WGMMA.reduce(0),
                                           optimized=False)
                        eval_pipeline(acc_ref)
                        shape = (N_TILE, block_m)
                        y = (acc_ref[...] * lax.broadcast_in_dim(row_s, shape, (0,))
                             * lax.broadcast_in_dim(col_s, shape, (1,)))
                        ring_store(out_smem, y.astype(out_dtype),
                                   out_gmem.at[t, split, 0, :, pl.ds(ni * N_TILE, N_TILE)],
                                   local, config.store_buffers)

                    pl.run_scoped(acc_scope, plgpu.ACC((N_TILE, block_m), jnp.float32))

                def mma_body(_, w_smem, b_smem, acc):
                    plgpu.wgmma(acc, w_smem, b_smem.T)
                    plgpu.wgmma_wait(0)
                    return acc

                refs = (w_gmem.at[expert, ni, pl.ds(split * k_steps * N_TILE, k_steps * N_TILE)],
                        b_gmem.at[pl.ds(pl.multiple_of(row0_gmem[t], ROW_ALIGN), block_m),
                                  pl.ds(split * k_steps * K_TILE, k_steps * K_TILE)])
                return refs, mma_body, compute_context

            run_work_items(get_pipeline, pipeline_allocs,
                           num_tiles_gmem[0] * (n_tiles * config.k_splits), config.chain_items,
                           work_body)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((t_max, config.k_splits, 1, block_m, n_pad), out_dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=[plgpu.SMEM((slots, block_m, N_TILE), out_dtype)],
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return call(tile_expert, num_tiles, tiles.row0, w.data, w.scale, col_scales, b)


def fp8_tile_gemm_reference(b_tiles: TokenTiles | tuple[jax.Array], w: FP8Weights,
                            tile_expert: jax.Array, col_scales: jax.Array,
                            out_dtype=jnp.float32) -> jax.Array:
    """``[T, 1, 1, block_m, Np]``: the kernel's result with ``k_splits=1`` in jnp."""
    (b,) = TokenTiles.of(b_tiles).gathered()
    wd = untile_rows(w.data).astype(jnp.float32)  # [E, Np, Kp]
    e = jnp.clip(tile_expert, 0, w.num_experts - 1)
    out = jnp.einsum("tnk,tmk->tmn", wd[e], b.astype(jnp.float32), precision="highest")
    out = (out * w.scale[e][:, None, :] * col_scales[:, 0, :, None]).astype(out_dtype)
    return out[:, None, None]
