"""Activation pre-pass of the W4A4 kernels: bit-identical to nvfp4.quantize / ops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import nvfp4_quantize as aq
from quads_jax.quant import nvfp4, ops, rac
from quads_jax.quant.recipe import QuantRecipe


def _same(a, b):
    np.testing.assert_array_equal(nvfp4.codes_of(a), nvfp4.codes_of(b))
    np.testing.assert_array_equal(a.scales.view(jnp.uint8), b.scales.view(jnp.uint8))
    np.testing.assert_array_equal(a.global_scale, b.global_scale)


@pytest.mark.parametrize("mode", ["per_token", "per_batch", "static"])
def test_quantizer_is_ops_act_quantize(mode):
    x = jax.random.normal(jax.random.key(0), (9, 96), jnp.bfloat16) * 5
    static = jnp.float32(0.004) if mode == "static" else None
    got = aq.nvfp4_quantize(x, act_scale_mode=mode, static_scale=static)
    want = ops.act_quantize(x, QuantRecipe(act_scale_mode=mode), static_scale=static)
    _same(got.q, want)
    vals, g = aq.mma_operand(got.q, jnp.float16)
    np.testing.assert_array_equal(vals.astype(jnp.float32) * g[:, None],
                                  nvfp4.dequantize(got.q, jnp.float32))


@pytest.mark.parametrize("scale", ["separate", "shared"])
@pytest.mark.parametrize("selection", ["online_batch", "online_token"])
def test_rac_residual_matches_the_reference_construction(scale, selection):
    x = jax.random.normal(jax.random.key(1), (7, 128)) * 2
    cfg = aq.RACConfig(rac_residual_scale=scale, rac_selection=selection, rac_ratio=0.25)
    got = aq.nvfp4_quantize(x, rac_config=cfg)
    q = nvfp4.quantize(x, scale_mode="row")
    r = nvfp4.residual(x, q)
    mask = rac.block_mask(x, r, cfg)
    assert int(mask.sum(-1)[0]) == 2  # 25% of 8 blocks
    g = q.global_scale if scale == "shared" else None
    _same(got.residual, nvfp4.quantize(rac.masked_residual(r, mask), global_scale=g,
                                       scale_mode="row"))
    np.testing.assert_array_equal(got.mask, mask)


def test_bad_inputs():
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="act_scale_mode"):
        aq.nvfp4_quantize(x, act_scale_mode="per_layer")
    with pytest.raises(ValueError, match="static_scale"):
        aq.nvfp4_quantize(x, act_scale_mode="static")
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        aq.nvfp4_quantize(jnp.ones((2, 4, 32)))
    with pytest.raises(ValueError, match="rac_ratio"):
        aq.RACConfig(rac_ratio=0.0)
    with pytest.raises(ValueError, match="rac_score"):
        aq.RACConfig(rac_score="energy")
