"""The RL loop: optional SFT, then per step rollout -> rewards -> trainer log-probs -> updates
-> sync -> metrics, with evaluation, checkpoints and the layer-wise error analysis.

One RL step, as data (QUADS_SPEC section 6, DESIGN "One step of RL")::

    prompts ─► generate(rollout_params, rollout recipe)  tokens, logp_rollout, response mask
            ─► rewards ─► group advantages
            ─► logp_old = trainer forward (trainer recipe, no grad)   never the rollout's numbers
            ─► M mini-batch updates (GRPO + IS correction), one jitted scan
            ─► rollout_params = sync(params, rollout recipe) + identity check
            ─► metrics (mismatch/*, is/*, RL health, timing) ─► JSONL + TensorBoard + console
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax import config as cfglib
from quads_jax import models
from quads_jax.metrics_log import MetricsLogger
from quads_jax.quant.recipe import get_recipe
from quads_jax.rl import diagnostics
from quads_jax.rl.grpo import group_advantages
from quads_jax.rl.tasks import make_task, prompt_batches
from quads_jax.sampler import SamplerConfig, check_sync, sync
from quads_jax.sampler.calibration import calibrate, needs_calibration
from quads_jax.train import mesh as mesh_lib
from quads_jax.train.checkpoint import Checkpointer
from quads_jax.train.config import TrainConfig
from quads_jax.train.rollout import (
    calibration_batch,
    evaluate_pass_at_1,
    prompt_width,
    rollout_and_score,
)
from quads_jax.train.sft import run_sft
from quads_jax.train.state import (
    create_train_state,
    make_optimizer,
    split_rng,
    train_state_shardings,
)
from quads_jax.train.step import (
    jit_sharded,
    make_logprob_fn,
    make_update_fn,
    rl_loss_fn,
    sft_loss_fn,
    split_minibatches,
)
from quads_jax.train.tokenizer import load_tokenizer


class TrainingStopped(RuntimeError):
    """Raised after too many non-finite updates in a row (a checkpoint was saved first)."""


def stop_if_nonfinite(state, limit: int, checkpointer: Checkpointer, rl_step: int,
                      meta: dict[str, Any]) -> None:
    """After ``limit`` non-finite updates in a row: save a checkpoint, then raise
    :class:`TrainingStopped` with a message that says why and where the checkpoint is."""
    streak = int(state.nonfinite_streak)
    if streak < limit:
        return
    checkpointer.save(rl_step, state, meta)
    checkpointer.wait()
    raise TrainingStopped(
        f"training stopped at RL step {rl_step}: {streak} non-finite updates in a row "
        f"(optimizer.max_nonfinite_in_a_row={limit}; each was skipped); the last good state "
        f"is saved in {checkpointer.directory}/{rl_step}")


def recipes(config: TrainConfig, model_config) -> tuple[Any, Any]:
    """``(trainer recipe, rollout recipe)`` of the config's arm with its ``recipe_overrides``
    (an FP8 KV cache aligns the trainer's attention unless the overrides say otherwise)."""
    overrides = dict(config.recipe_overrides)
    if config.rollout.kv_cache_dtype == "float8_e4m3fn":  # align the trainer's attention
        overrides.setdefault("kv_quant", "float8_e4m3fn")
    if overrides.get("keep_last_n_bf16") and "num_layers" not in overrides:
        overrides["num_layers"] = model_config.num_hidden_layers
    trainer, rollout = config.recipe_names
    return get_recipe(trainer, **overrides), get_recipe(rollout, **overrides)


def make_apply_fn(model_config, recipe):
    """``(params, tokens, attention_mask) -> (logits f32 [B, T, V], aux_loss [])`` of the
    trainer: ``models.forward`` with the trainer recipe."""

    def apply(params, tokens, attention_mask):
        out = models.forward(model_config, params, tokens, attention_mask=attention_mask,
                             recipe=recipe)
        return out.logits, out.aux_loss

    return apply


class Trainer:
    """Builds everything from a :class:`TrainConfig` and runs SFT + RL (see :meth:`run`)."""

    def __init__(self, config: TrainConfig):
        self.config = c = config
        mesh_lib.maybe_initialize_distributed(c.mesh.distributed)
        self.tokenizer = load_tokenizer(c.model.tokenizer)
        if c.model.init == "hf":
            self.model_config, params = models.load_hf(c.model.hf_path)
        else:
            mc = c.model.config
            if c.model.tokenizer == "char":  # the char tokenizer fixes vocab and special ids
                t = self.tokenizer
                mc = dataclasses.replace(mc, vocab_size=t.vocab_size, bos_token_id=t.bos_id,
                                         eos_token_id=t.eos_id, pad_token_id=t.pad_id)
            self.model_config = mc
            params = models.init_params(mc, jax.random.key(c.seed))
        self.trainer_recipe, self.rollout_recipe = recipes(c, self.model_config)
        self.mesh = mesh_lib.make_mesh(c.mesh)
        self.splits = make_task(c.task)
        self.eval_examples = self.splits.eval[: c.rl.eval_prompts]
        self.prompt_width = prompt_width(self.tokenizer, self.splits.train + self.splits.eval)
        self.sampler_config = SamplerConfig(
            max_new_tokens=c.rollout.max_new_tokens, n_samples=c.grpo.num_generations,
            temperature=c.rollout.temperature, top_k=c.rollout.top_k, top_p=c.rollout.top_p,
            sampler=c.rollout.sampler, stop_token_ids=(self.tokenizer.eos_id,),
            pad_token_id=self.tokenizer.pad_id,
            kv_cache_dtype=c.rollout.kv_cache_dtype,
            share_prompt_cache=c.rollout.share_prompt_cache,
        )
        self.apply_fn = make_apply_fn(self.model_config, self.trainer_recipe)
        self.logprob_fn = jax.jit(make_logprob_fn(self.apply_fn))
        os.makedirs(c.run_dir, exist_ok=True)
        with open(os.path.join(c.run_dir, "config.json"), "w") as f:
            json.dump(cfglib.to_dict(c), f, indent=1, default=str)
        with open(os.path.join(c.run_dir, "model_config.json"), "w") as f:
            json.dump(cfglib.to_dict(self.model_config), f, indent=1)
        self.logger = MetricsLogger(c.run_dir, total_steps=c.rl.steps, console=c.console,
                                    tensorboard=c.tensorboard)
        self.ckpt = Checkpointer(os.path.join(c.run_dir, "checkpoints"), c.checkpoint)
        self.initial_params = params
        self._syncs, self._calibration = 0, None
        self.calibration_tokens = (
            calibration_batch(self.tokenizer, self.splits.train, c.rollout.calibration_prompts)
            if needs_calibration(self.rollout_recipe) else None)

    # ------------------------------------------------------------------ placement helpers
    def _state_and_update(self, params, opt_config, loss_fn, total_updates):
        opt = make_optimizer(opt_config, total_updates)
        state = create_train_state(params, opt, self.config.seed)
        shardings = train_state_shardings(state, self.mesh, self.config.mesh.rules,
                                          self.model_config)
        state = jax.device_put(state, shardings)
        update = make_update_fn(loss_fn, opt)
        return state, shardings, update

    def _batch_shardings(self, batch: dict[str, np.ndarray]):
        rules = self.config.mesh.rules
        return {k: jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(
            None, *mesh_lib.batch_sharding(self.mesh, v.shape[1:], rules).spec))
            for k, v in batch.items()}

    def _jit_for(self, update, state_sh, example_batch):
        b_sh = self._batch_shardings(example_batch)
        step = jit_sharded(update, state_sh, b_sh, self.mesh)
        return lambda state, batch: step(state, jax.device_put(batch, b_sh))

    def _score_kwargs(self) -> dict[str, Any]:
        return dict(tokenizer=self.tokenizer, model_config=self.model_config,
                    recipe=self.rollout_recipe, reward_config=self.config.reward,
                    task_name=self.config.task.name, width=self.prompt_width,
                    decode_rows=self.config.rollout.decode_rows,
                    segment_steps=self.config.rollout.segment_steps)

    def evaluate(self, rollout_params, step: int) -> dict[str, float]:
        """pass@1 over k samples on the held-out prompts (deterministic key per step)."""
        c = self.config
        key = jax.random.fold_in(jax.random.key(c.seed + 1), step)
        return evaluate_pass_at_1(rollout_params, self.eval_examples, key, k=c.rl.eval_samples,
                                  temperature=c.rl.eval_temperature, base=self.sampler_config,
                                  **self._score_kwargs())

    def sync(self, params):
        """Rollout params from the master params + the identity check (cheap checksum).

        A rollout recipe with a static RAC selection or activation scale is calibrated here on
        ``rollout.calibration_prompts`` training examples, at every ``calibration_every``-th
        sync (the last calibration serves the syncs between)."""
        calibration = None
        if needs_calibration(self.rollout_recipe):
            if self._syncs % self.config.rollout.calibration_every == 0:
                self._calibration = calibrate(params, self.rollout_recipe,
                                              model_config=self.model_config,
                                              tokens=self.calibration_tokens)
            calibration = self._calibration
        self._syncs += 1
        rp = sync(params, self.rollout_recipe, model_config=self.model_config,
                  calibration=calibration)
        check_sync(params, rp, self.rollout_recipe, model_config=self.model_config)
        return rp

    # ------------------------------------------------------------------------- phases
    def run_sft(self, params):
        c = self.config
        loss = sft_loss_fn(self.apply_fn, c.rl.aux_loss_coef)
        state, sh, update = self._state_and_update(params, c.sft.optimizer, loss, c.sft.steps)
        self.logger.set_total("sft", c.sft.steps)
        jitted = None

        def put(batch):
            nonlocal jitted
            if jitted is None:
                jitted = self._jit_for(update, sh, batch)
            return batch

        def step_fn(state, batch):
            return jitted(state, batch)

        state = run_sft(
            state, step_fn, self.splits.train, tokenizer=self.tokenizer, steps=c.sft.steps,
            batch_size=c.sft.batch_size, seed=c.seed, put_batch=put,
            log=lambda s, m: self.logger.log(s, m, phase="sft"),
            log_every=max(1, c.sft.steps // 20),
        )
        return state.params

    def rl_step(self, state, rollout_params, examples, update) -> tuple[Any, dict[str, float]]:
        """One RL step; returns the new state and its metrics."""
        c = self.config
        t0 = time.perf_counter()
        state, key = split_rng(state)
        scored = rollout_and_score(rollout_params, examples, key,
                                   sampler_config=self.sampler_config, **self._score_kwargs())
        ro = scored.rollout
        adv = group_advantages(scored.rewards, c.grpo.num_generations,
                               std_normalize=c.grpo.std_normalize, eps=c.grpo.adv_eps)
        batch = {"tokens": ro.tokens, "attention_mask": ro.attention_mask,
                 "mask": ro.response_mask.astype(jnp.float32), "logp_rollout": ro.logprobs,
                 "advantages": adv}
        t1 = time.perf_counter()
        logp_old, entropy = self.logprob_fn(state.params, batch)
        batch["logp_old"] = logp_old
        host = jax.device_get({"logp_old": logp_old, "logp_rollout": ro.logprobs,
                               "mask": batch["mask"], "entropy": entropy})
        metrics = diagnostics.mismatch_metrics(host["logp_rollout"], host["logp_old"],
                                               host["mask"])
        metrics.update(diagnostics.is_metrics(host["logp_old"], host["logp_rollout"],
                                              host["mask"], c.grpo))
        metrics.update(diagnostics.health_metrics(scored.rewards, scored.correct, host["mask"],
                                                  scored.truncated, host["entropy"]))
        np_batch = {k: np.asarray(v) for k, v in jax.device_get(batch).items()}
        state, m = update(state, split_minibatches(np_batch, c.rl.num_minibatches))
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        t2 = time.perf_counter()
        rollout_params = self.sync(state.params)
        jax.block_until_ready(rollout_params)
        t3 = time.perf_counter()
        metrics.update(m)
        metrics.update({
            "rollout/tokens_per_s": scored.new_tokens / max(scored.seconds, 1e-9),
            "rollout/row_utilisation": scored.new_tokens / max(scored.row_steps, 1),
            "time/rollout_s": scored.seconds, "time/train_s": t2 - t1, "time/sync_s": t3 - t2,
            "time/step_s": t3 - t0, "train/optimizer_step": float(state.step),
        })
        metrics.update(mesh_lib.device_memory_metrics())  # GPUs only
        return state, rollout_params, metrics

    def run(self) -> dict[str, Any]:
        """SFT (unless resuming), then RL; returns the summary (also written as summary.json).

        Runs under ``jax.set_mesh(self.mesh)``: the MoE blocks then run expert-parallel when the
        mesh has an ``expert`` axis (``models.moe.expert_parallel``)."""
        with jax.set_mesh(self.mesh):
            return self._run()

    def _run(self) -> dict[str, Any]:
        c = self.config
        start_rl_step, resumed = 0, False
        rl_loss = rl_loss_fn(self.apply_fn, c.grpo, c.rl.aux_loss_coef)
        total_updates = max(c.rl.steps * c.rl.num_minibatches, 1)
        state, sh, update = self._state_and_update(self.initial_params, c.optimizer, rl_loss,
                                                   total_updates)
        latest = self.ckpt.latest_step() if c.checkpoint.resume else None
        summary: dict[str, Any] = {"run_dir": os.path.abspath(c.run_dir), "arm": c.arm}
        if latest is not None:
            state, meta = self.ckpt.restore(latest, jax.tree.map(lambda x: x, state))
            state = jax.device_put(state, sh)
            start_rl_step, resumed = int(meta["rl_step"]), True
            summary.update(meta.get("summary", {}))
        elif c.sft.steps > 0:
            params = self.run_sft(state.params)
            state, sh, update = self._state_and_update(params, c.optimizer, rl_loss,
                                                       total_updates)
        rollout_params = self.sync(state.params)
        self.logger.set_total("eval", c.rl.steps)
        if not resumed:
            before = self.evaluate(rollout_params, 0)
            self.logger.log(0, before, phase="eval")
            summary["before"] = before
        self.logger.set_total("rl", c.rl.steps)
        batches = prompt_batches(self.splits.train, c.rollout.prompts_per_step,
                                 seed=c.seed + 2, start=start_rl_step)
        jitted = None
        analysis_probe = None
        for rl_step in range(start_rl_step + 1, c.rl.steps + 1):
            _, examples = next(batches)
            if jitted is None:
                example = self._example_rl_batch(len(examples))
                jitted = self._jit_for(update, sh, example)
            state, rollout_params, metrics = self.rl_step(state, rollout_params, examples, jitted)
            if c.rl.analysis_every and rl_step % c.rl.analysis_every == 0:
                from quads_jax.rl.analysis import layer_error_analysis, probe_batch

                if analysis_probe is None:
                    analysis_probe = probe_batch(self.tokenizer, self.eval_examples)
                metrics.update(layer_error_analysis(
                    state.params, self.model_config, self.trainer_recipe, self.rollout_recipe,
                    analysis_probe))
            if rl_step % c.rl.eval_every == 0 or rl_step == c.rl.steps:
                metrics.update(self.evaluate(rollout_params, rl_step))
            self.logger.log(rl_step, metrics, phase="rl")
            meta = {"rl_step": rl_step, "data_position": rl_step, "summary": _json_safe(summary)}
            stop_if_nonfinite(state, c.optimizer.max_nonfinite_in_a_row, self.ckpt, rl_step, meta)
            if self.ckpt.should_save(rl_step, last=rl_step == c.rl.steps):
                self.ckpt.save(rl_step, state, meta)
            summary["last"] = {k: v for k, v in metrics.items()
                               if k.startswith(("reward/", "eval/", "mismatch/"))}
        self.ckpt.wait()
        if c.rl.steps and "eval/pass@1" in summary.get("last", {}):
            summary["after"] = {k: v for k, v in summary["last"].items() if k.startswith("eval/")}
        summary["final_params_step"] = int(state.step)
        self.final_state = state
        with open(os.path.join(c.run_dir, "summary.json"), "w") as f:
            json.dump(_json_safe(summary), f, indent=1)
        return summary

    def _example_rl_batch(self, num_prompts: int) -> dict[str, np.ndarray]:
        """Shape-only RL batch ``[M, mb, T]`` for building the batch shardings."""
        c = self.config
        rows = num_prompts * c.grpo.num_generations
        t = 1  # only the leading dims matter for the batch specs
        mb = rows // c.rl.num_minibatches
        shapes = {"tokens": (mb, t), "attention_mask": (mb, t), "mask": (mb, t),
                  "logp_rollout": (mb, t), "logp_old": (mb, t), "advantages": (mb,)}
        return {k: np.zeros((c.rl.num_minibatches, *s), np.float32) for k, s in shapes.items()}

    def close(self) -> None:
        self.ckpt.close()
        self.logger.close()


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    return x
