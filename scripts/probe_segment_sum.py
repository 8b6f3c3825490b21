"""GPU probe: what RAC's per-expert score sums cost at the prefill's row counts, and whether
they repeat bit for bit (session 46).

``jax.ops.segment_sum`` is a scatter-add (float32 atomics on the GPU, any order);
``rac.ordered_segment_sum`` sorts and scans in a fixed order. Rows come sorted by expert, as the
grouped matmul gets them (skewed group sizes, some experts empty). Each variant runs ``--reps``
times inside one jitted ``fori_loop`` (a call far longer than host dispatch); prints the median
per call over ``--trials`` and how many of 8 repeated results differ from the first.

    python scripts/probe_segment_sum.py [--rows 65536,262144] [--blocks 128,48]
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax.quant import rac

VARIANTS = {"segment_sum": jax.ops.segment_sum, "ordered_segment_sum": rac.ordered_segment_sum}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="65536,262144")
    p.add_argument("--blocks", default="128,48")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    e = args.experts
    rng = np.random.default_rng(0)
    for m in map(int, args.rows.split(",")):
        # skewed routing: Zipf-like expert popularity, ~10 % of experts empty
        weights = rng.pareto(1.2, e) * (rng.random(e) > 0.1)
        ids = np.sort(rng.choice(e, m, p=weights / weights.sum())).astype(np.int32)
        for nb in map(int, args.blocks.split(",")):
            values = jax.random.uniform(jax.random.key(m + nb), (m, nb), jnp.float32)
            row = {"rows": m, "blocks": nb, "experts": e, "device": jax.devices()[0].device_kind}
            outs = {}
            for name, fn in VARIANTS.items():
                one = jax.jit(lambda v, i, fn=fn: fn(v, i, e))

                @jax.jit
                def loop(v, i, fn=fn):  # reps calls, each on a perturbed input (no CSE)
                    def body(k, acc):
                        return acc + fn(v + k.astype(v.dtype) * 1e-7, i, e)
                    return jax.lax.fori_loop(0, args.reps, body, jnp.zeros((e, v.shape[1]), v.dtype))

                idx = jnp.asarray(ids)
                jax.block_until_ready(loop(values, idx))
                times = []
                for _ in range(args.trials):
                    t0 = time.perf_counter()
                    jax.block_until_ready(loop(values, idx))
                    times.append((time.perf_counter() - t0) / args.reps)
                first = np.asarray(one(values, idx))
                differ = sum(not np.array_equal(np.asarray(one(values, idx)), first)
                             for _ in range(8))
                outs[name] = first
                row[name] = {"median_us": round(float(np.median(times)) * 1e6, 1),
                             "repeats_differing_of_8": differ}
            row["max_abs_diff"] = float(np.abs(outs["segment_sum"] -
                                               outs["ordered_segment_sum"]).max())
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
