"""Static RAC / activation-scale calibration at weight sync (QUADS_SPEC sections 4 and 5).

A rollout recipe with ``rac_selection="static"`` or ``act_scale_mode="static"`` fixes, per
layer (and per expert), the RAC block set and / or the activation global scale once per weight
sync instead of computing them from every batch. ``calibrate`` runs the model on a calibration
batch with the recipe's *online* counterpart (``online_batch`` selection, ``per_token`` scales:
the activations the deployed rollout would see, before anything static exists), collects every
W4A4 site's matmul input (``models.collect_site_inputs``) and scores it exactly as the online
mode does (``rac.calibrate_blocks``, ``rac.calibrate_act_scale``).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from quads_jax import models
from quads_jax.quant import ops, rac
from quads_jax.quant.recipe import QuantRecipe

W4A4_MODES = ("w4a4_nvfp4", "w4a4_nvfp4_rac")


def needs_calibration(recipe: QuantRecipe) -> bool:
    return recipe.rac_selection == "static" or recipe.act_scale_mode == "static"


def online_counterpart(recipe: QuantRecipe) -> QuantRecipe:
    """The recipe with its static choices replaced by their online defaults."""
    return recipe.replace(
        rac_selection="online_batch" if recipe.rac_selection == "static" else recipe.rac_selection,
        act_scale_mode="per_token" if recipe.act_scale_mode == "static" else recipe.act_scale_mode,
    )


def calibrated_sites(recipe: QuantRecipe, model_config) -> tuple[str, ...]:
    """Matmul sites of a W4A4 mode (the ones static calibration applies to)."""
    sites = [s for i in range(model_config.num_hidden_layers)
             for s in models.layer_matmul_sites(model_config, i)] + ["lm_head"]
    return tuple(s for s in sites if recipe.mode_for(s) in W4A4_MODES)


@functools.partial(jax.jit, static_argnames=("model_config", "recipe", "sites"))
def _calibrate(params, tokens, *, model_config, recipe, sites):
    online = online_counterpart(recipe)
    _, inputs = models.collect_site_inputs(model_config, params, tokens, recipe=online)
    out = {}
    for site in sites:
        x, group_sizes = inputs[site]
        experts = None if group_sizes is None else group_sizes.shape[0]
        row_expert = None if group_sizes is None else ops.expert_of_rows(group_sizes,
                                                                          x.shape[0])
        blocks = scale = None
        if recipe.rac_selection == "static" and recipe.mode_for(site) == "w4a4_nvfp4_rac":
            blocks = rac.calibrate_blocks(x, online, row_expert=row_expert,
                                          num_experts=experts)
        if recipe.act_scale_mode == "static":
            scale = rac.calibrate_act_scale(x, row_expert=row_expert, num_experts=experts)
        out[site] = (blocks, scale)
    return out


def calibrate(params: dict, recipe: QuantRecipe, *, model_config, tokens) -> dict:
    """Static calibration of every W4A4 site from a calibration batch.

    Args:
      params: the master tree.
      recipe: the rollout recipe (with a static RAC selection and / or activation scale).
      tokens: int ``[B, T]`` calibration token ids, every one real (no padding: padded rows
        would be scored with the rest, since expert inputs are sorted by expert).

    Returns:
      ``{site: (rac_blocks bool [K/16] | [E, K/16] or None, act_global_scale f32 [] | [E] or
      None)}`` for every W4A4 site.
    """
    shape = tuple(np.shape(tokens))
    if len(shape) != 2 or 0 in shape or not np.issubdtype(np.asarray(tokens).dtype, np.integer):
        raise ValueError(f"calibration_tokens: expected integer token ids [batch, length] with "
                         f"batch, length >= 1, got shape {shape}")
    return _calibrate(params, tokens, model_config=model_config, recipe=recipe,
                      sites=calibrated_sites(recipe, model_config))
