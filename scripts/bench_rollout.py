"""Rollout throughput of a Qwen3-30B-A3B-shaped MoE: prefill, decode, end to end, per precision.

    python scripts/bench_rollout.py --quick --out $OUT          # one H200, a few minutes
    python scripts/bench_rollout.py --batches 32,128,256 --prompts 256,1024 --new-tokens 1024
    python scripts/bench_rollout.py --quick --layers 24 --out $OUT  # an 80 GB H100: 24 layers
    python scripts/bench_rollout.py --tiny --quick              # CPU dry run of every code path

What it does, in one process (results are appended to ``OUT/rollout.jsonl`` as they come, and a
table is printed last):

1. random bf16 weights initialised on the device (one jitted init, stacked leaves generated one
   layer at a time so no f32 or full-size temporary exists; never built on the host);
2. the HBM copy bandwidth (the floor's denominator);
3. per precision: ``sync`` (compile, then timed) and its identity check, the weight bytes, then
   per (batch, prompt): prefill tokens/s, decode tokens/s over
   ``--decode-steps`` steps of a cache sized for ``--new-tokens``, timed around the middle of
   the generation (``--decode-at mid``: the decode attention reads the slots written so far, so
   a step's cost grows with the position and the middle one is the mean), end to end
   (prefill + new_tokens decode steps), and the decode floor (bytes that must move / measured
   bandwidth);
4. the largest batch at 1k context per precision, computed from the device memory, the weight
   bytes, the KV bytes per sequence and the decode program's temporary bytes per row;
5. the decode time split attention / MoE / rest from bf16 variants: MoE layers replaced by a
   16-wide dense MLP (48 and 1 layers);
6. first of all, XLA ``ragged_dot`` (f32 and bf16 output) against ``ragged_dot_mgpu`` on the
   expert shapes.

Precisions: ``bf16`` (expert matmuls through XLA ragged_dot with a bf16 result, its cuDNN grouped
GEMM), ``bf16_mgpu`` (the library's bf16 path on a GPU: ``pallas_kernels.bf16_grouped``, jax's
Pallas ``ragged_dot_mgpu``), ``fp8`` (E4M3 weights and activations,
our FP8 tensor-core tile kernel, ``pallas_kernels/w8a8_matmul.py``), ``nvfp4`` and ``nvfp4_rac``
(the Pallas W4A4 kernels); quantized weights in the kernels' layouts from ``sync``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from quads_jax import config as cfglib
from quads_jax import models, profiling, xla_runtime
from quads_jax.models import ModelConfig
from quads_jax.quant import ops
from quads_jax.quant.recipe import ROLLOUT_PRECISIONS, get_recipe
from quads_jax.sampler import engine
from quads_jax.sampler.calibration import needs_calibration
from quads_jax.sampler.floors import (
    BASELINES,
    QWEN3_30B_A3B,
    decode_step_bytes,
    expert_bytes,
    kv_bytes,
)
from quads_jax.sampler.sampling import DEFAULT_SAMPLER, SAMPLERS
from quads_jax.sampler.sync import SyncMismatchError, check_sync, sync, weight_bytes

PRECISIONS = {
    **ROLLOUT_PRECISIONS,
    "nvfp4_rac_static": "rollout_quads",  # with RECIPE_OVERRIDES' static RAC selection
    "bf16_mgpu": "bf16",
}
RECIPE_OVERRIDES = {"nvfp4_rac_static": dict(rac_selection="static")}


def timing_calibration(params: dict, recipe, cfg: ModelConfig) -> dict:
    """A static RAC block set for every W4A4 site, for *timing* the static arm: each weight (each
    expert) gets ``rac.select_blocks`` of seeded random scores (``rac_ratio`` of its K/16
    blocks), not ``calibration.calibrate`` on model activations (a 48-layer calibration forward
    at the 30B shape costs its own compile). The work of a decode step does not depend on which
    blocks are chosen: the residual operand spans K with the unselected blocks zero."""
    from quads_jax.quant import rac
    from quads_jax.sampler.calibration import calibrated_sites

    wanted = set(calibrated_sites(recipe, cfg))
    sites = jax.tree.leaves(models.param_sites(cfg, params),
                            is_leaf=lambda x: isinstance(x, str | tuple))
    out = {}
    for leaf, names in zip(jax.tree.leaves(params), sites, strict=True):
        for site in (names,) if isinstance(names, str) else names:
            if site not in wanted:
                continue
            nb = leaf.shape[-1] // 16
            lead = (leaf.shape[-3],) if ".experts." in site else ()
            scores = jax.random.uniform(jax.random.fold_in(jax.random.key(7), len(out)),
                                        lead + (nb,))
            out[site] = (rac.select_blocks(scores, recipe.rac_ratio), None)
    if missing := wanted - set(out):
        raise ValueError(f"timing_calibration: no weight found for {sorted(missing)[:3]}")
    return out


TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)


def bench_model_config(tiny: bool, layers: int | None = None) -> ModelConfig:
    """The benchmarks' model: Qwen3-30B-A3B's shape (``tiny``: ``TINY``), with ``layers``
    decoder layers instead of its own count when given (``--layers``)."""
    shape = dict(TINY if tiny else QWEN3_30B_A3B)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers={layers}: need at least 1 decoder layer")
        shape["num_hidden_layers"] = layers
    return ModelConfig(**shape)


def add_layers_flag(p) -> None:
    """``--layers`` (``bench_model_config``'s ``layers``)."""
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the model's, 48 for the 30B shape): fewer "
                        "fit an 80 GB H100 (the 48-layer sync needs ~78 GB); every layer is "
                        "the same, so the arms' per-step ratios hold, not their absolute times")


# ------------------------------------------------------------------------------ helpers
class Clock:
    """Wall time since start, and whether the time budget still allows new work."""

    def __init__(self, budget_s: float):
        self.t0, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allows(self, what: str) -> bool:
        if self.elapsed() < self.budget_s:
            return True
        print(f"[budget] {self.elapsed():.0f} s used of {self.budget_s:.0f}: skipping {what}",
              flush=True)
        return False


