"""Plain W4A4's operand kernel (pallas_kernels.act_operands): interpret mode equals the jnp
quantizer + gather bit for bit (NaN and inf blocks included), alone and through the grouped and
dense matmuls; where it applies; cuda lowering; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from pallas_kernels import act_operands as ao
from pallas_kernels import nvfp4_quantize as aq
from pallas_kernels.layout import prepare_w4a4_weights
from pallas_kernels.w4a4_grouped import w4a4_grouped_matmul
from pallas_kernels.w4a4_matmul import W4A4MatmulConfig, w4a4_matmul
from quads_jax.quant import nvfp4
from quads_jax.testing import grouped_w4a4_case, lower_for_h200


def _x(r, k, seed):
    x = jax.random.normal(jax.random.key(seed), (r, k), jnp.float32) * 3
    return x.at[0, 5].set(jnp.nan).at[1, 20].set(jnp.inf).astype(jnp.bfloat16)


@pytest.mark.numerics
@pytest.mark.parametrize(
    "r,m,k,k_pad,with_rows,block_rows,dtype",
    [
        (10, 24, 160, 256, True, 4, jnp.float16),  # K padded; GEMM rows from distinct rows
        (9, 9, 512, 512, False, 16, jnp.bfloat16),  # window rows not a multiple of block_rows
    ],
)
def test_interpret_equals_the_jnp_path(r, m, k, k_pad, with_rows, block_rows, dtype):
    x = _x(r, k, seed=k)
    rows = (jax.random.randint(jax.random.key(m), (m,), 0, r).astype(jnp.int32) if with_rows
            else None)
    # Window rows: every GEMM row, some twice, and empty rows (>= M) between.
    window = jnp.asarray(list(range(m)) + [m, m + 3] + list(range(0, m, 3)) + [m] * 5,
                         jnp.int32)
    got = ao.act_window_operand(x, ao.row_decode_scales(x), window, rows, k_pad=k_pad,
                                dtype=dtype, config=ao.ActOperandsConfig(block_rows=block_rows),
                                interpret=True)
    want = ao.act_window_operand_reference(x, window, rows, k_pad=k_pad, dtype=dtype)
    assert got.shape == (window.shape[0], k_pad) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(want).view(np.uint16))
    assert np.isnan(np.asarray(got, np.float32)).any()  # the NaN / inf blocks stay NaN
    # g is the quantizer's own per-token decode scale
    q = nvfp4.quantize_activations(x, "per_token")
    np.testing.assert_array_equal(np.asarray(ao.row_decode_scales(x)),
                                  np.asarray(q.global_scale[:, 0]))


def test_skip_leaves_padding_rows_unwritten_and_the_rest_equal():
    x = _x(6, 64, seed=3)
    window = jnp.asarray([0, 1, 6, 2, 3, 6, 4, 5], jnp.int32)
    kw = dict(k_pad=256, interpret=True)
    zeros = jit_call(ao.act_window_operand, x, jit_call(ao.row_decode_scales, x), window, **kw)
    skip = jit_call(ao.act_window_operand, x, jit_call(ao.row_decode_scales, x), window,
                    config=ao.ActOperandsConfig(padding_rows="skip"), **kw)
    live = np.asarray(window) < 6
    np.testing.assert_array_equal(np.asarray(skip)[live].view(np.uint16),
                                  np.asarray(zeros)[live].view(np.uint16))
    assert not np.asarray(zeros)[~live].any()


def _cfg(flag):
    return W4A4MatmulConfig(a_via_smem=True, num_sms=4, act_operand_kernel=flag)


def test_grouped_matmul_agrees_with_and_without_the_kernel():
    x, src, w, gs = jit_call(grouped_w4a4_case, 11)

    def grouped(flag):
        return np.asarray(jit_call(w4a4_grouped_matmul, x, w, gs, config=_cfg(flag),
                                   interpret=True, source_rows=src), np.float32)

    np.testing.assert_array_equal(grouped(True), grouped(False))


def test_the_kernel_only_where_it_applies(monkeypatch):
    """Dense decode with per-token scales and no RAC goes through the kernel (its operand
    equals the jnp path's: the test above); RAC, per-batch scales and the unwindowed tiles
    keep the jnp quantizer. Traced only (``jax.eval_shape``): which path runs, not values."""
    assert _cfg(True).act_operands_config() == ao.ActOperandsConfig()
    assert _cfg(False).act_operands_config() is None
    assert W4A4MatmulConfig(act_operand_kernel=True,
                            windowed_operands=False).act_operands_config() is None
    calls = []
    real = ao.act_window_operand
    monkeypatch.setattr(ao, "act_window_operand",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)
    wq = jit_call(nvfp4.quantize, jax.random.normal(jax.random.key(13), (64, 256)),
                  scale_mode="expert")
    wd = jit_call(prepare_w4a4_weights, wq)
    for kw, used in ((dict(), 1), (dict(rac=aq.RACConfig()), 0),
                     (dict(act_scale_mode="per_batch"), 0)):
        calls.clear()
        jax.eval_shape(lambda x, kw=kw: w4a4_matmul(x, wd, config=_cfg(True), interpret=True,
                                                    **kw), x)
        assert len(calls) == used, kw


def test_lowers_for_cuda():
    r, m, k, p = 128, 1024, 2048, 1936
    args = (jnp.ones((r, k), jnp.bfloat16), jnp.ones((r,)), jnp.zeros((p,), jnp.int32),
            jnp.zeros((m,), jnp.int32))
    text = lower_for_h200(lambda *a: ao.act_window_operand(*a, k_pad=k), *args)
    assert "act_operands" in text
    assert "ctlz" not in text  # Triton's NVIDIA backend cannot legalize it (rac_select's test)


def test_bad_input():
    x, g = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((4,))
    wr = jnp.zeros((8,), jnp.int32)
    with pytest.raises(ValueError, match="K % 16"):
        ao.act_window_operand(jnp.ones((4, 40)), g, wr, k_pad=256, interpret=True)
    with pytest.raises(ValueError, match=r"\[R, K\]"):
        ao.act_window_operand(jnp.ones((2, 4, 64)), g, wr, k_pad=256, interpret=True)
    with pytest.raises(ValueError, match=r"g \[3\]"):
        ao.act_window_operand(x, jnp.ones((3,)), wr, k_pad=256, interpret=True)
    with pytest.raises(ValueError, match="k_pad"):
        ao.act_window_operand(x, g, wr, k_pad=100, interpret=True)
    with pytest.raises(ValueError, match="int32"):
        ao.act_window_operand(x, g, wr.astype(jnp.int16), k_pad=256, interpret=True)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        ao.act_window_operand(x, g, wr, k_pad=256, dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="nan"):
        ao.act_window_operand(x, g, wr, k_pad=256, interpret=True,
                              config=ao.ActOperandsConfig(padding_rows="nan"))
