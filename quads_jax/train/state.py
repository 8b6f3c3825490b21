"""The train state (one pytree: params, optimizer state, step, RNG, non-finite counters) and
the optimizer built from :class:`OptimizerConfig`."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from quads_jax.config import check, check_choice


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping and a warmup + constant / cosine schedule.

    Attributes:
      lr: peak learning rate.
      b1, b2, eps: Adam moments.
      weight_decay: decoupled decay, applied to matrices only (ndim >= 2), not norms / biases.
      grad_clip: global-norm clip (0 turns it off).
      warmup_steps: linear warmup from 0 to ``lr``.
      schedule: ``constant`` after warmup, or ``cosine`` decay to 10% over the run.
      max_nonfinite_in_a_row: stop training (after saving) when this many consecutive updates
        had a non-finite loss or gradient; each of them is skipped.
    """

    lr: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    max_nonfinite_in_a_row: int = 5

    def __post_init__(self) -> None:
        own = "OptimizerConfig"
        check(own, "lr", self.lr, 0.0 < self.lr <= 1.0, "a number in (0, 1]")
        check(own, "b1", self.b1, 0.0 <= self.b1 < 1.0, "a number in [0, 1)")
        check(own, "b2", self.b2, 0.0 <= self.b2 < 1.0, "a number in [0, 1)")
        check(own, "eps", self.eps, self.eps > 0.0, "a number > 0")
        check(own, "weight_decay", self.weight_decay, self.weight_decay >= 0.0, "a number >= 0")
        check(own, "grad_clip", self.grad_clip, self.grad_clip >= 0.0, "a number >= 0 (0: off)")
        check(own, "warmup_steps", self.warmup_steps, self.warmup_steps >= 0, "an integer >= 0")
        check_choice(own, "schedule", self.schedule, ("constant", "cosine"))
        check(own, "max_nonfinite_in_a_row", self.max_nonfinite_in_a_row,
              self.max_nonfinite_in_a_row >= 1, "an integer >= 1")


def make_optimizer(config: OptimizerConfig, total_updates: int) -> optax.GradientTransformation:
    """``clip_by_global_norm`` then AdamW with the configured schedule."""
    warm = max(config.warmup_steps, 0)
    if config.schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(
            0.0 if warm else config.lr, config.lr, max(warm, 1), max(total_updates, warm + 1),
            end_value=0.1 * config.lr,
        )
    elif warm:
        sched = optax.linear_schedule(0.0, config.lr, warm)
    else:
        sched = config.lr
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    chain = [optax.clip_by_global_norm(config.grad_clip)] if config.grad_clip > 0 else []
    chain.append(optax.adamw(sched, config.b1, config.b2, config.eps,
                             weight_decay=config.weight_decay, mask=decay_mask))
    return optax.chain(*chain)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a resume needs, as one pytree of arrays.

    Attributes:
      step: int32 ``[]``, optimizer updates applied (skipped ones not counted).
      params: the master weights (the model's nested dict).
      opt_state: the optax state of ``params``.
      rng: uint32 ``[2]``-like key data (``jax.random.key_data``), advanced by the loop.
      nonfinite_streak: int32 ``[]``, consecutive skipped updates.
      nonfinite_total: int32 ``[]``, all skipped updates.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    nonfinite_streak: jax.Array
    nonfinite_total: jax.Array


def create_train_state(params: Any, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    """A fresh state: step 0, ``optimizer.init(params)``, RNG from ``seed``."""
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731  (distinct buffers: all are donated)
    return TrainState(
        step=zero(),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(jax.random.key(seed)),
        nonfinite_streak=zero(),
        nonfinite_total=zero(),
    )


def split_rng(state: TrainState) -> tuple[TrainState, jax.Array]:
    """Advance the state's RNG; returns (new state, a fresh typed key)."""
    key = jax.random.wrap_key_data(state.rng)
    key, sub = jax.random.split(key)
    return dataclasses.replace(state, rng=jax.random.key_data(key)), sub


def train_state_shardings(state: TrainState, mesh, rules: str, model_config: Any) -> TrainState:
    """NamedShardings of every leaf of ``state`` (arrays or abstract values): params by the
    logical-axis rules, optimizer moments like their params, scalars replicated."""
    from quads_jax.train import mesh as mesh_lib

    p_sh = mesh_lib.param_shardings(state.params, mesh, rules, model_config)
    rep = mesh_lib.replicated(mesh)
    return TrainState(
        step=rep,
        params=p_sh,
        opt_state=mesh_lib.like_params_shardings(
            state.opt_state, jax.tree.structure(state.params), p_sh, mesh),
        rng=rep,
        nonfinite_streak=rep,
        nonfinite_total=rep,
    )
