"""Exact arithmetic shared by every quantizer, immune to XLA's floating-point rewrites.

Two XLA rewrites silently change quantizers inside jitted programs:

* ``a / c`` with a constant (or broadcast scalar) ``c`` becomes ``a * (1 / c)``, which rounds
  twice: ``amax / 2688`` then differs by an ulp for ~5% of values (breaking the idempotence of
  ``qdq``), and ties such as ``amax_b / 6 == 2^-10`` stop rounding to even.
* XLA:GPU's ``SimplifyFPConversions`` (on by default through ``--xla_allow_excess_precision``)
  folds ``f32 -> float8_e4m3fn -> f32`` into nothing, so ``s.astype(e4m3).astype(f32)`` inside
  one program returns the *unrounded* ``s``: codes would be computed from a scale that is not
  the stored one (found on the H200; see docs/BENCHMARKS.md).

A third difference is the backend's own division: XLA:GPU's float32 ``1 / x`` is not the IEEE
quotient (on the H200 it differed from numpy on 13.5 % of random values, 2026-12-03), so the
reciprocals ``r_b = 1 / (s_b * g)`` and ``1 / g`` can differ between CPU and GPU in the last
bit, and a code at an E2M1 tie with them. Within one backend (the trainer's fake-quant, the
weight sync and the rollout all run on the GPU) everything is bit-identical; ``divide`` is the
hook through which a Pallas kernel tracing these functions chooses its division.

So division by a constant is done on the integer significand (exact, correctly rounded, the
same on every backend), and E4M3 rounding is done with power-of-two scaling and
``round-half-even`` (exact f32 operations), so the value is already on the E4M3 grid before any
cast, and a folded cast changes nothing.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_U = jnp.uint32

# The float32 division of ``divide`` while a kernel traces this module's functions (None: jnp's
# ``/``, i.e. the backend's: IEEE on CPU, not on XLA:GPU, see above). A Pallas Triton kernel may
# install its own here (``division``; ``pallas_kernels.rac_select`` can install div.rn.f32).
_DIVISION: list = [None]


def divide(a, b) -> jax.Array:
    """float32 ``a / b``: the backend's division, or the one a tracing kernel installed."""
    fn = _DIVISION[0]
    return jnp.divide(a, b) if fn is None else fn(a, b)


@contextlib.contextmanager
def division(fn):
    """Within the block, ``divide`` calls ``fn(a, b)`` (a kernel's division) instead of ``/``:
    the quantizer functions traced into a Pallas kernel stay the same code."""
    prev, _DIVISION[0] = _DIVISION[0], fn
    try:
        yield
    finally:
        _DIVISION[0] = prev


def _odd_part(c: float) -> tuple[int, int]:
    """``c = odd * 2^shift`` for a positive integer-valued constant ``c``."""
    ci = int(c)
    if ci != c or ci <= 0:
        raise ValueError(f"divide_by_constant: c={c!r} must be a positive integer value")
    shift = 0
    while ci % 2 == 0:
        ci //= 2
        shift += 1
    if ci >= 64:
        raise ValueError(f"divide_by_constant: c={c!r} has odd part {ci} >= 64; not supported")
    return ci, shift


def divide_by_constant(a: jax.Array, c: float) -> jax.Array:
    """Correctly rounded float32 ``a / c`` for a constant positive integer ``c`` (odd part < 64).

    Long division of the 24-bit significand by the odd part of ``c`` in uint32, round half to
    even with the remainder as sticky bit; the power-of-two part goes to the exponent. Results
    below the float32 normal range (``|a| < ~1e-35``) fall back to a float division.
    """
    odd, shift = _odd_part(c)
    a = jnp.asarray(a, jnp.float32)
    bits = lax.bitcast_convert_type(jnp.abs(a), _U)
    biased = (bits >> _U(23)).astype(jnp.int32)
    m = (bits & _U(0x7FFFFF)) | _U(0x800000)  # normal inputs only (others fall back)
    n = m << _U(6)  # < 2^30
    q = n // _U(odd)
    rem = n - q * _U(odd)
    # q has 24 + d significant bits (d >= 1 because odd < 64); keep 24, round half to even.
    # clz of the int32 bit pattern: Triton lowers an int32 clz to __nv_clz but cannot legalize
    # the math.ctlz it emits for uint32 (pallas_kernels.rac_select traces this on the H200).
    d = (_U(32) - lax.clz(lax.bitcast_convert_type(q, jnp.int32)).astype(_U)) - _U(24)
    kept = q >> d
    low = q & ((_U(1) << d) - _U(1))
    half = _U(1) << (d - _U(1))
    round_up = (low > half) | ((low == half) & ((rem > 0) | ((kept & _U(1)) == 1)))
    kept = kept + round_up.astype(_U)
    carry = kept >> _U(24)  # rounding overflowed to 2^24
    kept = kept >> carry
    # value = kept * 2^(d + carry - 6 + (biased - 150) - shift); biased exponent of the result:
    e_out = d.astype(jnp.int32) + carry.astype(jnp.int32) + biased - 6 - shift
    out_bits = (e_out.astype(_U) << _U(23)) | (kept & _U(0x7FFFFF))
    exact = lax.bitcast_convert_type(out_bits, jnp.float32)
    exact = jnp.where(a < 0, -exact, exact)
    ok = (biased >= 1) & (biased <= 254) & (e_out >= 1) & (e_out <= 254)
    fallback = divide(a, np.float32(c))
    return jnp.where(a == 0, jnp.zeros_like(a), jnp.where(ok, exact, fallback))