def timed(fn, reps: int) -> list[float]:
    """Seconds of ``reps`` calls of ``fn()`` (each blocked until ready)."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return out


def record(out_dir: str, row: dict) -> None:
    row = dict(row, elapsed_s=round(row.get("elapsed_s", 0.0), 1))
    print(json.dumps(row), flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "rollout.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def init_params_on_device(config: ModelConfig, rng: jax.Array) -> dict:
    """Random weights made on the device in ``param_dtype``; norms are ones.

    Same tree as ``models.init_params``; stacked leaves are generated one layer at a time
    (``lax.map``), so the only large buffers are the outputs.
    """
    abstract = jax.eval_shape(functools.partial(models.init_params, config), rng)
    leaves, treedef = jax.tree.flatten_with_path(abstract)
    std, dtype = config.initializer_range, config.param_dtype

    def make(key, path, leaf):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.ones(leaf.shape, dtype)
        if len(leaf.shape) >= 3:
            keys = jax.random.split(key, leaf.shape[0])
            layer = lambda k: (jax.random.normal(k, leaf.shape[1:], dtype) * std).astype(dtype)
            return jax.lax.map(layer, keys)
        return (jax.random.normal(key, leaf.shape, dtype) * std).astype(dtype)

    def build(rng):
        keys = jax.random.split(rng, len(leaves))
        return jax.tree.unflatten(treedef, [make(k, p, x) for k, (p, x) in zip(keys, leaves, strict=True)])

    device = jax.devices()[0]
    return jax.jit(build, out_shardings=jax.sharding.SingleDeviceSharding(device))(rng)


def copy_bandwidth(nbytes: int) -> float:
    """Device copy bandwidth in bytes/s (read + write counted), median of 5."""
    x = jnp.arange(nbytes // 4, dtype=jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    jax.block_until_ready(f(x))
    t = statistics.median(timed(lambda: f(x), 5))
    return 2 * x.nbytes / t


# ------------------------------------------------------------------------------ expert-matmul arms
# ops' jnp path asks ragged_dot for an f32 result; XLA on GPU then expands it to a dense,
# num_experts-times redundant product (PALLAS_NOTES section 4), which cannot run a 30B prefill.
# On a GPU the library's bf16 mode runs ``pallas_kernels.bf16_grouped`` (jax's Pallas
# ragged_dot_mgpu forward): the ``bf16_mgpu`` arm. The ``bf16`` arm registers XLA's best path
# instead (bf16 output -> cuDNN grouped GEMM) as the grouped kernel of the mode, rounded to bf16
# once, as ops does after its f32 product.
def _xla_ragged(x, w, group_sizes):
    return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), group_sizes,
                              preferred_element_type=jnp.bfloat16)


def _mgpu_ragged(x, w, group_sizes):
    """What the bf16 rollout runs: ``bf16_grouped``'s forward (``ragged_dot_mgpu``)."""
    from pallas_kernels import bf16_grouped

    return bf16_grouped.grouped_matmul(x, w, group_sizes)


def _bf16_kernel(ragged):
    def fn(x, w, group_sizes, *, recipe, site, interpret):
        return ragged(x, w.astype(x.dtype), group_sizes)

    return fn


BF16_PATH = {"path": "xla"}  # set from the ragged_dot comparison: the faster decode path


def register_arm(name: str) -> None:
    from quads_jax.quant import kernel_backend

    if name == "bf16" and BF16_PATH["path"] == "mgpu":
        name = "bf16_mgpu"
    if name == "bf16":
        ops.register_kernel("bf16", "grouped", _bf16_kernel(_xla_ragged))
    elif name == "bf16_mgpu":  # the library's own registration
        ops.register_kernel("bf16", "grouped", kernel_backend.plain_grouped_kernel("bf16"))


def bench_ragged_dot(config: ModelConfig, rows: list[int], reps: int) -> list[dict]:
    """XLA ragged_dot (bf16 and f32 output) vs ragged_dot_mgpu on the expert shapes."""
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    xla_f32 = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(
        x, jnp.swapaxes(w, 1, 2), gs, preferred_element_type=jnp.float32))
    xla, mg = jax.jit(_xla_ragged), jax.jit(_mgpu_ragged)
    out = []
    for name, n, k in (("gate_up", 2 * i, h), ("down", h, i)):
        w = jax.random.normal(jax.random.key(1), (e, n, k), jnp.bfloat16)
        for m in rows:
            x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)
            ids = jax.random.randint(jax.random.key(3), (m,), 0, e)
            gs = jnp.bincount(ids, length=e).astype(jnp.int32)
            ref = xla_f32(x, w, gs)
            row = dict(kind="ragged_dot", matmul=name, rows=m, n=n, k=k,
                       expert_bytes=e * n * k * 2, flops=2 * m * n * k)
            for label, f in (("xla_f32out", xla_f32), ("xla_bf16out", xla), ("mgpu", mg)):
                try:
                    got = f(x, w, gs).astype(jnp.float32)
                    row[f"{label}_rel_err"] = float(jnp.linalg.norm(got - ref)
                                                    / jnp.linalg.norm(ref))
                    row[f"{label}_ms"] = statistics.median(
                        timed(lambda f=f, a=(x, w, gs): f(*a), reps)) * 1e3
                except Exception as err:  # record and go on: one path failing is a result
                    row[f"{label}_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            out.append(row)
    return out


# ------------------------------------------------------------------------------ rollout cases
def matmul_flops_per_token(cfg: ModelConfig) -> float:
    """2 x the weights one token multiplies with (attention, router, its top-k experts)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    moe = cfg.num_experts * h + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    return 2.0 * cfg.num_hidden_layers * (attn + moe)


def profile_decode(dec, params, start, steps: int, tag: str, top: int = 16) -> dict:
    """Kernel totals of ``steps`` decode steps under ``jax.profiler`` (see quads_jax.profiling): the
    ``top`` kernels by summed time."""
    try:
        summary = profiling.trace(
            lambda: jax.block_until_ready(dec(params, start, jnp.int32(steps))), tag,
            steps=steps, top=top)
    except Exception as e:  # noqa: BLE001  (a missing profiler must not lose the timings)
        print(f"profile {tag} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(f"profile {tag}:\n{profiling.format_summary(summary)}", flush=True)
    return summary


CB_SCHEDULES = ("LHS", "SERIALIZE", "CONCURRENT", "CONCURRENT_REGIONS")
CB_OPTION = "xla_gpu_command_buffer_scheduling_mode"


def digest(x: jax.Array) -> str:
    """A short hex digest of an array's bytes (bit-identity across runs and processes)."""
    return hashlib.sha256(jax.device_get(x).tobytes()).hexdigest()[:16]


@jax.jit
def state_checksum(tree) -> jax.Array:
    """uint32 checksum of the bits of every array in ``tree`` (a decode state: its KV cache is
    gigabytes, so it is summed on the device, not copied out): each leaf's words weighted by
    their position and summed with wrap-around (integer addition: the same result in any
    order), leaves combined in tree order."""
    total = jnp.uint32(0)
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if leaf.dtype == jnp.bool_:
            leaf = leaf.astype(jnp.uint8)
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize]
        words = jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32)
        words = words.reshape(words.shape[0] if words.ndim else 1, -1)
        row = jax.lax.broadcasted_iota(jnp.uint32, words.shape, 0)
        col = jax.lax.broadcasted_iota(jnp.uint32, words.shape, 1)
        weight = (row * jnp.uint32(0x9E3779B1) + col * jnp.uint32(0x85EBCA77)) | jnp.uint32(1)
        total = total * jnp.uint32(31) + jnp.sum(words * weight, dtype=jnp.uint32)
    return total


