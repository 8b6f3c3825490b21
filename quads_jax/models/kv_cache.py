"""KVCache: the dense key/value cache that ``forward`` reads and writes.

Layout ``[num_layers, B, num_kv_heads, S_max, head_dim]``: one (row, KV head) reads a contiguous
``[S, D]`` slab (the decode attention kernel's unit of work, and no transposed copy in the jnp
path); a paged cache can later replace the slot axis ``S`` by pages. All rows share ``length`` (slots written so far); which
slots hold real tokens is ``mask`` (left-padded prompts leave pad slots False). Optionally a
shared prefix (one row per group, e.g. a GRPO group's prompt) that each row attends to before
its own slots: its n samples then hold and read the prompt's keys once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from quads_jax.models.config import ModelConfig
from quads_jax.quant.arith import straight_through


def to_cache_dtype(x: jax.Array, dtype) -> jax.Array:
    """``x`` as stored in a cache of ``dtype``. FP8 E4M3 (no infinities: a cast past its largest
    finite value, 448, gives NaN) saturates first, as vLLM's FP8 KV cache does with a scale of
    1; RMS-normed keys and the values of these models stay far below it."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float8_e4m3fn:
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -big, big)
    return x.astype(dtype)


def fake_quant(x: jax.Array, dtype) -> jax.Array:
    """``to_cache_dtype(x, dtype)`` back in ``x.dtype`` (exact: E4M3 values are bf16 / f32
    values), with a straight-through gradient: what a forward without a cache attends to when
    the rollout's cache is ``dtype`` (``QuantRecipe.kv_quant``)."""
    y = to_cache_dtype(jax.lax.stop_gradient(x), dtype).astype(x.dtype)
    return straight_through(x, y)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Attributes:
    k, v: ``[L, B, KVH, S_max, D]`` cache dtype (default bf16; float32, or float8_e4m3fn:
      half the bytes a decode step reads, values saturated at +-448, ``to_cache_dtype``).
    mask: bool ``[B, S_max]``, slot holds a real token.
    length: int32 ``[]``, slots ``[0, length)`` are written (same for every row).
    prefix_k, prefix_v: None, or ``[L, G, KVH, P, D]`` (the cache dtype): slots every row of a
      group attends to before its own, written once per group (a GRPO group's prompt:
      ``SamplerConfig.share_prompt_cache``); read only.
    prefix_mask: bool ``[G, P]``, the prefix slot holds a real token (or None).
    row_group: int32 ``[B]``, the group (prefix row) of each row (or None).
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    length: jax.Array
    prefix_k: jax.Array | None = None
    prefix_v: jax.Array | None = None
    prefix_mask: jax.Array | None = None
    row_group: jax.Array | None = None

    @classmethod
    def init(
        cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16
    ) -> KVCache:
        """An empty cache for ``batch`` rows of up to ``max_len`` tokens."""
        if batch < 1 or max_len < 1:
            raise ValueError(f"KVCache.init: batch={batch}, max_len={max_len}; both must be >= 1")
        shape = (config.num_hidden_layers, batch, config.num_key_value_heads, max_len,
                 config.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            mask=jnp.zeros((batch, max_len), bool),
            length=jnp.zeros((), jnp.int32),
        )

    @property
    def has_prefix(self) -> bool:
        return self.prefix_k is not None

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]
