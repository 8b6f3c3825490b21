"""``python -m quads_jax.plot RUN_DIR [RUN_DIR ...] [--out DIR]``: PNG plots over RL steps.

One PNG per metric (reward, eval pass@1, ``mismatch/max_abs_logp_gap``,
``mismatch/mean_abs_logp_gap``, ``mismatch/k3_kl``), one line per run (arms overlaid, labelled
by the run's arm and folder name). Reads ``RUN_DIR/metrics.jsonl``; a resumed run's repeated
steps keep their last record. ``--smooth N`` draws each per-step series as its trailing mean
over N steps (the raw values faint behind it): per-step mismatch is noisy, and arms overlaid
are hard to tell apart without it. Evaluations (every ``eval_every`` steps) are never smoothed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from quads_jax.metrics_log import read_metrics

PLOTS = {
    "reward": "reward/mean",
    "pass_at_1": "eval/pass@1",
    "max_abs_logp_gap": "mismatch/max_abs_logp_gap",
    "mean_abs_logp_gap": "mismatch/mean_abs_logp_gap",
    "k3_kl": "mismatch/k3_kl",
}
UNSMOOTHED = ("eval/pass@1",)


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    if window < 1:
        raise ValueError(f"smoothing window={window}: must be >= 1")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def series(run_dir: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` in the run's RL and eval records (last record per step)."""
    by_step: dict[int, float] = {}
    for row in read_metrics(run_dir):
        if row.get("phase") in ("rl", "eval") and isinstance(row.get(key), (int, float)):
            by_step[int(row["step"])] = float(row[key])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _label(run_dir: str) -> str:
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            arm = json.load(f).get("arm", "?")
    except OSError:
        arm = "?"
    return f"{arm} ({os.path.basename(os.path.normpath(run_dir))})"


def plot_runs(run_dirs: Sequence[str], out_dir: str, smooth: int = 1) -> list[str]:
    """Write one PNG per metric of :data:`PLOTS` into ``out_dir``; returns their paths.
    ``smooth`` > 1: per-step series as trailing means over that many steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for d in run_dirs:
        if not os.path.exists(os.path.join(d, "metrics.jsonl")):
            raise ValueError(f"run dir {d!r} has no metrics.jsonl")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, key in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for d in run_dirs:
            steps, values = series(d, key)
            if not steps:
                continue
            if smooth > 1 and key not in UNSMOOTHED:
                raw = ax.plot(steps, values, linewidth=0.6, alpha=0.25)[0]
                ax.plot(steps, trailing_mean(values, smooth), color=raw.get_color(),
                        label=f"{_label(d)}, mean of {smooth}")
            else:
                ax.plot(steps, values, marker="o", markersize=3, label=_label(d))
        ax.set_xlabel("RL step")
        ax.set_ylabel(key)
        ax.set_title(key)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        path = os.path.join(out_dir, f"{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quads_jax.plot", description=__doc__)
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots of "
                        "the first run, or ./plots for several)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="draw per-step metrics as trailing means over N steps")
    args = parser.parse_args(argv)
    out = args.out or (os.path.join(args.run_dirs[0], "plots") if len(args.run_dirs) == 1
                       else "plots")
    try:
        if args.smooth < 1:
            raise ValueError(f"--smooth={args.smooth}: must be >= 1")
        paths = plot_runs(args.run_dirs, out, smooth=args.smooth)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
