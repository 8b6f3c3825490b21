"""The data-parallel rollout (``sampler.sharding``) on 8 fake CPU devices: under a mesh the
decode state's rows are split over the batch axes, and the rollout equals the unsharded one."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quads_jax import models
from quads_jax.quant import kernel_backend
from quads_jax.quant.recipe import QuantRecipe
from quads_jax.sampler import engine
from quads_jax.sampler.engine import SamplerConfig
from quads_jax.testing import tiny_config
from quads_jax.train import mesh as mesh_lib

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [19, 20, 21, 22]] * 2  # 8 prompts
CFG = tiny_config(dtype="float32", num_hidden_layers=2, mlp_only_layers=())


@pytest.fixture(scope="module")
def params():
    return models.init_params(CFG, jax.random.key(0))


def _generate(params, recipe, mesh=None):
    tokens, mask = engine.left_pad(PROMPTS)
    # a bf16 cache of >= 16 slots: what the decode attention kernel takes
    sc = SamplerConfig(max_new_tokens=12, n_samples=2, temperature=1.0,
                       kv_cache_dtype="bfloat16")
    run = lambda: engine.generate(params, tokens, jax.random.key(3), sc,  # noqa: E731
                                  model_config=CFG, recipe=recipe, prompt_mask=mask)
    if mesh is None:
        return run(), None
    with jax.set_mesh(mesh):
        out = run()
        lowered = engine._generate_jit.lower(
            params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(3), config=sc,
            model_config=CFG, recipe=recipe)
    return out, (lowered.as_text(), lowered.compile().as_text())


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_rollout_rows_split_over_the_batch_axes(params, backend):
    """16 rows (8 prompts x 2 samples) over data x fsdp = 8 devices: each device's cache holds
    2 rows (without the constraints, nothing here splits them: no expert axis, so no MoE
    shard_map), and the sampled tokens and log-probs are the unsharded rollout's.
    "interpret" runs the decode attention kernel (Pallas interpret mode) in its shard_map."""
    recipe = QuantRecipe(backend=backend)
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=4))
    # The Mosaic GPU interpreter cannot run on several fake devices at once (its simulated
    # shared memory is process-global): the experts' bf16 grouped kernel stays off here.
    kernel_backend.set_bf16_grouped(False)
    try:
        want, _ = _generate(params, recipe)
        got, (stablehlo, hlo) = _generate(params, recipe, mesh)
    finally:
        kernel_backend.set_bf16_grouped(True)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    # XLA:CPU blocks a 2-row matmul differently from a 16-row one: f32 sums in another
    # order, and a bf16 cache (and the kernel's bf16 dots) round some of those apart.
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-3)
    # The cache [L, R, KVH, S, D] per device: 2 of the 16 rows.
    kvh, d, layers = CFG.num_key_value_heads, CFG.head_dim, CFG.num_hidden_layers
    local = re.findall(rf"bf16\[{layers},2,{kvh},\d+,{d}\]", hlo)
    full = re.findall(rf"bf16\[{layers},16,{kvh},\d+,{d}\]", hlo)
    assert local and not full, (len(local), len(full))
    # The decode attention kernel in a shard_map of its own (the jnp path needs none).
    assert ("manual_computation" in stablehlo) == (backend == "interpret")


def test_continuous_batching_under_a_mesh_equals_unsharded(params):
    """Continuous batching (8 decode rows for 16 responses: refills, row gathers, the slots'
    rebuild) with its rows split over 8 devices gives the unsharded run's greedy tokens."""
    from quads_jax.sampler.continuous import generate_continuous

    tokens, mask = engine.left_pad(PROMPTS)
    sc = SamplerConfig(max_new_tokens=5, greedy=True, n_samples=2)

    def run():
        return generate_continuous(params, tokens, jax.random.key(4), sc, model_config=CFG,
                                   prompt_mask=mask, batch_rows=8, segment_steps=2)

    want, _ = run()
    with jax.set_mesh(mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=4))):
        got, segments = run()
    assert len(segments) > 1  # rows were refilled
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-4)
