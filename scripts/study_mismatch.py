"""The rollout-trainer mismatch of every precision arm at one fixed policy.

    python scripts/study_mismatch.py --run-dir runs/tiny_cpu [--arms ...] [--prompts 256]
    python scripts/study_mismatch.py --config configs/tiny_cpu.yaml [key=value ...]

The policy is a train run's latest checkpoint (``--run-dir``, e.g. what ``make demo`` leaves)
or, with ``--config``, the config's SFT warm start run here. Every arm samples the same prompts
with the same seeds; its trainer forward scores the sampled tokens
(``quads_jax.rl.mismatch_study``). Writes ``OUT/study.json`` (every number, per seed too),
``OUT/study.md`` (the table) and ``OUT/mismatch.png``, rewritten after every arm
(``"complete"`` in the JSON says whether every arm ran), and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from quads_jax import config as cfglib
from quads_jax.rl import mismatch_study as study
from quads_jax.train.config import TrainConfig

COLUMNS = ("arm", "trainer / rollout", "tokens", "mean |gap|", "p99 |gap|", "max |gap|",
           "k3 KL", "pass rate", "RAC blocks")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="a quads_jax.train run: its latest checkpoint's params")
    src.add_argument("--config", help="a train YAML: run its SFT warm start for the policy")
    p.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    p.add_argument("--arms", default=",".join(study.DEFAULT_ARMS),
                   help="comma-separated ARM[:field=value,...] list (an arm's further "
                        "overrides follow its own commas; default: %(default)s)")
    p.add_argument("--prompts", type=int, default=256, help="training prompts sampled")
    p.add_argument("--samples", type=int, default=8, help="responses per prompt and seed")
    p.add_argument("--seeds", default="0,1,2", help="rollout seeds (comma-separated)")
    p.add_argument("--out", default="runs/study_mismatch", help="output folder")
    return p


def _base_config(args) -> TrainConfig:
    extra = [*args.overrides, f"run_dir={os.path.join(args.out, 'policy')}", "console=false",
             # the sampler's n_samples is set from --samples directly; the GRPO group size
             # only has to be valid (>= 2) for the config to load
             "tensorboard=false", f"grpo.num_generations={max(args.samples, 2)}"]
    if args.run_dir:
        path = os.path.join(args.run_dir, "config.json")
        if not os.path.exists(path):
            raise ValueError(f"--run-dir {args.run_dir!r} has no config.json; is it a "
                             "quads_jax.train run?")
        with open(path) as f:
            data = json.load(f)
        return cfglib.from_dict(TrainConfig, cfglib.apply_overrides(data, extra))
    return cfglib.load(TrainConfig, args.config, extra)


def _cell(row: dict, key: str, spread: bool = False) -> str:
    text = f"{row[key]:.4g}"
    if spread and len(row["seeds"]) > 1:  # one seed has no spread to show
        text += f" ± {study.seed_spread(row, key):.2g}"
    return text


def table_rows(rows: list[dict], arms: list) -> list[list[str]]:
    out = []
    for row, arm in zip(rows, arms, strict=True):
        trainer, rollout = arm.config.recipe_names
        out.append([row["arm"], f"{trainer} / {rollout}", str(row["tokens"]),
                    _cell(row, "mismatch/mean_abs_logp_gap", True),
                    _cell(row, "mismatch/p99_abs_logp_gap"),
                    _cell(row, "mismatch/max_abs_logp_gap"),
                    _cell(row, "mismatch/k3_kl", True), f"{row['pass_rate']:.3f}",
                    f"{row['rac/block_fraction']:.3f}" if "rac/block_fraction" in row else "-"])
    return out


def write_outputs(out: str, header: dict, rows: list[dict], cells: list[list[str]]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "study.json"), "w") as f:
        json.dump({**header, "rows": rows}, f, indent=1)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    with open(os.path.join(out, "study.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["arm"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.35 * len(rows) + 1.5), sharey=True)
    for ax, key, title in ((axes[0], "mismatch/mean_abs_logp_gap", "mean |logp gap|"),
                           (axes[1], "mismatch/k3_kl", "k3 KL")):
        values = [max(r[key], 1e-12) for r in rows]
        ax.barh(labels, values, xerr=[study.seed_spread(r, key) for r in rows])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(title)
    axes[0].invert_yaxis()  # the y axis is shared: once puts the first arm on top
    fig.suptitle(f"rollout-trainer mismatch at one policy ({header['policy']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "mismatch.png"), dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"--seeds {args.seeds!r}: expected comma-separated integers "
                             "(e.g. 0,1,2)") from None
        if not seeds or args.prompts < 1 or args.samples < 1:
            raise ValueError(f"need >= 1 seed, prompt and sample; got --seeds {args.seeds!r}, "
                             f"--prompts {args.prompts}, --samples {args.samples}")
        base = _base_config(args)
    except (ValueError, OSError) as err:
        print(f"study_mismatch: {err}", file=sys.stderr)
        return 2

    from quads_jax.export import restore_params
    from quads_jax.train.loop import Trainer
    from quads_jax.train.rollout import calibration_batch

    start = time.perf_counter()
    trainer = Trainer(base)
    try:
        arms = [study.parse_arm(a, base, trainer.model_config) for a in study.split_arms(args.arms)]
        if args.run_dir:
            run_model, params, step = restore_params(args.run_dir)
            # Only the compute dtype may differ from the run's model (bf16 engines on the CPU).
            same = dataclasses.replace(run_model, dtype=trainer.model_config.dtype)
            if same != trainer.model_config:
                diff = sorted(f.name for f in dataclasses.fields(same)
                              if getattr(same, f.name) != getattr(trainer.model_config, f.name))
                raise ValueError(f"overrides change the run's model in {diff}; with --run-dir "
                                 "only model.config.dtype (the compute dtype) may change")
            policy = f"{os.path.abspath(args.run_dir)} step {step}"
        elif base.sft.steps > 0:
            params = trainer.run_sft(trainer.initial_params)
            policy = f"SFT warm start of {args.config} ({base.sft.steps} steps, arm {base.arm})"
        else:
            params = trainer.initial_params
            policy = f"random init of {args.config} (seed {base.seed})"
    except ValueError as err:
        print(f"study_mismatch: {err}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
    examples = trainer.splits.train[: args.prompts]
    sampler = dataclasses.replace(trainer.sampler_config, n_samples=args.samples)
    header = {"policy": policy, "prompts": len(examples), "samples": args.samples,
              "seeds": seeds, "temperature": sampler.temperature,
              "max_new_tokens": sampler.max_new_tokens}

    def write(rows: list[dict]) -> None:
        # after every arm: a run cut off by a time limit keeps what it measured ("complete")
        write_outputs(args.out, {**header, "complete": len(rows) == len(arms),
                                 "arms": [a.spec for a in arms],
                                 "seconds": time.perf_counter() - start},
                      rows, table_rows(rows, arms[:len(rows)]))

    rows = study.run_study(
        params, arms, examples, seeds=seeds, model_config=trainer.model_config,
        tokenizer=trainer.tokenizer, sampler_config=sampler, width=trainer.prompt_width,
        calibration_tokens=calibration_batch(trainer.tokenizer, trainer.splits.train,
                                             base.rollout.calibration_prompts), on_row=write)
    header["seconds"] = time.perf_counter() - start
    cells = table_rows(rows, arms)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mismatch at one policy: {policy}")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("arm", "trainer / rollout") else "right")
    for c in cells:
        table.add_row(*c)
    Console(width=160).print(table)
    print(f"files: {args.out}/study.json, study.md, mismatch.png "
          f"({header['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
