"""FP8 E4M3 quantization for the FP8 arm (weights and activations), with STE fake-quant.

Granularities (one float32 *decode* scale ``s = amax / 448`` per group, codes
``e4m3(clip(x * (1 / s), -448, 448))``):

* "tensor": one scale, shape ``[]``;
* "channel": one per output channel of a weight ``[..., N, K]`` -> scale ``[..., N, 1]``;
* "token": one per token (row) of an activation ``[..., K]`` -> scale ``[..., 1]`` (same
  arithmetic as "channel"; two names so a recipe reads as what it means);
* "block1x128": one per 128 consecutive elements of a row (DeepSeek-V3 activations) -> scale
  ``[..., K / 128]``;
* "block128x128": one per 128 x 128 tile of a matrix (DeepSeek-V3 weights) -> scale
  ``[..., N / 128, K / 128]``.

As in ``nvfp4``: the reciprocal is explicit and the division ``amax / 448`` is hidden from XLA's
divide-by-constant rewrite, so every implementation (jnp, Pallas) computes identical codes. A NaN
or Inf input becomes NaN (E4M3FN has a NaN); the scales ignore non-finite values.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax.quant import arith
from quads_jax.quant.arith import round_to_e4m3, straight_through

E4M3_MAX = 448.0
BLOCK = 128
GRANULARITIES = ("tensor", "channel", "token", "block1x128", "block128x128")
Granularity = Literal["tensor", "channel", "token", "block1x128", "block128x128"]
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Tensor:
    """An FP8 E4M3 tensor of logical shape ``data.shape``.

    Attributes:
      data: float8_e4m3fn ``[..., K]`` (weights ``[..., N, K]``).
      scale: float32 decode scale; its shape follows ``granularity`` (module docstring).
      granularity: static, one of ``GRANULARITIES``.
      dtype: static logical dtype that ``dequantize(q, None)`` returns.
    """

    data: jax.Array
    scale: jax.Array
    granularity: str = dataclasses.field(default="tensor", metadata={"static": True})
    dtype: jnp.dtype = dataclasses.field(default=jnp.dtype(jnp.bfloat16), metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.size + 4 * np.prod(self.scale.shape))


def _check(x: jax.Array, granularity: str) -> None:
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(
            f"x: dtype {getattr(x, 'dtype', type(x))} is not supported; FP8 quantization accepts "
            "bfloat16, float16 or float32 arrays"
        )
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not one of {GRANULARITIES}")
    if x.ndim == 0 or x.size == 0:
        raise ValueError(f"x: shape {tuple(x.shape)} is empty or scalar; need [..., K]")
    if granularity in ("channel", "block128x128") and x.ndim < 2:
        raise ValueError(
            f"granularity={granularity!r} needs a matrix [..., N, K]; got ndim={x.ndim}"
        )
    if granularity in ("block1x128", "block128x128") and x.shape[-1] % BLOCK:
        raise ValueError(
            f"x: last axis K={x.shape[-1]} is not a multiple of {BLOCK} (granularity={granularity!r})"
        )
    if granularity == "block128x128" and x.shape[-2] % BLOCK:
        raise ValueError(
            f"x: axis -2 N={x.shape[-2]} is not a multiple of {BLOCK} (granularity='block128x128')"
        )


def _grouped(x: jax.Array, granularity: str) -> tuple[jax.Array, tuple[int, ...]]:
    """View ``x`` so that each scale group is reduced over the returned axes."""
    if granularity == "tensor":
        return x, tuple(range(x.ndim))
    if granularity in ("channel", "token"):
        return x, (x.ndim - 1,)
    k = x.shape[-1]
    if granularity == "block1x128":
        v = x.reshape(x.shape[:-1] + (k // BLOCK, BLOCK))
        return v, (v.ndim - 1,)
    n = x.shape[-2]
    v = x.reshape(x.shape[:-2] + (n // BLOCK, BLOCK, k // BLOCK, BLOCK))
    return v, (v.ndim - 3, v.ndim - 1)


def decode_scale_from_amax(amax: jax.Array) -> jax.Array:
    """``amax / 448`` (one correctly rounded division), 1 where amax is 0."""
    return arith.decode_scale_from_amax(amax, E4M3_MAX)


def encode(x: jax.Array, scale: jax.Array) -> jax.Array:
    """E4M3 codes of ``x`` with the broadcastable float32 decode ``scale``; NaN/Inf -> NaN."""
    xf = x.astype(jnp.float32)
    r = jnp.where(scale > 0, jnp.float32(1.0) / jnp.where(scale > 0, scale, 1.0), 0.0)
    # round_to_e4m3 saturates at +-448; rounding before the cast keeps a jitted qdq exact on
    # XLA:GPU, which folds f32 -> e4m3 -> f32 cast chains (see quant/arith.py).
    y = round_to_e4m3(xf * r)
    y = jnp.where(jnp.isfinite(xf), y, jnp.nan)
    return y.astype(jnp.float8_e4m3fn)


def quantize(x: jax.Array, *, granularity: Granularity = "tensor") -> FP8Tensor:
    """Quantize ``x`` to FP8 E4M3 with one decode scale per ``granularity`` group."""
    x = jnp.asarray(x)
    _check(x, granularity)
    v, axes = _grouped(x, granularity)
    a = jnp.abs(v.astype(jnp.float32))
    amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=axes, keepdims=True)
    scale = decode_scale_from_amax(amax)
    data = encode(v, scale).reshape(x.shape)
    if granularity == "block1x128":
        scale = scale[..., 0]
    elif granularity == "block128x128":
        scale = scale[..., :, 0, :, 0]
    elif granularity == "tensor":
        scale = scale.reshape(())
    return FP8Tensor(data=data, scale=scale, granularity=granularity, dtype=jnp.dtype(x.dtype))


def expanded_scale(q: FP8Tensor) -> jax.Array:
    """The decode scale broadcast-ready against ``q.data`` (block scales repeated)."""
    s = q.scale
    if q.granularity == "block1x128":
        return jnp.repeat(s, BLOCK, axis=-1)
    if q.granularity == "block128x128":
        return jnp.repeat(jnp.repeat(s, BLOCK, axis=-2), BLOCK, axis=-1)
    return s


def dequantize(q: FP8Tensor, dtype: jnp.dtype | None = jnp.float32) -> jax.Array:
    """``data * scale`` in float32, cast to ``dtype`` (None: the logical dtype)."""
    if not isinstance(q, FP8Tensor):
        raise ValueError(f"dequantize expects an FP8Tensor, got {type(q).__name__}")
    out = q.data.astype(jnp.float32) * expanded_scale(q)
    return out.astype(q.dtype if dtype is None else dtype)


def qdq(x: jax.Array, *, granularity: Granularity = "tensor") -> jax.Array:
    """Quantize then dequantize, in ``x.dtype``."""
    return dequantize(quantize(x, granularity=granularity), x.dtype)


def fake_quant(x: jax.Array, *, granularity: Granularity = "tensor") -> jax.Array:
    """``qdq(x)`` forward, identity gradient (straight-through)."""
    return straight_through(x, qdq(jax.lax.stop_gradient(x), granularity=granularity))
