"""The FP8 W8A8 tile kernel: layout, GPU-interpreter results against the jnp reference, cuda
lowering, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.fp8_tiles_mgpu import FP8GemmConfig, dequantize_fp8_weights, prepare_fp8_weights
from pallas_kernels.w8a8_matmul import (
    W8A8MatmulConfig,
    w8a8_grouped_matmul,
    w8a8_matmul,
    w8a8_reference,
)
from quads_jax.quant import fp8

H200 = AbstractMesh((), (), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", platform="gpu", num_cores=132))


def _rel(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(y - ref)) / np.max(np.abs(ref))


@pytest.mark.parametrize("shape,gran", [((200, 300), "channel"), ((3, 130, 256), "tensor")])
def test_prepare_dequantizes_to_the_fp8_values(shape, gran):
    q = jit_call(fp8.quantize, jax.random.normal(jax.random.key(0), shape) * 2, granularity=gran)
    w = jit_call(prepare_fp8_weights, q)
    assert w.shape == shape and w.n_pad % 128 == 0 and w.k_pad % 128 == 0
    want = jit_call(fp8.dequantize, q, jnp.float32).reshape((-1,) + shape[-2:])
    np.testing.assert_array_equal(jit_call(dequantize_fp8_weights, w), want)


@pytest.mark.parametrize("m,act", [(5, "token"), (70, "tensor")])
def test_dense_interpret_matches_reference(m, act):
    x = jax.random.normal(jax.random.key(m), (m, 256), jnp.float32)
    w = jit_call(fp8.quantize, jax.random.normal(jax.random.key(1), (200, 256)),
                 granularity="channel")
    y = jit_call(w8a8_matmul, x, w, act_granularity=act,
                 config=W8A8MatmulConfig(num_sms=4, k_splits=2), interpret=True)
    assert _rel(y, jit_call(w8a8_reference, x, w, act_granularity=act)) < 1e-5


def test_grouped_interpret_matches_reference_with_empty_and_uneven_groups():
    w = jit_call(fp8.quantize, jax.random.normal(jax.random.key(2), (4, 136, 384)),
                 granularity="channel")
    gs = jnp.asarray([5, 0, 19, 1], jnp.int32)
    x = jax.random.normal(jax.random.key(3), (28, 384), jnp.float32)  # 3 rows past the groups
    y = jit_call(w8a8_grouped_matmul, x, w, gs, config=W8A8MatmulConfig(num_sms=4, block_m=8),
                 interpret=True)
    assert _rel(y, jit_call(w8a8_reference, x, w, gs)) < 1e-5
    np.testing.assert_array_equal(np.asarray(y[25:]), 0.0)
    # output_rows: the result's rows read back in that order (repeats and padding rows too).
    perm = jnp.asarray([27, 3, 0, 24, 3, 5, 6, 26], jnp.int32)
    y2 = jit_call(w8a8_grouped_matmul, x, w, gs, config=W8A8MatmulConfig(num_sms=4, block_m=8),
                  interpret=True, output_rows=perm)
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y)[np.asarray(perm)])


def test_grouped_store_buffers_give_the_same_bits():
    """The epilogue's copies waited for at once or through two buffers (``store_buffers``):
    the same output bits (4 work items on 1 SM)."""
    w = jit_call(fp8.quantize, jax.random.normal(jax.random.key(6), (3, 128, 256)),
                 granularity="channel")
    gs = jnp.asarray([10, 0, 9], jnp.int32)
    x = jax.random.normal(jax.random.key(7), (19, 256), jnp.float32)
    def run(sb):
        return jit_call(w8a8_grouped_matmul, x, w, gs, interpret=True, config=W8A8MatmulConfig(
            num_sms=1, block_m=8, store_buffers=sb))

    ys = [run(sb) for sb in (0, 2)]
    # The setting reaches the kernel: its staging scratch [slots, block_m, 128].
    assert "[1,8,128]" in str(jax.make_jaxpr(lambda: run(0))())
    assert "[2,8,128]" in str(jax.make_jaxpr(lambda: run(2))())
    for y in ys[1:]:
        np.testing.assert_array_equal(np.asarray(y), np.asarray(ys[0]))
    assert _rel(ys[0], jit_call(w8a8_reference, x, w, gs)) < 1e-5


@pytest.mark.parametrize("act", ["token", "tensor"])
def test_grouped_source_rows_equal_the_gathered_rows(act):
    """Distinct rows plus ``source_rows`` (a MoE token's slots): the same result, bit for bit."""
    w = jit_call(fp8.quantize, jax.random.normal(jax.random.key(4), (3, 136, 256)),
                 granularity="channel")
    x = jax.random.normal(jax.random.key(5), (6, 256), jnp.float32)
    src = jnp.asarray([0, 2, 2, 5, 1, 1, 4, 3, 0, 5], jnp.int32)
    gs = jnp.asarray([4, 0, 6], jnp.int32)
    cfg = W8A8MatmulConfig(num_sms=4, block_m=8)
    y = jit_call(w8a8_grouped_matmul, x, w, gs, act_granularity=act, config=cfg, interpret=True,
                 source_rows=src)
    want = jit_call(w8a8_grouped_matmul, x[src], w, gs, act_granularity=act, config=cfg,
                    interpret=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_fp8_kernels_lower_for_cuda():
    def lower(fn, *args):
        with jax.sharding.use_abstract_mesh(H200):
            exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
                export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),
                export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
        assert "mosaic_gpu" in exp.mlir_module()
        return exp.mlir_module()

    w = jit_call(prepare_fp8_weights,
                 jit_call(fp8.quantize, jnp.ones((256, 512)), granularity="channel"))
    lower(lambda x, w: w8a8_matmul(x, w), jnp.ones((16, 512), jnp.bfloat16), w)
    lower(lambda x, w: w8a8_matmul(x, w, config=W8A8MatmulConfig(store_buffers=2)),
          jnp.ones((16, 512), jnp.bfloat16), w)
    we = jit_call(prepare_fp8_weights,
                  jit_call(fp8.quantize, jnp.ones((4, 128, 256)), granularity="channel"))
    text = lower(lambda x, w, gs: w8a8_grouped_matmul(x, w, gs), jnp.ones((24, 256),
                                                                         jnp.bfloat16), we,
                 jnp.asarray([8, 0, 10, 6], jnp.int32))
    assert "tile_plan" in text  # the plan kernel (W8A8MatmulConfig.tile_plan_kernel)


def test_bad_input_is_refused():
    w = jit_call(fp8.quantize, jnp.ones((128, 256)), granularity="channel")
    with pytest.raises(ValueError, match="K=128 does not match"):
        w8a8_matmul(jnp.ones((4, 128)), w)
    with pytest.raises(ValueError, match="act_granularity"):
        w8a8_matmul(jnp.ones((4, 256)), w, act_granularity="block1x128")
    w2 = jit_call(fp8.quantize, jnp.ones((2, 128, 256)), granularity="channel")
    with pytest.raises(ValueError, match="w8a8_grouped_matmul"):
        w8a8_matmul(jnp.ones((4, 256)), w2)
    with pytest.raises(ValueError, match="granularity"):
        prepare_fp8_weights(jit_call(fp8.quantize, jnp.ones((128, 256)),
                                     granularity="block128x128"))
    with pytest.raises(ValueError, match="group_sizes"):
        w8a8_grouped_matmul(jnp.ones((4, 256)), w2, jnp.asarray([3, 3], jnp.int32))
    with pytest.raises(ValueError, match="k_splits"):
        FP8GemmConfig(k_splits=0)
