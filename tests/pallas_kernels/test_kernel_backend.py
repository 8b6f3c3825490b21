"""kernel_backend wires the kernels into quads_jax.quant.ops (recipe.backend="interpret")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from pallas_kernels.layout import W4A4Weights
from quads_jax.quant import kernel_backend, ops
from quads_jax.quant.recipe import QuantRecipe


def test_registered_modes():
    got = set(ops.registered_kernels())
    for mode in ("w4a4_nvfp4", "w4a4_nvfp4_rac", "w4a16_nvfp4"):
        assert {(mode, "dense"), (mode, "grouped")} <= got


def test_ops_linear_interpret_matches_reference_path():
    site = "layers.0.mlp.experts.down"
    w = jax.random.normal(jax.random.key(0), (128, 256))
    x = jax.random.normal(jax.random.key(1), (3, 256))
    rules = ((site, "w4a4_nvfp4_rac"),)
    packed = jit_call(ops.quantize_weight, w, "w4a4_nvfp4_rac")
    prepared = jit_call(kernel_backend.prepare_weights, packed, "w4a4_nvfp4_rac")
    assert isinstance(prepared, W4A4Weights) and prepared.shape == (128, 256)
    ref = jit_call(ops.linear, x, packed, site, QuantRecipe(rules=rules, backend="reference"))
    got = jit_call(ops.linear, x, prepared, site, QuantRecipe(rules=rules, backend="interpret"))
    err = np.max(np.abs(np.asarray(got) - np.asarray(ref))) / np.max(np.abs(np.asarray(ref)))
    assert got.shape == (3, 128) and got.dtype == jnp.float32 and err < 1e-5


def test_w4a4_overrides_are_checked_and_used():
    try:
        kernel_backend.set_w4a4_overrides(n_group=2, num_sms=2)
        cfg = kernel_backend._config(True, "float16")
        assert (cfg.n_group, cfg.num_sms, cfg.a_via_smem) == (2, 2, True)
        for bad in (dict(n_groups=2), dict(mma_dtype="bfloat16"), dict(block_m=12)):
            with pytest.raises(ValueError, match="block_m|unknown field"):
                kernel_backend.set_w4a4_overrides(**bad)
        assert kernel_backend._config(False, "float16").n_group == 2  # a bad call changed nothing
    finally:
        kernel_backend.set_w4a4_overrides()
    assert kernel_backend._config(False, "float16") == kernel_backend.W4A4MatmulConfig()


def test_fp8_overrides_are_checked_and_used():
    try:
        kernel_backend.set_fp8_overrides(windowed_operands=False)
        assert not kernel_backend._fp8_config(True).windowed_operands
        with pytest.raises(ValueError, match="unknown field"):
            kernel_backend.set_fp8_overrides(num_sms=2)
        assert not kernel_backend._fp8_config(False).windowed_operands  # unchanged
    finally:
        kernel_backend.set_fp8_overrides()
    assert kernel_backend._fp8_config(False) == kernel_backend.W8A8MatmulConfig()


def test_grouped_barrier_switch():
    """The barrier after the grouped kernels is off by default (measured faster); the ablation
    adds it to the traced program; a non-bool is refused and changes nothing."""
    y = jnp.ones((4, 8))
    # a fresh function per trace: make_jaxpr caches by function (the switch is read at trace)
    prim = lambda: str(jax.make_jaxpr(lambda a: kernel_backend._materialized(a))(y))  # noqa: E731
    assert kernel_backend.DEFAULT_GROUPED_BARRIER is False
    assert "optimization_barrier" not in prim()
    try:
        kernel_backend.set_grouped_barrier(True)
        assert "optimization_barrier" in prim()
        with pytest.raises(ValueError, match="True or False"):
            kernel_backend.set_grouped_barrier("no")
        assert "optimization_barrier" in prim()
    finally:
        kernel_backend.set_grouped_barrier()
    assert "optimization_barrier" not in prim()


def test_w4a4_bits_switch():
    """``set_w4a4_bits`` picks the word bit layout of the float16 weights made at sync (bf16
    layouts keep "nibbles"); a bad value raises and changes nothing."""
    w = jax.random.normal(jax.random.key(3), (2, 128, 256))
    recipe = QuantRecipe(rac_residual_format="bf16")

    def prepared(mode, *more):  # traced at each call: the switch as set then
        return jit_call(kernel_backend.prepare_weights, w, mode, *more)

    assert prepared("w4a4_nvfp4").bits == "signs_high"  # the default
    try:
        kernel_backend.set_w4a4_bits("nibbles")
        assert prepared("w4a4_nvfp4").bits == "nibbles"
        kernel_backend.set_w4a4_bits("signs_high")
        assert prepared("w4a4_nvfp4").bits == "signs_high"
        assert prepared("w4a16_nvfp4", QuantRecipe()).bits == "nibbles"
        assert prepared("w4a4_nvfp4_rac", recipe).bits == "nibbles"
        with pytest.raises(ValueError, match="bits='x' is not one of"):
            kernel_backend.set_w4a4_bits("x")
        assert prepared("w4a4_nvfp4").bits == "signs_high"
    finally:
        kernel_backend.set_w4a4_bits()
    assert prepared("w4a4_nvfp4").bits == "signs_high"


def test_w4a4_scale_dtype_switch():
    """``set_w4a4_scale_dtype`` picks the block scales' dtype of the float16 weights made at
    sync (bf16 layouts keep bf16 scales); a bad value raises and changes nothing."""
    w = jax.random.normal(jax.random.key(4), (2, 128, 256))

    def prepared(mode, *more):  # traced at each call: the switch as set then
        return jit_call(kernel_backend.prepare_weights, w, mode, *more)

    default = jnp.dtype(kernel_backend.DEFAULT_W4A4_SCALE_DTYPE or "float16")
    assert prepared("w4a4_nvfp4").scales.dtype == default
    try:
        kernel_backend.set_w4a4_scale_dtype("float8_e4m3fn")
        got = prepared("w4a4_nvfp4")
        assert got.scales.dtype == jnp.float8_e4m3fn and got.mma_dtype == "float16"
        bf16 = prepared("w4a16_nvfp4", QuantRecipe())
        assert bf16.scales.dtype == jnp.bfloat16
        with pytest.raises(ValueError, match="scale_dtype='int8'"):
            kernel_backend.set_w4a4_scale_dtype("int8")
        assert prepared("w4a4_nvfp4").scales.dtype == jnp.float8_e4m3fn
        kernel_backend.set_w4a4_scale_dtype(None)
        assert prepared("w4a4_nvfp4").scales.dtype == jnp.float16
    finally:
        kernel_backend.set_w4a4_scale_dtype()
    assert prepared("w4a4_nvfp4").scales.dtype == default



def test_trainer_modes_run_the_bf16_grouped_kernel_with_gradients():
    """The trainer's expert matmuls run ``bf16_grouped`` under "interpret" (what "auto" does
    on a GPU): QAT's (``w_fakequant_nvfp4``) value and gradients (straight-through to the f32
    master weight) equal the XLA reference path's; bf16, FP8 fake-quant and symmetric QAT are
    routed to it too; ``set_bf16_grouped(False)`` traces XLA's ``ragged_dot`` instead; shapes
    the kernel cannot take fall back to it."""
    site = "layers.0.mlp.experts.gate_up"
    x = jax.random.normal(jax.random.key(0), (24, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (3, 128, 64)) * 0.1  # f32 master weights
    gs = jnp.asarray([10, 0, 9], jnp.int32)
    recipes = [QuantRecipe(rules=((site, "w_fakequant_nvfp4"),), backend=b)
               for b in ("reference", "interpret")]

    def loss(x, w, recipe):
        y = ops.grouped_linear(x, w, gs, site, recipe)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    (ref_x, ref_w), (got_x, got_w) = (jit_call(jax.grad(loss, (0, 1)), x, w, r) for r in recipes)
    assert got_w.dtype == jnp.float32 and got_x.dtype == jnp.bfloat16
    for got, ref in ((got_x, ref_x), (got_w, ref_w)):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        assert np.max(np.abs(got - ref)) <= 2 ** -7 * np.max(np.abs(ref))
    # The other plain-matmul modes take their operands from the same ops.plain_operands as
    # their reference path: that they reach the kernel is what is left to check.
    bf16 = QuantRecipe(rules=((site, "bf16"),), backend="interpret")
    traced = lambda w, r=bf16: str(jax.make_jaxpr(  # noqa: E731
        lambda x, w: ops.grouped_linear(x, w, gs, site, r))(x[:, :w.shape[-1]], w))
    for mode in ("w_fakequant_nvfp4", "bf16", "w_fakequant_fp8",
                 "a_fakequant_nvfp4_w_fakequant_nvfp4"):
        jaxpr = traced(w, QuantRecipe(rules=((site, mode),), backend="interpret"))
        assert "ragged_dot_general" not in jaxpr and "wgmma" in jaxpr, mode
    assert "ragged_dot_general" in traced(w[:, :, :48])  # K = 48: not a multiple of 64
    try:
        kernel_backend.set_bf16_grouped(False)
        assert "ragged_dot_general" in traced(w) and "wgmma" not in traced(w)
        with pytest.raises(ValueError, match="True or False"):
            kernel_backend.set_bf16_grouped(1)
        with pytest.raises(ValueError, match="dw_kernel=0"):
            kernel_backend.set_bf16_grouped(True, dw_kernel=0)
        assert "ragged_dot_general" in traced(w)  # the bad calls changed nothing
    finally:
        kernel_backend.set_bf16_grouped()
    assert "ragged_dot_general" not in traced(w)
