"""RAC reference (QUADS_SPEC section 4): block selection, selection modes, residual scale and
format options, static calibration, the adaptive energy target."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from quads_jax.quant import nvfp4, ops, rac
from quads_jax.quant.recipe import QuantRecipe

SITE = "layers.1.mlp.experts.down"
M, K, N = 12, 128, 16


def f64(a) -> np.ndarray:
    """float64 host copy: reference products must not run as TF32 on a GPU."""
    return np.asarray(a, np.float64)


def rec(**kw) -> QuantRecipe:
    return QuantRecipe(rules=(("*", "w4a4_nvfp4_rac"),), backend="reference", **kw)


@pytest.fixture(scope="module")
def xw():
    kx, kw, ks = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (M, K)) * jnp.exp(2 * jax.random.normal(ks, (K,)))
    return x, jax.random.normal(kw, (N, K)) * 0.1


def test_select_blocks_counts_ties_and_energy():
    scores = jnp.asarray([[1.0, 5.0, 5.0, 0.0, 3.0, 2.0, 0.5, 4.0]])
    m = np.asarray(rac.select_blocks(scores, 0.5))
    np.testing.assert_array_equal(m[0], [0, 1, 1, 0, 1, 0, 0, 1])
    m = np.asarray(rac.select_blocks(scores, 0.25))
    np.testing.assert_array_equal(m[0], [0, 1, 1, 0, 0, 0, 0, 0])
    m = np.asarray(rac.select_blocks(scores, 0.125))  # tie 5.0 / 5.0: lower index wins
    np.testing.assert_array_equal(m[0], [0, 1, 0, 0, 0, 0, 0, 0])
    # total 20.5: 5 + 5 = 10 < 0.6 * 20.5 = 12.3, +4 = 14 >= 12.3 -> three blocks
    m = np.asarray(rac.select_blocks(scores, 1.0, energy_target=0.6))
    np.testing.assert_array_equal(m[0], [0, 1, 1, 0, 0, 0, 0, 1])
    m = np.asarray(rac.select_blocks(scores, 0.25, energy_target=0.6))  # ratio caps it
    assert m.sum() == 2


def test_pairwise_ranks_equal_the_sorting_path(monkeypatch):
    """Small score arrays are ranked by pairwise comparisons (no sort kernels), large ones by two
    stable argsorts: both must select the same blocks, ties, NaN and inf included."""
    rng = np.random.default_rng(0)
    for trial in range(30):
        s = rng.integers(0, 4, size=(int(rng.integers(1, 5)), int(rng.integers(1, 33))))
        s = s.astype(np.float32)
        s[rng.random(s.shape) < 0.15] = np.nan if trial % 2 else np.inf
        ratio = float(rng.uniform(0.05, 1.0))
        # jitted (one compile per shape; eagerly every small op compiled for each new shape),
        # a fresh function per path: the limit is read when the function is traced
        fast = np.asarray(jax.jit(lambda a, r=ratio: rac.select_blocks(a, r))(s))
        monkeypatch.setattr(rac, "PAIRWISE_RANK_LIMIT", 0)
        slow = np.asarray(jax.jit(lambda a, r=ratio: rac.select_blocks(a, r))(s))
        monkeypatch.undo()
        np.testing.assert_array_equal(fast, slow)


def test_online_batch_scores_only_the_valid_rows(xw):
    """``row_valid``: rows that are not tokens (padding, finished sequences) take no part in
    ``online_batch``'s selection. Valid rows then get what a batch of the valid rows alone
    gets, whatever garbage the others hold, dense and grouped."""
    x, w = xw
    # Jitted: one compile per shape instead of a dispatch of every small op.
    linear = jax.jit(lambda x, w, v=None: ops.linear(x, w, SITE, rec(), row_valid=v))
    grouped = jax.jit(lambda x, w, gs, src, v: ops.grouped_linear(
        x, w, gs, SITE, rec(), source_rows=src, row_valid=v))
    valid = jnp.arange(M) % 3 != 1
    garbage = x.at[~valid].set(1e4 * jax.random.normal(jax.random.key(9), (M, K))[~valid])
    alone = linear(x[valid], w)
    got = linear(garbage, w, valid)
    np.testing.assert_array_equal(np.asarray(got)[np.asarray(valid)], np.asarray(alone))
    unmasked = linear(garbage, w)[valid]
    assert float(jnp.abs(unmasked - alone).max()) > 1e-4  # the garbage did move the selection

    # Grouped, with distinct source rows: experts 0 / 1 get sorted rows [0, 7) / [7, 12).
    wg = jnp.stack([w, w[::-1]])
    gs = jnp.asarray([7, 5], jnp.int32)
    source = jnp.asarray([0, 2, 3, 5, 6, 8, 9, 1, 4, 7, 10, 11], jnp.int32)
    got = grouped(garbage, wg, gs, source, valid)
    keep = np.asarray(valid)[np.asarray(source)]
    per_expert = [(slice(0, 7), 0), (slice(7, 12), 1)]
    for rows, e in per_expert:
        src = np.asarray(source)[rows][keep[rows]]
        want = linear(x[src], wg[e])
        np.testing.assert_allclose(np.asarray(got)[rows][keep[rows]], np.asarray(want),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="row_valid shape"):
        ops.linear(x, w, SITE, rec(), row_valid=valid[:5])


def test_online_token_equals_per_row_online_batch(xw):
    x, w = xw
    # jitted: one compile per shape (eagerly, every small op of the RAC path compiled)
    y = jax.jit(lambda x: ops.linear(x, w, SITE, rec(rac_selection="online_token")))(x)
    batch_rac = jax.jit(lambda x: ops.linear(x, w, SITE, rec()))
    rows = [batch_rac(x[i:i + 1]) for i in range(M)]
    np.testing.assert_allclose(y, jnp.concatenate(rows), rtol=1e-5, atol=1e-5)
    batch = batch_rac(x)
    assert float(jnp.abs(batch - y).max()) > 1e-4  # the two selections differ here


def test_static_calibration_on_same_batch_equals_online(xw):
    x, w = xw
    # jitted: one compile per shape (eagerly, every small op compiled)
    calibrate = jax.jit(lambda x: rac.calibrate_blocks(x, rec()))
    blocks = calibrate(x)
    assert blocks.shape == (K // 16,) and int(blocks.sum()) == 4
    quantize = jax.jit(nvfp4.quantize, static_argnames="scale_mode")
    leaf = rac.CalibratedWeight(quantize(w, scale_mode="expert"), rac_blocks=blocks)
    static = jax.jit(lambda x, leaf: ops.linear(x, leaf, SITE, rec(rac_selection="static")))
    online = jax.jit(lambda x, w: ops.linear(x, w, SITE, rec()))
    np.testing.assert_array_equal(static(x, leaf), online(x, w))
    with pytest.raises(ValueError, match="static"):  # an uncalibrated weight: refused
        static(x, w)
    # grouped calibration: one block set per expert
    row_expert = jnp.asarray([0] * 5 + [2] * 7, jnp.int32)
    per_expert = jax.jit(lambda x, e: rac.calibrate_blocks(x, rec(), row_expert=e,
                                                           num_experts=3))(x, row_expert)
    assert per_expert.shape == (3, K // 16)
    np.testing.assert_array_equal(per_expert[0], calibrate(x[:5]))


def test_shared_residual_scale_and_bf16_format(xw):
    x, w = xw
    qx = jit_call(nvfp4.quantize, x, scale_mode="row")
    r = jit_call(nvfp4.residual, x, qx)
    mask = jit_call(rac.block_mask, x, r, rec())
    r_s = jit_call(rac.masked_residual, r, mask)
    wq = f64(jit_call(nvfp4.dequantize, jit_call(nvfp4.quantize, w), jnp.float32))
    y0 = f64(jit_call(nvfp4.dequantize, qx)) @ wq.T
    shared = jit_call(nvfp4.quantize, r_s, global_scale=qx.global_scale, scale_mode="row")
    np.testing.assert_allclose(jit_call(ops.linear, x, w, SITE, rec(rac_residual_scale="shared")),
                               y0 + f64(jit_call(nvfp4.dequantize, shared)) @ wq.T, rtol=1e-5,
                               atol=1e-5)
    bf16 = f64(r_s.astype(jnp.bfloat16).astype(jnp.float32)) @ wq.T
    np.testing.assert_allclose(jit_call(ops.linear, x, w, SITE, rec(rac_residual_format="bf16")),
                               y0 + bf16, rtol=1e-5, atol=1e-5)


def test_scores_pick_the_loud_block():
    x = jax.random.normal(jax.random.key(0), (4, 64)) * 0.01
    x = x.at[:, 32:48].mul(1000.0)  # block 2 dominates amax and the residual
    qx = nvfp4.quantize(x, scale_mode="tensor")
    r = nvfp4.residual(x, qx)
    for score in ("residual_l2", "residual_l1", "act_amax"):
        m = rac.block_mask(x, r, rec(rac_score=score, rac_ratio=0.25))
        np.testing.assert_array_equal(np.asarray(m)[0], [0, 0, 1, 0])


def test_captured_energy_grows_with_ratio_and_meets_target(xw):
    x, _ = xw
    qx = nvfp4.quantize(x, scale_mode="row")
    r = nvfp4.residual(x, qx)
    energy = [float(rac.captured_energy(r, rac.block_mask(x, r, rec(rac_ratio=q))))
              for q in (0.125, 0.5, 1.0)]
    assert energy[0] < energy[1] < energy[2] == 1.0
    m = rac.block_mask(x, r, rec(rac_ratio=1.0, rac_energy_target=0.8))
    assert float(rac.captured_energy(r, m)) >= 0.8
    assert int(m[0].sum()) < K // 16


def test_ordered_segment_sum_is_segment_sum_without_a_scatter():
    """The expert sums of ``online_batch`` add in one fixed order: with exactly representable
    values they equal ``segment_sum`` (unsorted ids, empty segments, ids past the segments
    dropped, a NaN or inf kept in its own segment), and the program has no scatter (XLA's
    GPU scatter-add adds float32 in any order: RAC's block sets changed from run to run)."""
    rng = np.random.default_rng(0)
    # jitted, as online_batch runs it: one compile per shape (eagerly, every small op compiled)
    ordered = jax.jit(rac.ordered_segment_sum, static_argnums=2)
    segment_sum = jax.jit(jax.ops.segment_sum, static_argnums=2)
    for m, e in ((1, 1), (9, 3), (200, 16)):
        values = rng.integers(0, 64, (m, 5)).astype(np.float32)
        ids = rng.integers(0, e + 2, m).astype(np.int32)
        got = ordered(jnp.asarray(values), jnp.asarray(ids), e)
        np.testing.assert_array_equal(np.asarray(got), segment_sum(values, ids, e))
    values = np.ones((6, 2), np.float32)
    values[2, 0], values[4, 1] = np.nan, np.inf
    ids = np.array([3, 0, 1, 1, 2, 0], np.int32)
    got = np.asarray(ordered(jnp.asarray(values), jnp.asarray(ids), 5))
    np.testing.assert_array_equal(got, [[2, 2], [np.nan, 2], [1, np.inf], [1, 1], [0, 0]])
    np.testing.assert_array_equal(
        np.asarray(ordered(jnp.zeros((0, 3)), jnp.zeros((0,), jnp.int32), 2)),
        np.zeros((2, 3)))
    hlo = jax.jit(lambda v, i: rac.aggregate_scores(v, "residual_l2", i, 4)).lower(
        values, ids).as_text()
    assert "scatter" not in hlo
    with pytest.raises(ValueError, match="same leading length"):
        rac.ordered_segment_sum(jnp.ones((4, 2)), jnp.zeros((3,), jnp.int32), 2)
