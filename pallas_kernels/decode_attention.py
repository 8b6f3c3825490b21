"""Decode attention over the stacked KV cache: one query token per row, read K and V once.

The jnp path (``quads_jax.models.layers.attend``) slices one layer out of the ``[L, B, KVH, S,
D]`` cache and runs two batched matmuls through XLA, with a softmax between them over the whole
preallocated slot axis. In decode that is the step's largest cost (the H200 rollout split of
2026-12-02 put attention at 21.7 of a 37-44 ms step, ~10x its bytes over the bandwidth).

This kernel (Pallas, Triton backend) runs one program per (row, KV head):

- it reads the layer it needs straight from the stacked cache (``layer`` is a runtime scalar),
  so no per-layer copy of the cache is made;
- it loops only over the slots written so far (``kv_len``, a runtime scalar), so early decode
  steps do not pay for the whole preallocated context;
- the G = H / KVH query heads of one KV head share each K and V block (GQA), read as a
  window of the 16 rows a tensor-core dot needs, the rows past its own G masked to zero on
  load and on store;
- online softmax (flash-decoding) in f32, P cast to the cache dtype for the PV product, the
  output divided by the softmax sum at the end.

At the 30B decode shape it reads at its byte floor: 74.4 us per layer for the 199 MB of K and
V at position 760 against 69 us at the run's 2.89 TB/s copy rate (0.93; H100 rollout,
2026-12-06), so only fewer bytes (the FP8 cache) make it faster.

GRPO groups sharing their prompt's cache (``SharedPrefix``) read the prefix in one of two
ways (``DecodeAttentionConfig.prefix_mode``): each row's program reads its group's prefix
before its own slots ("per_row"), or a first kernel reads each prefix once per tile of up to
``prefix_rows`` rows of its group, all their query heads as one ``[R * G, D]`` operand
("per_group", ``_prefix_kernel``), and the per-row kernel starts from its row's prefix
partials (merged into its online-softmax state) and reads only the row's own slots.

The Triton backend is deprecated in jax 0.11 (PALLAS_NOTES section 1): this kernel is the
second-best tool that works today; a Mosaic GPU version would follow the same plan.

Shapes: q ``[B, KVH, G, D]``, k_all / v_all ``[L, B, KVH, S, D]`` (bf16, f16, or FP8 E4M3:
an FP8 cache, half the bytes a decode step reads, is converted to bf16 block by block in the
kernel), valid bool or int32 ``[B, S]`` (slot holds a token the query may see), layer and
kv_len int32 scalars; output ``[B, KVH, G, D]`` in q's dtype.

Nothing runs around the kernel call in a decode step (where it runs once per layer): the
query is read and the output written in their ``[B, H, D]`` layout through masked windows
(a padded copy of q to ``Gp`` rows and the output's slice back to G were a small XLA kernel
each, 3.1 and 1.4 us per layer on the H200, 2026-12-03), an int32 ``valid`` is taken as is
(the model converts its mask once per step) and ``kv_len`` is clamped in the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# A masked score: exp() of it is 0 in f32, and it stays finite (no inf - inf = NaN).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
MIN_DOT_ROWS = 16  # tensor-core dots in Triton need >= 16 rows
CACHE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
_FP8_WORDS = {4: jnp.int32, 2: jnp.int16}  # FP8 codes per word -> the word dtype
PREFIX_MODES = ("auto", "per_row", "per_group")


def fp8_parts(head_dim: int) -> int:
    """FP8 codes per word the kernel reads an FP8 cache in: 4 (int32) when each of the 4
    column sets still gives a tensor-core dot >= 16 deep (head_dim >= 64), else 2 (int16)."""
    return 4 if head_dim >= 4 * MIN_DOT_ROWS else 2


def compute_dtype(cache_dtype) -> jnp.dtype:
    """The dtype of the kernel's dot operands for a cache dtype: the cache's own for bf16 / f16,
    bf16 for an FP8 cache (exact: every E4M3 value is a bf16 value)."""
    cache_dtype = jnp.dtype(cache_dtype)
    return jnp.dtype(jnp.bfloat16) if cache_dtype == jnp.float8_e4m3fn else cache_dtype


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """block_s: cache slots per loop step (power of two) of a bf16 / f16 cache, fp8_block_s
    of an FP8 cache; num_warps / num_stages: Triton's.

    Defaults: the fastest measured on the H200 at the 30B decode shape (batch 128, 4 KV heads,
    scripts/kernel_probe.py --attention). bf16, 2026-12-05 at 768 / 1279 slots: block_s 32 with
    4 warps and 3 stages 71.2 / 104.4 us; 2, 4 or 5 stages, 2 warps, block 16 or 64 (4 or 8
    warps) 74-89 / 105-128 us. FP8, the same call: block_s 64 64.8 / 91.7 us against 67.3 /
    107.1 at 32."""

    block_s: int = 32
    fp8_block_s: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # slot_splits > 1 (flash-decoding): each (row, KV head) runs as that many programs over
    # consecutive slot ranges, and XLA combines their unnormalized outputs. More programs with
    # shorter loops where the loop's latency rather than HBM limits the kernel (the FP8 cache:
    # half the bytes bought 0-12 % on the H200, 2026-12-04); more bytes written and one
    # combine kernel.
    slot_splits: int = 1
    # How rows read a shared prompt prefix (``SharedPrefix``, GRPO groups): "per_row": each
    # (row, KV head) program reads its group's prefix before its own slots (the prefix comes
    # from HBM once per group and from L2 for the other rows). "per_group": one pass per
    # (group tile, KV head) reads the prefix once for the queries of up to ``prefix_rows`` rows
    # of the group (``prefix_rows`` x G query rows: a tensor-core tile instead of G padded to
    # 16), then the per-row kernel merges its row's prefix partials into its softmax state and
    # reads only the row's own slots; ``prefix_splits`` slot ranges per group tile (16 groups x
    # 4 KV heads are only 64 programs on 132 SMs). "auto": per_group for prefixes of at least
    # ``prefix_group_min_slots`` slots, else per_row. On the H200 (2026-12-05, 16 groups x 8
    # rows): at prompt 1024 per_group took 92.5 us against 103.1 per_row in the kernel probe
    # (prefix_splits 1 / 2 / 8: 97.3 / 94.3 / 104.4; prefix_rows 4 or 16: 103 us) and the
    # nvfp4_rac decode step 14.66 against 15.32 ms; at prompts of 128-256 tokens continuous
    # batching ran 4 381 tok/s with per_group against 4 716 with per_row the session before
    # (its extra pass per layer costs more than the short prefix it saves).
    prefix_mode: str = "auto"
    prefix_rows: int = 8
    prefix_splits: int = 4
    prefix_group_min_slots: int = 512

    def __post_init__(self):
        if self.block_s < 16 or self.block_s & (self.block_s - 1):
            raise ValueError(f"DecodeAttentionConfig.block_s={self.block_s}: must be a power "
                             "of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DecodeAttentionConfig.num_warps={self.num_warps}: must be one of "
                             "1, 2, 4, 8, 16")
        if self.num_stages < 1:
            raise ValueError(f"DecodeAttentionConfig.num_stages={self.num_stages}: must be >= 1")
        if not 1 <= self.slot_splits <= 64:
            raise ValueError(f"DecodeAttentionConfig.slot_splits={self.slot_splits}: must be in "
                             "[1, 64]")
        if self.prefix_mode not in PREFIX_MODES:
            raise ValueError(f"DecodeAttentionConfig.prefix_mode={self.prefix_mode!r}: must be "
                             f"one of {PREFIX_MODES}")
        r = self.prefix_rows
        if not isinstance(r, int) or r < 1 or r & (r - 1) or r > 64:
            raise ValueError(f"DecodeAttentionConfig.prefix_rows={r!r}: must be a power of two "
                             "in [1, 64]")
        if not 1 <= self.prefix_splits <= 64:
            raise ValueError(f"DecodeAttentionConfig.prefix_splits={self.prefix_splits}: must "
                             "be in [1, 64]")
        if self.fp8_block_s < 16 or self.fp8_block_s & (self.fp8_block_s - 1):
            raise ValueError(f"DecodeAttentionConfig.fp8_block_s={self.fp8_block_s}: must be a "
                             "power of two >= 16")
        if self.prefix_group_min_slots < 0:
            raise ValueError("DecodeAttentionConfig.prefix_group_min_slots="
                             f"{self.prefix_group_min_slots}: must be >= 0")

    def per_group(self, prefix_slots: int) -> bool:
        """Whether a shared prefix of ``prefix_slots`` slots is read per group tile."""
        return self.prefix_mode == "per_group" or (
            self.prefix_mode == "auto" and prefix_slots >= self.prefix_group_min_slots)


class PrefixTiles(NamedTuple):
    """The rows of each group cut into tiles of ``R`` rows, for ``prefix_mode="per_group"``
    (``prefix_tiles``): the same for every layer of a decode step, so a step builds it once.

    Attributes:
      rows: int32 ``[T, R]``: the cache row at each slot of a tile (``B`` = empty).
      group: int32 ``[T]``: each tile's group (0 past the live tiles).
      count: int32 ``[1]``: the live tiles (the first ``count`` of ``T``).
      row_tile, row_pos: int32 ``[B]``: each row's tile and its slot in it.
    """

    rows: jax.Array
    group: jax.Array
    count: jax.Array
    row_tile: jax.Array
    row_pos: jax.Array


class SharedPrefix(NamedTuple):
    """Cache slots that every row of a group attends to before its own: the prompt of a GRPO
    group, prefilled once and read by its n samples (``SamplerConfig.share_prompt_cache``).

    Attributes:
      k, v: ``[L, G, KVH, P, D]`` in the cache's dtype (one row per group).
      valid: bool or int32 ``[G, P]``: the slot holds a prompt token (left padding: False).
      row_group: int32 ``[B]``: the group of each cache row.
      tiles: None, or ``prefix_tiles(row_group, G, config.prefix_rows)`` built once for a
        step's layers (``prefix_mode="per_group"`` builds it per call otherwise).
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    row_group: jax.Array
    tiles: PrefixTiles | None = None


