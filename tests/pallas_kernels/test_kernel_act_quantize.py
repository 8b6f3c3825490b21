"""Activation pre-pass of the W4A4 kernels: bit-identical to nvfp4.quantize / ops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from pallas_kernels import nvfp4_quantize as aq
from quads_jax.quant import nvfp4, ops, rac
from quads_jax.quant.recipe import QuantRecipe


def _same(a, b):
    np.testing.assert_array_equal(jit_call(nvfp4.codes_of, a), jit_call(nvfp4.codes_of, b))
    np.testing.assert_array_equal(a.scales.view(jnp.uint8), b.scales.view(jnp.uint8))
    np.testing.assert_array_equal(a.global_scale, b.global_scale)


@pytest.mark.parametrize("mode", ["per_token", "per_batch", "static"])
def test_quantizer_is_ops_act_quantize(mode):
    x = jax.random.normal(jax.random.key(0), (9, 96), jnp.bfloat16) * 5
    static = jnp.float32(0.004) if mode == "static" else None
    got = jit_call(aq.nvfp4_quantize, x, act_scale_mode=mode, static_scale=static)
    want = jit_call(ops.act_quantize, x, QuantRecipe(act_scale_mode=mode), static_scale=static)
    _same(got.q, want)
    vals, g = jit_call(aq.mma_operand, got.q, jnp.float16)
    np.testing.assert_array_equal(vals.astype(jnp.float32) * g[:, None],
                                  jit_call(nvfp4.dequantize, got.q, jnp.float32))


@pytest.mark.parametrize("scale", ["separate", "shared"])
@pytest.mark.parametrize("selection", ["online_batch", "online_token"])
def test_rac_residual_matches_the_reference_construction(scale, selection):
    x = jax.random.normal(jax.random.key(1), (7, 128)) * 2
    cfg = aq.RACConfig(rac_residual_scale=scale, rac_selection=selection, rac_ratio=0.25)
    got = jit_call(aq.nvfp4_quantize, x, rac_config=cfg)
    q = jit_call(nvfp4.quantize, x, scale_mode="row")
    r = jit_call(nvfp4.residual, x, q)
    mask = jit_call(rac.block_mask, x, r, cfg)
    assert int(mask.sum(-1)[0]) == 2  # 25% of 8 blocks
    g = q.global_scale if scale == "shared" else None
    masked = jit_call(rac.masked_residual, r, mask)
    _same(jit_call(rac.SelectedResidual.codes, got.residual),
          jit_call(nvfp4.quantize, masked, global_scale=g, scale_mode="row"))
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


def _old_residual_codes(x, cfg, act_mode, rows, row_expert, e, static_blocks):
    """The construction before ``rac.SelectedResidual``: the masked residual of the GEMM rows,
    materialized, then quantized with the residual scale mode."""
    q = nvfp4.quantize_activations(x, act_mode)
    r = nvfp4.residual(x, q)
    xg, rg = (x, r) if rows is None else (x[rows], r[rows])
    mask = rac.block_mask(xg, rg, cfg, row_expert=row_expert, num_experts=e,
                          static_blocks=static_blocks)
    r_s = rac.masked_residual(rg, mask)
    if cfg.rac_residual_scale == "shared":
        g = q.global_scale if rows is None or not q.global_scale.ndim else q.global_scale[rows]
        mode = "row" if g.ndim else "tensor"
        return nvfp4.quantize_codes(r_s, global_scale=g, scale_mode=mode), mask
    mode = "tensor" if act_mode == "per_batch" else "row"
    return nvfp4.quantize_codes(r_s, scale_mode=mode), mask


# Each selection, residual scale and activation scale mode, with and without source rows (a
# covering set rather than the full product: each case costs seconds of eager dispatch on CI).
@pytest.mark.parametrize("act_mode,scale,selection,gathered", [
    ("per_token", "separate", "online_batch", True),
    ("per_token", "separate", "online_token", True),
    ("per_token", "separate", "static", True),
    ("per_token", "shared", "online_batch", True),
    ("per_token", "separate", "online_batch", False),
    ("per_batch", "separate", "online_batch", False),
    ("per_batch", "shared", "online_token", False),
    ("per_batch", "separate", "static", True),
])
def test_selected_residual_codes_are_the_materialized_ones(act_mode, scale, selection, gathered):
    """``SelectedResidual.codes`` (all rows, and any tile-shaped set of rows with empty slots)
    equals quantizing the materialized masked residual, bit for bit."""
    e, k, n_tok = 4, 96, 6
    x = jax.random.normal(jax.random.key(3), (n_tok, k)) * 3
    x = x.at[2, 16:32].multiply(40.0)  # one loud block
    rows = jnp.array([0, 3, 1, 1, 5, 2, 4, 0, 2], jnp.int32) if gathered else None
    m = n_tok if rows is None else rows.shape[0]
    row_expert = jnp.sort(jax.random.randint(jax.random.key(4), (m,), 0, e))
    static = (jax.random.uniform(jax.random.key(5), (e, k // 16)) < 0.5
              if selection == "static" else None)
    cfg = aq.RACConfig(rac_residual_scale=scale, rac_selection=selection, rac_ratio=0.5)
    want, want_mask = jit_call(_old_residual_codes, x, cfg, act_mode, rows, row_expert, e,
                               static)
    q = jit_call(nvfp4.quantize_activations, x, act_mode)
    sel = jit_call(rac.select_residual, x, q, cfg, act_scale_mode=act_mode, rows=rows,
                   row_expert=row_expert, num_experts=e, static_blocks=static)
    np.testing.assert_array_equal(sel.mask, want_mask)
    got = jit_call(rac.SelectedResidual.codes, sel)
    np.testing.assert_array_equal(got.codes, want.codes)
    np.testing.assert_array_equal(got.scales.view(jnp.uint8), want.scales.view(jnp.uint8))
    np.testing.assert_array_equal(
        got.global_scale, jnp.broadcast_to(jnp.asarray(want.global_scale).reshape(-1, 1), (m, 1)))
    np.testing.assert_array_equal(jit_call(nvfp4.dequantize, got),
                                  jit_call(nvfp4.dequantize, want))
    np.testing.assert_array_equal(jit_call(rac.SelectedResidual.unscaled, sel),
                                  jit_call(nvfp4.unscaled_values, want))
    # Tile-shaped rows, with empty slots (index M): the same rows, zeros where empty.
    index = jnp.array([[0, 4, m], [m, 2, 1]], jnp.int32)
    tiled = jit_call(rac.SelectedResidual.codes, sel, index)
    live = np.asarray(index) < m
    for field in ("codes", "scales", "global_scale"):
        t = np.asarray(getattr(tiled, field)).view(np.uint8) if field == "scales" else \
            np.asarray(getattr(tiled, field))
        a = np.asarray(getattr(got, field)).view(np.uint8) if field == "scales" else \
            np.asarray(getattr(got, field))
        np.testing.assert_array_equal(t[live], a[np.asarray(index)[live]])
    assert not np.asarray(tiled.codes)[~live].any()
    np.testing.assert_array_equal(jit_call(rac.SelectedResidual.unscaled, sel, index),
                                  jit_call(nvfp4.unscaled_values, tiled))
    assert not np.asarray(tiled.scales.astype(jnp.float32))[~live].any()


def test_unselected_non_finite_blocks_code_to_zero():
    """An unselected block with an inf/NaN residual stays zero (the masked residual, times 0,
    would have carried a NaN scale); a selected one keeps the NaN marker."""
    x = jnp.ones((2, 64)).at[0, 3].set(jnp.inf)
    cfg = aq.RACConfig(rac_selection="static")
    q = jit_call(nvfp4.quantize_activations, x, "per_token")
    blocks = jnp.array([False, True, True, False])
    sel = jit_call(rac.select_residual, x, q, cfg, act_scale_mode="per_token",
                   static_blocks=blocks)
    c = jit_call(rac.SelectedResidual.codes, sel)
    assert float(c.scales[0, 0].astype(jnp.float32)) == 0.0
    assert np.isfinite(np.asarray(jit_call(nvfp4.dequantize, c))).all()


@pytest.mark.parametrize("rac_on", [False, True])
def test_windowed_operands_are_the_gathered_operands(rac_on):
    """The kernels' windowed B operands, coded from the distinct rows, hold the row operands
    gathered in every filled slot, and zero padding."""
    from pallas_kernels import w4a4_grouped as wg
    from pallas_kernels import w4a4_matmul as wm

    e, k, n_tok, top = 4, 128, 5, 2
    x = jax.random.normal(jax.random.key(6), (n_tok, k), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(7), (n_tok * top,), 0, e)
    order = jnp.argsort(ids, stable=True)
    rows = (order // top).astype(jnp.int32)
    gs = jnp.bincount(ids, length=e).astype(jnp.int32)
    m = rows.shape[0]
    rexp = jit_call(wg.row_experts, gs, m)
    cfg = aq.RACConfig() if rac_on else None
    acts = jit_call(aq.nvfp4_quantize, x, rac_config=cfg, row_expert=rexp, num_experts=e,
                    source_rows=rows)
    row_index, _, _, _, row0, window_rows = jit_call(wg.tile_plan, gs, m, 8)
    tiles, slot_g = wm.token_tiles(lambda idx: wm.operand_rows(acts, idx, jnp.float16, 256),
                                   row_index, row0, window_rows)
    b_rows, g_rows = jit_call(aq.kernel_operands, acts, jnp.float16)
    q_index = jit_call(wm.source_tile_rows, rows, n_tok, row_index)
    want_index = (q_index, row_index)[:len(b_rows)]
    assert len(tiles.rows) == len(b_rows) == (2 if rac_on else 1)
    live = np.asarray(row_index) < m  # the windows' slots past a group hold other rows
    for t, s, b, g, idx in zip(tiles.gathered(), slot_g, b_rows, g_rows, want_index,
                               strict=True):
        want = jit_call(wm.gather_rows, b, idx, jnp.float16, 256)
        np.testing.assert_array_equal(np.asarray(t)[live], np.asarray(want)[live])
        np.testing.assert_array_equal(s, jnp.pad(g, (0, 1))[idx])
    pad = np.asarray(window_rows) == m
    for r in tiles.rows:  # the aligned layout's padding rows are zero
        assert r.shape == (window_rows.shape[0], 256) and not np.asarray(r)[pad].any()
    # Without the barrier before the row gathers (the ablation): the same operands, jitted.
    for materialize in (True, False):
        ops_j, _ = jax.jit(lambda idx, mt=materialize: wm.operand_rows(
            acts, idx, jnp.float16, 256, mt))(window_rows)
        for got, want in zip(ops_j, tiles.rows, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
