"""GRPO with rollout-trainer importance-sampling correction (QUADS_SPEC section 6).

Per response token ``t`` of sequence ``i`` (all log-probs are of the sampled token)::

    ratio  = exp(logp_new - logp_old)                       gradient flows through logp_new only
    w, keep = IS_MODES[is_mode](logp_old - logp_rollout)     stop-gradient; keep <= response mask
    pg     = -w * min(ratio * A_i, clip(ratio, 1 - eps_lo, 1 + eps_hi) * A_i)
    loss_t = pg + kl_beta * k3(logp_ref, logp_new) - entropy_coef * entropy_t
    loss   = token_mean: sum(loss_t * keep) / sum(keep)
             seq_mean:   mean over sequences with a kept token of sum_t(loss_t keep) / sum_t keep

``logp_old`` is the trainer's own recomputation (trainer recipe, QAT weights) before the update;
``logp_rollout`` comes from the sampler. The IS modes:

* ``none``: w = 1.
* ``token_tis``: w = min(rho_t, C), rho_t = exp(logp_old - logp_rollout)  (truncated IS).
* ``token_mis``: w = rho_t, tokens with rho_t > C masked out (they leave the denominator).
* ``seq_tis``: w = min(prod_t rho_t, C) for every token of the sequence.
* ``seq_mis``: w = prod_t rho_t; sequences with prod > C masked out.
* ``geo_mis``: w = geometric mean of rho_t over the sequence; sequences whose geometric mean is
  outside [1 / geo_cap, geo_cap] masked out. [I] (the spec leaves the weight open.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from quads_jax.config import check, check_choice

IsMode = Literal["none", "token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mis"]


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The GRPO objective and its rollout correction.

    Attributes:
      num_generations: G, responses sampled per prompt (one advantage group).
      eps_lo / eps_hi: the asymmetric clip range [1 - eps_lo, 1 + eps_hi] of the ratio.
      is_mode: a key of :data:`IS_MODES`.
      is_cap: C, the truncation / masking threshold of the token and sequence modes.
      geo_cap: the two-sided threshold of ``geo_mis`` on the geometric-mean ratio.
      loss_agg: ``token_mean`` (over all kept tokens of the mini-batch) or ``seq_mean``.
      std_normalize: divide advantages by the group std (Dr. GRPO turns this off).
      adv_eps: added to the group std.
      kl_beta: weight of the k3 KL to the reference policy (0: no reference pass).
      entropy_coef: weight of the entropy bonus (0: off; entropy is still reported).
    """

    num_generations: int = 8
    eps_lo: float = 0.2
    eps_hi: float = 0.28
    is_mode: IsMode = "token_tis"
    is_cap: float = 2.0
    geo_cap: float = 1.5
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    std_normalize: bool = True
    adv_eps: float = 1e-6
    kl_beta: float = 0.0
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        own = "GRPOConfig"
        check(own, "num_generations", self.num_generations, self.num_generations >= 2,
              "an integer >= 2 (a group needs two responses)")
        check(own, "eps_lo", self.eps_lo, 0.0 <= self.eps_lo < 1.0, "a number in [0, 1)")
        check(own, "eps_hi", self.eps_hi, 0.0 <= self.eps_hi <= 10.0, "a number in [0, 10]")
        check_choice(own, "is_mode", self.is_mode, tuple(IS_MODES))
        check(own, "is_cap", self.is_cap, self.is_cap >= 1.0, "a number >= 1")
        check(own, "geo_cap", self.geo_cap, self.geo_cap > 1.0, "a number > 1")
        check_choice(own, "loss_agg", self.loss_agg, ("token_mean", "seq_mean"))
        check(own, "adv_eps", self.adv_eps, self.adv_eps > 0.0, "a number > 0")
        check(own, "kl_beta", self.kl_beta, self.kl_beta >= 0.0, "a number >= 0")
        check(own, "entropy_coef", self.entropy_coef, self.entropy_coef >= 0.0, "a number >= 0")


