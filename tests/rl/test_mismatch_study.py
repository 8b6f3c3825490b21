"""The fixed-policy mismatch study: arm parsing, and the engines' alignment it measures."""

import json
import pathlib
import sys

import pytest

from quads_jax import config as cfglib
from quads_jax.models.config import ModelConfig
from quads_jax.rl import mismatch_study as study
from quads_jax.train.config import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["model.config.hidden_size=64", "model.config.intermediate_size=128",
         "model.config.num_hidden_layers=1", "rollout.max_new_tokens=3", "sft.steps=0"]


def test_parse_arm_reads_overrides_and_rejects_bad_specs():
    cfg = cfglib.load(TrainConfig, ROOT / "configs" / "tiny_cpu.yaml", SMALL)
    mc = ModelConfig(num_hidden_layers=2)
    arm = study.parse_arm("quads:rac_ratio=0.25,rac_score=act_amax", cfg, mc)
    assert arm.config.arm == "quads"
    assert arm.config.recipe_overrides["rac_ratio"] == 0.25
    assert arm.config.recipe_overrides["rac_score"] == "act_amax"
    assert study.parse_arm("bf16", cfg, mc).config.recipe_names == ("bf16", "bf16")
    for spec, words in [("nvfp5", "not an arm"), ("quads:rac_ratio", "field=value"),
                        ("quads:rac_ratio=1.5", "rac_ratio"),
                        ("quads:no_such_field=1", "no_such_field"),
                        ("quads:rac_score=l7", "rac_score")]:
        with pytest.raises(ValueError, match=words):
            study.parse_arm(spec, cfg, mc)
    assert study.split_arms("bf16, quads:rac_ratio=0.5,rac_score=act_amax,naive_nvfp4,") == [
        "bf16", "quads:rac_ratio=0.5,rac_score=act_amax", "naive_nvfp4"]


def test_study_cli_separates_aligned_from_unaligned_engines(tmp_path, capsys):
    """At one policy (the random init): QAT + W4A16 (the same qdq weights on
    both sides, no activation rounding), agree to float32 rounding; W4A4 rollouts do not, a
    BF16 trainer (weight error too) least; RAC over every block closes part of the activation
    gap (QUADS_SPEC 1 and 4)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import study_mismatch

    arms = "w4a16,naive_nvfp4,qat_only,quads:rac_ratio=1.0"
    out = tmp_path / "study"
    rc = study_mismatch.main(["--config", str(ROOT / "configs" / "tiny_cpu.yaml"), *SMALL,
                              "--arms", arms, "--prompts", "8", "--samples", "8",
                              "--seeds", "0,1", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "study.json").read_text())
    assert (out / "mismatch.png").stat().st_size > 0
    assert len((out / "study.md").read_text().splitlines()) == 2 + 4
    by = {r["arm"]: r for r in data["rows"]}
    gap = {k: r["mismatch/mean_abs_logp_gap"] for k, r in by.items()}
    assert all(r["tokens"] > 50 for r in by.values()), by
    assert gap["w4a16"] < 1e-4, gap
    assert gap["qat_only"] > 100 * gap["w4a16"], gap
    assert gap["naive_nvfp4"] > gap["qat_only"], gap
    assert gap["quads:rac_ratio=1.0"] < gap["qat_only"], gap
    assert len(by["w4a16"]["seeds"]) == 2
    assert data["complete"] and data["arms"] == arms.split(",")
    # RAC's share of the blocks: every block at ratio 1.0; arms without RAC have none
    assert by["quads:rac_ratio=1.0"]["rac/block_fraction"] == 1.0
    assert by["quads:rac_ratio=1.0"]["rac/captured_energy"] == 1.0
    assert not any("rac/block_fraction" in by[a] for a in ("w4a16", "naive_nvfp4", "qat_only"))

    # bad input: a clear message and exit code 2, nothing written
    tiny = str(ROOT / "configs" / "tiny_cpu.yaml")
    for args, words in [(["--config", tiny, "--arms", "nvfp5"], "not an arm"),
                        (["--config", tiny, "--seeds", "0,x"], "comma-separated integers"),
                        (["--config", tiny, "--prompts", "0"], "--prompts 0"),
                        (["--run-dir", str(tmp_path / "none")], "no config.json"),
                        (["--config", str(tmp_path / "none.yaml")], "No such file")]:
        assert study_mismatch.main([*args, "--out", str(tmp_path / "bad")]) == 2, args
        assert words in capsys.readouterr().err, args
        assert not (tmp_path / "bad" / "study.json").exists()


def test_study_cli_keeps_the_arms_measured_before_a_failure(tmp_path, monkeypatch):
    """The files are rewritten after every arm: a study stopped midway (a time limit, an
    error) keeps the arms it finished, marked incomplete."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import study_mismatch

    calls = []

    def fake_measure(params, arm, examples, *, seeds, **kwargs):
        calls.append(arm.spec)
        if len(calls) == 2:
            raise RuntimeError("time limit")
        gap = {f"mismatch/{k}": 0.01 for k in ("mean_abs_logp_gap", "p99_abs_logp_gap",
                                               "max_abs_logp_gap", "k3_kl")}
        return {"arm": arm.spec, "tokens": 10, "pass_rate": 0.5, **gap,
                "seeds": [{"seed": s, "pass_rate": 0.5, "mismatch/mean_abs_logp_gap": 0.01,
                           "mismatch/k3_kl": 0.01} for s in seeds]}

    monkeypatch.setattr(study, "measure_arm", fake_measure)
    out = tmp_path / "study"
    with pytest.raises(RuntimeError, match="time limit"):
        study_mismatch.main(["--config", str(ROOT / "configs" / "tiny_cpu.yaml"), *SMALL,
                             "--arms", "bf16,naive_nvfp4,quads", "--prompts", "2",
                             "--samples", "1", "--seeds", "0", "--out", str(out)])
    data = json.loads((out / "study.json").read_text())
    assert [r["arm"] for r in data["rows"]] == ["bf16"] and not data["complete"]
    assert data["arms"] == ["bf16", "naive_nvfp4", "quads"]
    assert len((out / "study.md").read_text().splitlines()) == 2 + 1
