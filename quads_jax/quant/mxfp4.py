"""MXFP4-like FP4 (OCP microscaling): E2M1 elements, one power-of-two (E8M0) scale per 32.

Only a quantize-dequantize reference, for comparisons with NVFP4 in reports and studies: the
scale is ``2^(floor(log2(amax_block)) - 2)`` (2 = the largest E2M1 exponent), elements are
rounded half to even onto the E2M1 grid and saturate at +-6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quads_jax.quant.nvfp4 import e2m1_code_to_float, round_to_e2m1_code

BLOCK_SIZE = 32


def qdq(x: jax.Array) -> jax.Array:
    """``x [..., K]`` (K % 32 == 0) quantized to MXFP4 and back, in ``x.dtype``."""
    if x.ndim == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"x: shape {tuple(x.shape)}: the last axis must be a multiple of 32")
    xf = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    exp = jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - 2.0
    exp = jnp.clip(exp, -127.0, 127.0)
    # Powers of two: multiplying by the exact reciprocal 2^-exp equals dividing.
    codes = round_to_e2m1_code(xf * jnp.exp2(-exp))
    out = e2m1_code_to_float(codes) * jnp.exp2(exp)
    return out.reshape(x.shape).astype(x.dtype)
