"""Rollout scheduling on one workload: static batches, compaction, continuous batching.

    python scripts/bench_continuous.py --out $OUT                       # one H200
    python scripts/bench_continuous.py --tiny --sequences 48 --batch-rows 16 --new-tokens 32

An RL step's responses differ in length. The workload: ``--sequences`` responses
(``--sequences / --n-samples`` prompts of random length in ``[prompt/2, prompt]``) of at most
``--new-tokens`` tokens, on ``--batch-rows`` decode rows. The model is the Qwen3-30B-A3B shape
of ``bench_rollout.py`` with random weights (``--tiny``: its tiny model), synced to
``--precision``. Random weights never emit EOS, so a stop set of ``--stop-fraction`` of the
vocabulary (evenly spaced ids) ends each step's sample with about that probability: response
lengths are roughly geometric, capped at ``--new-tokens``.

Three schedules, each run once to compile and then timed (``--reps`` runs with the same key,
median):

- ``static``: ``engine.generate`` on consecutive groups of ``batch_rows`` rows; each batch runs
  until its longest row ends;
- ``compacting``: ``compaction.generate_compacting`` on the same groups (finished rows leave);
- ``continuous``: ``continuous.generate_continuous`` over all of them (rows refilled).

Each samples with its own key schedule, so their responses differ: the figure of merit is
response tokens per second (``tokens_per_s``), with ``row_steps`` (decode rows x steps run) against
the tokens produced as the batch's utilisation. Results go to ``OUT/continuous.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

from pallas_kernels.decode_attention import PREFIX_MODES, DecodeAttentionConfig
from quads_jax.models import ModelConfig
from quads_jax.quant.recipe import get_recipe
from quads_jax.sampler import engine
from quads_jax.sampler.compaction import generate_compacting
from quads_jax.sampler.continuous import batch_row_steps, generate_continuous, row_steps
from quads_jax.sampler.engine import SamplerConfig
from quads_jax.sampler.sync import sync

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rollout  # noqa: E402  (a script beside this one: the model shape and its init)


def workload(cfg: ModelConfig, args) -> tuple[np.ndarray, np.ndarray, SamplerConfig]:
    """(prompts int32 [Q, P] left-padded, mask, sampler config) of the benchmark."""
    rng = np.random.default_rng(args.seed)
    num_prompts = args.sequences // args.n_samples
    lengths = rng.integers(max(1, args.prompt // 2), args.prompt + 1, num_prompts)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in lengths]
    tokens, mask = engine.left_pad(prompts)
    count = max(1, round(args.stop_fraction * cfg.vocab_size))
    stops = tuple(int(i) for i in np.linspace(0, cfg.vocab_size - 1, count).astype(int))
    sc = SamplerConfig(max_new_tokens=args.new_tokens, n_samples=args.n_samples,
                       temperature=1.0, stop_token_ids=stops,
                       kv_cache_dtype=args.kv_cache_dtype,
                       share_prompt_cache=args.share_prompt_cache)
    return tokens, mask, sc


def schedules(params, cfg, recipe, tokens, mask, sc, args) -> dict:
    """name -> run(key) returning (response tokens, row-steps, segments)."""
    rows = args.batch_rows
    per_call = rows // sc.n_samples  # prompts per static batch

    def chunks():
        for i in range(0, tokens.shape[0], per_call):
            yield tokens[i:i + per_call], mask[i:i + per_call]

    def static(key):
        made = steps = 0
        for j, (t, m) in enumerate(chunks()):
            out = engine.generate(params, t, jax.random.fold_in(key, j), sc, model_config=cfg,
                                  recipe=recipe, prompt_mask=m)
            lengths = np.asarray(out.response_length)
            made += int(lengths.sum())
            steps += batch_row_steps(lengths)
        return made, steps, 0

    def compacting(key):
        made = steps = segs = 0
        for j, (t, m) in enumerate(chunks()):
            out, sizes = generate_compacting(params, t, jax.random.fold_in(key, j), sc,
                                             model_config=cfg, recipe=recipe, prompt_mask=m,
                                             segment_steps=args.segment_steps)
            lengths = np.asarray(out.response_length)
            made += int(lengths.sum())
            # The prefill's first tokens, then the segments (an upper bound: the last may run
            # fewer steps).
            steps += lengths.size + sum(sizes) * args.segment_steps
            segs += len(sizes)
        return made, steps, segs

    def continuous(key):
        out, segments = generate_continuous(params, tokens, key, sc, model_config=cfg,
                                            recipe=recipe, prompt_mask=mask, batch_rows=rows,
                                            segment_steps=args.segment_steps)
        made = int(np.asarray(out.response_length).sum())
        return made, row_steps(segments), len(segments)

    return {"static": static, "compacting": compacting, "continuous": continuous}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="bench_rollout's tiny model (CPU)")
    bench_rollout.add_layers_flag(p)
    p.add_argument("--precision", default=None, choices=sorted(bench_rollout.PRECISIONS),
                   help="default: nvfp4_rac on a GPU, bf16 elsewhere")
    p.add_argument("--sequences", type=int, default=512, help="responses in all")
    p.add_argument("--n-samples", type=int, default=8, help="responses per prompt (a group)")
    p.add_argument("--batch-rows", type=int, default=128)
    p.add_argument("--prompt", type=int, default=256, help="longest prompt (shortest: half)")
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--stop-fraction", type=float, default=0.002,
                   help="share of the vocabulary that ends a response (mean length ~ 1/this)")
    p.add_argument("--segment-steps", type=int, default=32)
    p.add_argument("--kv-cache-dtype", choices=("bfloat16", "float8_e4m3fn"),
                   default="bfloat16")
    p.add_argument("--share-prompt-cache", action="store_true",
                   help="a group's rows share one copy of its prompt's KV cache")
    p.add_argument("--attention-prefix-mode", choices=PREFIX_MODES,
                   default=DecodeAttentionConfig.prefix_mode,
                   help="how the decode attention kernel reads shared prompt prefixes "
                   "(DecodeAttentionConfig.prefix_mode)")
    p.add_argument("--schedules", default="static,compacting,continuous")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default="")
    p.add_argument("--out", default=os.environ.get("OUT", "out/bench_continuous"))
    args = p.parse_args(argv)
    if args.sequences % args.n_samples or args.batch_rows % args.n_samples:
        p.error(f"--sequences {args.sequences} and --batch-rows {args.batch_rows} must be "
                f"multiples of --n-samples {args.n_samples}")
    if not 0 < args.stop_fraction < 1:
        p.error(f"--stop-fraction {args.stop_fraction} must be in (0, 1)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from quads_jax.models import layers

    layers.set_decode_attention("kernel", DecodeAttentionConfig(
        prefix_mode=args.attention_prefix_mode))
    try:
        return run(args)
    finally:
        layers.set_decode_attention("kernel")


def run(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "continuous.jsonl")
    open(path, "w").close()

    def record(row):
        print(json.dumps(row), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    cfg = bench_rollout.bench_model_config(args.tiny, args.layers)
    gpu = jax.devices()[0].platform == "gpu"
    precision = args.precision or ("nvfp4_rac" if gpu else "bf16")
    recipe = get_recipe(bench_rollout.PRECISIONS[precision],
                        **bench_rollout.RECIPE_OVERRIDES.get(precision, {}))
    master = bench_rollout.init_params_on_device(cfg, jax.random.key(0))
    calib = None
    if precision == "nvfp4_rac_static":
        calib = bench_rollout.timing_calibration(master, recipe, cfg)
    params = jax.block_until_ready(sync(master, recipe, model_config=cfg, calibration=calib))
    del master
    tokens, mask, sc = workload(cfg, args)
    record(dict(kind="device", device=str(jax.devices()[0].device_kind), commit=args.commit,
                layers=cfg.num_hidden_layers, precision=precision, sequences=args.sequences,
                n_samples=args.n_samples, batch_rows=args.batch_rows, prompt=args.prompt,
                new_tokens=args.new_tokens,
                stop_fraction=args.stop_fraction, stop_ids=len(sc.stop_token_ids),
                segment_steps=args.segment_steps, kv_cache_dtype=args.kv_cache_dtype,
                share_prompt_cache=args.share_prompt_cache,
                attention_prefix_mode=args.attention_prefix_mode,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    runs = schedules(params, cfg, recipe, tokens, mask, sc, args)
    for name in args.schedules.split(","):
        if name not in runs:
            raise ValueError(f"--schedules: {name!r} is not one of {sorted(runs)}")
        # The same key every run: the first compiles every program the schedule uses (its
        # batch-size buckets depend on when rows end), the timed ones then compile nothing.
        key = jax.random.key(1)
        t = time.perf_counter()
        runs[name](key)
        first = time.perf_counter() - t
        times, made = [], []
        for _ in range(args.reps):
            t = time.perf_counter()
            tokens_made, steps, segments = runs[name](key)
            times.append(time.perf_counter() - t)
            made.append(tokens_made)
        seconds = statistics.median(times)
        record(dict(kind="schedule", schedule=name, precision=precision, seconds=seconds,
                    first_call_s=first, response_tokens=made[-1],
                    tokens_per_s=statistics.median(m / s for m, s in zip(made, times,
                                                                          strict=True)),
                    row_steps=steps, utilisation=made[-1] / max(steps, 1),
                    segments=segments, reps=args.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
