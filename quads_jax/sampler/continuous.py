"""Continuous batching: a fixed number of decode rows, refilled with waiting prompts as rows end.

An RL step samples many more responses than a decode batch holds, and their lengths differ
wildly. ``generate`` decodes a batch until its longest row ends (finished rows ride along);
``generate_compacting`` shrinks the batch as rows end. ``generate_continuous`` keeps
``batch_rows`` rows busy: it decodes in segments of ``segment_steps``; between segments the
rows that ended are read back, and waiting prompts (whole GRPO groups: a prompt is prefilled
once and its cache rows repeated ``n_samples`` times, as in ``generate``) are prefilled and
take their rows. When no prompt is left and the running rows fit in half the batch, the batch
shrinks as in ``generate_compacting``.

Why a dense cache and not pages: every row of ``KVCache`` shares the slot index ``length``
(the decode attention kernel reads one contiguous ``[S, D]`` slab per row and KV head). Rows
that join write their prompts (``P`` slots wide, left-padded) to slots ``[length - P,
length)`` of their rows (``_join``: a scatter of those rows alone) and decode on from
``length``, as the other rows do. Keys carry their rotary position, and attention is a masked
sum over slots, so a row's slots may also move as long as their order and mask do: when the
slots would run out (``length + segment_steps`` past the capacity; or when rows join while
``length < P``: they are written to their first slots), ``_rebuild`` moves every running
row's real slots to end at the new
``length`` = the longest row's count (one slot gather, a layer at a time so the cache is not
copied whole). The capacity is ``P + max_new_tokens - 1 + spare_slots``: a running row holds
at most ``P + max_new_tokens - 2`` slots, so after a rebuild there is room for
``spare_slots + 1`` steps; more spare slots, fewer rebuilds. A rebuild reads and writes the
whole cache (at the 30B shape, batch 128, 1k context: ~33 GB, ~10 ms at the H200's
bandwidth, against ~0.5 s for a 32-step segment; an estimate, not yet timed). A paged cache
would avoid it (the page table moves, not the keys) at the price of a decode attention kernel
that follows a page table.

With ``SamplerConfig.share_prompt_cache`` the prompts live in the cache's prefix rows (one
per group, ``2 * batch_rows / n`` of them) and a row's own slots hold only its response: a
group joins by writing its prefix row and its rows' fields (``_join_groups``), and a prefix row
is reused once all n rows of its group have ended.

Sampling draws one key per step for the whole batch (as ``generate`` does), so sampled
responses differ from ``generate``'s while greedy decoding gives the same tokens (up to the
order of the float additions in attention); a given rng gives the same rollout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax.config import check
from quads_jax.sampler import engine
from quads_jax.sampler.compaction import _ROW_FIELDS, _bucket, _gather_rows
from quads_jax.sampler.engine import DecodeState, Rollout, SamplerConfig

# Per-row fields copied from a prefilled state into the rows it joins, with their row axis:
# the ones compaction moves.
_JOIN_FIELDS = _ROW_FIELDS
# Fields read back when a row ends.
_RESULT_FIELDS = ("finish_reason", "response_length", "tokens", "logprobs", "expert_ids",
                  "prompt_expert_ids")


@dataclasses.dataclass(frozen=True)
class Segment:
    """One decode segment: rows in the batch, rows holding a sequence at its start (a row that
    joined already finished counts until it is read back), rows that joined just before it,
    decode steps run, and whether the cache slots were rebuilt before it."""

    rows: int
    running: int
    joined: int
    steps: int
    rebuilt: bool


def row_steps(segments: list[Segment]) -> int:
    """Decode rows x steps over ``segments``, each row's first token (sampled at its prefill)
    counted as one: a batch of B rows decoding N tokens each is ``B * N``, as ``generate``'s
    batch x its longest response. Response tokens over this is the batch's utilisation."""
    return sum(s.rows * s.steps + s.joined for s in segments)


