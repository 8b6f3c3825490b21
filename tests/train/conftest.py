"""A toy MoE-shaped language model for the train-step, sharding and checkpoint tests.

The step, the mesh rules and the checkpointer only see ``apply_fn(params, tokens, mask) ->
(logits, aux)``; this model has the real model's leaf kinds (embedding, stacked experts with a
router, lm_head) at tiny size so that every logical axis (vocab, embed, experts, mlp) appears.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quads_jax.models.config import ModelConfig

TOY = ModelConfig(vocab_size=24, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  num_experts=4, num_experts_per_tok=2, param_dtype="float32", dtype="float32")


def toy_params(seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    c = TOY
    n = lambda key, shape: 0.3 * jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    return {
        "embed": n(k[0], (c.vocab_size, c.hidden_size)),
        "router": n(k[1], (c.num_experts, c.hidden_size)),
        "experts": {"up": n(k[2], (c.num_experts, c.moe_intermediate_size, c.hidden_size)),
                    "down": n(k[3], (c.num_experts, c.hidden_size, c.moe_intermediate_size))},
        "norm": jnp.ones((c.hidden_size,), jnp.float32),
        "lm_head": n(k[4], (c.vocab_size, c.hidden_size)),
    }


def toy_apply(params, tokens, attention_mask):
    """Causal bag-of-prefix features -> soft-routed experts -> logits [B, T, V] f32."""
    x = params["embed"][tokens] * attention_mask[..., None]
    x = jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[None, :, None]
    gates = jax.nn.softmax(x @ params["router"].T, axis=-1)  # [B, T, E]
    h = jax.nn.silu(jnp.einsum("btd,efd->btef", x, params["experts"]["up"]))
    y = jnp.einsum("btef,edf->bted", h, params["experts"]["down"])
    x = x + jnp.einsum("bte,bted->btd", gates, y)
    x = x * params["norm"]
    aux = jnp.mean(gates**2) * TOY.num_experts
    return x @ params["lm_head"].T, aux


def toy_rl_batch(seed=0, b=8, t=6):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TOY.vocab_size, (b, t)).astype(np.int32)
    mask = np.zeros((b, t), np.float32)
    mask[:, t // 2:] = 1
    logp_old = -rng.uniform(0.5, 3.0, (b, t)).astype(np.float32)
    return {
        "tokens": tokens,
        "attention_mask": np.ones((b, t), np.float32),
        "mask": mask,
        "logp_old": logp_old,
        "logp_rollout": logp_old + rng.normal(0, 0.1, (b, t)).astype(np.float32),
        "advantages": rng.normal(0, 1, (b,)).astype(np.float32),
    }


@pytest.fixture
def toy():
    class Toy:
        config = TOY
        params = staticmethod(toy_params)
        apply = staticmethod(toy_apply)
        rl_batch = staticmethod(toy_rl_batch)

    return Toy
