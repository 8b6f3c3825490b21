"""bf16_grouped: the differentiable BF16 grouped matmul (interpret mode on the CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import bf16_grouped as bg


def _operands(m, n, k, e, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(ks[1], (e, n, k), jnp.bfloat16)
    dy = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
    return x, w, dy


def _group_of_rows(group_sizes, m):
    ends = np.cumsum(group_sizes)
    return np.searchsorted(ends, np.arange(m), side="right")  # len(sizes) past the groups


def _products64(x, w, dy, group_sizes):
    """float64 y, dx, dW of sum(y * dy) from the bf16 operands."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    e = w.shape[0]
    g = _group_of_rows(group_sizes, x.shape[0])
    y, dx, dw = np.zeros((x.shape[0], w.shape[1])), np.zeros_like(x), np.zeros_like(w)
    for i in range(e):
        r = g == i
        y[r] = x[r] @ w[i].T
        dx[r] = dy[r] @ w[i]
        dw[i] = dy[r].T @ x[r]
    return y, dx, dw


def _close_bf16(got, want):
    """Equal up to the final bf16 rounding (accumulation order aside)."""
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=1e-6 * np.max(np.abs(want)))


# Zeros, very uneven groups, rows past the groups (200 rows, 167 in groups); one full group.
# dW through our kernel and through XLA's ragged_dot_general (the default).
@pytest.mark.parametrize("m,sizes,dw_kernel", [(200, [50, 0, 77, 40], True),
                                               (128, [0, 128, 0, 0], False)])
def test_forward_and_gradients_match_float64(m, sizes, dw_kernel):
    n, k = 192, 128  # N not a multiple of the default 128-column tile: the 64 fallback
    x, w, dy = _operands(m, n, k, len(sizes))
    gs = jnp.asarray(sizes, jnp.int32)
    config = bg.BF16GroupedConfig(dw_kernel=dw_kernel, num_sms=4)

    def loss(x, w):
        y = bg.grouped_matmul(x, w, gs, config=config, interpret=True)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y), (dx, dw) = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    want_y, want_dx, want_dw = _products64(x, w, dy, sizes)
    _close_bf16(y, want_y)
    _close_bf16(dx, want_dx)
    _close_bf16(dw, want_dw)
    live = sum(sizes)
    assert not np.any(np.asarray(y[live:])) and not np.any(np.asarray(dx[live:]))


def test_ragged_contract_f32_equals_reference():
    """dW's kernel alone, f32 out: only the f32 summation order differs from float64."""
    sizes = [0, 70, 1, 0, 64]  # an empty group, one row, a whole block, 65 rows past the groups
    x, _, dy = _operands(200, 128, 64, len(sizes), seed=1)
    gs = jnp.asarray(sizes, jnp.int32)
    got = bg.ragged_contract(dy, x, gs, interpret=True, out_dtype=jnp.float32,
                             config=bg.BF16GroupedConfig(dw_block_n=64, num_sms=3))
    want = _products64(x, jnp.zeros((5, 128, 64), jnp.bfloat16), dy, sizes)[2]
    assert got.shape == (5, 128, 64) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    ref = bg.ragged_contract_xla(dy, x, gs, jnp.float32)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[0])) and not np.any(np.asarray(got[3]))


def test_padded_group_rows():
    index, first, count = bg.padded_group_rows(jnp.asarray([3, 0, 5, 1], jnp.int32), 12, 4)
    assert index.shape == (4 * -(-(12 + 4 * 3) // 4),)
    np.testing.assert_array_equal(first, [0, 1, 1, 3])
    np.testing.assert_array_equal(count, [1, 0, 2, 1])
    want = [0, 1, 2, -1, 3, 4, 5, 6, 7, -1, -1, -1, 8, -1, -1, -1]
    np.testing.assert_array_equal(index[:16], want)
    assert np.all(np.asarray(index[16:]) == -1)  # rows 9-11 are past the groups


def test_bad_input_is_refused():
    x, w, _ = _operands(16, 64, 64, 2)
    gs = jnp.asarray([8, 8], jnp.int32)
    with pytest.raises(ValueError, match="bfloat16 x"):
        bg.grouped_matmul(x.astype(jnp.float32), w, gs)
    with pytest.raises(ValueError, match="multiples of 64"):
        bg.grouped_matmul(x[:, :48], w[:, :, :48], gs)
    with pytest.raises(ValueError, match=r"must be int \[2\]"):
        bg.grouped_matmul(x, w, gs[:1])
    with pytest.raises(ValueError, match="ragged_contract"):
        bg.ragged_contract(x[:, :32], x, gs)
    for bad in (dict(block_n=96), dict(dw_block_rows=512), dict(dw_concurrent_steps=1),
                dict(num_sms=0), dict(dw_kernel=1)):
        with pytest.raises(ValueError, match="BF16GroupedConfig"):
            bg.BF16GroupedConfig(**bad)
    assert bg.supported((16, 64), (2, 128, 64), jnp.bfloat16)
    assert not bg.supported((16, 32), (2, 128, 32), jnp.bfloat16)
