"""Layer-wise NVFP4 error analysis on a fixed probe batch (QUADS_SPEC section 7).

The probe batch (held-out prompts) runs through the model once with the trainer recipe and
once with the rollout recipe, recording the input of every matmul site
(``models.collect_site_inputs``). For every routed-expert ``gate_up`` weight ``W [N, K]`` of
every MoE layer (experts that received probe rows, at most ``max_experts`` per layer) and its
real trainer-side input rows ``X [m, K]``, relative Frobenius errors against ``Y = X W^T``:

* ``analysis/weight_only_err``   ``|X qdq(W)^T - Y| / |Y|``
* ``analysis/act_only_err``      ``|dq(Q(X)) W^T - Y| / |Y|``
* ``analysis/w4a4_err``          ``|dq(Q(X)) qdq(W)^T - Y| / |Y|``
* ``analysis/w4a4_rac_err``      the same with the RAC residual ``dq(Q(R_S))`` added to the
  activations (selection, score and ratio of the rollout recipe)
* ``analysis/rac_captured_energy`` ``|R_S|^2 / |R|^2``
* ``analysis/rac_block_fraction`` the fraction of the K-blocks of the expert's real rows that
  RAC compensates: the ratio itself for a fixed count, fewer blocks where the adaptive variant
  (``rac_energy_target``) reaches its energy first. Measured on the probe's rows per expert (a
  prefill-sized batch); a decode step selects over its own few rows per expert.
* ``analysis/act_ftz_rate``      fraction of non-zero activations that quantize to 0

and, on the token-aligned inputs of each layer's ``q_proj`` (expert rows are sorted by the
routing, which itself differs between the two engines):

* ``analysis/act_bin_flip_rate`` fraction of E2M1 activation codes that differ between the
  trainer's and the rollout's input of the same site (the spec's diagnosis: small upstream
  differences flip whole bins).

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax import models
from quads_jax.quant import metrics as qmetrics
from quads_jax.quant import nvfp4, ops, rac
from quads_jax.sampler import left_pad


def probe_batch(
    tokenizer: Any, examples: Sequence[Any], max_prompts: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """The fixed probe: BOS + prompt (+ demonstration when known) of the first held-out
    examples, left-padded: ``(tokens int32 [B, P], mask bool [B, P])``."""
    rows = [tokenizer.encode(ex.prompt + ex.demonstration, add_bos=True)
            for ex in examples[:max_prompts]]
    return left_pad(rows, tokenizer.pad_id)


def _gemm_errors(x: jax.Array, w: jax.Array, recipe, n_rows: jax.Array) -> dict[str, jax.Array]:
    """Error metrics of one expert GEMM: ``x [m, K]`` f32 input rows, the first ``n_rows``
    real and the rest zero, ``w [N, K]``."""
    w = w.astype(jnp.float32)
    y = x @ w.T
    wq = nvfp4.qdq(w)
    qx = ops.act_quantize(x, recipe)
    xq = nvfp4.dequantize(qx, jnp.float32)
    # The rollout's own residual construction (selection and residual scale per the recipe).
    sel = rac.select_residual(x, qx, recipe, act_scale_mode=recipe.act_scale_mode)
    r, mask = sel.r, sel.mask
    rq = nvfp4.dequantize(sel.codes(), jnp.float32)
    # mask [m, K/16]: count the real rows only (a zero row still gets its ratio's blocks)
    real = jnp.arange(x.shape[0])[:, None] < n_rows
    return {
        "analysis/weight_only_err": qmetrics.rel_fro_error(y, x @ wq.T),
        "analysis/act_only_err": qmetrics.rel_fro_error(y, xq @ w.T),
        "analysis/w4a4_err": qmetrics.rel_fro_error(y, xq @ wq.T),
        "analysis/w4a4_rac_err": qmetrics.rel_fro_error(y, (xq + rq) @ wq.T),
        "analysis/rac_captured_energy": rac.captured_energy(r, mask),
        "analysis/rac_block_fraction": (jnp.sum(mask & real, dtype=jnp.float32)
                                        / (jnp.maximum(n_rows, 1) * mask.shape[-1])),
        "analysis/act_ftz_rate": qmetrics.flush_to_zero_rate(x, xq),
    }


def _flip_rate(x_trainer: jax.Array, x_rollout: jax.Array, recipe) -> jax.Array:
    a = ops.act_quantize(x_trainer, recipe).codes
    b = ops.act_quantize(x_rollout, recipe).codes
    return jnp.mean((a != b).astype(jnp.float32))


def _layer_weights(model_config: Any, params: dict, layer: int) -> dict:
    for g, (_, start, stop) in enumerate(model_config.layer_groups):
        if start <= layer < stop:
            return jax.tree.map(lambda x, i=layer - start: x[i], params["layers"][g])
    raise ValueError(f"layer={layer} is outside the model's {model_config.num_hidden_layers}")


def layer_error_analysis(
    params: dict,
    model_config: Any,
    trainer_recipe: Any,
    rollout_recipe: Any,
    probe: tuple[np.ndarray, np.ndarray],
    max_experts: int = 8,
) -> dict[str, float]:
    """Mean of each ``analysis/*`` metric over MoE layers and experts (module docstring).

    Args:
      params: master params; probe: ``(tokens int32 [B, P], mask bool [B, P])``.

    A rollout recipe with a static RAC selection or activation scale is analyzed as its
    online counterpart (``calibration.online_counterpart``: each GEMM's own batch, what the
    calibration scores): the master params carry no calibration.
    """
    from quads_jax.sampler.calibration import online_counterpart

    rollout_recipe = online_counterpart(rollout_recipe)
    tokens, mask = (jnp.asarray(a) for a in probe)
    real = np.asarray(mask).reshape(-1)
    collect = jax.jit(models.collect_site_inputs, static_argnums=0, static_argnames="recipe")
    _, trainer_in = collect(model_config, params, tokens, attention_mask=mask,
                            recipe=trainer_recipe)
    _, rollout_in = collect(model_config, params, tokens, attention_mask=mask,
                            recipe=rollout_recipe)
    errors = jax.jit(_gemm_errors, static_argnums=2)
    rows: list[dict[str, jax.Array]] = []
    flips = []
    for site, (x, group_sizes) in trainer_in.items():
        layer = int(site.split(".")[1]) if site.startswith("layers.") else -1
        if site.endswith("attn.q_proj"):
            xt = x.reshape(-1, x.shape[-1])[real].astype(jnp.float32)
            xr = rollout_in[site][0].reshape(-1, x.shape[-1])[real].astype(jnp.float32)
            flips.append(jax.jit(_flip_rate, static_argnums=2)(xt, xr, rollout_recipe))
        if not site.endswith("experts.gate_up") or group_sizes is None:
            continue
        w = _layer_weights(model_config, params, layer)["mlp"]["experts"]["gate_up"]
        sizes = np.asarray(group_sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        x = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
        for e in [int(i) for i in np.argsort(-sizes)[:max_experts] if sizes[i] > 0]:
            # zero-pad every expert's rows to one height: one compiled program for all experts;
            # zero rows add nothing to any metric (errors, energies, FTZ count only non-zeros).
            padded = np.zeros_like(x)
            padded[: sizes[e]] = x[offsets[e]:offsets[e + 1]]
            rows.append(errors(jnp.asarray(padded), w[e], rollout_recipe,
                               jnp.int32(sizes[e])))
    out = {}
    if rows:
        rows = jax.device_get(rows)
        out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    if flips:
        out["analysis/act_bin_flip_rate"] = float(np.mean(jax.device_get(flips)))
    return out
