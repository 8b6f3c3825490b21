"""The Qwen3-MoE model family: config, parameters, the functional forward, KV cache, HF I/O."""

from quads_jax.models.config import ModelConfig
from quads_jax.models.hf import load_hf, read_config, save_hf
from quads_jax.models.kv_cache import KVCache
from quads_jax.models.nnx_model import Qwen3MoeForCausalLM
from quads_jax.models.transformer import (
    ForwardOutput,
    collect_site_inputs,
    forward,
    fuse_qkv,
    has_fused_qkv,
    init_params,
    layer_matmul_sites,
    param_sites,
    split_layer_groups,
)

__all__ = [
    "ForwardOutput",
    "collect_site_inputs",
    "KVCache",
    "ModelConfig",
    "Qwen3MoeForCausalLM",
    "forward",
    "fuse_qkv",
    "has_fused_qkv",
    "init_params",
    "layer_matmul_sites",
    "load_hf",
    "read_config",
    "save_hf",
    "param_sites",
    "split_layer_groups",
]
