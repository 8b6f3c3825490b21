"""``python -m quads_jax.train --config configs/NAME.yaml [key=value ...]``: SFT + RL.

Overrides are dotted keys into the config (``rl.steps=5``, ``grpo.is_mode=token_mis``,
``arm=bf16``). At the end a short table compares reward and pass@1 before and after RL and
shows the rollout-trainer mismatch; plots go to ``RUN_DIR/plots``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from quads_jax import config as cfglib
from quads_jax import xla_runtime
from quads_jax.train.config import TrainConfig


def _table(summary: dict, run_dir: str, seconds: float, max_new_tokens: int) -> None:
    from rich.console import Console
    from rich.table import Table

    before, after, last = (summary.get(k, {}) for k in ("before", "after", "last"))
    table = Table(title=f"quads-jax run: arm={summary.get('arm')}  ({seconds:.0f} s)")
    table.add_column("metric")
    table.add_column("before RL", justify="right")
    table.add_column("after RL", justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    table.add_row("eval pass@1 (held-out)", fmt(before.get("eval/pass@1")),
                  fmt(after.get("eval/pass@1")))
    table.add_row("eval reward", fmt(before.get("eval/reward")), fmt(after.get("eval/reward")))
    table.add_row("train reward (last step)", "-", fmt(last.get("reward/mean")))
    table.add_row("mismatch max |logp gap|", "-", fmt(last.get("mismatch/max_abs_logp_gap")))
    table.add_row("mismatch k3 KL", "-", fmt(last.get("mismatch/k3_kl")))
    console = Console()
    console.print(table)
    console.print(f"files: metrics {run_dir}/metrics.jsonl, TensorBoard {run_dir}/tb, "
                  f"checkpoints {run_dir}/checkpoints, plots {run_dir}/plots, "
                  f"summary {run_dir}/summary.json")
    console.print(f"sample the trained policy: python -m quads_jax.sample --checkpoint {run_dir} "
                  f"--max-new-tokens {max_new_tokens} --prompt TEXT [--precision nvfp4_rac]",
                  markup=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quads_jax.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    xla_runtime.add_autotune_cache_argument(parser)
    args = parser.parse_args(argv)
    try:
        config = cfglib.load(TrainConfig, args.config, args.overrides)
        if args.autotune_cache is not None:
            xla_runtime.use_autotune_cache(args.autotune_cache)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    from quads_jax.train.loop import Trainer, TrainingStopped

    start = time.perf_counter()
    trainer = Trainer(config)
    try:
        summary = trainer.run()
    except TrainingStopped as err:
        print(f"STOPPED: {err}", file=sys.stderr)
        return 3
    finally:
        trainer.close()
    if not args.no_plots:
        from quads_jax.plot import plot_runs

        plot_runs([config.run_dir], os.path.join(config.run_dir, "plots"))
    _table(summary, os.path.abspath(config.run_dir), time.perf_counter() - start,
           config.rollout.max_new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
