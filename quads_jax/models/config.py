"""ModelConfig: the Qwen3-MoE architecture, with transformers' ``Qwen3MoeConfig`` field names.

Conversion to and from the HF ``config.json`` dict lives here too, so that ``load_hf`` /
``save_hf`` and a hand-written YAML config describe a model in exactly the same words.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
HF_MODEL_TYPE = "qwen3_moe"
_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


def _dtype_name(d: Any) -> str:
    name = jnp.dtype(d).name
    if name not in _DTYPES:
        raise ValueError(f"dtype {d!r} is not supported; use one of {sorted(_DTYPES)}")
    return name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Qwen3-MoE transformer.

    Layer ``i`` is a sparse MoE layer when ``num_experts > 0``, ``i not in mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0`` (transformers' rule); otherwise a dense SwiGLU MLP of
    ``intermediate_size``. ``head_dim=None`` means ``hidden_size // num_attention_heads``.
    ``dtype`` is the compute dtype (activations, matmul operands), ``param_dtype`` the dtype of
    the master weights that ``init_params`` creates.
    """

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # frozen: normalise once, here
        set_("mlp_only_layers", tuple(int(i) for i in (self.mlp_only_layers or ())))
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        if self.head_dim is None and self.num_attention_heads > 0:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        set_("dtype", jnp.dtype(_DTYPES[_dtype_name(self.dtype)]))
        set_("param_dtype", jnp.dtype(_DTYPES[_dtype_name(self.param_dtype)]))
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "decoder_sparse_step",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelConfig.{name}={v!r}: must be an integer >= 1")
        for name in ("num_experts", "moe_intermediate_size", "num_experts_per_tok"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"ModelConfig.{name}={v!r}: must be an integer >= 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_key_value_heads={self.num_key_value_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim}: must be even for RoPE")
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok}: must be in "
                    f"[1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size < 1:
                raise ValueError(
                    f"ModelConfig.moe_intermediate_size={self.moe_intermediate_size}: must be "
                    ">= 1 when num_experts > 0"
                )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"ModelConfig.mlp_only_layers={self.mlp_only_layers}: indices {bad} are outside "
                f"[0, num_hidden_layers={self.num_hidden_layers})"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: must be > 0")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "initializer_range"):
            if not float(getattr(self, name)) >= 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: must be >= 0")
        if self.hidden_act != "silu":
            raise ValueError(f"ModelConfig.hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if self.attention_bias:
            raise ValueError("ModelConfig.attention_bias=True: Qwen3-MoE has no attention bias")

    # ---------------------------------------------------------------- layer structure
    def is_moe_layer(self, i: int) -> bool:
        """True when layer ``i`` holds a sparse MoE block (transformers' rule)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """``"moe"`` or ``"dense"`` for each layer."""
        return tuple("moe" if self.is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers))

    @property
    def num_moe_layers(self) -> int:
        return sum(k == "moe" for k in self.layer_kinds)

    @property
    def layer_groups(self) -> tuple[tuple[str, int, int], ...]:
        """Runs of consecutive layers of one kind: ``(kind, start, stop)``; one scan each."""
        groups: list[tuple[str, int, int]] = []
        for i, kind in enumerate(self.layer_kinds):
            if groups and groups[-1][0] == kind:
                groups[-1] = (kind, groups[-1][1], i + 1)
            else:
                groups.append((kind, i, i + 1))
        return tuple(groups)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Build from a transformers ``config.json`` dict (``model_type`` ``qwen3_moe``).

        Accepts both spellings transformers writes: ``num_experts`` / ``num_local_experts`` and
        ``rope_theta`` / ``rope_parameters.rope_theta``. Raises ValueError naming a missing or
        unsupported field.
        """
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a dict from config.json, got {type(d).__name__}")
        archs = d.get("architectures") or [HF_ARCHITECTURE]
        model_type = d.get("model_type", HF_MODEL_TYPE)
        if model_type != HF_MODEL_TYPE or HF_ARCHITECTURE not in archs:
            raise ValueError(
                f"config.json: model_type={model_type!r}, architectures={archs!r} is not "
                f"supported; expected model_type={HF_MODEL_TYPE!r} and {HF_ARCHITECTURE!r}"
            )
        d = dict(d)
        if "num_experts" not in d and "num_local_experts" in d:
            d["num_experts"] = d["num_local_experts"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"config.json: rope_parameters.rope_type={rope_type!r} is not supported; "
                "only 'default' RoPE"
            )
        if d.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported")
        required = (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_experts",
            "num_experts_per_tok", "rope_theta",
        )
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json: missing required field(s) {missing}")
        names = {f.name for f in dataclasses.fields(cls)} - {"dtype", "param_dtype"}
        kwargs = {k: d[k] for k in names if k in d and d[k] is not None}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "head_dim"):
            kwargs.setdefault(key, None)
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers ``config.json`` dict that ``Qwen3MoeForCausalLM`` loads."""
        d: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURE],
            "model_type": HF_MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "initializer_range": self.initializer_range,
            "hidden_act": self.hidden_act,
            "attention_bias": False,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
            ),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.dtype.name,
        }
        return d
