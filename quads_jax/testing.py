"""Shared test helpers: a toy MoE config, the char tokenizer every test uses, and the cuda
lowering of a kernel under an abstract H200."""

from __future__ import annotations

from typing import Any

import numpy as np

from quads_jax.models.config import ModelConfig
from quads_jax.tokenizers import CharTokenizer


def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()


def tiny_config(**overrides: Any) -> ModelConfig:
    """4 layers (0, 2, 3 sparse MoE; 1 dense), hidden 64, GQA 4/2 of head_dim 16, 8 experts,
    top-2, vocab of the CharTokenizer. Every matmul K is a multiple of 16 (NVFP4 blocks)."""
    tok = CharTokenizer()
    kwargs: dict[str, Any] = dict(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=(1,),
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def padded_batch(
    rows: list[list[int]], pad_id: int = 0, *, left: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """tokens int32 ``[B, T]`` and mask bool ``[B, T]`` of ragged ``rows``, left or right padded."""
    t = max(len(r) for r in rows)
    tokens = np.full((len(rows), t), pad_id, np.int32)
    mask = np.zeros((len(rows), t), bool)
    for i, r in enumerate(rows):
        sl = slice(t - len(r), t) if left else slice(0, len(r))
        tokens[i, sl] = r
        mask[i, sl] = True
    return tokens, mask


def jit_forward():
    """``forward`` jitted with the config (and recipe, return_router) static, for tests."""
    import jax

    from quads_jax.models.transformer import forward

    static = ("recipe", "return_router", "remat", "unroll_layers", "pack_layer_vectors")
    return jax.jit(forward, static_argnums=0, static_argnames=static)


def lower_for_h200(fn, *args) -> str:
    """The StableHLO text of ``jax.jit(fn)(*args)`` exported for cuda under an abstract H200
    (no GPU needed): lowering every Pallas kernel for the device that CI does not have. The
    Mosaic GPU and Triton custom calls are allowed (they have no export compatibility
    guarantee)."""
    import jax
    from jax import export
    from jax.sharding import AbstractDevice, AbstractMesh

    h200 = AbstractMesh((), (), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", platform="gpu", num_cores=132))
    with jax.sharding.use_abstract_mesh(h200):
        exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    return exp.mlir_module()


def grouped_w4a4_case(seed: int):
    """A small grouped W4A4 call of the MoE decode shape: ``(x [12, 256] bf16 distinct rows,
    source_rows int32 [16] (some rows repeated, as a token's slots), kernel weights of 4
    experts [4, 128, 256], group_sizes [5, 0, 8, 3])`` (uneven, one empty group, 16 rows)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.layout import prepare_w4a4_weights
    from quads_jax.quant import nvfp4

    k = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(k[0], (12, 256), jnp.bfloat16)
    src = jnp.asarray([0, 3, 5, 1, 2, 7, 4, 9, 11, 6, 8, 10, 3, 1, 0, 2], jnp.int32)
    w = prepare_w4a4_weights(nvfp4.quantize(jax.random.normal(k[1], (4, 128, 256)),
                                            scale_mode="expert"))
    return x, src, w, jnp.asarray([5, 0, 8, 3], jnp.int32)


def pallas_calls(closed_jaxpr) -> list:
    """The ``pallas_call`` equations of a ``jax.make_jaxpr`` result, nested jaxprs (a jit's,
    a loop's) included: what a test reads to see which kernel a path really called."""
    import jax.extend

    def eqns(jx):
        for e in jx.eqns:
            yield e
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from eqns(sub)

    return [e for e in eqns(closed_jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