def batch_row_steps(response_length) -> int:
    """``row_steps`` of one ``generate`` batch: its rows x its longest response (the loop runs
    until the longest row ends; the first token, sampled at prefill, counted as one)."""
    lengths = np.asarray(response_length)
    return lengths.size * int(lengths.max())


def _idle_state(template: DecodeState, rows: int, slots: int, groups: int = 0) -> DecodeState:
    """A batch of ``rows`` idle rows (done, empty cache) shaped like ``template`` (an abstract
    prefill state of one prompt), with ``slots`` cache slots per row; with a shared prompt
    cache also ``groups`` empty prefix rows."""
    def per_row(x, axis, fill):
        return jnp.full(_with_rows(x, rows, axis), fill, x.dtype)

    def rows_slots(x, n, s):  # [L, n, KVH, s, D] zeros like x
        return jnp.zeros(x.shape[:1] + (n,) + x.shape[2:3] + (s,) + x.shape[4:], x.dtype)

    c = template.cache
    cache = dataclasses.replace(
        c, k=rows_slots(c.k, rows, slots), v=rows_slots(c.v, rows, slots),
        mask=jnp.zeros((rows, slots), bool), length=jnp.zeros((), jnp.int32))
    if c.has_prefix:
        width = c.prefix_k.shape[3]
        cache = dataclasses.replace(
            cache, prefix_k=rows_slots(c.prefix_k, groups, width),
            prefix_v=rows_slots(c.prefix_v, groups, width),
            prefix_mask=jnp.zeros((groups, width), bool),
            row_group=jnp.zeros((rows,), jnp.int32))
    t = template
    ids = lambda x: None if x is None else per_row(x, 1, -1)
    return DecodeState(
        cache=cache, step=jnp.zeros((), jnp.int32), last_token=per_row(t.last_token, 0, 0),
        prompt_length=per_row(t.prompt_length, 0, 1), done=per_row(t.done, 0, True),
        finish_reason=per_row(t.finish_reason, 0, 0),
        response_length=per_row(t.response_length, 0, 0), tokens=per_row(t.tokens, 0, 0),
        logprobs=per_row(t.logprobs, 0, 0.0), expert_ids=ids(t.expert_ids),
        prompt_expert_ids=ids(t.prompt_expert_ids), rng=t.rng)


