"""The Mosaic GPU kernels in the CPU GPU-interpreter against float64 products of the
dequantized operands (exact up to f32 accumulation order: rel err < 1e-5)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from pallas_kernels import nvfp4_quantize as aq
from pallas_kernels.layout import prepare_w4a4_weights
from pallas_kernels.w4a4_grouped import (
    row_experts,
    tile_plan,
    w4a4_grouped_matmul,
    w4a4_grouped_matmul_reference,
)
from pallas_kernels.w4a4_matmul import W4A4MatmulConfig, w4a4_matmul, w4a4_matmul_reference
from pallas_kernels.w4a16_matmul import w4a16_grouped_matmul, w4a16_matmul
from quads_jax.quant import nvfp4

CFG = dict(a_via_smem=True, num_sms=4, max_concurrent_steps=2)


def _rel(y, want):
    y, want = np.asarray(y, np.float64), np.asarray(want, np.float64)
    return np.max(np.abs(y - want)) / np.max(np.abs(want))


def _f64_product(acts, wq, row_expert=None):
    a = sum(np.asarray(v, np.float64) for v in jit_call(aq.dequantized_sum, acts))
    wd = np.asarray(jit_call(nvfp4.dequantize, wq, jnp.float32), np.float64)
    if row_expert is None:
        return a @ wd.T
    return np.einsum("mk,mnk->mn", a, wd[np.asarray(row_expert)])


def _weights(key, shape, scale_mode="tensor"):
    """Random NVFP4 weights, quantized in one compiled program (``tests/compiled.py``)."""
    return jit_call(nvfp4.quantize, jax.random.normal(key, shape), scale_mode=scale_mode)


def _on_grid(key, shape):
    """A random float16 operand on the NVFP4 grid (the tile kernel's A operands)."""
    return jit_call(_qdq_f16, jax.random.normal(key, shape))


def _qdq_f16(v):
    return nvfp4.dequantize(nvfp4.quantize(v), jnp.float16)


@pytest.mark.parametrize(
    "m,n,k,rac,mode,mma,decode,ks,ng",
    [
        (5, 200, 288, False, "per_token", "float16", "normal", 1, 1),
        (9, 136, 512, True, "per_batch", "bfloat16", "subnormal", 2, 1),
        (9, 400, 256, True, "per_token", "float16", "subnormal", 1, 4),  # 4 tiles per item
    ],
)
def test_dense_w4a4(m, n, k, rac, mode, mma, decode, ks, ng):
    x = jax.random.normal(jax.random.key(m), (m, k)) * 2
    wq = _weights(jax.random.key(n), (n, k))
    w = jit_call(prepare_w4a4_weights, wq, mma_dtype=mma, decode=decode)
    racc = aq.RACConfig(rac_ratio=0.5) if rac else None
    cfg = W4A4MatmulConfig(k_splits=ks, mma_dtype=mma, n_group=ng, **CFG)
    y = jit_call(w4a4_matmul, x, w, act_scale_mode=mode, rac=racc, config=cfg, interpret=True)
    assert y.shape == (m, n) and y.dtype == x.dtype
    acts = jit_call(aq.nvfp4_quantize, x, act_scale_mode=mode, rac_config=racc)
    want = _f64_product(acts, wq)
    assert _rel(y, want) < 1e-5
    assert _rel(jit_call(w4a4_matmul_reference, x, wq, act_scale_mode=mode, rac=racc), want) < 1e-5


@pytest.mark.parametrize("racc,compact", [
    (None, False), (aq.RACConfig(), True), (aq.RACConfig(rac_energy_target=0.2), True),
    (aq.RACConfig(rac_residual_format="bf16"), True),
    (aq.RACConfig(rac_selection="online_token"), False), (aq.RACConfig(), None)])
def test_dense_prefill_path_is_exact(racc, compact):
    """The decoded-weight path of large M; with online_batch RAC and ``rac_prefill_columns``
    (the default) its residual GEMM contracts the 9 selected blocks' 144 columns only (fewer
    selected with an energy target: the -1 entries add zeros), per-row selections all K;
    ``compact`` None: ``rac_prefill_columns=False``, the residual over all K."""
    m, n, k = 40, 136, 288
    x = jax.random.normal(jax.random.key(7), (m, k)) * 3
    wq = _weights(jax.random.key(8), (n, k))
    cfg = W4A4MatmulConfig(prefill_min_rows=32, rac_prefill_columns=compact is not None)
    compact = bool(compact)
    y = jit_call(w4a4_matmul, x, wq, rac=racc, config=cfg)  # no kernel: runs on any backend
    acts = jit_call(aq.nvfp4_quantize, x, rac_config=racc)
    want = _f64_product(acts, wq)
    assert _rel(y, want) < 1e-5
    jaxpr = str(jax.make_jaxpr(lambda x: w4a4_matmul(x, wq, rac=racc, config=cfg))(x))
    assert (f"[{m},{9 * 16}]" in jaxpr) == compact
    if racc is not None and racc.rac_energy_target is not None:
        assert int(acts.mask[0].sum()) < 9  # the fill entries were exercised


@pytest.mark.parametrize("sizes,extra,rac,n,ng,stack", [((4, 0, 9), 2, False, 128, 1, False),
                                                        ((0, 0, 17), 0, True, 128, 1, False),
                                                        ((4, 0, 9), 1, True, 256, 2, False),
                                                        ((4, 0, 9), 0, True, 256, 2, True)])
def test_grouped_w4a4_zero_and_uneven_groups(sizes, extra, rac, n, ng, stack):
    e, k = len(sizes), 256
    gs = jnp.asarray(sizes, jnp.int32)
    m = int(gs.sum()) + extra  # rows past the groups come out as zeros
    x = jax.random.normal(jax.random.key(3), (m, k))
    wq = _weights(jax.random.key(4), (e, n, k), "expert")
    racc = aq.RACConfig() if rac else None
    cfg = W4A4MatmulConfig(block_m=8, n_group=ng, stack_operands=stack, **CFG)
    y = jit_call(w4a4_grouped_matmul, x, wq, gs, rac=racc, config=cfg, interpret=True)
    rexp = jnp.minimum(row_experts(gs, m), e - 1)
    acts = jit_call(aq.nvfp4_quantize, x, rac_config=racc, row_expert=rexp, num_experts=e)
    want = _f64_product(acts, wq, rexp)
    want[int(gs.sum()):] = 0.0
    assert _rel(y, want) < 1e-5
    np.testing.assert_array_equal(np.asarray(y)[int(gs.sum()):], 0.0)
    ref = jit_call(w4a4_grouped_matmul_reference, x, wq, gs, rac=racc)
    assert _rel(ref, want) < 1e-5
    # Gathered tiles instead of row windows: the same products in every filled slot.
    gathered = jit_call(w4a4_grouped_matmul, x, wq, gs, rac=racc, interpret=True,
                        config=dataclasses.replace(cfg, windowed_operands=False))
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(y))
    if extra == 2:  # output_rows: the rows read back in that order, padding rows and repeats
        perm = np.asarray([m - 1, 5, 0, 12, 5, 3, m - 2], np.int32)
        reordered = jit_call(w4a4_grouped_matmul, x, wq, gs, rac=racc, config=cfg, interpret=True,
                             output_rows=jnp.asarray(perm))
        np.testing.assert_array_equal(np.asarray(reordered), np.asarray(y)[perm])
        with pytest.raises(ValueError, match=r"output_rows: values in \[0, 15\]; need \[0, 15\)"):
            w4a4_grouped_matmul(x, wq, gs, config=cfg, interpret=True,
                                output_rows=jnp.arange(m + 1, dtype=jnp.int32))