def bench_case(params, cfg, recipe, batch, prompt, args, bandwidth, tag="") -> dict:
    """One (batch, prompt) case: ``batch`` decode rows, ``batch / n_samples`` prompts (GRPO
    groups of ``--n-samples``, their prompt's cache shared with ``--share-prompt-cache``)."""
    n = args.n_samples
    if batch % n:
        raise ValueError(f"batch {batch} is not a multiple of --n-samples {n}")
    groups = batch // n
    chunk = args.prefill_chunk if args.prefill_chunk and groups % args.prefill_chunk == 0 else 0
    sc = engine.SamplerConfig(max_new_tokens=args.new_tokens, temperature=1.0, n_samples=n,
                              prefill_chunk=chunk, unroll_decode_layers=args.unroll_decode,
                              kv_cache_dtype=args.kv_cache_dtype,
                              share_prompt_cache=args.share_prompt_cache,
                              pack_decode_layer_vectors=args.pack_layer_vectors,
                              sampler=args.sampler)
    prompts = jax.random.randint(jax.random.key(batch + prompt), (groups, prompt), 0,
                                 cfg.vocab_size)
    mask = jnp.ones((groups, prompt), bool)
    # The sampling key's PRNG (--prng-impl): with --sampler gumbel, jax.random.categorical
    # draws noise for every vocab entry of every row each step (151 936 x batch); on an H100
    # (2026-12-06, scripts/sampling_probe.py) rbg / unsafe_rbg took 195 us per draw at batch
    # 128 against threefry's 153, and the default inverse_cdf sampler 65 (two numbers a row).
    rng = jax.random.key(0, impl=args.prng_impl)
    static = dict(config=sc, model_config=cfg, recipe=recipe)
    t = time.perf_counter()
    pre = engine._prefill_jit.lower(params, prompts, mask, rng, **static).compile()
    compile_prefill = time.perf_counter() - t
    pre_times = []
    for i in range(1 + args.prefill_reps):  # the first run is a warm-up unless it is slow
        t = time.perf_counter()
        state = jax.block_until_ready(pre(params, prompts, mask, rng))
        pre_times.append(time.perf_counter() - t)
        if i == 0 and pre_times[0] > args.slow_prefill_s:
            break
    t_pre = statistics.median(pre_times[1:] or pre_times)
    prefill_digest = f"{int(state_checksum(state)):08x}"  # cache, first tokens, log-probs

    # Decode donates its state: every run starts from a copy of the one prefilled state.
    fresh = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
    t = time.perf_counter()
    schedule = {CB_OPTION: args.cb_schedule} if args.cb_schedule else None
    dec = engine._decode_jit.lower(params, state, jnp.int32(1), **static).compile(schedule)
    compile_decode = time.perf_counter() - t
    mem = dec.memory_analysis()
    temp = int(getattr(mem, "temp_size_in_bytes", 0) or 0)
    jax.block_until_ready(dec(params, fresh(state), jnp.int32(1)))  # warm-up
    steps = min(args.decode_steps, args.new_tokens - 1)
    if args.decode_at == "mid":
        # The decode attention kernel reads only the slots written so far, so a step's cost
        # grows with the position: time the steps around the middle of the generation (the
        # mean position), which makes prompt + new_tokens x step the end-to-end time.
        ahead = max(0, args.new_tokens // 2 - steps // 2 - 1)
        t = time.perf_counter()
        state = jax.block_until_ready(dec(params, fresh(state), jnp.int32(ahead)))
        fast_forward_s = time.perf_counter() - t
    else:
        fast_forward_s = 0.0
    times, digests = [], {}
    for _ in range(args.reps):
        # One run's output is dropped before the next copy: at batch 256 a state holds 32 GB of
        # cache, and three at once (state, the last output, the next copy) beside the 61 GB
        # BF16 weights did not fit the H200 (2026-12-03, "14.99 GiB" allocation failures).
        start = jax.block_until_ready(fresh(state))
        t = time.perf_counter()
        out = jax.block_until_ready(dec(params, start, jnp.int32(steps)))
        times.append(time.perf_counter() - t)
        ran = int(out.step) - int(state.step)
        digests = digests or {"tokens_digest": digest(out.tokens),
                              "logprobs_digest": digest(out.logprobs)}
        del out
    profile = {}
    if args.profile_steps:
        profile = profile_decode(dec, params, jax.block_until_ready(fresh(state)),
                                 args.profile_steps, f"{tag}_b{batch}_p{prompt}",
                                 top=args.profile_top)
    t_step = statistics.median(times) / max(ran, 1)

    slots = prompt + int(state.step) + ran // 2  # slots that must be read, mid-window
    # A shared prompt is read once per group, the responses once per row.
    step_bytes = decode_step_bytes(
        cfg, params, batch=batch, slots=slots, kv_itemsize=kv_itemsize(args),
        groups=groups if args.share_prompt_cache else None, prompt=prompt)
    cache_slots = prompt + args.new_tokens - 1  # prefill attends over the whole cache
    if args.share_prompt_cache:
        cache_slots = prompt
    prefill_flops = matmul_flops_per_token(cfg) * groups * prompt + \
        4 * groups * prompt * cache_slots * cfg.num_attention_heads * cfg.head_dim * \
        cfg.num_hidden_layers
    e2e = t_pre + args.new_tokens * t_step
    return dict(
        batch=batch, prompt=prompt, new_tokens=args.new_tokens, decode_steps_timed=ran,
        n_samples=n, share_prompt_cache=args.share_prompt_cache,
        prefill_s=t_pre, prefill_tok_s=groups * prompt / t_pre,
        prefill_floor_s=prefill_flops / args.bf16_flops,
        decode_step_ms=t_step * 1e3, decode_tok_s=batch / t_step,
        decode_floor_ms=step_bytes / bandwidth * 1e3,
        decode_floor_ratio=(step_bytes / bandwidth) / t_step,
        prefill_runs=len(pre_times),
        e2e_s=e2e, e2e_tok_s=batch * args.new_tokens / e2e,
        compile_prefill_s=compile_prefill, compile_decode_s=compile_decode,
        decode_temp_bytes=temp, profile=profile, decode_at=args.decode_at,
        decode_position=int(state.step) + prompt, fast_forward_s=fast_forward_s,
        cb_schedule=args.cb_schedule or engine.DECODE_COMPILER_OPTIONS.get(CB_OPTION, "LHS"),
        prefill_digest=prefill_digest, **digests,
    )


def kv_itemsize(args) -> int:
    """Bytes per cached key or value element of the run's ``--kv-cache-dtype``."""
    return jnp.dtype(args.kv_cache_dtype).itemsize


def largest_batch(cfg, weights: int, temp_per_row: float, context: int = 1024,
                  itemsize: int = 2) -> int:
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    if not limit:
        return -1
    per_row = kv_bytes(cfg, 1, context, itemsize) + temp_per_row
    return int((limit - weights) // per_row)


def _try_check(params, rollout, recipe, cfg):
    try:
        return check_sync(params, rollout, recipe, model_config=cfg)
    except SyncMismatchError:
        return None


def bench_precision(name, make_params, cfg, cases, args, bandwidth, clock, out_dir) -> None:
    """Sync + identity check + every case of one precision. The bf16 master tree is made here
    (``make_params``, seeded: the same weights for every precision, ~3 s) and dropped after the
    check unless the arm shares it (bf16), so a quantized arm's rollout runs without 61 GB of
    master weights beside it (the FP8 arm ran out of memory with them)."""
    params = make_params()
    recipe = get_recipe(PRECISIONS[name], **RECIPE_OVERRIDES.get(name, {}))
    if jax.default_backend() == "gpu":
        register_arm(name)
    calib = timing_calibration(params, recipe, cfg) if needs_calibration(recipe) else None
    t = time.perf_counter()
    rollout = jax.block_until_ready(sync(params, recipe, model_config=cfg, calibration=calib))
    first = time.perf_counter() - t
    del rollout
    t_sync = statistics.median(timed(
        lambda: sync(params, recipe, model_config=cfg, calibration=calib), 2))
    rollout = sync(params, recipe, model_config=cfg, calibration=calib)
    t = time.perf_counter()
    check_error = ""
    try:
        check_sync(params, rollout, recipe, model_config=cfg)
    except SyncMismatchError as e:  # recorded: the identity failed, the timing still counts
        check_error = str(e)[:300]
    first_check = time.perf_counter() - t
    t_check = statistics.median(timed(
        lambda: _try_check(params, rollout, recipe, cfg), 2))
    if name.startswith("bf16"):  # bit-identical to the bf16 master (checked): share its buffers
        del rollout  # but with q/k/v stacked as sync stacks them (session 14's first runs
        rollout = models.fuse_qkv(cfg, params, recipe)  # gave this arm the three GEMMs)
    params = None  # the master tree is not needed past the check (see the docstring)
    wb = weight_bytes(rollout)
    record(out_dir, dict(kind="sync", precision=name, bf16_path=BF16_PATH["path"], sync_s=t_sync, sync_first_call_s=first,
                         check_s=t_check, check_first_call_s=first_check,
                         check_ok=not check_error, check_error=check_error, weight_bytes=wb,
                         expert_bytes=expert_bytes(rollout), elapsed_s=clock.elapsed()))
    for batch, prompt in cases:
        if not clock.allows(f"{name} batch {batch} prompt {prompt}"):
            return
        try:
            row = bench_case(rollout, cfg, recipe, batch, prompt, args, bandwidth, tag=name)
        except Exception as e:  # one failing case must not lose the others' numbers
            record(out_dir, dict(kind="error", precision=name, batch=batch, prompt=prompt,
                                 error=f"{type(e).__name__}: {str(e)[:400]}"))
            continue
        # 1k context per row; with shared prompt caches a row holds its response and 1/n of
        # its group's prompt.
        context = 1024
        if args.share_prompt_cache and prompt < 1024:
            context = 1024 - prompt + -(-prompt // args.n_samples)
        row["max_batch_1k_context"] = largest_batch(
            cfg, wb, row["decode_temp_bytes"] / batch, context=context,
            itemsize=kv_itemsize(args))
        record(out_dir, dict(kind="rollout", precision=name, weight_bytes=wb, **row,
                             elapsed_s=clock.elapsed()))


def bench_split(cfg, batch, prompt, args, bandwidth, clock, out_dir) -> None:
    """Decode step of bf16 variants without MoE (48 and 1 layers) -> attention / MoE / rest."""
    recipe = get_recipe("bf16")
    steps = {}
    for layers in (cfg.num_hidden_layers, 1):
        if not clock.allows(f"split variant with {layers} layers"):
            return
        variant = cfg.replace(num_hidden_layers=layers, mlp_only_layers=tuple(range(layers)),
                              intermediate_size=16)
        params = init_params_on_device(variant, jax.random.key(7))
        steps[layers] = bench_case(params, variant, recipe, batch, prompt, args, bandwidth,
                                   tag=f"no_moe_{layers}layers")["decode_step_ms"]
        del params
    per_layer_attn = (steps[cfg.num_hidden_layers] - steps[1]) / (cfg.num_hidden_layers - 1)
    record(out_dir, dict(kind="split", batch=batch, prompt=prompt,
                         no_moe_step_ms=steps[cfg.num_hidden_layers], one_layer_step_ms=steps[1],
                         attention_ms=per_layer_attn * cfg.num_hidden_layers,
                         rest_ms=steps[1] - per_layer_attn, elapsed_s=clock.elapsed()))


# ------------------------------------------------------------------------------ main
def multiples(rows: list[dict], baselines: tuple[str, ...] = BASELINES) -> list[str]:
    """One line per precision and baseline of the same case (batch, prompt, samples, shared
    cache): the decode step's multiple over the baseline, and the multiple the two floors
    allow (the baseline's step bytes over the precision's: what equal floor / step ratios
    would give)."""
    case = lambda r: (r["batch"], r["prompt"], r["n_samples"], r["share_prompt_cache"])  # noqa: E731
    runs = [r for r in rows if r["kind"] == "rollout"]
    base = {(case(r), r["precision"]): r for r in runs if r["precision"] in baselines}
    lines = []
    for r in runs:
        for b in baselines:
            ref = base.get((case(r), b))
            # a baseline against the baselines before it only (fp8 vs bf16, not bf16 vs fp8)
            if ref is None or (r["precision"] in baselines
                               and baselines.index(r["precision"]) <= baselines.index(b)):
                continue
            lines.append(
                f"{r['precision']} vs {b} (batch {r['batch']}, prompt {r['prompt']}): "
                f"{ref['decode_step_ms'] / r['decode_step_ms']:.2f}x the decode step, "
                f"{ref['decode_floor_ms'] / r['decode_floor_ms']:.2f}x by the floors")
    return lines


def summary(out_dir: str) -> str:
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "rollout.jsonl"))]
    lines = ["| precision | batch | prompt | prefill tok/s | decode tok/s | step ms | floor ms "
             "| floor/step | e2e tok/s | max batch @1k |", "|" + "---|" * 10]
    for r in rows:
        if r["kind"] == "rollout":
            lines.append(
                f"| {r['precision']} | {r['batch']} | {r['prompt']} | {r['prefill_tok_s']:.0f} "
                f"| {r['decode_tok_s']:.0f} | {r['decode_step_ms']:.2f} | "
                f"{r['decode_floor_ms']:.2f} | {r['decode_floor_ratio']:.2f} | "
                f"{r['e2e_tok_s']:.0f} | {r['max_batch_1k_context']} |")
    lines += multiples(rows)
    for r in rows:
        if r["kind"] == "sync":
            lines.append(f"sync {r['precision']}: {r['sync_s']:.3f} s, check {r['check_s']:.3f}"
                         f" s, weights {r['weight_bytes'] / 2**30:.2f} GiB")
        elif r["kind"] in ("split", "ragged_dot", "error", "device"):
            lines.append(json.dumps(r))
    return "\n".join(lines)


