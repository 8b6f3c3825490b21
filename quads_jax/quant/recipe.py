"""QuantRecipe: which matmul mode runs at which site of the model.

A *site* names one weight matmul: ``embed``, ``lm_head``, ``layers.{i}.attn.{q,k,v,o}_proj``,
``layers.{i}.mlp.router``, ``layers.{i}.mlp.experts.gate_up``, ``layers.{i}.mlp.experts.down``,
``layers.{i}.mlp.gate_up`` / ``layers.{i}.mlp.down`` (dense MLP layers),
``layers.{i}.mlp.shared_expert.*`` (families that have one). A recipe is an ordered list of
``(fnmatch pattern, mode)`` rules; the first match wins, unmatched sites run ``default_mode``.
The trainer recipe and the rollout recipe are two instances of this one class (QUADS_SPEC
sections 3-5); named instances live in a registry (``get_recipe``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable

MODES = (
    "bf16",
    "w_fakequant_nvfp4",
    "w4a4_nvfp4",
    "w4a4_nvfp4_rac",
    "w4a16_nvfp4",
    "w_fakequant_fp8",
    "w8a8_fp8",
    "a_fakequant_nvfp4_w_fakequant_nvfp4",
)
NVFP4_WEIGHT_MODES = (
    "w_fakequant_nvfp4",
    "w4a4_nvfp4",
    "w4a4_nvfp4_rac",
    "w4a16_nvfp4",
    "a_fakequant_nvfp4_w_fakequant_nvfp4",
)
FP8_WEIGHT_MODES = ("w_fakequant_fp8", "w8a8_fp8")
RAC_SELECTIONS = ("online_batch", "static", "online_token")
RAC_SCORES = ("residual_l2", "residual_l1", "act_amax")
RAC_RESIDUAL_SCALES = ("separate", "shared")
RAC_RESIDUAL_FORMATS = ("nvfp4", "bf16")
KV_QUANTS = ("none", "float8_e4m3fn")
ACT_SCALE_MODES = ("per_token", "per_batch", "static")
BACKENDS = ("auto", "reference", "interpret")
# Sites that are never quantized whatever the rules say: their "matmul" is a table lookup.
ALWAYS_BF16 = ("embed",)
EXPERT_PATTERNS = ("layers.*.mlp.experts.*",)
ATTENTION_PATTERNS = ("layers.*.attn.*_proj",)
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"QuantRecipe.{name}={value!r}: must be one of {allowed}")


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """Ordered ``(pattern, mode)`` rules over site names plus the options of the modes.

    Attributes:
      rules: ``((fnmatch pattern, mode), ...)``; first match wins.
      default_mode: mode of sites that no rule matches ("bf16").
      also_attention: also apply ``attention_mode`` to ``layers.*.attn.*_proj``.
      attention_mode: the mode ``also_attention`` uses (None: the mode of the first rule).
      keep_first_n_bf16 / keep_last_n_bf16: layers ``< n`` / ``>= L - n`` stay bf16 (needs
        ``num_layers`` for the last-n option).
      num_layers: total layer count, needed only by ``keep_last_n_bf16``.
      rac_ratio: fraction of the K/16 blocks that RAC compensates (QUADS_SPEC section 4).
      rac_energy_target: when set (0, 1], the adaptive variant: compensate the fewest blocks
        whose residual energy reaches this fraction of the total (``rac_ratio`` then caps it).
      rac_selection, rac_score, rac_residual_scale, rac_residual_format: RAC options.
      act_scale_mode: activation global scale, per_token | per_batch | static (section 5).
      fp8_weight_granularity / fp8_act_granularity: FP8 scale granularity.
      backend: auto (Pallas kernels on GPU when registered) | reference (jnp) | interpret.
      kv_quant: "none" | "float8_e4m3fn": a forward without a KV cache (the trainer's) rounds
        keys (after RoPE) and values as an FP8 KV cache stores them (``kv_cache.to_cache_dtype``,
        straight-through gradient), so the trainer attends to what a rollout on an FP8 cache
        attends to (with a cache, attention always reads the cache's values).
    """

    rules: tuple[tuple[str, str], ...] = ()
    default_mode: str = "bf16"
    also_attention: bool = False
    attention_mode: str | None = None
    keep_first_n_bf16: int = 0
    keep_last_n_bf16: int = 0
    num_layers: int | None = None
    rac_ratio: float = 0.5
    rac_energy_target: float | None = None
    rac_selection: str = "online_batch"
    rac_score: str = "residual_l2"
    rac_residual_scale: str = "separate"
    rac_residual_format: str = "nvfp4"
    act_scale_mode: str = "per_token"
    fp8_weight_granularity: str = "channel"
    fp8_act_granularity: str = "token"
    backend: str = "auto"
    kv_quant: str = "none"
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple((str(p), str(m)) for p, m in self.rules))
        for i, (pattern, mode) in enumerate(self.rules):
            if mode not in MODES:
                raise ValueError(
                    f"QuantRecipe.rules[{i}]=({pattern!r}, {mode!r}): mode must be one of {MODES}"
                )
        _choice("default_mode", self.default_mode, MODES)
        if self.attention_mode is not None:
            _choice("attention_mode", self.attention_mode, MODES)
        for name in ("keep_first_n_bf16", "keep_last_n_bf16"):
            if getattr(self, name) < 0:
                raise ValueError(f"QuantRecipe.{name}={getattr(self, name)}: must be >= 0")
        if self.keep_last_n_bf16 and self.num_layers is None:
            raise ValueError(
                f"QuantRecipe.keep_last_n_bf16={self.keep_last_n_bf16}: needs num_layers "
                "(the model's num_hidden_layers) to know which layers are last"
            )
        if not 0.0 < self.rac_ratio <= 1.0:
            raise ValueError(f"QuantRecipe.rac_ratio={self.rac_ratio}: must be in (0, 1]")
        if self.rac_energy_target is not None and not 0.0 < self.rac_energy_target <= 1.0:
            raise ValueError(
                f"QuantRecipe.rac_energy_target={self.rac_energy_target}: must be in (0, 1] or None"
            )
        _choice("kv_quant", self.kv_quant, KV_QUANTS)
        _choice("rac_selection", self.rac_selection, RAC_SELECTIONS)
        _choice("rac_score", self.rac_score, RAC_SCORES)
        _choice("rac_residual_scale", self.rac_residual_scale, RAC_RESIDUAL_SCALES)
        _choice("rac_residual_format", self.rac_residual_format, RAC_RESIDUAL_FORMATS)
        _choice("act_scale_mode", self.act_scale_mode, ACT_SCALE_MODES)
        _choice("fp8_weight_granularity", self.fp8_weight_granularity, ("tensor", "channel"))
        _choice("fp8_act_granularity", self.fp8_act_granularity, ("tensor", "token"))
        _choice("backend", self.backend, BACKENDS)

    def mode_for(self, site: str) -> str:
        """The mode of ``site`` (e.g. ``layers.3.mlp.experts.gate_up``)."""
        if site in ALWAYS_BF16:
            return "bf16"
        m = _LAYER_RE.match(site)
        if m is not None:
            layer = int(m.group(1))
            if layer < self.keep_first_n_bf16:
                return "bf16"
            if self.keep_last_n_bf16 and layer >= self.num_layers - self.keep_last_n_bf16:
                return "bf16"
        for pattern, mode in self.rules:
            if fnmatch.fnmatchcase(site, pattern):
                return mode
        if self.also_attention and any(fnmatch.fnmatchcase(site, p) for p in ATTENTION_PATTERNS):
            return self.attention_mode or (self.rules[0][1] if self.rules else self.default_mode)
        return self.default_mode

    def replace(self, **changes) -> QuantRecipe:
        return dataclasses.replace(self, **changes)


def _experts(mode: str, name: str, **options) -> QuantRecipe:
    return QuantRecipe(rules=tuple((p, mode) for p in EXPERT_PATTERNS), name=name, **options)


_REGISTRY: dict[str, Callable[[], QuantRecipe]] = {
    "bf16": lambda: QuantRecipe(name="bf16"),
    "trainer_qat": lambda: _experts("w_fakequant_nvfp4", "trainer_qat"),
    "trainer_symmetric_qat": lambda: _experts(
        "a_fakequant_nvfp4_w_fakequant_nvfp4", "trainer_symmetric_qat"
    ),
    "rollout_nvfp4": lambda: _experts("w4a4_nvfp4", "rollout_nvfp4"),
    "rollout_quads": lambda: _experts("w4a4_nvfp4_rac", "rollout_quads"),
    "rollout_w4a16": lambda: _experts("w4a16_nvfp4", "rollout_w4a16"),
    "trainer_fp8": lambda: _experts("w_fakequant_fp8", "trainer_fp8"),
    "rollout_fp8": lambda: _experts("w8a8_fp8", "rollout_fp8"),
}


# The rollout precisions a user picks by name (``sample --precision``, the benchmarks' arms,
# ``quads_jax.sampler.floors``) and the registered recipe of each.
ROLLOUT_PRECISIONS = {
    "bf16": "bf16",
    "fp8": "rollout_fp8",
    "nvfp4": "rollout_nvfp4",
    "nvfp4_rac": "rollout_quads",
}


def register_recipe(name: str, factory: Callable[[], QuantRecipe]) -> None:
    """Add a named recipe (an experiment is then a config change)."""
    if name in _REGISTRY:
        raise ValueError(f"recipe name {name!r} is already registered")
    _REGISTRY[name] = factory


def recipe_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_recipe(name: str, **overrides) -> QuantRecipe:
    """The named recipe, with field ``overrides`` (e.g. ``rac_ratio=0.25``)."""
    if name not in _REGISTRY:
        raise ValueError(f"recipe name={name!r} is unknown; registered: {sorted(_REGISTRY)}")
    recipe = _REGISTRY[name]()
    return recipe.replace(**overrides) if overrides else recipe
