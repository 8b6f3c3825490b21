"""Weight sync: packed leaves, bit identity with the trainer's qdq, and corruption caught."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from quads_jax import models
from quads_jax.quant import fp8, nvfp4, ops, rac
from quads_jax.quant.rac import CalibratedWeight
from quads_jax.quant.recipe import get_recipe
from quads_jax.sampler import engine
from quads_jax.sampler.calibration import calibrate
from quads_jax.sampler.sync import (
    SyncMismatchError,
    check_sync,
    leaf_actions,
    sync,
    weight_bytes,
)
from quads_jax.testing import tiny_config


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()  # 4 layers (dense layer 1), bf16 compute, f32 master weights
    return cfg, models.init_params(cfg, jax.random.key(0))


@pytest.mark.numerics
@pytest.mark.parametrize(
    "name,expert_type",
    [("bf16", jax.Array), ("rollout_nvfp4", nvfp4.NVFP4Tensor), ("rollout_fp8", fp8.FP8Tensor)],
)
def test_sync_packs_expert_leaves_bit_identical_to_trainer_qdq(model, name, expert_type):
    cfg, params = model
    recipe = get_recipe(name)
    rollout = sync(params, recipe, model_config=cfg)
    for group in rollout["layers"]:
        mlp = group["mlp"]
        if "experts" in mlp:
            assert isinstance(mlp["experts"]["gate_up"], expert_type)
            assert isinstance(mlp["experts"]["down"], expert_type)
            assert mlp["router"].dtype == jnp.float32  # the router runs in f32
        assert group["attn"]["qkv_proj"].dtype == jnp.bfloat16  # bf16 q/k/v: one weight
        assert "q_proj" not in group["attn"]
    report = check_sync(params, rollout, recipe, model_config=cfg, full=True)
    assert report.mismatches == (0,) * len(report.paths)
    check_sync(params, rollout, recipe, model_config=cfg)
    assert weight_bytes(rollout) < weight_bytes(params)


@pytest.mark.parametrize("name", ["rollout_quads", "rollout_w4a16", "trainer_qat"])
def test_every_nvfp4_mode_quantizes_the_experts_only(model, name):
    cfg, params = model
    actions = leaf_actions(params, get_recipe(name), model_config=cfg)
    mode = get_recipe(name).mode_for("layers.0.mlp.experts.down")
    assert actions["layers"][0]["mlp"]["experts"] == {"gate_up": mode, "down": mode}
    assert actions["layers"][0]["mlp"]["router"] == "keep"
    assert actions["layers"][1]["mlp"] == {"gate_up": "cast", "down": "cast"}  # dense layer
    assert actions["lm_head"] == actions["embed"] == "cast"


def test_fused_gate_up_share_one_scale_per_expert(model):
    cfg, params = model
    rollout = sync(params, get_recipe("rollout_nvfp4"), model_config=cfg)
    master = params["layers"][0]["mlp"]["experts"]["gate_up"]  # [n, E, 2I, H]
    leaf = rollout["layers"][0]["mlp"]["experts"]["gate_up"]
    half = master.shape[2] // 2
    want = nvfp4.shared_global_scale(master[:, :, :half], master[:, :, half:], scale_mode="expert")
    assert leaf.global_scale.shape == master.shape[:2] + (1, 1)
    np.testing.assert_array_equal(np.asarray(leaf.global_scale), np.asarray(want))


def test_keep_first_layers_bf16_splits_groups(model):
    cfg, params = model
    recipe = get_recipe("rollout_nvfp4", keep_first_n_bf16=3)
    rollout = sync(params, recipe, model_config=cfg)
    kinds = [type(g["mlp"]["experts"]["gate_up"]).__name__ for g in rollout["layers"]
             if "experts" in g["mlp"]]
    assert kinds == ["ArrayImpl", "ArrayImpl", "NVFP4Tensor"]
    check_sync(params, rollout, recipe, model_config=cfg, full=True)


def _corruptions(rollout):
    experts = rollout["layers"][-1]["mlp"]["experts"]
    q = experts["down"]
    yield "packed", "layers.2.mlp.experts.down", dataclasses.replace(
        q, packed=q.packed.at[0, 3, 5, 1].add(jnp.uint8(16)))
    idx = (0, 1, 2, 0)
    other = jnp.where(q.scales[idx].astype(jnp.float32) == 0.5, 1.0, 0.5)
    yield "scales", "layers.2.mlp.experts.down", dataclasses.replace(
        q, scales=q.scales.at[idx].set(other.astype(jnp.float8_e4m3fn)))
    yield "global", "layers.2.mlp.experts.down", dataclasses.replace(
        q, global_scale=q.global_scale * 1.0001)


@pytest.mark.parametrize("what", ["packed", "scales", "global", "cast", "structure"])
@pytest.mark.parametrize("full", [False, True])
def test_check_sync_catches_a_corrupted_leaf(model, what, full):
    cfg, params = model
    recipe = get_recipe("rollout_nvfp4")
    rollout = sync(params, recipe, model_config=cfg)
    bad = jax.tree.map(lambda x: x, rollout)
    if what == "cast":
        bad["layers"][0]["attn"]["o_proj"] = bad["layers"][0]["attn"]["o_proj"].at[0, 2, 3].add(
            jnp.bfloat16(0.25))
        path = "layers.0.attn.o_proj"
    elif what == "structure":
        del bad["layers"][1]["post_attn_norm"]
        path = "tree structure differs"
    else:
        (_, path, leaf), = [c for c in _corruptions(bad) if c[0] == what]
        bad["layers"][-1]["mlp"]["experts"]["down"] = leaf
    with pytest.raises(SyncMismatchError, match=path.replace(".", r"\.")):
        check_sync(params, bad, recipe, model_config=cfg, full=full)


def test_fused_qkv_is_the_three_projections_stacked_and_checked(model):
    cfg, params = model
    recipe = get_recipe("rollout_quads")
    rollout = sync(params, recipe, model_config=cfg)
    unfused = sync(params, recipe, model_config=cfg, fuse_qkv=False)
    for fused, three in zip(rollout["layers"], unfused["layers"], strict=True):
        want = jnp.concatenate([three["attn"][n] for n in ("q_proj", "k_proj", "v_proj")], -2)
        np.testing.assert_array_equal(np.asarray(fused["attn"]["qkv_proj"]), np.asarray(want))
    check_sync(params, unfused, recipe, model_config=cfg, full=True)  # either tree checks
    bad = jax.tree.map(lambda x: x, rollout)
    w = bad["layers"][0]["attn"]["qkv_proj"]
    bad["layers"][0]["attn"]["qkv_proj"] = w.at[0, -1, 0].add(jnp.bfloat16(0.5))  # a v row
    for full in (False, True):
        with pytest.raises(SyncMismatchError, match=r"layers\.0\.attn\.qkv_proj"):
            check_sync(params, bad, recipe, model_config=cfg, full=full)


@pytest.mark.parametrize("axis,fused", [("fsdp", True), ("tensor", False)])
def test_heads_split_over_devices_keep_three_projections(model, axis, fused):
    cfg, params = model
    mesh = jax.make_mesh((2,), (axis,), axis_types=(jax.sharding.AxisType.Explicit,))
    # fsdp splits the input features (axis -1), tensor the heads (axis -2)
    spec = P(None, None, "fsdp") if axis == "fsdp" else P(None, "tensor", None)
    sharded = jax.tree.map(lambda x: x, params)
    attn = sharded["layers"][0]["attn"]
    for n in ("q_proj", "k_proj", "v_proj"):
        attn[n] = jax.device_put(attn[n], jax.sharding.NamedSharding(mesh, spec))
    out = models.fuse_qkv(cfg, sharded)
    assert ("qkv_proj" in out["layers"][0]["attn"]) == fused
    assert "qkv_proj" in out["layers"][1]["attn"]  # the unsharded group still fuses


def test_quantized_attention_keeps_three_projections(model):
    cfg, params = model
    recipe = get_recipe("rollout_nvfp4", also_attention=True)
    rollout = sync(params, recipe, model_config=cfg)
    attn = rollout["layers"][0]["attn"]
    assert "qkv_proj" not in attn and isinstance(attn["q_proj"], nvfp4.NVFP4Tensor)
    # a fused tree run under a recipe that quantizes q/k/v is refused, not run as bf16
    fused = sync(params, get_recipe("rollout_nvfp4"), model_config=cfg)
    tokens = jnp.asarray([[4, 5, 6]], jnp.int32)
    with pytest.raises(ValueError, match="fused q/k/v weight runs bf16 only"):
        models.forward(cfg, fused, tokens, recipe=recipe)


@pytest.mark.parametrize("name", ["bf16", "rollout_quads"])
def test_fused_qkv_gives_the_logits_and_greedy_tokens_of_three_projections(name):
    cfg = tiny_config(num_hidden_layers=2, mlp_only_layers=())  # bf16 compute
    params = models.init_params(cfg, jax.random.key(5))
    recipe = get_recipe(name)
    fused = sync(params, recipe, model_config=cfg)
    three = sync(params, recipe, model_config=cfg, fuse_qkv=False)
    assert models.has_fused_qkv(fused) and not models.has_fused_qkv(three)
    tokens, mask = engine.left_pad([[4, 5, 6, 7], [8, 9]])
    run = jax.jit(lambda p: models.forward(cfg, p, tokens, attention_mask=mask,
                                           recipe=recipe).logits)
    # bit-identical here; in float32 compute XLA:CPU adds the wider GEMM's terms in another
    # order (~1e-6), so the tolerance is that of any GEMM shape change
    np.testing.assert_allclose(np.asarray(run(fused)), np.asarray(run(three)), atol=1e-5)
    config = engine.SamplerConfig(max_new_tokens=6, greedy=True)
    outs = [engine.generate(p, tokens, jax.random.key(1), config, model_config=cfg,
                            recipe=recipe, prompt_mask=mask) for p in (fused, three)]
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))


def test_synced_weights_give_the_logits_of_on_the_fly_quantization():
    cfg = tiny_config(num_hidden_layers=2, mlp_only_layers=())
    params = models.init_params(cfg, jax.random.key(3))
    recipe = get_recipe("rollout_nvfp4")
    rollout = sync(params, recipe, model_config=cfg)
    tokens, mask = engine.left_pad([[4, 5, 6, 7], [8, 9]])
    run = jax.jit(lambda p: models.forward(cfg, p, tokens, attention_mask=mask,
                                           recipe=recipe).logits)
    # The master tree is quantized inside the forward by the same function as at sync.
    np.testing.assert_array_equal(np.asarray(run(rollout)), np.asarray(run(params)))


def test_static_calibration_wraps_w4a4_leaves_with_calibrated_blocks_and_scales():
    # Two MoE layers, f32 activations (two compiled programs then agree to ~1 ulp).
    cfg = tiny_config(dtype="float32", num_hidden_layers=2, mlp_only_layers=())
    params = models.init_params(cfg, jax.random.key(0))
    recipe = get_recipe("rollout_quads", rac_selection="static", act_scale_mode="static")
    tokens = jax.random.randint(jax.random.key(1), (3, 12), 3, cfg.vocab_size)
    rollout = sync(params, recipe, model_config=cfg, calibration_tokens=tokens)
    leaf = rollout["layers"][0]["mlp"]["experts"]["gate_up"]  # layers 0 and 1
    assert isinstance(leaf, CalibratedWeight) and isinstance(leaf.weight, nvfp4.NVFP4Tensor)
    e, k = cfg.num_experts, cfg.hidden_size
    assert leaf.rac_blocks.shape == (2, e, k // 16) and leaf.act_global_scale.shape == (2, e)
    assert isinstance(rollout["layers"][0]["attn"]["qkv_proj"], jax.Array)  # bf16: no wrap

    # Recompute layer 1's calibration from the model's own site inputs in another program:
    # activations may differ in the last ulp (fusion order) and a near-tie between two
    # blocks' scores may flip, so most blocks and all scales (to 1e-5) must agree.
    online = recipe.replace(rac_selection="online_batch", act_scale_mode="per_token")
    collect = jax.jit(lambda p, t: models.collect_site_inputs(cfg, p, t, recipe=online)[1])
    x, gs = collect(params, tokens)["layers.1.mlp.experts.gate_up"]

    @jax.jit  # one compile, not a dispatch of every small op (7 of this test's 21 s)
    def recalibrate(x, gs):
        rows = ops.expert_of_rows(gs, x.shape[0])
        return (rac.calibrate_blocks(x, online, row_expert=rows, num_experts=e),
                rac.calibrate_act_scale(x, row_expert=rows, num_experts=e))

    want_blocks, want_scale = recalibrate(x, gs)
    assert np.mean(np.asarray(leaf.rac_blocks[1]) == np.asarray(want_blocks)) >= 0.9
    assert np.all(np.sum(np.asarray(leaf.rac_blocks), axis=-1) == k // 16 // 2)  # ratio 0.5
    np.testing.assert_allclose(np.asarray(leaf.act_global_scale[1]), np.asarray(want_scale),
                               rtol=1e-5)

    check_sync(params, rollout, recipe, model_config=cfg, full=True)

    # A calibration made once serves another sync: the same leaves as from the tokens.
    calib = calibrate(params, recipe, model_config=cfg, tokens=tokens)
    again = sync(params, recipe, model_config=cfg, calibration=calib)
    for a, b in zip(jax.tree.leaves(rollout), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"calibration: no entry for 1 W4A4 site\(s\)"):
        sync(params, recipe, model_config=cfg,
             calibration={k: v for k, v in calib.items() if k != "layers.1.mlp.experts.down"})
    with pytest.raises(ValueError, match="has no static RAC selection"):
        sync(params, get_recipe("rollout_quads"), model_config=cfg, calibration=calib)


def test_sync_input_errors(model):
    cfg, params = model
    recipe = get_recipe("rollout_quads", rac_selection="static")
    with pytest.raises(ValueError, match="calibration_tokens: None"):
        sync(params, recipe, model_config=cfg)
    with pytest.raises(ValueError, match=r"calibration_tokens: .*got shape \(5,\)"):
        sync(params, recipe, model_config=cfg, calibration_tokens=np.arange(5))
    with pytest.raises(ValueError, match="expected a QuantRecipe"):
        sync(params, "rollout_nvfp4", model_config=cfg)


@pytest.mark.parametrize("name,kind,field", [("rollout_w4a16", "W4A4Weights", "codes"),
                                              ("rollout_fp8", "FP8Weights", "data")])
def test_kernel_layout_leaves_pass_the_check_and_corruption_is_caught(model, name, kind, field):
    cfg, params = model
    recipe = get_recipe(name)
    rollout = sync(params, recipe, model_config=cfg, kernel_layout=True)
    leaf = rollout["layers"][-1]["mlp"]["experts"]["down"]
    arr = getattr(leaf, field)
    assert type(leaf).__name__ == kind and arr.shape[:2] == (2, cfg.num_experts)
    check_sync(params, rollout, recipe, model_config=cfg, full=True)
    bits = jax.lax.bitcast_convert_type(arr, jnp.uint8 if arr.dtype.itemsize == 1 else jnp.uint16)
    bad = jax.lax.bitcast_convert_type(bits.at[1, 2, 0, 3, 0].add(1), arr.dtype)
    rollout["layers"][-1]["mlp"]["experts"]["down"] = dataclasses.replace(leaf, **{field: bad})
    with pytest.raises(SyncMismatchError, match=r"layers\.2\.mlp\.experts\.down"):
        check_sync(params, rollout, recipe, model_config=cfg)


@pytest.mark.parametrize("scale_dtype", ["float8_e4m3fn", None])
def test_kernel_scale_layouts_pass_the_check_and_a_corrupt_scale_is_caught(model, scale_dtype):
    """Weights synced with E4M3 (the default) or float16 block scales in the kernel layout
    (``kernel_backend.set_w4a4_scale_dtype``) dequantize to the trainer's values; one scale
    changed by one unit in its last place is caught. The setting takes effect at the next
    sync, also after a sync at another setting in the same process (its jitted conversion)."""
    from quads_jax.quant import kernel_backend

    cfg, params = model
    recipe = get_recipe("rollout_nvfp4")
    other = None if scale_dtype else "float8_e4m3fn"
    try:
        kernel_backend.set_w4a4_scale_dtype(other)
        first = sync(params, recipe, model_config=cfg, kernel_layout=True)
        assert first["layers"][-1]["mlp"]["experts"]["down"].scales.dtype == jnp.dtype(
            other or "float16")
        kernel_backend.set_w4a4_scale_dtype(scale_dtype)
        rollout = sync(params, recipe, model_config=cfg, kernel_layout=True)
    finally:
        kernel_backend.set_w4a4_scale_dtype()
    leaf = rollout["layers"][-1]["mlp"]["experts"]["down"]
    assert leaf.scales.dtype == jnp.dtype(scale_dtype or "float16")
    assert leaf.mma_dtype == "float16"
    check_sync(params, rollout, recipe, model_config=cfg, full=True)
    word = jnp.uint8 if leaf.scales.dtype.itemsize == 1 else jnp.uint16
    bits = jax.lax.bitcast_convert_type(leaf.scales, word)
    bad = jax.lax.bitcast_convert_type(bits.at[1, 2, 0, 0, 3].add(1), leaf.scales.dtype)
    rollout["layers"][-1]["mlp"]["experts"]["down"] = dataclasses.replace(leaf, scales=bad)
    with pytest.raises(SyncMismatchError, match=r"layers\.2\.mlp\.experts\.down"):
        check_sync(params, rollout, recipe, model_config=cfg)
