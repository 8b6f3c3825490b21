"""Expert parallelism of the MoE block on 8 fake CPU devices: under a mesh whose ``expert``
axis divides E, each device multiplies only its own experts, and the block equals the
unsharded one (reference path and the trainer's fake-quant, with gradients).

Not run here: the Mosaic GPU kernels under it. The wrapper only relies on the grouped
matmul's contract (rows past the groups come out zero), which the kernels' own tests check,
but the GPU interpreter cannot run on several fake devices at once (its simulated shared
memory is process-global) and no multi-GPU machine was lent to run it for real. That the
kernels lower for cuda inside the shard_map, on the local experts' shapes, is tested in
``tests/pallas_kernels/test_w4a4_kernels_lower_cuda.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quads_jax import models
from quads_jax.models import init_params
from quads_jax.models.moe import expert_parallel_size, moe_block
from quads_jax.quant.recipe import QuantRecipe, get_recipe
from quads_jax.testing import tiny_config
from quads_jax.train import mesh as mesh_lib

CFG = tiny_config(dtype="float32")


@pytest.fixture(scope="module")
def moe_params():
    params = init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda x: x[0], params["layers"][0]["mlp"])


def _mesh(**sizes):
    return mesh_lib.make_mesh(mesh_lib.MeshConfig(**{"fsdp": 1, **sizes}))


def _block(p, x, recipe):
    return jax.jit(lambda p, x: moe_block(CFG, p, x, "layers.0.mlp", recipe))(p, x)


@pytest.mark.parametrize(
    "sizes,n",
    [
        (dict(data=2, expert=4), 16),  # tokens split over expert too: all-gather + reduce-scatter
        (dict(data=4, expert=2), 12),  # 12 tokens: data (4) divides them, expert needs a psum
        (dict(fsdp=2, expert=2, tensor=2), 5),  # 5 tokens: replicated, psum over expert
    ],
)
def test_expert_parallel_block_equals_unsharded(moe_params, sizes, n):
    x = jax.random.normal(jax.random.key(n), (n, 64), jnp.float32)
    recipe = QuantRecipe()
    want, want_routing = _block(moe_params, x, recipe)
    mesh = _mesh(**sizes)
    with jax.set_mesh(mesh):
        assert expert_parallel_size(CFG.num_experts) == mesh.shape["expert"]
        y, routing = _block(moe_params, x, recipe)
        hlo = jax.jit(lambda p, x: moe_block(CFG, p, x, "l.mlp", recipe)).lower(
            moe_params, x).as_text()
    # Inside the shard_map each device holds E / ep experts' gate_up [E_local, 2I, H]; the
    # partial sums are combined by a collective.
    e_local = CFG.num_experts // mesh.shape["expert"]
    assert f"tensor<{e_local}x64x64xf32>" in hlo
    assert any(c in hlo for c in ("all_reduce", "reduce_scatter"))
    np.testing.assert_array_equal(np.asarray(routing.expert_ids), np.asarray(want_routing.expert_ids))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(want).max()) > 1e-2


def test_expert_parallel_gradients_match(moe_params, monkeypatch):
    """Gradients in the params and the tokens, unsharded and expert-parallel (rotated sorted
    rows), against XLA's own gradient of the row gathers (``take_rows`` without its inverse:
    a scatter-add), so a wrong inverse map in the MoE block fails here."""
    x = jax.random.normal(jax.random.key(3), (8, 64), jnp.float32)
    recipe = get_recipe("trainer_qat")  # NVFP4 weight fake-quant on the experts
    loss = lambda p, x: jnp.sum(jnp.sin(moe_block(CFG, p, x, "layers.0.mlp", recipe)[0]))  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1))
    want = jax.jit(grad)(moe_params, x)
    with jax.set_mesh(_mesh(data=2, expert=4)):
        got = jax.jit(grad)(moe_params, x)
    from quads_jax.quant import ops

    monkeypatch.setattr(ops, "take_rows", lambda x, rows, inverse=None: x[rows])
    scatter = jax.jit(grad)(moe_params, x)
    for g in (got, want):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g,
                     scatter)
    assert float(jnp.abs(want[1]).max()) > 1e-3


def test_no_expert_parallelism_without_a_dividing_expert_axis():
    assert expert_parallel_size(8) == 1  # no mesh
    with jax.set_mesh(_mesh(data=8)):
        assert expert_parallel_size(8) == 1
    with jax.set_mesh(_mesh(expert=8)):
        assert expert_parallel_size(6) == 1 and expert_parallel_size(16) == 8


def test_site_inputs_are_recorded_unsplit_under_an_expert_parallel_mesh():
    """``collect_site_inputs`` (static calibration, the layer-wise analysis) under a mesh whose
    ``expert`` axis would split the MoE block: the block runs unsplit while recording, so the
    records are the global sorted rows (they leaked the shard_map's tracers before)."""
    params = models.init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(5), (4, 6), 3, CFG.vocab_size)
    collect = jax.jit(models.collect_site_inputs, static_argnums=0)
    _, want = collect(CFG, params, tokens)
    with jax.set_mesh(_mesh(data=2, expert=4)):
        _, got = collect(CFG, params, tokens)
    assert got.keys() == want.keys() and "layers.0.mlp.experts.gate_up" in got
    for site, (x, gs) in want.items():
        np.testing.assert_allclose(np.asarray(got[site][0]), np.asarray(x), rtol=1e-5,
                                   atol=1e-6)
        if gs is not None:
            np.testing.assert_array_equal(np.asarray(got[site][1]), np.asarray(gs))

