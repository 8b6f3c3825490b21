"""FP8 E4M3: granularities, exact codes, non-finite handling, STE, bad input."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from compiled import jit_call

from quads_jax.quant import fp8
from quads_jax.quant.metrics import flush_to_zero_rate, rel_fro_error, sqnr_db

SHAPES = {
    "tensor": (),
    "channel": (256, 1),
    "token": (256, 1),
    "block1x128": (256, 2),
    "block128x128": (2, 2),
}


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_granularity_shapes_and_numpy_reference(granularity):
    x = jax.random.normal(jax.random.PRNGKey(0), (256, 256)) * 5
    q = fp8.quantize(x, granularity=granularity)
    assert q.scale.shape == SHAPES[granularity] and q.data.dtype == jnp.float8_e4m3fn
    # numpy reference: per-group amax / 448, explicit reciprocal, saturating cast.
    xs = np.asarray(x)
    s = np.asarray(fp8.expanded_scale(q))
    amax_groups = np.broadcast_to(s, xs.shape) * np.float32(448)
    assert (np.abs(xs) <= amax_groups * (1 + 1e-6)).all()
    codes = np.clip(xs * (np.float32(1) / np.broadcast_to(s, xs.shape)), -448, 448)
    ref = codes.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(q.data.astype(jnp.float32)), ref)
    err = float(rel_fro_error(x, fp8.dequantize(q)))
    assert 0 < err < 0.04


def test_channel_scale_is_amax_over_448():
    w = jnp.array([[1.0, -896.0], [0.5, 0.25]])
    q = fp8.quantize(w, granularity="channel")
    np.testing.assert_array_equal(
        np.asarray(q.scale)[:, 0], np.array([896.0, 0.5], np.float32) / np.float32(448)
    )
    np.testing.assert_allclose(np.asarray(fp8.dequantize(q)), np.asarray(w), rtol=1e-6)


def test_non_finite_becomes_nan_and_zero_is_exact():
    x = jnp.array([[1.0, jnp.inf, -2.0, jnp.nan], [0.0, 0.0, 0.0, 0.0]])
    out = np.asarray(fp8.qdq(x, granularity="token"))
    assert np.isnan(out[0, 1]) and np.isnan(out[0, 3])
    np.testing.assert_array_equal(out[0, [0, 2]], [1.0, -2.0])
    np.testing.assert_array_equal(out[1], 0.0)


def test_ste_and_idempotence():
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 128))
    g = jax.random.normal(jax.random.PRNGKey(2), (8, 128))
    grad = jit_call(jax.grad(lambda a: jnp.sum(fp8.fake_quant(a, granularity="block1x128") * g)),
                    x)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(g))
    a = jit_call(fp8.qdq, x, granularity="channel")
    np.testing.assert_array_equal(np.asarray(a),
                                  np.asarray(jit_call(fp8.qdq, a, granularity="channel")))


@pytest.mark.parametrize(
    "x, granularity, match",
    [
        (jnp.ones((4, 100)), "block1x128", "K=100"),
        (jnp.ones((100, 128)), "block128x128", "N=100"),
        (jnp.ones((4, 128), jnp.int8), "tensor", "dtype int8"),
        (jnp.ones((4, 128)), "row", "granularity='row'"),
        (jnp.ones((128,)), "channel", "matrix"),
    ],
)
def test_bad_input(x, granularity, match):
    with pytest.raises(ValueError, match=match):
        fp8.quantize(x, granularity=granularity)


def test_metrics_values():
    x = jnp.array([1.0, 2.0, 0.0, 4.0])
    xh = jnp.array([1.0, 0.0, 0.0, 4.0])
    assert float(flush_to_zero_rate(x, xh)) == pytest.approx(1 / 3)
    assert float(rel_fro_error(x, xh)) == pytest.approx(2 / np.sqrt(21))
    assert float(sqnr_db(x, xh)) == pytest.approx(10 * np.log10(21 / 4))
    assert float(sqnr_db(x, x)) == np.inf
    with pytest.raises(ValueError, match="shape"):
        rel_fro_error(x, x[:2])
