"""Layer-wise error analysis on the tiny MoE: real per-site inputs, sane and ordered numbers."""

import jax
import numpy as np

from quads_jax import models
from quads_jax.quant.recipe import get_recipe
from quads_jax.rl.analysis import layer_error_analysis, probe_batch
from quads_jax.rl.tasks import TaskConfig, make_task
from quads_jax.testing import char_tokenizer, tiny_config


def test_layer_error_analysis():
    mc = tiny_config(dtype="float32", num_hidden_layers=2)  # layer 0 MoE, layer 1 dense
    params = models.init_params(mc, jax.random.key(0))
    probe = probe_batch(char_tokenizer(), make_task(TaskConfig(num_train=4, num_eval=8)).eval)
    out = layer_error_analysis(params, mc, get_recipe("trainer_qat"),
                               get_recipe("rollout_quads", rac_ratio=0.5), probe)
    for key in ("weight_only_err", "act_only_err", "w4a4_err", "w4a4_rac_err",
                "rac_captured_energy", "rac_block_fraction", "act_ftz_rate",
                "act_bin_flip_rate"):
        assert np.isfinite(out[f"analysis/{key}"]), key
    # NVFP4 errors are a few percent to ~20%; W4A4 is worse than either side alone; RAC helps
    assert 0.01 < out["analysis/weight_only_err"] < 0.3
    assert out["analysis/w4a4_err"] > max(out["analysis/weight_only_err"],
                                          out["analysis/act_only_err"])
    assert out["analysis/w4a4_rac_err"] < out["analysis/w4a4_err"]
    assert 0.5 <= out["analysis/rac_captured_energy"] <= 1.0  # half the blocks, the worst ones
    assert out["analysis/rac_block_fraction"] == 0.5  # a fixed count: the ratio (K/16 even)
    # the adaptive variant (no cap) stops at 30 % of the residual energy, which the top half
    # of the blocks exceeds (57 % here): fewer blocks than the fixed half, and about that energy
    adaptive = layer_error_analysis(params, mc, get_recipe("trainer_qat"), get_recipe(
        "rollout_quads", rac_ratio=1.0, rac_energy_target=0.3), probe)
    assert 0.0 < adaptive["analysis/rac_block_fraction"] < 0.5, adaptive
    assert 0.3 <= adaptive["analysis/rac_captured_energy"] < out["analysis/rac_captured_energy"]
    # the rollout's upstream quantization flips some activation codes, but not most
    assert 0.0 < out["analysis/act_bin_flip_rate"] < 0.5
    # bf16 on both sides: identical inputs, no flips
    same = layer_error_analysis(params, mc, get_recipe("bf16"), get_recipe("bf16"), probe)
    assert same["analysis/act_bin_flip_rate"] == 0.0
    # a static RAC rollout recipe is analyzed as its online counterpart (the master params
    # carry no calibration): the same numbers as the online recipe
    static = layer_error_analysis(params, mc, get_recipe("trainer_qat"),
                                  get_recipe("rollout_quads", rac_selection="static"), probe)
    assert static == out
