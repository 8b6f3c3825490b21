"""Checkpoints: 4 steps straight == 2 + save + resume + 2; a cut-off checkpoint is ignored."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax.rl.grpo import GRPOConfig
from quads_jax.train.checkpoint import CheckpointConfig, Checkpointer
from quads_jax.train.state import OptimizerConfig, create_train_state, make_optimizer, split_rng
from quads_jax.train.step import make_update_fn, rl_loss_fn, split_minibatches


def _run(toy, state, update, steps, start):
    metrics = []
    for s in range(start, start + steps):
        state, key = split_rng(state)
        # the batch depends on the RNG and the data position: both must resume exactly
        noise = jax.random.normal(key, (8,))
        batch = jax.tree.map(jnp.asarray, toy.rl_batch(seed=s))
        batch["advantages"] = batch["advantages"] + noise
        state, m = update(state, split_minibatches(batch, 2))
        metrics.append(float(m["train/loss"]))
    return state, metrics


def test_resume_continues_exactly(toy, tmp_path):
    opt = make_optimizer(OptimizerConfig(lr=1e-2), 10)
    update = jax.jit(make_update_fn(rl_loss_fn(toy.apply, GRPOConfig(num_generations=2)), opt))
    straight, m_straight = _run(toy, create_train_state(toy.params(), opt, 7), update, 4, 0)

    first, m_first = _run(toy, create_train_state(toy.params(), opt, 7), update, 2, 0)
    ck = Checkpointer(str(tmp_path / "ck"), CheckpointConfig(async_save=True))
    ck.save(2, first, {"data_position": 2})
    ck.close()

    ck2 = Checkpointer(str(tmp_path / "ck"), CheckpointConfig())
    fresh = create_train_state(toy.params(seed=99), opt, 0)  # different values, same structure
    assert ck2.latest_step() == 2
    restored, meta = ck2.restore(2, fresh)
    assert meta["data_position"] == 2 and meta["complete"]
    resumed, m_resumed = _run(toy, restored, update, 2, meta["data_position"])
    ck2.close()

    assert m_first + m_resumed == m_straight
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cut_off_checkpoint_is_never_latest(toy, tmp_path):
    opt = make_optimizer(OptimizerConfig(), 10)
    state = create_train_state(toy.params(), opt, 0)
    root = tmp_path / "ck"
    ck = Checkpointer(str(root), CheckpointConfig(keep=5))
    ck.save(1, state, {"data_position": 1})
    ck.wait()
    # a later step whose copy was cut off: state written, commit markers / meta missing
    shutil.copytree(root / "1", root / "2")
    os.remove(root / "2" / "commit_success.txt")
    # another one where the meta item is truncated mid-write
    shutil.copytree(root / "1", root / "3")
    (root / "3" / "meta" / "metadata").write_text('{"complete": tr')
    # and an Orbax temporary folder that never got renamed
    shutil.copytree(root / "1", root / "4.orbax-checkpoint-tmp-1234")
    assert ck.latest_step() == 1
    restored, meta = ck.restore(ck.latest_step(), state)
    assert meta["data_position"] == 1
    ck.close()
