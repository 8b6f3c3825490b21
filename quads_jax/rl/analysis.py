"""Layer-wise NVFP4 error analysis on a fixed probe batch (QUADS_SPEC section 7).

For every routed-expert ``gate_up`` weight ``W [N, K]`` (all MoE layers, up to ``max_experts``
experts each) and probe activations ``X [M, K]``, relative Frobenius errors against
``Y = X W^T`` (f32):

* ``analysis/weight_only_err``   ``|X qdq(W)^T - Y| / |Y|``
* ``analysis/act_only_err``      ``|dq(Q(X)) W^T - Y| / |Y|``
* ``analysis/w4a4_err``          ``|dq(Q(X)) qdq(W)^T - Y| / |Y|``
* ``analysis/w4a4_rac_err``      the same with the RAC residual ``dq(Q(R_S))`` added to the
  activations (selection, score and ratio of the rollout recipe)
* ``analysis/rac_captured_energy`` ``|R_S|^2 / |R|^2``
* ``analysis/act_ftz_rate``      fraction of non-zero activations that quantize to 0
* ``analysis/act_bin_flip_rate`` fraction of activation E2M1 codes that differ between the
  trainer's input (f32 arithmetic) and the same input recomputed in bf16 arithmetic, the way a
  second engine recomputes it online (the spec's diagnosis: tiny differences, whole-bin flips)

Probe activations: the exact input of layer 0's projections, ``rms_norm(embed[tokens])`` with
layer 0's ``input_norm`` over the real tokens of held-out prompts. Deeper layers see different
activations; using one probe for all keeps the numbers comparable across steps and arms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax.quant import metrics as qmetrics
from quads_jax.quant import nvfp4, ops, rac


def probe_batch(tokenizer: Any, examples: Sequence[Any], max_prompts: int = 16) -> np.ndarray:
    """Token ids of the probe prompts, concatenated: int32 ``[M]`` (real tokens only)."""
    ids = [i for ex in examples[:max_prompts] for i in tokenizer.encode(ex.prompt, add_bos=True)]
    return np.asarray(ids, np.int32)


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + jnp.asarray(eps, x.dtype)) * w.astype(x.dtype)


def _probe_activations(params: dict, model_config: Any, tokens: np.ndarray, dtype) -> jax.Array:
    emb = params["embed"][tokens].astype(dtype)
    norm = params["layers"][0]["input_norm"][0]
    return _rms_norm(emb, norm, model_config.rms_norm_eps).astype(jnp.float32)


def _rel(y, y_hat):
    return qmetrics.rel_fro_error(y, y_hat)


def _gemm_errors(x: jax.Array, x_other: jax.Array, w: jax.Array, recipe) -> dict[str, jax.Array]:
    w = w.astype(jnp.float32)
    y = x @ w.T
    wq = nvfp4.qdq(w)
    qx = ops.act_quantize(x, recipe)
    xq = nvfp4.dequantize(qx, jnp.float32)
    r = x - xq
    mask = rac.block_mask(x, r, recipe)
    r_s = rac.masked_residual(r, mask)
    rq = nvfp4.dequantize(ops.act_quantize(r_s, recipe), jnp.float32)
    codes = nvfp4.unpack_codes(qx.packed)
    codes_other = nvfp4.unpack_codes(ops.act_quantize(x_other, recipe).packed)
    return {
        "analysis/weight_only_err": _rel(y, x @ wq.T),
        "analysis/act_only_err": _rel(y, xq @ w.T),
        "analysis/w4a4_err": _rel(y, xq @ wq.T),
        "analysis/w4a4_rac_err": _rel(y, (xq + rq) @ wq.T),
        "analysis/rac_captured_energy": rac.captured_energy(r, mask),
        "analysis/act_ftz_rate": qmetrics.flush_to_zero_rate(x, xq),
        "analysis/act_bin_flip_rate": jnp.mean((codes != codes_other).astype(jnp.float32)),
    }


def layer_error_analysis(
    params: dict, model_config: Any, recipe: Any, probe_tokens: np.ndarray, max_experts: int = 8
) -> dict[str, float]:
    """Mean of each ``analysis/*`` metric over MoE layers and experts (see module docstring)."""
    x = _probe_activations(params, model_config, probe_tokens, jnp.float32)
    x_other = _probe_activations(params, model_config, probe_tokens, jnp.bfloat16)
    rows: list[dict[str, jax.Array]] = []
    errors = jax.jit(_gemm_errors, static_argnums=3)
    for group in params["layers"]:
        experts = group.get("mlp", {}).get("experts")
        if experts is None:
            continue
        w = experts["gate_up"]  # [n_layers_in_group, E, 2I, D]
        for layer in range(w.shape[0]):
            for e in range(min(w.shape[1], max_experts)):
                rows.append(errors(x, x_other, w[layer, e], recipe))
    if not rows:
        return {}
    rows = jax.device_get(rows)
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