def group_advantages(
    rewards: jax.Array, num_generations: int, *, std_normalize: bool = True, eps: float = 1e-6
) -> jax.Array:
    """Group-normalised advantages.

    Args:
      rewards: f32 ``[P * G]``, the G responses of each prompt contiguous.
    Returns:
      f32 ``[P * G]``: ``(r - mean_G) / (std_G + eps)`` (or without the division).
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or rewards.shape[0] % num_generations:
        raise ValueError(
            f"rewards shape {rewards.shape} is invalid; expected [P * G] with G={num_generations}"
        )
    groups = rewards.reshape(-1, num_generations)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if std_normalize:
        centred = centred / (groups.std(axis=1, keepdims=True) + eps)
    return centred.reshape(-1)


# --- IS-correction registry: (log_ratio [B,T], mask [B,T] f32, config) -> (w, keep) -------------
def _seq_log_ratio(log_ratio: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(log_ratio * mask, axis=1, keepdims=True)


def _is_none(log_ratio, mask, config):
    return jnp.ones_like(log_ratio), mask


def _is_token_tis(log_ratio, mask, config):
    # Clamp the exponent before exp so that huge gaps give C, never inf * 0 = nan.
    return jnp.exp(jnp.minimum(log_ratio, math.log(config.is_cap))), mask


def _is_token_mis(log_ratio, mask, config):
    keep = mask * (log_ratio <= math.log(config.is_cap))
    return jnp.exp(jnp.minimum(log_ratio, math.log(config.is_cap))) * keep, keep


def _is_seq_tis(log_ratio, mask, config):
    s = _seq_log_ratio(log_ratio, mask)
    return jnp.broadcast_to(jnp.exp(jnp.minimum(s, math.log(config.is_cap))), mask.shape), mask


def _is_seq_mis(log_ratio, mask, config):
    s = _seq_log_ratio(log_ratio, mask)
    keep = mask * (s <= math.log(config.is_cap))
    return jnp.exp(jnp.minimum(s, math.log(config.is_cap))) * keep, keep


def _is_geo_mis(log_ratio, mask, config):
    n = jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0)
    g = _seq_log_ratio(log_ratio, mask) / n
    keep = mask * (jnp.abs(g) <= math.log(config.geo_cap))
    return jnp.exp(jnp.clip(g, -math.log(config.geo_cap), math.log(config.geo_cap))) * keep, keep


IsFn = Callable[[jax.Array, jax.Array, GRPOConfig], tuple[jax.Array, jax.Array]]
IS_MODES: dict[str, IsFn] = {
    "none": _is_none,
    "token_tis": _is_token_tis,
    "token_mis": _is_token_mis,
    "seq_tis": _is_seq_tis,
    "seq_mis": _is_seq_mis,
    "geo_mis": _is_geo_mis,
}


def is_weights(
    logp_old: jax.Array, logp_rollout: jax.Array, mask: jax.Array, config: GRPOConfig
) -> tuple[jax.Array, jax.Array]:
    """Rollout-correction weights and kept-token mask, both f32 ``[B, T]``, no gradient."""
    mask = mask.astype(jnp.float32)
    # where, not multiply: padding positions may hold inf / garbage log-probs (inf * 0 = nan).
    log_ratio = jnp.where(mask > 0, (logp_old - logp_rollout).astype(jnp.float32), 0.0)
    log_ratio = jax.lax.stop_gradient(log_ratio)
    w, keep = IS_MODES[config.is_mode](log_ratio, mask, config)
    return jax.lax.stop_gradient(w), jax.lax.stop_gradient(keep)


def aggregate(values: jax.Array, keep: jax.Array, loss_agg: str) -> jax.Array:
    """Token-mean or sequence-mean of ``values [B, T]`` over the kept tokens."""
    if loss_agg == "token_mean":
        return jnp.sum(values * keep) / jnp.maximum(jnp.sum(keep), 1.0)
    per_seq_n = jnp.sum(keep, axis=1)
    per_seq = jnp.sum(values * keep, axis=1) / jnp.maximum(per_seq_n, 1.0)
    has = (per_seq_n > 0).astype(jnp.float32)
    return jnp.sum(per_seq * has) / jnp.maximum(jnp.sum(has), 1.0)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-prob and entropy of each token under the logits of the position before it.

    Args:
      logits: ``[B, T, V]`` (any float dtype; computed in f32).
      tokens: int ``[B, T]``.
    Returns:
      logp: f32 ``[B, T]``, ``logp[:, t] = log p(tokens[:, t] | tokens[:, :t])``, 0 at t = 0.
      entropy: f32 ``[B, T]``, entropy of the distribution that produced ``tokens[:, t]``.
    """
    logz = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(logz, tokens[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logz) * logz, axis=-1)
    pad = jnp.zeros_like(lp[:, :1])
    return jnp.concatenate([pad, lp], axis=1), jnp.concatenate([pad, ent], axis=1)


