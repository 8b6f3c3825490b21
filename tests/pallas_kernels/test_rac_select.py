"""The RAC selection kernel (pallas_kernels.rac_select): interpret mode equals the jnp path bit
for bit (coded block amax and decode scales, with and without the token mask), through the
grouped W4A4 matmul too; cuda lowering; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from pallas_kernels import nvfp4_quantize as aq
from pallas_kernels import rac_select as rs
from pallas_kernels.w4a4_grouped import w4a4_grouped_matmul
from pallas_kernels.w4a4_matmul import W4A4MatmulConfig
from quads_jax.testing import grouped_w4a4_case, lower_for_h200


def _inputs(r, m, nb, seed):
    k = jax.random.split(jax.random.key(seed), 5)
    # Multiples of 1/16 below 4: every sum of them is exact, so any summation order agrees.
    scores = jnp.floor(jax.random.uniform(k[0], (r, nb)) * 64) / 16
    amax = jax.random.uniform(k[1], (r, nb)) * 3
    finite = jax.random.uniform(k[2], (r, nb)) > 0.05
    rows = jax.random.randint(k[3], (m,), 0, r)
    valid = jax.random.uniform(k[4], (r,)) > 0.2
    return scores, amax, finite, rows, valid


@pytest.mark.parametrize(
    "r,m,nb,group_sizes,block_rows",
    [
        (16, 40, 128, [10, 0, 20, 10], 16),
        (12, 30, 48, [5, 5, 0, 0, 3, 7], 16),  # 10 rows past the groups: the last expert's
        (20, 100, 128, [40, 1, 0, 35, 24], 8),  # experts over several loop steps
        (8, 8, 16, [0, 0, 8], 4),
        (8, 5, 24, [2, 3], 32),  # M below block_rows; 24 blocks: chunks of 8
    ],
)
@pytest.mark.parametrize("with_valid", [False, True])
def test_interpret_equals_the_jnp_path(r, m, nb, group_sizes, block_rows, with_valid):
    scores, amax, finite, rows, valid = jit_call(_inputs, r, m, nb, seed=r + m)
    valid = valid if with_valid else None
    gs = jnp.asarray(group_sizes, jnp.int32)
    ref = jit_call(rs.grouped_rac_selection_reference, scores, amax, finite, rows, gs, ratio=0.5,
                   row_valid=valid)
    for fin in (finite, finite.astype(jnp.int8)):  # the row pass's int8 is read as it is
        out = jit_call(rs.grouped_rac_selection, scores, amax, fin, rows, gs, ratio=0.5,
                       row_valid=valid, config=rs.RACSelectConfig(block_rows=block_rows),
                       interpret=True)
        for name, a, b in zip(("coded", "g"), out, ref, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    selected = ~(np.asarray(out[0]) < 0)
    assert selected.sum(axis=1).min() == selected.sum(axis=1).max() == round(0.5 * nb)
    if with_valid:  # the rows that are not tokens do not vote
        alone = jit_call(rs.grouped_rac_selection_reference,
                         jnp.where(valid[:, None], scores, 0.0), amax, finite, rows, gs,
                         ratio=0.5)
        np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(alone[0]))


def test_nan_scores_rank_last_and_ties_take_the_lower_block():
    scores = jnp.zeros((4, 16)).at[:, 3].set(jnp.nan)  # all tied but block 3
    amax = jnp.ones((4, 16))
    finite = jnp.ones((4, 16), bool)
    rows = jnp.arange(4, dtype=jnp.int32)
    gs = jnp.asarray([4], jnp.int32)
    coded, g = jit_call(rs.grouped_rac_selection, scores, amax, finite, rows, gs, ratio=0.25,
                        interpret=True)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(coded[0]) >= 0), [0, 1, 2, 4])
    # rows None (the GEMM rows are the score rows: down's call): no index array, same result
    none = jit_call(rs.grouped_rac_selection, scores, amax, finite, None, gs, ratio=0.25,
                    interpret=True)
    for a, b in zip(none, (coded, g), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("with_valid", [False, True])
def test_grouped_matmul_with_and_without_the_kernel_agree(with_valid):
    """The grouped RAC matmul through the selection kernel equals the jnp selection bit for bit
    (the tiles, the kernel's products and the scales are then the same), with a token mask
    too (finished sequences do not vote); and with ``rac_select_slot_scales``, whose epilogue
    scales come from the selection kernel (its third output is what the tile kernel reads)."""
    from quads_jax.testing import pallas_calls

    x, src, w, gs = jit_call(grouped_w4a4_case, 7)
    valid = (jnp.arange(12) % 3 != 1) if with_valid else None

    def run(x, flag, slot_scales=False):
        cfg = W4A4MatmulConfig(a_via_smem=True, num_sms=2, rac_select_kernel=flag,
                               rac_select_slot_scales=slot_scales)
        return jit_call(w4a4_grouped_matmul, x, w, gs, rac=aq.RACConfig(), config=cfg,
                        interpret=True, source_rows=src, row_valid=valid)

    want = np.asarray(run(x, False), np.float32)
    np.testing.assert_array_equal(np.asarray(run(x, True, with_valid), np.float32), want)
    calls = pallas_calls(jax.make_jaxpr(lambda x: run(x, True, with_valid))(x))
    assert [len(c.outvars) for c in calls if str(c.params["name"]) == "rac_select"] == [
        3 if with_valid else 2]


@pytest.mark.parametrize("r,m,nb,group_sizes,block_rows,block_m", [
    (12, 30, 48, [5, 5, 0, 0, 3, 7], 16, 8),  # rows past the groups; 5 unused tiles of 9
    (16, 40, 16, [17, 0, 23], 8, 8),  # groups over several tiles and walk steps
    (8, 5, 24, [2, 3], 32, 16),
])
def test_slot_scales_equal_the_tile_plans(r, m, nb, group_sizes, block_rows, block_m):
    """``tiles``: the third output equals ``token_tiles``' scales over the tile plan (each live
    slot's activation and residual decode scales, 0 in empty slots and unused tiles), bit for
    bit; the selection itself is unchanged."""
    from pallas_kernels.w4a4_grouped import tile_plan

    scores, amax, finite, rows, valid = jit_call(_inputs, r, m, nb, seed=r + nb)
    gs = jnp.asarray(group_sizes, jnp.int32)
    act = jax.random.uniform(jax.random.key(m), (r,), minval=0.5, maxval=2.0)
    row_index, *_ = jit_call(tile_plan, gs, m, block_m)
    t = row_index.shape[0]
    cfg = rs.RACSelectConfig(block_rows=block_rows)
    coded, g, slots = jit_call(
        rs.grouped_rac_selection, scores, amax, finite, rows, gs, ratio=0.5, row_valid=valid,
        config=cfg, interpret=True, tiles=rs.SlotScales(block_m, t), act_scales=act)
    alone = jit_call(rs.grouped_rac_selection, scores, amax, finite, rows, gs, ratio=0.5,
                     row_valid=valid, config=cfg, interpret=True)
    for a, b in zip((coded, g), alone, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    live = row_index < m
    at = jnp.minimum(row_index, m - 1)
    want = jnp.stack([jnp.where(live, act[rows[at]], 0.0), jnp.where(live, g[at], 0.0)],
                     axis=1)
    assert slots.shape == (t, 2, block_m)
    np.testing.assert_array_equal(np.asarray(slots).view(np.uint32),
                                  np.asarray(want).view(np.uint32))
    with pytest.raises(ValueError, match="power of"):
        rs.grouped_rac_selection(scores, amax, finite, rows, gs, ratio=0.5, interpret=True,
                                 tiles=rs.SlotScales(24, t), act_scales=act)


def test_supports_only_what_it_computes():
    assert rs.supports(aq.RACConfig(), "per_token")
    assert not rs.supports(aq.RACConfig(), "per_batch")
    assert not rs.supports(aq.RACConfig(rac_selection="online_token"), "per_token")
    assert not rs.supports(aq.RACConfig(rac_score="act_amax"), "per_token")
    assert not rs.supports(aq.RACConfig(rac_energy_target=0.9), "per_token")
    assert not rs.supports(aq.RACConfig(rac_residual_scale="shared"), "per_token")


@pytest.mark.parametrize("exact", [False, True])
def test_lowers_for_cuda(exact):
    args = (jnp.ones((128, 48)), jnp.ones((128, 48)), jnp.ones((128, 48), jnp.int8),
            jnp.zeros((1024,), jnp.int32), jnp.full((128,), 8, jnp.int32), jnp.ones(128, bool))
    cfg = rs.RACSelectConfig(exact_division=exact)
    text = lower_for_h200(lambda *a: rs.grouped_rac_selection(*a[:5], ratio=0.5,
                                                              row_valid=a[5], config=cfg),
                          *args)
    assert "rac_select" in text
    assert ("div.rn.f32" in text) == exact  # arith.division: the kernel's division
    lower_for_h200(lambda *a: rs.grouped_rac_selection(*a[:3], None, a[4], ratio=0.5,
                                                       row_valid=a[5], config=cfg), *args)
    # with the tile kernels' epilogue scales (the decode step's 192 tiles of 16)
    text = lower_for_h200(lambda *a: rs.grouped_rac_selection(
        *a[:5], ratio=0.5, row_valid=a[5], config=cfg, tiles=rs.SlotScales(16, 192),
        act_scales=a[6]), *args, jnp.ones((128,)))
    assert "ctlz" not in text
    # Ops Triton's NVIDIA backend cannot legalize (its compile runs only on a GPU): math.ctlz
    # (an unsigned clz) failed on the H200 on 2026-12-03.
    assert "ctlz" not in text


def test_bad_input():
    s = jnp.ones((4, 16))
    rows, gs = jnp.zeros((4,), jnp.int32), jnp.asarray([4], jnp.int32)
    with pytest.raises(ValueError, match="must all be"):
        rs.grouped_rac_selection(s, jnp.ones((4, 8)), s > 0, rows, gs, ratio=0.5, interpret=True)
    with pytest.raises(ValueError, match="rows"):
        rs.grouped_rac_selection(s, s, s > 0, rows[None], gs, ratio=0.5, interpret=True)
    with pytest.raises(ValueError, match=r"rows None must be None or \[M\] and group_sizes"):
        rs.grouped_rac_selection(s, s, s > 0, None, gs[None], ratio=0.5, interpret=True)
    with pytest.raises(ValueError, match="row_valid"):
        rs.grouped_rac_selection(s, s, s > 0, rows, gs, ratio=0.5, row_valid=jnp.ones(3, bool),
                                 interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        rs.RACSelectConfig(block_rows=12)
