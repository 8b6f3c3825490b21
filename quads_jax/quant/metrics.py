"""Quantization error metrics (float32 math; inputs of any float dtype and equal shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _pair(x: jax.Array, x_hat: jax.Array) -> tuple[jax.Array, jax.Array]:
    if x.shape != x_hat.shape:
        raise ValueError(f"x_hat: shape {tuple(x_hat.shape)} differs from x's {tuple(x.shape)}")
    return x.astype(jnp.float32), x_hat.astype(jnp.float32)


def rel_fro_error(x: jax.Array, x_hat: jax.Array) -> jax.Array:
    """``||x_hat - x||_F / ||x||_F`` (0 when both are zero)."""
    x, x_hat = _pair(x, x_hat)
    num = jnp.linalg.norm((x_hat - x).ravel())
    den = jnp.linalg.norm(x.ravel())
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))


def sqnr_db(x: jax.Array, x_hat: jax.Array) -> jax.Array:
    """Signal-to-quantization-noise ratio ``10 log10(|x|^2 / |x - x_hat|^2)`` in dB (inf if exact)."""
    x, x_hat = _pair(x, x_hat)
    sig = jnp.sum(x * x)
    noise = jnp.sum((x - x_hat) ** 2)
    return jnp.where(noise > 0, 10.0 * jnp.log10(sig / jnp.where(noise > 0, noise, 1.0)), jnp.inf)


def flush_to_zero_rate(x: jax.Array, x_hat: jax.Array) -> jax.Array:
    """Fraction of the non-zero elements of ``x`` that quantize to exactly zero."""
    x, x_hat = _pair(x, x_hat)
    nonzero = x != 0
    flushed = nonzero & (x_hat == 0)
    return jnp.sum(flushed) / jnp.maximum(jnp.sum(nonzero), 1)
