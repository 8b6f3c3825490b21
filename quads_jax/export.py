"""``python -m quads_jax.export RUN_DIR --out DIR [--step N] [--format orbax|hf|both]``.

Takes the params of a training checkpoint (the latest complete one, or ``--step``) and writes
a params-only Orbax checkpoint (``DIR/params`` and the model's ``DIR/config.json``: what
``python -m quads_jax.sample --checkpoint DIR`` loads) and/or an HF safetensors checkpoint
(``DIR/hf``, loadable by transformers' ``Qwen3MoeForCausalLM.from_pretrained``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import jax


def restore_params(run_dir: str, step: int | None = None) -> tuple[Any, dict, int]:
    """``(model_config, params, step)`` of a run's checkpoint (latest complete by default)."""
    from quads_jax import config as cfglib
    from quads_jax import models
    from quads_jax.train.checkpoint import CheckpointConfig, Checkpointer
    from quads_jax.train.config import TrainConfig
    from quads_jax.train.state import create_train_state, make_optimizer

    for name in ("config.json", "model_config.json"):
        if not os.path.exists(os.path.join(run_dir, name)):
            raise ValueError(f"run_dir={run_dir!r} has no {name}; is it a quads_jax.train run?")
    with open(os.path.join(run_dir, "config.json")) as f:
        train_config = cfglib.from_dict(TrainConfig, json.load(f))
    with open(os.path.join(run_dir, "model_config.json")) as f:
        model_config = cfglib.from_dict(models.ModelConfig, json.load(f))
    ck = Checkpointer(os.path.join(run_dir, "checkpoints"), CheckpointConfig(async_save=False))
    try:
        steps = ck.complete_steps()
        if not steps:
            raise ValueError(f"run_dir={run_dir!r} has no complete checkpoint")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise ValueError(f"step={step}: run_dir={run_dir!r} has complete checkpoints at "
                             f"steps {steps} only")
        opt = make_optimizer(train_config.optimizer, 1)
        abstract = jax.eval_shape(
            lambda: create_train_state(models.init_params(model_config, jax.random.key(0)), opt, 0))
        state, _ = ck.restore(step, abstract)
    finally:
        ck.close()
    return model_config, state.params, step


def export(run_dir: str, out: str, *, step: int | None = None, fmt: str = "both") -> list[str]:
    """Write the params of ``run_dir``'s checkpoint to ``out``; returns the written folders."""
    import orbax.checkpoint as ocp

    from quads_jax.models import save_hf

    if fmt not in ("orbax", "hf", "both"):
        raise ValueError(f"format={fmt!r} is invalid; allowed: orbax, hf, both")
    model_config, params, step = restore_params(run_dir, step)
    written = []
    if fmt in ("orbax", "both"):
        path = os.path.abspath(os.path.join(out, "params"))
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, params)
        # The model config beside it, as HF writes it: ``out`` is then a params-only checkpoint
        # that ``python -m quads_jax.sample --checkpoint out`` loads (``models.read_config``).
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(model_config.to_hf_dict(), f, indent=2)
        written.append(path)
    if fmt in ("hf", "both"):
        path = os.path.abspath(os.path.join(out, "hf"))
        save_hf(model_config, params, path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quads_jax.export", description=__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--format", default="both", choices=("orbax", "hf", "both"))
    args = parser.parse_args(argv)
    try:
        paths = export(args.run_dir, args.out, step=args.step, fmt=args.format)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
