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
