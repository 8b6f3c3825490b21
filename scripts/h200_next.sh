#!/usr/bin/env bash
# The next H200 calls, one script (each step has its own time limit, so a slow step cannot
# starve the later ones; logs and JSON land under $OUT). COMMIT must name the commit that runs:
# the device copy's git HEAD can be stale (session 12 wrote a wrong commit into the JSON).
#
#   run: COMMIT=<sha> bash scripts/h200_next.sh STEP...   (on the device machine, repo root)
#
# Steps (about 3-4 minutes each; at most two per call):
#   check  the GPU checks of every kernel path (bench_kernels --part check, then check-grouped)
#   gcheck the grouped W4A4 / W4A16 and the FP8 checks alone (check-grouped)
#   mcheck the decode MoE operand path: 256 tokens top-8 with source_rows, +-RAC, and the
#          read-back in slot order (output_rows) (check-moe)
#   b128   the four arms at batch 128 / prompt 256, traced (the reference row)
#   b128r  nvfp4_rac and bf16 alone at batch 128 / prompt 256 (issue 5's 2x bf16; ~3.5 minutes)
#   cbuf   nvfp4_rac at batch 128 with XLA's command buffers at the default set, off, and with
#          WHILE + CONDITIONAL (the layer scan and the token loop inside CUDA graphs; session
#          15's explicit set was 17 % slower, before most of today's kernels), traced; counts the
#          command_buffer computations in the optimized HLO (~6.5 minutes)
#   rscale RAC's row pass computing the rows' decode scales itself (`rac_row_scales`, session
#          44): the decode MoE operand checks with it (check-moe), then nvfp4_rac at batch 128
#          with it and at the defaults, same call, traced (top 45 kernels; ~5 minutes);
#          rscale2: without its GPU check, with 128 and 512 programs (rac_row_scale_programs)
#   sslot  the selection kernel writing the tile kernels' epilogue scales
#          (`rac_select_slot_scales`, session 44): check-moe with it, then nvfp4_rac at batch
#          128 with it and at the defaults, same call, traced (~4 minutes)
#   cconc  how the command buffers may run independent kernels at once
#          (`--xla_gpu_command_buffer_scheduling_mode`: XLA's default LHS overlaps only what
#          the latency-hiding schedule made async; CONCURRENT_REGIONS lets regions of small
#          latency-bound kernels run side by side; CONCURRENT any independent ones; session 45):
#          nvfp4_rac at batch 128 with each, bf16 with LHS and CONCURRENT_REGIONS, untraced (a
#          profiling session runs the kernels outside the graphs) (~2.5 minutes on an H100);
#          cconc2: CONCURRENT against LHS for every arm, twice for nvfp4_rac and bf16, the
#          decode MoE operand checks under CONCURRENT, and `sslot`'s flag under both (~6 min)
#   cdef   the four arms at batch 128 at the engine's default (CONCURRENT since session 45),
#          nvfp4_rac and bf16 also with --cb-schedule LHS; each run's token and log-prob
#          digests (the same bits under both schedules) (~3.5 minutes on an H100)
#   determ nvfp4_rac at batch 128 in three processes with the same seed, nvfp4 in two: their
#          prefill checksums and token / log-prob digests must repeat (session 45: nvfp4_rac's
#          did not, from the prefill's scatter-add expert sums, since replaced by
#          rac.ordered_segment_sum; ~3 minutes on an H100)
#   hdef   the H200 row at 48 layers (session 46): the four arms at the engine's defaults, one
#          process each, nvfp4_rac first and last (its digests must repeat); ~5-6 minutes
#   dauto  nvfp4 in three processes with XLA's autotuning off (--xla_gpu_autotune_level=0):
#          do its prefill checksums and log-prob digests repeat then (session 46: they did not
#          with autotuning, in two processes)? ~3.5 minutes on an H100
#   datc   nvfp4 in two processes sharing one autotune cache (--autotune-cache): the second
#          compiles with the first's tuned kernels, so the digests repeat (~2.5 minutes)
#   hall   hdef in one process (model init once; session 46's device time was short): the four
#          arms at 48 layers on an H200, untraced, nvfp4_rac and bf16 first (~6-7 minutes)
#   segp   RAC's per-expert score sums at the prefill's row counts: segment_sum (a scatter-add)
#          against rac.ordered_segment_sum, time per call and repeats (probe_segment_sum.py)
#   cprof  nvfp4_rac and bf16 at batch 128 traced with the command buffers kept while profiling
#          (`--xla_enable_command_buffers_during_profiling=true`: otherwise a profiling session
#          runs every kernel outside the graphs, one after another, and the trace cannot show
#          what CONCURRENT overlaps), top 90 kernels (~1.5 minutes on an H100)
#   b32    the four arms at batch 32 / prompt 256
#   b256   the four arms at batch 256 / prompt 256 (rows still missing in docs/BENCHMARKS.md)
#   b256r  nvfp4_rac at batch 256 with the grouped GEMMs' prefill paths from 4 096 rows
#          instead of 2 048 (`prefill_min_rows`: the decode step's 2 048 expert rows at batch
#          256 take them; RAC over nvfp4 +11.9 % there against +5.2 % at 128, session 39),
#          then nvfp4_rac and nvfp4 at the defaults (~5 minutes)
#   p1024  nvfp4_rac and bf16 at batch 128 / prompt 1024
#   prof   the four arms at batch 128, traced with the top 120 kernels per arm, and
#          the decode programs' optimized HLO ($OUT/hlo.tgz) to name each fusion of the trace
#   prof2  prof's trace and HLO for nvfp4 and nvfp4_rac only, the top 160 kernels each (every
#          kernel of a layer: what the MoE block's XLA side is now)
#   nobar  nvfp4_rac and nvfp4 at batch 128 without the optimization barrier after the grouped
#          kernels and with it, same call, traced; nobar1: nvfp4_rac only, 8 steps (~2 minutes)
#   unroll nvfp4 and bf16 at batch 128 with the decode step's layers unrolled (no per-layer
#          dynamic slices of the stacked weights; compare with prof / b128 of the same commit)
#   kern   the kernel tables of issue 4 (bench_kernels --part decode,grouped: dense decode and
#          grouped decode against their floors and XLA BF16 / FP8), not complete since session 12;
#          over 9 minutes (session 18: the dense table alone took the whole 540 s): use
#          kdense and kgroup, one call each
#   kdense the dense decode table of `kern` at K x N = 2048 x 768 and 2048 x 3072 (--part
#          decode --trace: each row also with its traced device time and its largest kernel's;
#          270 s; session 19's full table ran out of its 270 s after its first shape, 4096 x
#          14336 with its 10 rows: that one alone is kdense0); kdense2: 4096 x 57344;
#          kdensew: kdense0 on two warpgroup pairs per SM (`--w4a4-set compute_wgs=4
#          --w4a4-set n_group=2`, RAC rows included; session 40: the grouped kernel gained
#          22-27 % so on the H200; run with kdense0 in one call)
#   kgroup the grouped table of `kern` at 1 and 16 tokens (--part grouped --trace; 270 s);
#          kgroup2 at 64 and 256 tokens
#   kpre   issue 4's prefill rows (bench_kernels --part prefill --trace: dense W4A4 +-RAC
#          against XLA BF16 at M = 8192, K x N = 4096 x 14336; grouped at 1 024 tokens x top-8 against
#          ragged_dot_mgpu; never run as isolated kernels)
#   cmdbuf nvfp4 and nvfp4_rac at batch 128 with XLA's command buffers (CUDA graphs) asked for
#          explicitly (the session-13 HLO had none; compare with b128 of the same call)
#   gabl   the grouped tile kernel alone at the decode step's shapes, traced: variants
#          (mma_overlap, stages, n_group, unchained) and ablations (no decode / one MMA / no
#          compute), +-RAC, and our FP8 kernel on the same tiles (kernel_probe
#          --grouped-ablations; about 3-4 minutes)
#   gabl2  where the grouped W4A4 kernel's time goes at the rollout's defaults (stacked RAC
#          operands, "signs_high" words, E4M3 scales, mma_k 256; session 37: on the H200 it
#          reaches 0.60-0.63 of its bytes' floor against our FP8 kernel's 0.83-0.89): default,
#          no decode, no compute (the pipeline alone), mma_k 64 and one MMA per step (the tensor
#          cores' share), n_group 2, store_buffers 1, n_group 2 + store_buffers 2 (~4 minutes)
#   ptxas  the grouped tile kernel at the defaults compiled with Mosaic GPU's PTX and ptxas dumps
#          ($OUT/dump): registers, spills, and whether ptxas serialized the wgmmas (C7515-style
#          "Potential Performance Loss" notes), wgmma counts per PTX (session 38)
#   pair2  why RAC's grouped decode calls lose on two warpgroup pairs on the H200 (session 47: its
#          +14.4 % over nvfp4 there is RAC's calls staying on one pair): the two-pair kernels
#          (plain and RAC stacked, mma_k 256) compiled with ptxas and SASS dumps, ptxas's
#          per-kernel lines in order (entry, registers, spills, C75xx wgmma-serialization notes),
#          then the kernel alone, +-RAC: one pair, two pairs stacked / unstacked, and unstacked
#          without the residual's wgmmas on one and two pairs (~6 minutes)
#   mem24  the copy warpgroup at 24 registers on two pairs (TileGemmConfig.memory_registers; the
#          compute warpgroups 112 instead of 104), after pair2 found RAC's two-pair kernels
#          spilling with their wgmmas serialized: ptxas lines of the two-pair RAC kernels at
#          mma_k 256 / 128 / 64 with 24 and at 128 / 64 with 40, GPU checks, the kernel
#          alone, then nvfp4_rac with RAC's decode calls on two pairs at 24 against the
#          defaults (~8 minutes on an H100; its probe ran out of time in the down rows there);
#          mem24h: the same cut to one GPU check and four kernel variants, for an H200 call
#   nrows  the grouped decode kernel alone with 32 token rows per tile instead of 16 (same tiles
#          and weight bytes; wgmma N 32, 64 with RAC's stacked operand), on one pair and on two
#          pairs at 112 registers, ptxas lines: does the plain call at N = 32 cost what RAC's
#          at 16 + 16 does (the tensor cores' time for N)? And with 8 rows per tile (N 8, RAC's
#          stacked 16: would narrow tiles for experts with <= 8 tokens make RAC's two-pair
#          calls cost what the plain ones do?), two pairs at 104 as well; the PTX comes back in
#          nrows_dump.tgz for `scripts/sass_stats.py` (~5 min)
#   narrow TileGemmConfig.narrow_tiles (session 49: a tile of <= 8 rows multiplied at wgmma N 8,
#          RAC's stacked 8 + 8): the grouped matmul's GPU check with it, then the kernel alone on
#          windows ~60 % narrow, one and two pairs, against the defaults and rows8 (~5 min);
#          narrowr: nvfp4_rac with it, RAC's calls on two pairs / one pair, and the defaults
#   e4m3   E4M3 block scales in the kernel layout (session 38: 0.5625 streamed bytes per weight
#          instead of 0.625; on the H100 the grouped decode kernel's pipeline alone took 94 % of
#          its time): GPU checks, the grouped kernel alone with f16 / E4M3 scales (+ no compute),
#          then nvfp4_rac at batch 128 with each, same call (~6 minutes)
#   s38    session 38's two changes (on by default since session 39) in one call (~8 minutes):
#          the GPU checks at the defaults and the grouped kernel alone with f16 / E4M3 scales,
#          then nvfp4_rac at batch 128 with f16 scales unpacked, E4M3 unpacked, E4M3 packed
#   s39h   s38 without its middle arm (~5.5 minutes): the checks, the kernel with f16 / E4M3
#          scales, nvfp4_rac at batch 128 with f16 scales unpacked and at the defaults
#   ng2    two weight-row tiles per work item (n_group 2) at the defaults (~5.5 minutes): with
#          float16 scales its 56 KB stages left 2 of them for gate_up (session 38: no gain on
#          the H100), E4M3 scales fit 4; GPU checks, the kernel alone (and n_group 4: 2 stages
#          for gate_up, 1 for down), nvfp4_rac at batch 128 at n_group 2 and 1
#   wdown  RAC's down-projection decode calls on two warpgroup pairs (wide_rac_decode_max_k
#          1024: K = 768 goes wide, gate_up's K = 2048 stays on one pair; session 40's H200
#          kernel alone: 41.6 against 47.1 us): check-moe with it, then nvfp4_rac with it and
#          at the defaults, untraced (~5.5 minutes at 48 layers on an H200)
#   tune   ng2 and store cut to one call (~7.5 minutes on an H100; session 47: neither was
#          run since E4M3 scales became the default): GPU checks of both, the grouped kernel
#          alone (default, n_group 2, store_buffers 2, both), then nvfp4_rac at batch 128,
#          untraced, at the defaults, n_group 2, store_buffers 2, and the defaults again
#   store  the epilogue's output copies waited for when their staging buffer is next written
#          (store_buffers 1 / 2, session 39) instead of at once: GPU checks, the grouped W4A4
#          and FP8 kernels alone, then nvfp4_rac and fp8 at batch 128 with 2 and 0 (~8 minutes)
#   wide   grouped decode without RAC on two warpgroup pairs (wide_plain_decode, on by default
#          since session 40 after the kernel alone on the H200: gate_up 85.3 -> 66.8 us, down
#          52.2 -> 38.1): GPU checks of the default path, the kernel alone (RAC unstacked on
#          one and two pairs: whole, without its second operand's wgmmas, and with them for a
#          random half of the K blocks only, `residual_blocks`: do RAC's residual products
#          bound its calls, and does issuing them per selected block pay?), then nvfp4 and
#          nvfp4_rac at batch 128 with it and nvfp4 without (~8.5 minutes)
#   w41    `wide` and `widerac` cut to one call of ~9 minutes (session 41's device time was
#          short): the GPU check of the default path, the kernel alone (default; RAC unstacked
#          on two pairs whole, without its second wgmmas, with a random half of its blocks),
#          nvfp4 + nvfp4_rac at the defaults, nvfp4 narrow, nvfp4_rac on two pairs at mma_k 128
#   widerac nvfp4_rac at batch 128 with its grouped decode calls on two warpgroup pairs too
#          (`wide_rac_decode`): stacked operands at mma_k 256 and 128, unstacked with the
#          residual's wgmmas for the selected blocks only (`rac_selected_wgmmas`, mma_k 128;
#          its rollout times only, the GPU check is `selw`'s), then at the defaults (~8
#          minutes). Two pairs with `residual_blocks` and a one-stage pipeline hang in interpret
#          mode (session 41): refused, such calls stay narrow
#   selw   RAC's residual wgmmas only for each tile's selected K blocks (`rac_selected_wgmmas`,
#          unstacked operands; session 40, never on a GPU): its GPU check, then nvfp4_rac at
#          batch 128 with it, unstacked without it, and at the defaults (stacked) (~8 minutes)
#   pack   nvfp4_rac and nvfp4 at batch 128, traced, with the decode step's per-layer norm
#          vectors and layer ids sliced as one packed array (--pack-layer-vectors, session 38:
#          one memcpy32_post per layer instead of five?) and without, same call (~5 minutes)
#   stk    the grouped tile kernel with RAC's operands stacked on the wgmma N side
#          (stack_operands), checked first, against base and mma_overlap (kernel_probe
#          --grouped-ablations; ~2.5 minutes)
#   stk128 nvfp4_rac at batch 128 with and without stacked operands (two runs, traced)
#   ov     the grouped tile kernel with stacked operands and mma_overlap=1 (GPU-checked first,
#          against the stacked default), then nvfp4_rac at batch 128 with --w4a4-mma-overlap 1
#          (compare with the prof / b128 row of the same call)
#   rsel   the RAC selection kernel (pallas_kernels.rac_select): the decode MoE operand check
#          (check-moe), then nvfp4_rac and nvfp4 at batch 128 traced, and nvfp4_rac with
#          --no-rac-select-kernel (the jnp selection) in the same call
#   rsel3  the coded selection kernel (session 37: per-expert selection writing the coded block
#          amax and decode scales for rac_operands): its GPU check and times against the jnp
#          path (kernel_probe --rac-select), then nvfp4_rac at batch 128 without it, with it
#          at 32 and at 16 rows per step, same call, traced
#   ssort  the MoE slot-sort kernel (session 37; off by default, never run on a GPU yet): its
#          GPU check and times against the jnp path (kernel_probe --slot-sort), then nvfp4_rac
#          at batch 128 with it (--slot-sort-kernel) and without, same call, traced
#   rsel2  the selection kernel's variants (block rows, warps, division) against the jnp path on
#          the GPU, then nvfp4_rac with --rac-select-block-rows 64 and without the kernel
#   rsel4  RAC's selection inside the operand kernel (`rac_select_in_operands`, session 43):
#          the decode MoE operand checks with it (check-moe), then nvfp4_rac at batch 128 with
#          it (the walk's 32 rows per step, and 16: each program loads a step's scores whole),
#          and at the defaults, same call, traced (~8 minutes)
#   win    nvfp4_rac and nvfp4 at batch 128, traced, with the token tiles read as row windows
#          (the default) and gathered (--no-windowed-operands), in the same call
#   mmak   the grouped tile kernel with wider wgmma groups (mma_k 128 / 256: the step's decoded
#          chunks multiplied by one wgmma group, one wait), GPU-checked first, against base and
#          stacked (kernel_probe --grouped-ablations), then nvfp4_rac and nvfp4 at batch 128
#          with --w4a4-mma-k 256 and the default 64 in the same call
#   nomat  nvfp4_rac and nvfp4 at batch 128, traced, without the optimization barrier that
#          materializes the distinct rows' operands and RAC residual before the windows' row
#          gathers (--no-materialize-operands; compare with b128 of the same call)
#   fin    nvfp4_rac and nvfp4 at batch 128, traced (the newest commit's pair), then nvfp4_rac
#          and bf16 at batch 128 / prompt 1024 (p1024 with a 200 s limit)
#   bits   the "signs_high" code-word bit layout (fewer integer ops per decoded code; session 19,
#          CPU-tested only): the grouped tile kernel with it, GPU-checked first, against the
#          stacked default (kernel_probe --grouped-ablations), then nvfp4_rac and nvfp4 at batch
#          128 with --w4a4-bits signs_high and with the default, in the same call
#   kv8    the decode attention kernel on an FP8 E4M3 cache (session 19, CPU-tested only):
#          GPU-checked against the reference and timed (kernel_probe --attention), then the four
#          arms at batch 128 with --kv-cache-dtype float8_e4m3fn (compare with b128)
#   attn   kv8's decode attention probe alone (checks, then bf16 / FP8 timings, bf16 configs:
#          num_stages, block_s, num_warps; FP8 configs; 240 s)
#   kv8r   kv8's four arms on the FP8 cache without the attention probe, then nvfp4_rac on the
#          bf16 cache (the same call's baseline)
#   rrows  RAC's row pass (pallas_kernels.rac_rows, session 29): GPU bit-identity and programs
#          (kernel_probe --rac-rows), the decode MoE operand checks (check-moe), then nvfp4_rac
#          and nvfp4 at batch 128 traced, and nvfp4_rac with --no-rac-row-kernel (same call)
#   rrec   the row pass without a float32 residual (rac_operands recomputes it, session 29): the
#          probe's GPU checks, check-moe, the prefill table, then nvfp4_rac with and without the
#          row kernel, two interleaved pairs, untraced
#   e2m1   the E2M1 rounding by powers of two (session 30; nvfp4.round_to_e2m1_value: the
#          activation kernels' rounding in a third of the operations): GPU checks (against the
#          decision-point ladder; act_operands and rac_rows against the jnp path) and the
#          decode programs' times (kernel_probe --act-operands --rac-rows), then the prefill
#          table at this commit and at BASE=<sha> (the commit before; git archive or a
#          carried ./base.tar) in the same call
#   ptile  the grouped prefill matmul's tile-kernel variants (n_group, block_m, pipeline depth,
#          mma_overlap, unstacked RAC operands), +-RAC, GPU-checked then timed with device
#          times (kernel_probe --prefill-tiles; session 30)
#   ksplit the split-K choice against split-K 1 / 2 / 4 / 8, W4A4 and our FP8 kernel, dense
#          decode at M = 16 on the four dense shapes, with XLA's FP8 GEMV (bench_kernels
#          --part splits --trace; session 34)
#   prng   nvfp4_rac and bf16 at batch 128 with an RngBitGenerator sampling key (--prng-impl
#          rbg; compare with b128 of the same call): does the step's one 107 us reduction
#          (input_reduce_fusion, once per step in every arm, H100 session 34; likely
#          jax.random.categorical's threefry Gumbel noise over 151 936 x 128 logits) shrink?
#   kab    issue 4's prefill rows (kpre) at this commit and at BASE=<sha> (git archive or a
#          carried ./base.tar), in the same call
#   tab    tpre (below) at this commit and at BASE=<sha>, in the same call
#   samp   the sampling probe (scripts/sampling_probe.py: one step's token draw at batch 128 /
#          256 x 151 936, Gumbel noise by threefry / rbg / unsafe_rbg against the inverse-CDF
#          sampler, greedy as the floor; session 35), then nvfp4_rac and bf16 at batch 128
#          traced with --sampler gumbel and inverse_cdf (same call)
#   tpre   every kernel of one grouped prefill call (1 024 tokens x top-8, K x N = 2048 x 768,
#          the kpre shape), W4A4 and + RAC 0.5, outside the benchmark chain (kernel_probe
#          --trace-grouped --trace-tokens 1024; session 34)
#   rowk   the row kernels' grids at the grouped prefill shape (ptile's probe with session 35's
#          variants: rac_rows rows / columns / warps, the window-operand kernels' rows / warps),
#          each GPU-checked, +-RAC (rac_rows' own knobs +RAC only)
#   rop4   nvfp4_rac at batch 128 with rac_operands at 8 (the decode default) and 4 window rows
#          per program (bench_rollout --w4a4-set rac_operand_block_rows=N), interleaved twice
#          (~5 minutes; 4 rows won in prefill, session 35)
#   ropr   rac_operands' rows per program (4, 2; 4 with 8 warps) at the grouped prefill shape
#          against the default 8 (ptile's probe, twice; session 35's rowk found rows 4 ~3 us
#          faster in that kernel)
#   rcp    rac_operands recomputing the placed operand values from x (W4A4MatmulConfig.
#          rac_operand_recompute_placed, session 35) against reading them back: ptile's probe
#          with "base,recompute placed", twice
#   place  RAC's operand values placed in the windows by rac_rows (W4A4MatmulConfig.
#          rac_placed_values, session 30; the default since session 32) against values not
#          placed, at the grouped prefill shape, GPU-checked then traced (kernel_probe
#          --prefill-tiles)
#   e2m1ab nvfp4_rac at batch 128, untraced, at BASE and at this commit, interleaved twice
#   study  the fixed-policy mismatch study on the GPU's own engines (scripts/study_mismatch.py,
#          session 31, CPU-run only): small_gpu_base after 300 SFT steps, 256 prompts x 8
#          samples x 2 seeds, seven arms (the Pallas rollout kernels against the XLA trainer
#          forward: the real engine floor, which the CPU study could only imitate with bf16);
#          session 32 on an H100: six arms in 420 s (the seventh cut off), so 560 s, a call alone
#   kv8s   nvfp4_rac and nvfp4 on the FP8 cache with the decode attention split over 2 slot
#          ranges per (row, KV head) (slot_splits, flash-decoding) and without, same call
#          (run `attn` first: its timings include the slot_splits variants)
#   static nvfp4_rac with a static RAC block set (no per-step selection; bench_rollout's
#          timing_calibration) and the online default at batch 128, traced; then static at 256
#   rop    RAC's stacked-operand kernel (pallas_kernels.rac_operands; session 21, CPU-tested
#          only): GPU bit-identity with the jnp path and traced times at the decode shapes
#          (kernel_probe --rac-operands), then nvfp4_rac at batch 128 with the kernel, and
#          nvfp4_rac and nvfp4 without it, in the same call
#   ropad  the rac_operands kernel leaving the windows' padding rows unwritten (padding_rows
#          "skip"; session 21, CPU-tested only): probe variants (GPU-checked on the written
#          rows, timed), then nvfp4_rac at batch 128 with --rac-operand-padding skip and with
#          the default, same call
#   plan   the token-tile plan kernel (pallas_kernels.tile_plan; session 22, CPU-tested only):
#          GPU equality with the jnp plan and traced times (kernel_probe --tile-plan), the same
#          for plain W4A4's operand kernel (act_operands, --act-operands), then nvfp4_rac, nvfp4
#          and fp8 at batch 128 with both, nvfp4_rac and nvfp4 with neither
#   plan2  plan with the tile-plan kernel's smaller blocks (16 by default since plan: block 64
#          took 30 us per layer in the rollout), nvfp4_rac and nvfp4 only
#   b128p  b128 (all four arms at the newest commit: fp8 with the plan kernel, bf16 with the
#          new sort_slots), then nvfp4_rac with the plan kernel at 8 entries per program, 2 warps
#   cont   rollout scheduling on one workload (scripts/bench_continuous.py; session 23,
#          CPU-tested only): 256 responses (32 prompts x 8, prompts 128-256 tokens), lengths
#          ~geometric (stop set 0.4 % of the vocabulary) capped at 512, on 128 decode rows,
#          nvfp4_rac: static batches (generate), compaction and continuous batching (320 s);
#          contshare: continuous batching with shared prompt caches on the same workload (per_row);
#          contgroup: the same with the decode attention's per_group prefix pass
#   share  GRPO groups sharing their prompt's KV cache (SamplerConfig.share_prompt_cache;
#          session 23, CPU-tested only): the decode attention kernel with the shared prefix
#          against the copied layout (kernel_probe --attention-prefix: checks, timings and
#          floors), then nvfp4_rac at batch 128 = 16 prompts x 8 samples,
#          prompt 1024, with the shared prompt cache and without, same call (traced)
#   pgroup the decode attention's shared prefix read once per group tile (prefix_mode
#          "per_group", session 24, CPU-tested only): kernel_probe --attention-prefix (checked
#          against per_row, then per_row / per_group variants / copied timed), then nvfp4_rac at
#          batch 128 = 16 x 8, prompt 1024, shared cache, per_group and per_row (same call)
#   hlo    nvfp4 at batch 128 with the decode program's optimized HLO dumped to $OUT/hlo (what
#          the 386 small `memcpy32_post` copies per step and the MoE block's fusions are)
#   tgrouped  the trainer's expert matmuls (pallas_kernels.bf16_grouped, session 26, CPU-tested
#          only): GPU checks of forward, dx and dW, then forward and forward + backward against
#          XLA ragged_dot at small_gpu_base's and the 30B model's expert shapes (bench_kernels
#          --part train-grouped --trace)
#   train  the trainer step (quads_jax.train.bench, small_gpu_base, 32 x 512, bf16 and
#          trainer_qat) with bf16_grouped and with XLA ragged_dot, same call (--grouped both;
#          session 2's row: 1.34 s per update, 1.7 % MFU); traindw: bf16_grouped with its dW
#          through ragged_contract (the default since session 27's tgrouped) on both recipes,
#          then with XLA's dW (--dw xla) on bf16, same call; trainprof: the bf16 update traced
#          (60 costliest kernels) with its optimized HLO ($OUT/hlo_train.tgz) to name them
#
# Session 13 ran prof, check, gcheck, mcheck and b32 (their 170 / 120 s limits cut check and
# gcheck short of their last items; raised since). Session 14 ran `nobar unroll` (the barrier
# stays; the unrolled decode program did not compile within 270 s), `b128 b256` and `p1024`.
# Session 15 ran `mcheck prof` (twice), `cmdbuf kern` (command buffers 17 % slower; kern ran out
# of its 330 s in the grouped table: it now has 540 s and must run alone) and `b256`. Next:
# `b128` (0fc02f8, not measured), `kern` alone, then `gcheck p1024`.
# Session 16 ran `gabl b128`, `gwgs wgs128` (reverted: hung) and `stk stk128` (stacked RAC
# operands: now the default). Next: `b128` at the newest commit, then `kern` alone.
# Session 17 ran `prof ov` (the reference row at the stacked default; mma_overlap=1 no gain),
# `rsel` (twice: the first failed to compile the kernel), `rsel2` (the RAC selection kernel is
# slower in the rollout: off by default) and `b32`. Next: `kern` alone, then `p1024 b256`.
# Session 18 ran `kern` (failed: the device copied an uncommitted kernel edit), `gcheck mcheck
# b128` (row windows; check-grouped ran out of its 160 s before its W4A16 items: now 240 s),
# `win` (windows vs gathered tiles, same call), `kern` at e3d82e8 (the dense table alone took
# its 540 s) and `kgroup` (cut at 64 tokens; wall-clock only). Next: `kdense`, `kgroup` (both
# with device times now), `gcheck` for the W4A16 items, then `p1024 b256`.
# Session 19 ran `mmak` (7413c4c: mma_k 256 faster; the default since, so `mmak`'s "base" is now
# 256 and "mma_k 64" the old path), `kdense kgroup` (fa54bdd; both cut by their 270 s limits,
# rows in the logs), `mcheck b128 nomat` (81f981d: the barrier helped RAC, cost plain nvfp4 a
# kernel per GEMM: RAC-only since) and `fin`. Next: `bits` and `kv8` (the signs_high layout and
# the FP8 KV cache, both built after the last call), then `b256`, `gcheck`, and `kdense`,
# `kdense2`, `kgroup2` for the tables' missing rows (at most two per call).
# Session 20 ran `bits` (6cd428a: signs_high faster, the default since), `kv8` (fc97b91: the
# FP8 cache crashed the decode program with an illegal address: jax's Triton 32-bit offsets on
# a 4.0e9-element 1-byte array; fixed in 74ebca8 by int32 words) and `kv8` at 74ebca8 (the
# four arms ran; the probe's FP8 check ran out of time capturing the 8 GB cache as a constant),
# then `attn b256` (cbdfb9a), `static` and `mcheck` (9e4733e). Next: `attn kv8s` (the decode
# attention's slot_splits, built after the last call), `check` / `mcheck` with the signs_high
# check weights (dd535a9), `gcheck`, `b32`, the kdense / kgroup tables.
# Session 21 ran `attn mcheck kv8s` (c1e04e4: slot_splits no gain), `rop` (22273a2: the
# rac_operands kernel, -0.9 ms per RAC step; the default since), `b128 b256` and `mcheck b32`
# plus the FP8-KV arms (9425e29), and `check` (9425e29, all PASS). Next: `ropad` (built after
# the last call), `kdense`, `kdense2`, `kgroup2` (one or two per call), `p1024`, `gcheck`.
# Session 22 ran `ropad prof2` (b79a63f: "skip" no gain; the nvfp4 step kernel by kernel),
# `plan` (8619555: the plan kernel at block 64 was 30 us per layer, slower) and `plan2`
# (b9d0759: block 16, nvfp4_rac 15.68 vs 16.23 ms; both kernels the default since). Next:
# `b128p` (all four arms at the newest commit, and the plan kernel at block 8), then `kdense`,
# `kdense2`, `kgroup2`, `p1024`, `gcheck`.
# Session 23: no device was lent. Next: `b128p`, then `cont` (continuous batching) and
# `share` (shared prompt cache), both built in session 23, `kdense`, `kdense2`, `kgroup2`,
# `p1024`, `gcheck`.
# Session 24 ran `b128 cont`, `share`, `kdense kgroup2` (kdense again without a row: the
# chain's lowering, fixed in a79ea2d), `contshare p1024`, `mcheck` and b128p's plan8 (all at
# c916b59; block 8 the default since). Next: `pgroup` (built after the last call), `attn`
# (the bf16 configs: the kernel is at ~0.53 of its floor in the rollout), `kdense` (to see the
# fix), `kdense2`, `kpre`, `kgroup`, `gcheck`, `b256`.
# Session 25 ran `prof2 attn`, `pgroup`, `kdense kpre`, `kdense2 kdense0` and `contgroup` (all
# at 67a2735; per_group won at prompt 1024 and lost at 128-256: "auto" the default since; FP8
# caches at 64 slots per block). Built after the last call: the down GEMM read back in slot
# order (output_rows, d510abb). Next: `mcheck` (its GPU check) with `nobar` (the barrier after
# the grouped kernels keeps their read-back gathers as kernels of their own, 7.8 us per layer;
# last measured in the old layout), `contshare` and `contgroup` in one call (the same machine),
# `b128` (all four arms at the newest commit), `kv8` (the FP8 block), `kgroup`, `gcheck`,
# `b256`.
# Session 26: no device was lent. Built: the trainer's grouped matmuls on Pallas
# (bf16_grouped; its dW kernel ragged_contract opt-in until checked). Next: `tgrouped train`
# (one call), then `traindw` if tgrouped's dW checks PASS, then session 25's list.
# Session 27 ran `tgrouped train` (9915281, an H100: bf16_grouped 2.7x faster per update than
# XLA ragged_dot; ragged_contract's dW as exact as XLA's and 10x faster: the default since),
# `traindw kpre mcheck` (d528a85, an H100: update 0.291 s; output_rows PASS), `b128` (OOM on
# the H100: the 30B rollout needs the H200), `trainprof` and `kpre` (7e950af, an H200: update
# 0.224 s; RAC prefill over all K beats the selected columns: the default since 10311c9).
# Built after the last call: swiglu's own gradient (21434a3). Next, on an H200: `trainprof`
# (the swiglu change), `kpre` (the block-wise column takes), `b128 nobar`, `contshare
# contgroup`, `kv8`, `kgroup`, `gcheck`, `b256`; never `b128`-like rollouts on an H100.
# Session 28 got H100s only: `b128 kpre` (1657f33; the rollout steps now run 24 layers on a GPU
# under 100 GB: nvfp4_rac 1.78x bf16 there; RAC prefill over the selected blocks +52 %: the
# default since), `trainprof` (0.257 s per update) and a short test of RAC scale coding in
# rac_operands (slower: reverted). Next, on an H200: `b128 nobar`, `kpre`, `trainprof`, then
# `contshare contgroup`, `kv8`, `kgroup`, `gcheck`, `b256`; on an H100 the same (24 layers).
# Session 29 got H100s only: `kpre b128` (25783e6: a variadic RAC reduction and a counts GEMM,
# slower: reverted), `kv8r` (c8fbbf2: the four arms on the FP8 cache, attention 46 against 75
# us per layer), `prof2` (c8fbbf2: RAC's XLA kernels read off the HLO), `rrows` and an
# interleaved A/B (da3d3b4: the rac_rows kernel, GPU bit-identical, -2.8 to -4.5 %), `kpre`
# (da3d3b4) and `rrec` (9dc8005: no f32 residual written; grouped RAC prefill +67 %). Next, on
# an H200: `b128` (all four arms at 48 layers with the row kernel), `rrec`, `kv8r`, then
# `trainprof`, `contshare contgroup`, `kgroup`, `gcheck`, `b256`; on an H100 the same.
# Session 30 got an H200 twice and H100s: `rpre` (7cfbbd7, H200: the row pass without values,
# slower: reverted), `e2m1` (a01f05c against 1db8d15, H100: the E2M1 rounding, bit-identical),
# the activation ablations (`kernel_probe --act-ablations`, H100), `ptile` (af03df0, H200; the
# mma_k variants at 3dfdedb on an H100: no knob helps RAC). The `needs_h200` call for `b128`
# got no machine. Built after the last call (CPU-tested only): `qdq` and the E2M1 code decode
# by arithmetic (ff96e15, and the commit after), RAC's values placed in the windows (opt-in:
# `place` measures it). Next, on an H200: `place`, `b128` (48 layers: the
# newest commit's four arms), `trainprof` (the trainer's fake-quant through the new `qdq`),
# `kpre`, then session 29's list; on an H100 the same at 24 layers.
# Session 32 got one H100 (after eight failed starts): `place b128` (07e3e01: placed values
# -10 us of grouped RAC prefill, +63 % over W4A4: now the default; nvfp4_rac 1.81x bf16 at 24
# layers) and `study` (six of seven arms). Next, on an H200: `place` (the default against
# values not placed: does +65 % go under 60 %?), `kpre`, `b128`, `trainprof`, `study` alone
# (560 s); then session 29's list.
# Session 33 got two H100s, no H200 (three `needs_h200` calls got none): `kpre trainprof`,
# `cmdbuf b128` (command buffers still +13-15 %; nvfp4_rac 1.78x bf16 at 24 layers), `kgroup
# kgroup2`, `kdense0`, `kdense2`, `kdense` (issue 4's decode tables at efb76ab). Next, on an
# H200: `place`, `b128` (48 layers), `study` alone; then session 29's list.
# Session 34 got H100s only: `tpre kdense0` (cafb3a0), `tpre kpre` + the base's (2db87d0 vs
# cafb3a0: RAC's scales coded in rac_operands, grouped RAC prefill +59.6 against +66.8 %),
# `kpre tpre kdense2 kdense` (3fe901e), `kpre tpre b128` (e5cb791, atomic sums: reverted),
# `ksplit kpre` (4c3a866: the split-K sweep), `kdense0 kdense2` (fb23019: FP8 >= XLA FP8 at
# the large shapes). Next, on an H200: `kpre tpre`, `ksplit`, `b128 prng` (48 layers), `place`,
# `study` alone; on an H100 the same at 24 layers.
# Session 35 got H100s only: `samp kab` (de2fc27: the inverse-CDF sampler, 65 against 153 us per
# draw at batch 128; the sorted scatter of 3ee59e6 not faster), `tab b128` (832aed6: the sorted
# scatter 9.3 against 4.6 us, reverted; nvfp4_rac 1.80x bf16), `rowk` (4e277df: the row
# kernels' grids), `rcp` and `kpre b128` (364262b: recomputed placed values slower),
# `ropr` (26d6d23: rac_operands at 4 rows per program in prefill, now the default). Next, on an
# H200: `kpre` (the prefill default), `rop4` (the same rows in decode), `b128` (48 layers),
# `ksplit`, `place`, `study` alone; on an H100 the same at 24 layers.
# Session 36 (H100s only; three H200 asks got none) ran `kpre nobar` (e76925f: the barrier
# after the grouped kernels now off by default, 04546c3), `prof2 rop4`, `b128` + a barrier-on
# run, `b256 p1024`, `b32`, `kgroup`, `kgroup2`. Next, on an H200: `b128` (48 layers), `nobar`,
# `kdense`, `kdense2`, `kpre`, `place`, `study` alone; on an H100: `kdense`, `kdense2`.
# Session 37 ran `b128` and `kdense0 kgroup2` on an H200 (ae0da10), then `rsel3` (8581402) and
# `rsel3 b128` (d126d0a: the RAC selection kernel on by default) on H100s; later asks got no
# machine and the device time ran out. Next: `ssort` first (the slot-sort kernel has never
# been compiled by Triton on a GPU; it is off by default until this A/B), then on an H200
# `gabl2` (what bounds the W4A4 expert kernels there), `b128` (48 layers, at the newest
# commit), `b32`, `b256`; on an H100 `kdense`, `kdense2`.
# Session 38 got H100s only (the H200 asks ran on H100s or got none): `gabl2 ssort` (398e556:
# the slot-sort kernel EQUAL and 2x faster, on by default since cc60706; the grouped kernel's
# ablations) and `ptxas gabl2` (86cd222: the pipeline alone takes 94 % of gate_up's time on
# the H100, so its bytes bound it; the ptxas dumps did not come back, see the step). Built after
# the last call (CPU-tested, lowered for cuda, never compiled by ptxas): E4M3 block scales in
# the kernel layout (0.5625 streamed bytes per weight instead of 0.625; off by default) and
# the decode step's per-layer vectors packed into one scan input (off by default).
# Session 39: `s38` on an H100 (ca9aabb: E4M3 checks PASS, gate_up 95.7 -> 91.6 us, nvfp4_rac
# at batch 128 8.67 -> 8.48 -> 8.40 ms): both on by default since a7082ac; then `ptxas b128`
# and `b32 b256` (the four arms at the new defaults, H100). Built after the last call: the
# epilogue's copies waited for a work item later (`store_buffers`, off). Next: on an H100
# `store`, `ng2` (n_group 2 now that E4M3 scales fit its stages 4 deep), `kdense`; on an H200
# `s39h` (does the E4M3 scales' conversion cost more than their bytes save where the decode
# bounds the kernel?), `store`, `ng2`, `gabl2`, `b128`.
# Session 40 (most asks got no machine or lost it mid-call): `b128` on an H100 (22802be:
# nvfp4_rac 8.33 ms, 1.89x bf16, 1.17x fp8, RAC +2.0 %), and on an H200 the grouped kernel on
# two warpgroup pairs (`compute_wgs=4`; its first run hung: jax's register split, fixed in
# 191e654): plain calls 22-27 % faster, GPU-checked at mma_k 128, on by default for grouped
# decode without RAC since (`wide_plain_decode`); RAC's gate_up slower. Next: `wide` (on an
# H200 first: the default path's GPU check, RAC on two pairs unstacked, the rollout A/B), then
# `kdense0 kdensew` (the dense decode kernel on two pairs), `selw` (RAC's residual wgmmas
# for the selected blocks only: built after the last call), `b128`, `s39h`, `kgroup`; on an
# H100 `wide` too (its kernel is copy-bound there).
# Session 41 (12 of 14 asks got no machine): `w41` on an H100 (d283154): the default path
# GPU-checked at mma_k 256 (PASS), nvfp4 at batch 128 8.19 -> 7.98 ms on two pairs, nvfp4_rac
# 8.49; RAC unstacked on two pairs: residual wgmmas 17.5 of 114.6 us, for the selected half
# of the blocks no gain (so `selw` is moot on the H100). Next, on an H200: `w41` (the same
# there; or `wide`), `widerac` (RAC calls on two pairs: the stacked operand at mma_k 128),
# `kdense0 kdensew`, `b128` (48 layers at the new default), `s39h`, `kgroup`.
# Session 42 (H100, 9c1fa62): `widerac` (RAC calls on two pairs: 8.94-9.84 ms against 8.43 on
# one; stays off), `kdense0 kdensew` (dense decode on two pairs +12 %: not adopted; float16
# scales), `b128` (nvfp4_rac 8.46: 1.92x bf16, 1.17x fp8, RAC +4.6 %) and the kernel alone
# one / two pairs with RAC (`probe`). Next, on an H200: `b128` (48 layers), `w41`, `kdense0
# kgroup kgroup2` (the tables with E4M3 scales since e3b5977), `s39h`.
# Session 43 (H100, 0a38c18): `rsel4` (RAC's selection inside rac_operands: GPU check PASS,
# the step 9.72 ms against 8.55: stays off). Next, on an H200: `b128` (48 layers), `w41`,
# `kdense0 kgroup kgroup2`, `s39h`.
# Session 44 (H100): `cbuf` (XLA's default command buffers 8.30 ms; none 8.91; with WHILE +
# CONDITIONAL 8.89: the default stays), `rscale` / `rscale2` (rac_rows computing the rows'
# decode scales: GPU check PASS, 8.43-8.59 ms against 8.36-8.41: off), `b128` at e712677
# (nvfp4_rac 8.45: 1.86x bf16's 15.73, 1.16x fp8's 9.80), `sslot` (the selection kernel writing
# the epilogue scales: PASS, 8.30 against 8.30 ms; off). Two asks for an H200 got none. Next:
# `sslot` again (the experts' scales now applied in the tile kernel's epilogue); on an H200: `b128`
# (48 layers), `w41`, `kdense0 kgroup kgroup2`, `s39h`.
# Session 45 (H100): `cconc` / `cconc2` (CONCURRENT command-buffer scheduling: nvfp4_rac 8.34 ->
# 8.13 ms, bf16 unchanged; the default since 2300907; `sslot` equal under it: off), `cdef` (the
# four arms at the new default: nvfp4_rac 8.19, 1.96x bf16's 16.06) and a repeat that found
# nvfp4_rac's rollout not reproducible (the prefill's scatter-add expert sums, replaced). Next:
# `determ` (the repeat, at the fix) and `cprof` (what the concurrent graphs overlap), then on an
# H200: `b128` (48 layers), `w41`, `kdense0 kgroup kgroup2`.
# Sessions 46-47: `hall` on an H200 (nvfp4_rac 1.81x bf16, RAC +14.4 %), `wdown` (off).
# Session 48 (H100): `tune` (n_group 2 / store_buffers 2: not adopted), `pair2` (RAC's two-pair
# kernels serialize their wgmmas at 104 registers), `mem24` (112 registers: 2-4 us, not the
# gap; the rollout slower). scripts/mosaic_ptx.py compiles these kernels to the same PTX on
# the CPU: register / serialization questions need no device call. Next: `nrows` (is it the
# wgmmas' N?) on either card, then on an H200 `m24k` and `nrows` there.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200_next}
mkdir -p "$OUT"
if [ -z "${COMMIT:-}" ]; then
  echo "COMMIT=<sha> is required (the commit that runs; git HEAD on the device can be stale)"
  exit 2