def _slot_sources(mask: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where every row's real slots go when they are moved to end at one shared length.

    Args:
      mask: bool ``[B, S]``, the slots holding real tokens.
      active: bool ``[B]``; rows not active keep no slot.

    Returns:
      ``(source int32 [B, S], new_mask bool [B, S], length int32 [])``: slot j of row b takes
      old slot ``source[b, j]``; ``length`` is the largest active row's count.
    """
    mask = mask & active[:, None]
    slots = mask.shape[1]
    count = jnp.sum(mask, axis=1, dtype=jnp.int32)
    length = jnp.max(count)
    slot = jnp.arange(slots, dtype=jnp.int32)
    # Real slots first, each row's in their old order (a stable sort on "is padding").
    order = jnp.argsort(~mask, axis=1, stable=True).astype(jnp.int32)
    first = length - count  # the new slot of each row's first real token
    new_mask = (slot[None, :] >= first[:, None]) & (slot[None, :] < length)
    rank = jnp.clip(slot[None, :] - first[:, None], 0, slots - 1)
    return jnp.take_along_axis(order, rank, axis=1), new_mask, length


@functools.partial(jax.jit, donate_argnames=("state",))
def _rebuild(state: DecodeState) -> DecodeState:
    """``state`` with every running row's real slots moved to end at the new ``cache.length``
    (module docstring). Rows that are done keep no slot."""
    cache = state.cache
    source, new_mask, length = _slot_sources(cache.mask, ~state.done)

    def move(layer, kv):
        # One layer at a time ([B, KVH, S, D]), so no full copy of the cache.
        return tuple(jax.lax.dynamic_update_index_in_dim(
            a, jnp.take_along_axis(a[layer], source[:, None, :, None], axis=2), layer, 0)
            for a in kv)

    k, v = jax.lax.fori_loop(0, cache.k.shape[0], move, (cache.k, cache.v))
    cache = dataclasses.replace(cache, k=k, v=v, mask=new_mask, length=length)
    return dataclasses.replace(state, cache=cache)


@functools.partial(jax.jit, static_argnames=("width", "front"), donate_argnames=("state",))
def _join(state: DecodeState, joining: DecodeState, rows: jax.Array, *, width: int,
          front: bool = False) -> DecodeState:
    """``state`` with the rows of ``joining`` (prefilled from prompts ``width`` wide) written
    into its rows ``rows`` (int32 ``[r]``; an index past the batch drops that row), their
    prompts at slots ``[length - width, length)`` (needs ``length >= width``), or with
    ``front`` at ``[0, width)`` (for a ``_rebuild`` to move); no other row moves. The cache is
    updated by one scatter per array (in place: ``state`` is donated)."""
    state = _join_fields(state, joining, rows)
    cache = state.cache
    slot = jnp.arange(width, dtype=jnp.int32) + (0 if front else cache.length - width)
    at = (rows[:, None], slot[None, :])  # [r, width] (row, slot) pairs

    def put(a, new):  # a [L, B, KVH, S, D], new [L, r, KVH, S', D]
        vals = jnp.transpose(new[:, :, :, :width], (1, 3, 0, 2, 4))  # [r, width, L, KVH, D]
        return a.at[:, at[0], :, at[1]].set(vals, mode="drop")

    mask = cache.mask.at[rows].set(False, mode="drop")
    mask = mask.at[at].set(joining.cache.mask[:, :width], mode="drop")
    cache = dataclasses.replace(cache, k=put(cache.k, joining.cache.k),
                                v=put(cache.v, joining.cache.v), mask=mask)
    return dataclasses.replace(state, cache=cache)


@functools.partial(jax.jit, donate_argnames=("state",))
def _join_groups(state: DecodeState, joining: DecodeState, rows: jax.Array,
                 groups: jax.Array) -> DecodeState:
    """With a shared prompt cache: the groups of ``joining`` (a state prefilled with
    ``share_prompt_cache``, group-major rows) written to prefix rows ``groups`` (int32 ``[g]``)
    and their rows to ``rows`` (int32 ``[g * n]``; an index past the end drops the entry).
    The joining rows hold no slot of their own yet, so nothing else moves."""
    state = _join_fields(state, joining, rows)
    cache, new = state.cache, joining.cache
    put = lambda a, b: a.at[:, groups].set(b, mode="drop")  # noqa: E731
    cache = dataclasses.replace(
        cache, prefix_k=put(cache.prefix_k, new.prefix_k),
        prefix_v=put(cache.prefix_v, new.prefix_v),
        prefix_mask=cache.prefix_mask.at[groups].set(new.prefix_mask, mode="drop"),
        row_group=cache.row_group.at[rows].set(groups[new.row_group], mode="drop"),
        mask=cache.mask.at[rows].set(False, mode="drop"))
    return dataclasses.replace(state, cache=cache)


def _join_fields(state: DecodeState, joining: DecodeState, rows: jax.Array) -> DecodeState:
    """``state`` with the per-row fields of ``joining`` written into its rows ``rows``."""
    fields = {}
    for f, axis in _JOIN_FIELDS.items():
        dst, src = getattr(state, f), getattr(joining, f)
        if dst is not None:
            fields[f] = dst.at[(slice(None),) * axis + (rows,)].set(src, mode="drop")
    return dataclasses.replace(state, **fields)


@jax.jit
def _take_results(state: DecodeState, rows: jax.Array) -> dict:
    """The result fields of ``rows`` (int32 ``[r]``)."""
    out = {}
    for f in _RESULT_FIELDS:
        x = getattr(state, f)
        if x is not None:
            out[f] = jnp.take(x, rows, axis=_JOIN_FIELDS[f])
    return out


def _padded(index: np.ndarray, size: int, fill: int) -> jax.Array:
    """``index`` padded with ``fill`` to ``size`` entries, as int32."""
    out = np.full(size, fill, np.int32)
    out[: index.size] = index
    return jnp.asarray(out)


def generate_continuous(
    rollout_params,
    prompts,
    rng: jax.Array,
    config: SamplerConfig,
    *,
    model_config,
    batch_rows: int,
    recipe=None,
    prompt_mask=None,
    segment_steps: int = 32,
    spare_slots: int | None = None,
    min_rows: int = 8,
) -> tuple[Rollout, list[Segment]]:
    """``generate`` for any number of prompts on ``batch_rows`` decode rows (module docstring).

    Args:
      batch_rows: decode rows; rounded down to whole groups of ``config.n_samples`` (at least
        one group), and no more than all the rows of the rollout.
      segment_steps: decode steps between refills (each refill reads ``done`` on the host).
      spare_slots: cache slots past ``P + max_new_tokens - 1``, >= ``segment_steps``
        (default 4 x ``segment_steps``): the slots' rebuild runs about once per
        ``spare_slots`` steps (module docstring).
      min_rows: once no prompt waits, the batch shrinks, never below this many rows.
      (the rest as in ``engine.generate``)

    Returns:
      ``(rollout, segments)``: the ``Rollout`` of ``B * n_samples`` rows, in ``generate``'s
      order (prompt i's samples at rows ``i*n .. i*n+n-1``), and one ``Segment`` per decode
      segment.
    """
    n = config.n_samples

    def require(name: str, value, low: int, why: str = "") -> None:
        check("generate_continuous", name, value, isinstance(value, int) and value >= low,
              f"an int >= {low}{why}")

    require("batch_rows", batch_rows, n, " (config.n_samples: one GRPO group)")
    require("segment_steps", segment_steps, 1)
    require("min_rows", min_rows, 1)
    if spare_slots is None:
        spare_slots = 4 * segment_steps
    require("spare_slots", spare_slots, segment_steps, " (segment_steps: a segment's room)")
    prompts, prompt_mask = engine._check_inputs(prompts, prompt_mask, config, model_config)
    num_prompts, width = prompts.shape
    total = num_prompts * n
    rows = min(batch_rows // n, num_prompts) * n
    share = config.share_prompt_cache
    # With a shared prompt cache a row's slots hold its response alone, and a group keeps its
    # prefix row until all its n rows have ended: twice the groups that fit, so a group that
    # is partly done does not hold back a waiting one.
    slots = (0 if share else width) + max(config.max_new_tokens - 1, 1) + spare_slots
    prefix_rows = 2 * (rows // n) if share else 0
    static = dict(config=config, model_config=model_config, recipe=recipe)
    prefill_key, decode_key = jax.random.split(rng)
    host_prompts, host_mask = np.asarray(prompts), np.asarray(prompt_mask)

    def prefill(index: np.ndarray) -> DecodeState:
        key = jax.random.fold_in(prefill_key, int(index[0]))
        return engine._prefill_jit(rollout_params, host_prompts[index], host_mask[index], key,
                                   **static)

    # The shapes of a one-prompt prefill (traced once per shape: jit's cache serves repeats).
    template = engine._prefill_jit.eval_shape(rollout_params, host_prompts[:1], host_mask[:1],
                                              rng, **static)
    state = dataclasses.replace(_idle_state(template, rows, slots, prefix_rows),
                                rng=decode_key)
    results = {f: np.full(_with_rows(getattr(template, f), total, _JOIN_FIELDS[f]),
                          -1 if f.endswith("expert_ids") else 0, getattr(template, f).dtype)
               for f in _RESULT_FIELDS if getattr(template, f) is not None}
    seq = np.full(rows, -1)  # the rollout row each batch row decodes; -1: idle
    row_prefix = np.zeros(rows, np.int64)  # shared prompt cache: each row's prefix row
    prefix_users = np.zeros(prefix_rows, np.int64)  # rows still reading each prefix row
    waiting, segments, step, length = 0, [], 0, 0
    while True:
        free = np.flatnonzero(seq < 0)
        groups = min(free.size // n, num_prompts - waiting)
        free_prefix = np.flatnonzero(prefix_users == 0)
        if share:
            groups = min(groups, free_prefix.size)
        joining, dest = None, None
        if groups:
            bucket = _bucket(groups, 1)  # bounded compiles: prefill batches are powers of two
            chunk = config.prefill_chunk
            if chunk and bucket > chunk:  # ... and multiples of the prefill chunk
                bucket = -(-bucket // chunk) * chunk
            index = np.arange(waiting, waiting + groups)
            index = np.concatenate([index, np.full(bucket - groups, index[-1])])
            joining = prefill(index)
            dest = _padded(free[: groups * n], bucket * n, seq.size)
            seq[free[: groups * n]] = np.arange(waiting * n, (waiting + groups) * n)
            waiting += groups
            if share:
                state = _join_groups(state, joining, dest,
                                     _padded(free_prefix[:groups], bucket, prefix_rows))
                row_prefix[free[: groups * n]] = np.repeat(free_prefix[:groups], n)
                prefix_users[free_prefix[:groups]] = n
        rebuilt = length + segment_steps > slots or (
            not share and joining is not None and length < width)
        if joining is not None and not share:  # shared: the groups joined above
            # Before a rebuild, at the front of the rows' slots (the rebuild moves them).
            state = _join(state, joining, dest, width=width, front=rebuilt)
        if rebuilt:
            state = _rebuild(state)
        running = int(np.sum(seq >= 0))
        state = engine._decode_jit(rollout_params, state, jnp.int32(segment_steps),
                                   per_row=True, **static)
        # One read-back per segment: which rows ended, and where the cache stands.
        done, new_step, length = jax.device_get((state.done, state.step, state.cache.length))
        segments.append(Segment(rows=seq.size, running=running,
                                joined=0 if joining is None else groups * n,
                                steps=int(new_step) - step, rebuilt=rebuilt))
        step, length = int(new_step), int(length)
        ended = np.flatnonzero(done & (seq >= 0))
        if ended.size:
            taken = jax.device_get(_take_results(state, _padded(ended, _bucket(ended.size, 1),
                                                               ended[0])))
            for f, value in taken.items():
                axis = _JOIN_FIELDS[f]
                dst = (slice(None),) * axis + (seq[ended],)
                src = (slice(None),) * axis + (slice(0, ended.size),)
                results[f][dst] = value[src]
            seq[ended] = -1
            if share:  # a prefix row frees once every row of its group has ended
                np.subtract.at(prefix_users, row_prefix[ended], 1)
        if waiting == num_prompts:
            busy = np.flatnonzero(seq >= 0)
            if busy.size == 0:
                break
            size = _bucket(busy.size, min_rows)
            if size < seq.size:
                keep = np.concatenate([busy, np.flatnonzero(seq < 0)[: size - busy.size]])
                state, seq = _gather_rows(state, jnp.asarray(keep, jnp.int32)), seq[keep]
                row_prefix = row_prefix[keep]

    fields = dict(expert_ids=None, prompt_expert_ids=None)
    fields.update({f: jnp.asarray(v) for f, v in results.items()})
    full = DecodeState(cache=None, step=jnp.int32(0), last_token=jnp.zeros((total,), jnp.int32),
                       prompt_length=jnp.zeros((total,), jnp.int32),
                       done=jnp.ones((total,), bool), rng=rng, **fields)
    return engine.finish(full, prompts, config, prompt_mask=prompt_mask), segments


def _with_rows(x, rows: int, axis: int) -> tuple[int, ...]:
    """``x``'s shape with ``rows`` entries on its row axis ``axis``."""
    return x.shape[:axis] + (rows,) + x.shape[axis + 1:]

