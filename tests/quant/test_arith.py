"""Exact division by constants and exact E4M3 rounding (immune to XLA's float rewrites)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from quads_jax.quant.arith import divide_by_constant, round_to_e4m3


@pytest.mark.parametrize("c", [2688.0, 6.0, 448.0, 1.0, 21.0])
def test_divide_by_constant_is_correctly_rounded(c):
    rng = np.random.default_rng(0)
    a = (rng.random(200_000) * 10.0 ** rng.uniform(-30, 30, 200_000)).astype(np.float32)
    a[:6] = [0.0, 1.0, 2688.0, 3 * 2688.0, 6 * 2.0**-10, 3e38]
    a = np.concatenate([a, -a])
    ref = a / np.float32(c)  # numpy: IEEE division, one rounding
    for fn in (divide_by_constant, jax.jit(divide_by_constant, static_argnums=1)):
        got = np.asarray(fn(jnp.asarray(a), c))
        np.testing.assert_array_equal(got, ref)
    # The float32 rewrite this replaces is measurably different (so the test can fail).
    rewritten = a * (np.float32(1) / np.float32(c))
    if c not in (1.0,):
        assert np.sum(rewritten != ref) > 0


def test_divide_by_constant_under_vmap_and_grad_shape():
    a = jnp.asarray(np.random.default_rng(1).random((64, 33), np.float32) * 1e3)
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda r: divide_by_constant(r, 2688.0))(a)),
        np.asarray(a) / np.float32(2688),
    )


@pytest.mark.parametrize("c", [0.0, -6.0, 2.5, 128.0 * 65])
def test_divide_by_constant_rejects_unsupported_constants(c):
    with pytest.raises(ValueError, match="divide_by_constant"):
        divide_by_constant(jnp.ones(3), c)


def test_round_to_e4m3_matches_the_cast_everywhere():
    rng = np.random.default_rng(2)
    y = np.concatenate(
        [
            np.linspace(-500, 500, 100_001, dtype=np.float32),
            (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-4, 2, 200_000)).astype(np.float32),
            np.array([2**-10, 3 * 2**-10, 2**-9, 464, 470, 448, 447.9, 0, 2**-6], np.float32),
        ]
    )
    ref = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    for fn in (round_to_e4m3, jax.jit(round_to_e4m3)):
        np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(y))), ref)
    out = np.asarray(round_to_e4m3(jnp.array([np.nan, np.inf, -np.inf])))
    assert np.isnan(out[0]) and out[1] == 448 and out[2] == -448


def test_jitted_qdq_uses_rounded_scales():
    """Inside one jitted program the block scale must be the stored (rounded) E4M3 value."""
    from quads_jax.quant import nvfp4

    x = jax.random.normal(jax.random.PRNGKey(0), (32, 64)) * 3
    q = nvfp4.quantize(x)
    eager = nvfp4.dequantize(q)
    jitted = jax.jit(lambda a: nvfp4.dequantize(nvfp4.quantize(a)))(x)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
