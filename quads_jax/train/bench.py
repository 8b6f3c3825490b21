"""Trainer-step benchmark: ``python -m quads_jax.train.bench [--config PATH] [--batch B]
[--seq T] [--recipes bf16,trainer_qat] [--repeats N] [--grouped kernel|xla|both]
[--dw kernel|xla] [--profile-top N]``.

Times one jitted RL update (M mini-batch updates in one scan: forward, GRPO loss, backward,
AdamW) on random tokens for each trainer recipe, reports the median over repeats, tokens/s,
model FLOP utilisation against a measured BF16 matmul rate, and each recipe's ratio to the
first (the asymmetric-QAT overhead when the recipes are ``bf16,trainer_qat``).
``--grouped`` picks the expert matmuls on a GPU: ``kernel`` (``pallas_kernels.bf16_grouped``,
the default), ``xla`` (XLA's ``ragged_dot``, what ran before it) or ``both`` (each recipe
twice; the first update's losses of the two are compared: same params, same batch);
``--dw`` its backward's dW (our ``ragged_contract`` or XLA's ``ragged_dot_general``);
``--profile-top N`` traces one more update per arm and adds its N costliest kernels
(``quads_jax.profiling``) to the arm's row.

FLOPs per token: ``6 * active_params + 12 * layers * seq * q_heads * head_dim`` (forward +
backward of the matmuls, causal attention counted in full as is the convention).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax import config as cfglib
from quads_jax import models, profiling
from quads_jax.quant import kernel_backend
from quads_jax.quant.recipe import get_recipe
from quads_jax.rl.grpo import GRPOConfig
from quads_jax.tokenizers import CharTokenizer
from quads_jax.train.config import TrainConfig
from quads_jax.train.loop import make_apply_fn
from quads_jax.train.state import OptimizerConfig, create_train_state, make_optimizer
from quads_jax.train.step import make_update_fn, rl_loss_fn, split_minibatches


def active_params(c) -> int:
    """Parameters one token touches (top-k experts only), embeddings excluded."""
    attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    moe = 3 * c.hidden_size * c.moe_intermediate_size * c.num_experts_per_tok
    moe += c.hidden_size * c.num_experts
    dense = 3 * c.hidden_size * c.intermediate_size
    per_layer = [attn + (moe if k == "moe" else dense) for k in c.layer_kinds]
    return sum(per_layer) + c.hidden_size * c.vocab_size  # lm_head matmul


def total_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    """Measured BF16 dense matmul rate (the MFU denominator), TFLOP/s."""
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda a: (a @ a).astype(jnp.float32).sum())
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e12


def random_batch(rng: np.random.Generator, rows: int, seq: int, vocab: int, prompt: int):
    tokens = rng.integers(3, vocab, (rows, seq)).astype(np.int32)
    mask = np.zeros((rows, seq), np.float32)
    mask[:, prompt:] = 1
    logp = -rng.uniform(0.1, 3.0, (rows, seq)).astype(np.float32)
    return {"tokens": tokens, "attention_mask": np.ones((rows, seq), bool), "mask": mask,
            "logp_old": logp, "logp_rollout": logp + rng.normal(0, 0.05, logp.shape).astype(
                np.float32), "advantages": rng.normal(0, 1, rows).astype(np.float32)}


def bench_recipe(model_config, params, recipe_name, batch, minibatches, repeats,
                 grouped: str = "kernel", dw_kernel: bool = True, profile_top: int = 0):
    # read when the update is traced
    kernel_backend.set_bf16_grouped(grouped == "kernel", dw_kernel=dw_kernel)
    recipe = get_recipe(recipe_name)
    opt = make_optimizer(OptimizerConfig(lr=1e-6), 100)
    update = jax.jit(make_update_fn(rl_loss_fn(make_apply_fn(model_config, recipe),
                                               GRPOConfig(num_generations=2)), opt),
                     donate_argnums=0)
    # a fresh copy per recipe: the update donates (deletes) the state it is given
    state = create_train_state(jax.tree.map(jnp.copy, params), opt, 0)
    dev_batch = jax.device_put(split_minibatches(batch, minibatches))
    t0 = time.perf_counter()
    state, m = update(state, dev_batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    first_loss = float(m["train/loss"])
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        state, m = update(state, dev_batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    profile = None
    if profile_top > 0:  # one more update, traced: where its device time goes

        def run():
            nonlocal state, m
            state, m = update(state, dev_batch)
            jax.block_until_ready(m)

        # GPU planes only: a CPU run has no device kernels, and reports an empty profile
        profile = profiling.trace(run, f"train_{recipe_name}_{grouped}", top=profile_top)
        print(f"profile {recipe_name} {grouped}:\n{profiling.format_summary(profile)}",
              file=sys.stderr, flush=True)
    kernel_backend.set_bf16_grouped()
    # what ran: the kernels need a GPU (recipe backend "auto"); elsewhere both arms are XLA's
    ran = "xla"
    if grouped == "kernel" and jax.default_backend() == "gpu":
        ran = "bf16_grouped" + (" + ragged_contract" if dw_kernel else ", dW XLA")
    return {"recipe": recipe_name, "grouped": grouped, "grouped_ran": ran, "compile_s": compile_s,
            "median_s": statistics.median(times), "min_s": min(times),
            "first_loss": first_loss, "loss": float(m["train/loss"]),
            **({"profile": profile} if profile is not None else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m quads_jax.train.bench", description=__doc__)
    p.add_argument("--config", default="configs/small_gpu_base.yaml")
    p.add_argument("--batch", type=int, default=32, help="sequences per RL update")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--recipes", default="bf16,trainer_qat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--grouped", default="kernel", choices=("kernel", "xla", "both"),
                   help="expert matmuls on a GPU: bf16_grouped, XLA ragged_dot, or both")
    p.add_argument("--dw", default="kernel", choices=("kernel", "xla"),
                   help="bf16_grouped's dW: our ragged_contract kernel (the default) or XLA's "
                        "ragged_dot_general")
    p.add_argument("--profile-top", type=int, default=0,
                   help="trace one more update per arm and report its N costliest kernels")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = cfglib.load(TrainConfig, args.config, args.overrides)
    tok = CharTokenizer()
    mc = cfg.model.config
    if cfg.model.tokenizer == "char":
        mc = cfglib.from_dict(type(mc), {**cfglib.to_dict(mc), "vocab_size": tok.vocab_size})
    params = models.init_params(mc, jax.random.key(0))
    batch = random_batch(np.random.default_rng(0), args.batch, args.seq, mc.vocab_size,
                         args.seq // 4)
    peak = matmul_tflops() if jax.default_backend() == "gpu" else float("nan")
    tokens = args.batch * args.seq
    flops_tok = 6 * active_params(mc) + 12 * mc.num_hidden_layers * args.seq * \
        mc.num_attention_heads * mc.head_dim
    rows = []
    arms = ("kernel", "xla") if args.grouped == "both" else (args.grouped,)
    for name, grouped in ((n, g) for n in args.recipes.split(",") for g in arms):
        r = bench_recipe(mc, params, name, batch, args.minibatches, args.repeats, grouped,
                         args.dw == "kernel", args.profile_top)
        if grouped == "xla" and len(arms) == 2:  # same params and batch: the same first loss
            r["first_loss_rel_diff_to_kernel"] = abs(r["first_loss"] - rows[-1]["first_loss"]) \
                / max(abs(rows[-1]["first_loss"]), 1e-30)
            r["kernel_speedup"] = r["median_s"] / rows[-1]["median_s"]
        r["tokens_per_s"] = tokens / r["median_s"]
        r["tflops"] = flops_tok * tokens / r["median_s"] / 1e12
        r["mfu_vs_measured_matmul"] = r["tflops"] / peak
        r["ratio_to_first"] = r["median_s"] / (rows[0]["median_s"] if rows else r["median_s"])
        rows.append(r)
    out = {"device": str(jax.devices()[0].device_kind), "params": total_params(params),
           "active_params": active_params(mc), "batch": args.batch, "seq": args.seq,
           "minibatches": args.minibatches, "matmul_tflops": peak, "results": rows}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
