"""Metric logging: one call per step writes JSONL, TensorBoard events and a console line.

``metrics.jsonl`` (one JSON object per logged step, ``{"step": s, "phase": p, ...metrics}``) is
the ground truth that ``python -m quads_jax.plot`` and the tests read; TensorBoard event files sit
beside it for interactive use; the console shows a single rich progress line with ETA.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

# metric -> short label of the console line
CONSOLE_KEYS = {
    "sft/loss": "loss",
    "reward/mean": "reward",
    "eval/pass@1": "pass@1",
    "mismatch/max_abs_logp_gap": "max_gap",
    "mismatch/k3_kl": "k3",
}


def _plain(value: Any) -> float | int | str | None:
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    v = float(np.asarray(value))
    return v if math.isfinite(v) else str(v)  # JSON has no NaN / Inf literals


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``RUN_DIR/metrics.jsonl`` in order (last record wins on resumed steps)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


class MetricsLogger:
    """Writes ``metrics.jsonl`` + TensorBoard events under ``run_dir``; prints progress.

    Args:
      run_dir: output folder (created).
      total_steps: the number of steps of the phase being tracked (for the ETA).
      console: print a progress line per logged step.
      tensorboard: also write TensorBoard event files.
    """

    def __init__(
        self, run_dir: str, *, total_steps: int, console: bool = True, tensorboard: bool = True
    ):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.console = console
        self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a")  # noqa: SIM115
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
        self._phase_first: dict[str, tuple[int, float]] = {}
        self._phase_total: dict[str, int] = {}
        self._rich = None
        if console:
            from rich.console import Console

            self._rich = Console(highlight=False)

    def set_total(self, phase: str, total_steps: int) -> None:
        """Tell the logger how many steps ``phase`` has (for its ETA)."""
        self._phase_total[phase] = total_steps
        self._phase_first.pop(phase, None)

    def log(self, step: int, metrics: Mapping[str, Any], *, phase: str = "rl") -> None:
        """Record ``metrics`` of ``step`` (``phase`` tags SFT / RL / eval records)."""
        row = {"step": int(step), "phase": phase}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, float) and k != "step":
                    self._tb.add_scalar(f"{phase}/{k}" if phase == "sft" else k, v, step)
        if self.console:
            self._print(step, row, phase)

    def _print(self, step: int, row: Mapping[str, Any], phase: str) -> None:
        total = self._phase_total.get(phase, self.total_steps)
        first = self._phase_first.get(phase)
        if first is None:  # the ETA of each phase counts from its own first logged step
            self._phase_first[phase] = (step, time.perf_counter())
            eta = "    ?"
        else:
            per = (time.perf_counter() - first[1]) / max(step - first[0], 1)
            eta = f"{max(total - step, 0) * per:4.0f}s"
        width = 12
        filled = int(width * min(step / max(total, 1), 1.0))
        bar = "#" * filled + "." * (width - filled)
        shown = " ".join(
            f"{label}={row[k]:.3g}" for k, label in CONSOLE_KEYS.items()
            if isinstance(row.get(k), float)
        )
        line = f"{phase:>4} [{bar}] {step:>4}/{total:<4} eta {eta} {shown}"
        if self._rich is not None:
            self._rich.print(line, markup=False, soft_wrap=True)
        else:
            print(line, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