def parse_args(argv):
    from pallas_kernels.decode_attention import PREFIX_MODES
    from pallas_kernels.w4a4_matmul import W4A4MatmulConfig
    from quads_jax.quant import kernel_backend

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="batch 128, prompt 256, 16 timed decode steps, 2 reps")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU dry run)")
    add_layers_flag(p)
    p.add_argument("--batches", default="32,128,256")
    p.add_argument("--prompts", default="256,1024")
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps timed per case")
    p.add_argument("--reps", type=int, default=3, help="timed decode runs per case")
    p.add_argument("--prefill-reps", type=int, default=2, help="timed prefill runs per case")
    p.add_argument("--slow-prefill-s", type=float, default=5.0,
                   help="a first prefill slower than this is taken as the timing (no repeats)")
    p.add_argument("--precisions", default=None,
                   help="comma list (default nvfp4_rac,bf16,fp8,nvfp4,bf16_mgpu; none: only the "
                   "split); bf16 takes the "
                   "faster of XLA / mgpu expert matmuls (decode shapes)")
    p.add_argument("--split", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--decode-attention", choices=models.layers.DECODE_ATTENTION_IMPLS,
                   default="kernel", help="decode attention: the Pallas kernel or the jnp path")
    p.add_argument("--w4a4-n-group", type=int, choices=(1, 2, 4), default=1,
                   help="weight-row tiles per work item of the NVFP4 kernels "
                   "(W4A4MatmulConfig.n_group)")
    p.add_argument("--w4a4-stack-operands", action=argparse.BooleanOptionalAction,
                   default=True, help="RAC's two B operands stacked on the wgmma N side "
                   "(W4A4MatmulConfig.stack_operands, the default)")
    p.add_argument("--w4a4-mma-overlap", type=int, choices=(0, 1), default=0,
                   help="wgmma groups left in flight while the next chunk is decoded "
                   "(W4A4MatmulConfig.mma_overlap)")
    p.add_argument("--w4a4-mma-k", type=int, choices=(64, 128, 256), default=256,
                   help="K columns of decoded weight per wgmma group (W4A4MatmulConfig.mma_k; "
                   "--w4a4-mma-overlap 1 needs 64 or 128)")
    p.add_argument("--sampler", choices=sorted(SAMPLERS), default=DEFAULT_SAMPLER,
                   help="how a token is drawn from its log-probs (SamplerConfig.sampler): "
                   "Gumbel noise over the whole vocab, or two uniforms per row")
    p.add_argument("--prng-impl", choices=("threefry2x32", "rbg", "unsafe_rbg"),
                   default="threefry2x32",
                   help="the sampling key's PRNG implementation (jax.random.key(..., impl=)); "
                   "the rollout engine takes any key (jax's default: threefry2x32)")
    xla_runtime.add_autotune_cache_argument(p)
    p.add_argument("--cb-schedule", choices=CB_SCHEDULES, default=None,
                   help="the decode program's xla_gpu_command_buffer_scheduling_mode (default: "
                   "engine.DECODE_COMPILER_OPTIONS'); rows record it, a checksum of the "
                   "prefilled state and digests of the first timed run's tokens and "
                   "log-probs, equal across modes and runs when the kernels compute the "
                   "same bits")
    p.add_argument("--kv-cache-dtype", choices=("bfloat16", "float8_e4m3fn"), default="bfloat16",
                   help="the rollout's KV cache (SamplerConfig.kv_cache_dtype); FP8 halves the "
                   "decode attention's reads, in every arm")
    p.add_argument("--attention-slot-splits", type=int, default=1,
                   help="decode attention programs per (row, KV head) over slot ranges "
                   "(DecodeAttentionConfig.slot_splits; flash-decoding)")
    p.add_argument("--attention-prefix-mode", choices=PREFIX_MODES, default=None,
                   help="how the decode attention reads shared prompt prefixes "
                   "(DecodeAttentionConfig.prefix_mode; with --share-prompt-cache)")
    p.add_argument("--attention-prefix-rows", type=int, default=None,
                   help="rows of a group per prefix program (DecodeAttentionConfig.prefix_rows)")
    p.add_argument("--attention-prefix-splits", type=int, default=None,
                   help="slot ranges per group tile (DecodeAttentionConfig.prefix_splits)")
    p.add_argument("--w4a4-bits", choices=("nibbles", "signs_high"), default="signs_high",
                   help="the float16 NVFP4 weights' code-word bit layout made at weight sync "
                   "(kernel_backend.set_w4a4_bits)")
    p.add_argument("--w4a4-scales", choices=("float16", "float8_e4m3fn"),
                   default=kernel_backend.DEFAULT_W4A4_SCALE_DTYPE or "float16",
                   help="the float16 NVFP4 weights' block-scale dtype made at weight sync "
                   "(kernel_backend.set_w4a4_scale_dtype)")
    p.add_argument("--materialize-operands", action=argparse.BooleanOptionalAction,
                   default=True, help="with RAC, the NVFP4 kernels' distinct-row operands and "
                   "residual computed once before the row gathers (the default; "
                   "W4A4MatmulConfig.materialize_operands)")
    p.add_argument("--windowed-operands", action=argparse.BooleanOptionalAction, default=True,
                   help="the NVFP4 and FP8 kernels read token tiles as row windows (the "
                   "default) or as gathered tiles (W4A4MatmulConfig / W8A8MatmulConfig."
                   "windowed_operands)")
    p.add_argument("--slot-sort-kernel", action=argparse.BooleanOptionalAction,
                   default=models.moe.DEFAULT_SLOT_SORT_KERNEL,
                   help="the MoE slots' sort by expert in the Pallas kernel (pallas_kernels."
                   "slot_sort; the default) or in jnp (moe.set_slot_sort_kernel)")
    p.add_argument("--rac-select-kernel", action=argparse.BooleanOptionalAction,
                   default=W4A4MatmulConfig.rac_select_kernel,
                   help="RAC's per-expert selection in the Triton kernel (pallas_kernels."
                   "rac_select) or in jnp (default: W4A4MatmulConfig.rac_select_kernel)")
    p.add_argument("--rac-select-block-rows", type=int,
                   default=W4A4MatmulConfig.rac_select_block_rows,
                   help="rows per loop step of the RAC selection kernel")
    p.add_argument("--rac-operand-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="RAC's stacked B operands written by the Triton kernel "
                   "(pallas_kernels.rac_operands) or by an XLA fusion (default: "
                   "W4A4MatmulConfig.rac_operand_kernel)")
    p.add_argument("--rac-operand-padding", choices=("zeros", "skip"), default="zeros",
                   help="the RAC operand kernel's window rows without a GEMM row: written as "
                   "zeros (default) or not written (W4A4MatmulConfig.rac_operand_padding)")
    p.add_argument("--act-operand-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="plain W4A4's B operand quantized by the Triton kernel "
                   "(pallas_kernels.act_operands) or by XLA's quantizer fusions and a gather "
                   "(default: W4A4MatmulConfig.act_operand_kernel)")
    p.add_argument("--rac-row-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="RAC's operand values and residual statistics of the distinct rows "
                   "from one Triton kernel (pallas_kernels.rac_rows) or from XLA's quantizer "
                   "and residual fusions (default: W4A4MatmulConfig.rac_row_kernel)")
    p.add_argument("--rac-placed-values", action=argparse.BooleanOptionalAction, default=None,
                   help="grouped RAC prefill calls without source rows: rac_rows writes the "
                   "operand values into the windowed operand itself, rac_operands completes it "
                   "in place (default: W4A4MatmulConfig.rac_placed_values)")
    p.add_argument("--tile-plan-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="the grouped kernels' token-tile plan (NVFP4 and FP8) in one Pallas "
                   "kernel (pallas_kernels.tile_plan) or in jnp (default: "
                   "W4A4MatmulConfig.tile_plan_kernel)")
    p.add_argument("--tile-plan-block", type=int, default=W4A4MatmulConfig.tile_plan_block,
                   help="entries per program of the tile-plan kernel (a power of two >= 8)")
    p.add_argument("--tile-plan-warps", type=int, default=W4A4MatmulConfig.tile_plan_warps,
                   help="Triton warps per program of the tile-plan kernel")
    p.add_argument("--w4a4-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any W4A4MatmulConfig field for every NVFP4 kernel call (repeatable; "
                   "the value parsed as YAML, e.g. rac_operand_block_rows=4), after the "
                   "dedicated flags: a field set by both takes this value")
    p.add_argument("--fp8-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any W8A8MatmulConfig field for every FP8 kernel call (repeatable; the "
                   "value parsed as YAML, e.g. store_buffers=2), after the dedicated flags")
    p.add_argument("--n-samples", type=int, default=1,
                   help="rows per prompt (a GRPO group); the batch counts rows")
    p.add_argument("--share-prompt-cache", action="store_true",
                   help="a group's rows share one copy of its prompt's KV cache")
    p.add_argument("--unroll-decode", action="store_true",
                   help="decode steps with the layers unrolled (SamplerConfig."
                   "unroll_decode_layers; an ablation: longer compile)")
    p.add_argument("--pack-layer-vectors", action=argparse.BooleanOptionalAction,
                   default=engine.SamplerConfig.pack_decode_layer_vectors,
                   help="the decode step's layer scan slices the per-layer norm vectors and "
                   "layer ids as one packed array (SamplerConfig.pack_decode_layer_vectors)")
    p.add_argument("--grouped-barrier", action=argparse.BooleanOptionalAction,
                   default=kernel_backend.DEFAULT_GROUPED_BARRIER,
                   help="an optimization barrier after the grouped kernels "
                   "(kernel_backend.set_grouped_barrier; an ablation, off by default)")
    p.add_argument("--decode-at", choices=("mid", "start"), default="mid",
                   help="time the decode steps at the middle of the generation (default; the "
                   "attention reads the slots written so far) or right after the prompt")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="also trace this many decode steps per case and record where the "
                   "device time goes (quads_jax/profiling.py)")
    p.add_argument("--profile-top", type=int, default=16,
                   help="kernels listed per traced case (by summed device time)")
    p.add_argument("--ragged", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this")
    p.add_argument("--bf16-flops", type=float, default=790e12, help="measured bf16 rate (KINDS)")
    p.add_argument("--prefill-chunk", type=int, default=32,
                   help="prompts per prefill pass (bounds attention-score memory); 0: all")
    p.add_argument("--bf16-path", choices=("xla", "mgpu"), default=None,
                   help="expert matmuls of the bf16 arm (default: the faster in --ragged)")
    p.add_argument("--commit", default="")
    p.add_argument("--out", default=os.environ.get("OUT", "out/bench_rollout"))
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.prompts, args.decode_steps, args.reps = "128", "256", 16, 2
        args.prefill_reps = 1
        args.precisions = args.precisions or "nvfp4_rac,bf16,nvfp4,fp8"
    args.precisions = args.precisions or "nvfp4_rac,bf16,fp8,nvfp4,bf16_mgpu"
    return args


def set_fields(items: list[str], flag: str = "--w4a4-set") -> dict:
    """``--w4a4-set`` / ``--fp8-set`` ``FIELD=VALUE`` items -> ``{field: value}`` (checked by
    ``kernel_backend.set_w4a4_overrides`` / ``set_fp8_overrides``)."""
    return cfglib.field_overrides(items, flag)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.autotune_cache is not None:
        xla_runtime.use_autotune_cache(args.autotune_cache)
    if args.bf16_path:
        BF16_PATH["path"] = args.bf16_path
    from pallas_kernels.decode_attention import DecodeAttentionConfig
    from pallas_kernels.w4a4_matmul import W4A4MatmulConfig
    from quads_jax.quant import kernel_backend

    prefix_kw = {field: value for field, value in (
        ("prefix_mode", args.attention_prefix_mode), ("prefix_rows", args.attention_prefix_rows),
        ("prefix_splits", args.attention_prefix_splits)) if value is not None}
    attention = DecodeAttentionConfig(slot_splits=args.attention_slot_splits, **prefix_kw)
    models.layers.set_decode_attention(args.decode_attention, attention)
    if (args.w4a4_n_group != 1 or not args.w4a4_stack_operands or args.w4a4_mma_overlap
            or args.w4a4_mma_k != 256 or not args.materialize_operands
            or args.rac_select_kernel != W4A4MatmulConfig.rac_select_kernel
            or args.rac_select_block_rows != W4A4MatmulConfig.rac_select_block_rows
            or args.grouped_barrier != kernel_backend.DEFAULT_GROUPED_BARRIER
            or not args.windowed_operands
            or args.rac_operand_kernel is not None or args.rac_operand_padding != "zeros"
            or args.tile_plan_kernel is not None or args.act_operand_kernel is not None
            or args.rac_row_kernel is not None or args.rac_placed_values is not None
            or args.tile_plan_block != W4A4MatmulConfig.tile_plan_block
            or args.tile_plan_warps != W4A4MatmulConfig.tile_plan_warps or args.w4a4_set
            or args.fp8_set):
        operand_kernel = ({} if args.rac_operand_kernel is None
                          else dict(rac_operand_kernel=args.rac_operand_kernel))
        operand_kernel["rac_operand_padding"] = args.rac_operand_padding
        plan = dict(tile_plan_block=args.tile_plan_block, tile_plan_warps=args.tile_plan_warps)
        if args.tile_plan_kernel is not None:
            plan["tile_plan_kernel"] = args.tile_plan_kernel
        operand_kernel.update(plan)
        if args.act_operand_kernel is not None:
            operand_kernel["act_operand_kernel"] = args.act_operand_kernel
        if args.rac_row_kernel is not None:
            operand_kernel["rac_row_kernel"] = args.rac_row_kernel
        if args.rac_placed_values is not None:
            operand_kernel["rac_placed_values"] = args.rac_placed_values
        # --w4a4-set / --fp8-set come last: they win over the dedicated flags' values.
        kernel_backend.set_w4a4_overrides(**{
            **dict(n_group=args.w4a4_n_group, stack_operands=args.w4a4_stack_operands,
                   mma_overlap=args.w4a4_mma_overlap, mma_k=args.w4a4_mma_k,
                   materialize_operands=args.materialize_operands,
                   rac_select_kernel=args.rac_select_kernel,
                   rac_select_block_rows=args.rac_select_block_rows,
                   windowed_operands=args.windowed_operands),
            **operand_kernel, **set_fields(args.w4a4_set)})
        kernel_backend.set_fp8_overrides(**{
            **dict(windowed_operands=args.windowed_operands), **plan,
            **set_fields(args.fp8_set, "--fp8-set")})
        kernel_backend.set_grouped_barrier(args.grouped_barrier)
    kernel_backend.set_w4a4_bits(args.w4a4_bits)
    kernel_backend.set_w4a4_scale_dtype(None if args.w4a4_scales == "float16"
                                        else args.w4a4_scales)
    models.moe.set_slot_sort_kernel(args.slot_sort_kernel)
    clock = Clock(args.budget_s)
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "rollout.jsonl"), "w").close()
    cfg = bench_model_config(args.tiny, args.layers)
    device = jax.devices()[0]
    gpu = device.platform == "gpu"
    bandwidth = copy_bandwidth(2**32 if gpu else 2**26)
    record(args.out, dict(kind="device", device=str(device.device_kind), jax=jax.__version__,
                          commit=args.commit, layers=cfg.num_hidden_layers,
                          decode_attention=args.decode_attention,
                          w4a4_n_group=args.w4a4_n_group,
                          w4a4_stack_operands=args.w4a4_stack_operands,
                          w4a4_mma_overlap=args.w4a4_mma_overlap,
                          w4a4_mma_k=args.w4a4_mma_k,
                          materialize_operands=args.materialize_operands,
                          w4a4_bits=args.w4a4_bits, w4a4_scales=args.w4a4_scales,
                          kv_cache_dtype=args.kv_cache_dtype, prng_impl=args.prng_impl,
                          sampler=args.sampler, w4a4_set=args.w4a4_set,
                          fp8_set=args.fp8_set,
                          attention_slot_splits=args.attention_slot_splits,
                          attention_prefix_mode=attention.prefix_mode,
                          attention_prefix_rows=attention.prefix_rows,
                          attention_prefix_splits=attention.prefix_splits,
                          rac_select_kernel=args.rac_select_kernel,
                          rac_select_block_rows=args.rac_select_block_rows,
                          slot_sort_kernel=args.slot_sort_kernel,
                          rac_operand_kernel=(W4A4MatmulConfig().rac_operand_kernel
                                              if args.rac_operand_kernel is None
                                              else args.rac_operand_kernel),
                          rac_operand_padding=args.rac_operand_padding,
                          act_operand_kernel=(W4A4MatmulConfig().act_operand_kernel
                                              if args.act_operand_kernel is None
                                              else args.act_operand_kernel),
                          rac_row_kernel=(W4A4MatmulConfig().rac_row_kernel
                                          if args.rac_row_kernel is None
                                          else args.rac_row_kernel),
                          rac_placed_values=(W4A4MatmulConfig().rac_placed_values
                                             if args.rac_placed_values is None
                                             else args.rac_placed_values),
                          tile_plan_kernel=(W4A4MatmulConfig().tile_plan_kernel
                                            if args.tile_plan_kernel is None
                                            else args.tile_plan_kernel),
                          tile_plan_block=args.tile_plan_block,
                          tile_plan_warps=args.tile_plan_warps,
                          grouped_barrier=args.grouped_barrier,
                          windowed_operands=args.windowed_operands,
                          unroll_decode=args.unroll_decode,
                          pack_layer_vectors=args.pack_layer_vectors,
                          n_samples=args.n_samples, share_prompt_cache=args.share_prompt_cache,
                          copy_bandwidth_TBps=bandwidth / 1e12,
                          date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    if args.ragged and gpu:
        rows = bench_ragged_dot(cfg, [1024, 32768], 5)
        for row in rows:
            record(args.out, row)
        decode = [r for r in rows if r["rows"] == 1024]
        xla = sum(r.get("xla_bf16out_ms", float("inf")) for r in decode)
        mgpu = sum(r.get("mgpu_ms", float("inf")) for r in decode)
        BF16_PATH["path"] = "mgpu" if mgpu < xla else "xla"
        record(args.out, dict(kind="bf16_path", path=BF16_PATH["path"], decode_xla_ms=xla,
                              decode_mgpu_ms=mgpu))
    t = time.perf_counter()
    params = jax.block_until_ready(init_params_on_device(cfg, jax.random.key(0)))
    record(args.out, dict(kind="init", seconds=time.perf_counter() - t,
                          weight_bytes=weight_bytes(params), elapsed_s=clock.elapsed()))
    del params

    def make_params():
        return jax.block_until_ready(init_params_on_device(cfg, jax.random.key(0)))

    cases = [(int(b), int(p)) for p in args.prompts.split(",") for b in args.batches.split(",")]
    for name in [n for n in args.precisions.split(",") if n != "none"]:
        if name not in PRECISIONS:
            raise ValueError(f"--precisions: {name!r} is not one of {sorted(PRECISIONS)}")
        if name == "bf16_mgpu" and not gpu:
            continue
        if clock.allows(f"precision {name}"):
            bench_precision(name, make_params, cfg, cases, args, bandwidth, clock, args.out)
    if args.split and clock.allows("time split"):
        if gpu:
            register_arm("bf16")
        bench_split(cfg, *cases[0], args, bandwidth, clock, args.out)
    print(summary(args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
