"""RAC's stacked-operand kernel (pallas_kernels.rac_operands): interpret mode equals the jnp
operand path bit for bit, alone and through the grouped and dense W4A4 matmuls; the tiles carry
one stacked array; cuda lowering; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from pallas_kernels import nvfp4_quantize as aq
from pallas_kernels import rac_operands as ro
from pallas_kernels.w4a4_grouped import w4a4_grouped_matmul
from pallas_kernels.w4a4_matmul import W4A4MatmulConfig, dense_plan, operand_rows, token_tiles
from quads_jax.quant import rac
from quads_jax.testing import grouped_w4a4_case, lower_for_h200, pallas_calls


def _selected(r_rows, m, k, seed, with_rows):
    """A real RAC quantization of ``r_rows`` distinct rows, ``m`` GEMM rows (their distinct
    rows drawn at random when ``with_rows``), per-expert online_batch selection over 3 experts;
    a NaN and an inf in the input (their blocks are coded as the quantizer codes them)."""
    kx, kr, ke = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (r_rows, k), jnp.float32) * 3
    x = x.at[0, 5].set(jnp.nan).at[1, 20].set(jnp.inf).astype(jnp.bfloat16)
    rows = jax.random.randint(kr, (m,), 0, r_rows) if with_rows else None
    expert = jnp.sort(jax.random.randint(ke, (m,), 0, 3)).astype(jnp.int32)
    acts = jit_call(aq.nvfp4_quantize, x, act_scale_mode="per_token", rac_config=aq.RACConfig(),
                    row_expert=expert, num_experts=3, source_rows=rows)
    return acts


# GEMM rows = distinct rows (with_rows False) is the dense path: test_dense_tiles_* below.
@pytest.mark.parametrize(
    "r_rows,m,k,k_pad,with_rows,block_rows",
    [
        (10, 24, 160, 256, True, 4),  # K padded to the kernels' 256
        (9, 40, 512, 512, True, 16),  # window rows not a multiple of block_rows
    ],
)
def test_interpret_equals_the_jnp_path(r_rows, m, k, k_pad, with_rows, block_rows):
    acts = _selected(r_rows, m, k, seed=m + k, with_rows=with_rows)
    res = acts.residual
    b0, _ = jit_call(aq.mma_operand, acts.q, jnp.float16)
    # Window rows: every GEMM row, some twice, and empty rows (>= M) between.
    window = jnp.asarray(list(range(m)) + [m, m + 3] + list(range(0, m, 3)) + [m] * 5,
                         jnp.int32)
    window = window[: len(window) - len(window) % 2]
    cfg = ro.RACOperandsConfig(block_rows=block_rows)
    got = jit_call(ro.rac_stacked_operands, b0, res.r, res.scales.astype(jnp.float32),
                   res.reciprocals, window, acts.q_rows, res.rows, k_pad=k_pad, config=cfg,
                   interpret=True)
    want = jit_call(ro.rac_stacked_operands_reference, b0, res.r, res.scales, res.reciprocals,
                    window, acts.q_rows, res.rows, k_pad=k_pad)
    assert got.shape == (2, window.shape[0], k_pad) and got.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.count_nonzero(np.asarray(got[1])) > 0  # the residual operand is not all zero
    # The kernel coding the block scales itself from the coded amax: the same bits.
    coded = jit_call(ro.rac_stacked_operands, b0, res.r, None, None, window, acts.q_rows,
                     res.rows, k_pad=k_pad, config=cfg, interpret=True,
                     coded=(jit_call(rac.coded_block_amax, res), res.global_scale))
    np.testing.assert_array_equal(np.asarray(coded), np.asarray(want))
    # And what operand_rows returns with and without the kernel (the tile kernels' input).
    with_kernel, s_k = jit_call(operand_rows, acts, window, jnp.float16, k_pad, kernel=cfg,
                                interpret=True)
    without, s_j = jit_call(operand_rows, acts, window, jnp.float16, k_pad)
    np.testing.assert_array_equal(np.asarray(with_kernel), np.asarray(jnp.stack(without)))
    for a, b in zip(s_k, s_j, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_padding_rows_skipped_or_poisoned():
    """``padding_rows`` "skip" / "nan": the window rows with a GEMM row are the same, the
    others are not written ("nan": they keep the NaN the buffer was filled with)."""
    acts = _selected(9, 40, 256, seed=2, with_rows=True)
    res = acts.residual
    b0, _ = jit_call(aq.mma_operand, acts.q, jnp.float16)
    window = jnp.asarray(list(range(40)) + [40] * 6 + list(range(0, 40, 5)) + [40] * 10,
                         jnp.int32)
    want = np.asarray(jit_call(
        ro.rac_stacked_operands_reference, b0, res.r, res.scales, res.reciprocals, window,
        acts.q_rows, res.rows, k_pad=256))
    filled = np.asarray(window) < 40
    for padding in ("skip", "nan"):
        got = np.asarray(jit_call(
            ro.rac_stacked_operands, b0, res.r, res.scales.astype(jnp.float32), res.reciprocals,
            window, acts.q_rows, res.rows, k_pad=256,
            config=ro.RACOperandsConfig(padding_rows=padding), interpret=True))
        np.testing.assert_array_equal(got[:, filled], want[:, filled], err_msg=padding)
    assert np.isnan(got[:, ~filled]).all()


def _config(flag, padding="zeros"):
    return W4A4MatmulConfig(a_via_smem=True, num_sms=2, rac_operand_kernel=flag,
                            rac_operand_padding=padding)


def test_grouped_matmul_with_and_without_the_kernel_agree():
    x, src, w, gs = jit_call(grouped_w4a4_case, 3)

    def run(flag, padding="zeros"):
        return np.asarray(jit_call(w4a4_grouped_matmul, x, w, gs, rac=aq.RACConfig(),
                                   config=_config(flag, padding), interpret=True,
                                   source_rows=src), np.float32)

    want = run(False)
    np.testing.assert_array_equal(run(True), want)
    # The windows' padding rows (groups 5 / 8 / 3 start at multiples of 8; the layout's tail)
    # filled with NaN instead of zeros: no GEMM row's result changes (padding_rows "skip").
    np.testing.assert_array_equal(run(True, "nan"), want)


def test_dense_tiles_carry_the_stacked_operand():
    """The dense path's token tiles (``run_dense``'s ``token_tiles``): one stacked array with
    the kernel, equal to the jnp path's two operands stacked, and the same slot scales."""
    x = jax.random.normal(jax.random.key(4), (10, 256), jnp.bfloat16)
    acts = jit_call(aq.nvfp4_quantize, x, rac_config=aq.RACConfig())
    row_index, _, _, row0 = dense_plan(10, None)

    def tiles(kernel):
        return token_tiles(lambda idx: jit_call(operand_rows, acts, idx, jnp.float16, 256,
                                                kernel=kernel, interpret=True),
                           row_index, row0, row_index.reshape(-1))

    (got, g_got), (want, g_want) = tiles(ro.RACOperandsConfig()), tiles(None)
    assert got.stacked and not want.stacked and got.num_operands == want.num_operands == 2
    got.check(256, (jnp.float16,))
    np.testing.assert_array_equal(np.asarray(got.stack()), np.asarray(want.stack()))
    for a, b in zip(got.gathered() + g_got, want.gathered() + g_want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_kernel_only_where_it_applies():
    assert _config(True).rac_operands_config() == ro.RACOperandsConfig()
    assert _config(False).rac_operands_config() is None
    for off in (dict(materialize_operands=False), dict(windowed_operands=False),
                dict(stack_operands=False)):
        assert W4A4MatmulConfig(rac_operand_kernel=True, **off).rac_operands_config() is None
    # A bf16 residual is not coded: the jnp path's plain operands.
    x = jax.random.normal(jax.random.key(5), (8, 64), jnp.bfloat16)
    acts = jit_call(aq.nvfp4_quantize, x, rac_config=aq.RACConfig(rac_residual_format="bf16"))
    ops_, _ = jit_call(operand_rows, acts, jnp.arange(8, dtype=jnp.int32), jnp.float16, 256,
                       kernel=ro.RACOperandsConfig(), interpret=True)
    assert isinstance(ops_, tuple) and len(ops_) == 2


@pytest.mark.parametrize("padding,coded", [("zeros", False), ("skip", False), ("zeros", True)])
def test_lowers_for_cuda(padding, coded):
    m, r, k, p = 1024, 128, 2048, 1936
    rcp = jnp.ones((m,)) if coded else jnp.ones((m, k // 16))  # coded: the decode scales
    args = (jnp.ones((r, k), jnp.float16), jnp.ones((r, k)), jnp.ones((m, k // 16)), rcp,
            jnp.zeros((p,), jnp.int32), jnp.zeros((m,), jnp.int32), jnp.zeros((m,), jnp.int32))

    def run(b0, r, s, rcp, *idx):
        cfg = ro.RACOperandsConfig(padding_rows=padding)
        if coded:
            return ro.rac_stacked_operands(b0, r, None, None, *idx, k_pad=k, config=cfg,
                                           coded=(s, rcp))
        return ro.rac_stacked_operands(b0, r, s, rcp, *idx, k_pad=k, config=cfg)

    text = lower_for_h200(run, *args)
    assert "rac_operands" in text
    assert "ctlz" not in text  # Triton's NVIDIA backend cannot legalize it (rac_select's test)


@pytest.mark.parametrize("exact", [False, True])
def test_selecting_kernel_lowers_for_cuda(exact):
    """``select=`` at the decode step's gate_up shapes (128 distinct rows, 1 024 GEMM rows of
    128 experts, K = 2048), with the selection's exact division or Triton's."""
    from pallas_kernels import rac_select as rs

    m, r, k, p, e = 1024, 128, 2048, 1936, 128
    nb = k // 16
    args = (jnp.ones((r, k), jnp.float16), jnp.ones((r, k), jnp.bfloat16), jnp.ones((r,)),
            jnp.zeros((p,), jnp.int32), jnp.zeros((m,), jnp.int32), jnp.ones((r, nb)),
            jnp.ones((r, nb)), jnp.ones((r, nb), jnp.int8), jnp.full((e,), 8, jnp.int32),
            jnp.ones((r,), bool))

    def run(b0, x, g, wr, rows, scores, amax, fin, gs, valid):
        sel = ro.OperandSelection(scores, amax, fin, gs, valid, ratio=0.5,
                                  config=rs.RACSelectConfig(exact_division=exact))
        return ro.rac_stacked_operands(b0, None, None, None, wr, rows, k_pad=k,
                                       residual_of=(x, g), select=sel)

    text = lower_for_h200(run, *args)
    assert "rac_operands" in text
    assert ("div.rn.f32" in text) == exact
    assert "ctlz" not in text


def test_bad_input():
    b0, r = jnp.ones((4, 64), jnp.float16), jnp.ones((4, 64))
    s = jnp.ones((6, 4))
    wr = jnp.zeros((8,), jnp.int32)
    with pytest.raises(ValueError, match="must be"):
        ro.rac_stacked_operands(b0, r, jnp.ones((6, 3)), s, wr, k_pad=256, interpret=True)
    with pytest.raises(ValueError, match="k_pad"):
        ro.rac_stacked_operands(b0, r, s, s, wr, k_pad=100, interpret=True)
    with pytest.raises(ValueError, match="int32"):
        ro.rac_stacked_operands(b0, r, s, s, wr.astype(jnp.int16), k_pad=256, interpret=True)
    with pytest.raises(ValueError, match="M=6"):
        ro.rac_stacked_operands(b0, r, s, s, wr, jnp.zeros((5,), jnp.int32), k_pad=256,
                                interpret=True)
    with pytest.raises(ValueError, match="not both"):
        ro.rac_stacked_operands(b0, r, s, s, wr, k_pad=256, interpret=True,
                                coded=(s, jnp.ones((6,))))
    with pytest.raises(ValueError, match=r"reciprocals None must be"):  # K/16 = 3, not 4
        ro.rac_stacked_operands(b0, r, None, None, wr, k_pad=256, interpret=True,
                                coded=(jnp.ones((6, 3)), jnp.ones((6,))))
    with pytest.raises(ValueError, match=r"coded g \(5,\) must be \[M\] = \[6\]"):
        ro.rac_stacked_operands(b0, r, None, None, wr, k_pad=256, interpret=True,
                                coded=(s, jnp.ones((5,))))
    with pytest.raises(ValueError, match="block_rows"):
        ro.RACOperandsConfig(block_rows=6)
    # select=: the residual recomputed from x, nothing precoded, block_rows dividing 8
    sel = ro.OperandSelection(jnp.ones((4, 4)), jnp.ones((4, 4)), jnp.ones((4, 4), jnp.int8),
                              jnp.asarray([4], jnp.int32))
    x, g = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((4,))
    with pytest.raises(ValueError, match="select needs"):
        ro.rac_stacked_operands(b0, r, None, None, wr, k_pad=64, interpret=True, select=sel,
                                config=ro.RACOperandsConfig(block_k=64))
    with pytest.raises(ValueError, match="block_rows=16"):
        ro.rac_stacked_operands(b0, None, None, None, wr, k_pad=64, interpret=True,
                                residual_of=(x, g), select=sel,
                                config=ro.RACOperandsConfig(block_rows=16, block_k=64))
    with pytest.raises(ValueError, match=r"must be \[R, K/16\] = \[4, 4\]"):
        ro.rac_stacked_operands(b0, None, None, None, wr, k_pad=64, interpret=True,
                                residual_of=(x, g), config=ro.RACOperandsConfig(block_k=64),
                                select=ro.OperandSelection(jnp.ones((4, 3)), sel.amax,
                                                           sel.finite, sel.group_sizes))
    with pytest.raises(ValueError, match="k_pad=256 must be K=64"):
        ro.rac_stacked_operands(b0, None, None, None, wr, k_pad=256, interpret=True,
                                residual_of=(x, g), select=sel)
    with pytest.raises(ValueError, match="padding_rows"):
        ro.RACOperandsConfig(padding_rows="ones")


def _selection_inputs(r_rows, m, k, group_sizes, seed, with_rows, with_valid):
    """Distinct rows, their row pass (rac_rows), GEMM rows and the plan's window layout."""
    from pallas_kernels import rac_rows
    from pallas_kernels.act_operands import row_decode_scales
    from pallas_kernels.token_tiles import ROW_ALIGN
    from pallas_kernels.w4a4_grouped import aligned_group_rows

    kx, kr, kv = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(kx, (r_rows, k), jnp.float32) * 3).at[0, 5].set(jnp.inf)
    x = x.astype(jnp.bfloat16)
    g_x = jit_call(row_decode_scales, x)
    rp = jit_call(rac_rows.rac_row_pass, x, g_x, with_residual=False, interpret=True)
    rows = jax.random.randint(kr, (m,), 0, r_rows).astype(jnp.int32) if with_rows else None
    valid = (jax.random.uniform(kv, (r_rows,)) > 0.3) if with_valid else None
    gs = jnp.asarray(group_sizes, jnp.int32)
    window_rows, _, _ = aligned_group_rows(gs, m, ROW_ALIGN, m + ROW_ALIGN * len(group_sizes))
    return x, g_x, rp, rows, valid, gs, window_rows


@pytest.mark.parametrize(
    "r_rows,m,k,group_sizes,with_rows,block_rows,select_rows",
    [
        (12, 30, 256, [7, 0, 12, 1, 10], True, 8, 32),  # nb = 16: one chunk
        (30, 30, 768, [9, 5, 0, 16], False, 4, 4),  # nb = 48: chunks of 16; several steps
        (10, 40, 512, [3, 20, 2, 5], True, 2, 8),  # 10 rows past the groups: the last expert's
    ],
)
@pytest.mark.parametrize("with_valid", [False, True])
def test_selection_in_the_operand_kernel_equals_rac_select(r_rows, m, k, group_sizes,
                                                           with_rows, block_rows, select_rows,
                                                           with_valid):
    """``select=``: each program selects its expert's blocks itself; the stacked operands and
    the window rows' decode scales equal rac_select's coded path bit for bit."""
    from pallas_kernels import rac_select as rs

    x, g_x, rp, rows, valid, gs, window_rows = _selection_inputs(
        r_rows, m, k, group_sizes, r_rows + m, with_rows, with_valid)
    amax, fin = rp.amax[..., 0], rp.finite_i8
    scfg = rs.RACSelectConfig(block_rows=select_rows)
    coded, g = jit_call(
        rs.grouped_rac_selection, rp.scores, amax, fin,
        jnp.arange(m, dtype=jnp.int32) if rows is None else rows, gs, ratio=0.5,
        row_valid=valid, config=scfg, interpret=True)
    cfg = ro.RACOperandsConfig(block_rows=block_rows)
    want = jit_call(ro.rac_stacked_operands, rp.values, None, None, None, window_rows, rows,
                    k_pad=k, config=cfg, interpret=True, residual_of=(x, g_x),
                    coded=(coded, g))
    got, g_win = jit_call(
        ro.rac_stacked_operands, rp.values, None, None, None, window_rows, rows, k_pad=k,
        config=cfg, interpret=True,
        residual_of=(x, g_x),
        select=ro.OperandSelection(rp.scores, amax, fin, gs, valid, ratio=0.5, config=scfg))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(g_win),
                                  np.asarray(jit_call(rac.rows_or_fill, g, window_rows, 0.0)))
    assert np.count_nonzero(np.asarray(got[1])) > 0  # a real residual operand


def test_grouped_matmul_selecting_in_the_operand_kernel_gives_the_same_bits():
    """``W4A4MatmulConfig.rac_select_in_operands``: the grouped RAC decode call (source rows,
    uneven and empty groups, a token mask) equals the call through rac_select bit for bit,
    for the gate_up-like call on distinct rows and the down-like call on its own rows (the
    kernel-level test above covers the calls without a mask)."""
    x, src, w, gs = jit_call(grouped_w4a4_case, 11)
    valid = jnp.arange(12) % 3 != 1
    h = jax.random.normal(jax.random.key(12), (16, 256), jnp.bfloat16)

    def run(flag):
        cfg = W4A4MatmulConfig(a_via_smem=True, num_sms=2, rac_select_in_operands=flag)
        up = jit_call(w4a4_grouped_matmul, x, w, gs, rac=aq.RACConfig(), config=cfg,
                      interpret=True, source_rows=src, row_valid=valid)
        down = jit_call(w4a4_grouped_matmul, h, w, gs, rac=aq.RACConfig(), config=cfg,
                        interpret=True, row_valid=valid[src])
        return np.asarray(up, np.float32), np.asarray(down, np.float32)

    for got, want in zip(run(True), run(False), strict=True):
        np.testing.assert_array_equal(got, want)
    # The flag really takes the selecting kernel (two outputs: the operands and the window
    # rows' decode scales), not the fallback that would make the comparison above trivial.
    for flag, outputs in ((True, 2), (False, 1)):
        cfg = W4A4MatmulConfig(a_via_smem=True, num_sms=2, rac_select_in_operands=flag)
        calls = pallas_calls(jax.make_jaxpr(lambda h, cfg=cfg: w4a4_grouped_matmul(
            h, w, gs, rac=aq.RACConfig(), config=cfg, interpret=True))(h))
        assert [len(c.outvars) for c in calls if str(c.params["name"]) == "rac_operands"] == [
            outputs]
