"""Static calibration for the rollout recipe: RAC block sets and activation global scales
per layer (and per expert) from a calibration batch (QUADS_SPEC sections 4 and 5).

The weight sync calls ``calibrate_static`` with the master tree and a few prompts; the result
is the master tree (layer groups split per the recipe) whose W4A4 leaves are wrapped in
``rac.CalibratedWeight``. Packing the wrapped weights to NVFP4 afterwards keeps the wrapper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quads_jax.models.config import ModelConfig
from quads_jax.models.transformer import collect_site_inputs, param_sites, split_layer_groups
from quads_jax.quant import ops, rac
from quads_jax.quant.recipe import QuantRecipe

W4A4_MODES = ("w4a4_nvfp4", "w4a4_nvfp4_rac")


def _online(recipe: QuantRecipe) -> QuantRecipe:
    """The recipe with online choices, to run the calibration forward itself."""
    return recipe.replace(
        rac_selection="online_batch" if recipe.rac_selection == "static" else recipe.rac_selection,
        act_scale_mode="per_batch" if recipe.act_scale_mode == "static" else recipe.act_scale_mode,
    )


def calibrate_static(
    config: ModelConfig,
    params: dict,
    tokens: jax.Array,
    *,
    recipe: QuantRecipe,
    attention_mask: jax.Array | None = None,
) -> dict:
    """Wrap every W4A4 leaf of ``params`` in a ``rac.CalibratedWeight`` with the static RAC
    blocks (``rac_selection="static"``: bool ``[n, (E,) K/16]``) and/or the static activation
    decode scale (``act_scale_mode="static"``: f32 ``[n, (E)]``) chosen on ``tokens [B, T]``.

    The calibration forward runs the recipe with online choices (online_batch / per_batch).
    Padding tokens take part in the statistics: calibrate on unpadded prompts where possible.
    """
    want_blocks = recipe.rac_selection == "static"
    want_scale = recipe.act_scale_mode == "static"
    split = split_layer_groups(config, params, recipe)
    if not (want_blocks or want_scale):
        return split
    collect = jax.jit(collect_site_inputs, static_argnums=0, static_argnames="recipe")
    _, inputs = collect(config, params, tokens, attention_mask=attention_mask,
                        recipe=_online(recipe))
    sites = param_sites(config, split)

    def calibrate(leaf, leaf_sites):
        if not isinstance(leaf_sites, tuple) or recipe.mode_for(leaf_sites[0]) not in W4A4_MODES:
            return leaf
        blocks, scales = [], []
        for site in leaf_sites:
            x, gs = inputs[site]
            kw = {}
            if gs is not None:
                kw = dict(row_expert=ops.expert_of_rows(gs, x.shape[0]), num_experts=gs.shape[0])
            if want_blocks and recipe.mode_for(site) == "w4a4_nvfp4_rac":
                blocks.append(rac.calibrate_blocks(x, recipe, **kw))
            if want_scale:
                scales.append(rac.calibrate_act_scale(x, **kw))
        return rac.CalibratedWeight(
            leaf,
            rac_blocks=jnp.stack(blocks) if blocks else None,
            act_global_scale=jnp.stack(scales) if scales else None,
        )

    layers = [jax.tree.map(calibrate, g, s, is_leaf=lambda x: hasattr(x, "shape"))
              for g, s in zip(split["layers"], sites["layers"], strict=True)]
    return dict(split, layers=layers)
