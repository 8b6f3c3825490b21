"""QuantRecipe: site -> mode rules, defaults of QUADS_SPEC section 3, options, registry."""

from __future__ import annotations

import pytest

from quads_jax.quant.recipe import QuantRecipe, get_recipe, recipe_names, register_recipe

SITES_BF16 = ("layers.3.attn.q_proj", "layers.3.attn.o_proj", "layers.3.mlp.router",
              "layers.0.mlp.gate_up", "layers.3.mlp.shared_expert.gate_up", "lm_head", "embed")


@pytest.mark.parametrize("name,mode", [
    ("trainer_qat", "w_fakequant_nvfp4"), ("rollout_nvfp4", "w4a4_nvfp4"),
    ("rollout_quads", "w4a4_nvfp4_rac"), ("rollout_w4a16", "w4a16_nvfp4"),
    ("trainer_fp8", "w_fakequant_fp8"), ("rollout_fp8", "w8a8_fp8"),
    ("trainer_symmetric_qat", "a_fakequant_nvfp4_w_fakequant_nvfp4"), ("bf16", "bf16"),
])
def test_named_recipes_quantize_routed_experts_only(name, mode):
    r = get_recipe(name)
    assert r.mode_for("layers.3.mlp.experts.gate_up") == mode
    assert r.mode_for("layers.47.mlp.experts.down") == mode
    assert all(r.mode_for(s) == "bf16" for s in SITES_BF16)


def test_options_first_last_layers_and_attention():
    r = get_recipe("rollout_nvfp4", keep_first_n_bf16=1, keep_last_n_bf16=2, num_layers=6,
                   also_attention=True)
    assert r.mode_for("layers.0.mlp.experts.gate_up") == "bf16"
    assert r.mode_for("layers.1.mlp.experts.gate_up") == "w4a4_nvfp4"
    assert r.mode_for("layers.3.attn.k_proj") == "w4a4_nvfp4"
    assert r.mode_for("layers.3.attn.q_norm") == "bf16"
    assert r.mode_for("layers.4.attn.k_proj") == "bf16"
    assert r.mode_for("layers.5.mlp.experts.down") == "bf16"
    assert r.mode_for("layers.3.mlp.router") == "bf16"
    assert r.replace(attention_mode="w4a16_nvfp4").mode_for("layers.2.attn.v_proj") == "w4a16_nvfp4"


def test_first_matching_rule_wins_and_embed_is_never_quantized():
    r = QuantRecipe(rules=(("layers.2.*", "bf16"), ("*.experts.*", "w4a4_nvfp4"),
                           ("*", "w8a8_fp8")))
    assert r.mode_for("layers.2.mlp.experts.down") == "bf16"
    assert r.mode_for("layers.1.mlp.experts.down") == "w4a4_nvfp4"
    assert r.mode_for("lm_head") == "w8a8_fp8"
    assert r.mode_for("embed") == "bf16"


def test_registry():
    assert {"bf16", "trainer_qat", "rollout_quads", "rollout_fp8"} <= set(recipe_names())
    assert get_recipe("rollout_quads", rac_ratio=0.25).rac_ratio == 0.25
    with pytest.raises(ValueError, match="unknown"):
        get_recipe("w2a2")
    with pytest.raises(ValueError, match="already registered"):
        register_recipe("bf16", QuantRecipe)


@pytest.mark.parametrize("kwargs,field", [
    (dict(rules=(("*", "int4"),)), "rules"),
    (dict(default_mode="fp4"), "default_mode"),
    (dict(rac_ratio=0.0), "rac_ratio"),
    (dict(rac_ratio=1.5), "rac_ratio"),
    (dict(rac_energy_target=2.0), "rac_energy_target"),
    (dict(rac_selection="random"), "rac_selection"),
    (dict(rac_score="l3"), "rac_score"),
    (dict(rac_residual_scale="x"), "rac_residual_scale"),
    (dict(rac_residual_format="fp8"), "rac_residual_format"),
    (dict(act_scale_mode="per_channel"), "act_scale_mode"),
    (dict(backend="tpu"), "backend"),
    (dict(kv_quant="int8"), "kv_quant"),
    (dict(keep_first_n_bf16=-1), "keep_first_n_bf16"),
    (dict(keep_last_n_bf16=2), "keep_last_n_bf16"),
])
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"QuantRecipe.{field}"):
        QuantRecipe(**kwargs)
