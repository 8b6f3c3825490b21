"""The grouped kernels' token-tile plan in one kernel (Pallas, Triton backend).

``w4a4_grouped.tile_plan`` (with ``row_experts``) turns the group sizes ``[E]`` of a grouped
GEMM into the metadata the tile kernels read: each tile's expert and first window row, each
slot's GEMM row, each GEMM row's slot and expert, and the windowed operand's row layout. In jnp
that is three cumulative sums over E and a dozen small comparisons, gathers and selects over
the tiles ``[T]``, the GEMM rows ``[M]`` and the window rows ``[P]``: XLA makes about ten
kernels of it per layer. On the H200 (2026-12-04, b79a63f, decode step at batch 128, traced)
they took ~14 us per layer of a 15.2 ms nvfp4 step, 1-4.4 us each (the three cumulative sums
alone: one ``reduce_window`` fusion of 4.4 us), every one far from any bandwidth limit.

Here every program recomputes the per-expert vectors (E is small) and writes one chunk of
``block`` entries of each index space: the per-expert value at an entry's expert is a one-hot
sum over E (Triton has no gather from registers). Integer arithmetic only: equal to the jnp
plan (tests; ``kernel_probe --tile-plan`` on the GPU, every variant).

Measured on the H200 (2026-12-04, b9d0759): 5.0 us at the decode step's M = 1 024 (the jnp
plan: 12.1 us in 9 kernels); in the batch-128 decode step 5.2 us per layer, and with
``act_operands`` the step 15.68 / 14.56 ms (nvfp4_rac / nvfp4) against 16.23 / 15.31 without
either kernel, same call. Its first version ran 64 entries per program: 30 us per layer.

Shapes (``tile_plan``'s): group sizes int32 ``[E]``; ``m`` GEMM rows, ``block_m`` tokens per
tile; ``T = m // block_m + E`` tiles, ``P`` window rows (``window_len``). Outputs int32:
``row_index [T, block_m]``, ``tile_expert [T]``, ``num_tiles [1]``, ``row_slot [M]``, ``row0
[T]``, ``window_rows [P]``, ``row_expert [M]`` (``row_experts``: E past the groups).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.nvfp4_tiles_mgpu import ROW_ALIGN
from pallas_kernels.triton_grid import check_num_warps, check_pow2_fields, pow2_at_least
from pallas_kernels.vma import varying_operands


@dataclasses.dataclass(frozen=True)
class TilePlanConfig:
    """block: entries of each index space per program (a power of two >= 8); num_warps:
    Triton warps per program.

    A program's work is ~10 one-hot sums of ``[block, E]``: on the H200 (2026-12-04, 8619555,
    ``kernel_probe --tile-plan``, M = 1 024, E = 128) 45.9 us at block 128, 17.9 at 64, 8.0 at
    32 (4 warps; the jnp plan: 11.9 us in 9 kernels); 3.6-4.1 us at block 8 with 2 warps
    against 5.0-6.9 at 16 with 4 (b9d0759), and 3.9 against 5.2 us per layer in the batch-128
    rollout (2026-12-05, c916b59), so the default is block 8, 2 warps."""

    block: int = 8
    num_warps: int = 2

    def __post_init__(self):
        check_pow2_fields(self, "block", minimum=8)
        check_num_warps(self)


def plan_config(on: bool, block: int, num_warps: int) -> TilePlanConfig | None:
    """The kernel's config for a matmul config's ``tile_plan_kernel`` / ``tile_plan_block`` /
    ``tile_plan_warps`` fields (None: off, the jnp plan); a bad value raises ``ValueError``."""
    return TilePlanConfig(block=block, num_warps=num_warps) if on else None


def num_tiles_bound(m: int, num_experts: int, block_m: int) -> int:
    """``T``: the most token tiles ``m`` rows over ``num_experts`` groups can need."""
    return m // block_m + num_experts


def window_len(m: int, num_experts: int, block_m: int) -> int:
    """``P``: rows of the windowed operand (a multiple of ``ROW_ALIGN``): every group starts at
    a multiple of ``ROW_ALIGN``, and the last tile's window may run ``block_m`` rows past."""
    p = m + (ROW_ALIGN - 1) * min(num_experts, m) + block_m
    return -(-p // ROW_ALIGN) * ROW_ALIGN


def _kernel(gs_ref, row_index_ref, te_ref, nt_ref, row_slot_ref, row0_ref, window_ref,
            rexp_ref, *, m: int, e: int, block_m: int, t_max: int, p_len: int, block: int):
    gs = gs_ref[...]  # [Ep], zero past E
    ep = gs.shape[0]
    eidx = jnp.arange(ep, dtype=jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    tiles = (gs + (block_m - 1)) // block_m
    tile_ends = jnp.cumsum(tiles)
    tile_starts = tile_ends - tiles
    padded = (gs + (ROW_ALIGN - 1)) // ROW_ALIGN * ROW_ALIGN
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    total_tiles = jnp.sum(tiles)
    total_padded = jnp.sum(padded)

    def count_le(vec, vals):  # ops.count_le: entries of vec <= each value
        return jnp.sum((vals[:, None] >= vec[None, :]).astype(jnp.int32), axis=1)

    def gather(idx):  # vec[idx] for idx in [0, Ep): one one-hot mask for every vec
        onehot = eidx[None, :] == idx[:, None]
        return lambda vec: jnp.sum(jnp.where(onehot, vec[None, :], 0), axis=1)

    i0 = pl.program_id(0) * block
    lane = jnp.arange(block, dtype=jnp.int32)

    # GEMM rows: their expert (E past the groups) and tile slot.
    r = i0 + lane
    rexp = jnp.minimum(count_le(ends, r), e)  # the zero groups past E end at the total too
    at = gather(jnp.minimum(rexp, e - 1))
    local = r - at(starts)
    slot = (at(tile_starts) + local // block_m) * block_m + local % block_m
    in_m = r < m
    pltriton.store(rexp_ref.at[pl.ds(i0, block)], rexp, mask=in_m)
    pltriton.store(row_slot_ref.at[pl.ds(i0, block)],
                   jnp.where(rexp < e, slot, t_max * block_m), mask=in_m)

    # Tiles: expert, the GEMM row of each slot, the first window row.
    t = i0 + lane
    te = jnp.minimum(count_le(tile_ends, t), e - 1)
    at = gather(te)
    t_local = (t - at(tile_starts)) * block_m
    rows = (at(starts) + t_local)[:, None] + jnp.arange(block_m, dtype=jnp.int32)[None, :]
    live_tile = t < total_tiles
    live = live_tile[:, None] & (rows < at(ends)[:, None])
    in_t = t < t_max
    pltriton.store(te_ref.at[pl.ds(i0, block)], te, mask=in_t)
    pltriton.store(row0_ref.at[pl.ds(i0, block)],
                   jnp.where(live_tile, at(padded_starts) + t_local, 0), mask=in_t)
    pltriton.store(row_index_ref.at[pl.ds(i0, block), :], jnp.where(live, rows, m),
                   mask=jnp.broadcast_to(in_t[:, None], rows.shape))

    # Window rows: the GEMM row at each row of the aligned layout (m = a zero row).
    p = i0 + lane
    at = gather(jnp.minimum(count_le(padded_ends, p), e - 1))
    p_local = p - at(padded_starts)
    gemm_row = jnp.where((p < total_padded) & (p_local < at(gs)), at(starts) + p_local, m)
    pltriton.store(window_ref.at[pl.ds(i0, block)], gemm_row, mask=p < p_len)
    pltriton.store(nt_ref.at[pl.ds(0, 1)], jnp.broadcast_to(total_tiles, (1,)))


@functools.partial(jax.jit, static_argnames=("m", "block_m", "config", "interpret"))
def tile_plan_kernel(group_sizes: jax.Array, m: int, block_m: int, *,
                     config: TilePlanConfig = TilePlanConfig(), interpret: bool = False):
    """``w4a4_grouped.tile_plan(group_sizes, m, block_m)`` and ``row_experts(group_sizes,
    m)`` in one kernel: ``(row_index, tile_expert, num_tiles, row_slot, row0, window_rows,
    row_expert)`` (module docstring)."""
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"tile_plan_kernel: group_sizes {group_sizes.dtype}"
                         f"{list(group_sizes.shape)}; need an int vector [E]")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"tile_plan_kernel: block_m={block_m} must be a power of two")
    if m < 1:
        raise ValueError(f"tile_plan_kernel: m={m} must be >= 1")
    e = group_sizes.shape[0]
    t_max, p_len = num_tiles_bound(m, e, block_m), window_len(m, e, block_m)
    gs = group_sizes.astype(jnp.int32)
    ep = pow2_at_least(e)
    if ep != e:  # empty groups past E change no cumulative sum (the kernel clamps to E)
        gs = jnp.pad(gs, (0, ep - e))
    vary, (gs,) = varying_operands(gs)
    b = config.block
    grid = -(-max(m, t_max, p_len) // b)
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    shapes = ((t_max, block_m), (t_max,), (1,), (m,), (t_max,), (p_len,), (m,))
    kernel = functools.partial(_kernel, m=m, e=e, block_m=block_m, t_max=t_max, p_len=p_len,
                               block=b)
    return tuple(pl.pallas_call(
        kernel,
        grid=(grid,),
        in_specs=[whole((ep,))],
        out_specs=[whole(s) for s in shapes],
        out_shape=[jax.ShapeDtypeStruct(s, jnp.int32, **vary) for s in shapes],
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="tile_plan",
    )(gs))
