"""Where the NVFP4 tile kernel's time goes, on one GPU: checks, ablations, decode variants, dumps.

    PYTHONPATH=. python3 scripts/kernel_probe.py --out $OUT            # checks + timings
    PYTHONPATH=. python3 scripts/kernel_probe.py --dump DIR            # compile 3 variants only
                                                                       # (with MOSAIC_GPU_DUMP_*)

Decode shape M=16, K=4096, N=14336 (a 4096 x 14336 projection at a decode step of 16 tokens).
The tile kernel is timed alone (its B operand pre-made, no XLA work around it), rotating over
enough weight copies to stream from HBM, many calls unrolled in one jitted program
(``bench_kernels.time_chain``). Ablations (``TileGemmConfig.ablation``) skip decode, MMA or all
compute: the differences say what each part costs. Correctness runs first, with XLA's default
flags (``--xla_allow_excess_precision`` left on: the quantizer must be right under it).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402

from pallas_kernels import nvfp4_quantize as aq  # noqa: E402
from pallas_kernels.layout import prepare_w4a4_weights  # noqa: E402
from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm  # noqa: E402
from pallas_kernels.w4a4_grouped import (  # noqa: E402
    w4a4_grouped_matmul,
    w4a4_grouped_matmul_reference,
)
from pallas_kernels.w4a4_matmul import W4A4MatmulConfig, w4a4_matmul  # noqa: E402
from quads_jax.quant import kernel_backend, nvfp4  # noqa: E402

M, K, N = 16, 4096, 14336
GE, GK, GN = 128, 2048, 768  # grouped: Qwen3-30B-A3B's experts
OUT = "/tmp/probe_out"
ATTN_SHAPE = (128, 4, 8, 1279, 128, 4)  # batch, KV heads, query heads per KV head, slots, D, L
# (name, layout decode, TileGemmConfig overrides)
TILE_VARIANTS = (  # the first two are timed again at the end (run-to-run spread)
    ("ptx s4", "subnormal", dict(decode_impl="ptx")),
    ("jnp normal s4", "normal", dict(decode_impl="jnp")),
    ("ptx s2", "subnormal", dict(decode_impl="ptx", max_concurrent_steps=2)),
    ("ptx s3", "subnormal", dict(decode_impl="ptx", max_concurrent_steps=3)),
    ("ptx s6", "subnormal", dict(decode_impl="ptx", max_concurrent_steps=6)),
    ("ptx overlap1 s4", "subnormal", dict(decode_impl="ptx", mma_overlap=1, mma_k=64)),
    ("ptx ks2 s4", "subnormal", dict(decode_impl="ptx", k_splits=2)),
    ("ablate no_decode s4", "normal", dict(ablation="no_decode")),
    ("ablate one_mma (ptx) s4", "subnormal", dict(ablation="one_mma", decode_impl="ptx",
                                                  mma_k=64)),
    ("ablate no_compute s4", "normal", dict(ablation="no_compute")),
    ("ablate no_compute s2", "normal", dict(ablation="no_compute", max_concurrent_steps=2)),
)
E2E_VARIANTS = (
    ("ptx subnormal", "subnormal", dict(decode_impl="ptx")),
    ("jnp normal", "normal", dict(decode_impl="jnp")),
)


def weights(key, shape, decode, bits: str = "nibbles", scale_dtype: str | None = None):
    """``(NVFP4Tensor, W4A4Weights)`` of a random weight, f16 MMA, the given decode, word bit
    layout and block-scale dtype (None: float16)."""
    return bk.nvfp4_weight(key, shape, "float16", decode, bits=bits, scale_dtype=scale_dtype)


def tile_op(cfg):
    te, nt = jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32)
    return lambda b, w: nvfp4_tile_gemm((b,), w, te, nt, config=cfg)


def run_checks():
    bk.log("== checks (default XLA flags; fresh inputs; poisoned outputs)")
    bk.run_diagnostics()
    racc = aq.RACConfig()
    x = bk.rand(9, (M, K), jnp.float32)
    e, ke, ne = 128, 2048, 768
    gs = bk.routing(64, 64, e, 8, True)
    xg = bk.rand(41, (int(gs.sum()) + 3, ke), jnp.float32)
    for name, decode, kw in E2E_VARIANTS[:1]:
        wq, ww = weights(19, (N, K), decode)
        cfg = W4A4MatmulConfig(**kw)
        for r in (None, racc):
            bk.check(f"{name}: dense w4a4{'+RAC' if r else ''} M={M} K={K} N={N}",
                     jax.jit(lambda x=x, ww=ww, r=r, cfg=cfg: w4a4_matmul(x, ww, rac=r,
                                                                           config=cfg)),
                     lambda x=x, wq=wq, r=r: bk.deq_ref(x, wq, r), (M, N))
        wq, ww = weights(40, (e, ne, ke), decode)
        for r in (None, racc):
            bk.check(f"{name}: grouped w4a4{'+RAC' if r else ''} E={e} rows={xg.shape[0]}",
                     jax.jit(lambda x=xg, gs=gs, ww=ww, r=r, cfg=cfg: w4a4_grouped_matmul(
                         x, ww, gs, rac=r, config=cfg)),
                     lambda x=xg, gs=gs, wq=wq, r=r: bk.deq_ref(x, wq, r, gs), (xg.shape[0], ne))


def run_timings():
    bk.measure_floors()
    bw = bk.RESULTS["floors"]["read_bw"]
    nv_bytes = N * K * 0.5625
    bk.log(f"== tile kernel alone, M={M} K={K} N={N}; floor {nv_bytes / bw * 1e6:.1f} us "
           f"(0.5625 B/param at {bw / 1e12:.2f} TB/s)")
    c = bk.copies_for(N * K * 0.625)
    x = bk.rand(60, (M, K))
    ws = {d: [weights(100 + i, (N, K), d)[1] for i in range(c)] for d in ("normal", "subnormal")}
    b = aq.mma_operand(nvfp4.quantize(x, scale_mode="row"), jnp.float16)[0].reshape(1, M, K)
    for name, decode, kw in TILE_VARIANTS + TILE_VARIANTS[:2]:
        try:
            t, calls = bk.time_chain(tile_op(TileGemmConfig(**kw)), b, ws[decode])
            bk.record(f"tile {name}", t, calls, bytes_=nv_bytes, flops=2 * M * N * K)
        except Exception as err:  # noqa: BLE001  (one variant failing must not stop the run)
            bk.log(f"  tile {name} FAILED: {type(err).__name__}: {str(err)[:400]}")
    bk.log("== full w4a4_matmul (activation quantization + kernel + epilogue)")
    for name, decode, kw in E2E_VARIANTS[:1]:
        for r in (None, aq.RACConfig()):
            cfg = W4A4MatmulConfig(**kw)
            try:
                t, calls = bk.time_chain(
                    lambda x, w, cfg=cfg, r=r: w4a4_matmul(x, w, rac=r, config=cfg), x, ws[decode])
                bk.record(f"w4a4 {name}{' +RAC0.5' if r else ''}", t, calls, bytes_=nv_bytes,
                          flops=2 * M * N * K)
            except Exception as err:  # noqa: BLE001
                bk.log(f"  w4a4 {name} FAILED: {type(err).__name__}: {str(err)[:400]}")
    del ws
    wb = [bk.rand(200 + i, (K, N)) for i in range(bk.copies_for(N * K * 2))]
    t, calls = bk.time_chain(lambda x, w: jnp.dot(x, w), x, wb)
    bk.record(f"XLA bf16 M={M} K={K} N={N}", t, calls, bytes_=N * K * 2, flops=2 * M * N * K)
    del wb
    w8 = [bk.fp8_weight(300 + i, N, K) for i in range(bk.copies_for(N * K))]
    t, calls = bk.time_chain(bk.xla_fp8, x, w8)
    bk.record(f"XLA fp8 M={M} K={K} N={N}", t, calls, bytes_=N * K, flops=2 * M * N * K)
    bk.BEST.update(name="ptx subnormal", layout=dict(mma_dtype="float16", decode="subnormal"),
                   config=dict())
    bk.bench_dense(shapes=((2048, 768), (4096, 57344), (2048, 3072)), extra=False)
    bk.write_outputs(OUT)
    bk.bench_grouped()


def traced_kernels(f, *args, match="mosaic", tag="probe"):
    """Run ``f(*args)`` once under ``jax.profiler`` and return (mean device us of the kernels
    whose name contains ``match``, their count, the busy fraction of the device). The device
    duration of a kernel excludes launch gaps and host work, which wall-clock timing of a chain
    cannot separate."""
    from quads_jax import profiling

    summary = profiling.trace(lambda: jax.block_until_ready(f(*args)), tag, top=50)
    for plane in summary.values():
        hits = [k for k in plane["top"] if match in k["name"]]
        count = sum(k["count"] for k in hits)
        if count:
            total = sum(k["total_ms"] for k in hits) * 1e3
            return total / count, count, plane["busy_fraction"]
    return float("nan"), 0, float("nan")


def run_launch_bound():
    """Is a call bound by the host's per-launch work? Time per call and host enqueue time per
    call (the jitted chain's call returns once every launch is enqueued) at 1x and 4x the bytes."""

    bk.log("== launch-bound test: us per call (device) vs us per call to enqueue (host)")
    for k, n in ((K, N), (4 * K, N), (K, 4 * N)):
        xk = bk.rand(61, (M, k))
        b = aq.mma_operand(nvfp4.quantize(xk, scale_mode="row"), jnp.float16)[0].reshape(1, M, k)
        c = bk.copies_for(n * k * 0.625)
        ws = [weights(100 + i, (n, k), "subnormal")[1] for i in range(c)]
        variants = [("ptx", dict(decode_impl="ptx")), ("no_compute", dict(ablation="no_compute"))]
        if (k, n) == (K, N):  # where does a fixed per-call cost come from?
            variants += [("nc sms66", dict(ablation="no_compute", num_sms=66)),
                         ("nc stages1", dict(ablation="no_compute", max_concurrent_steps=1)),
                         ("ptx ks4", dict(decode_impl="ptx", k_splits=4))]
        for name, kw in variants:
            op = tile_op(TileGemmConfig(**kw))
            reps = max(1, 8 // c)  # <= 8 call sites: each one is compiled separately (~1-2 s)

            def prog(x, *ws, op=op, reps=reps):
                for _ in range(reps):
                    for w in ws:
                        y = op(x, w)
                        x = x + (y.reshape(-1)[0] * 1e-30).astype(x.dtype)
                return x

            f = jax.jit(prog)
            jax.block_until_ready(f(b, *ws))
            dev, host = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                r = f(b, *ws)
                t1 = time.perf_counter()
                jax.block_until_ready(r)
                t2 = time.perf_counter()
                host.append((t1 - t0) / (reps * c))
                dev.append((t2 - t0) / (reps * c))
            floor = n * k * 0.5625 / bk.RESULTS["floors"]["read_bw"]
            try:
                kern_us, count, busy = traced_kernels(f, b, *ws, tag=f"{name}_{k}_{n}")
            except Exception as err:  # noqa: BLE001  (the trace is extra; keep the timing)
                kern_us, count, busy = float("nan"), 0, float("nan")
                bk.log(f"  trace failed: {type(err).__name__}: {str(err)[:200]}")
            bk.log(f"  {name:10s} K={k:6d} N={n:6d}: {sorted(dev)[2] * 1e6:7.1f} us/call, "
                   f"enqueue {sorted(host)[2] * 1e6:7.1f} us/call, kernel (traced) "
                   f"{kern_us:7.1f} us x{count:.0f}, busy {busy:.2f}, floor {floor * 1e6:6.1f} us")
            bk.RESULTS["timings"].append({"name": f"launch-bound {name} K={k} N={n}",
                                          "us": sorted(dev)[2] * 1e6,
                                          "enqueue_us": sorted(host)[2] * 1e6,
                                          "kernel_traced_us": kern_us,
                                          "floor_us": floor * 1e6, "calls": reps * c,
                                          "note": "enqueue = host time to launch", "bytes": None,
                                          "flops": None})
        del ws


def run_final():
    """The numbers for docs/BENCHMARKS.md in few compiles: GPU checks of the FP8 kernel and the
    grouped NVFP4 path, then dense decode and grouped decode timings (<= 16 calls per program:
    every kernel call site in a program is compiled on its own, ~1 s each)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rdm

    from pallas_kernels.w8a8_matmul import w8a8_grouped_matmul, w8a8_matmul, w8a8_reference
    from quads_jax.quant import fp8

    bk.log("== final checks (fresh inputs, poisoned outputs)")
    x = bk.rand(9, (M, K), jnp.float32)
    w8 = fp8.quantize(bk.rand(7, (N, K), jnp.float32), granularity="channel")
    bk.check("fp8 kernel dense M=16 K=4096 N=14336 (tol 1e-3: FP8 tensor-core accumulation)",
             jax.jit(lambda x=x, w=w8: w8a8_matmul(x, w)), lambda: w8a8_reference(x, w8), (M, N),
             tol=1e-3)
    e, ke, ne = GE, GK, GN
    gs = bk.routing(64, 64, e, 8, True)
    xg = bk.rand(41, (int(gs.sum()) + 3, ke), jnp.float32)
    w8e = fp8.quantize(bk.rand(8, (e, ne, ke), jnp.float32), granularity="channel")
    bk.check(f"fp8 kernel grouped E=128 rows={xg.shape[0]} (tol 1e-3)",
             jax.jit(lambda x=xg, gs=gs, w=w8e: w8a8_grouped_matmul(x, w, gs)),
             lambda: w8a8_reference(xg, w8e, gs), (xg.shape[0], ne), tol=1e-3)
    wq, ww = weights(40, (e, ne, ke), "subnormal")
    for r in (None, aq.RACConfig()):
        bk.check(f"nvfp4 grouped w4a4{'+RAC' if r else ''} E=128 rows={xg.shape[0]}",
                 jax.jit(lambda x=xg, gs=gs, ww=ww, r=r: w4a4_grouped_matmul(x, ww, gs, rac=r)),
                 lambda x=xg, gs=gs, wq=wq, r=r: bk.deq_ref(x, wq, r, gs), (xg.shape[0], ne))
    bk.measure_floors()
    fl = 2 * M * N * K
    x = bk.rand(60, (M, K))
    bk.log(f"== dense decode M={M} K={K} N={N}")
    ws = [weights(100 + i, (N, K), "subnormal")[1] for i in range(5)]
    for name, op in (("w4a4 (ptx, full path)", lambda x, w: w4a4_matmul(x, w)),
                     ("w4a4+RAC0.5", lambda x, w: w4a4_matmul(x, w, rac=aq.RACConfig()))):
        t, calls = bk.time_chain(op, x, ws, reps=3)
        bk.record(f"{name} M={M} K={K} N={N}", t, calls, bytes_=N * K * 0.5625, flops=fl)
    del ws
    w8x = [bk.fp8_weight(300 + i, N, K) for i in range(5)]  # (e4m3 [N, K], scale [N])
    t, calls = bk.time_chain(bk.xla_fp8, x, w8x, reps=3)
    bk.record(f"XLA fp8 M={M} K={K} N={N}", t, calls, bytes_=N * K, flops=fl)
    w8s = [bk.our_fp8_weight(w) for w in w8x]  # the same weights in our kernel's layout
    del w8x
    t, calls = bk.time_chain(lambda x, w: w8a8_matmul(x, w), x, w8s, reps=3)
    bk.record(f"our fp8 kernel M={M} K={K} N={N}", t, calls, bytes_=N * K, flops=fl)
    del w8s
    wb = [bk.rand(200 + i, (K, N)) for i in range(3)]
    t, calls = bk.time_chain(lambda x, w: jnp.dot(x, w), x, wb, reps=4)
    bk.record(f"XLA bf16 M={M} K={K} N={N}", t, calls, bytes_=N * K * 2, flops=fl)
    del wb
    bk.write_outputs(OUT)
    bk.log(f"== grouped decode E={e} K={ke} N={ne} top-8")
    wsg = [weights(400 + i, (e, ne, ke), "subnormal")[1] for i in range(2)]
    w8g = [bk.our_fp8_weight(fp8.quantize(bk.rand(450 + i, (e, ne, ke), jnp.float32),
                                          granularity="channel")) for i in range(2)]
    wbg = [bk.rand(500 + i, (e, ke, ne)) for i in range(2)]
    for tokens in (1, 64, 256):
        gs = bk.routing(tokens, tokens, e, 8)
        m = int(gs.sum())
        touched = int((np.asarray(gs) > 0).sum())
        xt = bk.rand(70, (m, ke))
        nb = touched * ne * ke
        for name, op, ws, per in (
            ("w4a4", lambda x, w, gs=gs: w4a4_grouped_matmul(x, w, gs), wsg, 0.5625),
            ("w4a4+RAC0.5", lambda x, w, gs=gs: w4a4_grouped_matmul(x, w, gs,
                                                                    rac=aq.RACConfig()), wsg, 0.5625),
            ("our fp8 kernel", lambda x, w, gs=gs: w8a8_grouped_matmul(x, w, gs), w8g, 1.0),
            ("jax ragged_dot_mgpu bf16", lambda x, w, gs=gs: rdm.ragged_dot(
                x, w, group_sizes=gs, block_m=128, block_n=128, block_k=64,
                max_concurrent_steps=4, grid_block_n=1), wbg, 2.0),
        ):
            try:
                t, calls = bk.time_chain(op, xt, ws, reps=6)
                bk.record(f"grouped {name} tokens={tokens} rows={m} experts={touched}", t, calls,
                          bytes_=nb * per, flops=2 * m * ne * ke)
            except Exception as err:  # noqa: BLE001
                bk.log(f"  grouped {name} tokens={tokens} FAILED: {type(err).__name__}: "
                       f"{str(err)[:300]}")


def run_attention_prefix(shape=(128, 8, 4, 8, 1024, 1023, 128, 4), interpret=False):
    """Decode attention with GRPO groups sharing their prompt's cache (``SharedPrefix``) against
    the copied layout (each row holding its prompt): 128 rows = 16 prompts x 8, prompt 1024,
    mid-response (512 of 1023 response slots). Floors: the KV bytes each layout must read
    (shared: 16 x 1024 + 128 x 512 slots; copied: 128 x 1536). ``shape``: rows, n, KV heads,
    query heads per KV head, prompt slots, response slots, head dim, layers; ``interpret``:
    the CPU dry run of every call (timings meaningless)."""
    from pallas_kernels.decode_attention import (
        DecodeAttentionConfig,
        SharedPrefix,
        decode_attention,
        decode_attention_reference,
        prefix_tiles,
    )

    b, n, kvh, g, p, r, d, layers_n = shape
    groups = b // n
    q = bk.rand(90, (b, kvh, g, d))
    pk, pv = (bk.rand(seed, (layers_n, groups, kvh, p, d)) for seed in (91, 92))
    k, v = (bk.rand(seed, (layers_n, b, kvh, r, d)) for seed in (93, 94))
    pad = jax.random.randint(jax.random.key(95), (groups, 1), 0, 64)
    prefix = SharedPrefix(pk, pv, jnp.arange(p)[None, :] >= pad,
                          jnp.repeat(jnp.arange(groups, dtype=jnp.int32), n))
    kv_len = r // 2 + 1
    valid = jnp.broadcast_to(jnp.arange(r)[None, :] < kv_len, (b, r))
    # The copied layout: each row's group prompt in front of its own slots.
    rows = prefix.row_group
    k_full = jnp.concatenate([pk[:, rows], k], axis=3)
    v_full = jnp.concatenate([pv[:, rows], v], axis=3)
    valid_full = jnp.concatenate([prefix.valid[rows], valid], axis=1)
    cfg = DecodeAttentionConfig(prefix_mode="per_row")
    run = functools.partial(decode_attention, config=cfg, interpret=interpret)
    bk.log("== decode attention, shared prompt caches: checks (tol 2e-2: P rounded to bf16)")
    # Inputs as lambda defaults: bk.check passes them traced (a captured cache would be folded
    # into the program as a constant).
    kernel = jax.jit(lambda q=q, k=k, v=v, valid=valid, prefix=prefix: run(
        q, k, v, jnp.int32(1), valid, jnp.int32(kv_len), prefix))
    bk.check(f"shared prefix, {groups} groups x {n}, prompt {p}, kv_len {kv_len}", kernel,
             lambda: decode_attention_reference(q, k, v, 1, valid, prefix=prefix),
             (b, kvh, g, d), tol=2e-2)
    bk.check("shared prefix = copied prompt (kernel, both layouts)", kernel,
             lambda: run(q, k_full, v_full, jnp.int32(1), valid_full, jnp.int32(p + kv_len)),
             (b, kvh, g, d), tol=2e-2)
    # prefix_mode "per_group" (the prefix read once per tile of a group's rows), its tiles
    # built once outside the timed calls as the model does per decode step.
    variants = [("per_row", cfg)] + [
        (f"per_group rows={r} splits={c}", DecodeAttentionConfig(
            prefix_mode="per_group", prefix_rows=r, prefix_splits=c))
        for r, c in ((8, 1), (8, 2), (8, 4), (8, 8), (4, 4), (16, 4))]
    for name, vcfg in (variants[1:4:2] if not interpret else variants[3:4]):  # splits 1, 4
        tiled = prefix._replace(tiles=prefix_tiles(prefix.row_group, groups, vcfg.prefix_rows))
        group_kernel = jax.jit(lambda q=q, k=k, v=v, valid=valid, prefix=tiled, vcfg=vcfg:
                               decode_attention(q, k, v, jnp.int32(1), valid, jnp.int32(kv_len),
                                                prefix, config=vcfg, interpret=interpret))
        bk.check(f"shared prefix {name} = per_row", group_kernel, kernel, (b, kvh, g, d),
                 tol=2e-2)
    bk.log("== decode attention, shared prompt caches: timings (4 layers rotated)")
    chain = dict(reps=1, runs=1) if interpret else dict(reps=4)  # the dry run: one pass
    slot_bytes = 2 * kvh * d * 2  # K and V, bf16, per slot
    for name, vcfg in variants if not interpret else variants[:2]:
        tiled = prefix._replace(tiles=prefix_tiles(prefix.row_group, groups, vcfg.prefix_rows)
                                if vcfg.prefix_mode == "per_group" else None)
        ws = [(k, v, jnp.int32(i), tiled) for i in range(layers_n)]
        t, calls = bk.time_chain(
            lambda x, w, vcfg=vcfg: decode_attention(x, w[0], w[1], w[2], valid,
                                                     jnp.int32(kv_len), w[3], config=vcfg,
                                                     interpret=interpret), q, ws, **chain)
        bk.record(f"decode attention shared prefix {name} {groups}x{n} prompt={p} "
                  f"kv_len={kv_len}", t, calls, bytes_=(groups * p + b * kv_len) * slot_bytes)
    wf = [(k_full, v_full, jnp.int32(i)) for i in range(layers_n)]
    t, calls = bk.time_chain(lambda x, w: run(x, w[0], w[1], w[2], valid_full,
                                              jnp.int32(p + kv_len)), q, wf, **chain)
    bk.record(f"decode attention copied prompt {b} rows prompt={p} kv_len={p + kv_len}", t,
              calls, bytes_=b * (p + kv_len) * slot_bytes)


def run_attention():
    """Decode attention at the 30B rollout shape (batch 128, 4 KV heads of 8 query heads, head
    dim 128, a 1279-slot cache): the kernel (mid-generation and full cache) against the jnp path
    the model used before (one layer sliced out, two XLA matmuls, a softmax between)."""
    from pallas_kernels.decode_attention import (
        DecodeAttentionConfig,
        decode_attention,
        decode_attention_reference,
    )
    from quads_jax.models import layers

    b, kvh, g, s, d, layers_n = ATTN_SHAPE
    k_all = bk.rand(80, (layers_n, b, kvh, s, d))
    v_all = bk.rand(81, (layers_n, b, kvh, s, d))
    q = bk.rand(82, (b, kvh, g, d))
    first = jax.random.randint(jax.random.key(83), (b, 1), 0, 64)  # left padding per row
    slot = jnp.arange(s)[None, :]
    bk.log("== decode attention: checks (kernel vs jnp reference, f32 compare)")
    for kv_len in (300, s):
        valid = (slot >= first) & (slot < kv_len)
        bk.check(f"decode attention kv_len={kv_len} (tol 2e-2: P rounded to bf16)",
                 jax.jit(lambda q=q, valid=valid, n=kv_len: decode_attention(
                     q, k_all, v_all, jnp.int32(2), valid, jnp.int32(n))),
                 lambda q=q, valid=valid: decode_attention_reference(q, k_all, v_all, 2, valid),
                 (b, kvh, g, d), tol=2e-2)
    # An FP8 E4M3 cache (SamplerConfig.kv_cache_dtype) of all 48 layers: 4.0e9 one-byte
    # elements, past the 2**31 that jax's Triton lowering indexes 1-byte arrays with (the
    # kernel reads it as int32 words); checked against the reference at the last layer.
    from quads_jax.models.kv_cache import to_cache_dtype

    full_layers = 48
    k8, v8 = (to_cache_dtype(bk.rand(seed, (full_layers, b, kvh, s, d)), jnp.float8_e4m3fn)
              for seed in (84, 85))
    for kv_len in (768 * s // 1279, s):
        valid = (slot >= first) & (slot < kv_len)
        bk.check(f"decode attention FP8 cache L={full_layers} layer {full_layers - 1} "
                 f"kv_len={kv_len} (tol 2e-2)",
                 lambda q=q, valid=valid, k=k8, v=v8, n=kv_len: decode_attention(
                     q, k, v, jnp.int32(full_layers - 1), valid, jnp.int32(n)),
                 lambda q=q, valid=valid: decode_attention_reference(q, k8, v8,
                                                                     full_layers - 1, valid),
                 (b, kvh, g, d), tol=2e-2)
    bk.log("== decode attention: timings (one layer per call, 4 layers rotated)")
    ws = [(k_all, v_all, jnp.int32(i)) for i in range(layers_n)]
    ws8 = [(k8, v8, jnp.int32(i)) for i in range(layers_n)]
    for kv_len in (768 * s // 1279, s):
        valid = (slot >= first) & (slot < kv_len)
        # bf16 at the rollout's shape is at its KV-byte floor in the traced rollout (74.4 us
        # per layer for 199 MB at 2.89 TB/s on the H100, 2026-12-06: 0.93; an earlier note
        # here counted 99.6 MB, the element count). Of the stage / block / warp variants timed
        # on 2026-12-05 none beat the default (the DecodeAttentionConfig docstring); the FP8
        # cache was fastest at 64 slots per block.
        for name, w, item, cfg in (("", ws, 2, DecodeAttentionConfig()),
                                   ("num_stages=2 ", ws, 2, DecodeAttentionConfig(num_stages=2)),
                                   ("block_s=64 ", ws, 2, DecodeAttentionConfig(block_s=64)),
                                   ("num_warps=2 ", ws, 2, DecodeAttentionConfig(num_warps=2)),
                                   ("slot_splits=2 ", ws, 2, DecodeAttentionConfig(slot_splits=2)),
                                   ("FP8 cache ", ws8, 1, DecodeAttentionConfig()),
                                   ("FP8 cache fp8_block_s=32 ", ws8, 1,
                                    DecodeAttentionConfig(fp8_block_s=32)),
                                   ("FP8 cache fp8_block_s=128 ", ws8, 1,
                                    DecodeAttentionConfig(fp8_block_s=128)),
                                   ("FP8 cache slot_splits=2 ", ws8, 1,
                                    DecodeAttentionConfig(slot_splits=2)),
                                   ("FP8 cache slot_splits=4 ", ws8, 1,
                                    DecodeAttentionConfig(slot_splits=4))):
            try:
                t, calls = bk.time_chain(
                    lambda x, w, valid=valid, n=kv_len, cfg=cfg: decode_attention(
                        x, w[0], w[1], w[2], valid, jnp.int32(n), config=cfg), q, w, reps=4)
                bk.record(f"decode attention kernel {name}kv_len={kv_len}", t, calls,
                          bytes_=2 * b * kvh * kv_len * d * item)
            except Exception as err:  # noqa: BLE001
                bk.log(f"  kernel {name}FAILED: {type(err).__name__}: {str(err)[:300]}")
    allowed = (slot >= first)[:, None, :]

    def jnp_path(x, w):
        k = jax.lax.dynamic_index_in_dim(w[0], w[2], 0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(w[1], w[2], 0, keepdims=False)
        return layers.attend(x.reshape(b, 1, kvh * g, d), k, v, allowed)

    t, calls = bk.time_chain(jnp_path, q, ws, reps=4)
    bk.record(f"decode attention jnp path (XLA) kv_len={s}", t, calls,
              bytes_=2 * b * kvh * s * d * 2)


def run_grouped_n_group(shapes=("gate_up", "down")):
    """The grouped decode matmuls of a 128-sequence decode step (1024 rows, top-8 of 128
    experts): gate_up (N=1536, K=2048) and down (N=2048, K=768), 1, 2 and 4 weight-row tiles
    per work item (``W4A4MatmulConfig.n_group``), +-RAC; GPU checks first."""
    bk.log("== grouped n_group: checks (fresh inputs, poisoned outputs)")
    gs = bk.routing(128, 128, GE, 8)
    m = int(gs.sum())
    touched = int((np.asarray(gs) > 0).sum())
    for n, k, name in ((2 * GN, GK, "gate_up"), (GK, GN, "down")):
        if name not in shapes:
            continue
        wq, ww = weights(600 + n, (GE, n, k), "subnormal")
        x = bk.rand(601, (m, k), jnp.float32)  # f32 output: the check sees the kernel's f32 sums
        for ng, r in ((2, None), (2, aq.RACConfig()), (4, aq.RACConfig())):
            cfg = W4A4MatmulConfig(n_group=ng)
            bk.check(f"grouped {name} n_group={ng}{' +RAC' if r else ''} rows={m}",
                     jax.jit(lambda x=x, ww=ww, r=r, cfg=cfg: w4a4_grouped_matmul(
                         x, ww, gs, rac=r, config=cfg)),
                     lambda x=x, wq=wq, r=r: bk.deq_ref(x, wq, r, gs), (m, n))
        bk.log(f"== grouped {name} timings: rows={m} experts={touched}")
        x = x.astype(jnp.bfloat16)
        ws = [weights(610 + i, (GE, n, k), "subnormal")[1] for i in range(2)]
        for ng, r in [(g, r) for r in (None, aq.RACConfig()) for g in (1, 2, 4)]:
            cfg = W4A4MatmulConfig(n_group=ng)
            try:
                t, calls = bk.time_chain(
                    lambda x, w, cfg=cfg, r=r: w4a4_grouped_matmul(x, w, gs, rac=r, config=cfg),
                    x, ws, reps=2)
                bk.record(f"grouped {name} n_group={ng}{' +RAC0.5' if r else ''}", t, calls,
                          bytes_=touched * n * k * 0.5625, flops=2 * m * n * k)
            except Exception as err:  # noqa: BLE001
                bk.log(f"  grouped {name} n_group={ng} FAILED: {type(err).__name__}: "
                       f"{str(err)[:300]}")
        del ws


# (label, W4A4MatmulConfig overrides): grouped prefill variants (run_prefill_tiles).
PREFILL_VARIANTS = (
    ("base", {}),
    ("n_group 2", {"n_group": 2}),
    ("block_m 32", {"block_m": 32}),
    ("block_m 128", {"block_m": 128}),
    ("steps 2", {"max_concurrent_steps": 2}),
    ("mma_k 128", {"mma_k": 128}),
    ("mma_k 128 overlap", {"mma_k": 128, "mma_overlap": 1}),
    ("mma_k 64 overlap", {"mma_k": 64, "mma_overlap": 1}),
    ("values not placed", {"rac_placed_values": False}),
    # The row kernels' grids (rac_rows; the window-operand kernels act_operands, rac_operands):
    # tuned at the decode step's shapes, run at 8 192 rows here (session 35); rac_operands'
    # rows in a call this large are rac_operand_block_rows_prefill (4 since session 35).
    ("rows 16", {"rac_row_block_rows": 16, "rac_operand_block_rows_prefill": 16,
                 "act_operand_block_rows": 16}),
    ("rows 32", {"rac_row_block_rows": 32, "rac_operand_block_rows_prefill": 32,
                 "act_operand_block_rows": 32}),
    ("operand rows 16", {"rac_operand_block_rows_prefill": 16, "act_operand_block_rows": 16}),
    ("operand rows 4", {"rac_operand_block_rows_prefill": 4, "act_operand_block_rows": 4}),
    ("operand warps 8", {"operand_warps": 8}),
    ("operand warps 2", {"operand_warps": 2}),
    ("rac_rows 16", {"rac_row_block_rows": 16}),
    ("rac_rows 4", {"rac_row_block_rows": 4}),
    ("rac_rows k512", {"rac_row_block_k": 512}),
    ("rac_rows k1024", {"rac_row_block_k": 1024}),
    ("rac_rows k128", {"rac_row_block_k": 128}),
    ("rac_rows warps 8", {"rac_row_warps": 8}),
    ("rac_rows warps 2", {"rac_row_warps": 2}),
    ("recompute placed", {"rac_operand_recompute_placed": True}),
    # rac_operands at the decode default's 8 rows and at 2 (4 with 8 warps: "operand warps 8")
    ("rac_operand rows 8", {"rac_operand_block_rows_prefill": 8}),
    ("rac_operand rows 2", {"rac_operand_block_rows_prefill": 2}),
)


def run_prefill_tiles(tokens: int = 1024, variants=PREFILL_VARIANTS):
    """The grouped prefill matmul of issue 4 (``tokens`` top-8 over 128 experts, K x N = 2048 x
    768: 8 192 rows), W4A4 and W4A4 + RAC 0.5, with the tile kernel's prefill-side knobs
    (``PREFILL_VARIANTS``: weight-row tiles per work item, tokens per tile, pipeline depth,
    wgmma overlap, unstacked RAC operands): each variant GPU-checked (fresh inputs, poisoned
    output) and timed with its traced device and tile-kernel times (``bench_kernels`` rows)."""
    bk.TRACE = True
    gs = bk.routing(tokens, tokens, GE, 8)
    m = int(gs.sum())
    touched = int((np.asarray(gs) > 0).sum())
    wq, ww = weights(820, (GE, GN, GK), "subnormal")
    xc = bk.rand(821, (m, GK), jnp.float32)
    x = xc.astype(jnp.bfloat16)
    ws = [weights(830 + i, (GE, GN, GK), "subnormal")[1] for i in range(2)]
    bk.log(f"== grouped prefill variants: rows={m} experts={touched} K={GK} N={GN}")
    racs = (("", None), (" +RAC0.5", aq.RACConfig()))
    # rac_rows' and rac_operands' own knobs change nothing without RAC: only their +RAC row
    rows = [(f"{label}{tag}", over, r) for label, over in variants for tag, r in racs
            if r is not None or not over
            or not all(key.startswith(("rac_row_", "rac_operand_")) for key in over)]
    rows.append(("unstacked +RAC0.5", {"stack_operands": False}, aq.RACConfig()))
    interpret = jax.devices()[0].platform != "gpu"  # a CPU smoke run: the interpreters
    for label, over, r in rows:
        try:
            cfg = W4A4MatmulConfig(**over, **({"a_via_smem": True} if interpret else {}))
            ok = bk.check(f"grouped prefill {label}", jax.jit(
                lambda xc=xc, ww=ww, r=r, cfg=cfg: w4a4_grouped_matmul(
                    xc, ww, gs, rac=r, config=cfg, interpret=interpret)),
                lambda r=r: w4a4_grouped_matmul_reference(xc, wq, gs, rac=r), (m, GN))
            if not ok:
                continue
            t, calls = bk.time_chain(
                lambda x, w, cfg=cfg, r=r: w4a4_grouped_matmul(x, w, gs, rac=r, config=cfg,
                                                               interpret=interpret),
                x, ws, reps=2)
            bk.record(f"grouped prefill {label}", t, calls, bytes_=touched * GN * GK * 0.5625,
                      flops=2 * m * GN * GK)
        except Exception as err:  # noqa: BLE001  (a variant failing must not stop the sweep)
            bk.log(f"  grouped prefill {label} FAILED: {type(err).__name__}: {str(err)[:300]}")


def run_trace_grouped(tokens: int = 128, prefill_shape: bool = False, top: int = 14):
    """Every kernel of one grouped call (``tokens`` top-8 over 128 experts; 128: the decode
    step's 1024 rows), with and without RAC, gate_up and down (``prefill_shape``: issue 4's
    prefill table shape, K x N = 2048 x 768, alone): where the time between the Mosaic kernel
    and the whole ``w4a4_grouped_matmul`` goes (activation quantization, RAC selection, tile
    gather, combine), without the benchmark chain's own kernels."""
    from quads_jax import profiling

    gs = bk.routing(tokens, tokens, GE, 8)
    m = int(gs.sum())
    shapes = (((GN, GK, "prefill"),) if prefill_shape
              else ((2 * GN, GK, "gate_up"), (GK, GN, "down")))
    for n, k, name in shapes:
        ww = weights(700 + n, (GE, n, k), "subnormal")[1]
        x = bk.rand(701, (m, k))
        for r in (None, aq.RACConfig()):
            f = jax.jit(lambda x, ww, r=r: w4a4_grouped_matmul(x, ww, gs, rac=r))
            jax.block_until_ready(f(x, ww))
            def run(f=f, x=x, ww=ww):
                for _ in range(4):
                    jax.block_until_ready(f(x, ww))

            summary = profiling.trace(run, f"grouped_{name}_{bool(r)}", steps=4, top=top)
            bk.log(f"== traced grouped {name}{' +RAC0.5' if r else ''} rows={m} (per call)")
            bk.log(profiling.format_summary(summary))


# The rollout's grouped-kernel settings beyond TileGemmConfig's defaults ("bits" and "scales"
# pick the weight layout, the rest are TileGemmConfig fields).
ROLLOUT_TILES = dict(stack_operands=True, bits=kernel_backend.DEFAULT_W4A4_BITS,
                     scales=kernel_backend.DEFAULT_W4A4_SCALE_DTYPE)
# (name, TileGemmConfig overrides): the grouped tile kernel alone at the decode step's shapes.
GROUPED_VARIANTS = (
    ("base", {}),
    ("mma_k 64", dict(mma_k=64)),
    ("mma_overlap=1", dict(mma_overlap=1, mma_k=64)),
    ("stages 2", dict(max_concurrent_steps=2)),
    ("n_group 2", dict(n_group=2)),
    ("stacked", dict(stack_operands=True)),
    ("stacked overlap1", dict(stack_operands=True, mma_overlap=1, mma_k=64)),
    ("mma_k 128", dict(mma_k=128)),
    ("mma_k 256", dict(mma_k=256)),
    ("stacked k128", dict(stack_operands=True, mma_k=128)),
    ("stacked k256", dict(stack_operands=True, mma_k=256)),
    ("stacked k128 overlap1", dict(stack_operands=True, mma_k=128, mma_overlap=1)),
    ("signs_high", dict(bits="signs_high")),
    ("stacked signs_high", dict(stack_operands=True, bits="signs_high")),
    ("unchained", dict(chain_items=False)),
    ("ablate no_decode", dict(ablation="no_decode")),
    ("ablate one_mma", dict(ablation="one_mma", mma_k=64)),
    ("ablate no_compute", dict(ablation="no_compute")),
    # The rollout's defaults (stacked RAC operands, "signs_high" words, E4M3 scales, mma_k 256)
    # and the same with one part swapped out: where the default kernel's time goes.
    ("default", ROLLOUT_TILES),
    ("default no_decode", dict(ROLLOUT_TILES, ablation="no_decode")),
    ("default no_compute", dict(ROLLOUT_TILES, ablation="no_compute")),
    ("default mma_k 64", dict(ROLLOUT_TILES, mma_k=64)),
    ("default one_mma", dict(ROLLOUT_TILES, mma_k=64, ablation="one_mma")),
    ("default n_group 2", dict(ROLLOUT_TILES, n_group=2)),
    ("default n_group 4", dict(ROLLOUT_TILES, n_group=4)),
    # The epilogue's copies waited for when their staging buffer is next written (one or two
    # buffers), not at once (session 39).
    ("default store1", dict(ROLLOUT_TILES, store_buffers=1)),
    ("default store2", dict(ROLLOUT_TILES, store_buffers=2)),
    ("default n_group 2 store2", dict(ROLLOUT_TILES, n_group=2, store_buffers=2)),
    # Two compute warpgroup pairs, one per weight-row tile of a 2-tile item (session 40): twice
    # the warps decoding and issuing wgmmas per SM, 104 registers each (mma_k 256 holds the
    # decoded step in 64 of them; 128 / 64 in 32 / 16).
    ("default wg4", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4)),
    ("default wg4 mma_k 128", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, mma_k=128)),
    ("default wg4 mma_k 64", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, mma_k=64)),
    ("default wg4 n_group 4", dict(ROLLOUT_TILES, n_group=4, compute_wgs=4, mma_k=128)),
    # RAC's gate_up was slower on two pairs (H200, 191e654: 89.9 -> 93.8 us at mma_k 128) while
    # plain calls gained 22-27 %: its stacked N = 32 accumulator (16 registers of 104), or
    # two N = 16 ones?
    ("default wg4 unstacked", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, mma_k=128,
                                   stack_operands=False)),
    ("default wg4 store2", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, mma_k=128,
                                store_buffers=2)),
    # The copy warpgroup at 24 registers instead of 40: the compute warpgroups of two pairs get
    # 112 instead of 104. At 104 ptxas serialized the RAC kernels' wgmmas for want of
    # registers and spilled (H100, bd982e0, mma_k 256; the plain kernels spilled less and kept
    # their wgmmas async); mma_k 128 / 64 hold 32 / 48 fewer decoded registers.
    ("default wg4 mem24", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, memory_registers=24)),
    ("default wg4 mma_k 128 mem24", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, mma_k=128,
                                         memory_registers=24)),
    ("default wg4 mma_k 64 mem24", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, mma_k=64,
                                        memory_registers=24)),
    # The same tiles (experts, weight bytes) with 32 token rows each instead of the decode
    # step's 16: every wgmma N = 32 without RAC (64 with its stacked operand). If the plain
    # call at N = 32 costs what RAC's stacked one does at 16 + 16, the tensor cores' time for
    # N, not RAC's extra copies or registers, is what RAC adds (results right for the rows).
    ("default rows32", dict(ROLLOUT_TILES, tile_rows=32)),
    ("default wg4 rows32", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, tile_rows=32)),
    ("default wg4 mem24 rows32", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4,
                                      memory_registers=24, tile_rows=32)),
    # ... and with 8 rows each: wgmma N = 8, 16 with RAC's stacked operand (the plain call's
    # N). If RAC's call at 8 + 8 costs what the plain one does at 16, narrowing the tiles that
    # hold at most 8 tokens (most of the decode step's, ~8 tokens per expert) would pay.
    ("default wg4 rows8", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, tile_rows=8)),
    ("default wg4 mem24 rows8", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4,
                                     memory_registers=24, tile_rows=8)),
    # ``narrow_tiles``: tiles of 16 rows of which ~60 % hold at most 8 (the decode step's share
    # at ~8 tokens per expert) multiplied at N = 8 (8 + 8 with RAC's stacked operand); the
    # kernel holds both accumulator sets' code. `nrows`'s rows8 rows are its bound.
    ("default narrow", dict(ROLLOUT_TILES, narrow_tiles=True, narrow_frac=0.6)),
    ("default wg4 narrow", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, narrow_tiles=True,
                                narrow_frac=0.6)),
    ("default wg4 mem24 narrow", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4,
                                      memory_registers=24, narrow_tiles=True, narrow_frac=0.6)),
    ("default wg4 mem24 narrow0", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4,
                                       memory_registers=24, narrow_tiles=True, narrow_frac=0.0)),
    # RAC's second operand's wgmmas left out (unstacked operands, wrong results): if they are
    # what bounds RAC's calls, issuing them only for the expert's selected K blocks (half of
    # them at ratio 0.5: the rest multiply zeros) would pay.
    ("default unstacked", dict(ROLLOUT_TILES, stack_operands=False)),
    ("default unstacked no_second_mma", dict(ROLLOUT_TILES, stack_operands=False,
                                             ablation="no_second_mma")),
    ("default wg4 unstacked no_second_mma", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4,
                                                 mma_k=128, stack_operands=False,
                                                 ablation="no_second_mma")),
    # ... and issued only for a random half of each expert's K blocks (``residual_blocks``,
    # RAC's selection at ratio 0.5; right results where the residual is zero elsewhere, so no
    # GPU check here: `default unstacked selected` checks the grouped matmul's path).
    ("default unstacked keep50", dict(ROLLOUT_TILES, stack_operands=False, rac_keep=0.5)),
    ("default wg4 unstacked keep50", dict(ROLLOUT_TILES, n_group=2, compute_wgs=4, mma_k=128,
                                          stack_operands=False, rac_keep=0.5)),
    # The grouped matmul with RAC's selection passed to the kernel (check only: the kernel
    # alone has no selection; `keep50` times it).
    ("default unstacked selected", dict(ROLLOUT_TILES, stack_operands=False,
                                        rac_selected_wgmmas=True)),
    # float16 block scales (0.625 streamed bytes per weight; the default until session 39,
    # which made the format's E4M3 bytes, 0.5625, the default: layout.E4M3).
    ("default f16 scales", dict(ROLLOUT_TILES, scales=None)),
    ("default f16 no_compute", dict(ROLLOUT_TILES, scales=None, ablation="no_compute")),
)