fi
ALL=nvfp4,nvfp4_rac,bf16,fp8
# An 80 GB H100 cannot hold the 48-layer 30B shape (session 27: `sync` out of memory with 61 GB
# of BF16 weights and their NVFP4 copy): there the rollout and continuous-batching steps run 24
# of its identical layers (the arms' per-step ratios hold, their absolute times do not: the
# JSON records `layers`).
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
LAYERS=()
if [ -n "$GPU_MIB" ] && [ "$GPU_MIB" -lt 100000 ]; then
  LAYERS=(--layers 24)
  echo "GPU memory $GPU_MIB MiB: the rollout steps run ${LAYERS[*]}"
fi

probe() {  # probe TAG SECONDS CHECKS VARIANTS: the grouped tile kernel alone (kernel_probe
  # --grouped-ablations): the grouped matmul's GPU checks of CHECKS, then VARIANTS timed
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout "$2" python3 scripts/kernel_probe.py \
    --grouped-ablations --out "$OUT/$1" --check-variants "$3" --variants "$4" \
    > "$OUT/$1.log" 2>&1
  echo "$1 rc $?"; grep -E "grouped|FAIL|PASS|Error" "$OUT/$1.log" | cut -c1-130
}
e4m3_probe() {  # e4m3_probe SECONDS VARIANTS: the GPU checks at the defaults (E4M3 scales),
  # then VARIANTS timed
  probe e4m3k "$1" default "$2"
}
rollout() {  # rollout TAG SECONDS ARGS...
  local tag=$1 limit=$2; shift 2
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 15 "$limit" python3 scripts/bench_rollout.py \
    --no-ragged --bf16-path mgpu --no-split --commit "$COMMIT" ${LAYERS[@]+"${LAYERS[@]}"} \
    --out "$OUT/$tag" "$@" > "$OUT/$tag.log" 2>&1
  echo "$tag rc $?"; grep -E "^\||busy|^ +[0-9.]+ ms" "$OUT/$tag.log" | cut -c1-120
}
flag_ab() {  # flag_ab TAG FIELD=VALUE: the decode MoE operand checks with --w4a4-set FIELD=VALUE
  # (check-moe), then nvfp4_rac at batch 128 with it (TAGown) and at the defaults (TAGdef),
  # same call, traced (top 45 kernels)
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 100 python3 scripts/bench_kernels.py \
    --part check-moe --w4a4-set "$2" --out "$OUT/mcheck$1" > "$OUT/mcheck$1.log" 2>&1
  echo "mcheck$1 rc $?"; grep -E "PASS|FAIL" "$OUT/mcheck$1.log" | cut -c1-110
  rollout "$1own" 110 --quick --profile-steps 4 --profile-top 45 --precisions nvfp4_rac \
    --w4a4-set "$2" --budget-s 85
  rollout "$1def" 110 --quick --profile-steps 4 --profile-top 45 --precisions nvfp4_rac \
    --budget-s 85
}
continuous() {  # continuous TAG SECONDS ARGS...: the `cont` workload (bench_continuous.py)
  local tag=$1 limit=$2; shift 2
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 15 "$limit" python3 scripts/bench_continuous.py \
    --precision nvfp4_rac --sequences 256 --n-samples 8 --batch-rows 128 --prompt 256 \
    --new-tokens 512 --stop-fraction 0.004 --segment-steps 32 --commit "$COMMIT" \
    ${LAYERS[@]+"${LAYERS[@]}"} --out "$OUT/$tag" "$@" > "$OUT/$tag.log" 2>&1
  echo "$tag rc $?"; grep -E '"schedule"|Error' "$OUT/$tag.log" | cut -c1-300
}
ptxas_lines() {  # ptxas_lines DIR: each Mosaic kernel's ptxas notes from $OUT/DIR (compile
  # order: kernel_0, kernel_1, ...), then the dumps packed into $OUT/DIR.tgz
  for f in $(ls "$OUT/$1"/*.ptxas 2>/dev/null | sort -V); do
    echo "$(basename "$f" .ptxas): $(grep -oE "C75[0-9]+|[0-9]+ bytes spill (stores|loads)|Used [0-9]+ registers" "$f" | awk '!seen[$0]++' | tr '\n' ' ')"
  done
  tar -czf "$OUT/$1.tgz" -C "$OUT" --exclude="*.mlir-passes.log" "$1" && rm -rf "${OUT:?}/$1"
}
dumped_probe() {  # dumped_probe TAG SECONDS CHECKS VARIANTS: probe with Mosaic GPU's PTX and
  # ptxas dumps in $OUT/TAG_dump, then each kernel's ptxas lines (ptxas_lines)
  mkdir -p "$OUT/$1_dump"
  MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/$1_dump" probe "$@"
  ptxas_lines "$1_dump"
}
mem24_rollouts() {  # nvfp4_rac with RAC's decode calls on two pairs at 112 registers, then at
  # the defaults
  rollout m24 150 --quick --precisions nvfp4_rac --w4a4-set wide_rac_decode=true \
    --w4a4-set wide_memory_registers=24 --budget-s 130
  rollout m24def 150 --quick --precisions nvfp4_rac --budget-s 130
}
check() {  # check PART SECONDS
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 "$2" python3 scripts/bench_kernels.py \
    --part "$1" --out "$OUT/$1" > "$OUT/$1.log" 2>&1
  echo "$1 rc $?"; grep -E "PASS|FAIL" "$OUT/$1.log" | cut -c1-110
}
short="--decode-steps 16 --reps 2 --prefill-reps 1"
base_tree() {  # the tree of commit $BASE in /tmp/base (git archive; else ./base.tar, carried)
  if [ ! -d /tmp/base ]; then
    mkdir -p /tmp/base
    { git archive "${BASE:?BASE=<sha> is required}" 2>/dev/null || cat base.tar; } \
      | tar -x -C /tmp/base || return 1
  fi
}
prefill_ab() {  # issue 4's prefill rows (kpre) at this commit and at BASE, in the same call
  for tree in new base; do
    dir=.; [ $tree = base ] && { base_tree || continue; dir=/tmp/base; }
    (cd $dir && XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$dir timeout -k 15 120 \
      python3 scripts/bench_kernels.py --part prefill --trace --out "$OUT/kpre_$tree" \
      > "$OUT/kpre_$tree.log" 2>&1; echo "kpre $tree rc $?")
    grep -E "grouped|floor|bw" "$OUT/kpre_$tree.log" | cut -c1-220
  done
}
for step in "$@"; do
  case $step in
    check) check check 230; check check-grouped 240 ;;
    gcheck) check check-grouped 240 ;;
    mcheck) check check-moe 100 ;;
    b128) rollout b128 250 --quick --profile-steps 4 --precisions $ALL --budget-s 200 ;;
    cbuf) # XLA's command buffers (CUDA graphs) in the decode step: the default set, none,
      # and with the layer loop and the token loop's conditionals (WHILE, CONDITIONAL); the
      # default's and WHILE's optimized HLO counted for command_buffer computations
      cb="--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*"
      XLA_FLAGS="--xla_dump_to=/tmp/hlo_cbdef $cb" rollout cbdef 130 --quick --profile-steps 4 \
        --precisions nvfp4_rac --budget-s 100
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" rollout cboff 120 --quick --profile-steps 4 \
        --precisions nvfp4_rac --budget-s 95
      XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1 --xla_dump_to=/tmp/hlo_cbwhile $cb" \
        rollout cbwhile 150 --quick --profile-steps 4 --precisions nvfp4_rac --budget-s 120
      for d in /tmp/hlo_cbdef /tmp/hlo_cbwhile; do
        echo "$d: $(ls $d 2>/dev/null | grep -c after_optimizations.txt) modules"
        cat $d/*after_optimizations.txt 2>/dev/null | grep -oE "command_buffer[A-Za-z0-9_.]*|kind=[A-Za-z]+" \
          | sed -E 's/[0-9]+$//' | sort | uniq -c | sort -rn | head -8
      done ;;
    rscale) flag_ab rs rac_row_scales=true ;;
    rscale2) rollout rsown2 120 --quick --profile-steps 4 --profile-top 45 \
        --precisions nvfp4_rac --w4a4-set rac_row_scales=true --budget-s 95
      rollout rsown512 120 --quick --profile-steps 4 --profile-top 45 --precisions nvfp4_rac \
        --w4a4-set rac_row_scales=true --w4a4-set rac_row_scale_programs=512 --budget-s 95
      rollout rsdef2 120 --quick --profile-steps 4 --profile-top 45 --precisions nvfp4_rac \
        --budget-s 95 ;;
    sslot) flag_ab ss rac_select_slot_scales=true ;;
    cconc) for arm in nvfp4_rac:LHS nvfp4_rac:CONCURRENT_REGIONS nvfp4_rac:CONCURRENT \
        bf16:LHS bf16:CONCURRENT_REGIONS; do
        XLA_FLAGS="--xla_gpu_command_buffer_scheduling_mode=${arm#*:}" \
          rollout "cc_${arm%:*}_${arm#*:}" 110 --quick --precisions "${arm%:*}" --budget-s 80
      done ;;
    cconc2) XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT check check-moe 100
      for arm in nvfp4_rac:LHS nvfp4_rac:CONCURRENT bf16:LHS bf16:CONCURRENT fp8:LHS \
        fp8:CONCURRENT nvfp4:LHS nvfp4:CONCURRENT bf16:CONCURRENT nvfp4_rac:CONCURRENT \
        bf16:LHS nvfp4_rac:LHS nvfp4_rac:LHS:rac_select_slot_scales=true \
        nvfp4_rac:CONCURRENT:rac_select_slot_scales=true; do
        IFS=: read -r prec mode flag <<< "$arm"
        XLA_FLAGS="--xla_gpu_command_buffer_scheduling_mode=$mode" \
          rollout "c2_${prec}_${mode}${flag:+_ss}" 70 --quick --precisions "$prec" \
          ${flag:+--w4a4-set "$flag"} --budget-s 50
      done ;;
    cdef|determ|hdef|dauto) arms="nvfp4_rac: nvfp4_rac:LHS bf16: bf16:LHS fp8: nvfp4:" limit=70
      extra=  # dauto's XLA flag, for this step's runs only (not exported to later steps)
      [ "$step" = dauto ] && arms="nvfp4: nvfp4: nvfp4:" limit=80 \
        extra=--xla_gpu_autotune_level=0
      [ "$step" = determ ] && arms="nvfp4_rac: nvfp4_rac: nvfp4: nvfp4_rac: nvfp4:"
      [ "$step" = hdef ] && arms="nvfp4_rac: bf16: fp8: nvfp4: nvfp4_rac:" limit=110
      n=0
      for arm in $arms; do
        IFS=: read -r prec mode <<< "$arm"
        n=$((n + 1)); tag="${step}${n}_${prec}_${mode:-default}"
        XLA_FLAGS="${XLA_FLAGS:-}${extra:+ $extra}" rollout "$tag" "$limit" --quick \
          --precisions "$prec" ${mode:+--cb-schedule "$mode"} --budget-s $((limit - 20))
        python3 -c "import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if r['kind'] == 'rollout':
        print(' ', r['precision'], r['cb_schedule'], r.get('prefill_digest'), r['tokens_digest'],
              r['logprobs_digest'])
" "$OUT/$tag/rollout.jsonl"
      done ;;
    datc) for i in 1 2; do  # two processes sharing one autotune cache: the same digests
        rollout "datc$i" 80 --quick --precisions nvfp4 --autotune-cache /tmp/datc --budget-s 60
        grep -o '"prefill_tok_s": [0-9.]*\|"[a-z]*_digest": "[0-9a-f]*"' "$OUT/datc$i.log" \
          | paste -sd' '
      done ;;
    hall) rollout hall 470 --quick --precisions nvfp4_rac,bf16,fp8,nvfp4 --budget-s 420 ;;
    segp) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 150 python3 scripts/probe_segment_sum.py \
        > "$OUT/segp.log" 2>&1; echo "segp rc $?"; cut -c1-300 "$OUT/segp.log" | tail -8 ;;
    cprof) XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true rollout cprof 150 \
        --quick --profile-steps 4 --profile-top 90 --precisions nvfp4_rac,bf16 --budget-s 110 ;;
    b128r) rollout b128r 200 --quick --profile-steps 4 --precisions nvfp4_rac,bf16 \
      --budget-s 160 ;;
    prng) rollout prng 220 --quick --profile-steps 4 --precisions nvfp4_rac,bf16 \
      --prng-impl rbg --budget-s 170 ;;
    b32) rollout b32 220 --batches 32 --prompts 256 $short --precisions $ALL --budget-s 170 ;;
    b256) rollout b256 280 --batches 256 --prompts 256 $short --precisions $ALL --budget-s 220 ;;
    b256r) rollout b256r 150 --batches 256 --prompts 256 $short --precisions nvfp4_rac \
      --w4a4-set prefill_min_rows=4096 --budget-s 110
      rollout b256d 150 --batches 256 --prompts 256 $short --precisions nvfp4_rac,nvfp4 \
      --budget-s 110 ;;
    p1024) rollout p1024 220 --batches 128 --prompts 1024 $short --precisions nvfp4_rac,bf16 \
      --budget-s 170 ;;
    prof) XLA_FLAGS="--xla_dump_to=/tmp/hlo_prof --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \
      rollout prof 300 --quick --profile-steps 4 --profile-top 120 \
      --precisions nvfp4_rac,nvfp4,bf16,fp8 --budget-s 250
      (cd /tmp/hlo_prof && tar czf "$OUT/hlo.tgz" $(ls | grep -E "after_optimizations.txt$"))
      ls -la "$OUT" ;;
    prof2) XLA_FLAGS="--xla_dump_to=/tmp/hlo_prof --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \
      rollout prof2 200 --quick --profile-steps 4 --profile-top 160 \
      --precisions nvfp4,nvfp4_rac --budget-s 160
      (cd /tmp/hlo_prof && tar czf "$OUT/hlo.tgz" $(ls | grep -E "after_optimizations.txt$"))
      ls -la "$OUT" ;;
    nobar1) rollout nobar1 110 --batches 128 --prompts 256 --decode-steps 8 --reps 1 \
      --prefill-reps 1 --profile-steps 2 --no-grouped-barrier --precisions nvfp4_rac --budget-s 80
      rollout bar1 110 --batches 128 --prompts 256 --decode-steps 8 --reps 1 --prefill-reps 1 \
      --profile-steps 2 --grouped-barrier --precisions nvfp4_rac --budget-s 80 ;;
    nobar) rollout nobar 200 --quick --profile-steps 4 --no-grouped-barrier \
      --precisions nvfp4_rac,nvfp4 --budget-s 150
      rollout bar 200 --quick --profile-steps 4 --grouped-barrier --precisions nvfp4_rac,nvfp4 \
        --budget-s 150 ;;
    unroll) rollout unroll 280 --quick --unroll-decode --precisions nvfp4,bf16 --budget-s 220 ;;
    kern) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 540 python3 scripts/bench_kernels.py \
      --part decode,grouped --out "$OUT/kern" > "$OUT/kern.log" 2>&1
      echo "kern rc $?"; tail -40 "$OUT/kern/bench_kernels.md" ;;
    kdense|kdense2|kdense0|kdensew) shapes=2048x768,2048x3072; wide=()
      [ $step = kdense2 ] && shapes=4096x57344; [ $step = kdense0 ] && shapes=4096x14336
      [ $step = kdensew ] && { shapes=4096x14336; wide=(--w4a4-set compute_wgs=4 --w4a4-set n_group=2); }
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 270 python3 scripts/bench_kernels.py \
      --part decode --dense-shapes $shapes --trace ${wide[@]+"${wide[@]}"} --out "$OUT/$step" \
      > "$OUT/$step.log" 2>&1
      echo "$step rc $?"; grep -E "M=|floor|bw" "$OUT/$step.log" | cut -c1-240 ;;
    kgroup|kgroup2) tokens=1,16; [ $step = kgroup2 ] && tokens=64,256
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 270 python3 scripts/bench_kernels.py \
      --part grouped --tokens $tokens --trace --out "$OUT/$step" > "$OUT/$step.log" 2>&1
      echo "$step rc $?"; grep -E "grouped|floor|bw" "$OUT/$step.log" | cut -c1-240 ;;
    tgrouped) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 420 python3 scripts/bench_kernels.py \
      --part train-grouped --trace --out "$OUT/tgrouped" > "$OUT/tgrouped.log" 2>&1
      echo "tgrouped rc $?"; grep -E "PASS|FAIL|train|floor|bw" "$OUT/tgrouped.log" | cut -c1-240 ;;
    train) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 280 python3 -m quads_jax.train.bench \
      --config configs/small_gpu_base.yaml --batch 32 --seq 512 --repeats 3 --grouped both \
      > "$OUT/train.json" 2> "$OUT/train.log"
      echo "train rc $?"; grep -E '"(recipe|grouped.*|median_s|first_loss.*|kernel_speedup|mfu.*)"' \
        "$OUT/train.json"; tail -3 "$OUT/train.log" | cut -c1-200 ;;
    traindw) for dw in kernel xla; do  # recipes: the dW kernel on both, XLA's dW on bf16 only
        r=bf16,trainer_qat; [ $dw = xla ] && r=bf16
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 150 python3 -m quads_jax.train.bench \
        --config configs/small_gpu_base.yaml --batch 32 --seq 512 --repeats 3 --dw $dw \
        --profile-top 25 \
        --recipes $r > "$OUT/traindw_$dw.json" 2>> "$OUT/traindw.log"
        echo "traindw $dw rc $?"; grep -E '"(recipe|grouped.*|median_s|first_loss|mfu.*)"' \
          "$OUT/traindw_$dw.json"
      done; grep -A12 "^profile" "$OUT/traindw.log" | cut -c1-160 ;;
    trainprof) XLA_FLAGS="--xla_dump_to=/tmp/hlo_train --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*update.*" \
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 200 python3 -m quads_jax.train.bench \
      --config configs/small_gpu_base.yaml --batch 32 --seq 512 --repeats 3 --recipes bf16 \
      --profile-top 60 > "$OUT/trainprof.json" 2> "$OUT/trainprof.log"
      echo "trainprof rc $?"; grep -E '"(recipe|grouped_ran|median_s|first_loss|mfu.*)"' \
        "$OUT/trainprof.json"; grep -A25 "^profile" "$OUT/trainprof.log" | cut -c1-160
      (cd /tmp/hlo_train && tar czf "$OUT/hlo_train.tgz" $(ls | grep -E "after_optimizations.txt$")) ;;
    kpre) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 270 python3 scripts/bench_kernels.py \
      --part prefill --trace --out "$OUT/kpre" > "$OUT/kpre.log" 2>&1
      echo "kpre rc $?"; grep -E "prefill|grouped|floor|bw" "$OUT/kpre.log" | cut -c1-240 ;;
    cmdbuf) XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=2" \
      rollout cmdbuf 220 --quick --precisions nvfp4,nvfp4_rac --budget-s 170 ;;
    gabl) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 280 python3 scripts/kernel_probe.py \
      --grouped-ablations --out "$OUT/gabl" > "$OUT/gabl.log" 2>&1
      echo "gabl rc $?"; grep -E "grouped|FAIL|floor" "$OUT/gabl.log" | cut -c1-130 ;;
    gabl2) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 260 python3 scripts/kernel_probe.py \
      --grouped-ablations --out "$OUT/gabl2" \
      --variants "${GABL2_VARIANTS:-default,default no_decode,default no_compute,default mma_k 64,default one_mma,default n_group 2,default store1,default n_group 2 store2}" \
      > "$OUT/gabl2.log" 2>&1
      echo "gabl2 rc $?"; grep -E "grouped|FAIL|floor" "$OUT/gabl2.log" | cut -c1-130 ;;
    ptxas) mkdir -p "$OUT/dump"  # session 38 had not made it: the dumps may need it to exist
      MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/dump" \
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 150 python3 scripts/kernel_probe.py \
      --grouped-ablations --out "$OUT/ptxask" --variants "default" > /tmp/ptxas.log 2>&1
      # Session 38: the dumps went to the log (too big to come back), not to DUMP_TO: grep it
      # here and keep a compressed copy.
      echo "ptxas rc $?"; grep -E "^  grouped|Error" /tmp/ptxas.log | cut -c1-130
      gzip -c /tmp/ptxas.log > "$OUT/ptxas.log.gz"; ls "$OUT/dump" 2>/dev/null | head
      grep -hoE "C75[0-9]+.{0,160}|[Ss]erializ.{0,120}|Potential Performance.{0,160}" \
        /tmp/ptxas.log "$OUT"/dump/* 2>/dev/null | sort | uniq -c | head -20
      grep -hE "Used [0-9]+ registers|spill" /tmp/ptxas.log "$OUT"/dump/* 2>/dev/null \
        | sort | uniq -c | head -20
      for pat in wgmma.mma_async wgmma.wait_group wgmma.fence cvt.rn.f16x2.e4m3x2; do
        echo "$pat: $(grep -c "$pat" /tmp/ptxas.log)"; done ;;
    pair2) mkdir -p "$OUT/dump2"
      MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO="$OUT/dump2" \
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 170 python3 scripts/kernel_probe.py \
      --grouped-ablations --out "$OUT/ptxas2k" --variants "default wg4" > /tmp/ptxas2.log 2>&1
      echo "ptxas2 rc $?"; grep -E "^  grouped|Error" /tmp/ptxas2.log | cut -c1-130
      # In order, so each kernel's registers and notes follow its entry line.
      grep -hE "Compiling entry|Used [0-9]+ registers|spill|C75[0-9]+|[Ss]erializ" \
        /tmp/ptxas2.log "$OUT"/dump2/* 2>/dev/null | cut -c1-220 | head -60
      for pat in "HGMMA" "WARPGROUP.ARRIVE" "WARPGROUP.DEPBAR" "LDL" "STL"; do
        echo "$pat: $(cat /tmp/ptxas2.log "$OUT"/dump2/* 2>/dev/null | grep -c "$pat")"; done
      gzip -c /tmp/ptxas2.log > "$OUT/ptxas2.log.gz"; tar -czf "$OUT/dump2.tgz" -C "$OUT" dump2 && rm -rf "$OUT/dump2"
      ls -la "$OUT" | grep -E "ptxas2|dump2"
      GABL2_VARIANTS="default,default wg4,default wg4 unstacked,default unstacked no_second_mma,default wg4 unstacked no_second_mma" \
        bash "$0" gabl2 ;;
    mem24) dumped_probe mem24k 200 "default wg4 mem24,default wg4 mma_k 128 mem24" \
        "default,default wg4,default wg4 mem24,default wg4 mma_k 128,default wg4 mma_k 128 mem24,default wg4 mma_k 64 mem24"
      mem24_rollouts ;;
    mem24h|m24k) # mem24 cut to fit an H200 call (m24k: the kernel alone)
      dumped_probe mem24k 200 "default wg4 mem24" \
        "default,default wg4,default wg4 mem24,default wg4 mma_k 128 mem24"
      [ "$step" = m24k ] || mem24_rollouts ;;
    nrows) dumped_probe nrows 280 "" \
        "default,default wg4,default wg4 mem24,default wg4 mem24 rows32,default wg4 mem24 rows8,default wg4 rows8,default rows32" ;;
    narrow) # narrow_tiles (tiles of <= 8 rows at N = 8): the grouped matmul's GPU check, then
      # the kernel alone on windows of which ~60 % are narrow (rows8: every tile at N = 8)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 100 python3 scripts/bench_kernels.py \
        --part check-moe --w4a4-set narrow_tiles=true --out "$OUT/mchecknt" \
        > "$OUT/mchecknt.log" 2>&1
      echo "mchecknt rc $?"; grep -E "PASS|FAIL" "$OUT/mchecknt.log" | cut -c1-110
      probe narrowk 270 "" "default,default wg4,default wg4 narrow,default wg4 mem24 narrow,default wg4 mem24 narrow0,default wg4 mem24 rows8" ;;
    narrowr) # nvfp4_rac with narrow tiles: RAC's calls on two pairs at 112 registers, on one
      # pair, and the defaults
      rollout nrac2 150 --quick --precisions nvfp4_rac --w4a4-set narrow_tiles=true \
        --w4a4-set wide_rac_decode=true --w4a4-set wide_memory_registers=24 --budget-s 130
      rollout nrac1 150 --quick --precisions nvfp4_rac --w4a4-set narrow_tiles=true --budget-s 130
      rollout ndef 150 --quick --precisions nvfp4_rac --budget-s 130 ;;
    e4m3) e4m3_probe 170 "default f16 scales,default,default f16 no_compute,default no_compute"
      rollout e4m3 110 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-scales float8_e4m3fn --budget-s 90
      rollout f16s 110 --quick --profile-steps 4 --precisions nvfp4_rac --w4a4-scales float16 \
      --budget-s 90 ;;
    s38) e4m3_probe 150 "default f16 scales,default"
      rollout base38 110 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-scales float16 --no-pack-layer-vectors --budget-s 90
      rollout e4m3 110 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-scales float8_e4m3fn --no-pack-layer-vectors --budget-s 90
      rollout e4m3pack 110 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-scales float8_e4m3fn --pack-layer-vectors --budget-s 90 ;;
    s39h) e4m3_probe 120 "default f16 scales,default"  # s38 in ~5.5 minutes (the H200)
      rollout f16s 110 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-scales float16 --no-pack-layer-vectors --budget-s 90
      rollout defaults 110 --quick --profile-steps 4 --precisions nvfp4_rac --budget-s 90 ;;
    ng2) probe ng2k 150 "default n_group 2" \
      "default,default n_group 2,default n_group 4"
      rollout ng2 100 --quick --profile-steps 4 --precisions nvfp4_rac --w4a4-n-group 2 \
      --budget-s 80
      rollout ng1 100 --quick --profile-steps 4 --precisions nvfp4_rac --budget-s 80 ;;
    wdown) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 100 python3 scripts/bench_kernels.py \
        --part check-moe --w4a4-set wide_rac_decode_max_k=1024 --out "$OUT/mcheckwd" \
        > "$OUT/mcheckwd.log" 2>&1
      echo "mcheckwd rc $?"; grep -E "PASS|FAIL" "$OUT/mcheckwd.log" | cut -c1-110
      rollout wdown 150 --quick --precisions nvfp4_rac --w4a4-set wide_rac_decode_max_k=1024 \
        --budget-s 130
      rollout wdef 150 --quick --precisions nvfp4_rac --budget-s 130 ;;
    tune) probe tunek 170 "default n_group 2,default store2" \
      "default,default n_group 2,default store2,default n_group 2 store2"
      rollout tdef 100 --quick --precisions nvfp4_rac --budget-s 80
      rollout tng2 100 --quick --precisions nvfp4_rac --w4a4-n-group 2 --budget-s 80
      rollout tst2 100 --quick --precisions nvfp4_rac --w4a4-set store_buffers=2 --budget-s 80
      rollout tdef2 100 --quick --precisions nvfp4_rac --budget-s 80 ;;
    store) probe storek 170 "default store2" \
      "default,default store1,default store2,fp8 store2"
      rollout store 150 --quick --profile-steps 4 --precisions nvfp4_rac,fp8 \
      --w4a4-set store_buffers=2 --fp8-set store_buffers=2 --budget-s 120
      rollout store0 150 --quick --profile-steps 4 --precisions nvfp4_rac,fp8 --budget-s 120 ;;
    wide) probe widek 250 "default,default wg4 mma_k 64" \
      "default,default wg4,default unstacked,default wg4 unstacked,default unstacked no_second_mma,default wg4 unstacked no_second_mma,default unstacked keep50,default wg4 unstacked keep50"
      rollout wide 150 --quick --profile-steps 4 --precisions nvfp4,nvfp4_rac --budget-s 120
      rollout narrow 110 --quick --profile-steps 4 --precisions nvfp4 \
      --w4a4-set wide_plain_decode=false --budget-s 90 ;;
    w41) probe w41k 170 default \
      "default,default wg4 unstacked,default wg4 unstacked no_second_mma,default wg4 unstacked keep50"
      rollout wide 140 --quick --profile-steps 4 --precisions nvfp4,nvfp4_rac --budget-s 110
      rollout narrow 100 --quick --profile-steps 4 --precisions nvfp4 \
      --w4a4-set wide_plain_decode=false --budget-s 80
      rollout wrac128 100 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-set wide_rac_decode=true --w4a4-set mma_k=128 --budget-s 80 ;;
    widerac) rollout wrac 120 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-set wide_rac_decode=true --budget-s 100
      rollout wrac128 120 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-set wide_rac_decode=true --w4a4-set mma_k=128 --budget-s 100
      rollout wracsel 120 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-set wide_rac_decode=true --w4a4-set stack_operands=false \
      --w4a4-set rac_selected_wgmmas=true --w4a4-set mma_k=128 --budget-s 100
      rollout racdef 120 --quick --profile-steps 4 --precisions nvfp4_rac --budget-s 100 ;;
    selw) probe selwk 120 "default unstacked selected" default
      rollout selw 120 --quick --profile-steps 4 --precisions nvfp4_rac --w4a4-set \
      stack_operands=false --w4a4-set rac_selected_wgmmas=true --budget-s 100
      rollout unstk 120 --quick --profile-steps 4 --precisions nvfp4_rac --w4a4-set \
      stack_operands=false --budget-s 100
      rollout stk 120 --quick --profile-steps 4 --precisions nvfp4_rac --budget-s 100 ;;
    pack) rollout pack 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --pack-layer-vectors --budget-s 110
      rollout nopack 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --no-pack-layer-vectors --budget-s 110 ;;
    stk) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 200 python3 scripts/kernel_probe.py \
      --grouped-ablations --out "$OUT/stk" --variants "base,mma_overlap=1,stacked,stacked overlap1" \
      --check-variants "stacked" > "$OUT/stk.log" 2>&1
      echo "stk rc $?"; grep -E "grouped|FAIL|floor" "$OUT/stk.log" | cut -c1-130 ;;
    stk128) rollout stk128 130 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-stack-operands --budget-s 100
      rollout rac128 130 --quick --profile-steps 4 --precisions nvfp4_rac \
      --no-w4a4-stack-operands --budget-s 100 ;;
    ov) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 150 python3 scripts/kernel_probe.py \
      --grouped-ablations --out "$OUT/ovk" --variants "stacked,stacked overlap1" \
      --check-variants "stacked overlap1" > "$OUT/ovk.log" 2>&1
      echo "ovk rc $?"; grep -E "grouped|FAIL|floor" "$OUT/ovk.log" | cut -c1-130
      rollout ov128 130 --quick --profile-steps 4 --precisions nvfp4_rac \
      --w4a4-mma-overlap 1 --budget-s 100 ;;
    rsel) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 120 python3 scripts/kernel_probe.py \
      --rac-select --out "$OUT/rselk" > "$OUT/rselk.log" 2>&1
      echo "rselk rc $?"; grep -E "rac_select|Error" "$OUT/rselk.log" | cut -c1-140
      check check-moe 100
      rollout rsel128 250 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --rac-select-kernel --budget-s 200
      rollout nosel128 130 --quick --profile-steps 4 --precisions nvfp4_rac \
      --no-rac-select-kernel --budget-s 100 ;;
    rsel2) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 150 python3 scripts/kernel_probe.py \
      --rac-select --out "$OUT/rselk" > "$OUT/rselk.log" 2>&1
      echo "rselk rc $?"; grep -E "rac_select|XLA:GPU|Error" "$OUT/rselk.log" | cut -c1-150
      rollout rsel64 130 --quick --profile-steps 4 --precisions nvfp4_rac \
      --rac-select-kernel --rac-select-block-rows 64 --budget-s 100
      rollout nosel128 130 --quick --profile-steps 4 --precisions nvfp4_rac \
      --no-rac-select-kernel --budget-s 100 ;;
    rsel3) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 150 python3 scripts/kernel_probe.py \
      --rac-select --out "$OUT/rselk" > "$OUT/rselk.log" 2>&1
      echo "rselk rc $?"; grep -E "rac_select|XLA:GPU|Error" "$OUT/rselk.log" | cut -c1-150
      for v in nosel sel32 sel16; do  # the jnp selection, then the kernel at 32 / 16 rows
        case $v in nosel) a=--no-rac-select-kernel ;; sel32) a=--rac-select-kernel ;;
          sel16) a="--rac-select-kernel --rac-select-block-rows 16" ;; esac
        rollout $v 150 --quick --profile-steps 4 --precisions nvfp4_rac $a --budget-s 120
      done ;;
    rsel4) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 110 python3 scripts/bench_kernels.py \
        --part check-moe --w4a4-set rac_select_in_operands=true --out "$OUT/mchecksel" \
        > "$OUT/mchecksel.log" 2>&1
      echo "mchecksel rc $?"; grep -E "PASS|FAIL" "$OUT/mchecksel.log" | cut -c1-110
      rollout selop 120 --quick --profile-steps 4 --precisions nvfp4_rac \
        --w4a4-set rac_select_in_operands=true --budget-s 95
      rollout selop16 120 --quick --profile-steps 4 --precisions nvfp4_rac \
        --w4a4-set rac_select_in_operands=true --w4a4-set rac_select_block_rows=16 --budget-s 95
      rollout seldef 120 --quick --profile-steps 4 --precisions nvfp4_rac --budget-s 95 ;;
    ssort) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 120 python3 scripts/kernel_probe.py \
      --slot-sort --out "$OUT/ssortk" > "$OUT/ssortk.log" 2>&1
      echo "ssortk rc $?"; grep -E "slot_sort|Error" "$OUT/ssortk.log" | cut -c1-150
      rollout ssort 110 --quick --profile-steps 4 --precisions nvfp4_rac --slot-sort-kernel \
      --budget-s 90
      rollout nossort 110 --quick --profile-steps 4 --precisions nvfp4_rac --budget-s 90 ;;
    win) rollout win128 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 --budget-s 110
      rollout gat128 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --no-windowed-operands --budget-s 110 ;;
    mmak) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 240 python3 scripts/kernel_probe.py \
      --grouped-ablations --out "$OUT/mmak" \
      --variants "base,stacked,mma_k 128,mma_k 256,stacked k128,stacked k256,stacked k128 overlap1" \
      --check-variants "mma_k 256,stacked k256,stacked k128" > "$OUT/mmak.log" 2>&1
      echo "mmak rc $?"; grep -E "grouped|FAIL|PASS|floor|Error" "$OUT/mmak.log" | cut -c1-140
      rollout k256 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 --w4a4-mma-k 256 \
      --budget-s 110
      rollout k64 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 --budget-s 110 ;;
    nomat) rollout nomat 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --no-materialize-operands --budget-s 110 ;;
    fin) rollout fin128 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 --budget-s 110
      rollout p1024 200 --batches 128 --prompts 1024 $short --precisions nvfp4_rac,bf16 \
      --budget-s 150 ;;
    bits) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 200 python3 scripts/kernel_probe.py \
      --grouped-ablations --out "$OUT/bitsk" --variants "stacked,stacked signs_high,signs_high" \
      --check-variants "stacked signs_high" > "$OUT/bitsk.log" 2>&1
      echo "bitsk rc $?"; grep -E "grouped|FAIL|PASS|floor|Error" "$OUT/bitsk.log" | cut -c1-140
      rollout sh128 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --w4a4-bits signs_high --budget-s 110
      rollout nb128 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 --budget-s 110 ;;
    attn) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 240 python3 scripts/kernel_probe.py \
      --attention --out "$OUT/attn" > "$OUT/attn.log" 2>&1
      echo "attn rc $?"; grep -E "attention|FAIL|PASS|Error" "$OUT/attn.log" | cut -c1-140 ;;
    kv8) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 150 python3 scripts/kernel_probe.py \
      --attention --out "$OUT/attn" > "$OUT/attn.log" 2>&1
      echo "attn rc $?"; grep -E "attention|FAIL|PASS|Error" "$OUT/attn.log" | cut -c1-140
      rollout kv8 250 --quick --profile-steps 4 --precisions $ALL --kv-cache-dtype float8_e4m3fn \
      --budget-s 200 ;;
    kv8r) rollout kv8 250 --quick --profile-steps 4 --precisions $ALL --kv-cache-dtype float8_e4m3fn \
      --budget-s 200
      rollout b128rac 120 --quick --profile-steps 4 --precisions nvfp4_rac --budget-s 90 ;;
    rrows) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 150 python3 scripts/kernel_probe.py \
      --rac-rows --out "$OUT/rrows_probe" > "$OUT/rrows_probe.log" 2>&1
      echo "rrows probe rc $?"; grep -E "rac_rows|FAIL|Error" "$OUT/rrows_probe.log" | cut -c1-140
      check check-moe 100
      rollout rrows 200 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 --budget-s 160
      rollout rrows_off 110 --quick --profile-steps 4 --precisions nvfp4_rac --no-rac-row-kernel \
        --budget-s 80 ;;
    rrec) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 100 python3 scripts/kernel_probe.py \
      --rac-rows --out "$OUT/rrec_probe" > "$OUT/rrec_probe.log" 2>&1
      echo "rrec probe rc $?"; grep -E "rac_rows|FAIL|Error" "$OUT/rrec_probe.log" | cut -c1-140
      check check-moe 80
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 120 python3 scripts/bench_kernels.py \
        --part prefill --trace --out "$OUT/kpre" > "$OUT/kpre.log" 2>&1
      echo "kpre rc $?"; grep -E "grouped" "$OUT/kpre.log" | cut -c1-200
      for i in 1 2; do for f in --no-rac-row-kernel --rac-row-kernel; do
        rollout "ab$i${f#--}" 75 --quick --precisions nvfp4_rac $f --budget-s 60; done; done ;;
    e2m1) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 200 python3 scripts/kernel_probe.py \
      --act-operands --rac-rows --out "$OUT/e2m1_probe" > "$OUT/e2m1_probe.log" 2>&1
      echo "e2m1 probe rc $?"; grep -E "PASS|FAIL|Error|us in|kernel " "$OUT/e2m1_probe.log" | cut -c1-160
      prefill_ab ;;
    kab) prefill_ab ;;
    tab) for tree in new base; do  # tpre at this commit and at BASE, in the same call
        dir=.; [ $tree = base ] && { base_tree || continue; dir=/tmp/base; }
        (cd $dir && XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$dir timeout -k 15 150 \
          python3 scripts/kernel_probe.py --trace-grouped --trace-tokens 1024 \
          --out "$OUT/tpre_$tree" > "$OUT/tpre_$tree.log" 2>&1; echo "tpre $tree rc $?")
        grep -vE "^ +0\.00[0-2]" "$OUT/tpre_$tree.log" | cut -c1-160 | head -60
      done ;;
    samp) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 120 python3 scripts/sampling_probe.py \
      --out "$OUT/samp_probe" > "$OUT/samp_probe.log" 2>&1
      echo "samp probe rc $?"; grep -E "^B=|Error" "$OUT/samp_probe.log" | cut -c1-120
      for sampler in gumbel inverse_cdf; do
        rollout "samp_$sampler" 170 --quick --profile-steps 4 --precisions nvfp4_rac,bf16 \
          --sampler $sampler --budget-s 130
      done ;;
    rowk) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 400 python3 scripts/kernel_probe.py \
      --prefill-tiles --variants "base,rows 16,rows 32,operand rows 16,operand rows 4,operand \
warps 8,operand warps 2,rac_rows 16,rac_rows 4,rac_rows k512,rac_rows k1024,rac_rows k128,\
rac_rows warps 8,rac_rows warps 2" --out "$OUT/rowk" > "$OUT/rowk.log" 2>&1
      echo "rowk rc $?"; grep -E "grouped prefill|FAIL|Error" "$OUT/rowk.log" | cut -c1-230 ;;
    rop4) for i in 1 2; do for rows in 8 4; do  # the decode step's rac_operands rows, A/B
        rollout "rop4_${i}_r$rows" 75 --quick --precisions nvfp4_rac \
          --w4a4-set rac_operand_block_rows=$rows --budget-s 60
      done; done ;;
    ropr) for i in 1 2; do  # twice: rac_operands' rows per program at the prefill shape
        # (base: rac_operand_block_rows_prefill 4, the default since session 35)
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 150 python3 scripts/kernel_probe.py \
          --prefill-tiles --variants "base,rac_operand rows 8,rac_operand rows 2,operand \
warps 8" --out "$OUT/ropr$i" > "$OUT/ropr$i.log" 2>&1
        echo "ropr$i rc $?"; grep -E "grouped prefill|top:|FAIL|Error" "$OUT/ropr$i.log" | cut -c1-230
      done ;;
    rcp) for i in 1 2; do  # twice, each a base / recompute pair
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 150 python3 scripts/kernel_probe.py \
          --prefill-tiles --variants "base,recompute placed" --out "$OUT/rcp$i" \
          > "$OUT/rcp$i.log" 2>&1
        echo "rcp$i rc $?"; grep -E "grouped prefill|top:|FAIL|Error" "$OUT/rcp$i.log" | cut -c1-230
      done ;;
    ptile) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 300 python3 scripts/kernel_probe.py \
      --prefill-tiles --out "$OUT/ptile" > "$OUT/ptile.log" 2>&1
      echo "ptile rc $?"; grep -E "grouped prefill|top:|FAIL|Error" "$OUT/ptile.log" | cut -c1-230 ;;
    ksplit) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 270 python3 scripts/bench_kernels.py \
      --part splits --trace --out "$OUT/ksplit" > "$OUT/ksplit.log" 2>&1
      echo "ksplit rc $?"; grep -E "M=|failed" "$OUT/ksplit.log" | cut -c1-200 ;;
    tpre) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 150 python3 scripts/kernel_probe.py \
      --trace-grouped --trace-tokens 1024 --out "$OUT/tpre" > "$OUT/tpre.log" 2>&1
      echo "tpre rc $?"; grep -vE "^ +0\.00[0-2]" "$OUT/tpre.log" | cut -c1-160 | head -90 ;;
    place) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 200 python3 scripts/kernel_probe.py \
      --prefill-tiles --variants "base,values not placed" --out "$OUT/place" > "$OUT/place.log" 2>&1
      echo "place rc $?"; grep -E "grouped prefill|top:|FAIL|Error" "$OUT/place.log" | cut -c1-230 ;;
    study) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 560 python3 scripts/study_mismatch.py \
      --config configs/small_gpu_base.yaml sft.steps=300 --prompts 256 --samples 8 --seeds 0,1 \
      --arms "bf16,w4a16,naive_nvfp4,qat_only,symmetric_qat,quads,quads:rac_ratio=1.0" \
      --out "$OUT/study" > "$OUT/study.log" 2>&1
      echo "study rc $?"; cat "$OUT/study/study.md" ;;
    e2m1ab) base_tree || exit 1
      for i in 1 2; do for tree in base new; do
        dir=.; [ $tree = base ] && dir=/tmp/base
        (cd $dir && PYTHONPATH=$dir OUT=$OUT COMMIT=$COMMIT-$tree; \
          rollout "ab$i$tree" 120 --quick --precisions nvfp4_rac --budget-s 100)
      done; done ;;
    kv8s) rollout kv8s2 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --kv-cache-dtype float8_e4m3fn --attention-slot-splits 2 --budget-s 110
      rollout kv8s1 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --kv-cache-dtype float8_e4m3fn --budget-s 110 ;;
    static) rollout static128 150 --quick --profile-steps 4 --precisions nvfp4_rac_static,nvfp4_rac \
      --budget-s 110
      rollout static256 130 --batches 256 --prompts 256 $short --precisions nvfp4_rac_static \
      --budget-s 90 ;;
    rop) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 150 python3 scripts/kernel_probe.py \
      --rac-operands --out "$OUT/ropk" > "$OUT/ropk.log" 2>&1
      echo "ropk rc $?"; grep -E "rac_operands|FAIL|Error" "$OUT/ropk.log" | cut -c1-150
      rollout rop128 130 --quick --profile-steps 4 --precisions nvfp4_rac --rac-operand-kernel \
      --budget-s 100
      rollout nrop128 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --no-rac-operand-kernel --budget-s 110 ;;
    ropad) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 200 python3 scripts/kernel_probe.py \
      --rac-operands --out "$OUT/ropk" > "$OUT/ropk.log" 2>&1
      echo "ropk rc $?"; grep -E "rac_operands|FAIL|Error" "$OUT/ropk.log" | cut -c1-160
      rollout ropad128 130 --quick --profile-steps 4 --precisions nvfp4_rac \
      --rac-operand-padding skip --budget-s 100
      rollout rop128 130 --quick --profile-steps 4 --precisions nvfp4_rac --budget-s 100 ;;
    plan) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 200 python3 scripts/kernel_probe.py \
      --tile-plan --act-operands --out "$OUT/planp" > "$OUT/planp.log" 2>&1
      echo "planp rc $?"; grep -E "tile_plan|act_operands|FAIL|Error" "$OUT/planp.log" | cut -c1-150
      rollout plan128 200 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4,fp8 \
      --tile-plan-kernel --act-operand-kernel --budget-s 160
      rollout noplan128 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --no-tile-plan-kernel --no-act-operand-kernel --budget-s 110 ;;
    plan2) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 100 python3 scripts/kernel_probe.py \
      --tile-plan --out "$OUT/planp" > "$OUT/planp.log" 2>&1
      echo "planp rc $?"; grep -E "tile_plan|FAIL|Error" "$OUT/planp.log" | cut -c1-150
      rollout plan128 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --tile-plan-kernel --act-operand-kernel --budget-s 110
      rollout noplan128 150 --quick --profile-steps 4 --precisions nvfp4_rac,nvfp4 \
      --no-tile-plan-kernel --no-act-operand-kernel --budget-s 110 ;;
    b128p) rollout b128 250 --quick --profile-steps 4 --precisions $ALL --budget-s 200
      rollout plan8 130 --quick --profile-steps 4 --precisions nvfp4_rac --tile-plan-block 8 \
      --tile-plan-warps 2 --budget-s 100 ;;
    cont) continuous cont 320 ;;
    contshare) continuous contshare 200 --schedules continuous --share-prompt-cache \
      --attention-prefix-mode per_row ;;
    contgroup) continuous contgroup 200 --schedules continuous --share-prompt-cache \
      --attention-prefix-mode per_group ;;
    share) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 120 python3 scripts/kernel_probe.py \
      --attention-prefix --out "$OUT/sharep" > "$OUT/sharep.log" 2>&1
      echo "sharep rc $?"; grep -E "PASS|FAIL|shared prefix|copied prompt" "$OUT/sharep.log" | cut -c1-150
      rollout share 200 --batches 128 --prompts 1024 $short --precisions nvfp4_rac \
      --n-samples 8 --share-prompt-cache --profile-steps 4 --budget-s 150
      rollout noshare 200 --batches 128 --prompts 1024 $short --precisions nvfp4_rac \
      --n-samples 8 --profile-steps 4 --budget-s 150 ;;
    pgroup) XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 15 150 python3 scripts/kernel_probe.py \
      --attention-prefix --out "$OUT/pgroupp" > "$OUT/pgroupp.log" 2>&1
      echo "pgroupp rc $?"; grep -E "PASS|FAIL|shared prefix|copied prompt|Error" "$OUT/pgroupp.log" | cut -c1-150
      rollout pgroup 200 --batches 128 --prompts 1024 $short --precisions nvfp4_rac \
      --n-samples 8 --share-prompt-cache --attention-prefix-mode per_group --profile-steps 4 \
      --budget-s 150
      rollout prow 200 --batches 128 --prompts 1024 $short --precisions nvfp4_rac \
      --n-samples 8 --share-prompt-cache --attention-prefix-mode per_row --profile-steps 4 \
      --budget-s 150 ;;
    hlo) XLA_FLAGS="--xla_dump_to=$OUT/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \
      rollout hlo 200 --quick --precisions nvfp4 --budget-s 150 ;;
    *) echo "unknown step $step (kab tab samp rowk rcp ropr rop4 check gcheck mcheck kv8r rrows rrec b128 b32 b256 p1024 prof nobar unroll kern cmdbuf gabl stk stk128 nobar1 ov rsel rsel2 win kdense0 kdense kdense2 kdensew wide selw kgroup kgroup2 mmak nomat fin bits kv8 attn kv8s static rop ropad hlo prof2 plan plan2 b128p cont contshare contgroup share pgroup kpre tgrouped train traindw trainprof)"; exit 2 ;;
  esac
done
