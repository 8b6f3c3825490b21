"""The bytes a decode step must move, and the speed-ups they allow between rollout precisions.

A decode step of a MoE is bound by HBM reads: each weight it multiplies with is read once
(every non-expert weight but the embedding table, whose lookup reads B rows; the experts the
batch routes to) and every row's keys and values up to its position. At equal fractions of
that floor two precisions run at the ratio of their step bytes: the most one can gain over the
other without running closer to its floor. ``scripts/bench_rollout.py`` divides the same bytes
by the measured copy bandwidth for each run's floor; ``python -m quads_jax.bench floors``
prints them for a model shape, batches and positions with no GPU (the rollout trees are built
as shapes by ``jax.eval_shape``, in the kernels' layout).

Expert traffic assumes uniform routing: a step of B rows touches each expert with probability
``1 - (1 - k / E) ** B``. A shared prompt cache (GRPO groups) is read once per group.
"""

from __future__ import annotations

import argparse
import sys

import jax

from quads_jax import models
from quads_jax.models import ModelConfig
from quads_jax.quant.recipe import ROLLOUT_PRECISIONS, get_recipe
from quads_jax.sampler.sync import sync, weight_bytes

BASELINES = ("bf16", "fp8")
# The Qwen3-30B-A3B shape of issue 5's benchmark (scripts/bench_rollout.py's model).
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
    rope_theta=1e6, dtype="bfloat16", param_dtype="bfloat16",
)


def expert_bytes(tree) -> int:
    """Bytes of the routed experts' weights of a (rollout) parameter tree."""
    return sum(weight_bytes(g["mlp"]["experts"]) for g in tree["layers"] if "experts" in g["mlp"])


def kv_bytes(config: ModelConfig, rows: int, slots: int, itemsize: int = 2) -> int:
    """Key and value bytes of ``rows`` x ``slots`` cache slots (``itemsize``: the cache dtype's)."""
    return (2 * config.num_hidden_layers * rows * slots * config.num_key_value_heads
            * config.head_dim * itemsize)


def touched_experts(config: ModelConfig, rows: int) -> float:
    """Expected fraction of the experts that ``rows`` tokens route to (uniform routing)."""
    if not config.num_experts:
        return 0.0
    return 1.0 - (1.0 - config.num_experts_per_tok / config.num_experts) ** rows


def decode_step_bytes(config: ModelConfig, tree, *, batch: int, slots: int,
                      kv_itemsize: int = 2, groups: int | None = None,
                      prompt: int = 0) -> float:
    """Bytes one decode step of ``batch`` rows must read, each row at ``slots`` cache slots:
    the weights it multiplies with (``tree``: the rollout tree, arrays or shapes) and the KV
    cache; with ``groups`` the first ``prompt`` slots are a shared prompt read once per group."""
    if batch < 1 or slots < 1 or not 0 <= prompt <= slots:
        raise ValueError(f"decode_step_bytes: batch={batch}, slots={slots}, prompt={prompt}: "
                         "need batch >= 1, slots >= 1 and 0 <= prompt <= slots")
    if groups is not None and (groups < 1 or batch % groups):
        raise ValueError(f"decode_step_bytes: groups={groups} must divide batch={batch}")
    w_exp = expert_bytes(tree)
    # The lookup reads B rows of the embedding table, unless the LM head reads it whole.
    embed = 0 if config.tie_word_embeddings else weight_bytes(tree["embed"])
    if groups is None:
        read_kv = kv_bytes(config, batch, slots, kv_itemsize)
    else:
        read_kv = (kv_bytes(config, groups, prompt, kv_itemsize)
                   + kv_bytes(config, batch, slots - prompt, kv_itemsize))
    return weight_bytes(tree) - w_exp - embed + touched_experts(config, batch) * w_exp + read_kv


def rollout_tree_shapes(config: ModelConfig, precision: str):
    """The rollout tree of ``precision`` (a ``ROLLOUT_PRECISIONS`` key) as shapes, in the layout
    the GPU kernels read: no arrays are made."""
    if precision not in ROLLOUT_PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {sorted(ROLLOUT_PRECISIONS)}")
    recipe = get_recipe(ROLLOUT_PRECISIONS[precision])
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.key(0)))
    return jax.eval_shape(
        lambda p: sync(p, recipe, model_config=config, kernel_layout=True), params)


