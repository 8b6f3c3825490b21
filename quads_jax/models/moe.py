"""The sparse MoE block: route, sort token-slots by expert, grouped matmuls, weighted combine.

Dropless: every token's top-k slots are computed. The expert matmuls go through
``ops.grouped_linear`` (``jax.lax.ragged_dot`` in the reference path, the Pallas grouped kernel
on GPU). ``moe_dense_reference`` (all experts on all tokens) exists only to test this one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from quads_jax.models.config import ModelConfig
from quads_jax.models.layers import swiglu
from quads_jax.quant import ops
from quads_jax.quant.recipe import QuantRecipe


class Routing(NamedTuple):
    """weights: ``[N, k]`` f32 combine weights; expert_ids: int32 ``[N, k]``;
    logits: ``[N, E]`` f32 router logits; probs: ``[N, E]`` f32 softmax."""

    weights: jax.Array
    expert_ids: jax.Array
    logits: jax.Array
    probs: jax.Array


class RouterStats(NamedTuple):
    """Per-layer sums over real tokens for the load-balancing and z losses."""

    slot_counts: jax.Array  # [E] f32, top-k slots routed to each expert
    prob_sums: jax.Array  # [E] f32, summed router probabilities
    z_sum: jax.Array  # [] f32, summed logsumexp(logits)^2
    tokens: jax.Array  # [] f32, number of real tokens


def route(config: ModelConfig, router_w, x: jax.Array, site: str, recipe: QuantRecipe) -> Routing:
    """Softmax router with top-k (and ``norm_topk_prob`` renormalisation), in float32.

    x: ``[N, H]``; router_w: ``[E, H]``.
    """
    logits = ops.linear(x.astype(jnp.float32), router_w, site, recipe).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, config.num_experts_per_tok)
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights, ids.astype(jnp.int32), logits, probs)


def router_stats(routing: Routing, token_mask: jax.Array) -> RouterStats:
    """Sums over tokens with ``token_mask [N]`` True (padding excluded, as HF does)."""
    m = token_mask.astype(jnp.float32)
    e = routing.probs.shape[-1]
    counts = jnp.sum(jax.nn.one_hot(routing.expert_ids, e, dtype=jnp.float32), axis=1)
    z = jnp.square(jax.nn.logsumexp(routing.logits, axis=-1))
    return RouterStats(
        slot_counts=m @ counts,
        prob_sums=m @ routing.probs,
        z_sum=jnp.sum(z * m),
        tokens=jnp.sum(m),
    )


def moe_block(
    config: ModelConfig, p: dict, x: jax.Array, site: str, recipe: QuantRecipe
) -> tuple[jax.Array, Routing]:
    """Sparse MoE of tokens ``x [N, H]`` (compute dtype) -> ``([N, H], Routing)``.

    ``p``: ``router [E, H]``, ``experts.gate_up [E, 2I, H]`` (gate rows first),
    ``experts.down [E, H, I]``. ``site`` is the layer prefix, e.g. ``layers.3.mlp``.
    """
    n, h = x.shape
    k = config.num_experts_per_tok
    routing = route(config, p["router"], x, f"{site}.router", recipe)
    flat_ids = routing.expert_ids.reshape(-1)  # slot s = token s // k, choice s % k
    order = jnp.argsort(flat_ids, stable=True)
    group_sizes = jnp.bincount(flat_ids, length=config.num_experts).astype(jnp.int32)
    x_sorted = x[order // k]
    experts = p["experts"]
    gate_up = ops.grouped_linear(
        x_sorted, experts["gate_up"], group_sizes, f"{site}.experts.gate_up", recipe
    )
    out = ops.grouped_linear(
        swiglu(gate_up), experts["down"], group_sizes, f"{site}.experts.down", recipe
    )
    # Unsort with a gather: XLA fuses it into the weighted sum below, while a scatter of the
    # [N*k, H] rows would be a pass of its own. The inverse permutation is a scatter of N*k ints.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    slots = out[inverse].reshape(n, k, h)
    weights = routing.weights.astype(x.dtype).astype(jnp.float32)  # HF casts to the model dtype
    y = jnp.sum(slots.astype(jnp.float32) * weights[..., None], axis=1)
    return y.astype(x.dtype), routing


def dense_mlp(p: dict, x: jax.Array, site: str, recipe: QuantRecipe) -> jax.Array:
    """SwiGLU MLP of a dense layer: ``gate_up [2I, H]`` (gate first), ``down [H, I]``."""
    hidden = swiglu(ops.linear(x, p["gate_up"], f"{site}.gate_up", recipe))
    return ops.linear(hidden, p["down"], f"{site}.down", recipe)


def moe_dense_reference(config: ModelConfig, p: dict, x: jax.Array) -> jax.Array:
    """Test reference: every expert on every token, combined with the dense top-k weights.

    Same routing as ``moe_block``; bf16 recipe semantics (plain matmuls). ``[N, H]`` out.
    """
    routing = route(config, p["router"], x, "reference.router", QuantRecipe())
    e = config.num_experts
    weights = routing.weights.astype(x.dtype).astype(jnp.float32)
    combine = jnp.sum(
        jax.nn.one_hot(routing.expert_ids, e, dtype=jnp.float32) * weights[..., None], axis=1
    )  # [N, E]
    w_gu = p["experts"]["gate_up"].astype(x.dtype)
    w_d = p["experts"]["down"].astype(x.dtype)
    hi = jax.lax.Precision.HIGHEST
    gu = jnp.einsum("nh,eih->eni", x, w_gu, precision=hi, preferred_element_type=jnp.float32)
    hidden = swiglu(gu.astype(x.dtype))
    out = jnp.einsum("eni,ehi->enh", hidden, w_d, precision=hi,
                     preferred_element_type=jnp.float32)
    y = jnp.einsum("enh,ne->nh", out.astype(x.dtype).astype(jnp.float32), combine, precision=hi)
    return y.astype(x.dtype)
