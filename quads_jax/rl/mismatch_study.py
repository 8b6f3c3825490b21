"""The rollout-trainer mismatch of each precision arm at one fixed policy (QUADS_SPEC 1, 3, 4).

The RL loop measures the mismatch of the arm it trains, along a trajectory of its own; arms
then differ in their policies as much as in their engines. This study holds the policy fixed
(one master parameter tree) and, for every arm, syncs the rollout weights with the arm's
rollout recipe, samples responses with the rollout engine, and scores the same tokens with the
arm's trainer forward: what is left is the alignment of the two engines alone, which is what
QUADS changes (asymmetric QAT for the weights, RAC for the activations).

An arm is a ``train.config.ARMS`` name plus recipe overrides, written ``ARM`` or
``ARM:field=value,field=value`` (``quads:rac_ratio=0.25``, ``quads:rac_residual_format=bf16``):
the overrides go through ``TrainConfig`` (``recipe_overrides``), so they are checked as a
config's are.

Per arm, over all seeds' response tokens pooled: ``mismatch/*`` of
:func:`quads_jax.rl.diagnostics.mismatch_metrics`; per seed, ``mean_abs_logp_gap`` and
``k3_kl`` (their spread over seeds is the run-to-run noise); the rollout's pass rate on the
prompts (the deployed policy's accuracy under that precision). For an arm whose rollout
compensates (RAC), ``rac/block_fraction`` and ``rac/captured_energy``: the compensated share of
the expert GEMMs' K-blocks and of their residual energy (``rl.analysis``'s
``rac_block_fraction`` / ``rac_captured_energy``) over the first seed's sampled sequences (at
most ``ANALYSIS_ROWS``), one batch per expert: what the adaptive variant (``rac_energy_target``)
saves against its cap, where a kernel skips unselected blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from quads_jax import config as cfglib
from quads_jax import models
from quads_jax.rl import diagnostics
from quads_jax.rl.analysis import layer_error_analysis
from quads_jax.sampler import check_sync, sync
from quads_jax.sampler.calibration import calibrate, needs_calibration
from quads_jax.train.config import ARMS, TrainConfig
from quads_jax.train.loop import make_apply_fn, recipes
from quads_jax.train.rollout import rollout_and_score
from quads_jax.train.step import make_logprob_fn

# The arms of the default study: every ARMS entry, then QUADS' RAC ratio sweep (the
# published sweep's ratios), the BF16 residual (RAC's upper bound: no second rounding) and
# the static selection.
DEFAULT_ARMS = (
    "bf16", "fp8", "naive_nvfp4", "symmetric_qat", "qat_only", "w4a16",
    "quads:rac_ratio=0.125", "quads:rac_ratio=0.25", "quads", "quads:rac_ratio=0.75",
    "quads:rac_ratio=1.0", "quads:rac_residual_format=bf16", "quads:rac_selection=static",
)


@dataclasses.dataclass(frozen=True)
class StudyArm:
    """One trainer / rollout recipe pair.

    Attributes:
      spec: the arm as written (``ARM`` or ``ARM:field=value,...``); its label in tables.
      config: the base ``TrainConfig`` with ``arm`` and ``recipe_overrides`` set.
    """

    spec: str
    config: TrainConfig


def parse_arm(spec: str, base: TrainConfig, model_config: Any) -> StudyArm:
    """``ARM[:field=value,...]`` -> :class:`StudyArm` (a clear ``ValueError`` otherwise)."""
    name, _, rest = spec.partition(":")
    if name not in ARMS:
        raise ValueError(f"study arm {spec!r}: {name!r} is not an arm; one of {sorted(ARMS)}")
    overrides = dict(base.recipe_overrides)
    for item in filter(None, rest.split(",")):
        if "=" not in item:
            raise ValueError(f"study arm {spec!r}: override {item!r} is not field=value "
                             "(e.g. quads:rac_ratio=0.25)")
        keys, value = cfglib.parse_override(f"recipe_overrides.{item}")
        overrides[".".join(keys[1:])] = value
    # dataclasses.replace runs TrainConfig's checks: unknown fields, bad values.
    config = dataclasses.replace(base, arm=name, recipe_overrides=overrides)
    recipes(config, model_config)  # the recipes themselves check their values (e.g. rac_ratio range)
    return StudyArm(spec=spec, config=config)


def split_arms(text: str) -> list[str]:
    """Split on the commas that start a new arm: ``quads:a=1,b=2,bf16`` -> ``["quads:a=1,b=2",
    "bf16"]`` (a piece ``field=value`` continues the previous arm's overrides)."""
    arms: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if arms and ":" not in piece and "=" in piece:
            arms[-1] += "," + piece
        else:
            arms.append(piece)
    return arms


# Sampled sequences of the first seed that the RAC analysis runs on (one forward each way).
ANALYSIS_ROWS = 64


def _pooled_gaps(logp_rollout, logp_trainer, mask) -> tuple[np.ndarray, np.ndarray]:
    m = np.asarray(mask) > 0
    return np.asarray(logp_rollout, np.float64)[m], np.asarray(logp_trainer, np.float64)[m]


def measure_arm(
    params: Any,
    arm: StudyArm,
    examples: Sequence[Any],
    *,
    seeds: Sequence[int],
    model_config: Any,
    tokenizer: Any,
    sampler_config: Any,
    width: int | None = None,
    calibration_tokens: np.ndarray | None = None,
) -> dict[str, Any]:
    """The mismatch of ``arm`` at the policy ``params`` (the master tree).

    Args:
      params: master parameters (the trainer's).
      arm: the trainer / rollout recipe pair.
      examples: the prompts (task examples), each sampled ``sampler_config.n_samples`` times
        per seed.
      seeds: one rollout per seed (``jax.random.key(seed)``).
      width: pad every prompt batch to this many tokens (the loop's ``prompt_width``).
      calibration_tokens: int ``[B, T]``, for a rollout recipe with static choices.

    Returns:
      ``{"arm", "tokens", "pass_rate", "mismatch/...", "seeds": [{"seed", "pass_rate",
      "mismatch/mean_abs_logp_gap", "mismatch/k3_kl"}, ...]}``.
    """
    c = arm.config
    trainer_recipe, rollout_recipe = recipes(c, model_config)
    calibration = None
    if needs_calibration(rollout_recipe):
        if calibration_tokens is None:
            raise ValueError(f"study arm {arm.spec!r}: its rollout recipe is calibrated "
                             "(static choices) and needs calibration_tokens")
        calibration = calibrate(params, rollout_recipe, model_config=model_config,
                                tokens=calibration_tokens)
    rollout_params = sync(params, rollout_recipe, model_config=model_config,
                          calibration=calibration)
    check_sync(params, rollout_params, rollout_recipe, model_config=model_config)
    logprob_fn = jax.jit(make_logprob_fn(make_apply_fn(model_config, trainer_recipe)))
    pooled_r, pooled_t, per_seed, correct = [], [], [], []
    # RAC on the expert GEMMs (the sites the analysis reports; a model without MoE has none)
    compensates = any(rollout_recipe.mode_for(site) == "w4a4_nvfp4_rac"
                      for i in range(model_config.num_hidden_layers)
                      for site in models.layer_matmul_sites(model_config, i)
                      if site.endswith("experts.gate_up"))
    for seed in seeds:
        scored = rollout_and_score(
            rollout_params, examples, jax.random.key(seed), tokenizer=tokenizer,
            model_config=model_config, recipe=rollout_recipe, sampler_config=sampler_config,
            reward_config=c.reward, task_name=c.task.name, width=width)
        ro = scored.rollout
        batch = {"tokens": ro.tokens, "attention_mask": ro.attention_mask}
        logp_trainer, _ = logprob_fn(params, batch)
        r, t = _pooled_gaps(ro.logprobs, logp_trainer, ro.response_mask)
        m = diagnostics.mismatch_metrics(r, t, np.ones_like(r))
        per_seed.append({"seed": int(seed), "pass_rate": float(scored.correct.mean()),
                         **{k: m[k] for k in ("mismatch/mean_abs_logp_gap",
                                              "mismatch/k3_kl")}})
        pooled_r.append(r)
        pooled_t.append(t)
        correct.append(np.asarray(scored.correct, np.float64))
        if seed == seeds[0] and compensates:
            probe = (np.asarray(ro.tokens)[:ANALYSIS_ROWS],
                     np.asarray(ro.attention_mask, bool)[:ANALYSIS_ROWS])
            rac_stats = layer_error_analysis(params, model_config, trainer_recipe,
                                             rollout_recipe, probe)
    r, t = np.concatenate(pooled_r), np.concatenate(pooled_t)
    out = {"arm": arm.spec, "tokens": int(r.size),
           "pass_rate": float(np.concatenate(correct).mean())}
    if compensates:
        out["rac/block_fraction"] = rac_stats["analysis/rac_block_fraction"]
        out["rac/captured_energy"] = rac_stats["analysis/rac_captured_energy"]
    out.update(diagnostics.mismatch_metrics(r, t, np.ones_like(r)))
    out["seeds"] = per_seed
    return out


def run_study(
    params: Any,
    arms: Sequence[StudyArm],
    examples: Sequence[Any],
    *,
    seeds: Sequence[int],
    log=print,
    on_row=None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """:func:`measure_arm` for every arm, in order (same prompts and seeds for all).

    ``on_row(rows)``, when given, gets the rows measured so far after each arm (the CLI writes
    its files there, so a run cut off by a time limit keeps the arms it finished)."""
    rows = []
    for arm in arms:
        row = measure_arm(params, arm, examples, seeds=seeds, **kwargs)
        log(f"{arm.spec}: {row['tokens']} tokens, mean |gap| "
            f"{row['mismatch/mean_abs_logp_gap']:.4g}, k3 {row['mismatch/k3_kl']:.3g}, "
            f"max {row['mismatch/max_abs_logp_gap']:.3g}, pass {row['pass_rate']:.3f}")
        rows.append(row)
        if on_row is not None:
            on_row(list(rows))
    return rows


def seed_spread(row: dict[str, Any], key: str) -> float:
    """Standard deviation over seeds of a per-seed value (0 with one seed)."""
    values = np.asarray([s[key] for s in row["seeds"]], np.float64)
    return float(values.std(ddof=1)) if values.size > 1 else 0.0
