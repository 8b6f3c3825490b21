"""NVFP4 format: ties, clamps, packing, idempotence, grid membership, independent cross-check."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from compiled import jit_call
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src.cudnn import scaled_matmul_stablehlo as jax_sms

from quads_jax.quant import nvfp4

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def test_e2m1_tie_table_and_saturation():
    y = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6.0, 7.0, 1e9, 0.2499, 0.2501])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, 0.0, 0.5]
    got = nvfp4.e2m1_code_to_float(nvfp4.round_to_e2m1_code(y))
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(
        np.asarray(nvfp4.e2m1_code_to_float(nvfp4.round_to_e2m1_code(-y))), -np.array(want)
    )


def test_rounding_matches_ml_dtypes_cast_on_finite_values():
    y = np.linspace(-8, 8, 20001, dtype=np.float32)
    ours = np.asarray(nvfp4.e2m1_code_to_float(nvfp4.round_to_e2m1_code(jnp.asarray(y))))
    ref = y.clip(-6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.abs(ours), np.abs(ref))  # ml_dtypes keeps -0


@pytest.mark.parametrize(
    "block_scale, expected",
    [(448.0, 448.0), (464.0, 448.0), (470.0, 448.0), (2.0**-9, 2.0**-9), (2.0**-10, 0.0),
     (3 * 2.0**-10, 2.0**-8), (1e6, 448.0)],
)
def test_e4m3_block_scale_clamp_and_subnormals(block_scale, expected):
    blocks = jnp.zeros((1, 1, 16), jnp.float32).at[0, 0, 3].set(6.0 * block_scale)
    s, r = jit_call(nvfp4.block_scales_and_reciprocals, blocks, jnp.float32(1.0))
    assert float(s.astype(jnp.float32)[0, 0]) == expected
    assert not np.isnan(np.asarray(s.astype(jnp.float32))).any()
    if expected == 0.0:
        assert float(r[0, 0, 0]) == 0.0


def test_pack_nibble_order_and_round_trip():
    codes = jnp.arange(32, dtype=jnp.uint8).reshape(2, 16) % 16
    packed = nvfp4.pack_codes(codes)
    assert packed.shape == (2, 8) and packed.dtype == jnp.uint8
    assert int(packed[0, 0]) == 0x10  # element 0 low nibble (0), element 1 high nibble (1)
    assert int(packed[0, 1]) == 0x32
    np.testing.assert_array_equal(np.asarray(nvfp4.unpack_codes(packed)), np.asarray(codes))


def test_quantize_layout_shapes_dtypes():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 64), jnp.bfloat16)
    for mode, gshape in [("tensor", ()), ("row", (3, 5, 1)), ("expert", (3, 1, 1))]:
        q = jit_call(nvfp4.quantize, x, scale_mode=mode)
        assert q.packed.shape == (3, 5, 32) and q.packed.dtype == jnp.uint8
        assert q.scales.shape == (3, 5, 4) and q.scales.dtype == jnp.float8_e4m3fn
        assert q.global_scale.shape == gshape and q.global_scale.dtype == jnp.float32
        assert q.shape == x.shape and q.dtype == jnp.bfloat16
        assert q.nbytes == 3 * 5 * 32 + 3 * 5 * 4 + 4 * int(np.prod(gshape))


def _check_on_grid_and_nearest(x: np.ndarray, q: nvfp4.NVFP4Tensor):
    """Every output is on its block's scaled grid and is a nearest grid point of x * r_b."""
    xf = np.asarray(x, np.float32).reshape(q.shape[:-1] + (-1, 16))
    g = np.broadcast_to(np.asarray(q.global_scale)[..., None], xf.shape[:-1] + (1,))
    s = np.asarray(q.scales.astype(jnp.float32))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(s * g > 0, np.float32(1) / (s * g), 0).astype(np.float32)
    y = np.clip(xf * r, -6, 6)
    codes = jit_call(nvfp4.unpack_codes, q.packed)
    vals = np.asarray(jit_call(nvfp4.e2m1_code_to_float, codes)).reshape(xf.shape)
    assert np.isin(np.abs(vals), GRID).all()
    dist = np.abs(y - vals)
    best = np.min(np.abs(np.abs(y)[..., None] - GRID), axis=-1)
    assert (dist <= best + 1e-6).all(), float((dist - best).max())
    deq = np.asarray(jit_call(nvfp4.dequantize, q)).reshape(xf.shape)
    np.testing.assert_array_equal(deq, ((vals * s) * g).astype(np.float32))


