"""The slot-sort kernel (pallas_kernels.slot_sort): interpret mode equals ``moe.sort_slots``'
jnp path entry for entry (uniform, skewed, single-expert routing; E not a power of two), the
MoE block gives the same result with it, cuda lowering, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import slot_sort as ss
from quads_jax.models.moe import sort_slots
from quads_jax.testing import lower_for_h200


def _ids(kind: str, s: int, e: int, seed: int) -> jax.Array:
    key = jax.random.key(seed)
    if kind == "uniform":
        return jax.random.randint(key, (s,), 0, e).astype(jnp.int32)
    if kind == "skewed":  # most slots on one expert, the rest on the last
        return jnp.where(jax.random.uniform(key, (s,)) < 0.9, 1, e - 1).astype(jnp.int32)
    return jnp.full((s,), e - 1, jnp.int32)  # "one": every slot on the last expert


@pytest.mark.parametrize("s,e,kind,block", [
    (1024, 128, "uniform", 16),  # a decode step at batch 128, top-8 of 128
    (1024, 128, "skewed", 16),
    (8, 128, "uniform", 16),  # one token: one program counts all 128 experts
    (32, 16, "one", 16),
    (64, 6, "uniform", 16),  # E = 6: slices of 2 experts over 4 programs
    (64, 8, "skewed", 4),  # more programs than experts: the last ones count none
])
def test_interpret_equals_the_jnp_path(s, e, kind, block):
    ids = _ids(kind, s, e, seed=s + e)
    cfg = ss.SlotSortConfig(block=block)
    assert ss.supports(s, e, cfg)
    got = ss.slot_sort(ids, e, config=cfg, interpret=True)
    want = sort_slots(ids, e)
    for name, a, b in zip(("order", "inverse", "counts"), got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    order, inverse, counts = (np.asarray(a) for a in got)
    np.testing.assert_array_equal(order[inverse], np.arange(s))  # a permutation and its inverse
    assert counts.sum() == s


def test_sort_slots_takes_the_kernel_where_asked_and_supported():
    ids = _ids("uniform", 64, 6, seed=1)
    for a, b in zip(sort_slots(ids, 6, "interpret"), sort_slots(ids, 6), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = str(jax.make_jaxpr(lambda i: sort_slots(i, 6, "interpret"))(ids))
    assert "slot_sort" in text
    for s in (48, 2, 2 * ss.MAX_SLOTS):  # not a power of two; 2 slots can't cover 6 experts
        assert not ss.supports(s, 6)
    text = str(jax.make_jaxpr(lambda i: sort_slots(i, 6, "interpret"))(ids[:48]))
    assert "slot_sort" not in text


def test_lowers_for_cuda():
    text = lower_for_h200(lambda i: ss.slot_sort(i, 128), jnp.zeros((1024,), jnp.int32))
    assert "slot_sort" in text


def test_bad_input():
    with pytest.raises(ValueError, match="ids"):
        ss.slot_sort(jnp.zeros((4, 2), jnp.int32), 4, interpret=True)
    with pytest.raises(ValueError, match="ids"):
        ss.slot_sort(jnp.zeros((4,), jnp.float32), 4, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        ss.slot_sort(jnp.zeros((2,), jnp.int32), 6, interpret=True)
    with pytest.raises(ValueError, match="block"):
        ss.SlotSortConfig(block=48)
    with pytest.raises(ValueError, match="num_warps"):
        ss.SlotSortConfig(num_warps=3)


def test_moe_block_equals_with_and_without_the_kernel():
    """The MoE block (bf16 expert kernels in interpret mode) gives the same output and routing
    with the slot-sort kernel as with the jnp count (``moe.set_slot_sort_kernel``), and only
    traces the kernel when asked."""
    from quads_jax.models import init_params, moe
    from quads_jax.quant.recipe import QuantRecipe
    from quads_jax.testing import tiny_config

    cfg = tiny_config(dtype="float32")
    p = jax.tree.map(lambda a: a[0], init_params(cfg, jax.random.key(0))["layers"][0]["mlp"])
    x = jax.random.normal(jax.random.key(1), (8, cfg.hidden_size), jnp.float32)
    recipe = QuantRecipe(backend="interpret")
    assert ss.supports(8 * cfg.num_experts_per_tok, cfg.num_experts)

    def run(on):
        try:
            moe.set_slot_sort_kernel(on)
            fn = lambda p, x: moe.moe_block(cfg, p, x, "layers.0.mlp", recipe)  # noqa: E731
            return str(jax.make_jaxpr(fn)(p, x)), jax.jit(fn)(p, x)
        finally:
            moe.set_slot_sort_kernel()

    (text_on, (y_on, r_on)), (text_off, (y_off, r_off)) = run(True), run(False)
    assert "slot_sort" in text_on and "slot_sort" not in text_off
    np.testing.assert_array_equal(np.asarray(r_on.expert_ids), np.asarray(r_off.expert_ids))
    np.testing.assert_array_equal(np.asarray(y_on), np.asarray(y_off))
