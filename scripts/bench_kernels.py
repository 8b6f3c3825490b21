"""Correctness checks and timings of the Pallas NVFP4 kernels on one GPU (H200), vs XLA baselines.

Usage (on the device): ``PYTHONPATH=. python3 scripts/bench_kernels.py --out $OUT [--part P]``
with P in ``all | check | decode | grouped | prefill | train-grouped | tune``. Writes ``bench_kernels.json`` and
``bench_kernels.md`` under ``--out``.

Method (docs/DESIGN.md "Performance method"):
* correctness first, on fresh random inputs, the device memory poisoned with NaN before each
  kernel run (a NaN-filled buffer of the output's size is freed just before, so the allocator
  hands that memory to the kernel's output); f32 inputs, compared with an f32-HIGHEST XLA product
  of the dequantized operands;
* timings: each op runs ``reps`` times inside ONE jitted program (a ``fori_loop`` whose body calls
  the op on ``C`` distinct weight copies, so the weights stream from HBM and not from the 50 MB
  L2; calls are chained through a 1e-30-scaled data dependency on the output); median of 5 runs
  divided by the call count; the empty-chain overhead is measured and reported;
* floors: bytes the op must read / the best read bandwidth measured in this run (XLA BF16
  ``x[16,4096] @ W[4096,57344]``), and FLOPs / the measured BF16 matmul rate.
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import json
import math
import os
import signal
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import nvfp4_quantize as aq
from pallas_kernels.fp8_tiles_mgpu import prepare_fp8_weights
from pallas_kernels.layout import prepare_w4a4_weights
from pallas_kernels.w4a4_grouped import w4a4_grouped_matmul
from pallas_kernels.w4a4_matmul import W4A4MatmulConfig, w4a4_matmul
from pallas_kernels.w4a16_matmul import w4a16_grouped_matmul, w4a16_matmul
from pallas_kernels.w8a8_matmul import (
    W8A8MatmulConfig,
    w8a8_grouped_matmul,
    w8a8_matmul,
    w8a8_reference,
)
from quads_jax import config as cfglib
from quads_jax.quant import fp8, nvfp4
from quads_jax.quant.kernel_backend import (
    DEFAULT_W4A4_BITS,
    DEFAULT_W4A4_SCALE_DTYPE,
    store_overrides,
)

L2_FLUSH_BYTES = 160e6
SMOKE = False  # --smoke: tiny shapes, jnp instead of the kernel, to test this script on a CPU
# --trace: each timed row also records device times from one profiled run of its chain
# (``device_times``); ``time_chain`` leaves them here for the next ``record``.
TRACE = False
_LAST_TRACE: dict = {}
RESULTS: dict = {"checks": [], "timings": [], "floors": {}}
# The kernel variant the timings use: the first that passes the checks (run_checks sets it).
VARIANTS = (
    ("f16 subnormal ptx", dict(mma_dtype="float16", decode="subnormal"), dict()),
    ("f16 normal regs", dict(mma_dtype="float16", decode="normal"), dict()),
    ("bf16 normal regs", dict(mma_dtype="bfloat16", decode="normal"), dict()),
    ("f16 normal smemA", dict(mma_dtype="float16", decode="normal"), dict(a_via_smem=True)),
    ("f16 subnormal regs", dict(mma_dtype="float16", decode="subnormal"),
     dict(decode_impl="jnp")),
)
BEST = {"layout": VARIANTS[0][1], "config": VARIANTS[0][2], "name": VARIANTS[0][0]}
# --w4a4-set: W4A4MatmulConfig fields for every kcfg() config (recorded in the JSON).
OVERRIDES: dict = {}


def set_overrides(fields: dict) -> None:
    """Check ``fields`` as W4A4MatmulConfig fields (a ValueError names a bad one) and use them
    in every ``kcfg`` config from now on."""
    store_overrides(OVERRIDES, W4A4MatmulConfig, fields, set(), "--w4a4-set W4A4MatmulConfig")
    RESULTS["w4a4_set"] = dict(fields)


def kcfg(**kw) -> W4A4MatmulConfig:
    """The chosen variant's kernel config with the ``--w4a4-set`` fields, then ``kw``."""
    return W4A4MatmulConfig(**{**BEST["config"], "mma_dtype": BEST["layout"]["mma_dtype"],
                               **OVERRIDES, **kw})


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------- timing
def time_chain(op, x, weights, *, reps=None, runs=5, target_s=1e-3):
    """Median seconds per call of ``op(x, w)``, ``reps`` passes over the weights unrolled in one
    jitted program (a fori_loop costs ~19 us per iteration on the H200: measured)."""
    c = len(weights)
    # One jitted op, called c * passes times: jax lowers its body (the Mosaic GPU kernels
    # included) once and the chain refers to it. Inlined, 64 calls lowered 64 kernels: ~1 s
    # each for K x N = 2048 x 768 (CPU, `lower_for_h200`: 8 calls 8.5 s inlined, 2.0 s
    # jitted), twice per row, which ran session 19's and 24's `kdense` out of 270 s.
    call = jax.jit(op)
    programs = {}

    def make(passes):
        if passes in programs:
            return programs[passes]

        def prog(x, *ws):
            for _ in range(passes):
                for w in ws:
                    y = call(x, w)
                    x = x + (y.reshape(-1)[0] * 1e-30).astype(x.dtype)
            return x

        programs[passes] = jax.jit(prog)
        return programs[passes]

    if reps is None:  # one pass sizes the program to ~target_s per run (at most 64 calls)
        f = make(1)
        jax.block_until_ready(f(x, *weights))
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, *weights))
        one = (time.perf_counter() - t0) / c
        reps = max(1, min(64 // c, math.ceil(target_s / max(one, 1e-6) / c)))
    f = make(reps)
    jax.block_until_ready(f(x, *weights))
    ts = []
    for _ in range(1 if SMOKE else runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, *weights))
        ts.append(time.perf_counter() - t0)
    _LAST_TRACE.clear()
    if TRACE:
        _LAST_TRACE.update(device_times(f, (x, *weights), reps * c))
    return statistics.median(ts) / (reps * c), reps * c


def device_times(f, args, calls: int) -> dict:
    """Per call of the chained program ``f(*args)`` (``calls`` calls), from one profiled run:
    ``device_us``, the summed device time of all its kernels (its XLA glue included, launch
    gaps and host work not), and ``kernel_us`` / ``kernel``, its largest kernel (the op's
    GEMM: ours or XLA's). The wall-clock median of a chain of calls of tens of microseconds is
    mostly glue and launch gaps (session 18's tables). Empty where the trace has no device
    plane (CPU) or fails (a failed trace must not stop the run)."""
    try:
        from quads_jax import profiling

        summary = profiling.trace(lambda: jax.block_until_ready(f(*args)), "bench_kernels",
                                  top=6)
    except Exception as err:  # noqa: BLE001
        log(f"  trace failed: {type(err).__name__}: {str(err)[:150]}")
        return {}
    for plane in summary.values():
        if plane["top"]:
            top = plane["top"][0]
            return {"device_us": plane["busy_ms"] * 1e3 / calls,
                    "kernel_us": top["total_ms"] * 1e3 / calls, "kernel": top["name"],
                    # the op's six costliest kernels: where its device time goes
                    "top_kernels": [(k["name"], k["total_ms"] * 1e3 / calls, k["count"] / calls)
                                    for k in plane["top"]]}
    return {}


def copies_for(nbytes: float) -> int:
    """Weight copies a chain rotates through so that no call finds its weight in L2 (2 in the
    CPU smoke run, which measures nothing)."""
    if SMOKE:
        return 2
    return int(min(64, max(2, math.ceil(L2_FLUSH_BYTES / max(nbytes, 1)))))


def record(name, seconds, calls, *, bytes_=None, flops=None, note=""):
    bw = RESULTS["floors"].get("read_bw")
    rate = RESULTS["floors"].get("bf16_flops")
    row = {"name": name, "us": seconds * 1e6, "calls": calls, "bytes": bytes_, "flops": flops,
           "note": note}
    floors = []
    flop_floor = [flops / rate] if flops and rate else []
    if bytes_ and bw:
        floors.append(bytes_ / bw)
        row["achieved_TBps"] = bytes_ / seconds / 1e12
    if flop_floor:
        floors += flop_floor
        row["TFLOPs"] = flops / seconds / 1e12
    if floors:
        row["floor_us"] = max(floors) * 1e6
        row["floor_ratio"] = max(floors) / seconds
    traced = ""
    if _LAST_TRACE:  # this row's device times (time_chain with --trace)
        row.update(_LAST_TRACE)
        _LAST_TRACE.clear()
        # The kernel's device time against the probe kernel's device-time rate (the wall-clock
        # probe includes launch gaps: on the H200 it read 2.87 TB/s where the GEMV kernel itself
        # read 4.48, which made every traced kernel look 1.6x closer to its floor).
        kernel_bw = RESULTS["floors"].get("read_bw_kernel") or bw
        kernel_floors = ([bytes_ / kernel_bw] if bytes_ and kernel_bw else []) + flop_floor
        if kernel_floors:
            row["kernel_floor_us"] = max(kernel_floors) * 1e6
            row["kernel_floor_ratio"] = row["kernel_floor_us"] / row["kernel_us"]
        traced = (f"  device {row['device_us']:.1f} us, kernel {row['kernel_us']:.1f} us "
                  f"(floor {row.get('kernel_floor_us', 0):.1f} us, ratio "
                  f"{row.get('kernel_floor_ratio', 0):.2f}) {row['kernel'][:40]}")
    RESULTS["timings"].append(row)
    log(f"  {name:58s} {seconds * 1e6:9.1f} us  floor {row.get('floor_us', 0):8.1f} us  "
        f"ratio {row.get('floor_ratio', 0):5.2f}  {note}{traced}")
    if len(row.get("top_kernels", ())) > 1:
        log("      top: " + "; ".join(f"{n[:44]} {us:.1f} us x{c:.0f}"
                                      for n, us, c in row["top_kernels"]))


# ----------------------------------------------------------------------------- data
def S(v: int, div: int, lo: int) -> int:
    """A size, shrunk in smoke mode."""
    return max(lo, v // div) if SMOKE else v


def rand(key, shape, dtype=jnp.bfloat16, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


ROLLOUT = "rollout"  # nvfp4_weight's bits / scale_dtype: what the rollout's weight sync uses


def nvfp4_weight(key, shape, mma=None, decode=None, bits=ROLLOUT, scale_dtype=ROLLOUT):
    """The weight and its kernel layout. Float16 layouts get the rollout's default code-word
    bits and block-scale dtype (``kernel_backend.DEFAULT_W4A4_BITS`` / ``_SCALE_DTYPE``: E4M3,
    0.5625 streamed bytes per weight) unless ``bits`` / ``scale_dtype`` say otherwise
    (``scale_dtype=None``: float16 scales), so checks and timings run what the rollout runs;
    bfloat16 layouts have "nibbles" and bfloat16 scales, the only ones they support."""
    q = nvfp4.quantize(rand(key, shape, jnp.float32), scale_mode="expert" if len(shape) == 3
                       else "tensor")
    mma = mma or BEST["layout"]["mma_dtype"]
    f16 = mma == "float16"
    bits = (DEFAULT_W4A4_BITS if f16 else "nibbles") if bits == ROLLOUT else bits
    scale_dtype = (DEFAULT_W4A4_SCALE_DTYPE if f16 else None) if scale_dtype == ROLLOUT \
        else scale_dtype
    return q, prepare_w4a4_weights(q, mma_dtype=mma, decode=decode or BEST["layout"]["decode"],
                                   bits=bits, scale_dtype=scale_dtype)


def routing(key, tokens, e, top_k, skew=False):
    """Sorted-by-expert group sizes of ``tokens`` routed top-k over ``e`` experts."""
    rng = np.random.default_rng(key)
    p = rng.dirichlet(np.full(e, 0.3)) if skew else np.full(e, 1.0 / e)
    counts = np.zeros(e, np.int64)
    for _ in range(tokens):
        counts[rng.choice(e, size=top_k, replace=False, p=p)] += 1
    return jnp.asarray(counts, jnp.int32)


# ----------------------------------------------------------------------------- floors
def measure_floors():
    """Read bandwidth: the best of three XLA BF16 GEMV probes (the first also lifts the clocks
    from idle); the BF16 matmul rate; the chain's per-step overhead."""
    log("== floors")
    x = rand(1, (16, S(4096, 8, 256)))
    w = rand(2, (S(4096, 8, 256), S(57344, 64, 128)))
    best = best_kernel = 0.0
    for _ in range(3):
        t, n = time_chain(lambda x, w: jnp.dot(x, w), x, [w])
        best = max(best, w.size * 2 / t)
        traced = ""
        if _LAST_TRACE:  # --trace: the GEMV program's device time, the rate HBM really gives
            # All its kernels' time per call, not its largest kernel's: on 2026-12-05 the
            # largest alone read as 70 us (6.67 TB/s, above the H200's 4.8 TB/s peak), so it is
            # not the whole GEMV; the program is the GEMV and one tiny add.
            rate = w.size * 2 / (_LAST_TRACE["device_us"] * 1e-6)
            best_kernel = max(best_kernel, rate)
            traced = (f" (device {_LAST_TRACE['device_us']:.1f} us -> {rate / 1e12:.2f} TB/s;"
                      f" largest kernel {_LAST_TRACE['kernel_us']:.1f} us)")
            _LAST_TRACE.clear()
        log(f"  XLA bf16 16x4096 @ 4096x57344: {t * 1e6:.1f} us -> {w.size * 2 / t / 1e12:.2f} "
            f"TB/s{traced}")
    RESULTS["floors"]["read_bw"] = best
    if best_kernel:
        RESULTS["floors"]["read_bw_kernel"] = best_kernel
    d = S(8192, 32, 256)
    a = rand(3, (d, d))
    b = rand(4, (d, d))
    t, _ = time_chain(lambda x, w: jnp.dot(x, w), a, [b], reps=5)
    RESULTS["floors"]["bf16_flops"] = 2 * d**3 / t
    log(f"  XLA bf16 {d}^3: {t * 1e3:.2f} ms -> {2 * d**3 / t / 1e12:.0f} TFLOP/s")
    t, _ = time_chain(lambda x, w: x[:, :1] * w[:1, :1], x, [w[:8, :8]], reps=200)
    RESULTS["floors"]["chain_overhead_us"] = t * 1e6
    log(f"  empty chain step: {t * 1e6:.2f} us")


# ----------------------------------------------------------------------------- checks
def poison(shape):
    junk = jnp.full(shape, jnp.nan, jnp.float32)
    jax.block_until_ready(junk)
    del junk
    gc.collect()


def rel_err(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-30)), bool(
        np.isnan(y).any())


def _call_with_traced_args(fn):
    """Call ``jax.jit(lambda x=x, w=w: ...)`` with its array defaults as *traced* arguments: a
    captured constant is folded by XLA on the host at compile time, which is not what runs in a
    model (and once made the H200 check compare two different quantizations)."""
    f = getattr(fn, "__wrapped__", fn)
    arrays, static = {}, {}
    for k, v in inspect.signature(f).parameters.items():
        if v.default is inspect.Parameter.empty:
            raise ValueError(f"{k}: pass every input as a default (lambda x=x: ...)")
        leaves = jax.tree.leaves(v.default)
        is_arr = leaves and all(isinstance(a, jax.Array | np.ndarray) for a in leaves)
        (arrays if is_arr else static)[k] = v.default
    return jax.jit(functools.partial(f, **static))(**arrays)


def check(name, fn, ref_fn, out_shape, tol=1e-5):
    poison((max(out_shape[0], 8) * 4, out_shape[1] * 2))
    y = jax.block_until_ready(_call_with_traced_args(fn))
    err, nan = rel_err(y, ref_fn())
    ok = err < tol and not nan
    RESULTS["checks"].append({"name": name, "rel_err": err, "nan": nan, "ok": ok})
    log(f"  {'PASS' if ok else 'FAIL'} {name}: rel err {err:.2e}{' NaN!' if nan else ''}")
    return ok


def deq_ref(x, wq, racc=None, gs=None):
    """f32 HIGHEST product of the dequantized operands (what the kernel computes exactly)."""
    e = None if gs is None else wq.shape[0]
    rexp = None
    if gs is not None:
        rexp = jnp.minimum(jnp.searchsorted(jnp.cumsum(gs), jnp.arange(x.shape[0]),
                                            side="right"), e - 1)
    acts = aq.nvfp4_quantize(x, rac_config=racc, row_expert=rexp, num_experts=e)
    a = sum(aq.dequantized_sum(acts))
    wd = nvfp4.dequantize(wq, jnp.float32)
    if gs is None:
        return jnp.dot(a, wd.T, precision="highest")
    y = jnp.einsum("mk,mnk->mn", a, wd[rexp], precision="highest")
    return jnp.where((jnp.arange(x.shape[0]) < jnp.sum(gs))[:, None], y, 0.0)


def run_diagnostics():
    """Localize a failure: quantizer bit-identity (GPU jit / GPU eager / CPU) and the tile
    kernel alone against its jnp reference on identical operands."""
    log("== diagnostics")
    x = rand(5, (16, S(4096, 8, 256)), jnp.float32)
    q_e = nvfp4.quantize(x, scale_mode="row")
    q_j = jax.jit(lambda x: nvfp4.quantize(x, scale_mode="row"))(x)
    cpu = jax.devices("cpu")[0]
    q_c = jax.jit(lambda x: nvfp4.quantize(x, scale_mode="row"))(jax.device_put(x, cpu))
    q_f = jax.jit(lambda: nvfp4.quantize(x, scale_mode="row"))()  # x folded as a constant
    for tag, q in (("gpu-jit", q_j), ("cpu-jit", q_c), ("gpu-jit-constant-folded", q_f)):
        same = {f: bool(np.array_equal(np.asarray(getattr(q, f)).view(np.uint8)
                                       if f != "global_scale" else np.asarray(getattr(q, f)),
                                       np.asarray(getattr(q_e, f)).view(np.uint8)
                                       if f != "global_scale" else np.asarray(getattr(q_e, f))))
                for f in ("packed", "scales", "global_scale")}
        RESULTS["checks"].append({"name": f"quantize bit-identity {tag} vs gpu-eager",
                                  "rel_err": 0.0 if all(same.values()) else 1.0, "nan": False,
                                  "ok": all(same.values())})
        log(f"  quantize {tag} vs gpu-eager identical: {same}")
    from pallas_kernels.nvfp4_tiles_mgpu import (
        TileGemmConfig,
        nvfp4_tile_gemm,
        tile_gemm_reference,
    )

    wq, ww = nvfp4_weight(6, (S(14336, 16, 128), x.shape[1]))
    b, _ = aq.mma_operand(q_e, ww.mma_dtype)
    b = b.reshape(1, 16, -1)
    te, nt = jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32)
    for ks in (1, 2):
        kw = dict(a_via_smem=True, num_sms=4) if SMOKE else BEST["config"]
        cfg = TileGemmConfig(k_splits=ks, **kw)
        y = jax.jit(lambda b, w, te, nt, cfg=cfg: nvfp4_tile_gemm(
            (b,), w, te, nt, config=cfg, interpret=SMOKE))(b, ww, te, nt)
        err, nan = rel_err(jnp.sum(y, 1), tile_gemm_reference((b,), ww, te)[:, 0])
        RESULTS["checks"].append({"name": f"tile kernel alone k_splits={ks}", "rel_err": err,
                                  "nan": nan, "ok": err < 1e-5 and not nan})
        log(f"  tile kernel alone k_splits={ks}: rel err {err:.2e}")


def run_mini_checks():
    """The smallest end-to-end set: dense and grouped W4A4 (+RAC), inputs traced."""
    log("== mini checks (f32 inputs, traced, poisoned outputs)")
    racc = aq.RACConfig()
    m, k, n = 16, S(4096, 8, 256), S(14336, 16, 128)
    x = rand(9, (m, k), jnp.float32)
    wq, ww = nvfp4_weight(19, (n, k))
    for r in (None, racc):
        check(f"dense w4a4{'+RAC' if r else ''} M={m} K={k} N={n} (traced)",
              jax.jit(lambda x=x, ww=ww, r=r: w4a4_matmul(x, ww, rac=r, config=kcfg())),
              lambda x=x, wq=wq, r=r: deq_ref(x, wq, r), (m, n))
    e, k, n = S(128, 16, 8), S(2048, 8, 256), S(768, 6, 128)
    wq, ww = nvfp4_weight(40, (e, n, k))
    gs = routing(64, S(64, 16, 4), e, min(8, e), True)
    m = int(gs.sum()) + 3
    x = rand(41, (m, k), jnp.float32)
    for r in (None, racc):
        check(f"grouped w4a4{'+RAC' if r else ''} E={e} rows={m} (traced)",
              jax.jit(lambda x=x, gs=gs, r=r: w4a4_grouped_matmul(x, ww, gs, rac=r,
                                                                  config=kcfg())),
              lambda x=x, gs=gs, r=r: deq_ref(x, wq, r, gs), (m, n))


def run_checks():
    log("== correctness (f32 inputs, poisoned outputs)")
    ok = True
    racc = aq.RACConfig()
    m, k, n = 16, S(4096, 8, 256), S(14336, 16, 128)
    x = rand(9, (m, k), jnp.float32)
    passed = []
    for name, lay, cfg in VARIANTS:
        wq, ww = nvfp4_weight(19, (n, k), **{"mma": lay["mma_dtype"], "decode": lay["decode"]})
        c = W4A4MatmulConfig(mma_dtype=lay["mma_dtype"], **cfg)
        if check(f"variant {name}: dense w4a4 M={m} K={k} N={n}",
                 jax.jit(lambda x=x, ww=ww, c=c: w4a4_matmul(x, ww, config=c)),
                 lambda x=x, wq=wq: deq_ref(x, wq), (m, n)):
            passed.append((name, lay, cfg))
    if passed:
        BEST.update(name=passed[0][0], layout=passed[0][1], config=passed[0][2])
    log(f"  timings use variant: {BEST['name']}")
    RESULTS["variant"] = BEST["name"]
    for m, k, n in ((16, 4096, 14336), (1, 2048, 768), (200, 2048, 768)):
        k, n = S(k, 8, 256), S(n, 16, 128)
        x = rand(10 + m, (m, k), jnp.float32)
        wq, ww = nvfp4_weight(20 + m, (n, k))
        ok &= check(f"dense w4a4 M={m} K={k} N={n}",
                    jax.jit(lambda x=x, ww=ww: w4a4_matmul(x, ww, config=kcfg())),
                    lambda x=x, wq=wq: deq_ref(x, wq), (m, n))
        wq, ww = nvfp4_weight(20 + m, (n, k))
        ok &= check(f"dense w4a4+RAC0.5 f16 M={m} K={k} N={n}",
                    jax.jit(lambda x=x, ww=ww: w4a4_matmul(x, ww, rac=racc, config=kcfg())),
                    lambda x=x, wq=wq: deq_ref(x, wq, racc), (m, n))
    x = rand(30, (16, S(4096, 8, 256)))
    wq, ww = nvfp4_weight(31, (S(14336, 16, 128), x.shape[1]), "bfloat16")
    ok &= check("dense w4a16 bf16 M=16 K=4096 N=14336",
                jax.jit(lambda x=x, ww=ww: w4a16_matmul(x, ww, config=kcfg(mma_dtype="bfloat16"))),
                lambda: jnp.dot(x.astype(jnp.float32), nvfp4.dequantize(wq).T,
                                precision="highest"), (16, ww.n), tol=1e-2)
    return run_grouped_checks() and ok


def run_moe_checks():
    """The decode step's MoE operand path: 256 tokens, top-8 over 128 experts, gate_up's input
    as distinct token rows plus ``source_rows`` (quantized once per token), +-RAC."""
    ok = True
    e, k, n, tokens = S(128, 16, 8), S(2048, 8, 256), S(768, 6, 128), S(256, 16, 4)
    wq, ww = nvfp4_weight(40, (e, n, k))
    ids = jax.random.randint(jax.random.key(70), (tokens * min(8, e),), 0, e)
    order = jnp.argsort(ids, stable=True)
    gs = jnp.bincount(ids, length=e).astype(jnp.int32)
    src = (order // min(8, e)).astype(jnp.int32)
    x = rand(71, (tokens, k), jnp.float32)  # float32 output: the f32 accumulation is compared
    for r in (None, aq.RACConfig()):
        ok &= check(f"grouped w4a4{'+RAC' if r else ''} source_rows E=128 tokens={tokens} top-8",
                    jax.jit(lambda x=x, gs=gs, src=src, r=r: w4a4_grouped_matmul(
                        x, ww, gs, rac=r, config=kcfg(), source_rows=src)),
                    lambda r=r: deq_ref(x[src], wq, r, gs), (src.shape[0], n))
    # The down GEMM's read-back in slot order (``output_rows``, the MoE block's unsort).
    unsort = jnp.argsort(order).astype(jnp.int32)
    ok &= check(f"grouped w4a4 output_rows (unsorted) E=128 tokens={tokens} top-8",
                jax.jit(lambda x=x, gs=gs, src=src, unsort=unsort: w4a4_grouped_matmul(
                    x, ww, gs, config=kcfg(), source_rows=src, output_rows=unsort)),
                lambda: deq_ref(x[src], wq, None, gs)[unsort], (src.shape[0], n))
    return ok


def run_grouped_checks():
    """The grouped (MoE) checks (NVFP4 +-RAC, W4A16) and both FP8 paths."""
    ok = True
    racc = aq.RACConfig()
    e, k, n = S(128, 16, 8), S(2048, 8, 256), S(768, 6, 128)
    wq, ww = nvfp4_weight(40, (e, n, k))
    # FP8 (scales applied in the kernel's epilogue): close to, not equal to, an f32 product
    # (Hopper's FP8 tensor cores accumulate with fewer bits), hence the looser tolerance.
    x = rand(60, (16, S(4096, 8, 256)))
    w8 = fp8.quantize(rand(61, (S(14336, 16, 128), x.shape[1])), granularity="channel")
    w8k = our_fp8_weight(w8)
    ok &= check("dense w8a8 M=16 K=4096 N=14336",
                jax.jit(lambda x=x, w=w8k: w8a8_matmul(x, w, config=fp8_cfg())),
                lambda: w8a8_reference(x.astype(jnp.float32), w8), (16, w8.shape[0]),
                tol=1e-2)
    w8g = fp8.quantize(rand(62, (e, n, k)), granularity="channel")
    gs = routing(8, S(64, 16, 4), e, min(8, e), True)
    xg = rand(63, (int(gs.sum()) + 3, k))
    w8gk = our_fp8_weight(w8g)
    ok &= check("grouped w8a8 E=128 tokens=64",
                jax.jit(lambda xg=xg, w=w8gk, gs=gs: w8a8_grouped_matmul(
                    xg, w, gs, config=fp8_cfg())),
                lambda: w8a8_reference(xg.astype(jnp.float32), w8g, gs), (xg.shape[0], n),
                tol=1e-2)
    for tokens, skew in ((1, False), (64, True), (256, False)):
        tokens = S(tokens, 16, 1)
        gs = routing(tokens, tokens, e, min(8, e), skew)
        m = int(gs.sum()) + 3  # 3 rows past the groups must come out as zeros
        x = rand(41 + tokens, (m, k), jnp.float32)
        for r in (None, racc):
            ok &= check(f"grouped w4a4{'+RAC' if r else ''} E=128 tokens={tokens} skew={skew}",
                        jax.jit(lambda x=x, gs=gs, r=r: w4a4_grouped_matmul(
                            x, ww, gs, rac=r, config=kcfg())),
                        lambda x=x, gs=gs, r=r: deq_ref(x, wq, r, gs), (m, n))
    gs = routing(7, S(64, 16, 4), e, min(8, e), True)
    xb = rand(50, (int(gs.sum()), k))
    wq16, ww16 = nvfp4_weight(40, (e, n, k), "bfloat16")
    ok &= check("grouped w4a16 E=128 tokens=64",
                jax.jit(lambda xb=xb, ww16=ww16, gs=gs: w4a16_grouped_matmul(
                    xb, ww16, gs, config=kcfg(mma_dtype="bfloat16"))),
                lambda: jax.lax.ragged_dot(xb.astype(jnp.float32), jnp.swapaxes(
                    nvfp4.dequantize(wq16), 1, 2), gs, precision="highest"), (xb.shape[0], n),
                tol=1e-2)
    return ok


# ----------------------------------------------------------------------------- baselines
def fp8_weight(key, n, k):
    w = rand(key, (n, k), jnp.float32)
    s = jnp.max(jnp.abs(w), axis=1) / 448.0
    return (w / s[:, None]).astype(jnp.float8_e4m3fn), s


def our_fp8_weight(w):
    """An ``(e4m3 [N, K], scale [N])`` pair or an ``FP8Tensor`` in our FP8 kernel's layout."""
    if not isinstance(w, fp8.FP8Tensor):
        w = fp8.FP8Tensor(w[0], w[1][:, None], "channel")
    return prepare_fp8_weights(w)


def fp8_cfg(**kw) -> W8A8MatmulConfig:
    if SMOKE:
        return W8A8MatmulConfig(num_sms=4, tile_plan_kernel=False, **kw)
    return W8A8MatmulConfig(**kw)


def xla_fp8(x, w):
    w8, ws = w
    xs = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True) / 448.0
    x8 = (x.astype(jnp.float32) * (1.0 / xs)).astype(jnp.float8_e4m3fn)
    y = jax.lax.dot_general(x8, w8, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * xs * ws[None]).astype(x.dtype)


# ----------------------------------------------------------------------------- dense decode
SPLIT_SWEEP = (1, 2, 4, 8)


def bench_splits(shapes=((4096, 14336), (4096, 57344), (2048, 3072), (2048, 768)), m=16):
    """The split-K choice (``w4a4_matmul.auto_k_splits``, both tile kernels' default) against
    fixed splits ``SPLIT_SWEEP``, W4A4 and our FP8 kernel, dense decode at M = ``m``, with
    XLA's FP8 GEMV on the same shapes: which split is fastest where."""
    log("== split-K sweep")

    def sweep(name, matmul, x, weights, nbytes, fl, shape):
        for tag, ks in [("auto", None)] + [(f"ks{s}", s) for s in SPLIT_SWEEP]:
            try:  # a split that does not divide K's steps loses its row only
                t, calls = time_chain(lambda x, w, ks=ks: matmul(x, w, ks), x, weights)
                record(f"{name} [{tag}] {shape}", t, calls, bytes_=nbytes, flops=fl)
            except Exception as e:  # noqa: BLE001
                log(f"  {name} [{tag}] failed: {type(e).__name__}: {str(e)[:160]}")

    for k, n in shapes:
        k, n = S(k, 8, 256), S(n, 32, 128)
        x = rand(60, (m, k))
        fl, shape = 2 * m * n * k, f"M={m} K={k} N={n}"
        ws = [nvfp4_weight(100 + i, (n, k))[1] for i in range(copies_for(n * k * 0.625))]
        sweep("w4a4", lambda x, w, ks: w4a4_matmul(x, w, config=kcfg(k_splits=ks)), x, ws,
              n * k * 0.5625, fl, shape)
        del ws
        w8 = [fp8_weight(300 + i, n, k) for i in range(copies_for(n * k))]
        t, calls = time_chain(xla_fp8, x, w8)
        record(f"XLA fp8 (per-channel) {shape}", t, calls, bytes_=n * k, flops=fl)
        w8 = [our_fp8_weight(w) for w in w8]
        sweep("our fp8 kernel", lambda x, w, ks: w8a8_matmul(x, w, config=fp8_cfg(k_splits=ks)),
              x, w8, n * k, fl, shape)
        del w8


def bench_dense(ms=(16,), shapes=((4096, 14336), (2048, 768), (4096, 57344), (2048, 3072)),
                extra=True):
    log("== dense")
    for k, n in shapes:
        k, n = S(k, 8, 256), S(n, 32, 128)
        nv_bytes = n * k * 0.5625
        # the large, not too wide shapes get the kernels' variant and extra-path rows
        variants = extra and n * k >= 4096 * 14336 // (256 if SMOKE else 1) and n < 4 * k
        for m in ms:
            x = rand(60, (m, k))
            c = copies_for(n * k * 0.625)
            ws = [nvfp4_weight(100 + i, (n, k))[1] for i in range(c)]
            real = ws[0].nbytes
            fl = 2 * m * n * k
            cfgs = [("auto", kcfg())]
            if variants:
                cfgs += [("ks2", kcfg(k_splits=2)), ("ks4", kcfg(k_splits=4)),
                         ("stages2", kcfg(max_concurrent_steps=2))]
            for tag, cfg in cfgs:
                t, calls = time_chain(lambda x, w, cfg=cfg: w4a4_matmul(x, w, config=cfg), x, ws)
                record(f"w4a4 [{tag}] M={m} K={k} N={n}", t, calls, bytes_=nv_bytes, flops=fl,
                       note=f"kernel reads {real / 1e6:.1f} MB ({ws[0].scales.dtype} scales)")
            if extra or m == 16:
                t, calls = time_chain(lambda x, w: w4a4_matmul(x, w, rac=aq.RACConfig(),
                                                               config=kcfg()), x, ws)
                record(f"w4a4+RAC0.5 M={m} K={k} N={n}", t, calls, bytes_=nv_bytes, flops=fl)
            del ws
            if variants and m == 16:
                ws = [nvfp4_weight(100 + i, (n, k), "bfloat16")[1] for i in range(c)]
                t, calls = time_chain(lambda x, w: w4a4_matmul(
                    x, w, config=kcfg(mma_dtype="bfloat16")), x, ws)
                record(f"w4a4 bf16-mma M={m} K={k} N={n}", t, calls, bytes_=nv_bytes, flops=fl)
                t, calls = time_chain(lambda x, w: w4a16_matmul(
                    x, w, config=kcfg(mma_dtype="bfloat16")), x, ws)
                record(f"w4a16 M={m} K={k} N={n}", t, calls, bytes_=nv_bytes, flops=fl)
                del ws
            c = copies_for(n * k * 2)
            wb = [rand(200 + i, (k, n)) for i in range(c)]
            t, calls = time_chain(lambda x, w: jnp.dot(x, w), x, wb)
            record(f"XLA bf16 M={m} K={k} N={n}", t, calls, bytes_=n * k * 2, flops=fl)
            del wb
            c = copies_for(n * k)
            w8 = [fp8_weight(300 + i, n, k) for i in range(c)]
            t, calls = time_chain(xla_fp8, x, w8)
            record(f"XLA fp8 (per-channel) M={m} K={k} N={n}", t, calls, bytes_=n * k, flops=fl)
            w8 = [our_fp8_weight(w) for w in w8]
            t, calls = time_chain(lambda x, w: w8a8_matmul(x, w, config=fp8_cfg()), x, w8)
            record(f"our fp8 kernel M={m} K={k} N={n}", t, calls, bytes_=n * k, flops=fl)
            # The FP8 kernel's split-K and pipeline variants, as the W4A4 rows above: is the
            # default the fastest where it trails XLA's FP8 GEMV by a few percent?
            if variants:
                for tag, kw in [("ks2", dict(k_splits=2)), ("ks4", dict(k_splits=4)),
                                ("stages2", dict(max_concurrent_steps=2)),
                                ("stages6", dict(max_concurrent_steps=6))]:
                    try:  # a variant that does not fit (shared memory) loses its row only
                        t, calls = time_chain(lambda x, w, kw=kw: w8a8_matmul(
                            x, w, config=fp8_cfg(**kw)), x, w8)
                    except Exception as e:
                        log(f"  our fp8 kernel [{tag}] failed: {type(e).__name__}: "
                            f"{str(e)[:200]}")
                        continue
                    record(f"our fp8 kernel [{tag}] M={m} K={k} N={n}", t, calls,
                           bytes_=n * k, flops=fl)
            del w8


# ----------------------------------------------------------------------------- grouped
def bench_grouped(tokens_list=(1, 16, 64, 256), e=128, k=2048, n=768, top_k=8, prefill=False):
    e, k, n, top_k = S(e, 16, 8), S(k, 8, 256), S(n, 6, 128), min(top_k, S(e, 16, 8))
    tokens_list = tuple(S(t, 16, 1) for t in tokens_list)
    log(f"== grouped E={e} K={k} N={n} top{top_k}")
    c = 4
    ws = [nvfp4_weight(400 + i, (e, n, k))[1] for i in range(c)]
    per_expert = n * k * 0.5625
    for tokens in tokens_list:
        gs = routing(tokens, tokens, e, top_k)
        m = int(gs.sum())
        touched = int((np.asarray(gs) > 0).sum())
        x = rand(70, (m, k))
        fl = 2 * m * n * k
        t, calls = time_chain(lambda x, w, gs=gs: w4a4_grouped_matmul(x, w, gs, config=kcfg()),
                              x, ws)
        record(f"grouped w4a4 tokens={tokens} rows={m} experts={touched}", t, calls,
               bytes_=touched * per_expert, flops=fl)
        t, calls = time_chain(lambda x, w, gs=gs: w4a4_grouped_matmul(
            x, w, gs, rac=aq.RACConfig(), config=kcfg()), x, ws)
        record(f"grouped w4a4+RAC0.5 tokens={tokens}", t, calls, bytes_=touched * per_expert,
               flops=fl)
        w8 = [our_fp8_weight(fp8.quantize(rand(450 + i, (e, n, k), jnp.float32),
                                           granularity="channel")) for i in range(2)]
        t, calls = time_chain(lambda x, w, gs=gs: w8a8_grouped_matmul(x, w, gs, config=fp8_cfg()),
                              x, w8)
        record(f"grouped our fp8 kernel tokens={tokens}", t, calls,
               bytes_=touched * n * k, flops=fl)
        del w8
        wb = [rand(500 + i, (e, k, n)) for i in range(2)]
        if m <= 4096 and not SMOKE:
            t, calls = time_chain(lambda x, w, gs=gs: jax.lax.ragged_dot(x, w, gs), x, wb)
            record(f"XLA ragged_dot bf16 tokens={tokens}", t, calls, bytes_=touched * n * k * 2,
                   flops=fl)
        if (prefill or m >= 512) and not SMOKE:
            try:
                from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rdm

                def mgpu(x, w, gs=gs):
                    return rdm.ragged_dot(x, w, group_sizes=gs, block_m=128, block_n=128,
                                          block_k=64, max_concurrent_steps=4, grid_block_n=1)

                t, calls = time_chain(mgpu, x, wb)
                record(f"jax ragged_dot_mgpu bf16 tokens={tokens}", t, calls,
                       bytes_=touched * n * k * 2, flops=fl)
            except Exception as err:  # noqa: BLE001  (a baseline failing must not stop the run)
                log(f"  ragged_dot_mgpu failed: {type(err).__name__}: {str(err)[:200]}")
        del wb


def bench_prefill():
    log("== dense prefill")
    m, k, n = S(8192, 32, 64), S(4096, 8, 256), S(14336, 32, 128)
    x = rand(80, (m, k))
    fl = 2 * m * n * k
    ws = [nvfp4_weight(600 + i, (n, k))[1] for i in range(2)]
    for tag, cfg in (("kernel bm64", kcfg(prefill_min_rows=None)),
                     ("decoded weight + XLA GEMM", kcfg())):
        try:
            t, calls = time_chain(lambda x, w, cfg=cfg: w4a4_matmul(x, w, config=cfg), x, ws,
                                  reps=1)
            record(f"w4a4 prefill [{tag}] M={m} K={k} N={n}", t, calls, flops=fl)
        except Exception as err:  # noqa: BLE001
            log(f"  {tag} failed: {type(err).__name__}: {str(err)[:300]}")
    t, calls = time_chain(lambda x, w: w4a4_matmul(x, w, rac=aq.RACConfig(), config=kcfg()), x,
                          ws, reps=1)
    record(f"w4a4+RAC0.5 prefill M={m} K={k} N={n}", t, calls, flops=fl)

    # the default: the residual over the selected blocks (rac_prefill_columns, since session
    # 28); the variant contracts all K (its unselected blocks zeros)
    def rac_all_k(x, w):  # w4a4_matmul's large-M path
        from pallas_kernels import w4a4_matmul as wm

        rac = aq.RACConfig()
        return wm.prefill_product(aq.nvfp4_quantize(x, rac_config=rac),
                                  wm.as_kernel_weights(w, kcfg().mma_dtype), x.dtype, rac,
                                  columns=False)

    t, calls = time_chain(rac_all_k, x, ws, reps=1)
    record(f"w4a4+RAC0.5 prefill, residual over all K M={m} K={k} N={n}", t, calls, flops=fl)
    del ws
    wb = [rand(700, (k, n))]
    t, calls = time_chain(lambda x, w: jnp.dot(x, w), x, wb, reps=2)
    record(f"XLA bf16 prefill M={m} K={k} N={n}", t, calls, flops=fl)


def bench_train_grouped():
    """The trainer's expert matmuls, bf16, forward and forward + backward: ``bf16_grouped``
    (``ragged_dot_mgpu`` forward and dx, ``ragged_contract`` dW) against XLA's ``ragged_dot``
    as ``ops`` ran them before (f32 result, then bf16). Checked first (fresh inputs, f32
    HIGHEST reference of the bf16 operands)."""
    log("== trainer grouped bf16 matmuls (bf16_grouped vs XLA ragged_dot)")
    # (name, E, N, K, top-k, tokens): small_gpu_base's experts at a quarter of its bench batch
    # of 32 x 512 tokens, and Qwen3-30B-A3B's at 1 024 tokens.
    for shape in (("small_gpu_base gate_up", 32, 1024, 1024, 4, 4096),
                  ("small_gpu_base down", 32, 1024, 512, 4, 4096),
                  ("30B gate_up", 128, 1536, 2048, 8, 1024),
                  ("30B down", 128, 2048, 768, 8, 1024)):
        _train_grouped_shape(*shape)


def _train_grouped_shape(name, e, n, k, top_k, tokens):
    from pallas_kernels import bf16_grouped as bg

    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    e, tokens = S(e, 8, 4), S(tokens, 64, 16)
    n, k = (S(d, 16, 64) // 64 * 64 for d in (n, k))  # smoke: still multiples of 64
    gs = routing(900, tokens, e, min(top_k, e))
    m = int(gs.sum())
    x, w, dy = rand(901, (m, k)), rand(902, (e, n, k), scale=0.05), rand(903, (m, n))

    def ours(x, w):  # dW through XLA's ragged_dot_general
        return bg.grouped_matmul(x, w, gs, config=bg.BF16GroupedConfig(dw_kernel=False),
                                 interpret=SMOKE)

    def ours_dw(x, w):  # dW through our ragged_contract kernel (the default)
        return bg.grouped_matmul(x, w, gs, interpret=SMOKE)

    def xla(x, w):  # as ops ran the trainer's expert matmuls before bf16_grouped
        return bg.grouped_matmul_reference(x, w, gs)

    def exact(x, w):
        return jax.lax.ragged_dot(x.astype(f32), jnp.swapaxes(w, 1, 2).astype(f32), gs,
                                  precision=hi)

    def grads(f, x, w, dy):
        return jax.vjp(f, x, w)[1](dy.astype(jax.eval_shape(f, x, w).dtype))

    def step(f):
        def g(x, w):  # forward + backward; dW kept live through dx
            dx, dw = grads(f, x, w, dy)
            return dx.at[0, 0].add(dw[0, 0, 0].astype(dx.dtype))
        return g

    tag = f"{name} E={e} N={n} K={k} rows={m}"
    # bf16 results: rounding alone errs by up to 2^-8 of the largest element (session 27's
    # H100 check measured 4.1e-3 for XLA's dW and ours alike, with a 4e-3 tolerance): one
    # bf16 ulp, 2^-7, is the honest bound; a wrong kernel errs by O(1).
    bf16_tol = 2.0**-7
    check(f"bf16_grouped forward {tag}", lambda x=x, w=w: ours(x, w), lambda: exact(x, w),
          (m, n), tol=bf16_tol)
    for i, part in ((0, "dx"), (1, "dW (XLA)"), (1, "dW (ragged_contract)")):
        f = ours_dw if "contract" in part else ours
        check(f"bf16_grouped {part} {tag}",
              lambda x=x, w=w, dy=dy, i=i, f=f: grads(f, x, w, dy)[i],
              lambda i=i: grads(exact, x, w, dy)[i], (m, n), tol=bf16_tol)
    ws = [w, rand(910, (e, n, k), scale=0.05)]
    fl = 2 * m * n * k
    t, calls = time_chain(ours, x, ws)
    record(f"train bf16_grouped forward {tag}", t, calls, flops=fl)
    arms = (("bf16_grouped, dW XLA", ours, None), ("bf16_grouped, dW ragged_contract", ours_dw,
                                                   None))
    if not SMOKE:  # XLA's: E-times redundant, slow: one pass
        t, calls = time_chain(xla, x, ws, reps=1)
        record(f"train XLA ragged_dot forward {tag}", t, calls, flops=fl)
        arms += (("XLA ragged_dot", xla, 1),)
    for label, f, reps in arms:
        t, calls = time_chain(step(f), x, ws, reps=reps)
        record(f"train {label} forward+backward {tag}", t, calls, flops=3 * fl)


def enable_smoke():
    """Replace the Mosaic GPU kernel by its jnp reference (sums over splits are the same)."""
    global SMOKE
    SMOKE = True
    from pallas_kernels import fp8_tiles_mgpu, nvfp4_tiles_mgpu
    from pallas_kernels import w4a4_matmul as wm
    from pallas_kernels import w8a8_matmul as w8

    def stand_in(b_tiles, w, tile_expert, num_tiles, *, config, interpret=False,
                 col_scales=None, out_dtype=jnp.float32, residual_blocks=None,
                 expert_scales=None, expert_factor=1.0):
        del num_tiles, config, interpret
        return nvfp4_tiles_mgpu.tile_gemm_reference(b_tiles, w, tile_expert, col_scales,
                                                    out_dtype, residual_blocks, expert_scales,
                                                    expert_factor)

    def fp8_stand_in(b_tiles, w, tile_expert, num_tiles, *, config, col_scales,
                     out_dtype=jnp.float32, interpret=False):
        del num_tiles, config, interpret
        return fp8_tiles_mgpu.fp8_tile_gemm_reference(b_tiles, w, tile_expert, col_scales,
                                                      out_dtype)

    wm.nvfp4_tile_gemm = stand_in
    w8.fp8_tile_gemm = fp8_stand_in
    # The Triton kernels around the tile GEMM (operands, tile plan) cannot run on the CPU
    # outside interpret mode: their jnp paths compute the same arrays.
    BEST["config"] = {**BEST["config"], "act_operand_kernel": False,
                      "rac_operand_kernel": False, "tile_plan_kernel": False,
                      "rac_row_kernel": False}


def write_outputs(out: str):
    os.makedirs(out, exist_ok=True)
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    RESULTS["jax"] = jax.__version__
    with open(os.path.join(out, "bench_kernels.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    fl = RESULTS["floors"]
    lines = [f"device {RESULTS['device']}, jax {RESULTS['jax']}; read bw "
             f"{fl.get('read_bw', 0) / 1e12:.2f} TB/s (GEMV kernel alone "
             f"{fl.get('read_bw_kernel', 0) / 1e12:.2f}: the floor of the floor/kernel column), "
             f"bf16 {fl.get('bf16_flops', 0) / 1e12:.0f} "
             f"TFLOP/s, chain step overhead {fl.get('chain_overhead_us', 0):.2f} us", "",
             "| op | median us | floor us | floor/median | TB/s | TFLOP/s | calls | "
             "device us | kernel us | floor/kernel | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in RESULTS["timings"]:
        lines.append(f"| {r['name']} | {r['us']:.1f} | {r.get('floor_us', 0):.1f} | "
                     f"{r.get('floor_ratio', 0):.2f} | {r.get('achieved_TBps', 0):.2f} | "
                     f"{r.get('TFLOPs', 0):.1f} | {r['calls']} | {r.get('device_us', 0):.1f} | "
                     f"{r.get('kernel_us', 0):.1f} | {r.get('kernel_floor_ratio', 0):.2f} | "
                     f"{r['note']} |")
    lines += ["", "| check | rel err | ok |", "|---|---|---|"]
    lines += [f"| {c['name']} | {c['rel_err']:.2e} | {c['ok']} |" for c in RESULTS["checks"]]
    with open(os.path.join(out, "bench_kernels.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    """``"1,16"`` -> ``(1, 16)``; a clear error for anything else."""
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag}={text!r}: need comma-separated integers, e.g. 1,16") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"{flag}={text!r}: need integers >= 1")
    return vals


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"4096x14336,2048x768"`` -> ``((4096, 14336), (2048, 768))`` (K x N)."""
    shapes = []
    for item in text.split(","):
        kn = item.lower().split("x")
        if len(kn) != 2:
            raise SystemExit(f"--dense-shapes={text!r}: {item!r} is not KxN, e.g. 4096x14336")
        shapes.append(parse_ints(",".join(kn), "--dense-shapes"))
    return tuple(shapes)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/bench_out")
    p.add_argument("--part", default="all")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, jnp kernel stand-in (CPU)")
    p.add_argument("--dense-shapes", default=None,
                   help="--part decode: comma-separated KxN shapes (default: all four)")
    p.add_argument("--tokens", default=None,
                   help="--part grouped: comma-separated token counts (default 1,16,64,256)")
    p.add_argument("--w4a4-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a W4A4MatmulConfig field for every timed W4A4 call (repeatable; e.g. "
                        "compute_wgs=4 with n_group=2: two warpgroup pairs per SM)")
    p.add_argument("--trace", action="store_true",
                   help="also record each timed row's device time (all kernels, and its "
                   "largest kernel) from one profiled run of its chain")
    args = p.parse_args(argv)
    global TRACE
    TRACE = args.trace
    set_overrides(cfglib.field_overrides(args.w4a4_set, "--w4a4-set"))
    # `timeout` (h200_next.sh) ends a step with SIGTERM: exit through the `finally` below, so
    # the rows measured so far are still written (session 19 lost two tables' files that way).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    if args.smoke:
        enable_smoke()
    log(jax.devices())
    start = time.time()
    parts = args.part.split(",")
    try:
        if "all" in parts or "diag" in parts:
            run_diagnostics()
        if "all" in parts or "check" in parts:
            run_checks()
            write_outputs(args.out)
        elif "check-grouped" in parts:
            run_grouped_checks()
            write_outputs(args.out)
        if "check-moe" in parts:
            run_moe_checks()
            write_outputs(args.out)
        if "mini" in parts:
            run_mini_checks()
            write_outputs(args.out)
        if "nofloors" in parts:
            return 0
        measure_floors()
        if "all" in parts or "decode" in parts:
            if args.dense_shapes:
                bench_dense(shapes=parse_shapes(args.dense_shapes))
            else:
                bench_dense()
            write_outputs(args.out)
        if "splits" in parts:
            bench_splits(**({"shapes": parse_shapes(args.dense_shapes)} if args.dense_shapes
                            else {}))
            write_outputs(args.out)
        if "all" in parts or "decode1" in parts:
            bench_dense(ms=(1, 64), shapes=((4096, 14336),), extra=False)
            write_outputs(args.out)
        if "all" in parts or "grouped" in parts:
            if args.tokens:
                bench_grouped(tokens_list=parse_ints(args.tokens, "--tokens"))
            else:
                bench_grouped()
            write_outputs(args.out)
        if "all" in parts or "prefill" in parts:
            bench_prefill()
            bench_grouped(tokens_list=(1024,), prefill=True)
            write_outputs(args.out)
        if "all" in parts or "train-grouped" in parts:
            bench_train_grouped()
    finally:
        write_outputs(args.out)
        log(f"total {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
