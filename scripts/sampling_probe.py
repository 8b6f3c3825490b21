"""Time one decode step's token sampling at the 30B shape's vocab: Gumbel noise vs inverse CDF.

Every rollout step draws one token per row from ``[B, 151 936]`` log-probs. With
``jax.random.categorical`` (the "gumbel" sampler) that is one threefry-generated random number per
vocab entry per row (19.4 M at batch 128); the "inverse_cdf" sampler needs two per row. This
script times ``sampling.sample_tokens`` inside one jitted ``fori_loop`` of ``--steps`` draws
(so a call runs far longer than host dispatch), per sampler and PRNG implementation, with greedy
(no randomness) as the floor of the log-softmax passes, and checks before timing that every
arm's log-probs of its picks equal ``log_softmax`` at those tokens.

  python scripts/sampling_probe.py --out DIR [--batch 128,256] [--steps 50]

Writes ``DIR/sampling_probe.json`` (one row per arm: median / min us per draw over ``--reps``
calls) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from quads_jax.sampler.sampling import SamplingParams, sample_tokens

VOCAB = 151936
ARMS = (  # (name, SamplingParams kwargs, PRNG implementation of the key)
    ("greedy", dict(greedy=True), "threefry2x32"),
    ("gumbel/threefry2x32", dict(sampler="gumbel"), "threefry2x32"),
    ("gumbel/rbg", dict(sampler="gumbel"), "rbg"),
    ("gumbel/unsafe_rbg", dict(sampler="gumbel"), "unsafe_rbg"),
    ("inverse_cdf/threefry2x32", dict(sampler="inverse_cdf"), "threefry2x32"),
)


def draw_loop(params: SamplingParams, steps: int):
    """jit(logits [B, V] bf16, key) -> (tokens [B] int32, logp sum [B] float32) after ``steps``
    draws; each draw's logits are shifted by a per-step constant so no pass is hoisted out of
    the loop (the shift changes no probability)."""

    def run(logits, key):
        def body(i, carry):
            tokens, total = carry
            shifted = logits.astype(jnp.float32) + i.astype(jnp.float32) * 1e-3
            tok, logp = sample_tokens(jax.random.fold_in(key, i), shifted, params)
            return tokens ^ tok, total + logp

        zeros = jnp.zeros(logits.shape[:1], jnp.int32)
        return jax.lax.fori_loop(0, steps, body, (zeros, jnp.zeros(logits.shape[:1])))

    return jax.jit(run)


def check_arm(params: SamplingParams, impl: str, logits: jax.Array) -> float:
    """Max |logp - log_softmax(logits)[token]| of one draw (temperature 1, no filtering)."""
    tok, logp = jax.jit(lambda x, k: sample_tokens(k, x, params))(
        logits, jax.random.key(1, impl=impl))
    want = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    want = jnp.take_along_axis(want, tok[:, None], axis=-1)[:, 0]
    return float(jnp.max(jnp.abs(logp - want)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/sampling_probe")
    p.add_argument("--batch", default="128,256", help="comma-separated rows per draw")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--steps", type=int, default=50, help="draws per timed call")
    p.add_argument("--reps", type=int, default=7, help="timed calls per arm")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    print(f"device {jax.devices()[0].device_kind}, vocab {args.vocab}, {args.steps} draws/call")
    for batch in (int(b) for b in args.batch.split(",")):
        logits = (jax.random.normal(jax.random.key(batch), (batch, args.vocab)) * 4.0).astype(
            jnp.bfloat16)
        for name, kwargs, impl in ARMS:
            params = SamplingParams(**kwargs)
            error = check_arm(params, impl, logits)
            run = draw_loop(params, args.steps)
            key = jax.random.key(0, impl=impl)
            jax.block_until_ready(run(logits, key))
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                jax.block_until_ready(run(logits, key))
                times.append((time.perf_counter() - t) / args.steps * 1e6)
            row = dict(batch=batch, arm=name, prng=impl, us_per_draw_median=statistics.median(times),
                       us_per_draw_min=min(times), logp_max_abs_error=error,
                       status="PASS" if error < 1e-4 else "FAIL")
            rows.append(row)
            print(f"B={batch:4d} {name:26s} median {row['us_per_draw_median']:8.1f} us  "
                  f"min {row['us_per_draw_min']:8.1f}  logp err {error:.1e} {row['status']}",
                  flush=True)
    with open(os.path.join(args.out, "sampling_probe.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                       commit=os.environ.get("COMMIT", ""), steps=args.steps, rows=rows), f,
                  indent=1)
    assert all(r["status"] == "PASS" for r in rows), "a sampler's log-probs are wrong"


if __name__ == "__main__":
    main()