@pytest.mark.parametrize("rac", [False, True])
def test_grouped_narrow_tiles_give_the_wide_result(rac):
    """``W4A4MatmulConfig.narrow_tiles``: groups of at most 8 rows (and a large group's last
    tile of at most 8) multiplied at N = 8 in tiles of 16 give the wide call's rows."""
    e, k, n = 5, 256, 256
    gs = jnp.asarray([5, 0, 21, 8, 12], jnp.int32)  # tiles of 5, 16 + 5, 8, 12 rows
    m = int(gs.sum())
    x = jax.random.normal(jax.random.key(81), (m, k))
    wq = _weights(jax.random.key(82), (e, n, k), "expert")
    racc = aq.RACConfig() if rac else None
    cfg = W4A4MatmulConfig(block_m=16, n_group=1, **CFG)
    y = jit_call(w4a4_grouped_matmul, x, wq, gs, rac=racc, interpret=True,
                 config=dataclasses.replace(cfg, narrow_tiles=True))
    wide = jit_call(w4a4_grouped_matmul, x, wq, gs, rac=racc, interpret=True, config=cfg)
    rexp = jnp.minimum(row_experts(gs, m), e - 1)
    acts = jit_call(aq.nvfp4_quantize, x, rac_config=racc, row_expert=rexp, num_experts=e)
    assert _rel(y, _f64_product(acts, wq, rexp)) < 1e-5
    assert _rel(y, wide) < 1e-6

    def wgmmas(c):  # the narrow pipeline's wgmmas are in the traced kernel (the flag reached it)
        return str(jax.make_jaxpr(lambda x: w4a4_grouped_matmul(
            x, wq, gs, rac=racc, config=c, interpret=True))(x)).count("wgmma")

    assert wgmmas(dataclasses.replace(cfg, narrow_tiles=True)) > wgmmas(cfg)


