"""The NNX face of the model: a ``flax.nnx.Module`` whose state is exactly the parameter tree.

The functional ``forward(config, params, ...)`` is the one implementation; this module holds the
tree as ``nnx.Param`` variables so that NNX code (``nnx.split``, ``nnx.Optimizer``,
``nnx.jit``) can own it. ``model.pure_params()`` gives the plain tree (lists stay lists, unlike
``nnx.to_pure_dict``) that the trainer and the sampler pass through ``jax.jit``.
"""

from __future__ import annotations

import jax
from flax import nnx

from quads_jax.models.config import ModelConfig
from quads_jax.models.transformer import ForwardOutput, forward, init_params


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


class Qwen3MoeForCausalLM(nnx.Module):
    """``Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(0))`` or ``(config, params=tree)``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None,
                 params: dict | None = None):
        if params is None:
            if rngs is None:
                raise ValueError("Qwen3MoeForCausalLM: pass rngs (random init) or params")
            params = init_params(config, rngs.params())
        self.config = config
        self.params = nnx.data(jax.tree.map(nnx.Param, params))

    def pure_params(self) -> dict:
        """The plain array tree (what ``forward`` takes)."""
        return jax.tree.map(lambda v: v[...], self.params, is_leaf=_is_variable)

    def __call__(self, tokens: jax.Array, **kwargs) -> ForwardOutput:
        """``forward(self.config, params, tokens, **kwargs)``."""
        return forward(self.config, self.pure_params(), tokens, **kwargs)
