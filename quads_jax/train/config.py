"""The top-level config of ``python -m quads_jax.train``: one section per part, plus the arm.

An *arm* is a trainer recipe + a rollout recipe by name (``quads_jax.quant.recipe``):

=================  ========================  =================
arm                trainer recipe            rollout recipe
=================  ========================  =================
bf16               bf16                      bf16
fp8                trainer_fp8               rollout_fp8
naive_nvfp4        bf16                      rollout_nvfp4
qat_only           trainer_qat               rollout_nvfp4
quads              trainer_qat               rollout_quads
w4a16              trainer_qat               rollout_w4a16
symmetric_qat      trainer_symmetric_qat     rollout_nvfp4
=================  ========================  =================
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from quads_jax.config import check, check_choice
from quads_jax.models.config import ModelConfig
from quads_jax.rl.grpo import GRPOConfig
from quads_jax.rl.rewards import RewardConfig
from quads_jax.rl.tasks import TaskConfig
from quads_jax.sampler.engine import KV_CACHE_DTYPES
from quads_jax.sampler.sampling import DEFAULT_SAMPLER, SAMPLERS
from quads_jax.train.checkpoint import CheckpointConfig
from quads_jax.train.mesh import MeshConfig
from quads_jax.train.state import OptimizerConfig

ARMS: dict[str, tuple[str, str]] = {
    "bf16": ("bf16", "bf16"),
    "fp8": ("trainer_fp8", "rollout_fp8"),
    "naive_nvfp4": ("bf16", "rollout_nvfp4"),
    "qat_only": ("trainer_qat", "rollout_nvfp4"),
    "quads": ("trainer_qat", "rollout_quads"),
    "w4a16": ("trainer_qat", "rollout_w4a16"),
    "symmetric_qat": ("trainer_symmetric_qat", "rollout_nvfp4"),
}


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which model and tokenizer.

    Attributes:
      init: ``random`` (from ``config``) or ``hf`` (``load_hf(hf_path)``; ``config`` ignored).
      hf_path: a local HF checkpoint directory for ``init: hf``.
      tokenizer: ``char`` (built-in; vocab size and special ids are set from it) or a local
        HF tokenizer directory.
      config: the architecture for ``init: random`` (transformers' Qwen3MoeConfig names).
    """

    init: Literal["random", "hf"] = "random"
    hf_path: str = ""
    tokenizer: str = "char"
    config: ModelConfig = dataclasses.field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        check_choice("ModelSection", "init", self.init, ("random", "hf"))
        check("ModelSection", "hf_path", self.hf_path, self.init != "hf" or bool(self.hf_path),
              "a local HF checkpoint directory when init is 'hf'")


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Sampling during RL (the group size G is ``grpo.num_generations``).

    Attributes:
      prompts_per_step: prompts per RL step (batch = prompts_per_step * G responses).
      max_new_tokens: response length limit.
      temperature, top_k, top_p: sampling.
      sampler: how a token is drawn (``quads_jax.sampler.sampling.SAMPLERS``): "inverse_cdf"
        (two uniforms per row) or "gumbel" (``jax.random.categorical``).
      calibration_prompts: with a static RAC selection or activation scale in the rollout
        recipe, the calibration batch of each weight sync: BOS + prompt + demonstration of
        the first this-many training examples, each cut to the shortest one's length (the
        calibration scores every token, so there is no padding).
      calibration_every: calibrate at every this-many-th weight sync and reuse the last
        calibration in between (1: at every sync).
      kv_cache_dtype: the rollout's KV cache (``SamplerConfig.kv_cache_dtype``): "model" or
        e.g. "float8_e4m3fn" (half the cache bytes). With FP8 the trainer's attention rounds
        its keys and values the same way (``QuantRecipe.kv_quant``, straight-through), so the
        two sides stay aligned; ``recipe_overrides.kv_quant=none`` is the unaligned ablation.
      decode_rows: 0 samples a step's responses as one batch (``sampler.generate``); N > 0
        decodes them on N rows with continuous batching (``sampler.generate_continuous``:
        rows that end are refilled with waiting prompts; rounded down to whole groups of G).
        For steps with more responses than fit in memory at once, or with long-tailed lengths.
      segment_steps: with ``decode_rows``, decode steps between refills.
      share_prompt_cache: a prompt's G responses share one copy of its prompt's KV cache
        (``SamplerConfig.share_prompt_cache``), with or without ``decode_rows``.
    """

    prompts_per_step: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    sampler: str = DEFAULT_SAMPLER
    calibration_prompts: int = 8
    calibration_every: int = 1
    kv_cache_dtype: str = "model"
    decode_rows: int = 0
    segment_steps: int = 32
    share_prompt_cache: bool = False

    def __post_init__(self) -> None:
        own = "RolloutSection"
        check(own, "prompts_per_step", self.prompts_per_step, self.prompts_per_step >= 1,
              "an integer >= 1")
        check(own, "max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1,
              "an integer >= 1")
        check(own, "temperature", self.temperature, self.temperature > 0, "a number > 0")
        check_choice(own, "sampler", self.sampler, sorted(SAMPLERS))
        check(own, "calibration_prompts", self.calibration_prompts,
              self.calibration_prompts >= 1, "an integer >= 1")
        check(own, "calibration_every", self.calibration_every, self.calibration_every >= 1,
              "an integer >= 1")
        check(own, "kv_cache_dtype", self.kv_cache_dtype, self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"one of {list(KV_CACHE_DTYPES)}")
        check(own, "decode_rows", self.decode_rows, self.decode_rows >= 0,
              "an integer >= 0 (0: one batch per step)")
        check(own, "segment_steps", self.segment_steps, self.segment_steps >= 1,
              "an integer >= 1")


@dataclasses.dataclass(frozen=True)
class RLSection:
    """The RL schedule.

    Attributes:
      steps: RL steps (0: SFT only).
      num_minibatches: optimizer updates per RL step (the batch is split evenly).
      eval_every: evaluate every N RL steps (and before the first and after the last).
      eval_prompts: held-out prompts per evaluation (<= task.num_eval).
      eval_samples: k, samples per prompt; pass@1 is the mean correctness over k.
      eval_temperature: sampling temperature of the evaluation.
      analysis_every: run the layer-wise error analysis every N RL steps (0: off).
      aux_loss_coef: weight of the router load-balancing loss in the RL loss.
    """

    steps: int = 20
    num_minibatches: int = 1
    eval_every: int = 10
    eval_prompts: int = 32
    eval_samples: int = 4
    eval_temperature: float = 1.0
    analysis_every: int = 10
    aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        own = "RLSection"
        check(own, "steps", self.steps, self.steps >= 0, "an integer >= 0")
        check(own, "num_minibatches", self.num_minibatches, self.num_minibatches >= 1,
              "an integer >= 1")
        check(own, "eval_every", self.eval_every, self.eval_every >= 1, "an integer >= 1")
        check(own, "eval_prompts", self.eval_prompts, self.eval_prompts >= 1, "an integer >= 1")
        check(own, "eval_samples", self.eval_samples, self.eval_samples >= 1, "an integer >= 1")
        check(own, "eval_temperature", self.eval_temperature, self.eval_temperature > 0,
              "a number > 0")
        check(own, "analysis_every", self.analysis_every, self.analysis_every >= 0,
              "an integer >= 0")


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """Supervised warm start on task demonstrations (0 steps: off).

    Attributes:
      steps: optimizer steps.
      batch_size: demonstrations per step.
      optimizer: its own AdamW settings (usually a larger lr than RL).
    """

    steps: int = 0
    batch_size: int = 32
    optimizer: OptimizerConfig = dataclasses.field(
        default_factory=lambda: OptimizerConfig(lr=3e-3, warmup_steps=10, schedule="cosine"))

    def __post_init__(self) -> None:
        check("SFTSection", "steps", self.steps, self.steps >= 0, "an integer >= 0")
        check("SFTSection", "batch_size", self.batch_size, self.batch_size >= 1, "an integer >= 1")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything ``python -m quads_jax.train`` needs.

    Attributes:
      run_dir: where metrics, TensorBoard events, checkpoints and plots go.
      seed: seeds init, data order and sampling.
      arm: a key of :data:`ARMS`.
      trainer_recipe / rollout_recipe: override the arm's recipe names ("" = the arm's).
      recipe_overrides: QuantRecipe field overrides for both recipes (e.g. ``rac_ratio``).
      console / tensorboard: logging outputs (JSONL is always written).
    """

    run_dir: str = "runs/default"
    seed: int = 0
    arm: Literal["bf16", "fp8", "naive_nvfp4", "qat_only", "quads", "w4a16",
                 "symmetric_qat"] = "quads"
    trainer_recipe: str = ""
    rollout_recipe: str = ""
    recipe_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    rl: RLSection = dataclasses.field(default_factory=RLSection)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    console: bool = True
    tensorboard: bool = True

    def __post_init__(self) -> None:
        check_choice("TrainConfig", "arm", self.arm, tuple(ARMS))
        from quads_jax.quant.recipe import QuantRecipe, recipe_names

        for field in ("trainer_recipe", "rollout_recipe"):
            name = getattr(self, field)
            check("TrainConfig", field, name, not name or name in recipe_names(),
                  f"'' (the arm's) or one of {list(recipe_names())}")
        fields = {f.name for f in dataclasses.fields(QuantRecipe)}
        bad = sorted(set(self.recipe_overrides) - fields)
        check("TrainConfig", "recipe_overrides", self.recipe_overrides, not bad,
              f"QuantRecipe fields {sorted(fields)}")
        check("TrainConfig", "rl.num_minibatches", self.rl.num_minibatches,
              (self.rollout.prompts_per_step * self.grpo.num_generations)
              % self.rl.num_minibatches == 0,
              f"a divisor of prompts_per_step * num_generations = "
              f"{self.rollout.prompts_per_step * self.grpo.num_generations}")
        check("TrainConfig", "rl.eval_prompts", self.rl.eval_prompts,
              self.rl.eval_prompts <= self.task.num_eval or self.task.name == "jsonl",
              f"<= task.num_eval = {self.task.num_eval}")

    @property
    def recipe_names(self) -> tuple[str, str]:
        """(trainer recipe name, rollout recipe name) after overrides."""
        trainer, rollout = ARMS[self.arm]
        return self.trainer_recipe or trainer, self.rollout_recipe or rollout