@settings(max_examples=8)  # each example compiles its own shapes; many global scales: below
@given(
    rows=st.integers(1, 6),
    blocks=st.integers(1, 5),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
    log_mag=st.floats(-6, 4),
    mode=st.sampled_from(["tensor", "row"]),
    seed=st.integers(0, 2**16),
)
def test_property_idempotent_on_grid(rows, blocks, dtype, log_mag, mode, seed):
    x = (jax.random.normal(jax.random.PRNGKey(seed), (rows, blocks * 16)) * 10.0**log_mag)
    x = x.astype(dtype)
    # jitted: one compile per function and shape (eagerly, every op compiled for each new
    # shape: 5 s per example)
    quantize = jax.jit(functools.partial(nvfp4.quantize, scale_mode=mode))
    qdq = jax.jit(functools.partial(nvfp4.qdq, scale_mode=mode))
    q = quantize(x)
    _check_on_grid_and_nearest(np.asarray(x.astype(jnp.float32)), q)
    a = qdq(x)
    b = qdq(a)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # Re-quantizing the dequantized tensor reproduces codes, scales and global scale.
    q2 = quantize(jax.jit(nvfp4.dequantize)(q))
    np.testing.assert_array_equal(np.asarray(q.packed), np.asarray(q2.packed))
    np.testing.assert_array_equal(np.asarray(q.global_scale), np.asarray(q2.global_scale))


def test_idempotent_many_global_scales():
    # ~5% of amax values break idempotence if g is computed as amax * (1/2688): many rows.
    x = jax.random.normal(jax.random.PRNGKey(1), (4096, 16)) * jnp.exp(
        jax.random.uniform(jax.random.PRNGKey(2), (4096, 1), minval=-8, maxval=8)
    )
    a = jit_call(nvfp4.qdq, x, scale_mode="row")
    np.testing.assert_array_equal(np.asarray(a),
                                  np.asarray(jit_call(nvfp4.qdq, a, scale_mode="row")))


def test_special_blocks():
    tiny = jnp.full((16,), 1e-30)
    huge = jnp.full((16,), 3e38)
    equal = jnp.full((16,), 0.37)
    zeros = jnp.zeros((16,))
    mixed = jnp.concatenate([tiny, huge, equal, zeros])
    out = jit_call(nvfp4.qdq, mixed)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out[48:]), 0.0)
    np.testing.assert_allclose(np.asarray(out[16:32]), 3e38, rtol=1e-6)
    # A block of equal values alone is exact up to the E4M3 scale's rounding of amax / 6.
    eq = jit_call(nvfp4.qdq, equal)
    np.testing.assert_allclose(np.asarray(eq), 0.37, rtol=2**-4)
    # tiny next to huge flushes to zero (the block scale underflows E4M3): counted, not NaN.
    np.testing.assert_array_equal(np.asarray(out[:16]), 0.0)
    # Tiny blocks on their own use the E4M3 subnormal range through the global scale.
    np.testing.assert_allclose(np.asarray(jit_call(nvfp4.qdq, tiny)), 1e-30, rtol=1e-6)


def test_all_zero_tensor_is_exact_zero():
    q = jit_call(nvfp4.quantize, jnp.zeros((4, 32), jnp.bfloat16))
    assert float(q.global_scale) == 1.0
    out = jit_call(nvfp4.dequantize, q)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_non_finite_poisons_its_block_only(bad):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 48))
    x = x.at[1, 20].set(bad)
    out = np.asarray(jit_call(nvfp4.qdq, x))
    assert np.isnan(out[1, 16:32]).all()  # the whole block of the bad value
    assert np.isfinite(out[0]).all() and np.isfinite(out[1, :16]).all()
    assert np.isfinite(out[1, 32:]).all()
    np.testing.assert_array_equal(
        np.asarray(jit_call(nvfp4.quantize, x).global_scale),
        np.asarray(jit_call(nvfp4.compute_global_scale, x.at[1, 20].set(0.0))),
    )


