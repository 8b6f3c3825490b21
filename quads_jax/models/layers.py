"""Building blocks of the Qwen3-MoE decoder: RMSNorm, RoPE, masked GQA attention, SwiGLU.

Precision follows transformers' Qwen3-MoE: norms and softmax in float32, RoPE angles in float32,
matmul operands in the compute dtype with float32 accumulation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from quads_jax.train.mesh import batch_axes_dividing

# Added to disallowed attention scores. Finite, so a query row that may attend to nothing (a
# left-pad query) gets a uniform, finite softmax instead of NaN; such rows are never used.
MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x) * scale`` over the last axis; computed in f32, returned in ``x.dtype``.

    x: ``[..., D]``; scale: ``[D]`` (any float dtype).
    """
    xf = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    normed = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return scale.astype(x.dtype) * normed


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin ``[B, T, head_dim]`` f32 for int positions ``[B, T]`` (HF "default" RoPE, the
    half-split layout: angle ``j`` and ``j + D/2`` are equal)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, heads, D]`` by the tables ``[B, T, D]``; f32 math, ``x.dtype`` out."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Grouped-query attention.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, KVH, S, D]`` (H a multiple of KVH; the KV cache's
        layout, so that neither matmul needs a transposed copy of the cache).
      allowed: bool ``[B, T, S]``: query t may attend to key slot s.
    Returns ``[B, T, H * D]`` in ``q.dtype``; scores and softmax in f32.
    """
    b, t, h, d = q.shape
    kvh = k.shape[1]
    # XLA:CPU has no BF16 x BF16 -> F32 kernel for these batched dots: there the operands go
    # up to f32, which changes no result (a product of two bf16 values is exact in f32).
    mm = jnp.float32 if jax.default_backend() == "cpu" else q.dtype
    qg = q.reshape(b, t, kvh, h // kvh, d).astype(mm)
    k = k.astype(q.dtype).astype(mm)
    v = v.astype(q.dtype).astype(mm)
    precision = jax.lax.Precision.HIGHEST if mm == jnp.float32 else None  # no TF32
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, precision=precision,
                        preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(d**-0.5)
    scores = jnp.where(allowed[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).astype(mm)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(b, t, h * d)


DECODE_ATTENTION_IMPLS = ("kernel", "jnp")
_decode_attention = {"impl": "kernel", "config": None}


def set_decode_attention(impl: str, config=None) -> None:
    """``kernel``: decode steps use the decode attention kernel where the backend allows it
    (the default); ``jnp``: always the jnp path (an ablation, or a GPU without Triton).
    ``config``: the kernel's ``DecodeAttentionConfig`` (None: its defaults). Takes effect at
    the next trace; a bad value raises ``ValueError`` and changes nothing."""
    if impl not in DECODE_ATTENTION_IMPLS:
        raise ValueError(f"set_decode_attention: impl={impl!r} must be one of "
                         f"{DECODE_ATTENTION_IMPLS}")
    from pallas_kernels.decode_attention import DecodeAttentionConfig

    if config is not None and not isinstance(config, DecodeAttentionConfig):
        raise ValueError(f"set_decode_attention: config={config!r} must be a "
                         "DecodeAttentionConfig or None")
    _decode_attention.update(impl=impl, config=config)


def decode_prefix_tiles(row_group: jax.Array, groups: int, prefix_slots: int):
    """The decode attention kernel's ``PrefixTiles`` of a decode step's rows (int32 ``[B]``
    groups in ``[0, groups)``) when its config reads a shared prefix of ``prefix_slots`` slots
    per group (``DecodeAttentionConfig.per_group``), else None: the same for all layers of the
    step, so the model builds them once per step."""
    if _decode_attention["impl"] == "jnp":
        return None
    from pallas_kernels import decode_attention as da

    config = _decode_attention["config"] or da.DecodeAttentionConfig()
    if not config.per_group(prefix_slots):
        return None
    return da.prefix_tiles(row_group, groups, config.prefix_rows)


def decode_attend(q: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: jax.Array,
                  valid: jax.Array, kv_len: jax.Array, backend: str,
                  prefix: tuple | None = None) -> jax.Array | None:
    """One decode token per row through the decode attention kernel, or None where the jnp
    path (``attend`` on the sliced layer) is the one to use.

    Args:
      q: ``[B, 1, H, D]``; k_all, v_all: the stacked cache ``[L, B, KVH, S, D]`` (already
        holding the new token); layer: int32 scalar; valid: bool or int32 ``[B, S]``; kv_len: int32
        scalar, slots ``>= kv_len`` are empty; backend: the recipe's ("auto": the kernel on a
        GPU; "interpret": the kernel in Pallas interpret mode; "reference": None);
      prefix: None or ``(k, v [L, G, KVH, P, D], valid [G, P], row_group int32 [B], tiles)``,
        slots each row's group shares (``decode_attention.SharedPrefix``; ``tiles``:
        ``decode_prefix_tiles`` or None).
    Returns ``[B, 1, H * D]`` in ``q.dtype`` or None.
    """
    from pallas_kernels import decode_attention as da  # here: the trainer never needs Pallas

    shared = None if prefix is None else da.SharedPrefix(*prefix)
    if (backend == "reference" or _decode_attention["impl"] == "jnp"
            or not da.supports(k_all, shared)):
        return None
    if backend == "auto" and jax.default_backend() != "gpu":
        return None
    b, _, h, d = q.shape
    kvh = k_all.shape[2]
    qg = q.reshape(b, kvh, h // kvh, d)
    config = _decode_attention["config"] or da.DecodeAttentionConfig()
    call = functools.partial(da.decode_attention, config=config,
                             interpret=backend == "interpret")
    mesh = jax.sharding.get_abstract_mesh()
    rows = batch_axes_dividing(mesh, b)
    if rows and shared is None:
        # Rows split over the mesh (the data-parallel rollout, ``sampler.sharding``): each
        # device's kernel on its own rows. XLA cannot split the kernel's custom call and
        # would gather every row's cache onto every device. (A shared prefix indexes groups
        # by global id: it runs unsplit.)
        row, cache = P(rows), P(None, rows)
        out = jax.shard_map(
            lambda q, k, v, layer, valid, kv_len: call(q, k, v, layer, valid, kv_len, None),
            mesh=mesh, in_specs=(row, cache, cache, P(), row, P()), out_specs=row,
            check_vma=False)(qg, k_all, v_all, layer, valid, kv_len)
    else:
        out = call(qg, k_all, v_all, layer, valid, kv_len, shared)
    return out.reshape(b, 1, h * d)


@jax.custom_vjp
def swiglu(gate_up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` of fused ``[..., 2I]`` (gate first), f32 math, input dtype out.

    Its gradient keeps only ``gate_up`` (input dtype) for the backward pass and recomputes
    the f32 terms there: autodiff kept five f32 ``[rows, I]`` arrays per MoE layer (in the H200
    trainer's HLO of session 27, four 1.07 GB buffers per mini-batch: written,
    zero-initialised and read)."""
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(gate_up.dtype)


def _swiglu_fwd(gate_up):
    return swiglu(gate_up), gate_up


def _swiglu_bwd(gate_up, dy):
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    dy = dy.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate)
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))  # d silu(g) / dg = s (1 + g (1 - s))
    d_up = dy * gate * sig
    return (jnp.concatenate([d_gate, d_up], axis=-1).astype(gate_up.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
