"""Train step: it learns, sharded == 1 device on several meshes, non-finite updates skipped."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quads_jax.rl.grpo import GRPOConfig
from quads_jax.train import mesh as mesh_lib
from quads_jax.train.state import (
    OptimizerConfig,
    create_train_state,
    make_optimizer,
    train_state_shardings,
)
from quads_jax.train.step import (
    jit_sharded,
    make_update_fn,
    rl_loss_fn,
    sft_loss_fn,
    split_minibatches,
)

OPT = OptimizerConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0)


def _setup(toy, loss="rl"):
    opt = make_optimizer(OPT, 10)
    fn = rl_loss_fn(toy.apply, GRPOConfig(num_generations=2)) if loss == "rl" else \
        sft_loss_fn(toy.apply)
    return opt, make_update_fn(fn, opt)


def test_sft_update_lowers_loss(toy):
    opt, update = _setup(toy, "sft")
    state = create_train_state(toy.params(), opt, seed=0)
    batch = split_minibatches(jax.tree.map(jnp.asarray, toy.rl_batch()), 2)
    update = jax.jit(update)
    losses = []
    for _ in range(15):
        state, m = update(state, batch)
        losses.append(float(m["sft/loss"]))
    assert losses[-1] < 0.7 * losses[0]
    assert int(state.step) == 30


@pytest.mark.parametrize(
    "shape,rules",
    [
        (dict(data=8, fsdp=1), "fsdp"),
        (dict(data=1, fsdp=8), "fsdp"),
        (dict(data=2, fsdp=2, expert=2), "fsdp"),
        (dict(data=1, fsdp=2, expert=2, tensor=2), "tp"),
    ],
)
def test_sharded_step_equals_one_device(toy, shape, rules):
    opt, update = _setup(toy)
    batch = split_minibatches(jax.tree.map(jnp.asarray, toy.rl_batch(b=16)), 2)
    ref_state, ref_m = jax.jit(update)(create_train_state(toy.params(), opt, 0), batch)

    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(rules=rules, **shape))
    state = create_train_state(toy.params(), opt, 0)
    st_sh = train_state_shardings(state, mesh, rules, toy.config)
    b_sh = jax.tree.map(
        lambda x: jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(
                None, *mesh_lib.batch_sharding(mesh, x.shape[1:], rules).spec)), batch)
    state = jax.device_put(state, st_sh)
    # the experts leaf is really split over the expert axis when the mesh has one
    if shape.get("expert", 1) > 1:
        spec = state.params["experts"]["up"].sharding.spec
        assert spec[0] == "expert", spec
    step = jit_sharded(update, st_sh, b_sh, mesh)
    state, m = step(state, jax.device_put(batch, b_sh))
    np.testing.assert_allclose(float(m["train/loss"]), float(ref_m["train/loss"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def test_nonfinite_update_is_skipped_and_counted(toy):
    opt, update = _setup(toy)
    state = create_train_state(toy.params(), opt, 0)
    batch = jax.tree.map(jnp.asarray, toy.rl_batch())
    bad = dict(batch, advantages=batch["advantages"].at[0].set(jnp.nan))
    both = split_minibatches(jax.tree.map(lambda a, b: jnp.concatenate([a, b]), bad, batch), 2)
    new, m = jax.jit(update)(state, both)
    assert float(m["train/skipped"]) == 1 and int(new.step) == 1
    assert int(new.nonfinite_streak) == 0 and int(new.nonfinite_total) == 1  # second one was ok
    only_bad = split_minibatches(jax.tree.map(lambda a: jnp.concatenate([a, a]), bad), 2)
    new2, m2 = jax.jit(update)(state, only_bad)
    assert int(new2.nonfinite_streak) == 2 and int(new2.step) == 0
    for a, b in zip(jax.tree.leaves(new2.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mesh_config_errors():
    with pytest.raises(ValueError, match="MeshConfig.fsdp"):
        mesh_lib.MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="product 3 != 8"):
        mesh_lib.MeshConfig(data=3, fsdp=1).axis_sizes(8)
    with pytest.raises(ValueError, match="MeshConfig.rules"):
        mesh_lib.MeshConfig(rules="zz")
    with pytest.raises(ValueError, match="MeshConfig.num_devices=0"):
        mesh_lib.MeshConfig(num_devices=0)
    with pytest.raises(ValueError, match=r"num_devices=9: only 8 cpu device\(s\) here; need 1-8"):
        mesh_lib.make_mesh(mesh_lib.MeshConfig(num_devices=9))
    # the first num_devices devices; -1 in an axis resolves against them
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=-1, num_devices=4))
    assert mesh.shape == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 1}
    assert list(mesh.devices.flat) == jax.devices()[:4]


def test_spec_drops_axes_that_do_not_divide():
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=4, tensor=2))
    spec = mesh_lib.spec_for(("embed", "mlp"), (12, 6), mesh, "fsdp")
    assert spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    spec = mesh_lib.spec_for(("embed", "mlp"), (6, 5), mesh, "fsdp")
    assert spec == jax.sharding.PartitionSpec(None, None)


def test_batch_axes_dividing_and_device_memory_metrics():
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, expert=2))
    assert mesh_lib.batch_axes_dividing(mesh, 16) == ("data", "fsdp", "expert")
    assert mesh_lib.batch_axes_dividing(mesh, 6) == ("data",)  # fsdp would need 4 | 6
    assert mesh_lib.batch_axes_dividing(mesh, 3) == ()
    assert mesh_lib.device_memory_metrics() == {}  # CPU devices report no memory

    class Gpu:  # what a GPU's Device.memory_stats reports (the keys used)
        def __init__(self, peak, in_use):
            self.stats = {"peak_bytes_in_use": peak * 2**30, "bytes_in_use": in_use * 2**30}

        def memory_stats(self):
            return self.stats

    got = mesh_lib.device_memory_metrics([Gpu(3.0, 1.0), Gpu(5.0, 2.5)])
    assert got == {"mem/peak_gib_max": 5.0, "mem/peak_gib_min": 3.0, "mem/in_use_gib_max": 2.5}


@pytest.mark.slow
@pytest.mark.parametrize("in_mesh", [False, True])
def test_sharded_step_real_moe_expert_parallel(in_mesh, monkeypatch):
    """The real tiny Qwen3-MoE with the QAT trainer recipe: data x fsdp x expert == 1 device,
    by XLA's partitioner alone or (``in_mesh``, as the RL loop runs) with the MoE blocks in
    the expert-parallel ``shard_map``."""
    import contextlib

    from quads_jax import models
    from quads_jax.quant.recipe import get_recipe
    from quads_jax.testing import tiny_config
    from quads_jax.train.loop import make_apply_fn

    mc = tiny_config(dtype="float32", num_hidden_layers=2)
    params = models.init_params(mc, jax.random.key(0))
    opt = make_optimizer(OPT, 10)
    update = make_update_fn(rl_loss_fn(make_apply_fn(mc, get_recipe("trainer_qat")),
                                       GRPOConfig(num_generations=2)), opt)
    rng = np.random.default_rng(0)
    b, t = 16, 8
    lp = -rng.uniform(0.5, 3, (b, t)).astype(np.float32)
    mask = np.zeros((b, t), np.float32)
    mask[:, 4:] = 1
    batch = split_minibatches({
        "tokens": rng.integers(3, mc.vocab_size, (b, t)).astype(np.int32),
        "attention_mask": np.ones((b, t), bool), "mask": mask, "logp_old": lp,
        "logp_rollout": lp + 0.05, "advantages": rng.normal(size=b).astype(np.float32)}, 2)
    ref, ref_m = jax.jit(update)(create_train_state(params, opt, 0), batch)

    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, expert=2))
    state = create_train_state(params, opt, 0)
    sh = train_state_shardings(state, mesh, "fsdp", mc)
    assert sh.params["layers"][0]["mlp"]["experts"]["gate_up"].spec[1] == "expert"
    b_sh = jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        None, *mesh_lib.batch_sharding(mesh, x.shape[1:], "fsdp").spec)), batch)
    from quads_jax.models import moe

    calls = []
    traced = moe.expert_parallel
    monkeypatch.setattr(moe, "expert_parallel", lambda *a: calls.append(1) or traced(*a))
    with jax.set_mesh(mesh) if in_mesh else contextlib.nullcontext():
        out, m = jit_sharded(update, sh, b_sh, mesh)(jax.device_put(state, sh),
                                                      jax.device_put(batch, b_sh))
    assert bool(calls) == in_mesh
    np.testing.assert_allclose(float(m["train/loss"]), float(ref_m["train/loss"]), rtol=1e-5)
    # Adam turns f32 reduction-order noise of near-zero gradients into visible update noise;
    # 1e-4 is 1% of one update at lr 1e-2, far below any real sharding bug (a whole update).
    for a, b_ in zip(jax.tree.leaves(out.params), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=2e-5, atol=1e-4)