def test_global_scale_argument_and_shared_scale():
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    gate = jax.random.normal(k1, (4, 8, 32))
    up = jax.random.normal(k2, (4, 8, 32)) * 3
    g = jit_call(nvfp4.shared_global_scale, gate, up, scale_mode="expert")
    assert g.shape == (4, 1, 1)
    qg = jit_call(nvfp4.quantize, gate, global_scale=g, scale_mode="expert")
    qu = jit_call(nvfp4.quantize, up, global_scale=g, scale_mode="expert")
    fused = jit_call(nvfp4.quantize, jnp.concatenate([gate, up], axis=1), scale_mode="expert")
    np.testing.assert_array_equal(np.asarray(qg.global_scale), np.asarray(fused.global_scale))
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(qg.packed), np.asarray(qu.packed)], axis=1),
        np.asarray(fused.packed),
    )
    # Passing a quantized tensor's own global scale reproduces it exactly.
    q = jit_call(nvfp4.quantize, up, scale_mode="expert")
    q_again = jit_call(nvfp4.quantize, up, global_scale=q.global_scale, scale_mode="expert")
    np.testing.assert_array_equal(np.asarray(q.packed), np.asarray(q_again.packed))


def test_cross_check_against_jax_nvfp4_quantizer():
    """Independent implementation: jax's cuDNN-path reference quantizer."""
    x = jax.random.normal(jax.random.PRNGKey(4), (64, 512), jnp.float32) * 2.5
    ours = jit_call(nvfp4.quantize, x)
    cfg = jax_sms.BlockScaleConfig(
        mode="nvfp4", block_size=16, data_type=jnp.float4_e2m1fn,
        scale_type=jnp.float8_e4m3fn, global_scale=ours.global_scale, infer_only=False,
    )
    codes, scales = jax_sms.quantize(x, cfg)
    theirs = (
        codes.astype(jnp.float32).reshape(64, 32, 16)
        * scales.astype(jnp.float32)[..., None]
        * ours.global_scale
    ).reshape(64, 512)
    mine = jit_call(nvfp4.dequantize, ours)
    mismatch = int(jnp.sum(jnp.abs(mine - theirs) > 1e-6 * jnp.abs(theirs)))
    print(f"mismatches vs jax's quantizer: {mismatch} / {x.size}")
    # Different operation order (x / g / s vs x * (1 / (s g))) may flip rare ties only.
    assert mismatch <= x.size * 1e-3
    np.testing.assert_array_equal(
        np.asarray(ours.scales.astype(jnp.float32)), np.asarray(scales.astype(jnp.float32))
    )


def test_straight_through_gradient():
    w = jax.random.normal(jax.random.PRNGKey(5), (8, 32))
    g = jax.random.normal(jax.random.PRNGKey(6), (8, 32))
    grad = jit_call(jax.grad(lambda w: jnp.sum(nvfp4.fake_quant(w) * g)), w)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(g))
    np.testing.assert_array_equal(np.asarray(jit_call(nvfp4.fake_quant, w)),
                                  np.asarray(jit_call(nvfp4.qdq, w)))


def test_jit_vmap_and_dtypes_agree():
    x = jax.random.normal(jax.random.PRNGKey(7), (3, 4, 64))
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        xd = x.astype(dtype)
        eager = nvfp4.quantize(xd, scale_mode="expert")
        jitted = jax.jit(lambda a: nvfp4.quantize(a, scale_mode="expert"))(xd)
        vmapped = jax.vmap(lambda a: nvfp4.quantize(a))(xd)
        for a in (jitted, vmapped):
            np.testing.assert_array_equal(np.asarray(eager.packed), np.asarray(a.packed))
            np.testing.assert_array_equal(
                np.asarray(eager.global_scale).ravel(), np.asarray(a.global_scale).ravel()
            )
        assert nvfp4.qdq(xd).dtype == dtype


@pytest.mark.parametrize(
    "x, kwargs, match",
    [
        (jnp.ones((4, 24)), {}, "K=24"),
        (jnp.ones((4, 32), jnp.int32), {}, "dtype int32"),
        (jnp.ones((0, 32)), {}, "empty"),
        (jnp.ones(()), {}, "scalar"),
        (jnp.ones((4, 32)), {"global_scale": jnp.ones((3,))}, "expected"),
        (jnp.ones((4, 32)), {"scale_mode": "block"}, "scale_mode='block'"),
        (jnp.ones((4, 32)), {"scale_mode": "row", "global_scale": jnp.ones((2, 1))}, r"\(4, 1\)"),
    ],
)
def test_bad_input_raises_clear_errors(x, kwargs, match):
    with pytest.raises(ValueError, match=match):
        nvfp4.quantize(x, **kwargs)