def decode_scale_from_amax(amax: jax.Array, target: float) -> jax.Array:
    """The float32 decode scale ``amax / target`` (one correct rounding), 1 where amax is 0.

    ``target`` is the largest code magnitude the scale maps ``amax`` to: 2688 (= 6 * 448) for
    the NVFP4 global scale, 448 for FP8 E4M3. A single rounding makes re-quantizing ``qdq(x)``
    recover the same scale, so ``qdq`` is idempotent bit for bit.
    """
    amax = jnp.asarray(amax, jnp.float32)
    return jnp.where(amax > 0, divide_by_constant(amax, target), jnp.float32(1.0))


E4M3_MAX = 448.0


def round_half_even_small(v: jax.Array) -> jax.Array:
    """Non-negative float32 ``v < 2^31`` rounded to the nearest integer, ties to even
    (``jnp.round`` there), from its truncation and the exact remainder: no rounding primitive,
    so the same code runs inside Pallas Triton kernels (which lower no ``lax.round``). (The
    ``(v + 1.5 * 2^23) - 1.5 * 2^23`` trick does not survive XLA: its simplifier folds the
    pair away.)"""
    t = v.astype(jnp.int32)
    frac = v - t.astype(jnp.float32)  # exact: both are in [0, 2^31) with the same exponent range
    up = (frac > 0.5) | ((frac == 0.5) & ((t & 1) == 1))
    return (t + up.astype(jnp.int32)).astype(jnp.float32)


def round_to_e4m3(y: jax.Array) -> jax.Array:
    """Round float32 ``y`` to the nearest float8_e4m3fn value (half to even), as float32.

    ``|y|`` above 448 saturates to 448; NaN stays NaN (Inf becomes 448: callers mark non-finite
    inputs themselves). Exact: ``|y| * 2^-k`` is a power-of-two scaling, ``round`` is
    round-half-even, and the result is on the E4M3 grid, so casting it to float8_e4m3fn (folded
    away or not) changes nothing.
    """
    y = jnp.asarray(y, jnp.float32)
    a = jnp.minimum(jnp.abs(y), E4M3_MAX)
    exp = (lax.bitcast_convert_type(a, _U) >> _U(23)).astype(jnp.int32) - 127
    k = jnp.maximum(exp, -6) - 3  # E4M3: 3 mantissa bits; subnormal spacing 2^-9 below 2^-6
    ulp = lax.bitcast_convert_type(((k + 127).astype(_U)) << _U(23), jnp.float32)
    inv_ulp = lax.bitcast_convert_type(((127 - k).astype(_U)) << _U(23), jnp.float32)
    r = jnp.minimum(round_half_even_small(a * inv_ulp) * ulp, E4M3_MAX)
    r = jnp.where(y < 0, -r, r)
    return jnp.where(jnp.isnan(y), jnp.nan, r)


@jax.custom_vjp
def straight_through(x: jax.Array, y: jax.Array) -> jax.Array:
    """Returns ``y`` exactly in the forward pass; the gradient flows to ``x`` as identity.

    Exact, unlike ``x + stop_gradient(y - x)``, whose forward value can round away from ``y``.
    ``y`` gets no gradient.
    """
    return y


straight_through.defvjp(lambda x, y: (y, None), lambda _, g: (g, None))