def variant_fields(kw: dict, block_m: int) -> tuple[tuple[str, str | None], int, float | None,
                                                     float | None, dict]:
    """A ``GROUPED_VARIANTS`` entry's probe-level fields split from its ``TileGemmConfig``
    ones: the weight layout (word bits, scale dtype), the token rows per tile (``block_m``
    unless ``tile_rows``), the random residual-block fraction (``rac_keep``, or None), the
    fraction of tiles laid out as narrow windows (``narrow_frac``, or None: gathered tiles) and
    the remaining config fields."""
    kw = dict(kw)
    layout = (kw.pop("bits", "nibbles"), kw.pop("scales", None))
    return (layout, kw.pop("tile_rows", block_m), kw.pop("rac_keep", None),
            kw.pop("narrow_frac", None), kw)


def narrow_windows(operands, frac: float, seed: int, live: int):
    """Gathered tiles ``[T, rows, Kp]`` as ``TokenTiles`` windows whose tiles hold ``rows / 2``
    live rows with probability ``frac`` (the next window starts ``rows / 2`` on: what
    ``TileGemmConfig.narrow_tiles`` multiplies at N = ``rows / 2``), else ``rows``; and the
    share of the ``live`` tiles the kernel multiplies narrow (the last live one never is)."""
    from pallas_kernels.token_tiles import TokenTiles

    t, rows, k = operands[0].shape
    narrow = np.random.default_rng(seed).random(t) < frac
    stride = np.where(narrow, rows // 2, rows)
    row0 = np.concatenate([[0], np.cumsum(stride)[:-1]]).astype(np.int32)
    length = int(row0[-1]) + rows
    flat = tuple(b.reshape(t * rows, k)[:length] for b in operands)
    return TokenTiles(flat, jnp.asarray(row0), rows), float(narrow[:live - 1].sum() / live)


def residual_block_bits(experts: int, k_pad: int, fraction: float, seed: int) -> jax.Array:
    """A random ``fraction`` of each matrix's 16-column K blocks, as int32 ``[experts,
    ceil(k_pad / 512)]`` bit words (``nvfp4_tile_gemm``'s ``residual_blocks`` per tile: index
    by the tiles' experts)."""
    from pallas_kernels.w4a4_matmul import pack_block_bits

    keep = np.random.default_rng(seed).random((experts, k_pad // 16)) < fraction
    return pack_block_bits(jnp.asarray(keep), k_pad)


def run_grouped_ablations(tokens: int = 128, variants: tuple[str, ...] | None = None,
                          checks: tuple[str, ...] = ()):
    """Where the grouped tile kernel's time goes at a decode step of ``tokens`` sequences
    (top-8 of 128 experts): the Mosaic kernel alone (its token tiles pre-made), traced device
    time per call, for each ``GROUPED_VARIANTS`` entry with and without RAC's second operand,
    gate_up (N=1536, K=2048) and down (N=2048, K=768); our FP8 kernel on the same tiles first,
    as the reference (same schedule, no decode, 1.78x the streamed bytes): each W4A4 row's note
    gives "vs fp8 rate", the format's bytes at the FP8 kernel's streaming rate over its time.
    The ablations' results are wrong by design (time attribution only). ``variants``: the
    names to time (None: all; "fp8 store2" adds our FP8 kernel with ``store_buffers=2``);
    ``checks``: variants whose whole grouped matmul is first checked on fresh inputs against
    the float64 product of the dequantized operands (``bench_kernels.check``). An unknown
    name raises ``ValueError`` before anything runs."""
    from pallas_kernels.fp8_tiles_mgpu import FP8GemmConfig, fp8_tile_gemm
    from pallas_kernels.nvfp4_tiles_mgpu import K_TILE, N_TILE, _num_sms
    from pallas_kernels.w4a4_grouped import expected_tiles, grouped_block_m, tile_plan
    from pallas_kernels.w4a4_matmul import auto_k_splits
    from quads_jax.quant import fp8

    known = {v for v, _ in GROUPED_VARIANTS} | {"fp8 store2"}
    if unknown := sorted(set(variants or ()) - known) + sorted(set(checks) - known):
        raise ValueError(f"unknown grouped variant(s) {unknown}; one of {sorted(known)}")
    if kernel_only := [v for v in checks if {"rac_keep", "tile_rows", "narrow_frac"}
                       & set(dict(GROUPED_VARIANTS)[v])]:
        raise ValueError(f"grouped variant(s) {kernel_only}: the kernel alone (rac_keep, "
                         "tile_rows, narrow_frac), no grouped matmul to check")
    if check_only := [v for v in variants or () if "rac_selected_wgmmas" in
                      dict(GROUPED_VARIANTS)[v]]:
        raise ValueError(f"grouped variant(s) {check_only}: the grouped matmul's selection "
                         "(check only; the kernel alone is timed by the keep50 variants)")
    gs = bk.routing(128, tokens, GE, 8)
    m = int(gs.sum())
    touched = int((np.asarray(gs) > 0).sum())
    block_m = grouped_block_m(m, GE)
    row_index, te, nt, *_ = tile_plan(gs, m, block_m)
    t_max, live = row_index.shape[0], expected_tiles(m, GE, block_m)
    sms = _num_sms()
    bk.log(f"== grouped tile kernel alone: rows={m} experts={touched} block_m={block_m} "
           f"tiles={int(nt[0])} of {t_max}")

    for v in checks:
        # (tile_rows / rac_keep / narrow_frac variants were refused above)
        (bits, scales), _, _, _, kw = variant_fields(dict(GROUPED_VARIANTS)[v], block_m)
        if "memory_registers" in kw:  # the grouped matmul's field for two-pair calls
            kw["wide_memory_registers"] = kw.pop("memory_registers")
        cfg = W4A4MatmulConfig(**kw)
        for n, k, name in ((2 * GN, GK, "gate_up"), (GK, GN, "down")):
            wq, ww = weights(940 + n, (GE, n, k), "subnormal", bits, scales)
            x = bk.rand(941, (m, k), jnp.float32)  # f32 output: the check sees the f32 sums
            for r in (None, aq.RACConfig()):
                bk.check(f"grouped {name} {v}{' +RAC' if r else ''} rows={m}",
                         jax.jit(lambda x=x, ww=ww, r=r, cfg=cfg: w4a4_grouped_matmul(
                             x, ww, gs, rac=r, config=cfg)),
                         lambda x=x, wq=wq, r=r: bk.deq_ref(x, wq, r, gs), (m, n))

    def traced(f, *args, tag):
        def run():
            for _ in range(8):
                jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
        return traced_kernels(lambda: run(), tag=tag)

    def fp8_rate(n: int, k: int, name: str, cs, buffers=(0,)) -> float | None:
        """Our FP8 kernel on the same tiles, once per ``store_buffers`` value in ``buffers``:
        the first one's streamed bytes per second (the achievable rate of this machine in this
        call; the untraced GEMV probe read 1.6-1.7 TB/s on the session-38 H100s, so it is no
        floor), or None if it failed."""
        try:
            w8 = bk.our_fp8_weight(fp8.quantize(bk.rand(920 + n, (GE, n, k), jnp.float32),
                                                granularity="channel"))
            ks = auto_k_splits(live * (w8.n_pad // N_TILE), w8.k_pad // 128, sms)
            b8 = bk.rand(930, (t_max, block_m, w8.k_pad)).astype(jnp.float8_e4m3fn)
            rates = []
            for sb in buffers:
                f = jax.jit(lambda bt, w, ks=ks, sc=cs[:, :1], sb=sb: fp8_tile_gemm(
                    (bt,), w, te, nt, config=FP8GemmConfig(k_splits=ks, store_buffers=sb),
                    col_scales=sc, out_dtype=jnp.bfloat16 if ks == 1 else jnp.float32))
                tag = f" store_buffers={sb}" if sb else ""
                us, count, busy = traced(f, b8, w8, tag=f"{name}_fp8{tag.replace(' ', '_')}")
                rates.append(touched * n * k / (us * 1e-6))
                bk.record(f"grouped {name} FP8 tile kernel ks={ks}{tag}", us * 1e-6, count,
                          bytes_=touched * n * k,
                          note=f"busy {busy:.2f} {rates[-1] / 1e12:.2f} TB/s")
            return rates[0]
        except Exception as err:  # noqa: BLE001
            bk.log(f"  grouped {name} FP8 tile kernel FAILED: {type(err).__name__}: "
                   f"{str(err)[:300]}")
            return None

    fp8_buffers = (0, 2) if variants is not None and "fp8 store2" in variants else (0,)
    for n, k, name in ((2 * GN, GK, "gate_up"), (GK, GN, "down")):
        cs = jnp.ones((t_max, 2, block_m), jnp.float32)
        rate = fp8_rate(n, k, name, cs, fp8_buffers)
        wq, ww = weights(900 + n, (GE, n, k), "subnormal")
        by_bits = {("nibbles", None): ww}
        b_by_rows = {}  # token rows per tile -> (B operands, column scales)
        nbytes = touched * n * k * 0.5625  # the format's bytes, whatever the layout streams
        for v, kw in GROUPED_VARIANTS:
            if variants is not None and v not in variants:
                continue
            layout, rows, keep, narrow_frac, kw = variant_fields(kw, block_m)
            if rows not in b_by_rows:
                b_by_rows[rows] = (
                    [bk.rand(910 + a, (t_max, rows, ww.k_pad), jnp.float16) for a in range(2)],
                    jnp.ones((t_max, 2, rows), jnp.float32))
            b, cs = b_by_rows[rows]
            if layout not in by_bits:  # the same weight, other word bits or scale dtype
                by_bits[layout] = prepare_w4a4_weights(
                    wq, mma_dtype="float16", decode="subnormal", bits=layout[0],
                    scale_dtype=layout[1])
            ww = by_bits[layout]
            for a in (1, 2):
                ng = kw.get("n_group", 1)
                ks = auto_k_splits(live * (ww.n_pad // N_TILE // ng), ww.k_pad // K_TILE, sms)
                label = f"grouped {name} tile kernel {v}{' +RAC' if a == 2 else ''} ks={ks}"
                try:
                    cfg = TileGemmConfig(k_splits=ks, decode_impl="ptx", **kw)
                    rb = None if keep is None or a == 1 else residual_block_bits(
                        GE, ww.k_pad, keep, seed=950 + n)[te]  # each tile its expert's
                    f = jax.jit(lambda bt, w, cfg=cfg, sc=cs[:, :a], ks=ks, rb=rb:
                                nvfp4_tile_gemm(bt, w, te, nt, config=cfg, col_scales=sc,
                                                out_dtype=jnp.bfloat16 if ks == 1
                                                else jnp.float32, residual_blocks=rb))
                    bt, narrow_note = tuple(b[:a]), ""
                    if narrow_frac is not None:
                        bt, share = narrow_windows(bt, narrow_frac, seed=960 + n,
                                                   live=int(nt[0]))
                        narrow_note = f" narrow {share:.2f} of the tiles"
                    us, count, busy = traced(f, bt, ww, tag=f"{name}_{a}")
                    # vs fp8: the format's bytes at our FP8 kernel's rate over this time.
                    vs = "" if rate is None else f" vs fp8 rate {nbytes / rate / (us * 1e-6):.2f}"
                    bk.record(label, us * 1e-6, count, bytes_=nbytes,
                              note=f"busy {busy:.2f}{vs}{narrow_note}")
                except Exception as err:  # noqa: BLE001
                    bk.log(f"  {label} FAILED: {type(err).__name__}: {str(err)[:300]}")
        del ww, by_bits, b


def run_dump():
    """Compile (and run once) three variants, so MOSAIC_GPU_DUMP_* writes their PTX/SASS."""
    b = jnp.ones((1, M, K), jnp.float16)
    for name, decode, kw in (("jnp normal", "normal", {}), ("ptx", "subnormal",
                             {"decode_impl": "ptx"}), ("no_decode", "normal",
                                                       {"ablation": "no_decode"})):
        w = weights(1, (N, K), decode)[1]
        t0 = time.time()
        jax.block_until_ready(jax.jit(tile_op(TileGemmConfig(**kw)))(b, w))
        bk.log(f"compiled {name} in {time.time() - t0:.1f} s")


RAC_SELECT_VARIANTS = (  # (block_rows, num_warps, exact_division)
    (32, 4, False), (16, 4, False), (64, 4, False), (32, 2, False), (32, 4, True))


def run_rac_select():
    """The RAC selection kernel at the decode step's shapes (1 024 GEMM rows over 128 experts,
    top-8 of 128 tokens for gate_up's K/16 = 128 blocks; 1 024 distinct rows for down's 48),
    with uniform and skewed routing and a token mask: per ``RAC_SELECT_VARIANTS``, the rows
    whose selection equals the jnp path's (summation orders may differ in a last bit) and how
    many coded amax / decode scales differ on those rows on the GPU, then traced device time
    per call of the kernel and of the jnp path's kernels. First: whether XLA:GPU's float32
    ``1 / x`` is the correctly rounded one (against numpy)."""
    from pallas_kernels import rac_select as rs

    bk.log("== RAC selection kernel (pallas_kernels.rac_select) vs the jnp path")
    x = np.exp(np.random.default_rng(0).normal(size=1 << 20) * 8).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: 1.0 / v)(jnp.asarray(x)))
    bk.log(f"  XLA:GPU 1/x differs from IEEE (numpy) on {np.mean(got != 1 / x):.2e} of values")
    for name, r, nb in (("gate_up", 128, 128), ("down", 1024, 48)):
        for skew in (0.0, 1.5):
            k = jax.random.split(jax.random.key(nb), 6)
            logits = jax.random.normal(k[4], (128,)) * skew
            ids = jax.random.categorical(k[0], logits, shape=(1024,))
            order = jnp.argsort(ids, stable=True)
            gs = jnp.bincount(ids, length=128).astype(jnp.int32)
            rows = (order // 8 if r == 128 else order).astype(jnp.int32)
            scores = jnp.exp(jax.random.normal(k[1], (r, nb)))
            amax = jnp.exp(jax.random.normal(k[2], (r, nb))) * 0.1
            finite = (jax.random.uniform(k[3], (r, nb)) > 0.01).astype(jnp.int8)
            valid = jax.random.uniform(k[5], (r,)) > 0.05
            args = (scores, amax, finite, rows, gs, valid)
            ref = jax.jit(lambda *a: rs.grouped_rac_selection_reference(
                *a[:5], ratio=0.5, row_valid=a[5]))
            want = [np.asarray(a) for a in jax.device_get(ref(*args))]
            case = f"{name} skew {skew} (largest group {int(gs.max())})"
            us, count, _ = traced_kernels(ref, *args, match="", tag=f"rsel_{name}_jnp")
            bk.log(f"  rac_select {case} jnp {us * count:7.1f} us in {count} kernels")
            for br, nw, exact in RAC_SELECT_VARIANTS:
                cfg = rs.RACSelectConfig(block_rows=br, num_warps=nw, exact_division=exact)
                kern = jax.jit(lambda *a, cfg=cfg: rs.grouped_rac_selection(
                    *a[:5], ratio=0.5, row_valid=a[5], config=cfg))
                out = [np.asarray(a) for a in jax.device_get(kern(*args))]
                same = np.all((out[0] < 0) == (want[0] < 0), axis=1)
                diffs = [int(np.sum(~np.isclose(a[same], b[same], rtol=0, atol=0,
                                                equal_nan=True)))
                         for a, b in zip(out, want, strict=True)]
                us, _, _ = traced_kernels(kern, *args, match="rac", tag=f"rsel_{name}_{br}")
                bk.log(f"  rac_select {case} br {br} warps {nw} exact {exact}: {us:6.1f} us; "
                       f"selections equal {same.mean():.4f}; differing coded/g {diffs}")


def run_slot_sort():
    """The slot-sort kernel (``pallas_kernels.slot_sort``) at the decode step's shapes (top-8
    of 128 experts for 128 and 256 tokens; uniform and skewed routing): GPU equality
    with ``moe.sort_slots``' jnp path (order, inverse, counts), then the traced device time of
    the kernel and of the jnp path's kernels, per block size."""
    from pallas_kernels import slot_sort as ss
    from quads_jax.models.moe import sort_slots

    bk.log("== slot-sort kernel (pallas_kernels.slot_sort) vs the jnp path")
    for tokens in (128, 256):
        for skew in (0.0, 1.5):
            k = jax.random.split(jax.random.key(tokens), 2)
            logits = jax.random.normal(k[1], (GE,)) * skew
            ids = jax.random.categorical(k[0], logits, shape=(tokens * 8,)).astype(jnp.int32)
            ref = jax.jit(lambda i: sort_slots(i, GE))
            want = [np.asarray(a) for a in ref(ids)]
            case = f"{tokens} tokens skew {skew}"
            us, count, _ = traced_kernels(ref, ids, match="", tag=f"ssort_{tokens}_jnp")
            bk.log(f"  slot_sort {case} jnp {us * count:6.1f} us in {count} kernels")
            for block, warps in ((16, 4), (8, 4)):
                cfg = ss.SlotSortConfig(block=block, num_warps=warps)
                kern = jax.jit(lambda i, cfg=cfg: ss.slot_sort(i, GE, config=cfg))
                got = [np.asarray(a) for a in kern(ids)]
                equal = all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
                us, _, _ = traced_kernels(kern, ids, match="slot_sort",
                                          tag=f"ssort_{tokens}_{block}")
                bk.log(f"  slot_sort {case} block {block} warps {warps}: "
                       f"{us:5.1f} us; {'EQUAL' if equal else 'DIFFERENT (FAIL)'}")


def decode_operand_cases(tokens: int):
    """The decode step's two grouped GEMMs (``tokens`` top-8 over 128 experts, uniform
    routing): ``(name, K, x [R, K] bf16, source_rows or None, expert of each sorted row,
    window_rows)`` for gate_up (distinct token rows) and down (one row per GEMM row)."""
    from pallas_kernels.w4a4_grouped import tile_plan

    rows = tokens * 8
    for name, k, distinct in (("gate_up", 2048, True), ("down", 768, False)):
        ks = jax.random.split(jax.random.key(k), 2)
        ids = jax.random.randint(ks[0], (rows,), 0, GE)
        order = jnp.argsort(ids, stable=True)
        gs = jnp.bincount(ids, length=GE).astype(jnp.int32)
        src = (order // 8).astype(jnp.int32) if distinct else None
        x = jax.random.normal(ks[1], (tokens if distinct else rows, k), jnp.bfloat16)
        *_, window = tile_plan(gs, rows, 16)
        yield name, k, x, src, jnp.sort(ids).astype(jnp.int32), window


def check_and_time_window_kernel(kernel: str, label: str, kern, x, window, want,
                                 rows=None, program: str = "program"):
    """One variant of a window-operand kernel (``rac_operands`` / ``act_operands``): bit-identity
    of ``kern(x, window)`` with the jnp path's ``want`` (on the window rows ``rows`` only, when
    given), then the traced device time of the whole program and of the kernel alone against
    its floor: its write (the distinct rows it reads are small and stay in L2) at the GEMV
    probe's read bandwidth (``bk.measure_floors``, same run)."""
    got = np.asarray(kern(x, window))
    cmp = (Ellipsis, slice(None), slice(None)) if rows is None else (Ellipsis, rows, slice(None))
    diff = int(np.sum(got[cmp].view(np.uint16) != want[cmp].view(np.uint16)))
    bk.log(f"  {'PASS' if diff == 0 else 'FAIL'} {kernel} {label}: {diff} of {got[cmp].size} "
           "values differ from the jnp path")
    tag = f"{kernel}_{label}".replace(" ", "_")
    us_all, count_all, _ = traced_kernels(kern, x, window, match="", tag=f"all_{tag}")
    us_k, _, _ = traced_kernels(kern, x, window, match=kernel, tag=f"k_{tag}")
    floor_us = got.nbytes / bk.RESULTS["floors"].get("read_bw", float("nan")) * 1e6
    bk.log(f"  {kernel} {label}: kernel {us_k:6.1f} us ({got.nbytes / 1e6 / us_k:.2f} TB/s "
           f"written; floor {floor_us:.1f} us, ratio {floor_us / us_k:.2f}); {program} "
           f"{us_all * count_all:7.1f} us in {count_all} kernels")


# (block_rows, num_warps, padding_rows)
RAC_OPERAND_VARIANTS = ((8, 4, "zeros"), (16, 4, "zeros"), (4, 4, "zeros"), (8, 2, "zeros"),
                        (8, 4, "skip"), (4, 4, "skip"))


def run_rac_operands(tokens: int = 128, variants=RAC_OPERAND_VARIANTS):
    """RAC's stacked operands at the decode step's shapes (128 tokens top-8 over 128 experts:
    gate_up's 1 024 GEMM rows from 128 distinct rows, K = 2048; down's 1 024 distinct rows,
    K = 768), uniform routing: the ``rac_operands`` kernel against the jnp path
    (``operand_rows`` without it) -- bit-identity on the GPU, then traced device time of the
    quantizer + operands program each way, and of the kernel alone per
    ``RAC_OPERAND_VARIANTS``."""
    from pallas_kernels import rac_operands as ro
    from pallas_kernels.w4a4_matmul import operand_rows

    bk.log("== RAC stacked operands (pallas_kernels.rac_operands) vs the jnp path")
    interpret = jax.devices()[0].platform != "gpu"  # a CPU smoke run: the Triton interpreter
    rows = tokens * 8
    for name, k, x, src, rexp, window in decode_operand_cases(tokens):

        def program(x, window, kernel, rexp=rexp, src=src, k=k):
            acts = aq.nvfp4_quantize(x, rac_config=aq.RACConfig(), row_expert=rexp,
                                     num_experts=GE, source_rows=src)
            ops_, _ = operand_rows(acts, window, jnp.float16, k, True, kernel, interpret)
            return ops_ if kernel is not None else jnp.stack(ops_)

        ref = jax.jit(lambda x, w: program(x, w, None))
        want = np.asarray(ref(x, window))
        us, count, _ = traced_kernels(ref, x, window, match="", tag=f"rop_{name}_jnp")
        bk.log(f"  rac_operands {name} [2, {window.shape[0]}, {k}]: jnp quantizer + operands "
               f"{us * count:7.1f} us in {count} kernels")
        filled = np.asarray(window) < rows  # "skip" leaves the other rows unwritten
        for br, nw, pad in variants:
            cfg = ro.RACOperandsConfig(block_rows=br, num_warps=nw, padding_rows=pad)
            kern = jax.jit(lambda x, w, cfg=cfg: program(x, w, cfg))
            label = f"{name} br {br}{'' if pad == 'zeros' else ' ' + pad} warps {nw}"
            check_and_time_window_kernel("rac_operands", label, kern, x, window, want,
                                         None if pad == "zeros" else filled,
                                         "quantizer + operands")


# (block, num_warps) of pallas_kernels.tile_plan
TILE_PLAN_VARIANTS = ((16, 4), (16, 2), (8, 2), (8, 1), (32, 4))


def run_tile_plan(variants=TILE_PLAN_VARIANTS):
    """The token-tile plan at the decode steps' shapes (top-8 of 128 experts; 32 / 128 / 256
    tokens: 256 / 1 024 / 2 048 GEMM rows, uniform routing): ``pallas_kernels.tile_plan``
    against the jnp plan (``plan_and_row_experts`` without it) -- equality on the GPU, then the
    traced device time and kernel count of each program."""
    from pallas_kernels import tile_plan as tp
    from pallas_kernels.w4a4_grouped import grouped_block_m, plan_and_row_experts

    bk.log("== token-tile plan (pallas_kernels.tile_plan) vs the jnp plan")
    interpret = jax.devices()[0].platform != "gpu"  # a CPU smoke run: the Triton interpreter
    for tokens in (32, 128, 256):
        m = tokens * 8
        ids = jax.random.randint(jax.random.key(tokens), (m,), 0, GE)
        gs = jnp.bincount(ids, length=GE).astype(jnp.int32)
        bm = grouped_block_m(m, GE)
        ref = jax.jit(lambda gs, m=m, bm=bm: plan_and_row_experts(gs, m, bm))
        want = [np.asarray(a) for a in ref(gs)]
        us, count, _ = traced_kernels(ref, gs, match="", tag=f"plan_jnp_{tokens}")
        bk.log(f"  tile_plan {tokens} tokens (M={m}, block_m {bm}): jnp plan {us * count:6.1f} "
               f"us in {count} kernels")
        for block, nw in variants:
            cfg = tp.TilePlanConfig(block=block, num_warps=nw)
            kern = jax.jit(lambda gs, m=m, bm=bm, cfg=cfg: tp.tile_plan_kernel(
                gs, m, bm, config=cfg, interpret=interpret))
            got = [np.asarray(a) for a in kern(gs)]
            diff = sum(int(np.sum(a != b)) for a, b in zip(got, want, strict=True))
            bk.log(f"  {'PASS' if diff == 0 else 'FAIL'} tile_plan {tokens} tokens block {block} "
                   f"warps {nw}: {diff} entries differ from the jnp plan")
            us_k, count_k, _ = traced_kernels(kern, gs, match="", tag=f"plan_{tokens}_{block}")
            bk.log(f"  tile_plan {tokens} tokens block {block} warps {nw}: "
                   f"{us_k * count_k:6.1f} us in {count_k} kernels")


def check_e2m1_rounding():
    """``nvfp4.round_to_e2m1_value`` (the activation kernels' rounding: add and subtract of
    powers of two) against the decision-point ladder of ``round_to_e2m1_code`` and its table,
    both jitted for this device, on every float32 from 2^-30 to 16 at a stride of 2^7 ulps,
    both signs, and the non-finite values: bit-identity (a compiler that reassociated the add
    and subtract would fail it)."""
    lo, hi = np.float32(2.0**-30).view(np.int32), np.float32(16.0).view(np.int32)
    sweep = np.arange(lo, hi, 1 << 7, dtype=np.int32).view(np.float32)
    y = jnp.asarray(np.concatenate([sweep, -sweep, [np.inf, -np.inf, np.nan, 0.0, -0.0]])
                    .astype(np.float32))
    got = np.asarray(jax.jit(nvfp4.round_to_e2m1_value)(y)).view(np.uint32)
    want = np.asarray(jax.jit(lambda v: nvfp4.e2m1_code_to_float(
        nvfp4.round_to_e2m1_code(v)))(y)).view(np.uint32)
    diff = int(np.sum(got != want))
    bk.log(f"  {'PASS' if diff == 0 else 'FAIL'} round_to_e2m1_value vs the code ladder on "
           f"{jax.devices()[0].platform}: {diff} of {got.size} differ")


def _e2m1_ladder(y):
    """The E2M1 value rounding before session 30 (seven compares, selects and adds)."""
    mag = jnp.abs(y)
    val = jnp.zeros(y.shape, jnp.float32)
    for t, inclusive, step in nvfp4._E2M1_STEPS:
        val = val + jnp.where((mag >= t) if inclusive else (mag > t), jnp.float32(step), 0.0)
    return jnp.where((y < 0) & (val > 0), -val, val)


def _plain_scales(amax_b, finite, g):
    """A block scale without the exact E4M3 rounding and divisions (timing ablation only)."""
    s = jnp.where(finite, amax_b * (1.0 / 6.0), jnp.nan)
    return s, jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)


# Timing ablations of the activation kernels' arithmetic (run_act_ablations): which nvfp4
# function each replaces. Not bit-identical (except "ladder"): times only.
ACT_ABLATIONS = {
    "base": {},
    "ladder rounding": {"round_to_e2m1_value": _e2m1_ladder},
    "no rounding": {"round_to_e2m1_value": lambda y: y},
    "plain scales": {"block_scales_f32_from_amax": _plain_scales},
    "plain scales, no rounding": {"block_scales_f32_from_amax": _plain_scales,
                                  "round_to_e2m1_value": lambda y: y},
    "copy": {"unscaled_block_values": lambda xb, g: xb},
}


def run_act_ablations(rows: int = 8192):
    """Where the activation kernels' time goes: ``act_operands`` (decode gate_up windows from
    128 rows, and ``rows`` prefill rows without source rows, K = 2048) and ``rac_rows`` (the
    same prefill rows) with parts of the quantizer's arithmetic swapped out
    (``ACT_ABLATIONS``): traced kernel time, and the bytes it moves per us against the run's
    read bandwidth."""
    from pallas_kernels import act_operands as ao
    from pallas_kernels import rac_rows as rr
    from pallas_kernels.w4a4_grouped import grouped_block_m, tile_plan

    bk.log("== activation kernels' arithmetic ablations (timings only)")
    interpret = jax.devices()[0].platform != "gpu"
    _, k, xd, srcd, _, windowd = next(decode_operand_cases(128))
    ids = jnp.sort(jax.random.randint(jax.random.key(3), (rows,), 0, GE)).astype(jnp.int32)
    xp = jax.random.normal(jax.random.key(4), (rows, k), jnp.bfloat16)
    *_, windowp = tile_plan(jnp.bincount(ids, length=GE).astype(jnp.int32), rows,
                            grouped_block_m(rows, GE))
    cases = (("act_operands decode", "act_operands", xd, srcd, windowd),
             ("act_operands prefill", "act_operands", xp, None, windowp),
             ("rac_rows prefill", "rac_rows", xp, None, None))
    bw = bk.RESULTS["floors"].get("read_bw", float("nan"))
    saved = {name: getattr(nvfp4, name) for v in ACT_ABLATIONS.values() for name in v}
    for label, patch in ACT_ABLATIONS.items():
        for name, fn in patch.items():
            setattr(nvfp4, name, fn)
        try:
            jax.clear_caches()
            for case, kname, x, src, window in cases:
                g = ao.row_decode_scales(x)
                if window is None:
                    fn = jax.jit(lambda x, g: rr.rac_row_pass(
                        x, g, interpret=interpret, with_residual=False))
                    args = (x, g)
                    nbytes = x.size * 2 * 2 + x.size // 16 * 12
                else:
                    fn = jax.jit(lambda x, g, w, src=src: ao.act_window_operand(
                        x, g, w, src, k_pad=k, interpret=interpret))
                    args = (x, g, window)
                    nbytes = x.size * 2 + window.shape[0] * k * 2
                us, _, _ = traced_kernels(fn, *args, match=kname,
                                          tag=f"abl_{label}_{case}".replace(" ", "_"))
                floor = nbytes / bw * 1e6
                bk.log(f"  {case:22s} {label:26s} {us:7.1f} us  ({nbytes / 1e6:6.1f} MB: floor "
                       f"{floor:6.1f} us, ratio {floor / us:.2f})")
        finally:
            for name, fn in saved.items():
                setattr(nvfp4, name, fn)
    jax.clear_caches()


def run_act_operands(tokens: int = 128, variants=RAC_OPERAND_VARIANTS[:4]):
    """Plain W4A4's windowed operand at the decode step's shapes (as ``run_rac_operands``,
    per-token scales, no RAC): ``pallas_kernels.act_operands`` against the jnp quantizer +
    gather -- bit-identity on the GPU, then the traced device time of each program and of the
    kernel alone."""
    from pallas_kernels import act_operands as ao

    bk.log("== plain W4A4 operand (pallas_kernels.act_operands) vs the jnp path")
    check_e2m1_rounding()
    interpret = jax.devices()[0].platform != "gpu"
    for name, k, x, src, _, window in decode_operand_cases(tokens):
        ref = jax.jit(lambda x, w, src=src, k=k: ao.act_window_operand_reference(
            x, w, src, k_pad=k))
        want = np.asarray(ref(x, window))
        us, count, _ = traced_kernels(ref, x, window, match="", tag=f"aop_{name}_jnp")
        bk.log(f"  act_operands {name} [{window.shape[0]}, {k}]: jnp quantizer + operand "
               f"{us * count:7.1f} us in {count} kernels")
        for br, nw, pad in variants:
            cfg = ao.ActOperandsConfig(block_rows=br, num_warps=nw, padding_rows=pad)
            kern = jax.jit(lambda x, w, cfg=cfg, src=src, k=k: ao.act_window_operand(
                x, ao.row_decode_scales(x), w, src, k_pad=k, config=cfg, interpret=interpret))
            check_and_time_window_kernel("act_operands", f"{name} br {br} warps {nw}", kern, x,
                                         window, want)


def run_rac_rows(tokens: int = 128):
    """RAC's row pass at the decode step's shapes (gate_up: 128 distinct rows, K = 2048; down:
    1 024 rows, K = 768): ``pallas_kernels.rac_rows`` against the jnp quantizer and residual
    passes -- bit-identity of every output on the GPU (the scores to their summation order),
    then the traced RAC quantizer + selection + operands program each way (``nvfp4_quantize``
    and ``operand_rows`` with and without ``row_pass``)."""
    from pallas_kernels import rac_rows as rr
    from pallas_kernels.w4a4_matmul import operand_rows

    bk.log("== RAC row pass (pallas_kernels.rac_rows) vs the jnp path")
    interpret = jax.devices()[0].platform != "gpu"
    row_pass = W4A4MatmulConfig().rac_row_pass(interpret)
    for name, k, x, src, rexp, window in decode_operand_cases(tokens):
        want, g = jax.jit(rr.rac_row_pass_reference)(x)
        got = jax.jit(lambda x, g: rr.rac_row_pass(x, g, interpret=interpret))(x, g)
        for field, a, b in zip(want._fields, got, want, strict=True):
            a, b = np.asarray(a), np.asarray(b)
            bits = a.view(np.uint16 if a.itemsize == 2 else np.uint32) if a.dtype != bool else a
            ref = b.view(bits.dtype) if a.dtype != bool else b
            diff = int(np.sum(bits != ref))
            with np.errstate(invalid="ignore"):  # inf - inf in the NaN / inf blocks
                rel = float(np.nanmax(np.abs(a.astype(np.float64) - b)
                                      / np.maximum(np.abs(b), 1e-30))) if a.dtype != bool else 0.0
            ok = diff == 0 or (field == "scores" and rel < 1e-6)
            bk.log(f"  {'PASS' if ok else 'FAIL'} rac_rows {name} {field}: {diff} of {a.size} "
                   f"differ (max rel {rel:.1e})")

        def program(x, window, rp, rexp=rexp, src=src, k=k):
            acts = aq.nvfp4_quantize(x, rac_config=aq.RACConfig(), row_expert=rexp,
                                     num_experts=GE, source_rows=src, row_pass=rp)
            return operand_rows(acts, window, jnp.float16, k, True,
                                W4A4MatmulConfig().rac_operands_config(), interpret)[0]

        outs = {}
        for label, rp in (("jnp", None), ("kernel", row_pass)):
            fn = jax.jit(lambda x, w, rp=rp: program(x, w, rp))
            outs[label] = np.asarray(fn(x, window))
            us, count, _ = traced_kernels(fn, x, window, match="", tag=f"rrows_{name}_{label}")
            bk.log(f"  rac_rows {name}: quantizer + selection + operands ({label}) "
                   f"{us * count:7.1f} us in {count} kernels")
        diff = int(np.sum(outs["jnp"].view(np.uint16) != outs["kernel"].view(np.uint16)))
        bk.log(f"  {'PASS' if diff == 0 else 'FAIL'} rac_rows {name} stacked operands: {diff} of "
               f"{outs['jnp'].size} values differ")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/probe_out")
    p.add_argument("--dump", action="store_true", help="compile 3 variants only (for dumps)")
    p.add_argument("--no-checks", action="store_true")
    p.add_argument("--launch-bound", action="store_true", help="floors + the launch-bound test")
    p.add_argument("--final", action="store_true", help="the BENCHMARKS.md set (run_final)")
    p.add_argument("--attention", action="store_true", help="floors + decode attention")
    p.add_argument("--attention-prefix", action="store_true",
                   help="floors + decode attention with shared prompt caches vs copied")
    p.add_argument("--n-group", action="store_true", help="floors + grouped n_group study")
    p.add_argument("--n-group-shapes", default="gate_up,down")
    p.add_argument("--trace-grouped", action="store_true", help="kernels of a grouped call")
    p.add_argument("--trace-tokens", type=int, default=128,
                   help="--trace-grouped: tokens (top-8); with more than 128, the prefill "
                        "table's shape K x N = 2048 x 768 alone, every kernel listed")
    p.add_argument("--grouped-ablations", action="store_true",
                   help="floors + the grouped tile kernel's variants and ablations, traced")
    p.add_argument("--slot-sort", action="store_true",
                   help="the MoE slot-sort kernel: GPU equality with jnp, traced times")
    p.add_argument("--rac-select", action="store_true",
                   help="the RAC selection kernel: GPU bit-identity with jnp, traced times")
    p.add_argument("--rac-operands", action="store_true",
                   help="RAC's stacked-operand kernel: GPU bit-identity with jnp, traced times")
    p.add_argument("--act-operands", action="store_true",
                   help="plain W4A4's operand kernel: GPU bit-identity with jnp, traced times")
    p.add_argument("--rac-rows", action="store_true",
                   help="floors + RAC's row pass (pallas_kernels.rac_rows) vs the jnp path")
    p.add_argument("--prefill-tiles", action="store_true",
                   help="floors + the grouped prefill matmul's tile-kernel variants, +-RAC")
    p.add_argument("--act-ablations", action="store_true",
                   help="floors + the activation kernels' arithmetic ablations (timings)")
    p.add_argument("--tile-plan", action="store_true",
                   help="the token-tile plan kernel: GPU equality with jnp, traced times")
    p.add_argument("--variants", default=None,
                   help="--grouped-ablations: comma-separated GROUPED_VARIANTS names (all)")
    p.add_argument("--check-variants", default="",
                   help="--grouped-ablations: comma-separated variants to check first")
    args = p.parse_args(argv)
    global OUT
    OUT = args.out
    bk.log(jax.devices())
    if args.dump:
        run_dump()
        return 0
    start = time.time()
    try:
        if args.final:
            run_final()
            return 0
        if args.trace_grouped:
            big = args.trace_tokens > 128
            run_trace_grouped(args.trace_tokens, prefill_shape=big, top=40 if big else 14)
            return 0
        if args.grouped_ablations:
            bk.measure_floors()
            run_grouped_ablations(
                variants=None if args.variants is None else tuple(args.variants.split(",")),
                checks=tuple(v for v in args.check_variants.split(",") if v))
            return 0
        if args.slot_sort:
            run_slot_sort()
        if args.rac_select:
            run_rac_select()
            return 0
        if args.prefill_tiles:
            bk.measure_floors()
            names = None if args.variants is None else args.variants.split(",")
            run_prefill_tiles(variants=tuple(v for v in PREFILL_VARIANTS
                                             if names is None or v[0] in names))
            return 0
        if args.tile_plan or args.act_operands or args.rac_rows or args.act_ablations:
            bk.measure_floors()
            if args.act_ablations:
                run_act_ablations()
            if args.tile_plan:
                run_tile_plan()
            if args.act_operands:
                run_act_operands()
            if args.rac_rows:
                run_rac_rows()
            return 0
        if args.rac_operands:
            bk.measure_floors()
            run_rac_operands()
            return 0
        if args.n_group:
            bk.measure_floors()
            run_grouped_n_group(tuple(args.n_group_shapes.split(",")))
            return 0
        if args.attention:
            bk.measure_floors()
            run_attention()
            return 0
        if args.attention_prefix:
            bk.measure_floors()
            run_attention_prefix()
            return 0
        if args.launch_bound:
            bk.measure_floors()
            run_launch_bound()
            return 0
        if not args.no_checks:
            run_checks()
        run_timings()
    finally:
        bk.write_outputs(args.out)
        bk.log(f"total {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
