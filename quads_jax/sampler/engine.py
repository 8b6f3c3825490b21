"""The rollout engine: batched prefill, then a jitted decode loop over a preallocated KV cache.

``generate`` is one jitted program:

1. prefill: the left-padded prompt batch ``[B, P]`` runs through the model once and fills a
   fresh cache of ``P + max_new_tokens - 1`` slots (the last sampled token is never fed back).
   The prompt minus its last column goes first with its logits unused, so XLA drops the
   ``[B, P-1, vocab]`` lm_head product; the last column (always a real token under left padding)
   then yields the logits of the first response token;
2. group copy: for ``n_samples > 1`` the cache rows and the last logits are repeated along the
   batch (each prompt's samples are adjacent rows), so a prompt is prefilled once per group;
3. decode: ``lax.while_loop`` feeds one token per row per step, samples the next, and exits as
   soon as every row has hit a stop token or ``max_new_tokens``. Finished rows feed masked
   slots (``attention_mask`` False) so they never change what others see.

With ``prefill_chunk`` the prompts are prefilled that many at a time into the one preallocated
cache (bounded attention-score memory for large batches of long prompts). Rows that finish
early still ride along in this loop; ``quads_jax.sampler.compaction.generate_compacting`` drops
them from the batch between decode segments.

``prefill`` and ``decode`` are also exposed as two jitted calls over a ``DecodeState`` (the
decode call donates the state, so the cache is updated in place across the boundary): the
benchmark times them apart, and a caller can decode in segments.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax.config import check
from quads_jax.sampler.sampling import (
    DEFAULT_SAMPLER,
    SamplingParams,
    sample_tokens,
    validate_sampling,
)
from quads_jax.sampler.sharding import constrain_rows, constrain_state

FINISH_STOP = 1  # a stop / EOS token was sampled (it is part of the response)
FINISH_LENGTH = 2  # max_new_tokens reached
KV_CACHE_DTYPES = ("model", "bfloat16", "float32", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """What ``generate`` does; hashable, so it is a static argument of the jitted program.

    Attributes:
      max_new_tokens: response tokens per sequence, >= 1 (the cache holds prompt + this - 1).
      n_samples: responses per prompt (a GRPO group), >= 1; rows ``i*n .. i*n+n-1`` of the
        rollout belong to prompt ``i``.
      temperature, top_k, top_p, greedy, sampler: see
        ``quads_jax.sampler.sampling.SamplingParams``.
      stop_token_ids: ids that end a sequence (EOS and any other stop token); may be empty.
      pad_token_id: written after a sequence ends and in the prompt padding.
      return_expert_ids: also return the routed expert ids of every token (router replay).
      kv_cache_dtype: "model" (the model's compute dtype), "bfloat16", "float32" or
        "float8_e4m3fn" (FP8 keys and values, saturated at +-448 with a scale of 1: half the
        cache bytes, so half the decode attention's reads and twice the batch in memory; the
        rollout's attention then differs from the trainer's by that rounding unless the
        trainer recipe's ``kv_quant`` rounds the same way).
      unroll_decode_layers: the decode step runs its layers as a Python loop instead of a
        ``lax.scan`` (``models.forward(unroll_layers=True)``): every weight slice is static,
        so no dynamic-slice offsets per layer, at the price of a program ~L times larger to
        compile. Off by default: the 48-layer 30B-shaped decode program did not compile within
        270 s on the H200 host (2026-12-03); fine for small models.
      pack_decode_layer_vectors: the decode step's layer scan slices the per-layer norm vectors
        and layer ids as one packed array (``models.forward(pack_layer_vectors=True)``), so
        XLA:GPU copies one slice per layer instead of five (the ``memcpy32_post`` kernels,
        ~1.6 us each). Same numbers. On by default since its first GPU run (H100,
        2026-12-06, ca9aabb: nvfp4_rac at batch 128 with E4M3 scales 8.48 -> 8.40 ms per
        step, 1 045 -> 973 kernels).
      prefill_chunk: prefill this many prompts per pass (0: all at once); must divide the
        batch. Bounds prefill memory (attention scores) for large batches of long prompts.
      share_prompt_cache: the ``n_samples`` rows of a prompt share one copy of its prompt's
        keys and values (``KVCache`` prefix: each row holds only its response slots, and
        decode attention reads the prompt once per group's rows from the same buffer) instead
        of n copies: ``(n - 1) * P`` fewer cache slots per prompt. Same outputs (up to the
        order of attention's float additions); with continuous batching too.
    """

    max_new_tokens: int = 128
    n_samples: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    sampler: str = DEFAULT_SAMPLER
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    return_expert_ids: bool = False
    kv_cache_dtype: str = "model"
    prefill_chunk: int = 0
    unroll_decode_layers: bool = False
    share_prompt_cache: bool = False
    pack_decode_layer_vectors: bool = True

    def __post_init__(self) -> None:
        name = "SamplerConfig"
        for field in ("max_new_tokens", "n_samples"):
            value = getattr(self, field)
            check(name, field, value, isinstance(value, int) and value >= 1, "an int >= 1")
        validate_sampling(self.temperature, self.top_k, self.top_p, self.greedy, self.sampler)
        ids = self.stop_token_ids
        ok = isinstance(ids, tuple) and all(isinstance(i, int) and i >= 0 for i in ids)
        check(name, "stop_token_ids", ids, ok, "a tuple of token ids >= 0")
        pad = self.pad_token_id
        check(name, "pad_token_id", pad, isinstance(pad, int) and pad >= 0, "a token id >= 0")
        chunk = self.prefill_chunk
        check(name, "prefill_chunk", chunk, isinstance(chunk, int) and chunk >= 0,
              "an int >= 0 (0: the whole batch at once)")
        check(name, "kv_cache_dtype", self.kv_cache_dtype, self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"one of {list(KV_CACHE_DTYPES)}")
        for flag in ("unroll_decode_layers", "share_prompt_cache", "pack_decode_layer_vectors"):
            check(name, flag, getattr(self, flag), isinstance(getattr(self, flag), bool),
                  "True or False")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.greedy, self.sampler)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
    """The output of ``generate`` for ``R = B * n_samples`` rows and ``T = P + max_new_tokens``.

    Attributes:
      tokens: int32 ``[R, T]``: the left-padded prompt, then the response, then padding.
      logprobs: float32 ``[R, T]``: log-prob of each response token under the distribution it
        was sampled from; 0 elsewhere.
      response_mask: bool ``[R, T]``: True on response tokens (a final stop token included).
      attention_mask: bool ``[R, T]``: True on real tokens (prompt and response).
      finish_reason: int32 ``[R]``: ``FINISH_STOP`` or ``FINISH_LENGTH``.
      response_length: int32 ``[R]``.
      prompt_index: int32 ``[R]``: the prompt row each sample came from (its GRPO group).
      expert_ids: int32 ``[n_moe_layers, R, T, top_k]`` routed experts of each token as it was
        fed to the model, -1 for padding and for the last response token (never fed); None
        unless asked for.
      prompt_length: static P, the padded prompt width.
    """

    tokens: jax.Array
    logprobs: jax.Array
    response_mask: jax.Array
    attention_mask: jax.Array
    finish_reason: jax.Array
    response_length: jax.Array
    prompt_index: jax.Array
    expert_ids: jax.Array | None
    prompt_length: int = dataclasses.field(default=0, metadata={"static": True})

    @property
    def positions(self) -> jax.Array:
        """int32 ``[R, T]``: the position of each token (count of real tokens before it)."""
        return jnp.maximum(jnp.cumsum(self.attention_mask, axis=1, dtype=jnp.int32) - 1, 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the decode loop carries, for ``R`` rows and ``N = max_new_tokens``.

    Attributes:
      cache: the model's ``KVCache`` with ``R`` rows.
      step: int32 ``[]``: response tokens sampled so far (the next column to write).
      last_token: int32 ``[R]``: the latest sampled token, fed at the next step.
      prompt_length: int32 ``[R]``: real prompt tokens per row.
      done: bool ``[R]``; finish_reason: int32 ``[R]`` (0 while running).
      response_length: int32 ``[R]``: tokens sampled for each row so far (a stop token counts).
      tokens: int32 ``[R, N]``; logprobs: float32 ``[R, N]``.
      expert_ids: int32 ``[n_moe_layers, R, N, k]`` or None.
      prompt_expert_ids: int32 ``[n_moe_layers, R, P, k]`` or None.
      rng: the PRNG key for the remaining steps.
    """

    cache: Any
    step: jax.Array
    last_token: jax.Array
    prompt_length: jax.Array
    done: jax.Array
    finish_reason: jax.Array
    response_length: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    expert_ids: jax.Array | None
    prompt_expert_ids: jax.Array | None
    rng: jax.Array


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists into ``(tokens int32 [B, P], mask bool [B, P])``, P = longest."""
    if len(prompts) == 0:
        raise ValueError("prompts: an empty list; need at least one prompt")
    lengths = [len(p) for p in prompts]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
    width = max(lengths)
    tokens = np.full((len(prompts), width), pad_token_id, np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = np.asarray(p, np.int32)
        mask[i, width - len(p):] = True
    return tokens, mask


def _models():
    # Imported lazily: the model package imports the quant dispatch, which is heavy and is not
    # needed to build a SamplerConfig.
    from quads_jax import models

    return models


def _cache_dtype(config: SamplerConfig, model_config) -> jnp.dtype:
    if config.kv_cache_dtype == "model":
        return jnp.dtype(model_config.dtype)
    return jnp.dtype(config.kv_cache_dtype)


def _repeat_rows(cache, n: int):
    """Repeat every row of a KVCache n times (k, v rows on axis 1; mask rows on axis 0)."""
    if n == 1:
        return cache
    return dataclasses.replace(
        cache,
        k=jnp.repeat(cache.k, n, axis=1),
        v=jnp.repeat(cache.v, n, axis=1),
        mask=jnp.repeat(cache.mask, n, axis=0),
    )


def _mask_ids(ids: jax.Array, valid: jax.Array) -> jax.Array:
    """Expert ids ``[n_moe, R, T, k]`` with -1 where ``valid [R, T]`` is False."""
    return jnp.where(valid[None, :, :, None], ids.astype(jnp.int32), -1)


def _prefill_rows(params, prompts, prompt_mask, config, model_config, recipe):
    """Prefill ``prompts [b, P]`` into a fresh cache of ``P + max_new_tokens - 1`` slots.

    Returns ``(cache, logits [b, V] f32 of the last prompt token, expert ids
    [n_moe, b, P, k] with -1 on padding, or None)``.
    """
    models = _models()
    batch, width = prompts.shape
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1, dtype=jnp.int32) - 1, 0)
    cache = models.KVCache.init(model_config, batch, width + config.max_new_tokens - 1,
                                _cache_dtype(config, model_config))
    run = functools.partial(models.forward, model_config, params, recipe=recipe,
                            return_router=config.return_expert_ids)
    id_parts = []
    if width > 1:
        head = run(prompts[:, :-1], attention_mask=prompt_mask[:, :-1],
                   positions=positions[:, :-1], cache=cache)
        cache = head.cache
        id_parts.append(head.expert_ids)
    tail = run(prompts[:, -1:], attention_mask=prompt_mask[:, -1:], positions=positions[:, -1:],
               cache=cache)
    id_parts.append(tail.expert_ids)
    ids = None
    if config.return_expert_ids:
        ids = _mask_ids(jnp.concatenate(id_parts, axis=2), prompt_mask)
    return tail.cache, tail.logits[:, -1], ids


def _shared_prompt_cache(prompt_cache, n: int, max_new_tokens: int):
    """The decode cache of ``B * n`` rows over ``prompt_cache`` (B rows, the prompts' slots) as
    their shared prefix: each row's own slots (``max_new_tokens - 1``, at least 1) empty."""
    c = prompt_cache
    layers, groups, kvh, _, d = c.k.shape
    rows, slots = groups * n, max(max_new_tokens - 1, 1)
    return dataclasses.replace(
        c, k=jnp.zeros((layers, rows, kvh, slots, d), c.k.dtype),
        v=jnp.zeros((layers, rows, kvh, slots, d), c.v.dtype),
        mask=jnp.zeros((rows, slots), bool), length=jnp.zeros((), jnp.int32),
        prefix_k=c.k, prefix_v=c.v, prefix_mask=c.mask,
        row_group=jnp.repeat(jnp.arange(groups, dtype=jnp.int32), n))


def _prefill_batch(params, prompts, prompt_mask, config, model_config, recipe):
    """All rows, ``prefill_chunk`` prompts at a time; each prompt's cache repeated n times (or,
    with ``share_prompt_cache``, kept once as the rows' shared prefix).

    Returns ``(cache with B*n rows, logits [B*n, V], expert ids [n_moe, B, P, k] or None)``.
    """
    batch, n = prompts.shape[0], config.n_samples
    if config.share_prompt_cache:  # the prompts alone (max_new_tokens 1: P slots), once each
        cache, logits, ids = _prefill_batch(params, prompts, prompt_mask,
                                            dataclasses.replace(config, n_samples=1,
                                                                share_prompt_cache=False,
                                                                max_new_tokens=1),
                                            model_config, recipe)
        return (_shared_prompt_cache(cache, n, config.max_new_tokens),
                jnp.repeat(logits, n, axis=0), ids)
    chunk = config.prefill_chunk or batch
    if chunk >= batch:
        cache, logits, ids = _prefill_rows(params, prompts, prompt_mask, config, model_config,
                                           recipe)
        return _repeat_rows(cache, n), jnp.repeat(logits, n, axis=0), ids
    # Chunks write into one preallocated cache in place: peak memory is one chunk's
    # activations (attention scores grow with rows x prompt x slots) plus the full cache.
    part = jax.eval_shape(lambda p, m: _prefill_rows(params, p, m, config, model_config, recipe),
                          prompts[:chunk], prompt_mask[:chunk])
    c = part[0]
    cache = dataclasses.replace(
        c, k=jnp.zeros((c.k.shape[0], batch * n) + c.k.shape[2:], c.k.dtype),
        v=jnp.zeros((c.v.shape[0], batch * n) + c.v.shape[2:], c.v.dtype),
        mask=jnp.zeros((batch * n,) + c.mask.shape[1:], bool), length=jnp.int32(0))
    logits = jnp.zeros((batch * n,) + part[1].shape[1:], part[1].dtype)
    ids = None if part[2] is None else jnp.zeros(
        part[2].shape[:1] + (batch,) + part[2].shape[2:], jnp.int32)
    put = jax.lax.dynamic_update_slice_in_dim

    def body(i, carry):
        cache, logits, ids = carry
        rows = lambda a: jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=0)
        c, lg, id_ = _prefill_rows(params, rows(prompts), rows(prompt_mask), config,
                                   model_config, recipe)
        c, at = _repeat_rows(c, n), i * chunk * n
        cache = dataclasses.replace(cache, k=put(cache.k, c.k, at, axis=1),
                                    v=put(cache.v, c.v, at, axis=1),
                                    mask=put(cache.mask, c.mask, at, axis=0), length=c.length)
        logits = put(logits, jnp.repeat(lg, n, axis=0), at, axis=0)
        if ids is not None:
            ids = put(ids, id_, i * chunk, axis=1)
        return cache, logits, ids

    return jax.lax.fori_loop(0, batch // chunk, body, (cache, logits, ids))


def _prefill(params, prompts, prompt_mask, rng, config, model_config, recipe) -> DecodeState:
    n, max_new = config.n_samples, config.max_new_tokens
    prompts, prompt_mask = constrain_rows(prompts), constrain_rows(prompt_mask)  # under a mesh
    cache, logits, ids = _prefill_batch(params, prompts, prompt_mask, config, model_config,
                                        recipe)
    prompt_length = jnp.repeat(jnp.sum(prompt_mask, axis=1, dtype=jnp.int32), n)
    rows = prompts.shape[0] * n

    rng, key = jax.random.split(rng)
    token, logp = sample_tokens(key, logits, config.sampling)
    stopped = jnp.isin(token, jnp.asarray(config.stop_token_ids, jnp.int32))
    if max_new == 1:
        finish = jnp.where(stopped, FINISH_STOP, FINISH_LENGTH)
    else:
        finish = jnp.where(stopped, FINISH_STOP, 0)
    tokens = jnp.full((rows, max_new), config.pad_token_id, jnp.int32).at[:, 0].set(token)
    logprobs = jnp.zeros((rows, max_new), jnp.float32).at[:, 0].set(logp)

    expert_ids = prompt_ids = None
    if ids is not None:
        prompt_ids = jnp.repeat(ids, n, axis=1)
        expert_ids = jnp.full(ids.shape[:1] + (rows, max_new) + ids.shape[3:], -1, jnp.int32)
    return constrain_state(DecodeState(
        cache=cache, step=jnp.int32(1), last_token=token, prompt_length=prompt_length,
        done=finish > 0, finish_reason=finish.astype(jnp.int32),
        response_length=jnp.ones((rows,), jnp.int32), tokens=tokens,
        logprobs=logprobs, expert_ids=expert_ids, prompt_expert_ids=prompt_ids, rng=rng,
    ))


def _write_columns(buf: jax.Array, values: jax.Array, col: jax.Array, axis: int) -> jax.Array:
    """``buf`` with ``values`` (one entry per row, row axis ``axis - 1``) written at column
    ``col`` of axis ``axis``: a scalar ``col`` (every row at the same column: an in-place
    dynamic-update-slice), or int32 ``[R]`` per row (a scatter; a column past the end drops
    that row's write)."""
    if col.ndim == 0:
        return jax.lax.dynamic_update_slice_in_dim(buf, jnp.expand_dims(values, axis), col,
                                                   axis=axis)
    rows = jnp.arange(col.shape[0], dtype=jnp.int32)
    index = (slice(None),) * (axis - 1) + (rows, col)
    return buf.at[index].set(values, mode="drop")


def _decode_step(params, state: DecodeState, config, model_config, recipe,
                 per_row: bool = False) -> DecodeState:
    """One token per row. ``per_row``: rows are at different response columns (continuous
    batching, ``quads_jax.sampler.continuous``): each row's column is its
    ``response_length`` instead of the shared ``step``."""
    models = _models()
    active = ~state.done
    max_new = config.max_new_tokens
    # The fed token is response token col-1, at position prompt_length + col - 1.
    col = state.response_length if per_row else state.step
    positions = (state.prompt_length + col - 1)[:, None]
    out = models.forward(model_config, params, state.last_token[:, None],
                         attention_mask=active[:, None], positions=positions, recipe=recipe,
                         cache=state.cache, return_router=config.return_expert_ids,
                         unroll_layers=config.unroll_decode_layers,
                         pack_layer_vectors=config.pack_decode_layer_vectors)
    rng, key = jax.random.split(state.rng)
    token, logp = sample_tokens(key, out.logits[:, -1], config.sampling)
    token = jnp.where(active, token, config.pad_token_id)
    logp = jnp.where(active, logp, 0.0)
    stopped = active & jnp.isin(token, jnp.asarray(config.stop_token_ids, jnp.int32))
    at_length = active & (col + 1 >= max_new)
    finish = jnp.where(stopped, FINISH_STOP, jnp.where(at_length, FINISH_LENGTH,
                                                       state.finish_reason))
    if per_row:  # finished rows write nothing (their column is past the end: dropped)
        col = jnp.where(active, col, max_new)
    expert_ids = state.expert_ids
    if expert_ids is not None:
        fed = _mask_ids(out.expert_ids, active[:, None])
        expert_ids = _write_columns(expert_ids, fed[:, :, 0], col - 1, axis=2)
    return dataclasses.replace(
        state,
        cache=out.cache,
        step=state.step + 1,
        last_token=token,
        done=state.done | stopped | at_length,
        finish_reason=finish.astype(jnp.int32),
        response_length=jnp.where(active, col + 1, state.response_length),
        tokens=_write_columns(state.tokens, token, col, axis=1),
        logprobs=_write_columns(state.logprobs, logp, col, axis=1),
        expert_ids=expert_ids,
        rng=rng,
    )


def _decode_loop(params, state, max_steps, config, model_config, recipe,
                 per_row: bool = False) -> DecodeState:
    """Decode until every row is done or ``max_steps`` (int32 ``[]``) more steps have run.
    ``per_row``: see ``_decode_step``; ``step`` then counts steps run, not a column."""
    stop_at = state.step + max_steps
    if not per_row:
        stop_at = jnp.minimum(config.max_new_tokens, stop_at)

    def cond(s: DecodeState):
        return (s.step < stop_at) & ~jnp.all(s.done)

    def body(s: DecodeState):
        return constrain_state(_decode_step(params, s, config, model_config, recipe, per_row))

    return jax.lax.while_loop(cond, body, constrain_state(state))


def _finish(state: DecodeState, prompts, prompt_mask, config) -> Rollout:
    n = config.n_samples
    prompts = jnp.repeat(prompts, n, axis=0)
    prompt_mask = jnp.repeat(prompt_mask, n, axis=0)
    columns = jnp.arange(config.max_new_tokens, dtype=jnp.int32)
    response = columns[None, :] < state.response_length[:, None]
    expert_ids = None
    if state.expert_ids is not None:
        expert_ids = jnp.concatenate([state.prompt_expert_ids, state.expert_ids], axis=2)
    return Rollout(
        tokens=jnp.concatenate([jnp.where(prompt_mask, prompts, config.pad_token_id),
                                jnp.where(response, state.tokens, config.pad_token_id)], axis=1),
        logprobs=jnp.concatenate([jnp.zeros(prompts.shape, jnp.float32),
                                  jnp.where(response, state.logprobs, 0.0)], axis=1),
        response_mask=jnp.concatenate([jnp.zeros(prompts.shape, bool), response], axis=1),
        attention_mask=jnp.concatenate([prompt_mask, response], axis=1),
        # Rows still running when a segmented decode stopped early count as cut by length.
        finish_reason=jnp.where(state.done, state.finish_reason, FINISH_LENGTH),
        response_length=state.response_length,
        prompt_index=jnp.repeat(jnp.arange(prompts.shape[0] // n, dtype=jnp.int32), n),
        expert_ids=expert_ids,
        prompt_length=prompts.shape[1],
    )


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_inputs(prompts, prompt_mask, config: SamplerConfig, model_config):
    """Validate and normalise ``(prompts int32 [B, P], prompt_mask bool [B, P])``."""
    if not isinstance(config, SamplerConfig):
        raise ValueError(f"config: expected a SamplerConfig, got {type(config).__name__}")
    if not hasattr(prompts, "shape"):
        prompts = np.asarray(prompts)
    if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(f"prompts: expected integer token ids [batch, prompt_len], got shape "
                         f"{tuple(prompts.shape)} dtype {prompts.dtype}; use left_pad() for lists")
    batch, width = prompts.shape
    if batch == 0 or width == 0:
        raise ValueError(f"prompts: shape {(batch, width)} is empty; need >= 1 prompt of >= 1 token")
    if config.prefill_chunk and batch % config.prefill_chunk:
        raise ValueError(f"prompts: batch {batch} is not a multiple of SamplerConfig."
                         f"prefill_chunk={config.prefill_chunk}")
    if prompt_mask is None:
        prompt_mask = np.ones((batch, width), bool)
    if tuple(prompt_mask.shape) != (batch, width):
        raise ValueError(f"prompt_mask: shape {tuple(prompt_mask.shape)} != prompts shape "
                         f"{(batch, width)}")
    context = model_config.max_position_embeddings
    if width + config.max_new_tokens > context:
        raise ValueError(
            f"prompts: padded prompt length {width} + max_new_tokens {config.max_new_tokens} = "
            f"{width + config.max_new_tokens} exceeds the model context "
            f"max_position_embeddings={context}")
    if _is_concrete(prompts) and _is_concrete(prompt_mask):
        mask = np.asarray(prompt_mask, bool)
        empty = np.flatnonzero(~mask.any(axis=1))
        if empty.size:
            raise ValueError(f"prompts: row {int(empty[0])} is empty (prompt_mask has no real "
                             "token); every prompt needs at least one token")
        ragged = np.flatnonzero(np.any(mask[:, :-1] & ~mask[:, 1:], axis=1))
        if ragged.size:
            raise ValueError(f"prompt_mask: row {int(ragged[0])} is not left-padded (a real token "
                             "before a pad); use left_pad()")
        ids = np.asarray(prompts)[mask]
        vocab = model_config.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ValueError(f"prompts: token id {bad} is outside [0, vocab_size={vocab})")
    return jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_mask, bool)


_STATIC = ("config", "model_config", "recipe")
# XLA options of the programs that run the decode loop (a while loop around a scan over the
# stacked layers). With XLA's Triton GEMM fusions, every step copied each layer's four attention
# projections out of the stacked weights before multiplying (192 copies, 1.2 ms of a 21 ms step
# of the 30B shape at batch 128 on the H200); cuBLAS GEMMs with dynamic-slice fusion read them
# in place: 21.15 -> 20.11 ms (2026-12-03, docs/BENCHMARKS.md). The prefill program keeps XLA's
# defaults (under these options its tokens/s fell 22.0k -> 16.8k); `generate` compiles prefill
# and decode as one program, where the decode loop's time dominates. GPU-only options: the CPU
# backend ignores them.
# XLA's dot merger turned a layer's q, k and v projections (one shared input) into one GEMM on
# the weights concatenated anew at every step: a 21 MB copy per layer, 13 us of a decode step's
# ~420 us per layer (2026-12-03 trace, every arm); three GEMMs read the weights in place, and
# a synced tree holds them stacked once (``models.fuse_qkv``): one GEMM, no copy.
# XLA runs the decode step's kernels as CUDA graphs (command buffers); by default (LHS) each
# graph is a chain. CONCURRENT makes it a DAG of the kernels' data dependencies, so small
# latency-bound kernels that do not wait on each other can run side by side (a MoE layer's RAC
# row pass needs only the normed hidden state, not the router's top-k, slot sort or tile plan;
# which kernels overlap is not known: session 46's trace with the graphs kept, `h200_next.sh
# cprof`, gives each kernel's span, not what ran side by side): on an H100 (2026-12-07, 24 layers,
# batch 128, docs/BENCHMARKS.md "Session 45") nvfp4_rac 8.34 -> 8.14 ms, nvfp4 7.96 -> 7.78,
# fp8 9.71 -> 9.46, bf16 16.16 -> 16.14 (few small kernels). CONCURRENT_REGIONS failed to
# compile (an XLA RET_CHECK: "Concurrent region ids are not monotonic").
DECODE_COMPILER_OPTIONS = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_enable_dynamic_slice_fusion": True,
    "xla_disable_hlo_passes": "dot-merger",
    "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
}


@functools.partial(jax.jit, static_argnames=_STATIC, compiler_options=DECODE_COMPILER_OPTIONS)
def _generate_jit(params, prompts, prompt_mask, rng, *, config, model_config, recipe) -> Rollout:
    state = _prefill(params, prompts, prompt_mask, rng, config, model_config, recipe)
    state = _decode_loop(params, state, jnp.int32(config.max_new_tokens), config, model_config,
                         recipe)
    return _finish(state, prompts, prompt_mask, config)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill_jit(params, prompts, prompt_mask, rng, *, config, model_config, recipe):
    return _prefill(params, prompts, prompt_mask, rng, config, model_config, recipe)


@functools.partial(jax.jit, static_argnames=_STATIC + ("per_row",), donate_argnames=("state",),
                   compiler_options=DECODE_COMPILER_OPTIONS)
def _decode_jit(params, state, max_steps, *, config, model_config, recipe, per_row=False):
    return _decode_loop(params, state, max_steps, config, model_config, recipe, per_row)


@functools.partial(jax.jit, static_argnames=("config",))
def _finish_jit(state, prompts, prompt_mask, *, config):
    return _finish(state, prompts, prompt_mask, config)


def generate(
    rollout_params,
    prompts,
    rng: jax.Array,
    config: SamplerConfig,
    *,
    model_config,
    recipe=None,
    prompt_mask=None,
) -> Rollout:
    """Sample ``config.n_samples`` responses for every prompt, in one jitted program.

    Args:
      rollout_params: the model's parameter tree; leaves may be master arrays or packed
        ``NVFP4Tensor`` / ``FP8Tensor`` (from ``quads_jax.sampler.sync.sync``).
      prompts: int ``[B, P]`` token ids, left-padded (see ``left_pad``).
      rng: a PRNG key; the same key gives the same rollout.
      config: the sampler config.
      model_config: the ``quads_jax.models.ModelConfig`` (static).
      recipe: the rollout ``QuantRecipe`` (static); None runs the leaves as they are.
      prompt_mask: bool ``[B, P]`` True on real tokens; None means no padding.

    Returns:
      a ``Rollout`` of ``B * n_samples`` rows.
    """
    prompts, prompt_mask = _check_inputs(prompts, prompt_mask, config, model_config)
    return _generate_jit(rollout_params, prompts, prompt_mask, rng, config=config,
                         model_config=model_config, recipe=recipe)


def prefill(rollout_params, prompts, rng, config: SamplerConfig, *, model_config, recipe=None,
            prompt_mask=None) -> DecodeState:
    """The prefill half of ``generate`` (same arguments): the first token of every row sampled."""
    prompts, prompt_mask = _check_inputs(prompts, prompt_mask, config, model_config)
    return _prefill_jit(rollout_params, prompts, prompt_mask, rng, config=config,
                        model_config=model_config, recipe=recipe)


def decode(rollout_params, state: DecodeState, config: SamplerConfig, *, model_config,
           recipe=None, max_steps: int | None = None) -> DecodeState:
    """Continue decoding ``state`` (donated: do not reuse it) for up to ``max_steps`` steps.

    Stops early when every row is done; None runs to ``max_new_tokens``.
    """
    steps = config.max_new_tokens if max_steps is None else max_steps
    check("decode", "max_steps", steps, isinstance(steps, int) and steps >= 0, "an int >= 0")
    return _decode_jit(rollout_params, state, jnp.int32(steps), config=config,
                       model_config=model_config, recipe=recipe)


def finish(state: DecodeState, prompts, config: SamplerConfig, *, prompt_mask=None) -> Rollout:
    """Assemble the ``Rollout`` of a (possibly partly) decoded state; rows still running are
    reported with ``FINISH_LENGTH``."""
    prompts = jnp.asarray(prompts, jnp.int32)
    if prompt_mask is None:
        prompt_mask = jnp.ones(prompts.shape, bool)
    return _finish_jit(state, prompts, jnp.asarray(prompt_mask, bool), config=config)


def compile_generate(rollout_params, prompts, rng, config: SamplerConfig, *, model_config,
                     recipe=None, prompt_mask=None):
    """Compile ``generate`` ahead of time for these shapes (to time compilation and running
    apart). Returns ``run(rollout_params, prompts, prompt_mask, rng) -> Rollout``."""
    prompts, prompt_mask = _check_inputs(prompts, prompt_mask, config, model_config)
    compiled = _generate_jit.lower(rollout_params, prompts, prompt_mask, rng, config=config,
                                   model_config=model_config, recipe=recipe).compile()

    def run(rollout_params, prompts, prompt_mask, rng) -> Rollout:
        return compiled(rollout_params, jnp.asarray(prompts, jnp.int32),
                        jnp.asarray(prompt_mask, bool), rng)

    return run
