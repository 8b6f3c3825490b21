"""The RL loop end to end on CPU (tiny MoE): reward really rises; resume; stop on non-finite;
the CLI and every YAML in configs/."""

import json
import pathlib

import jax
import numpy as np
import pytest

from quads_jax import config as cfglib
from quads_jax import models
from quads_jax.export import export, restore_params
from quads_jax.plot import plot_runs
from quads_jax.train import __main__ as cli
from quads_jax.train.checkpoint import CheckpointConfig, Checkpointer
from quads_jax.train.config import TrainConfig
from quads_jax.train.loop import Trainer, TrainingStopped, stop_if_nonfinite
from quads_jax.train.state import OptimizerConfig, create_train_state, make_optimizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

# An easy task (single-digit sums), a short warm start that leaves room to improve, then RL.
EASY = [
    "arm=bf16", "seed=1", "console=false", "tensorboard=false",
    "task.min_digits=1", "task.max_digits=1", "task.num_train=80", "task.num_eval=20",
    "sft.steps=60", "sft.batch_size=32",
    "model.config.hidden_size=64", "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "rollout.prompts_per_step=16", "rollout.max_new_tokens=3", "grpo.num_generations=8",
    "optimizer.lr=1e-3", "rl.steps=16", "rl.num_minibatches=2", "rl.eval_every=100",
    "rl.eval_prompts=20", "rl.eval_samples=8", "rl.analysis_every=16",
    "checkpoint.every_steps=8",
    # One of the 8 fake CPU devices: the sharded loop is test_loop_resume_equals_straight_run's
    # (8-way fsdp) and test_step's; on 2 cores the 8-way SPMD programs double these tests' time.
    "mesh.num_devices=1",
]


def _trainer(tmp_path, extra=()):
    cfg = cfglib.load(TrainConfig, ROOT / "configs" / "tiny_cpu.yaml",
                      [*EASY, f"run_dir={tmp_path / 'run'}", *extra])
    return Trainer(cfg)


