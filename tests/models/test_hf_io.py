"""HF checkpoint I/O without the oracle: sharded export, fused-expert import, mesh loading,
and the errors for bad checkpoints (missing / misshaped tensors, bad config.json)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from quads_jax.models import init_params, load_hf, save_hf
from quads_jax.models.hf import INDEX_FILE
from quads_jax.testing import tiny_config

CFG = tiny_config(dtype="float32")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    params = init_params(CFG, jax.random.key(1))
    path = str(tmp_path_factory.mktemp("ckpt") / "model")
    save_hf(CFG, params, path)
    return params, path


def _assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _copy_with(src, dst, edit_tensors=None, edit_config=None):
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if edit_config:
        edit_config(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_round_trip_and_sharded_export(exported, tmp_path):
    params, path = exported
    config, loaded = load_hf(path)
    assert config == CFG.replace(dtype=jnp.bfloat16)
    _assert_tree_equal(params, loaded)
    sharded = str(tmp_path / "sharded")
    save_hf(CFG, params, sharded, dtype=jnp.bfloat16, max_shard_bytes=40_000)
    files = sorted(os.listdir(sharded))
    assert INDEX_FILE in files and sum(f.endswith(".safetensors") for f in files) > 3
    config_b, loaded_b = load_hf(sharded)
    assert config_b.param_dtype == jnp.float32  # load casts to the configured dtype
    _assert_tree_equal(jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
                                    params), loaded_b)
    _, as_bf16 = load_hf(sharded, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(as_bf16))


def test_fused_expert_layout_is_read(exported, tmp_path):
    params, path = exported

    def fuse(t):
        for i in (0, 2, 3):
            pre = f"model.layers.{i}.mlp.experts."
            gu = [np.concatenate([t.pop(f"{pre}{e}.gate_proj.weight"),
                                  t.pop(f"{pre}{e}.up_proj.weight")]) for e in range(8)]
            t[pre + "gate_up_proj"] = np.stack(gu)
            t[pre + "down_proj"] = np.stack([t.pop(f"{pre}{e}.down_proj.weight") for e in range(8)])

    _, loaded = load_hf(_copy_with(path, str(tmp_path / "fused"), edit_tensors=fuse))
    _assert_tree_equal(params, loaded)


def test_load_onto_mesh_reads_shards(exported):
    params, path = exported
    mesh = jax.make_mesh((8,), ("expert",), devices=jax.devices()[:8])
    P = jax.sharding.PartitionSpec

    def shardings(leaf_path, shape):
        spec = P(None, "expert") if leaf_path[-2:-1] == ("experts",) else P()
        return jax.sharding.NamedSharding(mesh, spec)

    _, loaded = load_hf(path, mesh=mesh, shardings=shardings)
    gate_up = loaded["layers"][2]["mlp"]["experts"]["gate_up"]
    assert gate_up.sharding.spec == P(None, "expert")
    assert gate_up.addressable_shards[0].data.shape == (2, 1, 64, 64)
    _assert_tree_equal(params, loaded)
    _, replicated = load_hf(path, mesh=mesh)
    assert replicated["embed"].sharding.is_fully_replicated


def test_missing_and_misshaped_tensors(exported, tmp_path):
    _, path = exported
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    bad = _copy_with(path, str(tmp_path / "missing"), edit_tensors=lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is missing \(expected shape \[32, 64\]"):
        load_hf(bad)
    name = "model.layers.1.self_attn.k_proj.weight"

    def reshape(t):
        t[name] = t[name][:16]

    bad = _copy_with(path, str(tmp_path / "shape"), edit_tensors=reshape)
    with pytest.raises(ValueError, match=rf"'{name}' has shape \[16, 64\], expected \[32, 64\]"):
        load_hf(bad)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]), "not supported"),
    (lambda c: c.pop("hidden_size"), r"missing required field\(s\) \['hidden_size'\]"),
    (lambda c: c.update(num_key_value_heads=3), "ModelConfig.num_key_value_heads=3"),
    (lambda c: c.update(mlp_only_layers=[9]), "ModelConfig.mlp_only_layers"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type"),
])
def test_bad_config_json(exported, tmp_path, edit, match):
    _, path = exported
    with pytest.raises(ValueError, match=match):
        load_hf(_copy_with(path, str(tmp_path / "cfg"), edit_config=edit))


def test_export_is_atomic(exported, tmp_path):
    params, path = exported
    target = str(tmp_path / "out")
    save_hf(CFG, params, target)
    before = sorted(os.listdir(target))
    with pytest.raises(ValueError, match="not empty"):
        save_hf(CFG, params, target)
    broken = jax.tree.map(lambda x: x, params)
    broken["layers"][2]["mlp"]["experts"]["down"] = jnp.array(params["layers"][2]["mlp"][
        "experts"]["down"])
    broken["layers"][2]["mlp"]["experts"]["down"].delete()  # fails mid-write, after other files
    with pytest.raises(RuntimeError):
        save_hf(CFG, broken, target, overwrite=True)
    assert sorted(os.listdir(target)) == before
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left behind
    _, again = load_hf(target)
    _assert_tree_equal(params, again)