def prefix_tiles(row_group: jax.Array, groups: int, rows_per_tile: int) -> PrefixTiles:
    """Tiles of at most ``rows_per_tile`` rows of one group each: group g's rows (in row order)
    fill ``ceil(count_g / R)`` consecutive tiles; ``T = min(B, G + ceil(B / R))`` bounds the
    live tiles for any grouping. ``row_group``: int32 ``[B]`` in ``[0, groups)``."""
    b, r = row_group.shape[0], rows_per_tile
    t_max = max(1, min(b, groups + -(-b // r)))
    row_group = row_group.astype(jnp.int32)
    order = jnp.argsort(row_group, stable=True)
    counts = jnp.zeros((groups,), jnp.int32).at[row_group].add(1)
    group_start = jnp.cumsum(counts) - counts
    tiles_of = -(-counts // r)
    tile_start = jnp.cumsum(tiles_of) - tiles_of
    sorted_group = row_group[order]
    rank = jnp.arange(b, dtype=jnp.int32) - group_start[sorted_group]
    tile = tile_start[sorted_group] + rank // r
    pos = rank % r
    return PrefixTiles(
        rows=jnp.full((t_max, r), b, jnp.int32).at[tile, pos].set(order.astype(jnp.int32)),
        group=jnp.zeros((t_max,), jnp.int32).at[tile].set(sorted_group),
        count=jnp.sum(tiles_of, dtype=jnp.int32).reshape(1),
        row_tile=jnp.zeros((b,), jnp.int32).at[order].set(tile),
        row_pos=jnp.zeros((b,), jnp.int32).at[order].set(pos))


def _cache_problem(k_all: jax.Array, min_slots: int) -> str | None:
    """Why this stacked cache cannot be used (the kernel needs ``MIN_DOT_ROWS`` slots, the
    reference 1), or None."""
    d, s = k_all.shape[-1], k_all.shape[-2]
    if d < 16 or d & (d - 1):
        return f"head_dim {d} must be a power of two >= 16"
    if k_all.dtype not in CACHE_DTYPES:
        return f"cache dtype {k_all.dtype}; bf16, f16 or float8_e4m3fn expected"
    if k_all.dtype == jnp.float8_e4m3fn and d < 2 * MIN_DOT_ROWS:
        return f"head_dim {d} with an FP8 cache must be >= {2 * MIN_DOT_ROWS}"
    if s < min_slots:
        return (f"{s} cache slots; the kernel needs >= {min_slots} (use the jnp path for "
                "smaller caches)")
    return None


def supports(k_all: jax.Array, prefix: SharedPrefix | None = None) -> bool:
    """Whether the kernel takes this stacked cache (bf16/f16/FP8, head_dim a power of two >= 16,
    >= 16 slots) and shared prefix (the same, >= 16 prefix slots); callers fall back to the jnp
    path otherwise (e.g. an f32 cache)."""
    if prefix is not None and _cache_problem(prefix.k, MIN_DOT_ROWS) is not None:
        return False
    return _cache_problem(k_all, MIN_DOT_ROWS) is None


def _check(q, k_all, v_all, valid, min_slots: int = 1):
    if q.ndim != 4 or k_all.ndim != 5:
        raise ValueError(f"decode_attention: q {q.shape} must be [B, KVH, G, D] and k_all "
                         f"{k_all.shape} [L, B, KVH, S, D]")
    if k_all.shape != v_all.shape or k_all.dtype != v_all.dtype:
        raise ValueError(f"decode_attention: k_all {k_all.shape} {k_all.dtype} and v_all "
                         f"{v_all.shape} {v_all.dtype} must match")
    _, b, kvh, s, d = k_all.shape
    if q.shape[:2] != (b, kvh) or q.shape[3] != d:
        raise ValueError(f"decode_attention: q {q.shape} does not fit the cache {k_all.shape} "
                         "(want [B, KVH, G, D] with the cache's B, KVH and D)")
    if valid.shape != (b, s) or valid.dtype not in (jnp.bool_, jnp.int32):
        raise ValueError(f"decode_attention: valid {valid.dtype}{list(valid.shape)} must be "
                         f"bool or int32 [B, S] = {[b, s]}")
    if problem := _cache_problem(k_all, min_slots):
        raise ValueError(f"decode_attention: {problem}")


def _check_prefix(prefix: SharedPrefix, k_all: jax.Array, min_slots: int = 1):
    l, b, kvh, _, d = k_all.shape
    pk = prefix.k
    if pk.ndim != 5 or pk.shape != prefix.v.shape or pk.dtype != k_all.dtype \
            or prefix.v.dtype != k_all.dtype or (pk.shape[0], pk.shape[2], pk.shape[4]) != (l, kvh, d):
        raise ValueError(f"decode_attention: prefix k {pk.dtype}{list(pk.shape)} and v "
                         f"{prefix.v.dtype}{list(prefix.v.shape)} must be [L, G, KVH, P, D] = "
                         f"[{l}, G, {kvh}, P, {d}] in the cache's dtype {k_all.dtype}")
    g, p = pk.shape[1], pk.shape[3]
    if prefix.valid.shape != (g, p) or prefix.valid.dtype not in (jnp.bool_, jnp.int32):
        raise ValueError(f"decode_attention: prefix valid {prefix.valid.dtype}"
                         f"{list(prefix.valid.shape)} must be bool or int32 [G, P] = {[g, p]}")
    if prefix.row_group.shape != (b,) or prefix.row_group.dtype != jnp.int32:
        raise ValueError(f"decode_attention: prefix row_group {prefix.row_group.dtype}"
                         f"{list(prefix.row_group.shape)} must be int32 [B] = [{b}]")
    if problem := _cache_problem(pk, min_slots):
        raise ValueError(f"decode_attention: prefix: {problem}")


def _fp8_columns(words: jax.Array, parts: int) -> list[jax.Array]:
    """An FP8 block read as words ``[BS, D/parts]`` -> its ``parts`` column sets as bf16
    (exact): set ``j`` is byte ``j`` of every word, cache column ``parts * i + j``."""
    def byte(j):
        b = ((words >> (8 * j)) & 0xFF).astype(jnp.int8)
        return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.bfloat16)

    return [byte(j) for j in range(parts)]


def _store(o_ref, blocks: list[jax.Array]) -> None:
    """One output block ``[Gp, D]``, or ``parts`` column sets ``[parts, Gp, D/parts]``."""
    if len(blocks) == 1:
        o_ref[...] = blocks[0].astype(o_ref.dtype)
    else:
        for j, blk in enumerate(blocks):
            o_ref[j] = blk.astype(o_ref.dtype)


def _softmax_step(qs, k_at, v_at, valid_at, n_slots: int, block: int, parts: int,
                  scale: float):
    """The ``fori_loop`` body of one online-softmax step over ``block`` slots of a slot axis of
    ``n_slots``: ``qs`` the query column sets ``[Gq, D / parts]``; ``k_at`` / ``v_at`` /
    ``valid_at`` load a window of slots; the carry is ``(accs, m, l)``."""
    offs = jnp.arange(block)

    def body(i, carry):
        accs, m, l = carry
        # The last window is moved back inside the slot axis (no out-of-bounds reads,
        # which interpret mode would clamp anyway); its slots already seen are masked out.
        start = jnp.minimum(i * block, n_slots - block)
        window = pl.ds(start, block)
        k, v = k_at(window), v_at(window)  # one load each
        ks, vs = (([k], [v]) if parts == 1
                  else (_fp8_columns(k, parts), _fp8_columns(v, parts)))
        ok = (valid_at(window) != 0) & (start + offs >= i * block)
        s = sum(jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
                for q, k in zip(qs, ks, strict=True)) * scale  # [Gq, BS]
        s = jnp.where(ok[None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pc = p.astype(vs[0].dtype)
        accs = tuple(acc * alpha[:, None] + jax.lax.dot_general(
            pc, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            for acc, v in zip(accs, vs, strict=True))  # [Gq, D/parts]
        return accs, m_new, l * alpha + jnp.sum(p, axis=1)

    return body


def _empty_carry(gq: int, dp: int, parts: int):
    return (tuple(jnp.zeros((gq, dp), jnp.float32) for _ in range(parts)),
            jnp.full((gq,), MASK_VALUE, jnp.float32), jnp.zeros((gq,), jnp.float32))


def _kernel(layer_ref, kv_len_ref, q_ref, valid_ref, k_ref, v_ref, *refs,
            block_s: int, slots: int, scale: float, parts: int, splits: int,
            heads: int, q_rows: int, prefix_block: int = 0, prefix_slots: int = 0,
            group_partials: int = 0):
    """q and (``splits`` = 1) the output: the whole ``[B, KVH * parts * G, D / parts]`` arrays;
    program (b, h) reads and writes its ``heads`` = G rows as a ``q_rows`` = Gp row window
    (``_head_rows``, the rows past G masked). ``parts`` = 1: bf16 / f16 cache, one K / V block
    per step. ``parts`` = 4: FP8 cache read as int32 words ``[.., D/4]``; q and the output hold
    4 column sets per head (set j: columns ``4 i + j``), so each byte position j is one dot of
    K = D/4: no in-kernel interleave (which Triton does not lower) is needed.

    ``splits`` > 1: program (b, h, c) runs slot blocks ``[c n, (c + 1) n)`` of the ``N`` to read
    (``n = ceil(N / splits)``) and stores its unnormalized f32 sums ``[(parts,) Gp, D / parts]``
    and its running max and sum (``stats_refs``: m, l ``[Gp]``) for ``_combine_splits``.

    ``prefix_slots`` > 0: ``refs`` starts with the shared prefix (row_group ``[B]``, prefix
    valid ``[G, P]``, prefix K and V ``[L, G, KVH, P, D]``): every slot of row b's group's
    prefix is read first (by split 0), ``prefix_block`` at a time, then the row's own slots.

    ``group_partials`` = C > 0 (``prefix_mode="per_group"``): ``refs`` starts with row_tile,
    row_pos ``[B]`` and ``_prefix_kernel``'s outputs (acc ``[T, KVH, C, (parts,) 2 RGp, Dp]``,
    m, l ``[T, KVH, C, 2 RGp]``): the row's ``Gp`` rows from row ``row_pos * heads`` of its
    tile are merged into the carry first (by split 0): its ``heads`` query heads' prefix
    partials, then rows of no meaning (the tile's next row, or unwritten), which only ever
    reach the padding rows ``>= heads`` (every step is row-wise) that the caller drops.
    """
    refs = list(refs)
    if prefix_slots:
        group_ref, pvalid_ref, pk_ref, pv_ref = refs[:4]
        refs = refs[4:]
    if group_partials:
        tile_ref, pos_ref, pacc_ref, pm_ref, pl_ref = refs[:5]
        refs = refs[5:]
    o_ref, *stats_refs = refs
    b, h = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    kv_len = jnp.minimum(jnp.maximum(kv_len_ref[0], 0), slots)  # here: no XLA kernel of its own
    gp, dp = q_rows, q_ref.shape[-1]
    qs = [pltriton.load(_head_rows(q_ref, b, h, j, heads, gp, parts),
                        mask=_rows_below(heads, gp, dp), other=0)
          for j in range(parts)]  # [Gp, D / parts], rows >= heads zero

    carry = _empty_carry(gp, dp, parts)
    if prefix_slots:
        grp = group_ref[b]
        body = _softmax_step(qs, lambda w: pk_ref[layer, grp, h, w, :],
                             lambda w: pv_ref[layer, grp, h, w, :],
                             lambda w: pvalid_ref[grp, w], prefix_slots, prefix_block, parts,
                             scale)
        n_prefix = (prefix_slots + prefix_block - 1) // prefix_block
        if splits > 1:  # split 0 reads the prefix; _combine_splits weighs the splits
            n_prefix = jnp.where(pl.program_id(2) == 0, n_prefix, 0)
        carry = jax.lax.fori_loop(0, n_prefix, body, carry)
    if group_partials:
        tile, rows = tile_ref[b], pl.ds(pos_ref[b] * heads, gp)
        first_split = True if splits == 1 else pl.program_id(2) == 0
        for c in range(group_partials):
            pm = jnp.where(first_split, pm_ref[tile, h, c, rows], MASK_VALUE)
            pacc = ([pacc_ref[tile, h, c, rows, :]] if parts == 1
                    else [pacc_ref[tile, h, c, j, rows, :] for j in range(parts)])
            carry = _merge(carry, (pacc, pm, pl_ref[tile, h, c, rows]))
    body = _softmax_step(qs, lambda w: k_ref[layer, b, h, w, :],
                         lambda w: v_ref[layer, b, h, w, :], lambda w: valid_ref[w], slots,
                         block_s, parts, scale)
    blocks = (kv_len + block_s - 1) // block_s
    if splits == 1:
        first, last = 0, blocks
    else:
        per = (blocks + splits - 1) // splits
        first = pl.program_id(2) * per
        last = jnp.minimum(first + per, blocks)
    accs, m, l = jax.lax.fori_loop(first, jnp.maximum(first, last), body, carry)
    if splits > 1:  # unnormalized: _combine_splits rescales and divides
        m_ref, l_ref = stats_refs
        m_ref[...] = m
        l_ref[...] = l
        _store(o_ref, list(accs))
        return
    # A row with no visible slot (l = 0) gives 0, not NaN.
    denom = jnp.maximum(l, 1e-30)[:, None]
    for j, acc in enumerate(accs):
        pltriton.store(_head_rows(o_ref, b, h, j, heads, gp, parts),
                       (acc / denom).astype(o_ref.dtype), mask=_rows_below(heads, gp, dp))


def _head_rows(ref, b: jax.Array, h: jax.Array, part: int, heads: int, gp: int, parts: int):
    """Row b's ``Gp`` rows from KV head h's first query head (column set ``part``) of a ``[B,
    KVH * parts * G, Dp]`` query or output: the G heads, then the next head's rows or past the
    array's end, which ``_rows_below`` masks (no padded copy of q, no slice of the output)."""
    return ref.at[b, pl.ds((h * parts + part) * heads, gp), :]


def _rows_below(heads: int, gp: int, dp: int) -> jax.Array:
    """bool ``[Gp, Dp]``: the rows of a ``_head_rows`` window that are the head's own."""
    return jax.lax.broadcasted_iota(jnp.int32, (gp, dp), 0) < heads


def _merge(carry, other):
    """Two online-softmax states ``(accs, m, l)`` as one (``_combine_splits`` in a kernel). A
    state with m = MASK_VALUE weighs 0 (its l is ignored; its accs must still be finite)."""
    (accs, m, l), (accs2, m2, l2) = carry, other
    m_new = jnp.maximum(m, m2)
    a, a2 = jnp.exp(m - m_new), jnp.exp(m2 - m_new)
    a2 = jnp.where(m2 > MASK_VALUE, a2, 0.0)
    return (tuple(x * a[:, None] + y * a2[:, None] for x, y in zip(accs, accs2, strict=True)),
            m_new, l * a + jnp.where(m2 > MASK_VALUE, l2, 0.0) * a2)


def _prefix_kernel(count_ref, layer_ref, group_ref, q_ref, pvalid_ref, pk_ref, pv_ref, o_ref,
                   m_ref, l_ref, *, block: int, slots: int, scale: float, parts: int,
                   splits: int):
    """``prefix_mode="per_group"``'s pass: program (t, h, c) attends the queries of group tile
    t (its rows' G query heads of KV head h, ``[RGp, D]``, as ``q_ref``; empty slots zero)
    to slot range c of the tile's group's prefix, read once for all of them, and stores the
    unnormalized partial (as ``_kernel`` with ``splits`` > 1). Tiles past ``count`` read
    nothing."""
    t, h = pl.program_id(0), pl.program_id(1)
    layer, grp = layer_ref[0], group_ref[t]
    qs = [q_ref[...]] if parts == 1 else [q_ref[j] for j in range(parts)]
    rows, dp = qs[0].shape
    body = _softmax_step(qs, lambda w: pk_ref[layer, grp, h, w, :],
                         lambda w: pv_ref[layer, grp, h, w, :], lambda w: pvalid_ref[grp, w],
                         slots, block, parts, scale)
    blocks = (slots + block - 1) // block
    per = (blocks + splits - 1) // splits
    first = pl.program_id(2) * per
    last = jnp.where(t < count_ref[0], jnp.minimum(first + per, blocks), first)
    accs, m, l = jax.lax.fori_loop(first, jnp.maximum(first, last), body,
                                   _empty_carry(rows, dp, parts))
    # The outputs have 2 x rows rows: the row kernel reads Gp rows from any row's first head,
    # so the last row's window runs past the tile's rows; the second half stays unwritten.
    written = pl.ds(0, rows)
    m_ref[written] = m
    l_ref[written] = l
    for j, acc in enumerate(accs):
        if parts == 1:
            o_ref[written, :] = acc
        else:
            o_ref[j, written, :] = acc


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def decode_attention(q: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: jax.Array,
                     valid: jax.Array, kv_len: jax.Array, prefix: SharedPrefix | None = None,
                     *, config: DecodeAttentionConfig = DecodeAttentionConfig(),
                     interpret: bool = False) -> jax.Array:
    """Softmax attention of one query per row over layer ``layer`` of the stacked cache.

    Args:
      q: ``[B, KVH, G, D]`` (query heads grouped by their KV head), any float dtype.
      k_all, v_all: ``[L, B, KVH, S, D]`` bf16, f16 or float8_e4m3fn.
      layer: int32 scalar, the cache layer to read.
      valid: bool or int32 (nonzero = True) ``[B, S]``: the query of row b may attend to slot
        s; int32 is used as is (a decode step's layers share one mask: convert it once).
      kv_len: int32 scalar: slots ``>= kv_len`` are not read (must cover every valid slot;
        clamped to [0, S]).
      prefix: None, or a ``SharedPrefix`` each row also attends to (every valid slot of its
        group's prefix; >= 16 prefix slots).
    Returns ``[B, KVH, G, D]`` in ``q.dtype``; scores and softmax in f32, scale ``D**-0.5``.
    """
    _check(q, k_all, v_all, valid, min_slots=MIN_DOT_ROWS)
    if prefix is not None:
        _check_prefix(prefix, k_all, min_slots=MIN_DOT_ROWS)
    _, b, kvh, s, d = k_all.shape
    g = q.shape[2]
    gp = max(MIN_DOT_ROWS, 1 << (g - 1).bit_length())
    dot_dtype = compute_dtype(k_all.dtype)
    out_dtype = q.dtype
    q = q.astype(dot_dtype)
    parts = fp8_parts(d) if k_all.dtype == jnp.float8_e4m3fn else 1
    if parts > 1:
        # jax 0.11.2's Triton lowering picks 32-bit element offsets while the array's *bytes*
        # fit 2**32, so a 1-byte array past 2**31 elements overflows them (the 30B decode
        # cache at 1280 slots is 4.0e9 FP8 elements: CUDA_ERROR_ILLEGAL_ADDRESS on the H200,
        # 2026-12-04). Read as int32 (int16) words, an FP8 cache has a quarter (half) as many
        # elements. Byte j of word i is column 4 i + j (2 i + j), so q and the output go in
        # as ``parts`` column sets, one dot each.
        word = _FP8_WORDS[parts]
        as_words = lambda a: jax.lax.bitcast_convert_type(  # noqa: E731
            a.reshape(*a.shape[:-1], d // parts, parts), word)
        k_all, v_all = as_words(k_all), as_words(v_all)
        if prefix is not None:
            prefix = prefix._replace(k=as_words(prefix.k), v=as_words(prefix.v))
    qd = _to_parts(q, parts)  # [B, KVH, (parts,) G, Dp]
    q_rows = qd.reshape(b, -1, qd.shape[-1])  # each program reads its head's rows (_head_rows)
    kv_len = jnp.asarray(kv_len, jnp.int32).reshape(1)
    valid = valid.astype(jnp.int32)  # no operation for an int32 mask
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    splits = config.slot_splits
    prefix_args, prefix_kw = (), {}
    if prefix is not None and config.per_group(prefix.k.shape[3]):
        tiles, partials = _prefix_pass(q, prefix, layer, config=config, parts=parts,
                                       interpret=interpret)
        prefix_kw = dict(group_partials=config.prefix_splits)
        prefix_args = (tiles.row_tile, tiles.row_pos, *partials)
    elif prefix is not None:
        p = prefix.k.shape[3]
        prefix_kw = dict(prefix_slots=p, prefix_block=_block(config, p, parts > 1))
        prefix_args = (prefix.row_group, prefix.valid.astype(jnp.int32), prefix.k, prefix.v)
    prefix_specs = [_whole(a) for a in prefix_args]  # indexed by the row's group (tile)
    kernel = functools.partial(_kernel, block_s=_block(config, s, parts > 1), slots=s,
                               scale=d**-0.5, parts=parts, splits=splits, heads=g, q_rows=gp,
                               **prefix_kw)
    if splits == 1:  # written in place of q's rows: no padded output to slice
        grid = (b, kvh)
        out_specs = _whole(q_rows)
        out_shape = jax.ShapeDtypeStruct(q_rows.shape, dot_dtype)
    else:
        grid = (b, kvh, splits)
        out_specs, out_shape = _partial_outputs((*qd.shape[:-2], gp, qd.shape[-1]), splits)
    out = _pallas_call(
        kernel, "decode_attention", config, interpret,
        grid=grid,
        in_specs=[
            pl.BlockSpec((1,), lambda *_: (0,)),
            pl.BlockSpec((1,), lambda *_: (0,)),
            _whole(q_rows),
            pl.BlockSpec((None, s), lambda i, *_: (i, 0)),
            # The stacked cache is indexed in the kernel (layer and row are runtime values).
            _whole(k_all),
            _whole(v_all),
            *prefix_specs,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
    )(layer, kv_len, q_rows, valid, k_all, v_all, *prefix_args)
    if splits > 1:
        out = _combine_splits(*out).astype(dot_dtype)[..., :g, :]
    return _unparts(out.reshape(qd.shape), parts).astype(out_dtype)


def _pallas_call(kernel, name: str, config: DecodeAttentionConfig, interpret: bool, **kw):
    """``pl.pallas_call`` on the Triton backend with the config's warps and stages."""
    return pl.pallas_call(kernel, compiler_params=pltriton.CompilerParams(
        num_warps=config.num_warps, num_stages=config.num_stages), interpret=interpret,
        name=name, **kw)


def _whole(a: jax.Array) -> pl.BlockSpec:
    """The whole array as every program's block (the kernel indexes it by runtime values)."""
    return pl.BlockSpec(a.shape, lambda *_, n=a.ndim: (0,) * n)


def _block(config: DecodeAttentionConfig, slots: int, fp8: bool) -> int:
    """The config's block for the cache dtype, or the largest power of two <= slots."""
    return min(config.fp8_block_s if fp8 else config.block_s, 1 << (slots.bit_length() - 1))


def _to_parts(x: jax.Array, parts: int) -> jax.Array:
    """``[..., R, D]`` -> ``parts`` column sets ``[..., parts, R, D / parts]`` (set j holds
    columns ``parts * i + j``: the FP8 cache's words); no change for 1."""
    if parts == 1:
        return x
    *lead, r, d = x.shape
    return jnp.moveaxis(x.reshape(*lead, r, d // parts, parts), -1, -3)


def _unparts(x: jax.Array, parts: int) -> jax.Array:
    """``_to_parts``' inverse: ``[..., parts, R, D / parts]`` -> ``[..., R, D]``."""
    if parts == 1:
        return x
    x = jnp.moveaxis(x, -3, -1)
    return x.reshape(*x.shape[:-2], x.shape[-2] * parts)


def _partial_outputs(q_shape: tuple, splits: int):
    """Out specs and shapes of a partial pass with grid ``(N, KVH, splits)`` over queries laid
    out as ``q_shape`` ``[N, KVH, (parts,) rows, Dp]``: per split the f32 sums laid out like q,
    and m, l ``[rows]``."""
    n, kvh, *inner = q_shape
    rows = inner[-2]
    nz = len(inner)
    specs = (pl.BlockSpec((None, None, None, *inner), lambda i, j, c: (i, j, c) + (0,) * nz),
             pl.BlockSpec((None, None, None, rows), lambda i, j, c: (i, j, c, 0)),
             pl.BlockSpec((None, None, None, rows), lambda i, j, c: (i, j, c, 0)))
    shapes = (jax.ShapeDtypeStruct((n, kvh, splits, *inner), jnp.float32),
              jax.ShapeDtypeStruct((n, kvh, splits, rows), jnp.float32),
              jax.ShapeDtypeStruct((n, kvh, splits, rows), jnp.float32))
    return specs, shapes


def _prefix_pass(q: jax.Array, prefix: SharedPrefix, layer: jax.Array, *,
                 config: DecodeAttentionConfig, parts: int, interpret: bool):
    """``prefix_mode="per_group"``: each group's prefix read once per tile of up to
    ``config.prefix_rows`` of its rows. ``q``: ``[B, KVH, G, D]`` in the dot dtype; ``prefix``
    with its K / V already as the kernel reads them (FP8: words). Returns the tiles and the
    tiles' partials ``(acc [T, KVH, C, (parts,) 2 RGp, Dp], m, l [T, KVH, C, 2 RGp])``, C =
    ``config.prefix_splits``: tile slot i's query head j at row ``i G + j``."""
    _, kvh, g, d = q.shape
    groups, p = prefix.k.shape[1], prefix.k.shape[3]
    tiles = prefix.tiles
    if tiles is None or tiles.rows.shape[1] != config.prefix_rows:
        tiles = prefix_tiles(prefix.row_group, groups, config.prefix_rows)
    t, r = tiles.rows.shape
    n_rows = r * g
    rows_p = max(MIN_DOT_ROWS, 1 << (n_rows - 1).bit_length())
    # The tiles' queries: slot (t, i) is row rows[t, i] (B: a zero row), its G heads in order.
    qt = jnp.concatenate([q, jnp.zeros((1, kvh, g, d), q.dtype)])[tiles.rows]  # [T, R, KVH, G, D]
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(t, kvh, n_rows, d)
    qt = _to_parts(jnp.pad(qt, ((0, 0), (0, 0), (0, rows_p - n_rows), (0, 0))), parts)
    c = config.prefix_splits
    q_block = (None, None, *qt.shape[2:])
    nq = len(q_block) - 2
    out_specs, out_shape = _partial_outputs(
        (*qt.shape[:-2], 2 * rows_p, qt.shape[-1]), c)
    pvalid = prefix.valid.astype(jnp.int32)
    partials = _pallas_call(
        functools.partial(_prefix_kernel, block=_block(config, p, parts > 1), slots=p,
                          scale=d**-0.5, parts=parts, splits=c),
        "decode_attention_prefix", config, interpret,
        grid=(t, kvh, c),
        in_specs=[_whole(tiles.count), _whole(layer), _whole(tiles.group),
                  pl.BlockSpec(q_block, lambda i, j, _: (i, j) + (0,) * nq),
                  _whole(pvalid), _whole(prefix.k), _whole(prefix.v)],
        out_specs=out_specs,
        out_shape=out_shape,
    )(tiles.count, layer, tiles.group, qt, pvalid, prefix.k, prefix.v)
    return tiles, partials


def _combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """The splits' partial softmax sums -> the normalized output.

    ``acc`` f32 ``[B, KVH, C, (parts,) Gp, Dp]`` (unnormalized), ``m`` / ``l`` f32 ``[B, KVH,
    C, Gp]`` (running max, sum of exp). A split with no slot has m = MASK_VALUE and l = 0, so
    its weight is 0 beside any real split; a row with no visible slot at all gives 0."""
    top = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - top)  # [B, KVH, C, Gp]
    denom = jnp.maximum(jnp.sum(w * l, axis=2), 1e-30)  # [B, KVH, Gp]
    extra = acc.ndim - w.ndim  # the parts axis sits before Gp
    wb = w.reshape(w.shape[:3] + (1,) * (extra - 1) + w.shape[3:] + (1,))
    db = denom.reshape(denom.shape[:2] + (1,) * (extra - 1) + denom.shape[2:] + (1,))
    return jnp.sum(acc * wb, axis=2) / db


def decode_attention_reference(q, k_all, v_all, layer, valid, kv_len=None,
                               prefix: SharedPrefix | None = None) -> jax.Array:
    """jnp reference: the same math over the whole slot axis (``kv_len`` only bounds what the
    kernel reads; it never changes the result when it covers every valid slot), the shared
    prefix's slots (gathered per row) in front."""
    _check(q, k_all, v_all, valid)
    valid = valid.astype(bool)
    dot_dtype = compute_dtype(k_all.dtype)
    k = jax.lax.dynamic_index_in_dim(k_all, layer, 0, keepdims=False).astype(dot_dtype)
    v = jax.lax.dynamic_index_in_dim(v_all, layer, 0, keepdims=False).astype(dot_dtype)
    if prefix is not None:
        _check_prefix(prefix, k_all)
        rows = lambda a: jax.lax.dynamic_index_in_dim(  # noqa: E731
            a, layer, 0, keepdims=False)[prefix.row_group].astype(dot_dtype)
        k = jnp.concatenate([rows(prefix.k), k], axis=2)
        v = jnp.concatenate([rows(prefix.v), v], axis=2)
        valid = jnp.concatenate([prefix.valid.astype(bool)[prefix.row_group], valid], axis=1)
    d = q.shape[-1]
    s = jnp.einsum("bkgd,bksd->bkgs", q.astype(k.dtype), k,
                   preferred_element_type=jnp.float32) * jnp.float32(d**-0.5)
    s = jnp.where(valid[:, None, None, :], s, MASK_VALUE)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(valid[:, None, None, :], p, 0.0)
    denom = jnp.maximum(jnp.sum(p, axis=-1), 1e-30)
    out = jnp.einsum("bkgs,bksd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (out / denom[..., None]).astype(q.dtype)
