"""The jitted, sharded train step: scan over mini-batches, AdamW, non-finite skip.

One call of the update function performs ``M`` optimizer updates, one per mini-batch of a
``[M, mb, ...]`` batch, inside a single ``lax.scan`` (one dispatch per RL step). An update whose
loss or gradient norm is non-finite is skipped: params and optimizer state keep their values,
``nonfinite_streak`` / ``nonfinite_total`` count it, and the loop stops training after
``max_nonfinite_in_a_row`` in a row.

An ``apply_fn(params, tokens, attention_mask) -> (logits [B, T, V], aux_loss [])`` is the only
thing the step knows about the model: the loop builds it from ``quads_jax.models.forward`` with
the trainer recipe (BF16, asymmetric QAT, FP8 fake-quant, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from quads_jax.rl.grpo import GRPOConfig, aggregate, grpo_loss, token_logprobs
from quads_jax.train.state import TrainState

Batch = dict[str, jax.Array]
ApplyFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
LossFn = Callable[[Any, Batch], tuple[jax.Array, dict[str, jax.Array]]]


def rl_loss_fn(apply_fn: ApplyFn, config: GRPOConfig, aux_loss_coef: float = 0.0) -> LossFn:
    """GRPO loss of one mini-batch.

    The mini-batch holds ``tokens`` int32 ``[b, T]``, ``attention_mask`` ``[b, T]``, ``mask``
    (response tokens) ``[b, T]``, ``logp_old`` / ``logp_rollout`` f32 ``[b, T]``, ``advantages``
    f32 ``[b]`` and optionally ``logp_ref`` f32 ``[b, T]``.
    """

    def loss_fn(params, mb: Batch):
        logits, aux = apply_fn(params, mb["tokens"], mb["attention_mask"])
        logp, entropy = token_logprobs(logits, mb["tokens"])
        loss, metrics = grpo_loss(
            logp, mb["logp_old"], mb["logp_rollout"], mb["advantages"], mb["mask"], config,
            logp_ref=mb.get("logp_ref"), entropy=entropy,
        )
        if aux_loss_coef:
            loss = loss + aux_loss_coef * aux
        metrics["rl/entropy"] = aggregate(jax.lax.stop_gradient(entropy),
                                          mb["mask"].astype(jnp.float32), "token_mean")
        return loss, metrics

    return loss_fn


def sft_loss_fn(apply_fn: ApplyFn, aux_loss_coef: float = 0.0) -> LossFn:
    """Token-mean cross-entropy on the demonstration tokens (``mask`` = 1 on the completion)."""

    def loss_fn(params, mb: Batch):
        logits, aux = apply_fn(params, mb["tokens"], mb["attention_mask"])
        logp, _ = token_logprobs(logits, mb["tokens"])
        mask = mb["mask"].astype(jnp.float32)
        nll = -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        loss = nll + aux_loss_coef * aux if aux_loss_coef else nll
        return loss, {"sft/loss": nll, "sft/aux_loss": aux}

    return loss_fn


def make_update_fn(
    loss_fn: LossFn, optimizer: optax.GradientTransformation
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """``update(state, batch[M, mb, ...]) -> (state, metrics)``, M updates in one scan.

    Metrics are means over the M mini-batches, plus ``train/grad_norm`` (pre-clip),
    ``train/skipped`` (updates skipped in this call) and the state's counters.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def one_update(state: TrainState, mb: Batch):
        (loss, metrics), grads = grad_fn(state.params, mb)
        gnorm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(  # noqa: E731
            lambda a, b: jnp.where(finite, a, b), new, old)
        skipped = (~finite).astype(jnp.int32)
        state = dataclasses.replace(
            state,
            step=state.step + (1 - skipped),
            params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state),
            nonfinite_streak=jnp.where(finite, 0, state.nonfinite_streak + 1),
            nonfinite_total=state.nonfinite_total + skipped,
        )
        metrics = dict(metrics, **{"train/loss": loss, "train/grad_norm": gnorm,
                                   "train/skipped": skipped.astype(jnp.float32)})
        return state, metrics

    def update(state: TrainState, batch: Batch):
        state, per_mb = jax.lax.scan(one_update, state, batch)
        metrics = {k: jnp.mean(v) for k, v in per_mb.items()}
        metrics["train/skipped"] = jnp.sum(per_mb["train/skipped"])
        metrics["train/nonfinite_streak"] = state.nonfinite_streak
        metrics["train/nonfinite_total"] = state.nonfinite_total
        return state, metrics

    return update


def make_logprob_fn(apply_fn: ApplyFn) -> Callable[[Any, Batch], tuple[jax.Array, jax.Array]]:
    """``(params, batch) -> (logp [B, T], entropy [B, T])`` without gradient (the trainer's
    ``logp_old``: same recipe as the loss, never the rollout's numbers)."""

    def logprobs(params, batch: Batch):
        logits, _ = apply_fn(params, batch["tokens"], batch["attention_mask"])
        return token_logprobs(logits, batch["tokens"])

    return logprobs


def split_minibatches(batch: Batch, num_minibatches: int) -> Batch:
    """``[B, ...] -> [M, B / M, ...]`` for every array of ``batch``."""

    def split(x):
        if x.shape[0] % num_minibatches:
            raise ValueError(
                f"batch size {x.shape[0]} is not divisible by num_minibatches={num_minibatches}"
            )
        return x.reshape(num_minibatches, x.shape[0] // num_minibatches, *x.shape[1:])

    return jax.tree.map(split, batch)


def jit_sharded(update, state_shardings: Any, batch_shardings: Any, mesh) -> Callable:
    """``jax.jit`` of ``update`` with explicit in / out shardings; the state is donated."""
    from quads_jax.train.mesh import replicated

    return jax.jit(
        update,
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated(mesh)),
        donate_argnums=(0,),
    )
