"""Token sampling: temperature, top-k, top-p (nucleus), greedy, and the log-prob of the pick.

The log-prob returned with every token is the log of its probability under the distribution the
token was *actually drawn from*: logits divided by the temperature, restricted to the top-k /
top-p candidates, renormalised. That is the `logp_rollout` of the RL objective (QUADS_SPEC
section 6); with no filtering it equals ``log_softmax(logits / temperature)`` at the token.
Greedy decoding picks the mode of that same distribution and reports the same log-prob, so a
greedy rollout still carries a meaningful `logp_rollout`.

Top-k works in the k-candidate subspace (``lax.top_k``, then sample among k), so the full vocab
is never sorted when k is set; top-p alone sorts the vocab once per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one token is picked from logits.

    Attributes:
      temperature: > 0; logits are divided by it before everything else.
      top_k: keep the k most likely tokens; 0 keeps all.
      top_p: keep the smallest prefix of tokens (most likely first) whose probability mass
        reaches top_p; in (0, 1], 1 keeps all.
      greedy: pick the most likely token instead of sampling (log-probs as above).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_k, self.top_p, self.greedy)


def validate_sampling(temperature: float, top_k: int, top_p: float, greedy: bool) -> None:
    """Raise ValueError naming the field, the value and the accepted range."""
    if not isinstance(greedy, bool):
        raise ValueError(f"greedy={greedy!r} must be a bool")
    if not isinstance(temperature, int | float) or not temperature > 0.0:
        hint = "" if greedy else "; for argmax decoding set greedy=True"
        raise ValueError(f"temperature={temperature!r} must be a number > 0{hint}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an int >= 0 (0 disables top-k)")
    if not isinstance(top_p, int | float) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1 disables top-p)")


def _nucleus_mask(sorted_scaled: jax.Array, top_p: float) -> jax.Array:
    """Keep-mask over logits sorted descending ``[..., C]``: the smallest prefix with mass >= p.

    A token is kept when the mass strictly before it is < top_p, so the first token is always
    kept and the token that crosses top_p is included.
    """
    probs = jax.nn.softmax(sorted_scaled, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return mass_before < top_p


def candidate_log_probs(
    logits: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array | None]:
    """Normalised log-probs of the sampling distribution.

    Args:
      logits: ``[..., V]`` float (any float dtype; computed in float32).
      params: the sampling parameters.

    Returns:
      ``(log_probs, token_ids)``. Without filtering: ``log_probs [..., V]`` and ``token_ids``
      None (candidate i is token i). With filtering: ``log_probs [..., C]`` over C candidates
      sorted by logit (descending; removed ones at -inf) and ``token_ids [..., C]`` int32.
    """
    vocab = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / jnp.float32(params.temperature)
    k = params.top_k if 0 < params.top_k < vocab else 0
    if k == 0 and params.top_p >= 1.0:
        return jax.nn.log_softmax(scaled, axis=-1), None
    values, ids = jax.lax.top_k(scaled, k if k else vocab)
    if params.top_p < 1.0:
        values = jnp.where(_nucleus_mask(values, params.top_p), values, -jnp.inf)
    return jax.nn.log_softmax(values, axis=-1), ids.astype(jnp.int32)


def sample_tokens(
    rng: jax.Array, logits: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row.

    Args:
      rng: a PRNG key.
      logits: ``[B, V]`` float.
      params: the sampling parameters.

    Returns:
      ``(tokens [B] int32, log_probs [B] float32)``: the log-prob of each token under the
      distribution it was drawn from (see the module docstring).
    """
    log_probs, ids = candidate_log_probs(logits, params)
    if params.greedy:
        choice = jnp.argmax(log_probs, axis=-1)
    else:
        choice = jax.random.categorical(rng, log_probs, axis=-1)
    choice = choice.astype(jnp.int32)
    logp = jnp.take_along_axis(log_probs, choice[..., None], axis=-1)[..., 0]
    tokens = choice if ids is None else jnp.take_along_axis(ids, choice[..., None], axis=-1)[..., 0]
    return tokens, logp
