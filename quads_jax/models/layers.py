"""Building blocks of the Qwen3-MoE decoder: RMSNorm, RoPE, masked GQA attention, SwiGLU.

Precision follows transformers' Qwen3-MoE: norms and softmax in float32, RoPE angles in float32,
matmul operands in the compute dtype with float32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Added to disallowed attention scores. Finite, so a query row that may attend to nothing (a
# left-pad query) gets a uniform, finite softmax instead of NaN; such rows are never used.
MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x) * scale`` over the last axis; computed in f32, returned in ``x.dtype``.

    x: ``[..., D]``; scale: ``[D]`` (any float dtype).
    """
    xf = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    normed = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return scale.astype(x.dtype) * normed


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin ``[B, T, head_dim]`` f32 for int positions ``[B, T]`` (HF "default" RoPE, the
    half-split layout: angle ``j`` and ``j + D/2`` are equal)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, heads, D]`` by the tables ``[B, T, D]``; f32 math, ``x.dtype`` out."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Grouped-query attention.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, S, KVH, D]`` (H a multiple of KVH).
      allowed: bool ``[B, T, S]``: query t may attend to key slot s.
    Returns ``[B, T, H * D]`` in ``q.dtype``; scores and softmax in f32.
    """
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    k = k.astype(q.dtype)
    v = v.astype(q.dtype)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # no TF32
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision=precision,
                        preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(d**-0.5)
    scores = jnp.where(allowed[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(b, t, h * d)


def swiglu(gate_up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` of fused ``[..., 2I]`` (gate first), f32 math, input dtype out."""
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(gate_up.dtype)