def grpo_loss(
    logp_new: jax.Array,
    logp_old: jax.Array,
    logp_rollout: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: GRPOConfig,
    *,
    logp_ref: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped, IS-corrected GRPO loss of one mini-batch.

    Args:
      logp_new: f32 ``[B, T]`` log-probs of the sampled tokens under the current params (the
        only input the gradient flows through).
      logp_old: f32 ``[B, T]`` trainer log-probs before this step's updates.
      logp_rollout: f32 ``[B, T]`` sampler log-probs.
      advantages: f32 ``[B]`` per-sequence advantages.
      mask: ``[B, T]`` 1 on response tokens.
      logp_ref: f32 ``[B, T]`` reference-policy log-probs (needed when ``kl_beta > 0``).
      entropy: f32 ``[B, T]`` per-token entropy (needed when ``entropy_coef > 0``).
    Returns:
      (scalar loss, metrics: ``loss/pg``, ``loss/kl``, ``loss/entropy``, ``rl/clip_frac``).
    """
    if logp_new.shape != logp_old.shape or logp_new.shape != mask.shape:
        raise ValueError(
            f"logp_new {logp_new.shape}, logp_old {logp_old.shape}, mask {mask.shape}: "
            "expected equal [B, T] shapes"
        )
    if config.kl_beta > 0 and logp_ref is None:
        raise ValueError(f"kl_beta={config.kl_beta} > 0 needs logp_ref; got None")
    mask = mask.astype(jnp.float32)
    logp_old = jax.lax.stop_gradient(logp_old.astype(jnp.float32))
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))[:, None]
    w, keep = is_weights(logp_old, logp_rollout, mask, config)

    log_ratio = jnp.where(mask > 0, logp_new.astype(jnp.float32) - logp_old, 0.0)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - config.eps_lo, 1.0 + config.eps_hi)
    pg = -w * jnp.minimum(ratio * adv, clipped * adv)
    per_token = pg
    metrics = {"loss/pg": aggregate(pg, keep, config.loss_agg)}

    if logp_ref is not None:
        d = jnp.where(mask > 0, jax.lax.stop_gradient(logp_ref.astype(jnp.float32)) - logp_new, 0.0)
        kl = jnp.exp(d) - d - 1.0
        per_token = per_token + config.kl_beta * kl
        metrics["loss/kl"] = aggregate(kl, keep, config.loss_agg)
    if entropy is not None:
        entropy = jnp.where(mask > 0, entropy.astype(jnp.float32), 0.0)
        per_token = per_token - config.entropy_coef * entropy
        metrics["loss/entropy"] = aggregate(jax.lax.stop_gradient(entropy), keep, config.loss_agg)
    elif config.entropy_coef > 0:
        raise ValueError(f"entropy_coef={config.entropy_coef} > 0 needs entropy; got None")

    per_token = jnp.where(keep > 0, per_token, 0.0)
    loss = aggregate(per_token, keep, config.loss_agg)
    was_clipped = (ratio * adv > clipped * adv).astype(jnp.float32)
    metrics["rl/clip_frac"] = jax.lax.stop_gradient(
        jnp.sum(was_clipped * keep) / jnp.maximum(jnp.sum(keep), 1.0)
    )
    metrics["loss/total"] = jax.lax.stop_gradient(loss)
    return loss, metrics
