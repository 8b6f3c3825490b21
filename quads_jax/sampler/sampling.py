"""Token sampling: temperature, top-k, top-p (nucleus), greedy, and the log-prob of the pick.

The log-prob returned with every token is the log of its probability under the distribution the
token was *actually drawn from*: logits divided by the temperature, restricted to the top-k /
top-p candidates, renormalised. That is the `logp_rollout` of the RL objective (QUADS_SPEC
section 6); with no filtering it equals ``log_softmax(logits / temperature)`` at the token.
Greedy decoding picks the mode of that same distribution and reports the same log-prob, so a
greedy rollout still carries a meaningful `logp_rollout`.

Top-k works in the k-candidate subspace (``lax.top_k``, then sample among k), so the full vocab
is never sorted when k is set; top-p alone sorts the vocab once per step.

How a row's token is drawn from its log-probs is a registry entry (``SAMPLERS``):
``"gumbel"`` is ``jax.random.categorical`` (argmax of log-probs plus Gumbel noise: one random
number per candidate, ``[B, V]`` of them per step); ``"inverse_cdf"`` draws two uniforms per
row and walks the cumulative mass, first over blocks of candidates, then inside the chosen
block (one pass over ``exp(log_probs)`` for the block masses, then ``[B, block]`` work). Both
are exact samplers of the same distribution, so either gives the same log-prob for the token
it picks; they pick different tokens for the same key. The default is "inverse_cdf": on an
H100 one draw at batch 128 x 151 936 took 65 us against 153 us for "gumbel" (54 us with no
randomness at all, greedy; ``scripts/sampling_probe.py``, 2026-12-06, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

# The sampler of SamplingParams, SamplerConfig and the trainer's RolloutSection (a key of
# ``SAMPLERS``, defined below with the samplers).
DEFAULT_SAMPLER = "inverse_cdf"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one token is picked from logits.

    Attributes:
      temperature: > 0; logits are divided by it before everything else.
      top_k: keep the k most likely tokens; 0 keeps all.
      top_p: keep the smallest prefix of tokens (most likely first) whose probability mass
        reaches top_p; in (0, 1], 1 keeps all.
      greedy: pick the most likely token instead of sampling (log-probs as above).
      sampler: how a token is drawn from the log-probs, a key of ``SAMPLERS``.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    sampler: str = DEFAULT_SAMPLER

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_k, self.top_p, self.greedy, self.sampler)


def validate_sampling(
    temperature: float, top_k: int, top_p: float, greedy: bool, sampler: str = DEFAULT_SAMPLER
) -> None:
    """Raise ValueError naming the field, the value and the accepted range."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r} must be one of {sorted(SAMPLERS)}")
    if not isinstance(greedy, bool):
        raise ValueError(f"greedy={greedy!r} must be a bool")
    if not isinstance(temperature, int | float) or not temperature > 0.0:
        hint = "" if greedy else "; for argmax decoding set greedy=True"
        raise ValueError(f"temperature={temperature!r} must be a number > 0{hint}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an int >= 0 (0 disables top-k)")
    if not isinstance(top_p, int | float) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1 disables top-p)")


def gumbel_choice(rng: jax.Array, log_probs: jax.Array) -> jax.Array:
    """``[..., C]`` log-probs -> ``[...]`` int candidate index: argmax of log-probs + Gumbel."""
    return jax.random.categorical(rng, log_probs, axis=-1)


INVERSE_CDF_BLOCK = 1024


def inverse_cdf_choice(
    rng: jax.Array, log_probs: jax.Array, block: int = INVERSE_CDF_BLOCK
) -> jax.Array:
    """``[..., C]`` log-probs -> ``[...]`` int32 candidate index, by inverse-CDF sampling.

    Two uniforms u in (0, 1] per row: the first picks a block of ``block`` candidates, the
    first whose cumulative mass reaches u times the total; the second a candidate inside it
    the same way over the block's own cumulative mass. The picked candidate always has
    nonzero mass (its cumulative sum strictly exceeds the one before it, and the target is
    > 0), so a filtered-out (-inf) candidate is never drawn. Candidates with log-prob below
    float32's exp underflow (about -87; -103 with denormals) are never drawn either.

    Resolution: a float32 uniform is a multiple of 2^-23, so a block holding less than ~1e-7
    of its row's mass is drawn with a probability rounded to that grid (the second level is
    relative to the block's own mass, so rare tokens inside a likely block are exact). Gumbel
    noise from the same 23-bit uniforms has the like limit: it never draws a token more than
    ~17 nats below the row's most likely one.
    """
    if block < 1:
        raise ValueError(f"block={block!r} must be an int >= 1")
    *lead, count = log_probs.shape
    block = min(block, count)
    n_blocks = math.ceil(count / block)
    mass = jnp.exp(log_probs.astype(jnp.float32))
    mass = jnp.pad(mass, [(0, 0)] * len(lead) + [(0, n_blocks * block - count)])
    mass = mass.reshape(*lead, n_blocks, block)
    u = 1.0 - jax.random.uniform(rng, (2, *lead), jnp.float32)

    def first_reaching(weights: jax.Array, fraction: jax.Array) -> jax.Array:
        cdf = jnp.cumsum(weights, axis=-1)
        below = cdf < (fraction * cdf[..., -1])[..., None]
        return jnp.minimum(jnp.sum(below, axis=-1, dtype=jnp.int32), weights.shape[-1] - 1)

    chosen = first_reaching(jnp.sum(mass, axis=-1), u[0])
    row = jnp.take_along_axis(mass, chosen[..., None, None], axis=-2)[..., 0, :]
    return chosen * block + first_reaching(row, u[1])


# How a token is drawn from ``[..., C]`` log-probs given a key (``SamplingParams.sampler``).
SAMPLERS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "gumbel": gumbel_choice,
    "inverse_cdf": inverse_cdf_choice,
}


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
        choice = SAMPLERS[params.sampler](rng, log_probs)
    choice = choice.astype(jnp.int32)
    logp = jnp.take_along_axis(log_probs, choice[..., None], axis=-1)[..., 0]
    tokens = choice if ids is None else jnp.take_along_axis(ids, choice[..., None], axis=-1)[..., 0]
    return tokens, logp
