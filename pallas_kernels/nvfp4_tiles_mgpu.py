"""The Mosaic GPU (Hopper) NVFP4-weight tile GEMM shared by the dense and grouped kernels.

Computes, for every token tile ``t < num_tiles`` (``num_tiles`` read at run time)::

    out[t, s, a, m, n] = sum_{k in split s} W_e[n, k] * B_a[t, m, k],   e = tile_expert[t]

with ``W_e = e2m1 * s_w`` (times ``1 / w.code_factor``, see ``layout.code_factor``)
decoded in registers from the split-nibble layout, ``B_0`` the quantized activations
(``e2m1 * s_x`` in the MMA dtype, exact) and, with RAC, ``B_1`` the quantized residual: both
multiply the same decoded weight registers, so the weight is read and decoded once.

Design (swap-AB, as tokamax's sm90 quantized ragged dot): the weight rows are the wgmma M side
(64 per compute warpgroup, two warpgroups per 128-row tile) and the tokens are the wgmma N side
(``block_m`` >= 8), so decode with few tokens wastes no MMA rows. A third warpgroup issues the
TMA copies (``emit_pipeline_warp_specialized``). The grid is persistent over the live (token
tile, weight-row tile, K split) items, with chained pipelines (``run_work_items``); tiles past
``num_tiles`` are not visited. With ``col_scales``
the epilogue applies each token slot's global scales (activation x weight), adds the RAC
product to the main one and stores the caller's dtype: one output instead of two float32
ones, which the caller's transposes would otherwise read and write (on the H200, before this,
those transposes took 2.5 ms of a 27 ms decode step with RAC). The epilogue stores each
accumulator transposed (token-major, ``[block_m, n]``: a layout cast to WGMMA_TRANSPOSED, one
register shuffle, into a transposed view of the SMEM staging tile), so the caller reads rows
straight from the output, without an XLA transpose of it (15-22 us per layer of the decode
step). Partial sums of K splits are summed outside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax.experimental import mosaic as _mosaic  # noqa: F401  (registers the dialect)
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels.layout import K_TILE, N_TILE, W4A4Weights, code_bits, word_code
from pallas_kernels.token_tiles import ROW_ALIGN, TokenTiles

WG_ROWS = 64  # wgmma M per warpgroup
NUM_COMPUTE_WGS = N_TILE // WG_ROWS  # the warpgroups that cover one weight-row tile
COMPUTE_WGS = (2, 4)  # compute warpgroups per CTA (TileGemmConfig.compute_wgs)
KW_TILE = K_TILE // 4  # uint16 words per row per step
CHUNK = 64  # K columns per wgmma (128-byte swizzle of 16-bit values)
SMEM_BYTES = 232448 - 4096  # H100/H200 per-block shared memory, minus barriers and slack
DECODE_IMPLS = ("auto", "jnp", "ptx")
# Time attribution only (scripts/kernel_probe.py): each ablation skips part of the work, so its
# results are WRONG. no_decode: the raw code words bitcast to the MMA dtype; one_mma: the four
# decoded chunks of a step summed and multiplied once; no_compute: the pipeline streams its
# tiles and the body does nothing; no_second_mma: with RAC's two operands unstacked, the
# second one's wgmmas are not issued (what RAC's residual products cost on the tensor cores).
ABLATIONS = (None, "no_decode", "one_mma", "no_compute", "no_second_mma")
N_GROUPS = (1, 2, 4)
MMA_KS = (64, 128, 256)  # K columns per wgmma group (TileGemmConfig.mma_k)
STORE_BUFFERS = (0, 1, 2)  # the epilogue's output copies left in flight (store_buffers)


@dataclasses.dataclass(frozen=True)
class TileGemmConfig:
    """Tuning of ``nvfp4_tile_gemm``.

    Attributes:
      k_splits: K ranges computed by different CTAs (split-K, for decode occupancy); must divide
        ``Kp // 256``.
      max_concurrent_steps: pipeline depth (SMEM stages of weights + scales + activations).
      a_via_smem: stage the decoded weight tile through SMEM before the wgmma (the GPU
        interpreter cannot run wgmma with A in registers; slower on the device).
      num_sms: persistent CTAs; None = the device's SM count.
      decode_impl: "jnp" (array ops on uint16 values; what the GPU interpreter runs), "ptx"
        (the same bits from 32-bit PTX on each register's pair of words; device only, and only
        for the "subnormal" decode with float16 MMA, whose bits need no select; 2.5x faster on
        the H200 than "jnp", which Mosaic GPU lowers to 16-bit ops one half-register at a time)
        or "auto" ("ptx" where it applies, else "jnp").
      mma_overlap: wgmma groups left in flight while the next chunk is decoded (0: wait for
        every chunk's product before decoding the next).
      mma_k: K columns of decoded weight per wgmma group, one of ``MMA_KS``: 64 decodes one
        64-column chunk, multiplies it and (``mma_overlap`` 0) waits for the product before
        the next chunk, four times per 256-column step; 256 decodes the whole step into
        registers first (64 more registers per thread) and issues one wgmma group and one wait
        per step (the default). A wgmma group's issue, fence and wait are latency the
        warpgroup does not hide. On the H200 (2026-12-04, 7413c4c, the decode step's grouped
        calls alone, stacked RAC operands): gate_up 95.8 -> 90.3 us, +RAC 95.1 -> 92.0 us;
        down unchanged within noise; in the rollout at batch 128 the expert kernels took 72.6
        instead of 78.1 us per call (nvfp4_rac) and the step 17.93 instead of 18.36 ms.
      ablation: None, or one of ``ABLATIONS`` (time attribution; wrong results).
      n_group: weight-row tiles (of 128 rows) per work item, each with its own accumulator,
        copied together in each pipeline step: one activation tile per K step serves all of
        them (with few tokens per expert the activation tile is a third of a step's bytes, so
        a group of 2 moves ~15 % fewer bytes, ~25 % with RAC's second activation tile), and a
        work item restarts the copy pipeline once per group. Must divide the weight's 128-row
        tile count. Those savings did not show on the H200: the rollout's kernel time was the
        same at 2 as at 1 (``W4A4MatmulConfig.n_group``).
      chain_items: chain the pipelines of an SM's work items (``run_work_items``): the copies
        of the next item start while the current one computes. The pipeline depth is then the
        deepest that divides the item's K steps (``pipeline_stages``).
      stack_operands: with two B operands (RAC), stack them along the wgmma N side: one
        ``[2 * block_m, K]`` tile per step and one wgmma of N = 2 * block_m per chunk into one
        accumulator, whose two column halves the epilogue scales and adds, instead of two
        wgmmas into two accumulators. Same bytes; half the wgmma issues and waits. On the H200
        (2026-12-03, the decode step's grouped calls alone, ``kernel_probe
        --grouped-ablations``) RAC's second wgmma per chunk cost more than its second
        activation tile: +22 us on gate_up's 93, of which +13 remained without the decode.
      store_buffers: how the epilogue's copies to global memory wait (``ring_store``). 0: each
        waits until the copy engine has read its SMEM tile, before the next work item starts
        (in decode 12-16 items of 3-8 K steps per SM, each then pays the copy's latency).
        1 or 2: SMEM staging buffers per compute warpgroup, and a copy is waited for only when
        its buffer is next written (a work item later, with one epilogue copy per item), so
        the wait overlaps the next item's K loop. Same results; 0 until timed on a GPU.
      compute_wgs: compute warpgroups per CTA. 2: both decode and multiply every weight-row
        tile of the step (64 rows each). 4 (``n_group`` even): two pairs, each pair the
        ``n_group / 2`` tiles of its half of the group, so twice the warps decode and issue
        wgmmas on an SM and one warp's wait for its products can hide behind another's decode
        (on the H200 the kernel is bound by that per-step work, not by its bytes; session 37).
        The compute warpgroups then get 104 registers each instead of 232
        (``compute_registers``). Same results. On the H200 (2026-12-06, 191e654, the decode
        step's grouped calls alone, n_group 2): plain gate_up 85.3 -> 66.8 us and down 52.2
        -> 38.1 at mma_k 256 (128 / 64: 2-5 % slower); with RAC's stacked operand gate_up
        89.9 -> 93.8 (mma_k 128) and down 47.1 -> 41.6. ``W4A4MatmulConfig.wide_plain_decode``
        picks 4 for grouped decode calls without RAC.
      memory_registers: registers per thread the copy warpgroup lowers itself to
        (``setmaxnreg.dec``, a multiple of 8 in [24, 256]); the compute warpgroups raise
        themselves by what it frees (``compute_registers``): on four compute warpgroups 40
        gives them 104, 24 gives 112. On two pairs RAC's calls ran out of registers at 104
        (H100, 2026-12-07, bd982e0, ptxas: 100-220 bytes of spills and "wgmma.mma_async
        instructions are serialized due to insufficient register resources", which the
        plain calls' kernels did not report). At 24 (H100, 7d0543e, gate_up +RAC on two
        pairs alone) ptxas no longer serializes them, but the call is only 2-4 us faster
        (113.5 / 109.9 us at mma_k 256 / 128 against 96.5 on one pair): the registers are
        not what makes RAC slower on two pairs. 40 by default.
      narrow_tiles: multiply a token tile that holds at most ``block_m / 2`` rows (its window
        ends where the next live tile's starts: ``row0[t + 1] - row0[t] <= block_m / 2``, as
        in the grouped plan, whose windows are in order) with wgmmas of N = ``block_m / 2`` on
        the first half of each B tile, into accumulators of that width, and store zeros in
        its other slots. A decode step's groups average ~8 tokens in tiles of 16 (128
        sequences, top-8 of 128 experts: ~60 % of the groups hold <= 8), so most tiles then
        issue half the MMA work: N 8 instead of 16, or 8 + 8 instead of RAC's stacked 32.
        Needs ``col_scales``, ``block_m`` a multiple of 16 and no ``residual_blocks``; the
        kernel holds both accumulator sets' code (the branch is per work item). Off until
        timed on a GPU.
    """

    k_splits: int = 1
    max_concurrent_steps: int = 4
    a_via_smem: bool = False
    num_sms: int | None = None
    decode_impl: str = "auto"
    mma_overlap: int = 0
    mma_k: int = 256
    ablation: str | None = None
    n_group: int = 1
    chain_items: bool = True
    stack_operands: bool = False
    store_buffers: int = 0
    compute_wgs: int = 2
    memory_registers: int = 40
    narrow_tiles: bool = False

    def __post_init__(self):
        check_schedule(self)
        mr = self.memory_registers
        if not isinstance(mr, int) or isinstance(mr, bool) or mr % 8 or not 24 <= mr <= 256:
            raise ValueError(f"TileGemmConfig.memory_registers={mr!r}: a multiple of 8 in "
                             "[24, 256] (setmaxnreg's range)")
        if self.n_group not in N_GROUPS:
            raise ValueError(f"TileGemmConfig.n_group={self.n_group!r}: one of {N_GROUPS}")
        check_compute_wgs(self)
        if self.decode_impl not in DECODE_IMPLS:
            raise ValueError(f"TileGemmConfig.decode_impl={self.decode_impl!r}: one of {DECODE_IMPLS}")
        if self.mma_overlap not in (0, 1):
            raise ValueError(f"TileGemmConfig.mma_overlap={self.mma_overlap!r}: 0 or 1")
        if self.mma_k not in MMA_KS:
            raise ValueError(f"TileGemmConfig.mma_k={self.mma_k!r}: one of {MMA_KS}")
        if self.mma_overlap and self.mma_k == K_TILE:
            raise ValueError(f"TileGemmConfig.mma_overlap={self.mma_overlap} with mma_k="
                             f"{K_TILE}: a step has one wgmma group, nothing to overlap; use "
                             "mma_overlap=0, or mma_k=64 / 128 to overlap")
        if self.ablation == "one_mma" and self.mma_k != CHUNK:
            raise ValueError(f"TileGemmConfig.ablation='one_mma' sums the step's {CHUNK}-column "
                             f"chunks into one wgmma: needs mma_k={CHUNK} (got {self.mma_k})")
        if self.ablation not in ABLATIONS:
            raise ValueError(f"TileGemmConfig.ablation={self.ablation!r}: one of {ABLATIONS}")


def check_schedule(config) -> None:
    """Validate the schedule fields shared by the tile kernels' configs (``k_splits``,
    ``max_concurrent_steps``, ``num_sms``); errors name the config class."""
    name = type(config).__name__
    if not isinstance(config.k_splits, int) or config.k_splits < 1:
        raise ValueError(f"{name}.k_splits={config.k_splits!r}: need an int >= 1")
    steps = config.max_concurrent_steps
    if not isinstance(steps, int) or not 1 <= steps <= 8:
        raise ValueError(f"{name}.max_concurrent_steps={steps!r}: need 1..8")
    if config.num_sms is not None and (not isinstance(config.num_sms, int) or config.num_sms < 1):
        raise ValueError(f"{name}.num_sms={config.num_sms!r}: need None or an int >= 1")
    if config.store_buffers not in STORE_BUFFERS:
        raise ValueError(f"{name}.store_buffers={config.store_buffers!r}: one of {STORE_BUFFERS}")


def check_compute_wgs(config) -> None:
    """``compute_wgs`` is one of ``COMPUTE_WGS``; 4 splits the work item's ``n_group`` tiles
    between two warpgroup pairs, so it needs an even ``n_group``."""
    name, wgs = type(config).__name__, config.compute_wgs
    if wgs not in COMPUTE_WGS:
        raise ValueError(f"{name}.compute_wgs={wgs!r}: one of {COMPUTE_WGS}")
    pairs = wgs // NUM_COMPUTE_WGS
    if config.n_group % pairs:
        raise ValueError(f"{name}.compute_wgs={wgs} splits a work item's weight-row tiles "
                         f"between {pairs} warpgroup pairs: n_group={config.n_group} must be "
                         f"a multiple of {pairs} (n_group=2 or 4, or compute_wgs=2)")


REGISTER_FILE = 65536  # 32-bit registers per SM (H100 / H200)


def compute_registers(memory_registers: int, num_compute_wgs: int) -> int:
    """Registers per thread a compute warpgroup can raise itself to (``setmaxnreg.inc``) in a
    warp-specialized pipeline whose copy warpgroup lowers itself to ``memory_registers``.

    A CTA of ``n + 1`` warpgroups launches with ``REGISTER_FILE / (128 (n + 1))`` registers
    per thread, rounded down to 8; the increases can only take what the decrease freed, or
    ``setmaxnreg.inc`` waits forever. jax 0.11.2's pipeline gives ``(512 - memory) / n``: the
    same for 2 or 3 compute warpgroups (232, 152 with 40), but 112 for 4, where the launch's
    96 plus 56 / 4 freed is 110: the first GPU run of ``compute_wgs=4`` hung (session 40).
    """
    launch = REGISTER_FILE // (128 * (num_compute_wgs + 1)) // 8 * 8
    fitted = launch + (launch - memory_registers) // num_compute_wgs
    return min(256, (512 - memory_registers) // num_compute_wgs, fitted) // 8 * 8


@contextlib.contextmanager
def _fitted_compute_registers():
    """Trace a warp-specialized pipeline with ``compute_registers`` in place of jax's
    ``_compute_registers`` (module-private, so the patch is scoped to this trace)."""
    from jax._src.pallas.mosaic_gpu import pipeline as mgpu_pipeline

    original = mgpu_pipeline._compute_registers
    mgpu_pipeline._compute_registers = compute_registers
    try:
        yield
    finally:
        mgpu_pipeline._compute_registers = original


def check_n_group(n_group: int, n_pad: int) -> None:
    if (n_pad // N_TILE) % n_group:
        raise ValueError(f"n_group={n_group} does not divide the {n_pad // N_TILE} weight-row "
                         f"tiles of {N_TILE} (N padded to {n_pad})")


def pipeline_stages(max_stages: int, k_steps: int, smem_limit: int) -> int:
    """The deepest pipeline (<= ``max_stages`` and the SMEM limit) whose depth divides the
    work item's ``k_steps``: chained pipelines (``run_work_items``) need that. 0: none fits."""
    cap = min(max_stages, k_steps, smem_limit)
    return max((d for d in range(1, cap + 1) if k_steps % d == 0), default=0)


def store_slots(config) -> int:
    """The epilogue's SMEM staging tiles per compute warpgroup (``store_buffers``, at least 1)."""
    return max(config.store_buffers, 1)


def tile_stages(config, w: W4A4Weights, block_m: int, num_acc: int, halves: int, out_dtype,
                b_copy: bool, k_steps: int) -> int:
    """The tile kernel's pipeline depth (``pipeline_stages``) for ``num_acc`` B tiles of
    ``halves * block_m`` rows, the ``out_dtype`` epilogue and ``b_copy`` (the interpreter's 2-D
    copy of a stacked tile); raises where not even one stage fits in shared memory."""
    item = jnp.dtype(w.mma_dtype).itemsize
    bn = halves * block_m
    stage_bytes = (config.n_group * (N_TILE * KW_TILE * 2
                                     + (K_TILE // 16) * N_TILE * jnp.dtype(w.scales.dtype).itemsize)
                   + num_acc * bn * K_TILE * item)
    slots = store_slots(config)
    fixed = (config.compute_wgs * WG_ROWS * (
        slots * block_m * jnp.dtype(out_dtype).itemsize
        + (config.mma_k * item if config.a_via_smem else 0))
        + (config.compute_wgs * bn * K_TILE * item if b_copy else 0))
    stages = pipeline_stages(config.max_concurrent_steps, k_steps,
                             (SMEM_BYTES - fixed) // stage_bytes)
    if stages < 1:
        raise ValueError(
            f"block_m={block_m} with {num_acc} activation operand(s) needs {stage_bytes + fixed} "
            f"bytes of shared memory per pipeline stage; at most {SMEM_BYTES}: use block_m <= 64"
        )
    return stages


def residual_blocks_hang(config, stages: int, k_steps: int) -> bool:
    """``residual_blocks`` on two warpgroup pairs with a one-stage pipeline over two or more
    K steps: hangs in interpret mode (session 41; never run on a GPU), so refused."""
    return config.compute_wgs == 4 and stages == 1 and k_steps > 1


def run_work_items(make_pipeline, allocations, num_live_work, chain: bool, work_body) -> None:
    """The persistent work loop over the ``num_live_work`` live items (a run-time count, so
    tiles past ``num_tiles`` cost nothing), each item one pipeline over its K steps.

    ``work_body(idx, local) -> (gmem refs, body, compute_context)`` for item ``idx``, the
    ``local``-th (int32, from 0) of its SM's items, where ``compute_context`` may be a triple
    ``(flag, if_true, if_false)``: two pipelines over the same copies, the item's flag picks
    one (``narrow_tiles``); ``make_pipeline(body, compute_context, state)`` emits the
    pipeline. With ``chain`` an SM's pipelines are chained (``pipeline_state`` START / STEADY
    / STOP): the copy warpgroup runs on into the next item's first K steps while the compute
    warpgroups finish the current one, so an item does not start with an empty pipeline (an
    HBM round trip per item, with 3 to 8 K steps per item in decode). An SM with one item runs
    it unchained.
    """

    @plgpu.nd_loop((num_live_work,), collective_axes="sm")
    def _work_loop(loop_info: plgpu.NDLoopInfo):
        refs, body, context = work_body(loop_info.index[0], loop_info.local_index)

        def run(state):
            if not isinstance(context, tuple):
                make_pipeline(body, context, state)(*refs, allocations=allocations)
                return
            flag, if_true, if_false = context
            pl.when(flag)(lambda: make_pipeline(body, if_true, state)(
                *refs, allocations=allocations))
            pl.when(jnp.logical_not(flag))(lambda: make_pipeline(body, if_false, state)(
                *refs, allocations=allocations))

        if not chain:
            run(None)
            return
        j, n = loop_info.local_index, loop_info.num_local_steps
        phase = plgpu.PipelinePipeline
        state = jnp.where(j == 0, jnp.int32(phase.START),
                          jnp.where(j == n - 1, jnp.int32(phase.STOP), jnp.int32(phase.STEADY)))

        pl.when(n == 1)(lambda: run(None))
        pl.when(n > 1)(lambda: run(state))


def check_col_scales(col_scales: jax.Array, shape: tuple[int, ...]) -> None:
    """The epilogue's token-slot scales must be float32 ``shape``."""
    if col_scales.shape != shape or col_scales.dtype != jnp.float32:
        raise ValueError(f"col_scales: {col_scales.dtype}{list(col_scales.shape)}; need "
                         f"float32{list(shape)}")


def store_transposed(smem_ref, value: jax.Array) -> None:
    """Store a WGMMA-layout ``[rows, cols]`` register array into ``smem_ref`` ``[cols, rows]``:
    the layout cast to WGMMA_TRANSPOSED is one shuffle between lane pairs, after which each
    thread's pair of values is contiguous along ``rows`` of the transposed view."""
    smem_ref.T[...] = plgpu.layout_cast(value, plgpu.Layout.WGMMA_TRANSPOSED)


def ring_store(slots_ref, value: jax.Array, dst_ref, seq, buffers: int) -> None:
    """The epilogue's copy of a WGMMA-layout ``[rows, cols]`` value to ``dst_ref`` ``[cols,
    rows]`` through SMEM: ``slots_ref`` ``[max(buffers, 1), cols, rows]``; ``seq`` (int32)
    counts the warpgroup's earlier calls. ``buffers`` 0: stage in slot 0, copy, and wait
    until the copy has read it. ``buffers`` S >= 1: first wait until at most ``S - 1`` of the
    warpgroup's copies still read SMEM (so slot ``seq % S``'s previous copy, ``S`` calls ago,
    is done with it), then stage there and copy without waiting: the kernel must wait for
    the copies before it ends (``wait_smem_to_gmem(0)``)."""
    if buffers:
        plgpu.wait_smem_to_gmem(buffers - 1, wait_read_only=True)
    slot = slots_ref.at[lax.rem(seq, buffers)] if buffers > 1 else slots_ref.at[0]
    store_transposed(slot, value)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(slot, dst_ref)
    if not buffers:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _num_sms() -> int:
    if abstract_device := jax.sharding.get_abstract_mesh().abstract_device:
        return abstract_device.num_cores
    return jax.devices()[0].core_count if jax.devices()[0].platform == "gpu" else 4


def work_item(idx, k_splits: int, n_tiles: int):
    """Persistent-grid work item ``idx`` -> ``(K split, weight-row tile, token tile)``; K splits
    vary fastest, token tiles slowest."""
    split = lax.rem(idx, k_splits)
    ni = lax.rem(lax.div(idx, k_splits), n_tiles)
    return split, ni, lax.div(idx, k_splits * n_tiles)


def _swizzled(dtype, stacked: bool = False) -> tuple:
    """The SMEM transforms of a wgmma operand: (8, 128-byte) tiles, 128-byte swizzle. A stacked
    ``[2, rows, cols]`` block is tiled (1, 8, 128 bytes), so that it folds into the
    ``[2 * rows, cols]`` operand the wgmma reads (Mosaic GPU folds leading dims into a tiled
    one only when they have unit tiles)."""
    bits = jnp.dtype(dtype).itemsize * 8
    tile = (8, 128 * 8 // bits)
    return (plgpu.TilingTransform((1, *tile) if stacked else tile), plgpu.SwizzleTransform(128))


def _block_tiled(dtype) -> tuple:
    """SMEM transforms of a wgmma operand sliced per 16-column K block (``residual_blocks``):
    (8, 32-byte) tiles, 32-byte swizzle (a 128-byte swizzle's 64-column tiles cannot be
    sliced at 16 columns for a wgmma)."""
    return (plgpu.TilingTransform((8, 32 // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(32))


def block_words(k_pad: int) -> int:
    """int32 words of one bit per 16-column K block (``residual_blocks``)."""
    return -(-k_pad // (16 * 32))


def check_residual_blocks(residual_blocks: jax.Array, w: W4A4Weights, num_tiles: int,
                          num_ops: int, halves: int, config: TileGemmConfig) -> None:
    """``residual_blocks`` must be int32 ``[T, ceil(Kp / 512)]`` for a call of ``T`` token
    tiles with two unstacked B operands and no wgmma groups left in flight (``mma_overlap``
    0)."""
    shape = (num_tiles, block_words(w.k_pad))
    if residual_blocks.shape != shape or residual_blocks.dtype != jnp.int32:
        raise ValueError(f"residual_blocks: {residual_blocks.dtype}{list(residual_blocks.shape)}; "
                         f"need int32{list(shape)} (a bit per 16-column K block per token tile)")
    if num_ops != 2 or halves != 1:
        raise ValueError("residual_blocks selects the second B operand's K blocks: needs two "
                         f"operands, unstacked (got {num_ops}, stacked={halves == 2})")
    if config.mma_overlap:
        raise ValueError("residual_blocks issues a varying number of wgmmas per step: needs "
                         "mma_overlap=0")


def check_narrow_tiles(config: TileGemmConfig, block_m: int, col_scales, residual_blocks,
                       row0: jax.Array, num_tiles: jax.Array) -> int | None:
    """``narrow_tiles``' requirements; returns the narrow wgmma N (``block_m / 2``), or None
    when off. Concrete ``row0`` and ``num_tiles`` are checked for windows in order."""
    if not config.narrow_tiles:
        return None
    if block_m % 16:
        raise ValueError(f"narrow_tiles: block_m={block_m} must be a multiple of 16 (the "
                         "narrow wgmma N, block_m / 2, a multiple of 8)")
    if col_scales is None or residual_blocks is not None or config.ablation is not None:
        raise ValueError("narrow_tiles stores zeros in a narrow tile's empty slots: needs "
                         "col_scales (scaled output), no residual_blocks and no ablation (got "
                         f"col_scales={col_scales is not None}, residual_blocks="
                         f"{residual_blocks is not None}, ablation={config.ablation!r})")
    if not isinstance(row0, jax.core.Tracer) and not isinstance(num_tiles, jax.core.Tracer):
        live = np.asarray(row0)[:int(np.asarray(num_tiles)[0])]
        if (np.diff(live) < 0).any():
            raise ValueError(f"narrow_tiles: row0 of the live tiles {live.tolist()[:8]}... "
                             "must be nondecreasing (a tile's rows end where the next starts)")
    return block_m // 2


def _code_to_f16(c: jax.Array, decode: str) -> jax.Array:
    """uint16 E2M1 codes (0..15) -> float16 values (layout module docstring)."""
    u16 = jnp.uint16
    sign = (c & u16(8)) << u16(12)
    if decode == "subnormal":
        return lax.bitcast_convert_type(sign | ((c & u16(7)) << u16(9)), jnp.float16)
    mag = c & u16(7)
    # |code| >= 2: exponent and mantissa bits shifted into place, f16 bias (15) minus E2M1's (1)
    # added; |code| == 1 is E2M1's subnormal 0.5 (f16 0x3800); 0 stays 0.
    normal = (mag << u16(9)) + u16(0x3800)
    bits = jnp.where(mag >= u16(2), normal, mag * u16(0x3800))
    return lax.bitcast_convert_type(bits | sign, jnp.float16)


def _nibble_shifts(i: int) -> tuple[str, str]:
    """PTX moving nibble ``i`` of each 16-bit word to f16 bits sign<<15 | magnitude<<9."""
    sign, mag = 12 - 4 * i, 9 - 4 * i
    return (f"shl.b32 s, $1, {sign};" if sign else "mov.b32 s, $1;",
            f"shl.b32 m, $1, {mag};" if mag >= 0 else f"shr.b32 m, $1, {-mag};")


F16_SUBNORMAL_MASK = 0x8E008E00  # sign << 15 | magnitude << 9, in both halves of a register


def signs_high_ops(i: int) -> tuple[tuple[str, int], ...]:
    """The 32-bit operations that turn code ``i`` of both words of a register in the
    "signs_high" layout (``layout.code_bits``) into f16 "subnormal" bits: ``("and", mask)``,
    ``("shl", n)`` or ``("mul", 2^a + 2^b)``. With the sign and the magnitude at different
    distances from their f16 places, a multiply makes the two shifted copies at once: the
    layout keeps them from overlapping (checked by ``signs_high_decode_numpy``'s test over all
    words), so the product is their sum without carries, and one mask keeps the wanted bits."""
    mag_shift, sign_bit = code_bits(i, "signs_high")
    ts, tm = 15 - sign_bit, 9 - mag_shift  # left shifts that put the sign and magnitude in place
    if ts == tm:
        return ((("shl", ts),) if ts else ()) + (("and", F16_SUBNORMAL_MASK),)
    keep = ((1 << sign_bit) | (7 << mag_shift)) * 0x10001
    return (("and", keep), ("mul", (1 << ts) + (1 << tm)), ("and", F16_SUBNORMAL_MASK))


def signs_high_decode_numpy(regs: np.ndarray, i: int) -> np.ndarray:
    """``signs_high_ops(i)`` on uint32 registers in numpy (what the PTX computes)."""
    v = regs.astype(np.uint64)
    for op, arg in signs_high_ops(i):
        v = (v & arg) if op == "and" else (v << arg) if op == "shl" else (v * arg)
        v &= 0xFFFFFFFF
    return v.astype(np.uint32)


def _decode_asm(nibble: int, bits: str) -> str:
    """PTX for ``$0`` = the f16x2 "subnormal" bits of code ``nibble`` of the two words in ``$1``."""
    if bits == "signs_high":
        ops = signs_high_ops(nibble)
        body = []
        for n, (op, arg) in enumerate(ops):
            src, dst = ("$1" if n == 0 else "t"), ("$0" if n == len(ops) - 1 else "t")
            if op == "and":
                body.append(f"and.b32 {dst}, {src}, {arg:#010x};")
            elif op == "shl":
                body.append(f"shl.b32 {dst}, {src}, {arg};")
            else:
                body.append(f"mul.lo.u32 {dst}, {src}, {arg};")
        return "{ .reg .b32 t; " + " ".join(body) + " }"
    sign_op, mag_op = _nibble_shifts(nibble)
    return (f"{{ .reg .b32 s, m; {sign_op} {mag_op} and.b32 s, s, 0x80008000; "
            "and.b32 m, m, 0x0E000E00; or.b32 $0, s, m; }")


def _codes_to_f16_ptx(words: jax.Array, nibble: int, bits: str = "nibbles") -> jax.Array:
    """uint16 ``[64, n]`` words (WGMMA layout) -> float16 ``[64, n]`` "subnormal" values of
    code ``nibble``: each 32-bit register holds two words, decoded with 32-bit ops on both at
    once (Mosaic GPU lowers 16-bit shifts one half at a time, with unpack/repack around them):
    two shifts, two masks and an or per code for "nibbles", one to three ops for "signs_high"
    (``layout`` module docstring)."""
    layout = plgpu.Layout.WGMMA
    asm = _decode_asm(nibble, bits)

    @plgpu.inline_mgpu(
        arg_types=(layout,),
        return_type=plgpu.ShapeDtypeStruct(words.shape, jnp.float16, layout=layout),
    )
    def decode(_, w):
        i32 = ir.IntegerType.get_signless(32)
        regs = np.empty_like(w.registers)
        for idx, reg in np.ndenumerate(w.registers):
            shape = ir.VectorType(reg.type).shape
            out = mgpu_utils.inline_ptx(asm, mgpu_utils.bitcast(reg, i32), result_types=i32)
            regs[idx] = mgpu_utils.bitcast(out, ir.VectorType.get(shape, ir.F16Type.get()))
        return mgpu.FragmentedArray(_registers=regs, _layout=w.layout, _is_signed=None)

    return decode(words)


def _decode_chunk(w16: jax.Array, scales, rows, g: int, mma_dtype, decode: str,
                  config: TileGemmConfig, bits: str = "nibbles") -> jax.Array:
    """Decode K columns [64g, 64g + 64) of a 64-row uint16 tile to ``[64, 64]`` MMA values.

    ``w16``: uint16 ``[64, 64]`` words of the step; ``scales``: SMEM ref ``[16, 128]`` of the
    step's block scales (the MMA dtype, or E4M3), sliced at ``rows``.
    """
    pieces = []
    words = w16[:, 16 * g : 16 * g + 16]
    for i in range(4):
        if config.ablation == "no_decode":
            pieces.append(lax.bitcast_convert_type(words, mma_dtype))
            continue
        if config.decode_impl == "ptx":
            v = _codes_to_f16_ptx(words, i, bits)
        else:
            v = _code_to_f16(word_code(words, i, bits), decode)
        if mma_dtype != jnp.float16:
            v = v.astype(mma_dtype)
        s = scales[4 * g + i, rows]
        if s.dtype != mma_dtype:  # E4M3 scales (float16 MMA): cvt.rn.f16x2.e4m3x2, exact
            s = s.astype(mma_dtype)
        pieces.append(v * lax.broadcast_in_dim(s, (WG_ROWS, 16), (0,)))
    return jnp.concatenate(pieces, axis=1)


def nvfp4_tile_gemm(
    b_tiles: TokenTiles | tuple[jax.Array, ...],
    w: W4A4Weights,
    tile_expert: jax.Array,
    num_tiles: jax.Array,
    *,
    config: TileGemmConfig,
    col_scales: jax.Array | None = None,
    out_dtype=jnp.float32,
    interpret: bool = False,
    residual_blocks: jax.Array | None = None,
    expert_scales: jax.Array | None = None,
    expert_factor: float = 1.0,
) -> jax.Array:
    """Run the kernel.

    Args:
      b_tiles: ``TokenTiles`` (one or two (RAC) operands ``[R, Kp]`` in ``w.mma_dtype`` read
        as windows of ``block_m`` rows), or gathered tiles ``[T, block_m, Kp]`` (a tuple).
      w: the weights in kernel layout, ``E`` matrices ``[Np, Kp]``.
      tile_expert: int32 ``[T]``, the matrix each token tile multiplies.
      num_tiles: int32 ``[1]``, tiles ``t >= num_tiles[0]`` are skipped (their output is garbage).
      col_scales: None, or float32 ``[T, len(b_tiles), block_m]``: the epilogue computes
        ``sum_a acc_a * col_scales[t, a]`` (one scale per token slot; with RAC the two products
        are combined on chip, so the output is one array, not two) and stores it in
        ``out_dtype``.
      out_dtype: the stored dtype with ``col_scales`` (float32 without).
      expert_scales / expert_factor: None, or float32 ``[E]`` (with ``col_scales``): each
        tile's column scales are first multiplied by ``expert_scales[tile_expert[t]] *
        expert_factor`` (one scalar per tile, in the epilogue): the weights' global scales,
        which the caller then need not fold into ``col_scales`` (``w4a4_matmul.slot_scales``
        does that in an XLA kernel per call). The same products, in the same order.
      residual_blocks: None, or int32 ``[T, ceil(Kp / 512)]``: bit ``b % 32`` of word ``b //
        32`` set where 16-column K block ``b`` of tile ``t``'s second B operand (RAC's
        residual, unstacked) may be nonzero; the second operand's wgmmas are issued for those
        blocks only (one k16 wgmma per block, under a branch), the others multiply zeros
        (RAC's per-expert selection keeps a fraction ``rac_ratio`` of the blocks). The second
        operand's SMEM tiles then use a 32-byte swizzle (16-column tiles) so that a block can
        be sliced for a wgmma. Results equal the kernel's without it when the operand is zero
        outside the set blocks.
    Returns:
      ``[T, k_splits, A, block_m, Np]`` partial sums (see module docstring): float32 with
      ``A = len(b_tiles)`` without ``col_scales``; with them ``A = 1`` in ``out_dtype``.
    """
    mma_dtype = jnp.dtype(w.mma_dtype)
    n_pad, k_pad = w.n_pad, w.k_pad
    tiles = TokenTiles.of(b_tiles)
    tiles.check(k_pad, (mma_dtype,))
    t_max, block_m = tiles.num_tiles, tiles.block_m
    if tile_expert.shape != (t_max,):
        raise ValueError(f"tile_expert: shape {tuple(tile_expert.shape)}; need [{t_max}] (one "
                         "per tile)")
    k_steps_total = k_pad // K_TILE
    ptx_ok = not interpret and w.decode == "subnormal" and mma_dtype == jnp.float16
    if config.decode_impl == "auto":
        config = dataclasses.replace(config, decode_impl="ptx" if ptx_ok else "jnp")
    if config.decode_impl == "ptx" and not ptx_ok:
        raise ValueError(
            f"decode_impl='ptx' needs the device (interpret={interpret}), decode='subnormal' "
            f"(got {w.decode!r}) and float16 MMA (got {mma_dtype.name})"
        )
    if k_steps_total % config.k_splits:
        raise ValueError(
            f"TileGemmConfig.k_splits={config.k_splits} does not divide the {k_steps_total} "
            f"K steps of 256 (K padded to {k_pad})"
        )
    k_steps = k_steps_total // config.k_splits
    n_tiles = n_pad // N_TILE
    n_group = config.n_group
    check_n_group(n_group, n_pad)
    n_items = n_tiles // n_group
    num_ops = tiles.num_operands
    if col_scales is None:
        out_dtype, num_out = jnp.dtype(jnp.float32), num_ops
    else:
        out_dtype, num_out = jnp.dtype(out_dtype), 1
        check_col_scales(col_scales, (t_max, num_ops, block_m))
    if expert_scales is not None and (
            col_scales is None or expert_scales.shape != (w.num_experts,)
            or expert_scales.dtype != jnp.float32):
        raise ValueError(f"expert_scales: {expert_scales.dtype}{list(expert_scales.shape)}; "
                         f"need float32 [E] = [{w.num_experts}], with col_scales")
    num_wgs = config.compute_wgs
    # Each pair of compute warpgroups covers the 128 rows of tiles_per_wg of the item's tiles.
    tiles_per_wg = n_group // (num_wgs // NUM_COMPUTE_WGS)
    stores_per_item = tiles_per_wg * num_out  # epilogue copies per work item and warpgroup
    # halves: operands stacked along the wgmma N side (bn = halves * block_m columns per
    # accumulator); num_acc: accumulators (and B tiles) per weight-row tile.
    # Stacked operands are one array [2, R, Kp]: a window [2, block_m, 256] of it lands in SMEM
    # as the [2 * block_m, 256] tile (leading dims fold: same tiled layout).
    halves = 2 if config.stack_operands and num_ops == 2 else 1
    if halves == 2:
        b_arrays = (tiles.stack(),)
        if col_scales is not None:
            col_scales = col_scales.reshape(t_max, 1, 2 * block_m)
    else:
        b_arrays = tiles.operands()
    num_acc = len(b_arrays)
    bn = halves * block_m
    if bn > 256:
        raise ValueError(f"block_m={block_m} with stack_operands: the stacked wgmma N side "
                         f"{bn} exceeds 256")
    if config.ablation == "no_second_mma" and halves == 2:
        raise ValueError("ablation='no_second_mma' skips the second operand's wgmmas: needs "
                         "the operands unstacked (stack_operands=False)")
    if residual_blocks is not None:
        check_residual_blocks(residual_blocks, w, t_max, num_ops, halves, config)
    half_m = check_narrow_tiles(config, block_m, col_scales, residual_blocks, tiles.row0,
                                num_tiles)
    num_sms = config.num_sms or _num_sms()
    # The interpreter cannot run a wgmma on the folded [2 * block_m, 256] view of the stacked
    # [2, block_m, 256] B tile that the device reads: it gets a 2-D copy (registers, then SMEM).
    b_copy = interpret and halves == 2
    slots = store_slots(config)
    stages = tile_stages(config, w, block_m, num_acc, halves, out_dtype, b_copy, k_steps)
    if residual_blocks is not None and residual_blocks_hang(config, stages, k_steps):
        raise ValueError(
            "residual_blocks on two warpgroup pairs (compute_wgs=4) with a one-stage pipeline "
            f"over {k_steps} K steps hangs in interpret mode (session 41; never run on a GPU): "
            "use compute_wgs=2, a smaller mma_k or block_m (more stages), or k_splits"
        )

    # Pipeline step k: K step k of every weight-row tile of the work item's group (a leading
    # block dim of n_group; squeezed when 1) and of the activation tile(s).
    group = None if n_group == 1 else n_group
    in_specs = [
        plgpu.BlockSpec((group, N_TILE, KW_TILE), lambda k: (0, k, 0),
                        transforms=_swizzled(jnp.uint16)),
        plgpu.BlockSpec((group, K_TILE // 16, N_TILE), lambda k: (0, k, 0)),
    ] + [
        plgpu.BlockSpec((2, block_m, K_TILE), lambda k: (0, 0, k),
                        transforms=_swizzled(mma_dtype, stacked=True))
        if halves == 2 else
        plgpu.BlockSpec((block_m, K_TILE), lambda k: (0, k),
                        transforms=(_block_tiled(mma_dtype) if a == 1 and residual_blocks
                                    is not None else _swizzled(mma_dtype)))
        for a in range(num_acc)
    ]

    def window(b, row0, cols):
        """Rows ``[row0, row0 + block_m)`` (of both stacked operands) and columns ``cols``."""
        rows = pl.ds(row0 if isinstance(row0, int) else pl.multiple_of(row0, ROW_ALIGN),
                     block_m)
        return b.at[:, rows, cols] if halves == 2 else b.at[rows, cols]

    def kernel(tile_expert_gmem, num_tiles_gmem, row0_gmem, codes_gmem, scales_gmem, *rest):
        if col_scales is not None:
            cs_gmem, rest = rest[0], rest[1:]
        if expert_scales is not None:
            es_gmem, rest = rest[0], rest[1:]
        if residual_blocks is not None:
            rb_gmem, rest = rest[0], rest[1:]
        b_gmems = rest[:num_acc]
        out_gmem, out_smem = rest[num_acc], rest[num_acc + 1]
        a_smem = rest[num_acc + 2] if config.a_via_smem else None
        b2_smem = rest[num_acc + 3] if b_copy else None

        def get_pipeline(body, compute_context, state=None):
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k_steps,),
                memory_registers=config.memory_registers,
                in_specs=in_specs,
                wg_axis="wg",
                num_compute_wgs=num_wgs,
                max_concurrent_steps=stages,
                compute_context=compute_context,
                pipeline_state=state,
            )

        ignore = lambda *_, **__: None  # noqa: E731
        dummy_b = [window(b, 0, slice(None)) for b in b_gmems]

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
                codes_gmem.at[0, pl.ds(0, n_group)], scales_gmem.at[0, pl.ds(0, n_group)],
                *dummy_b
            ),
            collective_axes="wg",
        )
        def _pipeline_scope(pipeline_allocs):
            wg = lax.axis_index("wg")
            pair_wg = wg if num_wgs == NUM_COMPUTE_WGS else lax.rem(wg, NUM_COMPUTE_WGS)
            rows = pl.ds(pair_wg * WG_ROWS, WG_ROWS)
            # This warpgroup's first tile of the item's group (a static 0 with one pair).
            first_tile = (0 if num_wgs == NUM_COMPUTE_WGS
                          else lax.div(wg, NUM_COMPUTE_WGS) * tiles_per_wg)

            def wg_tile(ref, j: int):
                """This warpgroup's ``j``-th weight-row tile of the step's group."""
                return ref if group is None else ref.at[first_tile + j]

            def column_halves(v):
                """A ``[64, bn]`` accumulator value as its operands' ``[64, block_m]`` parts."""
                if halves == 1:
                    return [v]
                return [v[:, h * block_m:(h + 1) * block_m] for h in range(halves)]

            def work_body(idx, local):
                split, gi, t = work_item(idx, config.k_splits, n_items)
                expert = tile_expert_gmem[t]
                narrow = None
                if half_m is not None:  # at most block_m / 2 rows before the next tile's
                    nxt = row0_gmem[jnp.minimum(t + 1, t_max - 1)]
                    narrow = (t + 1 < num_tiles_gmem[0]) & (nxt - row0_gmem[t] <= half_m)

                def store(value, j: int, a: int):
                    row0 = ((gi * n_group + first_tile + j) * N_TILE
                            + pair_wg * WG_ROWS)
                    seq = local * stores_per_item + j * num_out + a  # this WG's store count
                    ring_store(out_smem.at[wg], value,
                               out_gmem.at[t, split, a, :, pl.ds(row0, WG_ROWS)], seq,
                               config.store_buffers)

                def slot_scales(pieces):
                    """The token slots' scales ``col_scales[t, a, cols]`` for each ``(a,
                    cols)`` (times the tile's expert scale: slot_scales' product, in its
                    order), broadcast over rows later; loaded before the K loop so that the
                    load's latency hides behind it."""
                    col = plgpu.Layout.WGMMA.reduce(0)
                    scales = [plgpu.load(cs_gmem.at[t, a, cols], layout=col, optimized=False)
                              for a, cols in pieces]
                    if expert_scales is not None:
                        w_t = es_gmem[expert] * jnp.float32(expert_factor)
                        scales = [s * w_t for s in scales]
                    return scales

                def wide_context(eval_pipeline):
                    def acc_scope(*acc_refs):  # acc_refs[j * num_acc + a]
                        if col_scales is None:
                            eval_pipeline(acc_refs)
                            for i, acc_ref in enumerate(acc_refs):
                                j, a = divmod(i, num_acc)
                                for h, part in enumerate(column_halves(acc_ref[...])):
                                    store(part, j, a * halves + h)
                            return
                        scales = slot_scales([(a, slice(None)) for a in range(num_acc)])
                        eval_pipeline(acc_refs)
                        for j in range(tiles_per_wg):
                            y = None
                            for a, s in enumerate(scales):
                                acc = acc_refs[j * num_acc + a][...]
                                if config.ablation == "no_compute" or (
                                        a and config.ablation == "no_second_mma"):
                                    # no wgmma fixes the accumulator's layout
                                    acc = plgpu.layout_cast(acc, plgpu.Layout.WGMMA)
                                term = acc * lax.broadcast_in_dim(s, (WG_ROWS, bn), (1,))
                                y = term if y is None else y + term
                            parts = column_halves(y)
                            y = parts[0] if halves == 1 else parts[0] + parts[1]
                            store(y.astype(out_dtype), j, 0)

                    pl.run_scoped(
                        acc_scope,
                        *[plgpu.ACC((WG_ROWS, bn), jnp.float32)
                          for _ in range(tiles_per_wg * num_acc)],
                    )

                def narrow_context(eval_pipeline):
                    def narrow_scope(*acc_refs):  # acc_refs[j * num_ops + op], [64, half_m]
                        # operand op's first half_m slots (stacked: [T, 1, 2 block_m])
                        scales = slot_scales([(0, pl.ds(op * block_m, half_m)) if halves == 2
                                              else (op, pl.ds(0, half_m))
                                              for op in range(num_ops)])
                        eval_pipeline(acc_refs)
                        zeros = plgpu.layout_cast(
                            jnp.zeros((WG_ROWS, block_m - half_m), jnp.float32),
                            plgpu.Layout.WGMMA)
                        for j in range(tiles_per_wg):
                            y = None
                            for op, sc in enumerate(scales):  # the wide epilogue's order
                                term = acc_refs[j * num_ops + op][...] * lax.broadcast_in_dim(
                                    sc, (WG_ROWS, half_m), (1,))
                                y = term if y is None else y + term
                            y = jnp.concatenate([y, zeros], axis=1)
                            store(y.astype(out_dtype), j, 0)

                    pl.run_scoped(
                        narrow_scope,
                        *[plgpu.ACC((WG_ROWS, half_m), jnp.float32)
                          for _ in range(tiles_per_wg * num_ops)],
                    )

                def mma_body(idx, w_smem, s_smem, *refs):
                    b_smems, accs = refs[:num_acc], refs[num_acc]
                    if config.ablation == "no_compute":
                        return accs
                    step_bits = None
                    if residual_blocks is not None:  # this K step's 16 block bits
                        block0 = (split * k_steps + idx[0]) * (K_TILE // 16)
                        word = rb_gmem[t, lax.div(block0, 32)]
                        step_bits = lax.shift_right_logical(word, lax.rem(block0, 32))
                    # The narrow accumulator set (narrow_scope) is num_ops of [64, half_m]
                    # per tile; the wide one num_acc of [64, bn] (bn > half_m).
                    per = num_ops if half_m is not None and accs[0].shape[1] == half_m else None
                    for j in range(tiles_per_wg):
                        if per is not None:
                            tile_mma(wg_tile(w_smem, j), wg_tile(s_smem, j), b_smems,
                                     accs[j * per:(j + 1) * per], narrow=True)
                            continue
                        tile_mma(wg_tile(w_smem, j), wg_tile(s_smem, j), b_smems,
                                 accs[j * num_acc:(j + 1) * num_acc], step_bits)
                    return accs

                def selected_wgmmas(acc, a, b_smem, g: int, step_bits):
                    """One k16 wgmma per 16-column block of wgmma group ``g`` whose bit is
                    set in ``step_bits`` (``residual_blocks``)."""
                    for i in range(config.mma_k // 16):
                        bit = lax.shift_right_logical(step_bits, g * config.mma_k // 16 + i) & 1
                        a_i = (a.at[:, pl.ds(16 * i, 16)] if a_smem is not None
                               else a[:, 16 * i:16 * (i + 1)])
                        b_i = b_smem.at[:, pl.ds(g * config.mma_k + 16 * i, 16)].T

                        @pl.when(bit != 0)
                        def _(a_i=a_i, b_i=b_i):
                            plgpu.wgmma(acc, a_i, b_i)

                def tile_mma(w_smem, s_smem, b_smems, accs, step_bits=None, narrow=False):
                    if halves == 2:  # [2, block_m, 256] -> the [2 * block_m, 256] operand
                        if b2_smem is None:
                            b_smems = [b.reshape(bn, K_TILE) for b in b_smems]
                        else:
                            (b,) = b_smems
                            b2_smem[wg] = b[...].reshape(bn, K_TILE)
                            plgpu.commit_smem()
                            b_smems = [b2_smem.at[wg]]
                    if narrow:  # each operand's first half_m rows, N = half_m, one acc each
                        # (stacked: sliced from the folded tile; Mosaic GPU cannot index the
                        # leading dim of a pipeline slot through its tiling)
                        b_smems = ([b_smems[0].at[pl.ds(op * block_m, half_m)]
                                    for op in range(halves)] if halves == 2 else
                                   [b.at[pl.ds(0, half_m)] for b in b_smems])
                    w16 = w_smem[rows]
                    per = config.mma_k // CHUNK  # chunks per wgmma group
                    n_groups = K_TILE // config.mma_k
                    total = None
                    for g in range(n_groups):
                        chunks = [_decode_chunk(w16, s_smem, rows, c, mma_dtype, w.decode,
                                                config, w.bits)
                                  for c in range(g * per, (g + 1) * per)]
                        a = chunks[0] if per == 1 else jnp.concatenate(chunks, axis=1)
                        last = g == n_groups - 1
                        if config.ablation == "one_mma":  # one product of the summed groups
                            total = a if total is None else total + a
                            if not last:
                                continue
                            a = total
                        if a_smem is not None:
                            a_smem[wg] = a
                            plgpu.commit_smem()
                            a = a_smem.at[wg]
                        cols = pl.ds(g * config.mma_k, config.mma_k)
                        for op, (b_smem, acc) in enumerate(zip(b_smems, accs, strict=True)):
                            if op and config.ablation == "no_second_mma":
                                continue
                            if op and step_bits is not None:
                                selected_wgmmas(acc, a, b_smem, g, step_bits)
                                continue
                            plgpu.wgmma(acc, a, b_smem.at[:, cols].T)
                        plgpu.wgmma_wait(0 if last or a_smem is not None
                                         else config.mma_overlap * len(b_smems))

                k_rows = pl.ds(split * k_steps * N_TILE, k_steps * N_TILE)
                k_blocks = pl.ds(split * k_steps * (K_TILE // 16), k_steps * (K_TILE // 16))
                k_cols = pl.ds(split * k_steps * K_TILE, k_steps * K_TILE)
                tiles = pl.ds(gi * n_group, n_group)
                refs = (codes_gmem.at[expert, tiles, k_rows],
                        scales_gmem.at[expert, tiles, k_blocks],
                        *[window(b, row0_gmem[t], k_cols) for b in b_gmems])
                # A pipeline evaluates once per compute context: narrow tiles get their own.
                context = (wide_context if narrow is None
                           else (narrow, narrow_context, wide_context))
                return refs, mma_body, context

            run_work_items(get_pipeline, pipeline_allocs,
                           num_tiles_gmem[0] * (n_items * config.k_splits), config.chain_items,
                           work_body)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = [plgpu.SMEM((num_wgs, slots, block_m, WG_ROWS), out_dtype)]
    if config.a_via_smem:
        scratch.append(
            plgpu.SMEM((num_wgs, WG_ROWS, config.mma_k), mma_dtype,
                       transforms=(_swizzled(mma_dtype) if residual_blocks is None
                                   else _block_tiled(mma_dtype)))
        )
    if b_copy:
        scratch.append(plgpu.SMEM((num_wgs, bn, K_TILE), mma_dtype,
                                  transforms=_swizzled(mma_dtype)))
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((t_max, config.k_splits, num_out, block_m, n_pad), out_dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=num_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=scratch,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    optional = tuple(a for a in (col_scales, expert_scales, residual_blocks) if a is not None)
    # jax's register split for 4 compute warpgroups deadlocks (compute_registers); for 2 at the
    # copy warpgroup's 40 it is the same split, so ours serves every case.
    with _fitted_compute_registers():
        return call(tile_expert, num_tiles, tiles.row0, w.codes, w.scales, *optional, *b_arrays)


def tile_gemm_reference(
    b_tiles: TokenTiles | tuple[jax.Array, ...], w: W4A4Weights, tile_expert: jax.Array,
    col_scales: jax.Array | None = None, out_dtype=jnp.float32,
    residual_blocks: jax.Array | None = None, expert_scales: jax.Array | None = None,
    expert_factor: float = 1.0,
) -> jax.Array:
    """The kernel's result with ``k_splits=1`` in jnp: float32 ``[T, 1, A, block_m, Np]``, or
    with ``col_scales`` ``[T, A, block_m]`` their weighted sum ``[T, 1, 1, block_m, Np]`` in
    ``out_dtype``; with ``residual_blocks`` the second operand's unset blocks are zero."""
    from pallas_kernels.layout import dequantize_w4a4_weights

    b_tiles = TokenTiles.of(b_tiles).gathered()
    if residual_blocks is not None:
        b0, b1 = b_tiles
        k = b1.shape[-1]
        block = jnp.arange(k, dtype=jnp.int32) // 16  # [Kp] the block of each column
        words = residual_blocks[:, block // 32]  # [T, Kp]
        keep = jnp.right_shift(words, block % 32) & 1  # bit 31 too: & 1 drops the sign fill
        b_tiles = (b0, jnp.where(keep[:, None, :] != 0, b1, jnp.zeros((), b1.dtype)))
    wd = dequantize_w4a4_weights(w)  # [E, N, K] e2m1 * s
    wd = wd / w.code_factor
    e = wd.shape[0]
    n_pad, k_pad = w.n_pad, w.k_pad
    wd = jnp.pad(wd, ((0, 0), (0, n_pad - w.n), (0, k_pad - w.k)))
    w_t = wd[jnp.clip(tile_expert, 0, e - 1)]  # [T, Np, Kp]
    outs = [
        jnp.einsum("tnk,tmk->tmn", w_t, b.astype(jnp.float32), precision="highest")
        for b in b_tiles
    ]
    if col_scales is None:
        return jnp.stack(outs, axis=1)[:, None]
    if expert_scales is not None:
        w_t = expert_scales[jnp.clip(tile_expert, 0, e - 1)] * jnp.float32(expert_factor)
        col_scales = col_scales * w_t[:, None, None]
    y = sum(o * col_scales[:, a, :, None] for a, o in enumerate(outs))
    return y[:, None, None].astype(out_dtype)
