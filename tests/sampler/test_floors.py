"""The decode step's byte floor (``quads_jax.sampler.floors``) and its CLI."""

import json

import jax
import pytest

from quads_jax import bench, models
from quads_jax.quant.recipe import ROLLOUT_PRECISIONS, get_recipe
from quads_jax.sampler import floors
from quads_jax.sampler.sync import sync, weight_bytes
from quads_jax.testing import tiny_config


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


def test_kv_bytes_and_touched_experts(cfg):
    # 2 (K and V) x layers x rows x slots x KV heads x head_dim x bytes
    assert floors.kv_bytes(cfg, 3, 10) == 2 * 4 * 3 * 10 * 2 * 16 * 2
    assert floors.kv_bytes(cfg, 3, 10, itemsize=1) == floors.kv_bytes(cfg, 3, 10) // 2
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    assert floors.touched_experts(cfg, 1) == pytest.approx(k / e)
    assert floors.touched_experts(cfg, 2) == pytest.approx(1 - (1 - k / e) ** 2)
    assert floors.touched_experts(cfg, 10_000) == pytest.approx(1.0)


def test_decode_step_bytes_counts_weights_touched_experts_and_the_cache(cfg):
    tree = sync(models.init_params(cfg, jax.random.key(0)), get_recipe("rollout_nvfp4"),
                model_config=cfg)
    total, experts = weight_bytes(tree), floors.expert_bytes(tree)
    embed = tree["embed"].size * tree["embed"].dtype.itemsize
    assert 0 < experts < total and embed > 0
    got = floors.decode_step_bytes(cfg, tree, batch=2, slots=7)
    want = (total - experts - embed + floors.touched_experts(cfg, 2) * experts
            + floors.kv_bytes(cfg, 2, 7))
    assert got == pytest.approx(want)
    # a shared prompt of 5 slots, 2 groups of 2 rows: the prompt read once per group
    shared = floors.decode_step_bytes(cfg, tree, batch=4, slots=7, groups=2, prompt=5)
    assert shared == pytest.approx(
        total - experts - embed + floors.touched_experts(cfg, 4) * experts
        + floors.kv_bytes(cfg, 2, 5) + floors.kv_bytes(cfg, 4, 2))
    # the shapes of the same tree give the same bytes (the CLI never makes arrays)
    shapes = jax.eval_shape(lambda t: t, tree)
    assert floors.decode_step_bytes(cfg, shapes, batch=2, slots=7) == pytest.approx(got)
    for kwargs, match in ((dict(batch=0, slots=7), "batch"),
                          (dict(batch=2, slots=7, prompt=8), "prompt"),
                          (dict(batch=3, slots=7, groups=2, prompt=5), "divide")):
        with pytest.raises(ValueError, match=match):
            floors.decode_step_bytes(cfg, tree, **kwargs)


def test_floor_rows_rank_the_precisions_by_their_bytes():
    # The 30B shape at 2 layers, as shapes only (at the tiny test shapes the kernels' tile
    # padding, which the rollout trees carry, outweighs the formats' bytes).
    cfg = models.ModelConfig(**{**floors.QWEN3_30B_A3B, "num_hidden_layers": 2})
    rows = floors.floor_rows(cfg, [1, 128, 1024], 16, bandwidth=1e12)
    assert [r["precision"] for r in rows] == list(ROLLOUT_PRECISIONS) * 3
    for batch in (1, 128, 1024):
        by = {r["precision"]: r for r in rows if r["batch"] == batch}
        assert by["bf16"]["step_bytes"] > by["fp8"]["step_bytes"] > by["nvfp4"]["step_bytes"]
        assert by["nvfp4_rac"]["step_bytes"] == by["nvfp4"]["step_bytes"]  # same weights
        assert by["bf16"]["x_bf16"] == 1.0 and by["fp8"]["x_fp8"] == 1.0
        r = by["nvfp4_rac"]
        assert r["x_bf16"] == pytest.approx(by["bf16"]["step_bytes"] / r["step_bytes"])
        assert r["floor_ms"] == pytest.approx(r["step_bytes"] / 1e12 * 1e3)
        assert r["floor_tok_s"] == pytest.approx(batch * 1e12 / r["step_bytes"])
    # One row touches 8 of 128 experts (the bf16 LM head, the same in every arm, dominates);
    # past ~128 rows every expert is read, and the KV cache, the same in every arm, grows with
    # the batch and narrows the multiple again.
    x = {r["batch"]: r["x_bf16"] for r in rows if r["precision"] == "nvfp4"}
    assert x[1] < x[128] and x[1024] < x[128]


def test_floors_cli_prints_the_table_and_refuses_bad_input(capsys, tmp_path):
    assert bench.MODULES["floors"] == floors.__name__  # python -m quads_jax.bench floors
    assert floors.main(["--layers", "2", "--batches", "8,128", "--position", "300",
                        "--precisions", "bf16,nvfp4", "--kv-cache-dtype", "float8_e4m3fn"]) == 0
    out = capsys.readouterr().out
    assert "2 layers, 128 experts top-8, position 300, KV float8_e4m3fn" in out
    lines = [line for line in out.splitlines() if line.startswith("| 128 | nvfp4 |")]
    assert len(lines) == 1 and lines[0].endswith("x |")
    # a transformers directory's config.json (no weights read)
    hf = tmp_path / "hf"
    hf.mkdir()
    shape = models.ModelConfig(**{**floors.QWEN3_30B_A3B, "num_hidden_layers": 3})
    (hf / "config.json").write_text(json.dumps(shape.to_hf_dict()))
    assert floors.main(["--hf", str(hf), "--batches", "4", "--precisions", "nvfp4"]) == 0
    assert "3 layers, 128 experts top-8" in capsys.readouterr().out
    assert floors.main(["--hf", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert floors.main(["--precisions", "bf16,int3"]) == 2
    assert "unknown ['int3']" in capsys.readouterr().err
    assert floors.main(["--batches", "8,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert floors.main(["--batches", "0"]) == 2
    assert "batch=0" in capsys.readouterr().err
    assert floors.main(["--bandwidth-tbps", "0"]) == 2
    assert floors.main(["--layers", "0"]) == 2


def test_tied_embeddings_count_as_the_lm_head(cfg):
    tied = cfg.replace(tie_word_embeddings=True)
    tree = jax.eval_shape(lambda: sync(models.init_params(tied, jax.random.key(0)),
                                       get_recipe("bf16"), model_config=tied))
    assert "lm_head" not in tree
    total, experts = weight_bytes(tree), floors.expert_bytes(tree)
    got = floors.decode_step_bytes(tied, tree, batch=1, slots=4)
    assert got == pytest.approx(total - experts + floors.touched_experts(tied, 1) * experts
                                + floors.kv_bytes(tied, 1, 4))