@pytest.mark.parametrize("rac", [False, True])
def test_grouped_source_rows_equal_the_gathered_rows(rac):
    """A MoE token's k slots share one row: quantized once per distinct row and gathered into
    the tiles, the result is bit-identical to passing the gathered rows."""
    e, k, n, tokens, top = 3, 256, 128, 5, 2
    x = jax.random.normal(jax.random.key(7), (tokens, k)).astype(jnp.bfloat16) * 3
    ids = jax.random.randint(jax.random.key(8), (tokens * top,), 0, e)
    order = jnp.argsort(ids, stable=True)
    gs = jnp.bincount(ids, length=e).astype(jnp.int32)
    wq = _weights(jax.random.key(9), (e, n, k), "expert")
    racc = aq.RACConfig() if rac else None
    cfg = W4A4MatmulConfig(block_m=8, **CFG)
    src = (order // top).astype(jnp.int32)
    y = jit_call(w4a4_grouped_matmul, x, wq, gs, rac=racc, config=cfg, interpret=True,
                 source_rows=src)
    want = jit_call(w4a4_grouped_matmul, x[src], wq, gs, rac=racc, config=cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    with pytest.raises(ValueError, match="source_rows"):
        w4a4_grouped_matmul(x, wq, gs, config=cfg, interpret=True, source_rows=src + tokens)
    if rac:  # tokens that are not (row_valid): the kernel path masks RAC's scores as jnp does
        valid = jnp.arange(tokens) != 2
        x = x.at[2].multiply(jnp.linspace(-40, 40, k).astype(x.dtype))  # garbage, not a token
        y = jit_call(w4a4_grouped_matmul, x, wq, gs, rac=racc, config=cfg, interpret=True,
                     source_rows=src, row_valid=valid)
        want = jit_call(w4a4_grouped_matmul, x[src], wq, gs, rac=racc, config=cfg, interpret=True,
                        row_valid=valid[src])
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
        rexp = jnp.minimum(row_experts(gs, src.shape[0]), e - 1)
        acts = jit_call(aq.nvfp4_quantize, x[src], rac_config=racc, row_expert=rexp, num_experts=e,
                        row_valid=valid[src])
        want = _f64_product(acts, wq, rexp)
        assert _rel(y, want) < 4e-3  # the bf16 output's rounding
        ref = jit_call(w4a4_grouped_matmul_reference, x[src], wq, gs, rac=racc,
                       row_valid=valid[src])
        assert _rel(ref, want) < 4e-3
        unmasked = jit_call(w4a4_grouped_matmul_reference, x[src], wq, gs, rac=racc)
        assert not np.array_equal(np.asarray(unmasked), np.asarray(ref))  # the mask counts


def test_w4a16_dense_and_grouped():
    k, n = 256, 128
    x = jax.random.normal(jax.random.key(5), (6, k)).astype(jnp.bfloat16)
    wq = _weights(jax.random.key(6), (2, n, k), "expert")
    w = jit_call(prepare_w4a4_weights, wq, mma_dtype="bfloat16")
    cfg = W4A4MatmulConfig(mma_dtype="bfloat16", **CFG)
    xf = np.asarray(x, np.float64)
    wd = np.asarray(jit_call(nvfp4.dequantize, wq), np.float64)
    gs = jnp.asarray([2, 4], jnp.int32)
    yg = jit_call(w4a16_grouped_matmul, x.astype(jnp.float32), w, gs, config=cfg, interpret=True)
    want = np.concatenate([xf[:2] @ wd[0].T, xf[2:] @ wd[1].T])
    assert _rel(yg, want) < 1e-5
    w0 = jit_call(prepare_w4a4_weights, nvfp4.NVFP4Tensor(wq.packed[0], wq.scales[0],
                                                          wq.global_scale[0, 0, 0]),
                  mma_dtype="bfloat16")
    yd = jit_call(w4a16_matmul, x.astype(jnp.float32), w0, config=cfg, interpret=True)
    assert _rel(yd, xf @ wd[0].T) < 1e-5


def test_tile_plan_covers_every_row_once():
    gs = jnp.asarray([3, 0, 20, 1, 0], jnp.int32)
    m, bm = 27, 8
    row_index, tile_expert, num_tiles, row_slot, row0, window_rows = tile_plan(gs, m, bm)
    nt = int(num_tiles[0])
    assert nt == 1 + 3 + 1
    flat = np.asarray(row_index).reshape(-1)
    live = flat[: nt * bm][flat[: nt * bm] < m]
    np.testing.assert_array_equal(np.sort(live), np.arange(24))
    np.testing.assert_array_equal(flat[np.asarray(row_slot)[:24]], np.arange(24))
    assert np.all(np.asarray(row_slot)[24:] == row_index.size)
    np.testing.assert_array_equal(np.asarray(tile_expert)[:nt], [0, 2, 2, 2, 3])
    # The windowed operand: each group from a multiple of 8 (sizes 3, 20, 1 -> 8, 24, 8 rows),
    # zero rows (index m) between; each live tile is the window of 8 rows from row0, whose
    # filled slots are exactly the tile's GEMM rows.
    wr = np.asarray(window_rows)
    assert wr.shape == (72,)  # m + 7 * 5 + bm, rounded up to a multiple of 8
    want = np.full(wr.shape, m)
    want[0:3], want[8:28], want[32] = np.arange(3), np.arange(3, 23), 23
    np.testing.assert_array_equal(wr, want)
    np.testing.assert_array_equal(np.asarray(row0), [0, 8, 16, 24, 32, 0, 0, 0])
    window = wr[np.asarray(row0)[:, None] + np.arange(bm)]
    filled = np.asarray(row_index) < m
    np.testing.assert_array_equal(np.asarray(row_index)[filled], window[filled])
    assert (window[:nt][~filled[:nt]] == m).all()  # here: padding, no other group's rows


def test_bad_inputs_raise():
    wq = jit_call(nvfp4.quantize, jnp.ones((128, 64)))
    wg = jit_call(nvfp4.quantize, jnp.ones((2, 128, 64)), scale_mode="expert")
    with pytest.raises(ValueError, match="K=32"):
        w4a4_matmul(jnp.ones((4, 32)), wq)
    with pytest.raises(ValueError, match="dtype"):
        w4a4_matmul(jnp.ones((4, 64), jnp.int32), wq)
    with pytest.raises(ValueError, match="w4a4_grouped_matmul"):
        w4a4_matmul(jnp.ones((4, 64)), wg)
    with pytest.raises(ValueError, match="group_sizes"):
        w4a4_grouped_matmul(jnp.ones((4, 64)), wg, jnp.asarray([3, 2]))
    with pytest.raises(ValueError, match="group_sizes"):
        w4a4_grouped_matmul(jnp.ones((4, 64)), wg, jnp.asarray([4]))
    with pytest.raises(ValueError, match="block_m"):
        W4A4MatmulConfig(block_m=12)
    with pytest.raises(ValueError, match="k_splits"):
        w4a4_matmul(jnp.ones((4, 64)), wq, config=W4A4MatmulConfig(k_splits=3, **CFG),
                    interpret=True)
    with pytest.raises(ValueError, match="n_group=3"):
        W4A4MatmulConfig(n_group=3)
    with pytest.raises(ValueError, match="n_group=2 does not divide the 1 weight-row tiles"):
        w4a4_matmul(jnp.ones((4, 64)), wq, config=W4A4MatmulConfig(n_group=2, **CFG),
                    interpret=True)
    with pytest.raises(ValueError, match="W4A16 needs"):
        w4a16_matmul(jnp.ones((4, 64)), prepare_w4a4_weights(wq, mma_dtype="float16"))


@pytest.mark.parametrize("out_dtype,stack", [(None, False), (jnp.float32, False),
                                             (jnp.bfloat16, False), (None, True),
                                             (jnp.bfloat16, True)])
def test_tile_gemm_epilogue_scales_sums_and_stores(out_dtype, stack):
    """The tile kernel on two operands (RAC), raw (``col_scales`` None: one float32 output per
    operand) or with the epilogue (one scaled sum in ``out_dtype``), against its jnp reference;
    the operands stacked on the wgmma N side (``stack_operands``) give the same result."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm, tile_gemm_reference

    t, bm, k, n, e = 3, 8, 256, 256, 2
    wq = _weights(jax.random.key(1), (e, n, k))
    w = jit_call(prepare_w4a4_weights, wq, mma_dtype="float16")
    b = tuple(_on_grid(jax.random.key(2 + a), (t, bm, k)) for a in range(2))
    te = jnp.array([1, 0, 1], jnp.int32)
    cs = None if out_dtype is None else jax.random.uniform(jax.random.key(5), (t, 2, bm)) + 0.5
    cfg = TileGemmConfig(a_via_smem=True, num_sms=2, max_concurrent_steps=1,
                         stack_operands=stack)
    kw = {} if out_dtype is None else dict(col_scales=cs, out_dtype=out_dtype)
    y = jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([t], jnp.int32), config=cfg,
                 interpret=True, **kw)
    if stack:  # the same products (up to the dot's f32 summation order) and additions
        two = jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([t], jnp.int32), interpret=True, **kw,
                       config=dataclasses.replace(cfg, stack_operands=False))
        assert _rel(y, two) < 1e-6
    want = jit_call(tile_gemm_reference, b, w, te, cs, out_dtype or jnp.float32)
    assert y.shape == want.shape == (t, 1, 2 if out_dtype is None else 1, bm, n)
    assert y.dtype == want.dtype
    tol = 1e-5 if y.dtype == jnp.float32 else 8e-3  # bf16: one rounding of the stored value
    assert _rel(y, want) < tol
    if cs is not None:  # the sum of the scaled products, not of the raw ones
        raw = jit_call(tile_gemm_reference, b, w, te)
        assert _rel(y, jnp.sum(raw, axis=2, keepdims=True)) > 1e-2
    if out_dtype == jnp.bfloat16 and stack:
        # expert_scales: the experts' scales applied in the epilogue give the bits of scales
        # folded into col_scales beforehand (slot_scales' product, in its order)
        es = jnp.array([0.75, 1.5], jnp.float32)
        folded = cs * (es[te] * jnp.float32(0.5))[:, None, None]
        got = jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([t], jnp.int32), config=cfg,
                       interpret=True, col_scales=cs, out_dtype=out_dtype, expert_scales=es,
                       expert_factor=0.5)
        ref = jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([t], jnp.int32), config=cfg,
                       interpret=True, col_scales=folded, out_dtype=out_dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
        np.testing.assert_array_equal(
            np.asarray(jit_call(tile_gemm_reference, b, w, te, cs, out_dtype, expert_scales=es,
                                expert_factor=0.5), np.float32),
            np.asarray(jit_call(tile_gemm_reference, b, w, te, folded, out_dtype), np.float32))
        with pytest.raises(ValueError, match="expert_scales"):
            nvfp4_tile_gemm(b, w, te, jnp.array([t], jnp.int32), config=cfg, interpret=True,
                            expert_scales=es)


@pytest.mark.parametrize("t,live,n,k,sms,chain", [
    (1, 1, 128, 512, 2, True),   # one item: one SM runs it unchained, the other has none
    (4, 3, 256, 512, 2, True),   # 6 live items over 2 SMs: START, STEADY, STOP; tile 3 skipped
    (4, 3, 256, 768, 2, True),   # 3 K steps per item: the pipeline depth must divide them
    (4, 3, 256, 512, 2, False),  # the unchained loop (ablation)
    (2, 0, 128, 512, 2, True),   # no live tile: nothing runs, nothing hangs
])
def test_tile_gemm_chained_work_items(t, live, n, k, sms, chain):
    """The persistent loop over the live items with chained pipelines, against the reference
    on the live tiles."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm, tile_gemm_reference

    wq = _weights(jax.random.key(11), (2, n, k))
    w = jit_call(prepare_w4a4_weights, wq, mma_dtype="float16")
    b = (_on_grid(jax.random.key(12), (t, 8, k)),)
    te = jnp.arange(t, dtype=jnp.int32) % 2
    cfg = TileGemmConfig(a_via_smem=True, num_sms=sms, max_concurrent_steps=4, chain_items=chain)
    y = jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([live], jnp.int32), config=cfg,
                 interpret=True)
    assert y.shape == (t, 1, 1, 8, n) and y.dtype == jnp.float32
    if live:
        assert _rel(y[:live], jit_call(tile_gemm_reference, b, w, te)[:live]) < 1e-5


@pytest.mark.parametrize("mma_k,stack,bits", [(128, False, "nibbles"), (256, False, "nibbles"),
                                              (256, True, "nibbles"), (64, True, "signs_high")])
def test_tile_gemm_mma_k_groups(mma_k, stack, bits):
    """Wider wgmma groups (``mma_k``: two or four decoded 64-column chunks per wgmma) give the
    reference's result, with the RAC operands stacked on the N side or not; so do weights in
    the "signs_high" bit layout."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm, tile_gemm_reference

    t, bm, k, n = 2, 8, 512, 128
    wq = _weights(jax.random.key(21), (2, n, k))
    w = jit_call(prepare_w4a4_weights, wq, mma_dtype="float16", bits=bits)
    b = tuple(_on_grid(jax.random.key(22 + a), (t, bm, k)) for a in range(2))
    te = jnp.array([1, 0], jnp.int32)
    cs = jax.random.uniform(jax.random.key(25), (t, 2, bm)) + 0.5
    cfg = TileGemmConfig(a_via_smem=True, num_sms=2, max_concurrent_steps=2, mma_k=mma_k,
                         stack_operands=stack)
    y = jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([t], jnp.int32), config=cfg, interpret=True,
                 col_scales=cs, out_dtype=jnp.float32)
    assert _rel(y, jit_call(tile_gemm_reference, b, w, te, cs, jnp.float32)) < 1e-5


def test_mma_k_config_errors():
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig

    with pytest.raises(ValueError, match=r"mma_k=96: one of \(64, 128, 256\)"):
        TileGemmConfig(mma_k=96)
    with pytest.raises(ValueError, match="mma_overlap=1 with mma_k=256"):
        TileGemmConfig(mma_k=256, mma_overlap=1)
    with pytest.raises(ValueError, match="mma_k=32"):
        W4A4MatmulConfig(mma_k=32)


def test_tile_gemm_store_buffers_give_the_same_bits():
    """The epilogue's copies waited for at once (``store_buffers=0``), when their one buffer is
    next written (1), or through two buffers (2): the same output bits, with several work
    items per SM (2 on 1 SM) and several copies per item (n_group 2; raw: one per operand and
    tile, 4 per item)."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm

    t, bm, k, n = 2, 8, 256, 256
    wq = _weights(jax.random.key(41), (2, n, k), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    b = tuple(_on_grid(jax.random.key(42 + a), (t, bm, k)) for a in range(2))
    te = jnp.array([1, 0], jnp.int32)
    def run(sb):
        return jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([t], jnp.int32), interpret=True,
                        config=TileGemmConfig(a_via_smem=True, num_sms=1, n_group=2,
                                              max_concurrent_steps=1, store_buffers=sb))

    ys = [run(sb) for sb in (0, 1, 2)]
    assert ys[0].shape == (t, 1, 2, bm, n)
    # The setting reaches the kernel: its staging scratch [2 warpgroups, slots, bm, 64].
    assert "f32[2,1,8,64]" in str(jax.make_jaxpr(lambda: run(0))())
    assert "f32[2,2,8,64]" in str(jax.make_jaxpr(lambda: run(2))())
    for y in ys[1:]:
        np.testing.assert_array_equal(np.asarray(y), np.asarray(ys[0]))
    with pytest.raises(ValueError, match="store_buffers=3"):
        TileGemmConfig(store_buffers=3)


def test_grouped_plain_decode_runs_wide_with_the_same_bits():
    """Grouped decode calls without RAC run two warpgroup pairs on 2-tile items
    (``wide_plain_decode``, the default) where the weight's row tiles pair up: the bits of the
    narrow schedule; odd tile counts, RAC calls (unless ``wide_rac_decode``) and prefill-sized
    calls stay narrow."""
    e, k = 3, 256
    gs = jnp.asarray([5, 0, 9], jnp.int32)
    x = jax.random.normal(jax.random.key(61), (14, k))
    cfg = W4A4MatmulConfig(block_m=8, **CFG)
    narrow = dataclasses.replace(cfg, wide_plain_decode=False)
    prefill = dataclasses.replace(cfg, prefill_min_rows=8)  # a prefill-sized call

    def run(c, wq, rac=None):
        return jit_call(w4a4_grouped_matmul, x, wq, gs, rac=rac, config=c, interpret=True)

    def registers(c, wq, rac=None):  # the compute warpgroups' setmaxnreg.inc
        text = str(jax.make_jaxpr(lambda: run(c, wq, rac))())
        return int(text.split("set_max_registers_p[action=increase n=")[1].split("]")[0])

    for n in (256, 384):  # 2 and 3 row tiles
        wq = _weights(jax.random.key(n), (e, n, k), "expert")
        # 3 row tiles do not pair: both configs run the narrow schedule, so only 2 tiles
        # compare bits (the interpreter's runs are most of this test's time)
        wide = n == 256
        if wide:
            np.testing.assert_array_equal(np.asarray(run(cfg, wq)), np.asarray(run(narrow, wq)))
        assert registers(cfg, wq) == (104 if wide else 232)  # 104: 4 compute warpgroups
        assert registers(narrow, wq) == registers(prefill, wq) == 232
        assert registers(cfg, wq, aq.RACConfig()) == 232
        # RAC calls on two pairs when asked (``wide_rac_decode``), stacked or not: same bits.
        for stack in (True, False):
            rac_narrow = dataclasses.replace(cfg, stack_operands=stack)
            rac_wide = dataclasses.replace(rac_narrow, wide_rac_decode=True)
            if wide:
                np.testing.assert_array_equal(np.asarray(run(rac_wide, wq, aq.RACConfig())),
                                              np.asarray(run(rac_narrow, wq, aq.RACConfig())))
            assert registers(rac_wide, wq, aq.RACConfig()) == (104 if wide else 232)
        # RAC calls by their K alone (``wide_rac_decode_max_k``): K = 256 goes wide at 256,
        # not at 255; prefill-sized calls stay narrow.
        by_k = dataclasses.replace(cfg, wide_rac_decode_max_k=k)
        assert registers(by_k, wq, aq.RACConfig()) == (104 if wide else 232)
        below = dataclasses.replace(by_k, wide_rac_decode_max_k=k - 1)
        assert registers(below, wq, aq.RACConfig()) == 232
        assert registers(dataclasses.replace(by_k, prefill_min_rows=8), wq, aq.RACConfig()) == 232
        # With the residual's wgmmas per selected block, two pairs only where the pipeline
        # keeps two stages (or has one K step; nvfp4_tile_gemm refuses the rest): here one
        # K step, and at K = 512 a one-stage pipeline (the interpreter's A tiles in SMEM).
        sel = dataclasses.replace(cfg, stack_operands=False, rac_selected_wgmmas=True,
                                  wide_rac_decode=True, max_concurrent_steps=1, k_splits=1)
        assert registers(sel, wq, aq.RACConfig()) == (104 if wide else 232)
    wq = _weights(jax.random.key(7), (e, 256, 2 * k), "expert")
    x = jnp.concatenate([x, x], axis=1)
    assert registers(sel, wq, aq.RACConfig()) == 232
    assert registers(dataclasses.replace(cfg, wide_rac_decode_max_k=k), wq, aq.RACConfig()) == 232
    two = dataclasses.replace(sel, max_concurrent_steps=2, mma_k=128)  # 2 stages fit
    assert registers(two, wq, aq.RACConfig()) == 104


def test_wide_rac_decode_max_k_refuses_what_is_not_a_depth():
    for bad in (-1, 1.5, True, "768"):
        with pytest.raises(ValueError, match="wide_rac_decode_max_k"):
            W4A4MatmulConfig(wide_rac_decode_max_k=bad)


@pytest.mark.parametrize("n_group,stack", [(2, True), (4, False)])
def test_tile_gemm_four_compute_warpgroups_give_the_same_bits(n_group, stack):
    """Two warpgroup pairs, each on its half of the work item's weight-row tiles
    (``compute_wgs=4``), give the bits of one pair doing every tile: with RAC's operands
    stacked or as two accumulators, epilogue scales or raw partial sums, several items per SM
    and store buffers."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm

    t, bm, k, n = 2, 8, 256, 128 * n_group * 2
    wq = _weights(jax.random.key(51), (2, n, k), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    b = tuple(_on_grid(jax.random.key(52 + a), (t, bm, k)) for a in range(2))
    te = jnp.array([1, 0], jnp.int32)
    cs = jax.random.uniform(jax.random.key(55), (t, 2, bm)) + 0.5

    def run(wgs, scaled):
        cfg = TileGemmConfig(a_via_smem=True, num_sms=1, n_group=n_group, mma_k=128,
                             stack_operands=stack, store_buffers=2, compute_wgs=wgs)
        return jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([t], jnp.int32), interpret=True,
                        config=cfg, col_scales=cs if scaled else None)

    for scaled in (True, False):
        y2, y4 = run(2, scaled), run(4, scaled)
        np.testing.assert_array_equal(np.asarray(y4), np.asarray(y2))
    # The setting reaches the kernel: its staging scratch [warpgroups, slots, bm, 64], and the
    # compute warpgroups ask for no more registers than the copy warpgroup frees
    # (``compute_registers``: 104, where jax's split, 112, hung on the GPU).
    jaxprs = {wgs: str(jax.make_jaxpr(lambda wgs=wgs: run(wgs, False))()) for wgs in (2, 4)}
    assert "f32[4,2,8,64]" in jaxprs[4]
    assert "set_max_registers_p[action=increase n=104]" in jaxprs[4]
    assert "set_max_registers_p[action=increase n=232]" in jaxprs[2]
    # The copy warpgroup at 24 registers: the four compute warpgroups take 112 (still within
    # the launch's 96 a thread), the same bits.
    cfg24 = TileGemmConfig(a_via_smem=True, num_sms=1, n_group=n_group, mma_k=128,
                           stack_operands=stack, store_buffers=2, compute_wgs=4,
                           memory_registers=24)
    call24 = lambda: jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([t], jnp.int32),  # noqa: E731
                              interpret=True, config=cfg24)
    jaxpr24 = str(jax.make_jaxpr(call24)())
    assert "set_max_registers_p[action=increase n=112]" in jaxpr24
    assert "set_max_registers_p[action=decrease n=24]" in jaxpr24
    if stack:  # one case is enough for the bits: each interpreted call takes seconds
        np.testing.assert_array_equal(np.asarray(call24()), np.asarray(run(2, False)))


def test_no_second_mma_ablation_multiplies_the_first_operand_only():
    """The ``no_second_mma`` ablation (time attribution) leaves RAC's second operand's wgmmas
    out: its result is the kernel's with that operand zero; stacked operands are refused."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm

    t, bm, k, n = 2, 8, 256, 128
    wq = _weights(jax.random.key(71), (2, n, k), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    b0, b1 = (_on_grid(jax.random.key(72 + a), (t, bm, k)) for a in range(2))
    te, cs = jnp.array([1, 0], jnp.int32), jax.random.uniform(jax.random.key(75), (t, 2, bm))

    def run(b, **kw):
        cfg = TileGemmConfig(a_via_smem=True, num_sms=1, **kw)
        return jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([t], jnp.int32), interpret=True,
                        config=cfg, col_scales=cs)

    np.testing.assert_array_equal(np.asarray(run((b0, b1), ablation="no_second_mma")),
                                  np.asarray(run((b0, jnp.zeros_like(b1)))))
    with pytest.raises(ValueError, match="needs the operands unstacked"):
        run((b0, b1), ablation="no_second_mma", stack_operands=True)


@pytest.mark.parametrize("wgs,mma_k", [(2, 256), (4, 128)])
def test_residual_blocks_issue_the_second_operands_selected_blocks_only(wgs, mma_k):
    """``residual_blocks`` (one bit per 16-column K block per matrix): the second operand's
    wgmmas run for the set blocks only; where the operand is zero outside them (RAC's
    residual outside its expert's selection) the result is the kernel's without the mask, and
    blocks left out are left out of the product."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm, tile_gemm_reference

    t, bm, k, n, e = 3, 8, 512, 256, 2
    wq = _weights(jax.random.key(81), (e, n, k), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    b0, b1 = (_on_grid(jax.random.key(82 + a), (t, bm, k)) for a in range(2))
    te = jnp.array([1, 0, 1], jnp.int32)
    keep = np.random.default_rng(83).random((e, k // 16)) < 0.5  # [E, 32 blocks]
    keep = keep[np.asarray(te)]  # per tile: its expert's blocks
    words = jnp.asarray((keep * (1 << np.arange(32, dtype=np.int64))).sum(1).astype(np.uint32)
                        .view(np.int32)[:, None])
    cols = np.repeat(keep, 16, axis=1)[:, None, :]  # [T, 1, K]
    b1_sel = jnp.where(cols, b1, 0).astype(jnp.float16)
    cs = jax.random.uniform(jax.random.key(85), (t, 2, bm)) + 0.5
    cfg = TileGemmConfig(a_via_smem=True, num_sms=2, n_group=2, compute_wgs=wgs, mma_k=mma_k)

    def run(b, blocks=None):
        return jit_call(nvfp4_tile_gemm, b, w, te, jnp.array([t], jnp.int32), config=cfg,
                        col_scales=cs, interpret=True, residual_blocks=blocks)

    plain = run((b0, b1_sel))
    assert _rel(run((b0, b1_sel), words), plain) < 1e-6
    # the unselected blocks of a full operand are left out: the product of the selected ones
    want = jit_call(tile_gemm_reference, (b0, b1_sel), w, te, cs)
    assert _rel(run((b0, b1), words), want) < 1e-5
    np.testing.assert_array_equal(  # the reference with the bits zeroes those blocks itself
        np.asarray(jit_call(tile_gemm_reference, (b0, b1), w, te, cs, residual_blocks=words)),
        np.asarray(want))
    if wgs == 4:  # two pairs, a one-stage pipeline, 2 K steps: refused (hangs when interpreted)
        cfg = dataclasses.replace(cfg, max_concurrent_steps=1)
        with pytest.raises(ValueError, match="one-stage pipeline over 2 K steps hangs"):
            run((b0, b1), words)
    with pytest.raises(ValueError, match=r"residual_blocks: int32\[3, 2\]; need int32\[3, 1\]"):
        run((b0, b1), jnp.zeros((3, 2), jnp.int32))
    with pytest.raises(ValueError, match="needs two operands, unstacked"):
        nvfp4_tile_gemm((b0, b1), w, te, jnp.array([t], jnp.int32), interpret=True,
                        config=dataclasses.replace(cfg, stack_operands=True), col_scales=cs,
                        residual_blocks=words)


@pytest.mark.parametrize("src", [False, True])
def test_grouped_rac_selected_wgmmas_equal_the_full_residual_product(src):
    """``rac_selected_wgmmas``: the grouped RAC matmul issues the residual's wgmmas only for
    each tile's selected blocks (``tile_block_bits`` of the selection's mask); the residual is
    zero elsewhere, so the result is the full product's up to f32 summation order, with
    gathered source rows too; stacked operands are refused."""
    from pallas_kernels.w4a4_matmul import tile_block_bits

    e, k, n = 3, 512, 256
    gs = jnp.asarray([6, 0, 11], jnp.int32)
    x = jax.random.normal(jax.random.key(91), (17, k)) * 2
    wq = _weights(jax.random.key(92), (e, n, k), "expert")
    rows = jnp.asarray(np.random.default_rng(93).integers(0, 17, 17), jnp.int32) if src else None
    cfg = W4A4MatmulConfig(block_m=8, stack_operands=False, **CFG)
    sel = dataclasses.replace(cfg, rac_selected_wgmmas=True)

    def run(c):
        return jit_call(w4a4_grouped_matmul, x, wq, gs, rac=aq.RACConfig(), config=c,
                        interpret=True, source_rows=rows)

    full, selected = run(cfg), run(sel)
    assert _rel(selected, full) < 1e-6
    # the selection reaches the kernel: the residual's tiles in 32-byte swizzles (16 columns)
    assert "swizzle=32" in str(jax.make_jaxpr(lambda: run(sel))())
    assert "swizzle=32" not in str(jax.make_jaxpr(lambda: run(cfg))())
    assert _rel(full, jit_call(w4a4_grouped_matmul_reference, x if rows is None else x[rows],
                               wq, gs, rac=aq.RACConfig())) < 1e-5
    # the bits: any row of the tile, padding rows (index M) none
    mask = jnp.asarray([[True] + [False] * 31, [False] * 31 + [True], [False] * 32])
    bits = tile_block_bits(mask, jnp.asarray([[0, 3], [1, 2], [3, 3]], jnp.int32), k)
    assert bits.tolist() == [[1], [-2**31], [0]]
    with pytest.raises(ValueError, match="needs stack_operands=False"):
        W4A4MatmulConfig(rac_selected_wgmmas=True)


def test_compute_registers_fit_the_launch_allocation():
    """What the copy warpgroup frees (launch registers minus 40) covers the compute
    warpgroups' increases; with 2 or 3 compute warpgroups the split is jax's own."""
    from jax._src.pallas.mosaic_gpu import pipeline as mgpu_pipeline

    from pallas_kernels.nvfp4_tiles_mgpu import REGISTER_FILE, compute_registers

    for n in (1, 2, 3, 4):
        launch = REGISTER_FILE // (128 * (n + 1)) // 8 * 8
        got = compute_registers(40, n)
        assert got % 8 == 0 and n * (got - launch) <= launch - 40
        if n < 4:
            assert got == mgpu_pipeline._compute_registers(40, n)
    assert compute_registers(40, 4) == 104
    for mem in (24, 32, 48):  # a copy warpgroup at other than 40 frees more or less
        for n in (2, 4):
            launch = REGISTER_FILE // (128 * (n + 1)) // 8 * 8
            got = compute_registers(mem, n)
            assert got % 8 == 0 and n * (got - launch) <= launch - mem
    assert compute_registers(24, 4) == 112


def test_compute_wgs_config_errors():
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig

    with pytest.raises(ValueError, match=r"compute_wgs=3: one of \(2, 4\)"):
        TileGemmConfig(compute_wgs=3)
    with pytest.raises(ValueError, match="n_group=1 must be a multiple of 2"):
        TileGemmConfig(compute_wgs=4)
    for bad in (16, 20, 264, 40.0, True):
        with pytest.raises(ValueError, match=r"memory_registers=.*multiple of 8 in \[24, 256\]"):
            TileGemmConfig(memory_registers=bad)
    with pytest.raises(ValueError, match="memory_registers=20"):
        W4A4MatmulConfig(wide_memory_registers=20)
    # The grouped matmul's field reaches two-pair calls only.
    cfg = W4A4MatmulConfig(wide_memory_registers=24)
    assert cfg.tile_config(1, 1, 2, 4).memory_registers == 24
    assert cfg.tile_config(1, 1, 2, 2).memory_registers == 40
    with pytest.raises(ValueError, match="compute_wgs=4"):
        W4A4MatmulConfig(compute_wgs=4, n_group=1)
    TileGemmConfig(compute_wgs=4, n_group=2)


def test_e4m3_scales_give_the_float16_scales_results():
    """Block scales kept as the format's E4M3 bytes (converted to f16 in the kernel) give the
    same bits as float16 scales: the tile kernel with stacked RAC operands and split K; and the
    dense matmul with them equals the float64 product."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm

    t, bm, k, n = 2, 8, 512, 128
    wq = _weights(jax.random.key(31), (2, n, k), "expert")
    b = tuple(_on_grid(jax.random.key(32 + a), (t, bm, k)) for a in range(2))
    te, cs = jnp.array([1, 0], jnp.int32), jax.random.uniform(jax.random.key(35), (t, 2, bm))
    cfg = TileGemmConfig(a_via_smem=True, num_sms=2, max_concurrent_steps=1, k_splits=2,
                         stack_operands=True)
    ys = [jit_call(nvfp4_tile_gemm, b,
                   jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype=sd), te,
                   jnp.array([t], jnp.int32), config=cfg, col_scales=cs,
                   out_dtype=jnp.float32, interpret=True)
          for sd in (None, "float8_e4m3fn")]
    np.testing.assert_array_equal(np.asarray(ys[1]), np.asarray(ys[0]))

    x = jax.random.normal(jax.random.key(36), (9, 256)) * 2
    wq = _weights(jax.random.key(37), (128, 256))
    w = jit_call(prepare_w4a4_weights, wq, scale_dtype="float8_e4m3fn")
    y = jit_call(w4a4_matmul, x, w, config=W4A4MatmulConfig(**CFG), interpret=True)
    assert _rel(y, _f64_product(jit_call(aq.nvfp4_quantize, x), wq)) < 1e-5


