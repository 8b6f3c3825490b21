"""RAC's row pass (pallas_kernels.rac_rows): interpret mode equals the jnp quantizer and
residual statistics (NaN and inf blocks included), alone and through the grouped and dense RAC
matmuls; where it applies; cuda lowering; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from pallas_kernels import nvfp4_quantize as aq
from pallas_kernels import rac_rows
from pallas_kernels.layout import prepare_w4a4_weights
from pallas_kernels.w4a4_grouped import values_placement, w4a4_grouped_matmul
from pallas_kernels.w4a4_matmul import W4A4MatmulConfig
from quads_jax.quant import nvfp4
from quads_jax.testing import lower_for_h200, pallas_calls


def _x(r, k, seed):
    x = jax.random.normal(jax.random.key(seed), (r, k), jnp.float32)
    x = x * jnp.exp(jax.random.normal(jax.random.key(seed + 1), (k,)))
    return x.at[0, 5].set(jnp.nan).at[1, 20].set(jnp.inf).astype(jnp.bfloat16)


@pytest.mark.numerics
@pytest.mark.parametrize("r,k,score,block_rows,dtype,scale_programs", [
    # rows padded to whole programs; with its own scales 2 rows per program (6 programs)
    (12, 768, "residual_l2", 8, jnp.float16, 4),
    # K/16 = 6: two blocks per program, three chunks per whole row
    (16, 96, "residual_l1", 4, jnp.bfloat16, 1),
])
def test_interpret_equals_the_jnp_path(r, k, score, block_rows, dtype, scale_programs):
    x = _x(r, k, seed=k)
    want, g = rac_rows.rac_row_pass_reference(x, score, dtype)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(nvfp4.compute_global_scale(
        x, "row")[:, 0]))
    got = rac_rows.rac_row_pass(x, g, score=score, dtype=dtype, interpret=True,
                                config=rac_rows.RACRowsConfig(block_rows=block_rows))
    for name, a, b in zip(want._fields, got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_array_equal(np.asarray(got.values).view(np.uint16),
                                  np.asarray(want.values).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(got.finite), np.asarray(want.finite))
    np.testing.assert_array_equal(np.asarray(got.finite_i8), np.asarray(want.finite_i8))
    assert not np.asarray(got.finite).all()  # the NaN / inf blocks
    # The residual and its block amax bit for bit (nvfp4.residual_from_values: exact
    # products, whether or not a compiler fuses them into multiply-adds); the scores' sums of
    # 16 to their order.
    for name in ("residual", "amax"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)).view(np.uint32),
                                      np.asarray(getattr(want, name)).view(np.uint32))
    a, b = np.asarray(got.scores), np.asarray(want.scores)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_allclose(a[np.isfinite(b)], b[np.isfinite(b)], rtol=1e-6)
    # The kernel's own decode scales (g=None, whole rows per program): the quantizer's g bit
    # for bit, and every output the same as with g given.
    cfg = rac_rows.RACRowsConfig(block_rows=block_rows, scale_programs=scale_programs)
    assert cfg.whole_row_block(r) == {4: 2, 1: 4}[scale_programs]
    own = rac_rows.rac_row_pass(x, None, score=score, dtype=dtype, interpret=True, config=cfg)
    assert got.g is None and own.g.shape == (r,)
    np.testing.assert_array_equal(np.asarray(own.g).view(np.uint32),
                                  np.asarray(g).view(np.uint32))
    for name in ("values", "residual", "amax", "finite", "scores", "finite_i8"):
        np.testing.assert_array_equal(np.asarray(getattr(own, name)),
                                      np.asarray(getattr(got, name)), err_msg=name)


def _weights(e, n, k, seed):
    w = jax.random.normal(jax.random.key(seed), (e, n, k), jnp.float32) * 0.1
    return jit_call(nvfp4.quantize, w, scale_mode="tensor")


def test_rac_matmul_with_the_row_kernel_equals_the_jnp_path():
    """The grouped RAC decode GEMM (the rollout's) gives the same result with the row pass's
    kernel as with XLA's passes: the same operands and residual, hence the same selection and
    codes. (The dense and grouped interpret tests of test_w4a4_kernels_interpret run the
    kernel too, the default, against float64 products.)"""
    k, n, m = 256, 32, 24
    x = jax.random.normal(jax.random.key(5), (m, k), jnp.float32).astype(jnp.bfloat16)
    racc = aq.RACConfig()
    outs = []
    # rac_placed_values with prefill_min_rows=16: this call counts as a prefill, so rac_rows
    # writes the values into the windowed operand and rac_operands completes it in place.
    # The last: the row kernels on other grids (W4A4MatmulConfig's row-kernel fields; the plan
    # has P = 72 window rows, placed at 4 or 8 prefill rows per program) with rac_operands
    # recomputing the placed values (one call for all: any of them wrong changes the result).
    # The last: the row pass with its own decode scales (whole rows per program), placed.
    other = dict(rac_row_block_rows=16, rac_row_block_k=128, rac_row_warps=2, operand_warps=8,
                 rac_operand_block_rows_prefill=8, rac_operand_recompute_placed=True)
    own = dict(rac_row_scales=True, rac_row_block_k=128)
    for row_kernel, placed, grid in ((True, False, {}), (False, False, {}), (True, True, {}),
                                     (True, True, other), (True, True, own)):
        cfg = W4A4MatmulConfig(a_via_smem=True, rac_row_kernel=row_kernel,
                               rac_placed_values=placed, prefill_min_rows=16, **grid)
        w = jit_call(prepare_w4a4_weights, _weights(4, n, k, 1), mma_dtype=cfg.mma_dtype)
        gs = jnp.asarray([7, 0, 12, 5], jnp.int32)
        outs.append(jit_call(w4a4_grouped_matmul, x, w, gs, rac=racc, config=cfg, interpret=True))
        if grid is own:  # the row kernel really computed the scales: its fifth output
            rows = [e for e in pallas_calls(jax.make_jaxpr(
                lambda x, w=w, gs=gs, cfg=cfg: w4a4_grouped_matmul(
                    x, w, gs, rac=racc, config=cfg, interpret=True))(x))
                if str(e.params["name"]) == "rac_rows"]
            assert [len(e.outvars) for e in rows] == [5]
        if placed:  # the plan's window rows are a whole number of rac_operands' programs
            assert values_placement(jnp.zeros((72,), jnp.int32), None, m, k, k, cfg, gs,
                                    jnp.zeros((m,), jnp.int32)) is not None
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(outs[0], np.float32),
                                      np.asarray(out, np.float32))


def test_applies_only_to_per_token_residual_scores():
    assert aq.row_pass_applies(aq.RACConfig(), "per_token")
    assert not aq.row_pass_applies(aq.RACConfig(rac_score="act_amax"), "per_token")
    assert not aq.row_pass_applies(aq.RACConfig(), "per_batch")


def test_lowers_for_cuda():
    x = jnp.zeros((128, 2048), jnp.bfloat16)
    g = jnp.ones((128,), jnp.float32)
    lower_for_h200(lambda x, g: rac_rows.rac_row_pass(x, g), x, g)
    # its own decode scales: down's 1 024 rows of K = 768 (three chunks per whole row)
    lower_for_h200(lambda x: rac_rows.rac_row_pass(x, None, with_residual=False),
                   jnp.zeros((1024, 768), jnp.bfloat16))


def test_bad_input():
    x = jnp.zeros((8, 64), jnp.bfloat16)
    g = jnp.ones((8,), jnp.float32)
    with pytest.raises(ValueError, match="K % 16"):
        rac_rows.rac_row_pass(jnp.zeros((8, 40), jnp.bfloat16), g)
    with pytest.raises(ValueError, match=r"g \[4\] must be \[R\] = \[8\]"):
        rac_rows.rac_row_pass(x, g[:4])
    with pytest.raises(ValueError, match="act_amax"):
        rac_rows.rac_row_pass(x, g, score="act_amax")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        rac_rows.rac_row_pass(x, g, dtype=jnp.float32)
    with pytest.raises(ValueError, match="block_rows=3"):
        rac_rows.RACRowsConfig(block_rows=3)
    with pytest.raises(ValueError, match="scale_programs=0"):
        rac_rows.RACRowsConfig(scale_programs=0)


def test_without_the_residual_and_recomputed_in_the_operand_kernel():
    """``with_residual=False`` writes everything but the float32 residual; ``rac_operands``
    recomputes it from the activations and the values (``residual_of``) and writes the same
    stacked operands as from the residual itself, NaN / inf blocks and repeated rows
    included."""
    from pallas_kernels import rac_operands as ro

    r_rows, m, k = 8, 16, 96
    x = _x(r_rows, k, seed=4)
    g = jit_call(nvfp4.compute_global_scale, x, "row")[:, 0]
    full = jit_call(rac_rows.rac_row_pass, x, g, interpret=True)
    part = jit_call(rac_rows.rac_row_pass, x, g, interpret=True, with_residual=False)
    assert part.residual is None
    for a, b in ((full.values, part.values), (full.amax, part.amax),
                 (full.finite, part.finite), (full.scores, part.scores)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows = jax.random.randint(jax.random.key(9), (m,), 0, r_rows).astype(jnp.int32)
    expert = jnp.sort(jax.random.randint(jax.random.key(10), (m,), 0, 3)).astype(jnp.int32)
    acts = jit_call(aq.nvfp4_quantize, x, rac_config=aq.RACConfig(), row_expert=expert,
                    num_experts=3, source_rows=rows)
    res = acts.residual
    window = jnp.asarray(list(range(m)) + [m, m] + list(range(0, m, 5)), jnp.int32)
    kw = dict(k_pad=256, interpret=True)
    s32 = res.scales.astype(jnp.float32)
    want = jit_call(ro.rac_stacked_operands, full.values, res.r, s32, res.reciprocals, window, rows,
                    res.rows, **kw)
    got = jit_call(ro.rac_stacked_operands, part.values, None, s32, res.reciprocals, window, rows,
                   residual_of=(x, g), **kw)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(want).view(np.uint16))
    assert np.count_nonzero(np.asarray(got[1])) > 0
    with pytest.raises(ValueError, match="not both"):
        ro.rac_stacked_operands(part.values, res.r, s32, res.reciprocals, window, rows,
                                residual_of=(x, g), **kw)
    with pytest.raises(ValueError, match="r_rows None"):
        ro.rac_stacked_operands(part.values, None, s32, res.reciprocals, window, rows, rows,
                                residual_of=(x, g), **kw)


def test_values_placed_in_the_windows_and_completed_in_place():
    """``window_of_row``: the row pass writes each row's values at its window row of operand 0
    of a stacked buffer; ``rac_operands(placed=...)`` completes that buffer (operand 1, the
    empty rows' zeros) into the same stacked operands as from the values themselves, NaN /
    inf blocks included; its input checks."""
    from pallas_kernels import rac_operands as ro

    m, k = 12, 256
    x = _x(m, k, seed=6)
    g = jit_call(nvfp4.compute_global_scale, x, "row")[:, 0]
    expert = jnp.asarray([0] * 5 + [1] * 3 + [2] * 4, jnp.int32)
    window = jnp.asarray([0, 1, 2, 3, 4, m, m, m, 5, 6, 7, m, 8, 9, 10, 11], jnp.int32)
    p = window.shape[0]
    window_of_row = jnp.full((m,), p, jnp.int32).at[window].set(
        jnp.arange(p, dtype=jnp.int32), mode="drop")
    cfg = rac_rows.RACRowsConfig(block_rows=8)  # 12 rows: the last program has 4 pad rows
    plain = jit_call(rac_rows.rac_row_pass, x, g, interpret=True, with_residual=False, config=cfg)
    placed = jit_call(rac_rows.rac_row_pass, x, g, interpret=True, with_residual=False, config=cfg,
                      window_of_row=window_of_row, windows=p)
    assert placed.values.shape == (2, p, k)
    got_rows = np.asarray(placed.values[0])[np.asarray(window_of_row)]
    np.testing.assert_array_equal(got_rows.view(np.uint16),
                                  np.asarray(plain.values).view(np.uint16))
    for a, b in ((plain.amax, placed.amax), (plain.scores, placed.scores)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    acts = jit_call(aq.nvfp4_quantize, x, rac_config=aq.RACConfig(), row_expert=expert,
                    num_experts=3)
    res = acts.residual
    s32 = res.scales.astype(jnp.float32)
    kw = dict(k_pad=k, interpret=True, config=ro.RACOperandsConfig(block_rows=8))
    want = jit_call(ro.rac_stacked_operands, plain.values, None, s32, res.reciprocals, window,
                    residual_of=(x, g), **kw)
    got = jit_call(ro.rac_stacked_operands, None, None, s32, res.reciprocals, window,
                   residual_of=(x, g), placed=placed.values, **kw)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(want).view(np.uint16))
    # The values recomputed from x instead of read back from the placed buffer: the same bits
    # (NaN / inf blocks included); a buffer whose operand 0 is garbage proves they are not read.
    garbage = placed.values.at[0].set(jnp.float16(-3.5))
    recomputed = jit_call(
        ro.rac_stacked_operands, None, None, s32, res.reciprocals, window, residual_of=(x, g),
        placed=garbage, k_pad=k, interpret=True,
        config=ro.RACOperandsConfig(block_rows=8, recompute_placed=True))
    got1, want1 = np.asarray(recomputed[1]), np.asarray(want[1])
    np.testing.assert_array_equal(got1.view(np.uint16), want1.view(np.uint16))
    assert np.count_nonzero(np.asarray(got[1])) > 0
    with pytest.raises(ValueError, match="placed"):  # P = 16 is not a multiple of 32 rows
        ro.rac_stacked_operands(None, None, s32, res.reciprocals, window, residual_of=(x, g),
                                placed=placed.values, k_pad=k, interpret=True,
                                config=ro.RACOperandsConfig(block_rows=32))
    with pytest.raises(ValueError, match="go together"):
        rac_rows.rac_row_pass(x, g, window_of_row=window_of_row)


@pytest.mark.parametrize("recompute_placed", [False, True])
def test_placed_values_lower_for_cuda(recompute_placed):
    from pallas_kernels import rac_operands as ro

    m, k, p = 64, 512, 80
    x = jnp.zeros((m, k), jnp.bfloat16)
    g = jnp.ones((m,), jnp.float32)
    wor = jnp.arange(m, dtype=jnp.int32)
    window = jnp.concatenate([jnp.arange(m, dtype=jnp.int32), jnp.full((p - m,), m, jnp.int32)])
    s = jnp.ones((m, k // 16), jnp.float32)

    def run(x, g, wor, window, s):
        rp = rac_rows.rac_row_pass(x, g, with_residual=False, window_of_row=wor, windows=p)
        return ro.rac_stacked_operands(None, None, s, s, window, k_pad=k, residual_of=(x, g),
                                       placed=rp.values, config=ro.RACOperandsConfig(
                                           recompute_placed=recompute_placed))

    lower_for_h200(run, x, g, wor, window, s)


def test_values_placement_applies_only_where_each_row_fills_one_window_row():
    m = 683 * 6  # groups of 6 rows, each padded to 8 window rows
    window = np.full((683, 8), m, np.int32)
    window[:, :6] = np.arange(m).reshape(683, 6)
    window = jnp.asarray(window.reshape(-1))
    p = window.shape[0]
    gs = jnp.full((683,), 6, jnp.int32)
    rexp = jnp.arange(m, dtype=jnp.int32) // 6
    on = W4A4MatmulConfig(rac_placed_values=True)
    placed = values_placement(window, None, m, 2048, 2048, on, gs, rexp)
    assert placed is not None and placed[1] == p and placed[0].shape == (m,)
    np.testing.assert_array_equal(np.asarray(window)[np.asarray(placed[0])], np.arange(m))
    off = W4A4MatmulConfig(rac_placed_values=False)
    assert values_placement(window, None, m, 2048, 2048, off, gs, rexp) is None  # off
    assert values_placement(window, jnp.zeros((m,), jnp.int32), m, 2048, 2048, on, gs,
                            rexp) is None  # source rows: each row feeds several window rows
    assert values_placement(window[:1024], None, 768, 2048, 2048, on, gs,
                            rexp) is None  # decode-sized
    assert values_placement(window, None, m, 2304, 2048, on, gs, rexp) is None  # K padded
    # P not a whole number of rac_operands' programs (its prefill rows per program)
    assert on.rac_operand_block_rows_prefill == 4
    assert values_placement(window[:p - 2], None, m, 2048, 2048, on, gs, rexp) is None


@pytest.mark.parametrize("sizes", [[7, 0, 12, 5], [0, 0, 3, 0], [16, 1, 8, 9]])
def test_window_of_rows_inverts_the_plans_windows(sizes):
    """``window_of_rows`` (arithmetic) equals the scatter of ``arange(P)`` through the plan's
    ``window_rows``, empty groups and rows past the groups included."""
    from pallas_kernels.w4a4_grouped import tile_plan, window_of_rows

    gs = jnp.asarray(sizes, jnp.int32)
    m = sum(sizes) + 3  # 3 rows past the groups
    *_, window = tile_plan(gs, m, 8)
    p = window.shape[0]
    want = jnp.full((m,), p, jnp.int32).at[window].set(jnp.arange(p, dtype=jnp.int32),
                                                      mode="drop")
    rexp = jnp.searchsorted(jnp.cumsum(gs), jnp.arange(m), side="right").astype(jnp.int32)
    np.testing.assert_array_equal(np.asarray(window_of_rows(gs, rexp, p)), np.asarray(want))


def test_matmul_config_sets_the_row_kernels_grids():
    """``W4A4MatmulConfig``'s row-kernel fields reach ``rac_rows`` and both window-operand
    kernels; a bad one is refused when the config is made, naming the kernel's field."""
    cfg = W4A4MatmulConfig(rac_row_block_rows=16, rac_row_block_k=512, rac_row_warps=8,
                           operand_warps=2)
    rows, interpret, dtype, placement = cfg.rac_row_pass(True)
    assert rows == rac_rows.RACRowsConfig(block_rows=16, block_k=512, num_warps=8)
    own = W4A4MatmulConfig(rac_row_scales=True, rac_row_scale_programs=512).rac_row_pass(False)
    assert own[0].row_scales and own[0].scale_programs == 512
    assert interpret and dtype == jnp.float16 and placement is None
    assert cfg.rac_operands_config().num_warps == 2 and cfg.act_operands_config().num_warps == 2
    # rac_operands' rows per program: the prefill field in calls of >= prefill_min_rows rows
    cfg = W4A4MatmulConfig(rac_operand_block_rows=16, rac_operand_block_rows_prefill=2,
                           prefill_min_rows=64)
    assert (cfg.is_prefill(63), cfg.is_prefill(64)) == (False, True)
    assert cfg.rac_operands_config().block_rows == 16
    assert cfg.rac_operands_config(prefill=True).block_rows == 2
    assert not W4A4MatmulConfig(prefill_min_rows=None).is_prefill(10**6)
    with pytest.raises(ValueError, match="RACOperandsConfig.block_rows=6"):
        W4A4MatmulConfig(rac_operand_block_rows_prefill=6)
    assert W4A4MatmulConfig(rac_row_kernel=False, rac_row_block_rows=16).rac_row_pass(
        False) is None
    with pytest.raises(ValueError, match="RACRowsConfig.block_rows=3"):
        W4A4MatmulConfig(rac_row_block_rows=3)
    with pytest.raises(ValueError, match="RACRowsConfig.num_warps=3"):
        W4A4MatmulConfig(rac_row_warps=3)
    with pytest.raises(ValueError, match="num_warps=16"):
        W4A4MatmulConfig(operand_warps=16)
