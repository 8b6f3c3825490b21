"""ops.linear / ops.grouped_linear: every mode against a reference written independently here
(float64 numpy on dequantized operands), packed leaves == master leaves, grouped == per-expert
loop, straight-through gradients, the kernel hook, bad inputs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from quads_jax.quant import fp8, nvfp4, ops, rac
from quads_jax.quant.recipe import MODES, QuantRecipe

SITE = "layers.0.mlp.experts.gate_up"
M, K, N, E = 24, 64, 32, 4


def recipe_for(mode: str, **kw) -> QuantRecipe:
    return QuantRecipe(rules=(("*", mode),), backend="reference", **kw)


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def deq(q) -> np.ndarray:
    if isinstance(q, fp8.FP8Tensor):
        return f64(jit_call(fp8.dequantize, q, jnp.float32))
    return f64(jit_call(nvfp4.dequantize, q, jnp.float32))


@pytest.fixture(scope="module")
def data():
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (M, K), jnp.float32) * jnp.exp(
        jax.random.normal(kg, (K,)))  # uneven channels, as in real activations
    w = jax.random.normal(kw, (N, K), jnp.float32) * 0.05
    we = jax.random.normal(kw, (E, N, K), jnp.float32) * jnp.arange(1, E + 1)[:, None, None]
    return x, w, we


def reference(mode: str, x, w, recipe: QuantRecipe) -> np.ndarray:
    """Each mode from its definition (QUADS_SPEC sections 2-5), float64."""
    xw = f64(x)
    if mode == "bf16":
        return xw @ f64(w).T
    if mode in ("w_fakequant_nvfp4", "w4a16_nvfp4"):
        return xw @ deq(jit_call(nvfp4.quantize, w)).T
    if mode == "w_fakequant_fp8":
        return xw @ deq(jit_call(fp8.quantize, w, granularity="channel")).T
    if mode == "w8a8_fp8":
        return deq(jit_call(fp8.quantize, x, granularity="token")) @ deq(
            jit_call(fp8.quantize, w, granularity="channel")).T
    wq = deq(jit_call(nvfp4.quantize, w))
    qx = jit_call(nvfp4.quantize, x, scale_mode="row")
    y = deq(qx) @ wq.T
    if mode == "w4a4_nvfp4_rac":  # the gathered form: Q(R_S) @ Q(W)[:, S]^T
        r = xw - deq(qx)
        nb = K // 16
        scores = (r.reshape(M, nb, 16) ** 2).sum((0, 2))
        s = np.sort(np.argsort(-scores, kind="stable")[: round(recipe.rac_ratio * nb)])
        cols = (s[:, None] * 16 + np.arange(16)).ravel()
        r_s = jit_call(nvfp4.quantize, jnp.asarray(r[:, cols], jnp.float32), scale_mode="row")
        y = y + deq(r_s) @ wq[:, cols].T
    return y


@pytest.mark.parametrize("mode", [m for m in MODES if m != "a_fakequant_nvfp4_w_fakequant_nvfp4"])
def test_linear_equals_reference(data, mode):
    x, w, _ = data
    recipe = recipe_for(mode)
    y = jit_call(ops.linear, x, w, SITE, recipe)
    assert y.shape == (M, N) and y.dtype == jnp.float32
    ref = reference(mode, x, w, recipe)
    np.testing.assert_allclose(f64(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_rac_reduces_error_and_ratio_one_is_two_pass(data):
    x, w, _ = data
    exact = f64(x) @ deq(nvfp4.quantize(w)).T
    err = lambda y: np.linalg.norm(f64(y) - exact) / np.linalg.norm(exact)
    e_w4a4 = err(ops.linear(x, w, SITE, recipe_for("w4a4_nvfp4")))
    errs = [err(ops.linear(x, w, SITE, recipe_for("w4a4_nvfp4_rac", rac_ratio=r)))
            for r in (0.25, 0.5, 1.0)]
    assert e_w4a4 > errs[0] > errs[1] > errs[2]
    assert errs[2] < 0.25 * e_w4a4
    bf16_res = err(ops.linear(x, w, SITE, recipe_for(
        "w4a4_nvfp4_rac", rac_ratio=1.0, rac_residual_format="bf16")))
    assert bf16_res < errs[2]


@pytest.mark.parametrize("mode", ["w4a4_nvfp4", "w4a4_nvfp4_rac", "w4a16_nvfp4", "w8a8_fp8",
                                  "w_fakequant_nvfp4", "w_fakequant_fp8"])
def test_packed_leaf_equals_master(data, mode):
    x, w, we = data
    recipe = recipe_for(mode)
    packed = jit_call(ops.quantize_weight, w, mode, recipe)
    assert isinstance(packed, nvfp4.NVFP4Tensor | fp8.FP8Tensor)
    np.testing.assert_array_equal(jit_call(ops.linear, x, packed, SITE, recipe),
                                  jit_call(ops.linear, x, w, SITE, recipe))
    gs = jnp.asarray([10, 0, 14, 0], jnp.int32)
    packed_e = jit_call(ops.quantize_weight, we, mode, recipe)
    np.testing.assert_array_equal(jit_call(ops.grouped_linear, x, packed_e, gs, SITE, recipe),
                                  jit_call(ops.grouped_linear, x, we, gs, SITE, recipe))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_equals_per_expert_loop(data, mode):
    x, _, we = data
    recipe = recipe_for(mode)
    # jitted, as the model runs them: one compile per shape (eagerly, every small op compiled)
    grouped = jax.jit(lambda x, w, gs: ops.grouped_linear(x, w, gs, SITE, recipe))
    linear = jax.jit(lambda x, w: ops.linear(x, w, SITE, recipe))
    gs = np.array([9, 0, 15, 0])  # experts 1 and 3 get no rows
    y = grouped(x.astype(jnp.bfloat16), we, jnp.asarray(gs))
    assert y.dtype == jnp.bfloat16
    start = 0
    for e, n in enumerate(gs):
        if n:
            ref = linear(x[start:start + n].astype(jnp.bfloat16), we[e])
            np.testing.assert_allclose(f64(y[start:start + n]), f64(ref), rtol=1e-2,
                                       atol=1e-2 * float(jnp.abs(ref).max()))
        start += n


def _empty_kernel_registry(monkeypatch, recipe):
    """No registered kernels for this test (restored after it); returns ``recipe`` with the
    interpret backend, which runs registered kernels."""
    monkeypatch.setattr(ops, "_KERNELS", {})
    monkeypatch.setattr(ops, "_TAKES_SOURCE_ROWS", set())
    monkeypatch.setattr(ops, "_TAKES_OUTPUT_ROWS", set())
    monkeypatch.setattr(ops, "_kernel_module_loaded", True)
    return dataclasses.replace(recipe, backend="interpret")


@pytest.mark.parametrize("mode", ["bf16", "w4a4_nvfp4_rac"])
def test_grouped_source_rows_equal_the_gathered_rows(data, mode, monkeypatch):
    """``source_rows``: the distinct rows plus their index give the gathered rows' result; a
    kernel registered with ``source_rows=True`` gets them as they are, others gathered."""
    x, _, we = data
    recipe = recipe_for(mode)
    src = jnp.asarray([3, 3, 0, 5, 1, 1, 1, 7, 2], jnp.int32)
    gs = jnp.asarray([4, 0, 5, 0], jnp.int32)
    xb = x.astype(jnp.bfloat16)
    # jitted, as the model runs it: one compile per call (eagerly, every small op compiled)
    grouped = jax.jit(lambda x, w, gs, src=None: ops.grouped_linear(x, w, gs, SITE, recipe,
                                                                    source_rows=src))
    want = grouped(xb[src], we, gs)
    np.testing.assert_array_equal(grouped(xb, we, gs, src), want)
    seen = []

    def kernel(x, w, group_sizes, *, recipe, site, interpret, source_rows=None):
        seen.append((x.shape[0], source_rows is not None))
        return jnp.zeros((src.shape[0], w.shape[1]), jnp.float32)

    interp = _empty_kernel_registry(monkeypatch, recipe)
    for takes in (True, False):
        ops.register_kernel(mode, "grouped", kernel, source_rows=takes)
        ops.grouped_linear(xb, we, gs, SITE, interp, source_rows=src)
    assert seen == [(xb.shape[0], True), (src.shape[0], False)]
    with pytest.raises(ValueError, match="grouped kernels only"):
        ops.register_kernel(mode, "dense", kernel, source_rows=True)


def test_grouped_output_rows_reorder_the_result(data, monkeypatch):
    """``output_rows``: ``y[output_rows]``, whether the kernel reads its result back in that
    order (registered with ``output_rows=True``) or ``grouped_linear`` gathers after it."""
    x, _, we = data
    recipe = recipe_for("bf16")
    gs = jnp.asarray([4, 0, 5, 0], jnp.int32)
    xb = x[:9].astype(jnp.bfloat16)
    perm = jnp.asarray([8, 0, 3, 3, 7], jnp.int32)
    full = ops.grouped_linear(xb, we, gs, SITE, recipe)
    np.testing.assert_array_equal(
        ops.grouped_linear(xb, we, gs, SITE, recipe, output_rows=perm), full[perm])
    seen = []

    def kernel(x, w, group_sizes, *, recipe, site, interpret, output_rows=None):
        seen.append(output_rows is not None)
        y = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None] * jnp.ones((1, w.shape[1]))
        return y if output_rows is None else y[output_rows]

    interp = _empty_kernel_registry(monkeypatch, recipe)
    for takes in (True, False):
        ops.register_kernel("bf16", "grouped", kernel, output_rows=takes)
        y = ops.grouped_linear(xb, we, gs, SITE, interp, output_rows=perm)
        np.testing.assert_array_equal(np.asarray(y[:, 0], np.float32), [8, 0, 3, 3, 7])
    assert seen == [True, False]
    with pytest.raises(ValueError, match="output_rows int32.* must be an int vector"):
        ops.grouped_linear(xb, we, gs, SITE, recipe, output_rows=perm[None])
    with pytest.raises(ValueError, match="grouped kernels only"):
        ops.register_kernel("bf16", "dense", kernel, output_rows=True)


@pytest.mark.parametrize("k", [1, 3])
def test_take_rows_with_inverse_has_the_gathers_gradient(k):
    """``take_rows(x, rows, inverse)``: the forward is ``x[rows]``; the gradient (a gather of
    the inverse, summed over the k copies) equals XLA's scatter-add of ``x[rows]``'s."""
    r, h = 5, 4
    rng = np.random.default_rng(k)
    slots = rng.permutation(r * k)  # sorted row -> slot; slot s takes row s // k
    rows = jnp.asarray(slots // k, jnp.int32)
    inverse = jnp.asarray(np.argsort(slots), jnp.int32)  # slot -> sorted row
    x = jnp.asarray(rng.normal(size=(r, h)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(r * k, h)), jnp.float32)

    def grad(f):
        return jax.vjp(f, x)[1](dy)[0]

    y = ops.take_rows(x, rows, inverse)
    np.testing.assert_array_equal(y, x[rows])
    np.testing.assert_allclose(grad(lambda x: ops.take_rows(x, rows, inverse)),
                               grad(lambda x: x[rows]), rtol=1e-6, atol=1e-6)
    # a wrong inverse changes the gradient: the test can fail
    bad = jnp.roll(inverse, 1)
    assert not np.allclose(grad(lambda x: ops.take_rows(x, rows, bad)),
                           grad(lambda x: x[rows]))
    with pytest.raises(ValueError, match="multiple of x's 5 rows"):
        ops.take_rows(x, rows[:-1], inverse[:-1]) if k == 1 else ops.take_rows(
            x, rows[1:], inverse[1:])
    with pytest.raises(ValueError, match="must be equal vectors"):
        ops.take_rows(x, rows, inverse[:-1])


@pytest.mark.numerics
def test_w4a4_bf16_operands_are_exact(data):
    """bf16 activations: the W4A4 result matches the float64 product of the dequantized
    operands to f32 accumulation accuracy (the operands are exact in bf16)."""
    x, w, _ = data
    xb = x.astype(jnp.bfloat16)
    y = ops.linear(xb, w, SITE, recipe_for("w4a4_nvfp4"), out_dtype=jnp.float32)
    ref = deq(nvfp4.quantize(xb, scale_mode="row")) @ deq(nvfp4.quantize(w)).T
    np.testing.assert_allclose(f64(y), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("act_scale_mode", ["per_batch", "static"])
def test_activation_scale_modes(data, act_scale_mode):
    x, w, _ = data
    recipe = recipe_for("w4a4_nvfp4", act_scale_mode=act_scale_mode)
    wq = deq(nvfp4.quantize(w))
    if act_scale_mode == "per_batch":
        leaf, qx = w, nvfp4.quantize(x, scale_mode="tensor")
    else:
        g = rac.calibrate_act_scale(x * 0.5)  # calibrated on smaller activations: clipping
        leaf = rac.CalibratedWeight(w, act_global_scale=g)
        qx = nvfp4.quantize(x, global_scale=jnp.full((M, 1), g), scale_mode="row")
    y = ops.linear(x, leaf, SITE, recipe)
    ref = deq(qx) @ wq.T
    np.testing.assert_allclose(f64(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    with pytest.raises(ValueError, match="static"):
        ops.linear(x, w, SITE, recipe_for("w4a4_nvfp4", act_scale_mode="static"))


def test_fake_quant_modes_have_straight_through_gradients(data):
    x, w, _ = data
    ct = jax.random.normal(jax.random.key(5), (M, N), jnp.float32)
    for mode, x_quant in (("w_fakequant_nvfp4", False),
                          ("a_fakequant_nvfp4_w_fakequant_nvfp4", True)):
        f = lambda x, w, mode=mode: jnp.sum(ops.linear(x, w, SITE, recipe_for(mode)) * ct)
        gx, gw = jax.grad(f, argnums=(0, 1))(x, w)
        w_hat = nvfp4.qdq(w)
        x_hat = nvfp4.qdq(x, scale_mode="row") if x_quant else x
        np.testing.assert_allclose(gw, f64(ct).T @ f64(x_hat), rtol=1e-5, atol=1e-5)  # at qdq(W)
        np.testing.assert_allclose(gx, f64(ct) @ f64(w_hat), rtol=1e-5, atol=1e-5)
        y = ops.linear(x, w, SITE, recipe_for(mode))
        np.testing.assert_allclose(f64(y), f64(x_hat) @ f64(w_hat).T, rtol=1e-5, atol=1e-5)


def test_kernel_hook_dispatch(data):
    x, w, _ = data
    calls = []

    def kernel(x, w, *, recipe, site, interpret):
        calls.append((site, interpret))
        return ops._reference(x, w, "w4a4_nvfp4", site, recipe, None) * 2.0

    ops._load_kernel_module()  # its registrations must not overwrite ours below
    saved = ops._KERNELS.get(("w4a4_nvfp4", "dense"))
    ops.register_kernel("w4a4_nvfp4", "dense", kernel)
    try:
        ref = ops.linear(x, w, SITE, recipe_for("w4a4_nvfp4"))
        out = ops.linear(x, w, SITE, recipe_for("w4a4_nvfp4").replace(backend="interpret"))
        np.testing.assert_array_equal(out, 2.0 * ref)
        assert calls == [(SITE, True)]
        if jax.default_backend() != "gpu":  # auto on CPU never runs kernels
            ops.linear(x, w, SITE, recipe_for("w4a4_nvfp4").replace(backend="auto"))
            assert len(calls) == 1
    finally:
        if saved is None:
            ops._KERNELS.pop(("w4a4_nvfp4", "dense"), None)
        else:
            ops._KERNELS[("w4a4_nvfp4", "dense")] = saved
    with pytest.raises(ValueError, match="mode"):
        ops.register_kernel("w4a2", "dense", kernel)
    with pytest.raises(ValueError, match="kind"):
        ops.register_kernel("w4a4_nvfp4", "sparse", kernel)


def test_bad_inputs(data):
    x, w, we = data
    with pytest.raises(ValueError, match="K=64 does not match weight K=32"):
        ops.linear(x, w[:, :32], SITE)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        ops.linear(x, we, SITE)
    with pytest.raises(ValueError, match="group_sizes"):
        ops.grouped_linear(x, we, jnp.asarray([M], jnp.int32), SITE)
    with pytest.raises(ValueError, match="bf16 but the weight is a packed NVFP4Tensor"):
        ops.linear(x, nvfp4.quantize(w), SITE, recipe_for("bf16"))
    with pytest.raises(ValueError, match="FP8Tensor weight cannot run an NVFP4 mode"):
        ops.linear(x, fp8.quantize(w, granularity="channel"), SITE, recipe_for("w4a4_nvfp4"))