@pytest.mark.numerics
def test_round_to_e2m1_value_is_the_code_table():
    """The arithmetic E2M1 rounding gives the table value of the rounded code, bit for bit
    (ties at every decision point, both signs, zeros, saturation, non-finite)."""
    points = np.array([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0,
                       6.0, 7.0, 8.0], np.float32)
    near = np.concatenate([points, np.nextafter(points, np.inf), np.nextafter(points, -np.inf)])
    rand = np.asarray(jax.random.uniform(jax.random.key(9), (4096,), minval=-8.0, maxval=8.0))
    # Every float32 from 2^-30 to 16 at a stride of 2^13 ulps: all exponents, both tie sides.
    sweep = np.arange(np.float32(2.0**-30).view(np.int32), np.float32(16.0).view(np.int32),
                      1 << 13, dtype=np.int32).view(np.float32)
    y = np.concatenate([near, -near, rand, sweep, -sweep,
                        [np.inf, -np.inf, np.nan, -np.nan, 1e30, -1e-30, 1e-45]]).astype(
        np.float32)
    want = nvfp4.e2m1_code_to_float(nvfp4.round_to_e2m1_code(jnp.asarray(y)))
    for fn in (nvfp4.round_to_e2m1_value, jax.jit(nvfp4.round_to_e2m1_value)):
        got = fn(jnp.asarray(y))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                      np.asarray(want).view(np.uint32))


@pytest.mark.numerics
def test_residual_products_are_exact_so_multiply_adds_change_nothing():
    """``residual_from_values`` splits the decode scale so that both of its products are exact
    in float32: each step is then one rounding of an exact value, the same whether or not a
    compiler contracts it into a fused multiply-add (float64 emulates the contracted form), and
    within one float32 rounding of the exact residual."""
    x = jax.random.normal(jax.random.key(0), (64, 256), jnp.float32) * 3
    q = nvfp4.quantize_codes(x.astype(jnp.bfloat16), scale_mode="row")
    vals = np.asarray(nvfp4.unscaled_values(q), np.float64)
    g = np.asarray(q.global_scale, np.float32)
    got = np.asarray(nvfp4.residual(x.astype(jnp.bfloat16), q))
    x64 = np.asarray(x.astype(jnp.bfloat16), np.float64)
    g_hi = (g.view(np.int32) & np.int32(-64)).view(np.float32).astype(np.float64)
    g_lo = g.astype(np.float64) - g_hi
    fused = ((x64 - vals * g_hi).astype(np.float32).astype(np.float64) - vals * g_lo)
    np.testing.assert_array_equal(got, fused.astype(np.float32))
    exact = x64 - vals * g.astype(np.float64)
    assert np.max(np.abs(got - exact) / np.maximum(np.abs(exact), 1e-30)) <= 2.0**-23


@pytest.mark.numerics
@pytest.mark.parametrize("mode,shape", [("tensor", (4, 64)), ("row", (6, 48)),
                                        ("expert", (3, 4, 32))])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_qdq_is_dequantize_of_quantize_bit_for_bit(mode, shape, dtype):
    """``qdq`` computes the values by arithmetic (no codes, no table): the same bits as
    ``dequantize(quantize(x))``, eager and jitted, with zero, tiny, huge and non-finite blocks
    (NaN where the codes' path gives NaN)."""
    x = jax.random.normal(jax.random.key(11), shape, jnp.float32)
    x = x * jnp.exp(3.0 * jax.random.normal(jax.random.key(12), shape[-1:]))
    flat = x.reshape(-1, shape[-1])
    flat = flat.at[0, :16].set(0.0).at[1, 3].set(jnp.inf).at[1, 40 % shape[-1]].set(jnp.nan)
    flat = flat.at[-1, :16].multiply(1e-30)
    x = flat.reshape(shape).astype(dtype)
    want = np.asarray(nvfp4.dequantize(nvfp4.quantize(x, scale_mode=mode), dtype))
    for fn in (nvfp4.qdq, jax.jit(nvfp4.qdq, static_argnames="scale_mode")):
        got = np.asarray(fn(x, scale_mode=mode))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        bits = np.uint16 if got.itemsize == 2 else np.uint32
        np.testing.assert_array_equal(got[ok].view(bits), want[ok].view(bits))
    assert np.isnan(want).any() and (want == 0).any()


def test_e2m1_code_to_float_is_the_table():
    """The arithmetic decode gives ``E2M1_TABLE`` bit for bit for all 16 codes (-0.0 for code 8),
    eager and jitted, uint8 and int32 codes."""
    for dtype in (jnp.uint8, jnp.int32):
        codes = jnp.arange(16, dtype=dtype)
        for fn in (nvfp4.e2m1_code_to_float, jax.jit(nvfp4.e2m1_code_to_float)):
            got = np.asarray(fn(codes))
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got.view(np.uint32),
                                          nvfp4.E2M1_TABLE.view(np.uint32))
