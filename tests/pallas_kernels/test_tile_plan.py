"""The token-tile plan kernel (pallas_kernels.tile_plan): interpret mode equals the jnp plan
(``w4a4_grouped.tile_plan`` + ``row_experts``) entry for entry, the grouped matmuls give the
same result with it, cuda lowering, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from pallas_kernels import tile_plan as tp
from pallas_kernels.layout import prepare_w4a4_weights
from pallas_kernels.w4a4_grouped import plan_and_row_experts, w4a4_grouped_matmul
from pallas_kernels.w4a4_matmul import W4A4MatmulConfig
from pallas_kernels.w8a8_matmul import W8A8MatmulConfig, w8a8_grouped_matmul
from quads_jax.quant import fp8, nvfp4
from quads_jax.testing import lower_for_h200

NAMES = ("row_index", "tile_expert", "num_tiles", "row_slot", "row0", "window_rows",
         "row_expert")


def _sizes(kind: str, e: int, m: int, seed: int) -> jax.Array:
    if kind == "routed":  # a decode step's routing: every row in some group
        ids = jax.random.randint(jax.random.key(seed), (m,), 0, e)
        return jnp.bincount(ids, length=e).astype(jnp.int32)
    if kind == "skewed":  # one group takes almost everything, most are empty
        return jnp.zeros((e,), jnp.int32).at[1].set(m - 3).at[e - 1].set(3)
    # "partial": the groups sum to less than m (rows past them belong to no group)
    return jnp.asarray(np.arange(e) % 3, jnp.int32)


@pytest.mark.parametrize(
    "kind,e,m,block_m,block",
    [
        ("routed", 128, 1024, 16, 64),  # the decode step's gate_up plan
        ("routed", 6, 37, 8, 8),  # E and every index space not a power of two
        ("skewed", 5, 40, 16, 32),  # groups over several tiles, empty groups
        ("partial", 7, 40, 8, 64),  # sum(group_sizes) < m
    ],
)
def test_interpret_equals_the_jnp_plan(kind, e, m, block_m, block):
    gs = _sizes(kind, e, m, seed=m)
    want = jit_call(plan_and_row_experts, gs, m, block_m)
    got = jit_call(tp.tile_plan_kernel, gs, m, block_m, config=tp.TilePlanConfig(block=block),
                   interpret=True)
    assert len(got) == len(want) == len(NAMES)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == jnp.int32, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert got[0].shape == (tp.num_tiles_bound(m, e, block_m), block_m)
    assert got[5].shape == (tp.window_len(m, e, block_m),)


def test_grouped_matmuls_agree_with_and_without_the_kernel():
    k = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(k[0], (30, 256), jnp.bfloat16)
    gs = jnp.asarray([9, 0, 14, 5], jnp.int32)  # 28 of 30 rows
    wq = jit_call(nvfp4.quantize, jax.random.normal(k[1], (4, 128, 256)), scale_mode="expert")
    w = jit_call(prepare_w4a4_weights, wq)

    def w4a4(flag):
        cfg = W4A4MatmulConfig(a_via_smem=True, num_sms=4, tile_plan_kernel=flag)
        return np.asarray(jit_call(w4a4_grouped_matmul, x, w, gs, config=cfg, interpret=True),
                          np.float32)

    np.testing.assert_array_equal(w4a4(True), w4a4(False))
    wf = jit_call(fp8.quantize, jax.random.normal(k[2], (4, 128, 256)), granularity="channel")

    def w8a8(flag):
        cfg = W8A8MatmulConfig(num_sms=4, tile_plan_kernel=flag)
        return np.asarray(jit_call(w8a8_grouped_matmul, x, wf, gs, config=cfg, interpret=True),
                          np.float32)

    np.testing.assert_array_equal(w8a8(True), w8a8(False))
    assert W4A4MatmulConfig(tile_plan_kernel=True).tile_plan_config() == tp.TilePlanConfig()
    assert W4A4MatmulConfig(tile_plan_kernel=False).tile_plan_config() is None
    assert W8A8MatmulConfig(tile_plan_block=8, tile_plan_warps=2).tile_plan_config() == \
        tp.TilePlanConfig(block=8, num_warps=2)
    with pytest.raises(ValueError, match="TilePlanConfig.block"):
        W4A4MatmulConfig(tile_plan_block=12)


def test_lowers_for_cuda():
    text = lower_for_h200(lambda gs: tp.tile_plan_kernel(gs, 1024, 16),
                          jnp.zeros((128,), jnp.int32))
    assert "tile_plan" in text
    assert "ctlz" not in text  # Triton's NVIDIA backend cannot legalize it (rac_select's test)


def test_bad_input():
    with pytest.raises(ValueError, match="int vector"):
        tp.tile_plan_kernel(jnp.zeros((4,), jnp.float32), 8, 8, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        tp.tile_plan_kernel(jnp.zeros((4,), jnp.int32), 8, 12, interpret=True)
    with pytest.raises(ValueError, match="m=0"):
        tp.tile_plan_kernel(jnp.zeros((4,), jnp.int32), 0, 8, interpret=True)
    with pytest.raises(ValueError, match="block"):
        tp.TilePlanConfig(block=48)
    with pytest.raises(ValueError, match="block"):
        tp.TilePlanConfig(block=4)
    with pytest.raises(ValueError, match="num_warps"):
        tp.TilePlanConfig(num_warps=3)