def test_short_rl_run_raises_reward(tmp_path, capsys):
    trainer = _trainer(tmp_path)
    assert trainer.mesh.devices.size == 1 < jax.device_count()  # mesh.num_devices=1
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == 16
    first = np.mean([r["reward/mean"] for r in rl[:8]])
    last = np.mean([r["reward/mean"] for r in rl[8:]])
    before, after = summary["before"]["eval/pass@1"], summary["after"]["eval/pass@1"]
    # The training reward of the last 8 steps against the first 8 (1 024 samples each): +0.046
    # to +0.065 over seeds 1-3 (2026-12-06). Held-out pass@1 over 20 prompts x 8 samples moves
    # -0.04 to +0.09 in 16 steps across seeds and samplers: too noisy to require a rise, so it
    # must only not collapse.
    assert last > first + 0.03, (first, last)
    assert after > before - 0.05, (before, after)
    # every spec section 7 metric is there each step
    for key in ("mismatch/max_abs_logp_gap", "mismatch/k3_kl", "mismatch/k1",
                "mismatch/token_mult_prob_error", "is/weight_mean", "is/ess",
                "rl/entropy", "rl/clip_frac", "train/grad_norm", "rollout/truncation_rate"):
        assert all(key in r for r in rl), key
    assert "analysis/w4a4_rac_err" in rl[15]
    assert (tmp_path / "run" / "checkpoints" / "16").exists()

    # export: params-only Orbax + HF safetensors from the last checkpoint == the final params
    written = export(str(tmp_path / "run"), str(tmp_path / "export"))
    assert (tmp_path / "export" / "hf" / "config.json").exists() and len(written) == 2
    # the params-only checkpoint carries its model config (what `sample --checkpoint` reads)
    # (HF's config.json keeps no compute dtype: the sample CLI takes --dtype)
    read = models.read_config(str(tmp_path / "export"))
    assert read.replace(dtype=trainer.model_config.dtype) == trainer.model_config
    _, params, step = restore_params(str(tmp_path / "run"))
    assert step == 16
    # the sample CLI reads the run directory itself (latest or --step), with its tokenizer
    from quads_jax import sample

    run_args = ["--checkpoint", str(tmp_path / "run"), "--prompt", "3+4=", "--greedy",
                "--max-new-tokens", "3", "--dtype", "float32"]
    assert sample.main([*run_args, "--step", "8"]) == 0
    assert "3+4=" in capsys.readouterr().out
    assert sample.main([*run_args, "--step", "5"]) == 2
    assert "complete checkpoints at steps [8, 16]" in capsys.readouterr().err
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(trainer.final_state.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # plots: one PNG per headline metric
    pngs = plot_runs([str(tmp_path / "run")], str(tmp_path / "plots"))
    assert len(pngs) == 5 and all(pathlib.Path(p).stat().st_size > 1000 for p in pngs)
    smoothed = plot_runs([str(tmp_path / "run")], str(tmp_path / "smooth"), smooth=4)
    assert [pathlib.Path(p).name for p in smoothed] == [pathlib.Path(p).name for p in pngs]


def test_static_rac_run_calibrates_at_sync(tmp_path, monkeypatch):
    """A rollout recipe with a static RAC selection trains: each weight sync calibrates on the
    training prompts (every ``calibration_every``-th sync; the syncs between reuse it), and the
    rollout leaves carry the calibrated block sets. The rollout runs on an FP8 KV cache, with
    continuous batching on 4 decode rows (8 responses per step) and shared prompt caches."""
    from quads_jax.quant.rac import CalibratedWeight
    from quads_jax.train import loop
    from quads_jax.train import rollout as rollout_lib

    continuous = []
    real_continuous = rollout_lib.generate_continuous

    def counting_continuous(*args, batch_rows, **kwargs):
        out = real_continuous(*args, batch_rows=batch_rows, **kwargs)
        continuous.append((batch_rows, out[0].tokens.shape[0], len(out[1])))
        return out

    monkeypatch.setattr(rollout_lib, "generate_continuous", counting_continuous)
    batches = []
    real = loop.calibrate

    def counting(params, recipe, *, model_config, tokens):
        batches.append(np.asarray(tokens))
        return real(params, recipe, model_config=model_config, tokens=tokens)

    monkeypatch.setattr(loop, "calibrate", counting)
    # No SFT warm start (sft.steps=0): the calibration needs a policy, not a trained one, and
    # the SFT step is one more program to compile (~5 s); test_short_rl_run_raises_reward
    # runs the SFT phase.
    trainer = _trainer(tmp_path, ["arm=quads", "recipe_overrides.rac_selection=static",
                                  "sft.steps=0", "rl.steps=2", "rl.analysis_every=0",
                                  "rl.eval_prompts=4", "rl.eval_samples=2",
                                  "rollout.prompts_per_step=4", "grpo.num_generations=2",
                                  "rollout.calibration_prompts=5",
                                  "rollout.calibration_every=2", "checkpoint.every_steps=0",
                                  "rollout.kv_cache_dtype=float8_e4m3fn",
                                  "rollout.decode_rows=4", "rollout.segment_steps=2",
                                  "rollout.share_prompt_cache=true"])
    assert trainer.sampler_config.kv_cache_dtype == "float8_e4m3fn"  # the config reaches it
    assert trainer.trainer_recipe.kv_quant == "float8_e4m3fn"  # and aligns the trainer
    try:
        trainer.run()
        with jax.set_mesh(trainer.mesh):  # the loop's mesh: its compiled sync programs
            rp = trainer.sync(trainer.final_state.params)  # sync 2 (0-1 ran): calibrates again
    finally:
        trainer.close()
    assert len(batches) == 2  # sync 0 of the run (sync 1 reused it), then 2
    tokens = batches[0]
    assert tokens.shape[0] == 5 and tokens.dtype == np.int32
    assert np.all(tokens[:, 0] == trainer.tokenizer.bos_id)
    assert np.all(tokens != trainer.tokenizer.pad_id)
    leaves = jax.tree.leaves(rp, is_leaf=lambda x: isinstance(x, CalibratedWeight))
    calibrated = [x for x in leaves if isinstance(x, CalibratedWeight)]
    assert calibrated and all(x.rac_blocks is not None for x in calibrated)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == 2
    # Every rollout (2 steps, 2 evaluations) decoded 8 responses on 4 rows, in segments.
    assert len(continuous) == 4 and all(c[:2] == (4, 8) and c[2] >= 2 for c in continuous)
    assert all(0 < r["rollout/row_utilisation"] <= 1 for r in rl)


def test_calibration_batch_cuts_rows_to_the_shortest_and_refuses_bad_input():
    from quads_jax.rl.tasks import Example
    from quads_jax.train.config import RolloutSection
    from quads_jax.train.rollout import calibration_batch
    from quads_jax.train.tokenizer import load_tokenizer

    tok = load_tokenizer("char")
    exs = [Example("1+2=", "3", "3"), Example("10+20=", "30", "30"), Example("4+4=", "8")]
    got = calibration_batch(tok, exs, 2)
    want = [tok.encode("1+2=3", add_bos=True)] * 1 + [tok.encode("10+20=30", add_bos=True)[:6]]
    np.testing.assert_array_equal(got, np.asarray(want, np.int32))
    assert calibration_batch(tok, exs, 9).shape == (3, 5)  # "4+4=" + BOS is the shortest
    with pytest.raises(ValueError, match="need n >= 1 and examples, got n=0"):
        calibration_batch(tok, exs, 0)
    with pytest.raises(ValueError, match="calibration_every"):
        RolloutSection(calibration_every=0)
    with pytest.raises(ValueError, match="kv_cache_dtype.*float8_e4m3fn"):
        RolloutSection(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="decode_rows=-1.*>= 0"):
        RolloutSection(decode_rows=-1)


def test_stop_after_n_nonfinite_saves_checkpoint(tmp_path):
    opt = make_optimizer(OptimizerConfig(), 10)
    state = create_train_state({"w": jax.numpy.ones((2, 2))}, opt, 0)
    ck = Checkpointer(str(tmp_path / "ck"), CheckpointConfig())
    stop_if_nonfinite(state, 3, ck, 5, {"rl_step": 5})  # streak 0: nothing happens
    assert ck.latest_step() is None
    state = state.__class__(**{**state.__dict__, "nonfinite_streak": jax.numpy.int32(3)})
    with pytest.raises(TrainingStopped, match=r"3 non-finite updates in a row.*ck/7"):
        stop_if_nonfinite(state, 3, ck, 7, {"rl_step": 7})
    assert ck.latest_step() == 7
    ck.close()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_file_validates(path):
    cfg = cfglib.load(TrainConfig, path)
    assert cfg.recipe_names[1].startswith(("rollout_", "bf16"))


def test_configs_exist():
    assert any(p.name == "tiny_cpu.yaml" for p in CONFIGS)


def test_cli_config_errors(capsys):
    tiny = str(ROOT / "configs" / "tiny_cpu.yaml")
    assert cli.main(["--config", tiny, "grpo.is_mode=nope"]) == 2
    assert "grpo.is_mode='nope' is invalid; allowed: one of" in capsys.readouterr().err
    assert cli.main(["--config", tiny, "rl.stepz=3"]) == 2
    assert "unknown config key rl.stepz" in capsys.readouterr().err
    assert cli.main(["--config", tiny, "optimizer.lr=-1"]) == 2
    assert "OptimizerConfig.lr=-1.0" in capsys.readouterr().err


def test_plot_smoothing_is_a_trailing_mean_and_refuses_bad_windows(tmp_path, capsys):
    from quads_jax import plot

    assert plot.trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert plot.trailing_mean([2.0, 4.0], 1) == [2.0, 4.0]
    assert plot.trailing_mean([2.0, 4.0, 9.0], 5) == [2.0, 3.0, 5.0]
    with pytest.raises(ValueError, match="window=0"):
        plot.trailing_mean([1.0], 0)
    assert plot.main([str(tmp_path), "--smooth", "0"]) == 2
    assert "--smooth=0: must be >= 1" in capsys.readouterr().err


def test_cli_table_says_how_to_sample_the_run(capsys):
    summary = {"arm": "quads", "before": {"eval/pass@1": 0.25}, "after": {"eval/pass@1": 0.5},
               "last": {"mismatch/k3_kl": 0.001}}
    cli._table(summary, "/runs/x", 12.0, 5)
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "0.250" in out and "0.500" in out and "arm=quads" in out
    assert ("python -m quads_jax.sample --checkpoint /runs/x --max-new-tokens 5 --prompt TEXT "
            "[--precision nvfp4_rac]") in out


@pytest.fixture
def compile_cache(tmp_path):
    """A persistent compilation cache for this test only: its three Trainers compile the same
    programs, and compiling them once saves most of the test's time."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    from jax.experimental.compilation_cache import compilation_cache

    old = {k: getattr(jax.config, k) for k in keys}
    compilation_cache.reset_cache()  # jax decides once whether a cache is in use: re-decide
    jax.config.update(keys[0], str(tmp_path / "jax_cache"))
    jax.config.update(keys[1], 0.0)
    jax.config.update(keys[2], 0)
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


@pytest.mark.slow
def test_loop_resume_equals_straight_run(tmp_path, compile_cache):
    """RL 2 steps straight == 1 step, stop, a new process-like Trainer resumes, 1 more:
    the same losses, rewards (so the same rollouts: RNG and data position restored) and
    bit-identical final params. The rollouts share each group's prompt cache."""
    # An untrained model (entropy ~4.4 nats over the characters) writes a well-formed
    # two-token answer (a digit, then a digit or EOS) about 1 time in 60: 64 samples per step
    # mix rewards in a step with probability ~0.67. Seed 0's two steps both make a real update
    # (the last asserts): the step after the resume is then a real one, not an update of zero.
    # (2 + 1 + 1 steps, not 4 + 2 + 2: the compiles are most of the time, each step ~0.7 s.)
    base = ["console=false", "tensorboard=false", "sft.steps=0", "reward.format_weight=1.0",
            "rollout.share_prompt_cache=true",
            "rollout.max_new_tokens=2", "model.config.hidden_size=64",
            "model.config.num_hidden_layers=2", "rollout.prompts_per_step=8",
            "grpo.num_generations=8", "rl.eval_every=100", "rl.analysis_every=0",
            "checkpoint.every_steps=1",
            # the evaluations sample 8 prompts x 8 like a step's rollout: one compiled program
            "rl.eval_prompts=8", "rl.eval_samples=8"]

    def run(name, steps):
        cfg = cfglib.load(TrainConfig, ROOT / "configs" / "tiny_cpu.yaml",
                          [*base, f"run_dir={tmp_path / name}", f"rl.steps={steps}"])
        trainer = Trainer(cfg)
        assert trainer.sampler_config.share_prompt_cache
        try:
            trainer.run()
        finally:
            trainer.close()
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        return trainer.final_state, {r["step"]: r for r in rows if r["phase"] == "rl"}

    straight, rows_a = run("a", 2)
    _, rows_first = run("b", 1)
    assert sorted(rows_first) == [1]
    resumed, rows_b = run("b", 2)
    assert sorted(rows_b) == [1, 2]  # step 1 from the first process's log, step 2 resumed
    for step in (1, 2):
        for key in ("train/loss", "reward/mean", "mismatch/k3_kl"):
            assert rows_a[step][key] == rows_b[step][key], (step, key)
    assert all(rows_a[s]["train/loss"] != 0 for s in (1, 2))  # the updates were real
    assert int(resumed.step) == int(straight.step) > 0
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
