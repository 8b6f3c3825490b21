"""Dense NVFP4 W4A4 matmul ``Y = X W^T`` on Hopper (Mosaic GPU), with optional fused RAC.

``w4a4_matmul(x, w)``: X ``[M, K]`` bf16 is quantized to NVFP4 (per token or per batch, plus the
RAC residual of the selected blocks) in XLA fusions of the same jitted program (plain per-token
decode: straight into the kernel's operand by ``act_operands``); the Mosaic GPU
kernel (``nvfp4_tiles_mgpu``) decodes the NVFP4 weight in registers and multiplies it with the
quantized activations (and, with RAC, the quantized residual: same weight registers, so the
weight is read once); one small XLA fusion sums K splits and applies the global scales.
``w4a4_matmul_reference`` is the same math in jnp.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import nvfp4_quantize as aq
from pallas_kernels.layout import K_TILE, N_TILE, W4A4Weights, prepare_w4a4_weights
from pallas_kernels.nvfp4_tiles_mgpu import (
    TileGemmConfig,
    _num_sms,
    block_words,
    check_n_group,
    nvfp4_tile_gemm,
    residual_blocks_hang,
    tile_stages,
)
from pallas_kernels.token_tiles import TokenTiles
from quads_jax.quant import nvfp4, rac

MAX_BLOCK_M = 64  # a pipeline stage of 64 tokens x 256 K (f16) is 32 KB; RAC doubles it


@dataclasses.dataclass(frozen=True)
class W4A4MatmulConfig:
    """Tuning of the dense and grouped W4A4 matmuls.

    Attributes:
      block_m: tokens per tile (the wgmma N side), a multiple of 8 in [8, 256]; None = M rounded
        up to 8 when M <= 64 (decode: one tile), else 64 (dense) / chosen per group size
        (grouped).
      k_splits: split-K factor; None = the smallest that fills the SMs (see ``auto_k_splits``).
      max_concurrent_steps: pipeline depth.
      a_via_smem: decoded weight tile through SMEM (for the CPU interpreter).
      num_sms: persistent CTAs; None = the device's SM count.
      mma_dtype: float16 | bfloat16, used when the weight arrives as an NVFP4Tensor.
      prefill_min_rows: dense calls with at least this many rows skip the decode kernel: the
        weight is decoded to its exact bf16/f16 values once per call (an XLA fusion, ~5% of a
        compute-bound GEMM at M = 8192) and multiplied by XLA's GEMM (PALLAS_NOTES 6.4; the
        product is the same exact-operand f32-accumulated W4A4). None = always the kernel.
      rac_prefill_columns: large-M dense GEMMs with RAC (``prefill_min_rows``) contract the
        residual over its selected blocks' columns only (``rac_block_columns``), taken as
        whole 16-column blocks; False: over all K (its unselected blocks are zeros). On an
        H100 (2026-12-05, 1657f33, M = 8192, K x N = 4096 x 14336): RAC +52 % device time
        over W4A4 with the selected blocks, +88 % over all K.
      windowed_operands: the kernels read token tiles as row windows of a compact operand
        (``token_tiles``), not as gathered ``[T, block_m, Kp]`` tiles.
      materialize_operands: with RAC, the distinct rows' operand values and residual are
        computed once before the row gathers (``operand_rows``); False is the ablation.
      rac_select_kernel: grouped GEMMs with RAC select blocks and code the residual's scales
        in ``pallas_kernels.rac_select`` (where its ``supports`` holds), not in jnp;
        rac_select_block_rows: its ``RACSelectConfig.block_rows``; rac_select_in_operands:
        in grouped decode calls, inside ``rac_operands`` instead (see the field's comment);
        rac_select_slot_scales: it also writes the tile kernels' token-slot scales.
      rac_operand_kernel: with RAC (coded residual, ``materialize_operands``, row windows and
        ``stack_operands``), the stacked B operands are written by
        ``pallas_kernels.rac_operands`` instead of an XLA gather fusion;
        rac_operand_block_rows / rac_operand_padding: its ``RACOperandsConfig.block_rows`` /
        ``padding_rows``; rac_operand_block_rows_prefill: its ``block_rows`` in grouped calls
        of at least ``prefill_min_rows`` rows; rac_operand_recompute_placed: its
        ``recompute_placed``; operand_warps: its and ``act_operands``' ``num_warps``.
      act_operand_kernel: plain W4A4 with per-token activation scales (no RAC) and row
        windows: the B operand is quantized and laid out by ``pallas_kernels.act_operands``
        (bit-identical); act_operand_block_rows: its ``block_rows``.
      rac_row_kernel: RAC with per-token scales and a residual score: the distinct rows'
        operand values and residual statistics from ``pallas_kernels.rac_rows`` (one kernel);
        rac_row_block_rows / rac_row_block_k / rac_row_warps / rac_row_scales /
        rac_row_scale_programs: its ``RACRowsConfig`` (``block_rows``, ``block_k``,
        ``num_warps``, ``row_scales``, ``scale_programs``).
      rac_placed_values: large grouped RAC calls without source rows: ``rac_rows`` writes the
        operand values into the windowed stacked operand itself (see the field's comment).
      tile_plan_kernel: grouped GEMMs compute their token-tile plan in
        ``pallas_kernels.tile_plan`` (one kernel) instead of jnp (same arrays);
        tile_plan_block / tile_plan_warps: its ``TilePlanConfig``.
      decode_impl, mma_overlap, mma_k, chain_items, stack_operands, store_buffers,
        compute_wgs: see ``nvfp4_tiles_mgpu.TileGemmConfig``.
      n_group: weight-row tiles per work item (``TileGemmConfig.n_group``). 1 by default: on
        the H200 (2026-12-03, decode step of 128 sequences) 2 left the expert kernels' time in
        the rollout unchanged (90.5 vs 90.9 us per call). (The earlier version, one pipeline
        step per tile, made the 768-wide down projection slower at 4: 157 -> 211 us.)
    """

    block_m: int | None = None
    k_splits: int | None = None
    max_concurrent_steps: int = 4
    a_via_smem: bool = False
    num_sms: int | None = None
    mma_dtype: str = "float16"
    prefill_min_rows: int | None = 2048
    decode_impl: str = "auto"
    mma_overlap: int = 0
    mma_k: int = 256
    materialize_operands: bool = True
    n_group: int = 1
    chain_items: bool = True
    # On the H200 (2026-12-03, 4a3768d, same call): the RAC decode step 19.37 -> 18.37 ms at
    # batch 128; the grouped kernels alone: gate_up +RAC 114.6 -> 97.7 us, down 59.8 -> 51.8.
    stack_operands: bool = True
    # Grouped GEMMs with RAC (up to rac_select.MAX_ROWS rows): the per-expert block selection,
    # coded for rac_operands, in one Triton kernel (``pallas_kernels.rac_select``) instead of
    # five XLA kernels per GEMM. On an H100 (2026-12-06, 8581402, batch-128 decode step, 24
    # layers, same call): 6.2 + 4.7 us per layer against ~18.6, 144 kernels per step fewer,
    # the step 8.76 ms against 8.84 (16 rows per step: 8.80); at d126d0a (the first step's
    # loads hoisted) 5.8 + 3.5 us, the step 8.67 against 8.84. Its serial walk over an
    # expert's rows is latency-bound: with one expert holding 225 of 1 024 rows, down's call
    # took 12.4 us against the jnp path's 10.4 (``kernel_probe --rac-select``).
    rac_select_kernel: bool = True
    rac_select_block_rows: int = 32
    # Grouped decode calls (fewer than prefill_min_rows rows) with the selection kernel, the row
    # pass and the stacked operand kernel: each rac_operands program selects its expert's blocks
    # itself (``rac_operands.OperandSelection``: rac_select's functions, the same bits) and
    # rac_select does not run (XLA drops its unused call). Off: slower. H100, 2026-12-07,
    # 0a38c18, nvfp4_rac at batch 128 (24 layers, `h200_next.sh rsel4`; GPU check PASS, rel err
    # 1.39e-7): rac_operands 56.7 + 20.4 us per layer (gate_up + down) against 7.7 + 3.8 plus
    # rac_select's 5.8 + 3.7; the step 9.72 ms against 8.55 (16 rows per walk step: 9.64).
    # Every one of gate_up's 1 936 programs (242 row blocks x 8 column blocks) repeats its
    # expert's 128 x 128 rank, where rac_select ranks once per expert.
    rac_select_in_operands: bool = False
    # Grouped RAC calls whose selection runs in rac_select (and block_m a power of two): the
    # selection kernel also writes the tile kernels' epilogue scales [T, 2, block_m] (each
    # expert's program knows its tiles), so XLA's two slot-scale fusions per layer (2.0 + 2.2
    # us on an H100, 2026-12-07 trace) drop out. Measured (H100, ef612da, `h200_next.sh
    # sslot`; GPU check PASS): the step 8.30 against 8.30 ms: the fusions were gone, but
    # rac_select took +0.6 / +0.4 us and the weights' scales times the code factor became two
    # XLA multiplies of 1.4 / 1.6 us. Since then the tile kernel applies the weights' global
    # scales in its epilogue (`nvfp4_tile_gemm(expert_scales=)`: a dynamic slice of the
    # stacked layers' scales: XLA passes the weight codes to Mosaic calls that way without a
    # copy, `dynamic-slice-fusion`, and should these too) and rac_select writes the token
    # scales alone (not timed on a GPU, the HLO not read). Off until it is.
    rac_select_slot_scales: bool = False
    # On: the residual GEMM over the selected blocks. On the H200 (2026-12-05, 7e950af, M =
    # 8192, K x N = 4096 x 14336) it took 584 us against 1093 over all K, but the columns
    # gathered element by element (`b[:, cols]`, `wd[:, cols]`) took 355 + 2 x 264 us (device
    # 2958 against 2619 us); taken as whole 16-column blocks (`_take_blocks`), on an H100
    # (1657f33): 2207 against 2719 us, W4A4 alone 1447.
    rac_prefill_columns: bool = True
    windowed_operands: bool = True
    # On the H200 (2026-12-04, 22273a2, batch-128 decode step, same call): 8.2 + 4.4 us per
    # layer for gate_up's and down's stacked operands against the XLA fusion's 20.5 + 8.2, the
    # RAC step 16.17 against 17.08 ms (plain nvfp4: 15.32); bit-identical on the GPU
    # (kernel_probe --rac-operands).
    rac_operand_kernel: bool = True
    rac_operand_block_rows: int = 8
    # rac_operands' window rows per program in grouped calls of at least prefill_min_rows rows.
    # H100, 2026-12-06 (`kernel_probe.py --prefill-tiles`, 8 192 rows, K x N = 2048 x 768, three
    # runs in two calls): 4 rows took the kernel 41.0-41.5 us against 44.2-45.2 at 8 (2 rows:
    # 48.7-49.0; 4 rows with 8 warps: 48.9-49.1), the call 258.6-260.2 us of device time
    # against 262.8-263.1 (RAC over W4A4 +55.0 / +55.7 % against +57.0 / +57.3 % in the same
    # runs). Decode calls keep rac_operand_block_rows (not measured at 4).
    rac_operand_block_rows_prefill: int = 4
    rac_operand_padding: str = "zeros"
    # Triton warps per program of the two window-operand kernels (rac_operands, act_operands).
    # H100, 2026-12-06, the same probe: 2 or 8 warps changed the grouped prefill's device time
    # by -1 to +3 us (act_operands 34.7-35.2 us at 4 warps, 36.5-37.0 at 8).
    operand_warps: int = 4
    # Plain W4A4 with per-token scales: the windowed B operand quantized straight from the
    # activations by ``pallas_kernels.act_operands`` instead of the quantizer's XLA passes
    # and a gather (act_operand_block_rows: its block_rows). On the H200 (2026-12-04,
    # 8619555, kernel_probe --act-operands): 12.5 + 7.0 us per layer (gate_up + down, 3
    # kernels each) against 14.9 + 10.7 us (7 + 6 kernels); bit-identical.
    act_operand_kernel: bool = True
    act_operand_block_rows: int = 8
    # RAC with per-token scales: the activations' operand values and the residual's block
    # statistics of the distinct rows from one Triton kernel (``pallas_kernels.rac_rows``)
    # instead of the quantizer's and the residual's XLA passes (5-6 kernels of 1.1-3.3 us per
    # GEMM in the H100's batch-128 decode step, 2026-12-05).
    rac_row_kernel: bool = True
    # rac_rows' grid (RACRowsConfig: rows and columns per program, warps). H100, 2026-12-06
    # (`kernel_probe.py --prefill-tiles`, 8 192 rows x K = 2048): rows 4 / 16, columns 128 / 512
    # / 1024, 2 or 8 warps all kept the kernel at 43.2-45.8 us (8 / 256 / 4: 43.5), the call
    # within 261.4-273.3 us against 263.1: it is bound by its arithmetic, not its grid.
    rac_row_block_rows: int = 8
    rac_row_block_k: int = 256
    rac_row_warps: int = 4
    # rac_rows computes the rows' per-token decode scales itself (RACRowsConfig.row_scales),
    # whole rows per program: the XLA row amax and its select before it drop out (per layer of
    # the decode step, H100 2026-12-07 trace: 1.5 + 1.1 us for gate_up's 128 rows, the amax
    # half of down's swiglu fusion and a 1.2 us select). Measured slower (H100, 2026-12-07,
    # e712677, `h200_next.sh rscale2`): the whole-row programs took 5.7 / 4.6 us (gate_up /
    # down at 512 programs) against 2.5 / 3.7 plus the XLA passes they replace, the step 8.43
    # against 8.41 ms (72 kernels fewer per step, busy time +0.02 ms). Off.
    rac_row_scales: bool = False
    rac_row_scale_programs: int = 128
    # Grouped RAC calls whose rows are their own distinct rows (no source_rows) and at least
    # prefill_min_rows: rac_rows writes each row's operand values straight into the windowed
    # stacked operand and rac_operands completes that buffer in place (operand 1 and the empty
    # rows), so the values are written once instead of written, read and written again (~33
    # of ~200 MB at the 8 192 x 2 048 prefill). Bit-identical (tests; on an H100 rel. err
    # 4.3e-7 against the f64 product, as without). H100, 2026-12-06, 07e3e01, `kernel_probe.py
    # --prefill-tiles --variants "base,placed values"`: grouped prefill + RAC 0.5 274.1 against
    # 284.2 us of device time (rac_operands 46.3 against 55.5 us), RAC over W4A4 +63 % against
    # +70 %; plain W4A4 unchanged (168.1 / 167.3).
    rac_placed_values: bool = True
    # With rac_placed_values: rac_operands recomputes the placed operand values from the x
    # block it reads for the residual instead of reading them back (RACOperandsConfig.
    # recompute_placed; bit-identical). Off: on an H100 (2026-12-06, the grouped prefill at 8 192
    # rows, two runs) the kernel took 59.5-59.9 us against 44.4-45.0 reading them (the
    # quantizer's arithmetic costs more than 2 bytes per element of reads).
    rac_operand_recompute_placed: bool = False
    # Grouped GEMMs: the token-tile plan (``w4a4_grouped.tile_plan``) in one Pallas kernel
    # (``pallas_kernels.tile_plan``) instead of ~10 small XLA kernels per layer. On the H200
    # (2026-12-04, b9d0759, batch-128 decode step, same call, with act_operand_kernel): 5.2 us
    # per layer; nvfp4_rac 15.68 against 16.23 ms, nvfp4 14.56 against 15.31 ms (both off).
    # Block 8 with 2 warps (2026-12-05, c916b59, same machine): 3.9 us per layer in the
    # rollout against 5.2 at block 16 / 4 warps (traced; the step's median within noise).
    tile_plan_kernel: bool = True
    tile_plan_block: int = 8
    tile_plan_warps: int = 2
    store_buffers: int = 0
    compute_wgs: int = 2
    # Grouped decode calls without RAC (one B operand, fewer than prefill_min_rows rows) run two
    # warpgroup pairs on work items of two weight-row tiles (compute_wgs 4, n_group >= 2; the
    # fields above where the weight's row tiles do not pair up). On the H200 (2026-12-06,
    # 191e654, the decode step's grouped calls alone at 128 sequences, top-8 of 128 experts,
    # rollout defaults, `kernel_probe --grouped-ablations`): gate_up 85.3 -> 66.8 us, down 52.2
    # -> 38.1 (0.66 / 0.63 -> 0.84 / 0.87 of the format's bytes at our FP8 kernel's streaming
    # rate, 4.03 / 3.42 TB/s). With RAC's stacked operand gate_up was slower (89.9 -> 98.3 us,
    # 93.8 at mma_k 128) and down faster (47.1 -> 41.6 at mma_k 128): RAC calls keep the fields.
    # In the rollout (H100, 2026-12-07, d283154, batch 128, 24 layers, `h200_next.sh w41`):
    # nvfp4's decode step 8.19 -> 7.98 ms; GPU-checked at mma_k 256 (PASS).
    wide_plain_decode: bool = True
    # The same for grouped RAC decode calls (two B operands, stacked or not). Off: slower on
    # two pairs in every measurement. H200 (session 40): stacked gate_up 93.8-98.3 us against
    # 89.9 on one pair (down 41.6 against 47.1). H100 (2026-12-07, 9c1fa62, the decode step's
    # calls alone): stacked gate_up 117.6 against 97.1 us, down 56.7 against 50.8; nvfp4_rac
    # at batch 128 (24 layers, `h200_next.sh widerac`) 9.07 ms (mma_k 256), 8.94 (mma_k 128),
    # 9.84 (unstacked, `rac_selected_wgmmas`) against 8.43 on one pair.
    wide_rac_decode: bool = False
    # Grouped RAC decode calls with K at most this (the padded K; 0: none) run on two pairs
    # even with wide_rac_decode off: on the H200 (session 40) the down projection's RAC call
    # (K = 768 at Qwen3-30B-A3B's shape) took 41.6 us on two pairs against 47.1 on one, while
    # gate_up's (K = 2048) got slower; on the H100 (session 42) both got slower. In the
    # rollout on the H200 (2026-12-07, 6fe280d, nvfp4_rac at batch 128, 48 layers,
    # `h200_next.sh wdown`; GPU check PASS) 1024 made the step slower: 14.47 ms against
    # 14.07-14.31 at 0. Off (0).
    wide_rac_decode_max_k: int = 0
    # Grouped RAC calls with unstacked operands: the residual operand's wgmmas only for the K
    # blocks selected in each token tile (``nvfp4_tile_gemm``'s ``residual_blocks``, from the
    # selection's mask; the others multiply zeros): at ratio 0.5 half of them. Off: on the H100
    # (2026-12-07, d283154, the decode step's gate_up alone on two pairs, unstacked) the
    # residual's wgmmas took 17.5 of 114.6 us and issuing them for a random half of the blocks,
    # one k16 wgmma per block under a branch, 114.3: no gain.
    rac_selected_wgmmas: bool = False
    # The tile kernel's copy-warpgroup registers (``TileGemmConfig.memory_registers``) in calls
    # on two warpgroup pairs, where the compute warpgroups get 104 registers at 40 and 112 at
    # 24; one-pair calls keep 40 (232 each). 40: on the H100 (2026-12-07, 7d0543e, batch
    # 128, 24 layers, `h200_next.sh mem24`) nvfp4_rac with RAC's decode calls on two pairs at
    # 24 took 8.56 ms a step against 8.09 at the defaults (one pair).
    wide_memory_registers: int = 40
    # Grouped decode calls multiply the token tiles that hold at most block_m / 2 rows at
    # wgmma N = block_m / 2 (``TileGemmConfig.narrow_tiles``; block_m a multiple of 16, no
    # ``rac_selected_wgmmas``): at the decode step's ~8 tokens per expert in tiles of 16, about
    # 60 % of the tiles, N 8 instead of 16 (8 + 8 instead of RAC's stacked 32). Off until timed
    # on a GPU (`h200_next.sh narrow`).
    narrow_tiles: bool = False

    def __post_init__(self):
        bm = self.block_m
        if bm is not None and (not isinstance(bm, int) or bm % 8 or not 8 <= bm <= 256):
            raise ValueError(f"W4A4MatmulConfig.block_m={bm!r}: None or a multiple of 8 in [8, 256]")
        if self.k_splits is not None and (not isinstance(self.k_splits, int) or self.k_splits < 1):
            raise ValueError(f"W4A4MatmulConfig.k_splits={self.k_splits!r}: None or an int >= 1")
        if self.mma_dtype not in ("float16", "bfloat16"):
            raise ValueError(
                f"W4A4MatmulConfig.mma_dtype={self.mma_dtype!r}: one of ('float16', 'bfloat16')"
            )
        self.tile_config(1, self.num_sms, self.n_group)
        TileGemmConfig(memory_registers=self.wide_memory_registers)
        self.rac_operands_config()
        self.rac_operands_config(prefill=True)
        self.act_operands_config()
        self.rac_row_pass(False)
        self.tile_plan_config()
        wk = self.wide_rac_decode_max_k
        if not isinstance(wk, int) or isinstance(wk, bool) or wk < 0:
            raise ValueError(f"W4A4MatmulConfig.wide_rac_decode_max_k={wk!r}: an int >= 0 "
                             "(0: no RAC call by its K alone)")
        p = self.prefill_min_rows
        if p is not None and (not isinstance(p, int) or p < 1):
            raise ValueError(f"W4A4MatmulConfig.prefill_min_rows={p!r}: None or an int >= 1")
        if self.rac_selected_wgmmas and (self.stack_operands or self.mma_overlap):
            raise ValueError("W4A4MatmulConfig.rac_selected_wgmmas issues the residual's "
                             "wgmmas per selected block: needs stack_operands=False and "
                             f"mma_overlap=0 (got {self.stack_operands}, {self.mma_overlap})")

    def wide_decode(self, m: int, rac: bool, k_pad: int) -> bool:
        """A grouped call of ``m`` rows and padded depth ``k_pad`` (with RAC's second operand
        or not) asks for two warpgroup pairs (``wide_plain_decode`` / ``wide_rac_decode`` /
        ``wide_rac_decode_max_k``; decode calls only)."""
        if self.is_prefill(m):
            return False
        if not rac:
            return self.wide_plain_decode
        return self.wide_rac_decode or k_pad <= self.wide_rac_decode_max_k

    def is_prefill(self, m: int) -> bool:
        """A call of ``m`` GEMM rows runs the prefill paths (``prefill_min_rows``)."""
        return self.prefill_min_rows is not None and m >= self.prefill_min_rows

    def rac_operands_config(self, prefill: bool = False):
        """The ``rac_operands`` kernel's config, or None when it is off (``operand_rows``);
        ``prefill``: a grouped call of at least ``prefill_min_rows`` rows."""
        from pallas_kernels.rac_operands import RACOperandsConfig

        if not (self.rac_operand_kernel and self.materialize_operands and self.windowed_operands
                and self.stack_operands):
            return None
        rows = self.rac_operand_block_rows_prefill if prefill else self.rac_operand_block_rows
        return RACOperandsConfig(block_rows=rows,
                                 num_warps=self.operand_warps,
                                 padding_rows=self.rac_operand_padding,
                                 recompute_placed=self.rac_operand_recompute_placed)

    def act_operands_config(self):
        """The ``act_operands`` kernel's config, or None when it is off (``operand_rows``)."""
        from pallas_kernels.act_operands import ActOperandsConfig

        if not (self.act_operand_kernel and self.windowed_operands):
            return None
        return ActOperandsConfig(block_rows=self.act_operand_block_rows,
                                 num_warps=self.operand_warps)

    def rac_row_pass(self, interpret: bool, placement=None):
        """``nvfp4_quantize``'s ``row_pass`` argument: None when ``rac_row_kernel`` is off;
        ``placement``: None or ``(window_of_row, P)`` (``rac_placed_values``)."""
        from pallas_kernels.rac_rows import RACRowsConfig

        if not self.rac_row_kernel:
            return None
        rows = RACRowsConfig(block_rows=self.rac_row_block_rows, block_k=self.rac_row_block_k,
                             num_warps=self.rac_row_warps, row_scales=self.rac_row_scales,
                             scale_programs=self.rac_row_scale_programs)
        return rows, interpret, jnp.dtype(self.mma_dtype), placement

    def tile_plan_config(self):
        """The ``tile_plan`` kernel's config (``tile_plan_block`` entries per program,
        ``tile_plan_warps`` warps), or None when it is off (the jnp plan)."""
        from pallas_kernels.tile_plan import plan_config

        return plan_config(self.tile_plan_kernel, self.tile_plan_block, self.tile_plan_warps)

    def tile_config(self, k_splits: int, num_sms: int | None, n_group: int,
                    compute_wgs: int | None = None) -> TileGemmConfig:
        """The tile kernel's config for a call with ``k_splits`` on ``num_sms`` SMs
        (``n_group`` / ``compute_wgs``: the call's, None: this config's compute_wgs)."""
        wgs = self.compute_wgs if compute_wgs is None else compute_wgs
        return TileGemmConfig(
            k_splits=k_splits, max_concurrent_steps=self.max_concurrent_steps,
            a_via_smem=self.a_via_smem, num_sms=num_sms, decode_impl=self.decode_impl,
            mma_overlap=self.mma_overlap, mma_k=self.mma_k, n_group=n_group,
            chain_items=self.chain_items,
            stack_operands=self.stack_operands, store_buffers=self.store_buffers,
            compute_wgs=wgs,
            memory_registers=(self.wide_memory_registers if wgs == 4
                              else TileGemmConfig.memory_registers))


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


# The SM-wave efficiency at which auto_k_splits stops splitting K: more splits restart the copy
# pipeline more often and make the kernel store float32 partial sums for an extra pass.
GOOD_WAVE_EFFICIENCY = 0.85
# One partial wave (an item per SM, some SMs idle) at this efficiency or more is not split.
ONE_WAVE_EFFICIENCY = 0.84


def auto_k_splits(work_items: int, k_steps: int, num_sms: int,
                  good_efficiency: float = GOOD_WAVE_EFFICIENCY) -> int:
    """Split-K factor: none where the items fill one wave of the SMs at
    ``ONE_WAVE_EFFICIENCY`` or more; else the fewest splits (each of >= 2 K steps) whose
    SM-wave efficiency (items / SM slots of the last full wave) reaches ``good_efficiency``,
    else the most efficient (ties: fewer splits).

    Measured on the H100 (2026-12-06, ``bench_kernels --part splits``, dense decode at M =
    16, traced device us for split-K 1 / 2 / 4 / 8): K x N = 4096 x 14336 (112 items of 128
    weight rows for 132 SMs, one wave at 0.848, which the 0.85 rule split 8 ways): W4A4 22.5
    / 23.4 / 25.0 / 26.0, our FP8 27.9 / 28.7 / 29.9 / 30.8 (XLA's FP8 GEMV 28.7): one wave
    unsplit is fastest. 4096 x 57344 (448 items, 3.4 waves at 0.848): W4A4 64.2 / 63.5 /
    65.9 / 75.5 (the 0.85 rule's 2 split: 62.4), FP8 85.4 / 88.6 / 91.4 (XLA 86.1): hence
    the FP8 kernel's ``good_efficiency`` of 0.84 (``w8a8_matmul``)."""
    if work_items <= num_sms and work_items / num_sms >= ONE_WAVE_EFFICIENCY:
        return 1
    best, best_eff = 1, 0.0
    for s in range(1, k_steps + 1):
        if k_steps % s or (s > 1 and k_steps // s < 2):
            continue
        items = work_items * s
        eff = items / (-(-items // num_sms) * num_sms)
        if eff >= good_efficiency:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def as_kernel_weights(w, mma_dtype: str) -> W4A4Weights:
    """Accept kernel-layout weights as they are; convert an ``NVFP4Tensor`` (a full weight pass)."""
    if isinstance(w, W4A4Weights):
        return w
    if isinstance(w, nvfp4.NVFP4Tensor):
        return prepare_w4a4_weights(w, mma_dtype=mma_dtype)
    raise ValueError(f"w_q: expected an NVFP4Tensor or W4A4Weights, got {type(w).__name__}")


def _pad_k(a: jax.Array, k_pad: int) -> jax.Array:
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, k_pad - a.shape[-1])])


def gather_rows(rows: jax.Array, index: jax.Array, dtype, k_pad: int) -> jax.Array:
    """Rows ``[R, K]`` at ``index`` (int32, any shape ``I``; ``>= R`` = a zero row) in
    ``dtype``, K zero-padded to ``k_pad``: ``I + [Kp]``."""
    return _pad_k(rac.rows_or_fill(rows.astype(dtype), index, 0), k_pad)


def plain_operand(rows: jax.Array, index: jax.Array, dtype, k_pad: int,
                  row_scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """One B operand of plain rows ``[R, K]`` at ``index`` (``gather_rows``) and each row's
    float32 scale ``I`` from ``row_scales [R]`` (None: 1; zero rows 0)."""
    g = jnp.ones((rows.shape[0],), jnp.float32) if row_scales is None else row_scales
    return (gather_rows(rows, index, dtype, k_pad),
            rac.rows_or_fill(g.astype(jnp.float32), index, 0.0))


def source_tile_rows(source_rows: jax.Array, num_rows: int, row_index: jax.Array) -> jax.Array:
    """``row_index`` (GEMM rows, >= M = empty) mapped to rows of an operand of ``num_rows``
    distinct rows through ``source_rows [M]`` (empty -> ``num_rows``, its zero row)."""
    return rac.rows_or_fill(source_rows, row_index, num_rows)


def operand_rows(acts: aq.QuantizedActivations, index: jax.Array, dtype, k_pad: int,
                 materialize: bool = True, kernel=None, interpret: bool = False,
                 selection=None,
                 ) -> tuple[tuple[jax.Array, ...] | jax.Array, tuple[jax.Array, ...]]:
    """The W4A4 kernel's B operands for GEMM rows ``index`` (int32, any shape ``I``; ``>= M``
    = a zero row): ``I + [Kp]`` in ``dtype`` (1, or 2 with RAC) and each row's activation
    decode scale ``I`` (0 for zero rows).

    The activation operand is gathered from its distinct rows (``acts.q_rows``); RAC's
    residual operand is coded straight from the distinct rows' residual
    (``rac.SelectedResidual.unscaled``): one elementwise pass, no separate ``[M, K]`` residual
    and no uint8 codes between. ``materialize`` (with RAC's coded residual): the distinct
    rows' operand values, residual and float32 block scales are computed once, behind an
    optimization barrier, before the row gathers replicate them (a decode step's windowed
    gate_up operand holds each of its 128 tokens' rows ~15 times); without it XLA fused the
    residual's producers into the gather and redid them for every windowed row. On the H200 (2026-12-04, 81f981d, batch-128
    decode step): RAC's two operand fusions 20.6 + 8.6 us per layer instead of 22.7 + 9.6, the
    step 17.72 against 18.00 ms; without RAC the barrier only added a kernel per GEMM (16.22
    against 15.98 ms), so plain operands never get it.

    ``kernel``: a ``rac_operands.RACOperandsConfig`` (``W4A4MatmulConfig.rac_operands_config``)
    or None. With it, a 1-D ``index``, RAC's coded residual and ``materialize``, both operands
    come back as one stacked array ``[2, I, Kp]`` written by ``rac_operands`` (bit-identical;
    ``interpret`` runs it in the Triton interpreter).

    ``selection``: None, or ``(group_sizes [E], ratio, rac_select.RACSelectConfig)`` of a
    grouped call whose ``index`` is the plan's window layout: where the stacked kernel
    recomputes the residual from the row pass (``acts.selection_stats``) and ``Kp == K``, its
    programs select each expert's blocks themselves (``rac_operands.OperandSelection``) and
    the selection kernel's outputs go unused (XLA drops the call).
    """
    res = acts.residual
    stacked_kernel = (kernel is not None and materialize and index.ndim == 1
                      and isinstance(res, rac.SelectedResidual))
    # rac_rows wrote operand 0 into the windows already (the caller placed each row at its
    # window row of this very index): rac_operands completes that buffer in place.
    placed = (stacked_kernel and acts.placed is not None and acts.q_rows is None
              and res.rows is None and acts.placed.shape[1:] == (index.shape[0], k_pad)
              and acts.placed.dtype == jnp.dtype(dtype)
              and index.shape[0] % kernel.block_rows == 0)
    b0, g0 = (None, acts.operand[1]) if placed else aq.acts_operand(acts, dtype)
    # rac_rows' values came with their activations, and the residual's rows are the values'
    # rows: rac_operands recomputes the residual from both (no float32 residual pass).
    recompute = placed or (stacked_kernel and acts.operand is not None
                           and b0 is acts.operand[0] and res.rows is acts.q_rows)
    # The stacked kernel codes the residual's block scales itself from the block amax (where
    # the jnp selection made them): XLA's scale and reciprocal passes drop out, and the
    # kernel's operands are materialized anyway (no barrier).
    coded = ((rac.coded_block_amax(res), res.global_scale)
             if stacked_kernel and res.has_coded_amax else None)
    if coded is None and materialize and isinstance(res, rac.SelectedResidual):
        # The block scales too, as float32 (exact): inside the gather fusion XLA would convert
        # each E4M3 scale once per element it scales (16 times per block, every windowed row).
        if recompute:
            b0, s32 = lax.optimization_barrier((b0, res.scales.astype(jnp.float32)))
        else:
            b0, r, s32 = lax.optimization_barrier((b0, res.r, res.scales.astype(jnp.float32)))
            res = dataclasses.replace(res, r=r)
        res = dataclasses.replace(res, scales=s32)
    q_index = index if acts.q_rows is None else source_tile_rows(
        acts.q_rows, g0.shape[0], index)
    if isinstance(res, rac.SelectedResidual) and stacked_kernel:
        from pallas_kernels import rac_operands as ro

        g_rows = rac.rows_or_fill(g0, q_index, 0.0)
        if (selection is not None and recompute and not placed
                and acts.selection_stats is not None and k_pad == acts.operand[2].shape[1]
                and ro.selects_in_kernel(kernel)):
            scores, amax, finite, valid = acts.selection_stats
            gs, ratio, select_config = selection
            stacked, s1 = ro.rac_stacked_operands(
                b0, None, None, None, index, acts.q_rows, k_pad=k_pad, config=kernel,
                interpret=interpret, residual_of=(acts.operand[2], g0),
                select=ro.OperandSelection(scores, amax, finite, gs, valid, ratio=ratio,
                                           config=select_config))
            return stacked, (g_rows, s1)
        s, rcp = (None, None) if coded is not None else (res.scales, res.reciprocals)
        if recompute:
            stacked = ro.rac_stacked_operands(
                b0, None, s, rcp, index, acts.q_rows, k_pad=k_pad, config=kernel,
                interpret=interpret, residual_of=(acts.operand[2], g0),
                placed=acts.placed if placed else None, coded=coded)
        else:
            stacked = ro.rac_stacked_operands(b0, res.r, s, rcp, index, acts.q_rows, res.rows,
                                              k_pad=k_pad, config=kernel, interpret=interpret,
                                              coded=coded)
        return stacked, (g_rows, rac.rows_or_fill(res.global_scale, index, 0.0))
    t0, s0 = plain_operand(b0, q_index, dtype, k_pad, g0)
    if res is None:
        return (t0,), (s0,)
    if isinstance(res, rac.SelectedResidual):
        t1 = _pad_k(res.unscaled(index).astype(dtype), k_pad)
        s1 = rac.rows_or_fill(res.global_scale, index, 0.0)
    else:  # bf16 residual (rac_residual_format="bf16"): plain rows, scale 1
        t1, s1 = plain_operand(res, index, dtype, k_pad)
    return (t0, t1), (s0, s1)


def act_operand_rows(x: jax.Array, source_rows: jax.Array | None, index: jax.Array, dtype,
                     k_pad: int, kernel, interpret: bool = False):
    """``operand_rows`` of plain per-token W4A4 from the activations themselves: the windowed
    operand ``[I, Kp]`` quantized by ``act_operands`` (``kernel``: its config; ``index``
    1-D) and each row's decode scale ``[I]``, as ``((operand,), (scales,))``. ``x``: the
    distinct rows ``[R, K]``; ``source_rows``: None or int32 ``[M]`` (GEMM row -> row of x)."""
    from pallas_kernels.act_operands import act_window_operand, row_decode_scales

    g = row_decode_scales(x)
    q_index = index if source_rows is None else source_tile_rows(source_rows, x.shape[0], index)
    operand = act_window_operand(x, g, index, source_rows, k_pad=k_pad, dtype=dtype,
                                 config=kernel, interpret=interpret)
    return (operand,), (rac.rows_or_fill(g, q_index, 0.0),)


def token_tiles(operand_of, row_index: jax.Array, row0: jax.Array, window_rows: jax.Array,
                windowed: bool = True) -> tuple[TokenTiles, tuple[jax.Array, ...]]:
    """The tile kernels' operands as row windows, and each token slot's scale.

    ``operand_of(index)`` returns ``(operands, row scales)`` of GEMM rows ``index``
    (``operand_rows`` / ``plain_operand``; ``>= M`` = a zero row, scale 0); it is called once,
    on ``window_rows`` (int32 ``[P]``: the GEMM row at each row of the windowed operand, the
    tile plan's layout). ``row_index``: int32 ``[T, block_m]`` GEMM row of each slot (``>= M``
    = empty, scale 0); ``row0``: int32 ``[T]`` each tile's first row of the windowed operand.
    Returns the ``TokenTiles`` and the slot scales ``[T, block_m]`` per operand. ``windowed``
    False: the operands gathered into tiles ``[T, block_m, Kp]`` instead (``TokenTiles.of``).
    """
    if not windowed:
        operands, scales = operand_of(row_index)
        return TokenTiles.of(operands), tuple(scales)
    operands, row_scales = operand_of(window_rows)
    stacked = isinstance(operands, jax.Array)  # one [A, P, Kp] array (rac_operands)
    # Slot r of tile t is window row row0[t] + r: its scale where that row is the slot's GEMM
    # row, else 0 (an empty slot reading padding, scale 0 anyway, or the next group's row).
    at = row0[:, None] + jnp.arange(row_index.shape[1], dtype=jnp.int32)[None, :]
    filled = window_rows[at] == row_index
    scales = tuple(jnp.where(filled, g[at], 0.0) for g in row_scales)
    rows = (operands,) if stacked else tuple(operands)
    return TokenTiles(rows, row0, row_index.shape[1], stacked=stacked), scales


def stored_dtype(out_dtype, k_splits: int):
    """What the tile kernels' epilogue stores: the caller's dtype, or float32 partial sums
    when K is split (summed by ``rows_from_tiles``)."""
    return out_dtype if k_splits == 1 else jnp.float32


def rows_from_tiles(out: jax.Array, row_slot: jax.Array | int, n: int, dtype) -> jax.Array:
    """Scaled kernel output ``[T, k_splits, 1, block_m, Np]`` -> rows ``[M, n]`` in ``dtype``.

    The K splits are summed (in float32); row ``i`` is tile slot ``row_slot[i] = t * block_m +
    r`` (a slot ``>= T * block_m`` gives a zero row), an int ``row_slot`` M takes the first M
    slots (dense). The kernels store token-major tiles, so this is a gather of whole rows
    (before 2026-12-03 they stored ``[Np, block_m]`` and an XLA transpose of every output came
    first: 15-22 us per layer of the decode step on the H200). Behind an optimization barrier
    (``kernel_backend._materialized``, an ablation since 2026-12-06) XLA ran it as a kernel of
    its own (4.2 us down, 3.6 us gate_up per layer, H200, 2026-12-05); without one it fuses
    into its consumer (swiglu, the MoE block's weighted sum).
    """
    t_max, splits, _, block_m, n_pad = out.shape
    summed = out[:, 0, 0] if splits == 1 else jnp.sum(out[:, :, 0], axis=1, dtype=jnp.float32)
    rows = summed.reshape(t_max * block_m, n_pad)
    if isinstance(row_slot, int):
        rows = rows[:row_slot]
    else:
        rows = jnp.take(rows, row_slot, axis=0, mode="fill", fill_value=0)
    return rows[:, :n].astype(dtype)


def slot_scales(slot_g: tuple[jax.Array, ...], tile_expert: jax.Array,
                w: W4A4Weights) -> jax.Array:
    """float32 ``[T, A, block_m]``: each token slot's scale for the kernel's epilogue, the
    operand's activation scale (``slot_g``, ``[T, block_m]`` each, 0 for empty slots) times the
    tile's weight global scale and ``1 / w.code_factor``."""
    g_t = w.global_scale[tile_expert] * jnp.float32(w.code_factor)  # [T]
    return jnp.stack(slot_g, axis=1) * g_t[:, None, None]


def run_tiles(
    tiles: TokenTiles,
    slot_g: tuple[jax.Array, ...],
    row_slot: jax.Array | int,
    w: W4A4Weights,
    tile_expert: jax.Array,
    num_tiles: jax.Array,
    config: W4A4MatmulConfig,
    interpret: bool,
    out_dtype,
    live_tiles: int | None = None,
    wide: bool = False,
    residual_blocks: jax.Array | None = None,
    narrow: bool = False,
    token_scales: jax.Array | None = None,
) -> jax.Array:
    """Run the kernel on token tiles, return the scaled rows ``[M, N]``.

    ``tiles``: the B operands in the MMA dtype as row windows, and ``slot_g`` their float32
    ``[T, block_m]`` activation scales (``token_tiles``; applied in the kernel's epilogue with
    the weight's, ``slot_scales``); ``row_slot``: int32 ``[M]``
    tile slot of each row (``T * block_m`` = a zero row), or an int M: the first M slots
    (``rows_from_tiles``). The kernel stores ``out_dtype`` when K is not split, float32 partial
    sums otherwise. ``live_tiles``: the tiles expected to hold rows (static; None: all ``T``),
    what the split-K choice counts. ``wide``: run two warpgroup pairs on items of at least two
    weight-row tiles (``W4A4MatmulConfig.wide_plain_decode`` / ``wide_rac_decode``) where the
    weight's row tiles pair up (with ``residual_blocks`` only where the pipeline keeps two
    stages). ``narrow``: tiles of at most ``block_m / 2`` rows at N = ``block_m / 2``
    (``TileGemmConfig.narrow_tiles``; where ``block_m`` is a multiple of 16 and without
    ``residual_blocks``; the tiles' windows must be in order, as the grouped plan's are).
    ``residual_blocks``: the tile kernel's (``tile_block_bits``). ``token_scales``:
    None, or ``slot_g`` stacked ``[T, A, block_m]`` as computed elsewhere (``rac_select``'s
    ``tiles``); ``slot_g`` is then not read, and the tile kernel applies the weights' global
    scales itself (``expert_scales``), where ``slot_scales`` folds them in with XLA.
    """
    num_sms = config.num_sms or _num_sms()
    check_n_group(config.n_group, w.n_pad)
    n_group, wgs = config.n_group, config.compute_wgs
    tiles_used = live_tiles or tiles.num_tiles

    def plan(n_group, wgs):
        k_splits = config.k_splits or auto_k_splits(
            tiles_used * (w.n_pad // N_TILE // n_group), w.k_pad // K_TILE, num_sms
        )
        return k_splits, config.tile_config(k_splits, num_sms, n_group, wgs)

    k_splits, tcfg = plan(n_group, wgs)
    if wide and (w.n_pad // N_TILE) % max(n_group, 2) == 0:
        k_splits_w, tcfg_w = plan(max(n_group, 2), 4)
        k_steps = w.k_pad // K_TILE // k_splits_w
        # nvfp4_tile_gemm refuses residual_blocks where they would hang: keep those narrow
        if residual_blocks is None or not residual_blocks_hang(tcfg_w, tile_stages(
                tcfg_w, w, tiles.block_m, 2, 1, stored_dtype(out_dtype, k_splits_w),
                False, k_steps), k_steps):
            k_splits, tcfg = k_splits_w, tcfg_w
    if narrow and tiles.block_m % 16 == 0 and residual_blocks is None:
        tcfg = dataclasses.replace(tcfg, narrow_tiles=True)
    out = nvfp4_tile_gemm(
        tiles, w, tile_expert, num_tiles, config=tcfg, interpret=interpret,
        col_scales=slot_scales(slot_g, tile_expert, w) if token_scales is None else token_scales,
        expert_scales=None if token_scales is None else w.global_scale,  # float32 [E]
        expert_factor=w.code_factor,
        out_dtype=stored_dtype(out_dtype, k_splits), residual_blocks=residual_blocks,
    )
    return rows_from_tiles(out, row_slot, w.n, out_dtype)


def tile_block_bits(mask: jax.Array, row_index: jax.Array, k_pad: int) -> jax.Array:
    """The tile kernel's ``residual_blocks``: int32 ``[T, ceil(Kp / 512)]``, bit ``b`` set
    where any row of tile ``t`` (``row_index`` ``[T, block_m]``; indices past ``mask``'s rows
    are padding) has 16-column block ``b`` selected in ``mask`` (bool ``[M, K/16]``)."""
    sel = mask.at[row_index].get(mode="fill", fill_value=False).any(axis=1)  # [T, K/16]
    return pack_block_bits(sel, k_pad)


def pack_block_bits(sel: jax.Array, k_pad: int) -> jax.Array:
    """bool ``[T, nb]`` (16-column K blocks; ``nb <= Kp / 16``) -> the int32 ``[T, ceil(Kp /
    512)]`` bit words of ``residual_blocks`` (bit ``b % 32`` of word ``b // 32``)."""
    t, words = sel.shape[0], block_words(k_pad)
    sel = jnp.pad(sel, ((0, 0), (0, 32 * words - sel.shape[1])))
    bits = sel.reshape(t, words, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(bits.sum(axis=-1, dtype=jnp.uint32), jnp.int32)


def dense_plan(m: int, block_m: int | None):
    """Token tiles of a dense ``[M, K]`` operand: ``(row_index [T, block_m], tile_expert [T]
    (zeros), num_tiles [1], row0 [T])``, tile ``t`` = rows ``[t * block_m, (t + 1) *
    block_m)``; block_m None: M rounded up to 8 when M <= 64 (decode: one tile), else 64."""
    block_m = block_m or (_round_up(m, 8) if m <= MAX_BLOCK_M else MAX_BLOCK_M)
    t = -(-m // block_m)
    rows = jnp.arange(t * block_m, dtype=jnp.int32)
    row_index = jnp.where(rows < m, rows, m).reshape(t, block_m)
    return (row_index, jnp.zeros((t,), jnp.int32), jnp.full((1,), t, jnp.int32),
            jnp.arange(t, dtype=jnp.int32) * block_m)


def run_dense(operand_of, m: int, w: W4A4Weights, config, interpret: bool,
              out_dtype) -> jax.Array:
    """Dense rows in consecutive token tiles through the kernel: ``[M, N]``. ``operand_of(
    index)``: the B operands and row scales of GEMM rows ``index`` (``token_tiles``)."""
    row_index, tile_expert, num_tiles, row0 = dense_plan(m, config.block_m)
    tiles, slot_g = token_tiles(operand_of, row_index, row0, row_index.reshape(-1),
                                config.windowed_operands)
    return run_tiles(tiles, slot_g, m, w, tile_expert, num_tiles, config, interpret, out_dtype)


def _take_blocks(a: jax.Array, blocks: jax.Array) -> jax.Array:
    """Columns of ``a [R, K]`` in whole 16-column blocks ``blocks`` (int ``[S]``): ``[R, 16 S]``."""
    rows = a.shape[0]
    return jnp.take(a.reshape(rows, -1, nvfp4.BLOCK_SIZE), blocks, axis=1).reshape(rows, -1)


def dense_prefill_parts(b_rows: tuple[jax.Array, ...], w: W4A4Weights,
                        residual_blocks: jax.Array | None = None) -> jax.Array:
    """Large-M path: exact decoded weight (MMA dtype) times each operand with XLA's GEMM, f32
    accumulation; ``[M, A, N]`` scaled like the kernel's output (``1 / w.code_factor``).

    ``residual_blocks``: None, or int32 ``[S]`` K-block indices (-1: none) that hold every
    nonzero block of the RAC residual operand ``b_rows[1]``: its GEMM then contracts those
    ``16 S`` columns only (``rac_block_columns``), not all K: the residual's zero blocks add
    exact zeros, so only the f32 summation order changes. (Writing the gathered columns out
    behind an optimization barrier first changed nothing on an H100: 2207.6 against 2206.7
    us, 2026-12-05.)"""
    from pallas_kernels.layout import dequantize_w4a4_weights

    wd = (dequantize_w4a4_weights(w)[0] / jnp.float32(w.code_factor)).astype(w.mma_dtype)
    dims = (((1,), (1,)), ((), ()))
    outs = []
    for a, b in enumerate(b_rows):
        b, wa = b.astype(w.mma_dtype), wd
        if a == 1 and residual_blocks is not None:
            # whole 16-column blocks taken along K (a gather of contiguous 32-byte slices,
            # not of single elements); a repeated fill index (-1) gives zeros
            blocks, live = jnp.maximum(residual_blocks, 0), residual_blocks >= 0
            b = jnp.where(jnp.repeat(live, nvfp4.BLOCK_SIZE), _take_blocks(b, blocks),
                          jnp.zeros((), b.dtype))
            wa = _take_blocks(wd, blocks)
        outs.append(jax.lax.dot_general(b, wa, dims, preferred_element_type=jnp.float32))
    return jnp.stack(outs, axis=1)


def rac_block_columns(acts: aq.QuantizedActivations, rac_config: aq.RACConfig | None):
    """The K blocks of a dense GEMM's RAC residual, when every row has the same ones and
    their number is bounded at trace time (``online_batch``: ``rac.kept_blocks``, fewer with
    an energy target): int32 ``[S]``, -1 past the selected count. None
    otherwise (``online_token`` selects per row; a static block set's size is a traced
    value): the residual GEMM then runs over all K."""
    if (rac_config is None or rac_config.rac_selection != "online_batch"
            or acts.mask is None):
        return None
    nb = acts.mask.shape[1]
    cap = rac.kept_blocks(rac_config.rac_ratio, nb)
    if cap >= nb:
        return None
    chosen = acts.mask[0]  # online_batch: one block set for the whole GEMM
    (blocks,) = jnp.nonzero(chosen, size=cap, fill_value=-1)
    return blocks.astype(jnp.int32)


def combine(parts: jax.Array, row_scales: tuple[jax.Array, ...], g_w: jax.Array, n: int, factor):
    """``sum_a parts[:, a, :n] * g_a[:, None]``, times ``g_w`` (per row ``[M]``) and ``factor``."""
    y = sum(parts[:, a, :n] * g[:, None] for a, g in enumerate(row_scales))
    return y * (g_w * jnp.float32(factor))[:, None]


def _check(x: jax.Array, w: W4A4Weights) -> None:
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) not in nvfp4.FLOAT_DTYPES:
        raise ValueError(f"x: dtype {getattr(x, 'dtype', None)}; need bfloat16, float16 or float32")
    if x.ndim != 2:
        raise ValueError(f"x: shape {tuple(x.shape)} must be [M, K]")
    if x.shape[0] == 0:
        raise ValueError("x: M=0 rows; need at least one")
    if x.shape[1] != w.k:
        raise ValueError(f"x: K={x.shape[1]} does not match the weight's K={w.k}")
    if x.shape[1] % nvfp4.BLOCK_SIZE:
        raise ValueError(f"x: K={x.shape[1]} is not a multiple of 16 (NVFP4 blocks)")


def w4a4_matmul(
    x: jax.Array,
    w_q,
    *,
    act_scale_mode: str = "per_token",
    rac: aq.RACConfig | None = None,
    rac_blocks: jax.Array | None = None,
    act_global_scale: jax.Array | None = None,
    config: W4A4MatmulConfig | None = None,
    interpret: bool = False,
    row_valid: jax.Array | None = None,
) -> jax.Array:
    """``Y = Q(x) @ Q(W)^T`` (+ RAC ``Q(R_S) @ Q(W)[:, S]^T``): ``[M, N]`` in ``x.dtype``.

    Args:
      x: activations ``[M, K]`` bf16 (f16/f32 accepted), K % 16 == 0.
      w_q: ``NVFP4Tensor [N, K]`` (converted per call) or ``W4A4Weights`` from
        ``layout.prepare_w4a4_weights`` (done once at weight sync).
      act_scale_mode: per_token | per_batch | static activation global scale (static:
        ``act_global_scale`` float32 ``[]``, calibrated).
      rac: RAC options, None = plain W4A4; rac_blocks: bool ``[K/16]`` for static selection.
      interpret: run the Mosaic GPU kernel in the CPU GPU-interpreter (needs a_via_smem).
      row_valid: None, or bool ``[M]``: the rows that are tokens; RAC's online_batch
        selection scores only those (``rac.selection_mask``).
    """
    config = config or W4A4MatmulConfig()
    w = as_kernel_weights(w_q, config.mma_dtype)
    if w.stacked:
        raise ValueError(f"w_q: stacked weight of {w.num_experts} experts; use w4a4_grouped_matmul")
    _check(x, w)
    m = x.shape[0]
    decode = not config.is_prefill(m)
    plain = config.act_operands_config() if rac is None and act_scale_mode == "per_token" else None
    if decode and plain is not None:
        return run_dense(lambda idx: act_operand_rows(x, None, idx, w.mma_dtype, w.k_pad, plain,
                                                      interpret),
                         m, w, config, interpret, x.dtype)
    acts = aq.nvfp4_quantize(x, act_scale_mode=act_scale_mode, rac_config=rac,
                             static_blocks=rac_blocks, static_scale=act_global_scale,
                             row_valid=row_valid,
                             # the large-M path runs no Pallas kernel (any backend)
                             row_pass=config.rac_row_pass(interpret) if decode else None)
    if decode:
        return run_dense(lambda idx: operand_rows(acts, idx, w.mma_dtype, w.k_pad,
                                                  config.materialize_operands,
                                                  config.rac_operands_config(), interpret),
                         m, w, config, interpret, x.dtype)
    return prefill_product(acts, w, x.dtype, rac, config.rac_prefill_columns)


def prefill_product(acts: aq.QuantizedActivations, w: W4A4Weights, out_dtype,
                    rac: aq.RACConfig | None = None, columns: bool = True) -> jax.Array:
    """``w4a4_matmul``'s large-M path from the quantized activations: ``[M, N]`` in
    ``out_dtype``. ``columns``: RAC's residual GEMM over the selected blocks only
    (``rac_block_columns``, where the selection allows; ``W4A4MatmulConfig.rac_prefill_columns``),
    else over all K."""
    b_rows, row_scales = aq.kernel_operands(acts, w.mma_dtype)
    blocks = rac_block_columns(acts, rac) if columns else None
    parts = dense_prefill_parts(b_rows, w, blocks)
    g_w = jnp.broadcast_to(w.global_scale[0], (b_rows[0].shape[0],))
    return combine(parts, row_scales, g_w, w.n, w.code_factor).astype(out_dtype)


def w4a4_matmul_reference(
    x: jax.Array,
    w_q: nvfp4.NVFP4Tensor,
    *,
    act_scale_mode: str = "per_token",
    rac: aq.RACConfig | None = None,
    rac_blocks: jax.Array | None = None,
    act_global_scale: jax.Array | None = None,
    row_valid: jax.Array | None = None,
) -> jax.Array:
    """jnp reference: dequantized operands, float32 products, ``[M, N]`` in ``x.dtype``."""
    acts = aq.nvfp4_quantize(x, act_scale_mode=act_scale_mode, rac_config=rac,
                             static_blocks=rac_blocks, static_scale=act_global_scale,
                             row_valid=row_valid)
    wd = nvfp4.dequantize(w_q, jnp.float32)
    y = sum(jnp.dot(a, wd.T, precision="highest") for a in aq.dequantized_sum(acts))
    return y.astype(x.dtype)