def floor_rows(config: ModelConfig, batches, slots: int, *, precisions=tuple(ROLLOUT_PRECISIONS),
               kv_itemsize: int = 2, bandwidth: float = 4.8e12) -> list[dict]:
    """One row per (batch, precision): weight bytes, step bytes, the floor at ``bandwidth``
    (bytes/s) in ms and tokens/s, and ``x_<baseline>``: the baseline's step bytes over this
    precision's (the multiple equal floor fractions give)."""
    trees = {p: rollout_tree_shapes(config, p) for p in precisions}
    rows = []
    for batch in batches:
        step = {p: decode_step_bytes(config, t, batch=batch, slots=slots,
                                     kv_itemsize=kv_itemsize) for p, t in trees.items()}
        for p in precisions:
            row = dict(precision=p, batch=batch, slots=slots, weight_bytes=weight_bytes(trees[p]),
                       kv_bytes=kv_bytes(config, batch, slots, kv_itemsize),
                       step_bytes=step[p], floor_ms=step[p] / bandwidth * 1e3,
                       floor_tok_s=batch * bandwidth / step[p])
            row.update({f"x_{b}": step[b] / step[p] for b in BASELINES if b in step})
            rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    bases = [b for b in BASELINES if rows and f"x_{b}" in rows[0]]
    head = ("| batch | precision | weights GB | KV read GB | step GB | floor ms | floor tok/s | "
            + " | ".join(f"allows x {b}" for b in bases) + " |")
    lines = [head, "|" + "---|" * (7 + len(bases))]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['precision']} | {r['weight_bytes'] / 1e9:.2f} | "
            f"{r['kv_bytes'] / 1e9:.2f} | {r['step_bytes'] / 1e9:.2f} | {r['floor_ms']:.2f} | "
            f"{r['floor_tok_s']:.0f} | " + " | ".join(f"{r[f'x_{b}']:.2f}x" for b in bases)
            + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m quads_jax.bench floors",
                                description=__doc__.split("\n")[0])
    p.add_argument("--hf", metavar="DIR", default=None,
                   help="a transformers Qwen3-MoE directory (its config.json only); default: "
                   "the Qwen3-30B-A3B shape")
    p.add_argument("--layers", type=int, default=None, help="decoder layers instead of the "
                   "model's (a model cut to fit a smaller GPU, as bench_rollout --layers)")
    p.add_argument("--batches", default="32,128,256", help="comma-separated decode batch sizes")
    p.add_argument("--position", type=int, default=760,
                   help="cache slots each row reads (default 760: prompt 256 halfway through "
                   "1 024 new tokens, bench_rollout's timed steps)")
    p.add_argument("--precisions", default=",".join(ROLLOUT_PRECISIONS),
                   help=f"comma-separated, of {sorted(ROLLOUT_PRECISIONS)}")
    p.add_argument("--kv-cache-dtype", choices=("bfloat16", "float8_e4m3fn"), default="bfloat16")
    p.add_argument("--bandwidth-tbps", type=float, default=4.8,
                   help="HBM read rate for the floor times (TB/s; the multiples do not depend "
                   "on it; default: the H200's datasheet rate)")
    args = p.parse_args(argv)
    try:
        try:
            batches = [int(b) for b in args.batches.split(",")]
        except ValueError:
            raise ValueError(f"--batches={args.batches!r}: comma-separated integers, e.g. "
                             "32,128,256") from None
        precisions = tuple(args.precisions.split(","))
        if bad := [x for x in precisions if x not in ROLLOUT_PRECISIONS]:
            raise ValueError(f"--precisions: unknown {bad}; one of {sorted(ROLLOUT_PRECISIONS)}")
        if args.bandwidth_tbps <= 0:
            raise ValueError(f"--bandwidth-tbps={args.bandwidth_tbps}: must be > 0")
        if args.hf:
            from quads_jax.models.hf import read_config

            config = read_config(args.hf)
        else:
            config = ModelConfig(**QWEN3_30B_A3B)
        if args.layers is not None:
            if args.layers < 1:
                raise ValueError(f"--layers={args.layers}: need at least 1")
            config = config.replace(num_hidden_layers=args.layers)
        rows = floor_rows(config, batches, args.position, precisions=precisions,
                          kv_itemsize=jax.numpy.dtype(args.kv_cache_dtype).itemsize,
                          bandwidth=args.bandwidth_tbps * 1e12)
    except ValueError as e:
        print(f"floors: {e}", file=sys.stderr)
        return 2
    print(f"{config.num_hidden_layers} layers, {config.num_experts} experts top-"
          f"{config.num_experts_per_tok}, position {args.position}, KV {args.kv_cache_dtype}, "
          f"floors at {args.bandwidth_tbps} TB/s")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
