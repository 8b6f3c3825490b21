"""``python -m quads_jax.bench WHAT [args ...]``: one front door to the benchmarks.

WHAT is one of:

* ``kernels``: Pallas NVFP4 / FP8 kernels vs XLA baselines (``scripts/bench_kernels.py``; GPU);
* ``rollout``: the 30B-A3B-shaped rollout engine per precision (``scripts/bench_rollout.py``; GPU);
* ``trainer``: the trainer step, BF16 vs asymmetric QAT, expert matmuls on ``bf16_grouped`` or
  XLA (``quads_jax.train.bench``, ``--grouped kernel|xla|both``);
* ``numerics``: what the NVFP4 format costs (``scripts/nvfp4_report.py``; CPU is fine);
* ``floors``: the bytes a decode step must move per rollout precision, and the speed-ups they
  allow over bf16 and fp8 (``quads_jax.sampler.floors``; no GPU needed).

The remaining arguments go to that benchmark (``--help`` lists them). The scripts live in the
repository's ``scripts/`` folder, so this entry point needs a checkout (an editable install).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

SCRIPTS = {
    "kernels": "bench_kernels.py",
    "rollout": "bench_rollout.py",
    "numerics": "nvfp4_report.py",
}
MODULES = {"trainer": "quads_jax.train.bench", "floors": "quads_jax.sampler.floors"}
CHOICES = sorted([*SCRIPTS, *MODULES])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    what, rest = argv[0], argv[1:]
    if what not in CHOICES:
        print(f"quads_jax.bench: unknown benchmark {what!r}; choose one of {CHOICES}", file=sys.stderr)
        return 2
    sys.argv = [what, *rest]
    if what in MODULES:
        runpy.run_module(MODULES[what], run_name="__main__")
        return 0
    script = Path(__file__).resolve().parents[1] / "scripts" / SCRIPTS[what]
    if not script.is_file():
        print(
            f"quads_jax.bench: {script} not found; run from a checkout of quads-jax "
            "(pip install -e .)",
            file=sys.stderr,
        )
        return 2
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