@pytest.mark.parametrize("num_ops,stack,wgs,ks", [(1, False, 2, 2), (2, True, 4, 1),
                                                  (2, False, 2, 1)])
def test_tile_gemm_narrow_tiles_multiply_half_the_rows(num_ops, stack, wgs, ks):
    """``narrow_tiles``: a window of at most ``block_m / 2`` live rows (the next live tile's
    window starts within ``block_m / 2`` rows) is multiplied at N = ``block_m / 2`` and its
    other slots stored as zeros, in each K split; its items chain with wide ones on an SM. The
    result is the reference's on the computed slots, and the wide kernel's."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm, tile_gemm_reference
    from pallas_kernels.token_tiles import TokenTiles

    bm, k, n_group = 16, 256 * ks, 2
    n = 128 * n_group
    wq = _weights(jax.random.key(61), (2, n, k), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    # Tiles 0 and 2 hold 16 and 12 rows, tile 1 holds 8 (the next starts 8 rows on): narrow;
    # tile 3 is the last live one (wide), tile 4 is past num_tiles.
    row0 = jnp.array([0, 16, 24, 40, 0], jnp.int32)
    rows = tuple(_on_grid(jax.random.key(62 + a), (64, k)) for a in range(num_ops))
    tiles = TokenTiles(rows, row0, bm)
    te = jnp.array([1, 0, 1, 0, 0], jnp.int32)
    # Scales on every slot, so that a slot the kernel left out shows: the narrow tile's
    # upper half is zero in its result but not in the wide kernel's or the reference's.
    cs = jax.random.uniform(jax.random.key(66), (5, num_ops, bm)) + 0.5
    num_tiles = jnp.array([4], jnp.int32)

    def run(narrow):
        cfg = TileGemmConfig(a_via_smem=True, num_sms=2, n_group=n_group, mma_k=128,
                             stack_operands=stack, compute_wgs=wgs, narrow_tiles=narrow,
                             k_splits=ks)
        return jit_call(nvfp4_tile_gemm, tiles, w, te, num_tiles, config=cfg, interpret=True,
                        col_scales=cs, out_dtype=jnp.float32)

    # K splits: float32 partial sums [T, ks, 1, bm, n], summed here
    y, wide = (np.asarray(run(v)).sum(axis=1, keepdims=True) for v in (True, False))
    want = np.asarray(jit_call(tile_gemm_reference, tiles, w, te, cs, jnp.float32))
    assert y.shape == want.shape == (5, 1, 1, bm, n)
    computed = np.ones((5, bm), bool)
    computed[1, bm // 2:] = False
    computed[4] = False  # past num_tiles
    assert _rel(y[computed[:, None, None]], want[computed[:, None, None]]) < 1e-5
    assert _rel(y[computed[:, None, None]], wide[computed[:, None, None]]) < 1e-6
    np.testing.assert_array_equal(y[1, :, :, bm // 2:], 0.0)  # the narrow tile's other slots
    assert np.abs(wide[1, :, :, bm // 2:]).min() > 0


def test_tile_gemm_narrow_tiles_refusals():
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm
    from pallas_kernels.token_tiles import TokenTiles

    wq = _weights(jax.random.key(71), (1, 128, 256))
    w = jit_call(prepare_w4a4_weights, wq, mma_dtype="float16")
    cfg = TileGemmConfig(a_via_smem=True, num_sms=1, narrow_tiles=True)
    te, nt = jnp.zeros((2,), jnp.int32), jnp.array([2], jnp.int32)
    rows = (jnp.zeros((48, 256), jnp.float16),)
    cs = jnp.ones((2, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match="block_m=8 must be a multiple of 16"):
        nvfp4_tile_gemm(TokenTiles(rows, jnp.array([0, 8], jnp.int32), 8), w, te, nt,
                        config=cfg, interpret=True, col_scales=jnp.ones((2, 1, 8)))
    with pytest.raises(ValueError, match="needs col_scales"):
        nvfp4_tile_gemm(TokenTiles(rows, jnp.array([0, 16], jnp.int32), 16), w, te, nt,
                        config=cfg, interpret=True)
    with pytest.raises(ValueError, match="must be nondecreasing"):
        nvfp4_tile_gemm(TokenTiles(rows, jnp.array([16, 0], jnp.int32), 16), w, te, nt,
                        config=cfg, interpret=True, col_scales=cs)
