"""The decode attention kernel (Pallas, Triton backend): interpret mode against the jnp
reference and through the model's cached decode, cuda lowering, bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.decode_attention import (
    DecodeAttentionConfig,
    SharedPrefix,
    decode_attention,
    decode_attention_reference,
    prefix_tiles,
)
from quads_jax.models import KVCache, forward, init_params
from quads_jax.quant.recipe import get_recipe
from quads_jax.testing import pallas_calls, tiny_config

H200 = AbstractMesh((), (), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", platform="gpu", num_cores=132))


def _inputs(layers, b, kvh, s, d, g, seed=0, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(ks[0], (layers, b, kvh, s, d), dtype)
    v = jax.random.normal(ks[1], (layers, b, kvh, s, d), dtype)
    q = jax.random.normal(ks[2], (b, kvh, g, d), dtype)
    return q, k, v


@pytest.mark.parametrize(
    "b,kvh,s,d,g,block_s,kv_len",
    [
        (3, 2, 50, 32, 4, 16, 37),   # S and kv_len not multiples of the block; last window moved
        (2, 1, 64, 16, 8, 64, 64),   # one full block
        (2, 2, 40, 16, 16, 16, 17),  # G = 16 (no padding), one slot into the second block
        (1, 4, 20, 32, 1, 64, 20),   # block larger than S: clipped to a power of two <= S
    ],
)
def test_kernel_matches_reference(b, kvh, s, d, g, block_s, kv_len):
    q, k, v = _inputs(3, b, kvh, s, d, g)
    slot = jnp.arange(s)[None, :]
    first = jnp.arange(b)[:, None] * 3  # left padding differs per row
    valid = (slot < kv_len) & (slot >= first)
    got = decode_attention(q, k, v, jnp.int32(1), valid, jnp.int32(kv_len),
                           config=DecodeAttentionConfig(block_s=block_s), interpret=True)
    want = decode_attention_reference(q, k, v, 1, valid)
    assert got.shape == (b, kvh, g, d) and got.dtype == q.dtype
    # Only the rounding of P to bf16 before the PV product differs (after vs before the
    # normalisation), a few bf16 ulps of O(1) outputs.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2)
    # The kernel reads the layer it is told to: another layer gives other numbers.
    other = decode_attention_reference(q, k, v, 2, valid)
    assert not np.allclose(np.asarray(got, np.float32), np.asarray(other, np.float32), atol=0.1)


@pytest.mark.parametrize("splits,kv_len,d,fp8", [
    (2, 50, 32, False),  # 4 blocks of 16: two each, the last window moved back
    (3, 37, 32, False),  # 3 blocks: one each
    (5, 20, 32, False),  # 2 blocks over 5 splits: three splits read nothing (weight 0)
    (2, 45, 128, True),  # FP8 cache read as int32 words: the splits' column sets combined
])
def test_slot_splits_match_the_reference(splits, kv_len, d, fp8):
    """Flash-decoding splits: each (row, KV head) runs as ``splits`` programs over consecutive
    slot blocks; their unnormalized sums combine to the reference; a row with no visible slot
    still gives 0."""
    from quads_jax.models.kv_cache import to_cache_dtype

    q, k, v = _inputs(2, 3, 2, 50, d, 4, seed=11)
    if fp8:
        k, v = (to_cache_dtype(a, jnp.float8_e4m3fn) for a in (k, v))
    slot = jnp.arange(50)[None, :]
    valid = (slot < kv_len) & (slot >= jnp.asarray([[0], [7], [0]]))
    valid = valid.at[2].set(False)
    cfg = DecodeAttentionConfig(block_s=16, slot_splits=splits)
    got = decode_attention(q, k, v, jnp.int32(1), valid, jnp.int32(kv_len), config=cfg,
                           interpret=True)
    want = decode_attention_reference(q, k, v, 1, valid)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2)
    assert np.all(np.asarray(got[2]) == 0)
    one = decode_attention(q, k, v, jnp.int32(1), valid, jnp.int32(kv_len),
                           config=DecodeAttentionConfig(block_s=16), interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(one, np.float32),
                               atol=1e-2, rtol=1e-2)


def _prefix(layers, groups, kvh, p, d, b, seed, dtype=jnp.bfloat16):
    """A shared prefix of ``groups`` left-padded prompts of ``p`` slots; rows to groups as a
    GRPO batch lays them out (adjacent rows share a group)."""
    ks = jax.random.split(jax.random.key(seed), 2)
    pk = jax.random.normal(ks[0], (layers, groups, kvh, p, d), dtype)
    pv = jax.random.normal(ks[1], (layers, groups, kvh, p, d), dtype)
    pad = jnp.arange(groups)[:, None] * 5  # each group's left padding differs
    valid = jnp.arange(p)[None, :] >= pad
    row_group = (jnp.arange(b) * groups // b).astype(jnp.int32)
    return SharedPrefix(pk, pv, valid, row_group)


@pytest.mark.parametrize("p,splits,fp8", [
    (37, 1, False),  # prefix not a multiple of the block: its last window moved back
    (16, 1, False),  # one prefix block
    (40, 3, False),  # flash-decoding splits: split 0 reads the prefix
    (48, 1, True),   # FP8 cache and prefix, read as int32 words
])
def test_shared_prefix_matches_the_reference(p, splits, fp8):
    """Every row attends to its group's prefix slots and then its own: equal to the reference
    over the prefix (gathered per row) concatenated in front of the row's slots."""
    from quads_jax.models.kv_cache import to_cache_dtype

    d = 128 if fp8 else 32
    q, k, v = _inputs(2, 4, 2, 24, d, 4, seed=21)
    prefix = _prefix(2, 2, 2, p, d, 4, seed=22)
    if fp8:
        k, v = (to_cache_dtype(a, jnp.float8_e4m3fn) for a in (k, v))
        prefix = prefix._replace(k=to_cache_dtype(prefix.k, jnp.float8_e4m3fn),
                                 v=to_cache_dtype(prefix.v, jnp.float8_e4m3fn))
    valid = jnp.arange(24)[None, :] < jnp.asarray([[10], [3], [20], [0]])  # row 3: prefix only
    cfg = DecodeAttentionConfig(block_s=16, slot_splits=splits)
    got = decode_attention(q, k, v, jnp.int32(1), valid, jnp.int32(20), prefix, config=cfg,
                           interpret=True)
    want = decode_attention_reference(q, k, v, 1, valid, prefix=prefix)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2)
    # The prefix really counts: without it the rows' outputs move.
    alone = decode_attention_reference(q, k, v, 1, valid.at[3, 0].set(True))
    assert not np.allclose(np.asarray(got, np.float32)[:3], np.asarray(alone, np.float32)[:3],
                           atol=0.1)


@pytest.mark.parametrize("row_group,rows,splits,slot_splits,fp8", [
    ([0, 0, 0, 1, 1, 1], 4, 1, 1, False),     # GRPO layout, one tile per group
    ([1, 0, 1, 1, 0, 1], 2, 2, 1, False),     # groups interleaved (compaction, joins); a group
                                              # over two tiles; the prefix in 2 slot ranges
    ([1, 1, 1, 1, 1, 1], 1, 1, 2, False),     # one group, a tile per row; rows' slot_splits
    ([0, 1, 0, 1, 0, 1], 4, 1, 1, True),      # FP8 cache and prefix, read as int32 words
])
def test_per_group_prefix_matches_the_reference(row_group, rows, splits, slot_splits, fp8):
    """``prefix_mode="per_group"``: the prefix read once per tile of a group's rows, the rows'
    own slots per row, the partials combined: the reference for any grouping of the rows."""
    from quads_jax.models.kv_cache import to_cache_dtype

    d = 128 if fp8 else 32
    q, k, v = _inputs(2, 6, 2, 24, d, 4, seed=23)
    prefix = _prefix(2, 2, 2, 37, d, 6, seed=24)._replace(
        row_group=jnp.asarray(row_group, jnp.int32))
    if fp8:
        k, v = (to_cache_dtype(a, jnp.float8_e4m3fn) for a in (k, v))
        prefix = prefix._replace(k=to_cache_dtype(prefix.k, jnp.float8_e4m3fn),
                                 v=to_cache_dtype(prefix.v, jnp.float8_e4m3fn))
    valid = jnp.arange(24)[None, :] < jnp.asarray([[10], [3], [20], [0], [24], [7]])
    cfg = DecodeAttentionConfig(block_s=16, slot_splits=slot_splits, prefix_mode="per_group",
                                prefix_rows=rows, prefix_splits=splits)
    want = decode_attention_reference(q, k, v, 1, valid, prefix=prefix)
    got = decode_attention(q, k, v, jnp.int32(1), valid, jnp.int32(24), prefix, config=cfg,
                           interpret=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2)
    # The tiles built once for a step's layers give the same result as built per call.
    tiled = prefix._replace(tiles=prefix_tiles(prefix.row_group, 2, rows))
    again = decode_attention(q, k, v, jnp.int32(1), valid, jnp.int32(24), tiled, config=cfg,
                             interpret=True)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got))


def test_auto_prefix_mode_reads_long_prefixes_per_group():
    """The default ("auto") reads a prefix of >= prefix_group_min_slots slots per group tile
    and a shorter one per row; the model builds group tiles only when they are used."""
    from quads_jax.models import layers

    auto = DecodeAttentionConfig()
    assert auto.prefix_mode == "auto"
    assert [auto.per_group(p) for p in (16, 511, 512, 4096)] == [False, False, True, True]
    assert not DecodeAttentionConfig(prefix_mode="per_row").per_group(4096)
    assert DecodeAttentionConfig(prefix_mode="per_group").per_group(16)
    row_group = jnp.array([0, 0, 1, 1], jnp.int32)
    try:
        layers.set_decode_attention("kernel", DecodeAttentionConfig(prefix_group_min_slots=64))
        assert layers.decode_prefix_tiles(row_group, 2, 63) is None
        tiles = layers.decode_prefix_tiles(row_group, 2, 64)
        assert tiles is not None and int(tiles.count[0]) == 2
    finally:
        layers.set_decode_attention("kernel")


def test_prefix_tiles_cover_every_row_once():
    rg = jnp.asarray([2, 0, 2, 2, 1, 2, 0, 2, 2], jnp.int32)
    t = prefix_tiles(rg, 3, 2)
    rows, group, count = np.asarray(t.rows), np.asarray(t.group), int(t.count[0])
    # ceil(2/2) + ceil(1/2) + ceil(6/2) = 5 live tiles, T = min(9, 3 + 5) = 8.
    assert rows.shape == (8, 2) and count == 5
    live = rows[:count]
    assert sorted(live[live < 9].tolist()) == list(range(9)) and (rows[count:] == 9).all()
    for ti in range(count):  # every tile holds rows of its own group only, in row order
        members = live[ti][live[ti] < 9]
        assert (np.asarray(rg)[members] == group[ti]).all() and (np.diff(members) > 0).all()
    np.testing.assert_array_equal(rows[np.asarray(t.row_tile), np.asarray(t.row_pos)],
                                  np.arange(9))


def test_shared_prefix_equals_the_prompt_copied_into_every_row():
    """The layout it replaces: each row holding its group's prompt in front of its own slots
    (what ``generate`` builds without ``share_prompt_cache``) gives the same output."""
    q, k, v = _inputs(1, 4, 2, 16, 32, 4, seed=31)
    prefix = _prefix(1, 2, 2, 20, 32, 4, seed=32)
    valid = jnp.arange(16)[None, :] < jnp.asarray([[5], [9], [16], [1]])
    got = decode_attention(q, k, v, jnp.int32(0), valid, jnp.int32(16), prefix,
                           config=DecodeAttentionConfig(block_s=16), interpret=True)
    rows = prefix.row_group
    k_full = jnp.concatenate([prefix.k[:, rows], k], axis=3)
    v_full = jnp.concatenate([prefix.v[:, rows], v], axis=3)
    valid_full = jnp.concatenate([prefix.valid[rows], valid], axis=1)
    copied = decode_attention(q, k_full, v_full, jnp.int32(0), valid_full, jnp.int32(36),
                              config=DecodeAttentionConfig(block_s=16), interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(copied, np.float32),
                               atol=1e-2, rtol=1e-2)


def test_rows_without_visible_slots_give_zero_and_kv_len_bounds_the_read():
    q, k, v = _inputs(2, 2, 2, 48, 16, 4, seed=1)
    valid = jnp.zeros((2, 48), bool).at[0, 10:20].set(True)
    got = decode_attention(q, k, v, jnp.int32(0), valid, jnp.int32(20), interpret=True)
    assert np.all(np.asarray(got[1]) == 0)
    # Slots past kv_len are never read: garbage there changes nothing.
    k2 = k.at[:, :, :, 20:].set(jnp.nan)
    again = decode_attention(q, k2, v, jnp.int32(0), valid, jnp.int32(20), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))


def test_int32_valid_and_kv_len_past_the_cache_give_the_same_result():
    q, k, v = _inputs(1, 2, 2, 40, 16, 4, seed=2)
    valid = (jnp.arange(40)[None, :] < jnp.asarray([[33], [12]]))
    got = decode_attention(q, k, v, jnp.int32(0), valid, jnp.int32(33), interpret=True)
    as_int = decode_attention(q, k, v, jnp.int32(0), valid.astype(jnp.int32), jnp.int32(33),
                              interpret=True)
    np.testing.assert_array_equal(np.asarray(as_int), np.asarray(got))
    # kv_len is clamped to the cache's 40 slots in the kernel (the reads stay in bounds)
    past = decode_attention(q, k, v, jnp.int32(0), valid, jnp.int32(1000), interpret=True)
    np.testing.assert_array_equal(np.asarray(past), np.asarray(got))
    want = decode_attention_reference(q, k, v, 0, valid.astype(jnp.int32))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("d", [32, 128])  # int16 words (2 codes) / int32 words (4 codes)
def test_fp8_cache_matches_the_reference(d):
    """An FP8 E4M3 cache: the kernel converts each block to bf16 (exact) and agrees with the
    reference on the same FP8 cache; the output stays within FP8's rounding of the bf16 one."""
    from quads_jax.models.kv_cache import to_cache_dtype

    q, k, v = _inputs(2, 2, 2, 48, d, 4, seed=3)
    k8, v8 = (to_cache_dtype(a, jnp.float8_e4m3fn) for a in (k, v))
    valid = jnp.ones((2, 48), bool).at[0, :5].set(False)
    got = decode_attention(q, k8, v8, jnp.int32(1), valid, jnp.int32(48),
                           config=DecodeAttentionConfig(block_s=16), interpret=True)
    want = decode_attention_reference(q, k8, v8, 1, valid)
    assert got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2)
    bf16 = decode_attention_reference(q, k, v, 1, valid)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(bf16, np.float32)).max()
    assert 1e-3 < err < 0.25  # FP8 rounds (3 mantissa bits), and only that much


def test_fp8_cache_goes_to_the_kernel_as_words():
    """jax 0.11.2's Triton lowering overflows 32-bit offsets on 1-byte arrays past 2**31
    elements (the 30B decode cache: an illegal address on the H200): the kernel must get the
    FP8 cache as int32 words, a quarter of the elements, never as float8."""
    q = jax.ShapeDtypeStruct((128, 4, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((48, 128, 4, 1280, 128), jnp.float8_e4m3fn)  # 4.0e9 elements
    valid = jax.ShapeDtypeStruct((128, 1280), jnp.bool_)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    calls = pallas_calls(jax.make_jaxpr(decode_attention)(q, kv, kv, i, valid, i))
    assert len(calls) == 1
    caches = [v.aval for v in calls[0].invars[-2:]]  # (.., q, valid, k_all, v_all)
    assert [(a.shape, a.dtype) for a in caches] == [((48, 128, 4, 1280, 32), jnp.int32)] * 2
    assert all(a.size < 2**31 for a in caches)


def test_fp8_cache_saturates_instead_of_nan():
    from quads_jax.models.kv_cache import to_cache_dtype

    x = jnp.asarray([1.0, -3.3, 1000.0, -1e6, 448.0], jnp.bfloat16)
    got = np.asarray(to_cache_dtype(x, jnp.float8_e4m3fn).astype(jnp.float32))
    np.testing.assert_array_equal(got, [1.0, -3.25, 448.0, -448.0, 448.0])
    assert to_cache_dtype(x, jnp.bfloat16).dtype == jnp.bfloat16


def test_model_decode_step_through_the_kernel_matches_the_jnp_path():
    c = tiny_config(dtype="bfloat16")
    params = init_params(c, jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (2, 20), 3, c.vocab_size)
    mask = jnp.ones((2, 20), bool).at[1, :4].set(False)  # a left-padded row
    recipe = get_recipe("bf16")
    cache = KVCache.init(c, 2, 24, dtype=jnp.bfloat16)
    pre = forward(c, params, tok, attention_mask=mask, cache=cache, recipe=recipe)
    nxt = jnp.asarray([[5], [7]], jnp.int32)
    outs = {}
    for backend in ("reference", "interpret"):
        r = dataclasses.replace(recipe, backend=backend)
        outs[backend] = forward(c, params, nxt, cache=pre.cache, recipe=r)
    np.testing.assert_allclose(np.asarray(outs["interpret"].logits),
                               np.asarray(outs["reference"].logits), atol=5e-2)
    # Layer 0's new key comes before any attention: the same bits on both paths.
    np.testing.assert_array_equal(np.asarray(outs["interpret"].cache.k[0]),
                                  np.asarray(outs["reference"].cache.k[0]))


def test_model_decode_step_with_a_shared_prefix_through_the_kernel():
    """A GRPO-shaped cache (``share_prompt_cache``: 2 prompts of 16 tokens as the prefix of 4
    rows): one decode step through the kernel, in either prefix mode (per_group with the
    step's tiles built once by the model), equals the jnp path, which equals the step on the
    cache with each row holding its own copy of the prompt."""
    import dataclasses as dc

    from quads_jax.models import layers
    from quads_jax.sampler import engine
    from quads_jax.sampler.engine import SamplerConfig

    c = tiny_config(dtype="bfloat16", num_hidden_layers=2, mlp_only_layers=())  # one scan
    params = init_params(c, jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (2, 16), 3, c.vocab_size)
    mask = jnp.ones((2, 16), bool).at[1, :3].set(False)
    sc = SamplerConfig(max_new_tokens=17, n_samples=2, greedy=True, share_prompt_cache=True)
    nxt = jnp.asarray([[5], [7], [9], [11]], jnp.int32)
    pos = jnp.asarray([[16], [16], [13], [13]], jnp.int32)

    def step(share, backend):
        state = engine.prefill(params, tok, jax.random.key(2),
                               dc.replace(sc, share_prompt_cache=share), model_config=c,
                               prompt_mask=mask)
        r = dc.replace(get_recipe("bf16"), backend=backend)
        return np.asarray(forward(c, params, nxt, positions=pos, cache=state.cache,
                                  recipe=r).logits)

    reference = step(True, "reference")
    np.testing.assert_allclose(reference, step(False, "reference"), atol=5e-2)
    try:
        for mode in ("per_row", "per_group"):
            layers.set_decode_attention("kernel", DecodeAttentionConfig(prefix_mode=mode,
                                                                        prefix_rows=2))
            np.testing.assert_allclose(step(True, "interpret"), reference, atol=5e-2,
                                       err_msg=mode)
    finally:
        layers.set_decode_attention("kernel")


@pytest.mark.parametrize("cache_dtype,splits", [(jnp.bfloat16, 1), (jnp.float8_e4m3fn, 1),
                                                (jnp.bfloat16, 4), (jnp.float8_e4m3fn, 2)])
def test_lowers_for_cuda(cache_dtype, splits):
    q = jax.ShapeDtypeStruct((4, 2, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 4, 2, 1279, 128), cache_dtype)
    valid = jax.ShapeDtypeStruct((4, 1279), jnp.bool_)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    fn = functools.partial(decode_attention, config=DecodeAttentionConfig(slot_splits=splits))
    with jax.sharding.use_abstract_mesh(H200):
        exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, kv, kv, i, valid, i)
    assert "xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("cache_dtype,mode", [(jnp.bfloat16, "per_row"),
                                               (jnp.float8_e4m3fn, "per_row"),
                                               (jnp.bfloat16, "per_group"),
                                               (jnp.float8_e4m3fn, "per_group")])
def test_shared_prefix_lowers_for_cuda(cache_dtype, mode):
    q = jax.ShapeDtypeStruct((16, 4, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 16, 4, 1023, 128), cache_dtype)
    pkv = jax.ShapeDtypeStruct((2, 2, 4, 256, 128), cache_dtype)
    prefix = SharedPrefix(pkv, pkv, jax.ShapeDtypeStruct((2, 256), jnp.bool_),
                          jax.ShapeDtypeStruct((16,), jnp.int32))
    valid = jax.ShapeDtypeStruct((16, 1023), jnp.bool_)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    fn = functools.partial(decode_attention, config=DecodeAttentionConfig(
        prefix_mode=mode, prefix_splits=2 if mode == "per_group" else 1))
    with jax.sharding.use_abstract_mesh(H200):
        exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
                q, kv, kv, i, valid, i, prefix)
    assert exp.mlir_module().count("xla.gpu.triton") >= (2 if mode == "per_group" else 1)


def test_bad_input_is_refused():
    q, k, v = _inputs(2, 2, 2, 32, 16, 4, seed=5)
    with pytest.raises(ValueError, match="head_dim 16 with an FP8 cache must be >= 32"):
        decode_attention(q, k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn),
                         jnp.int32(0), jnp.ones((2, 32), bool), jnp.int32(32), interpret=True)

    q, k, v = _inputs(1, 2, 2, 32, 16, 4)
    valid = jnp.ones((2, 32), bool)
    with pytest.raises(ValueError, match=r"q \(2, 2, 4, 8\) does not fit"):
        decode_attention(q[..., :8], k, v, 0, valid, 32, interpret=True)
    with pytest.raises(ValueError, match="valid"):
        decode_attention(q, k, v, 0, valid[:, :16], 32, interpret=True)
    with pytest.raises(ValueError, match=r"valid float32\[2, 32\] must be bool or int32"):
        decode_attention(q, k, v, 0, valid.astype(jnp.float32), 32, interpret=True)
    with pytest.raises(ValueError, match="must match"):
        decode_attention(q, k, v[..., :8], 0, valid, 32, interpret=True)
    with pytest.raises(ValueError, match="cache dtype"):
        decode_attention(q, k.astype(jnp.float32), v.astype(jnp.float32), 0, valid, 32,
                         interpret=True)
    with pytest.raises(ValueError, match="needs >= 16"):
        decode_attention(q, k[:, :, :, :8], v[:, :, :, :8], 0, valid[:, :8], 8, interpret=True)
    with pytest.raises(ValueError, match="block_s=24"):
        DecodeAttentionConfig(block_s=24)
    with pytest.raises(ValueError, match=r"prefix_mode='shared': must be one of \('auto'"):
        DecodeAttentionConfig(prefix_mode="shared")
    with pytest.raises(ValueError, match="fp8_block_s=48: must be a power of two"):
        DecodeAttentionConfig(fp8_block_s=48)
    with pytest.raises(ValueError, match="prefix_group_min_slots=-1: must be >= 0"):
        DecodeAttentionConfig(prefix_group_min_slots=-1)
    with pytest.raises(ValueError, match="prefix_rows=6: must be a power of two in"):
        DecodeAttentionConfig(prefix_rows=6)
    with pytest.raises(ValueError, match="prefix_splits=0: must be in"):
        DecodeAttentionConfig(prefix_splits=0)
    prefix = _prefix(1, 1, 2, 20, 16, 2, seed=6)
    with pytest.raises(ValueError, match=r"prefix row_group int32\[3\] must be int32 \[B\]"):
        decode_attention(q, k, v, 0, valid, 32, prefix._replace(
            row_group=jnp.zeros((3,), jnp.int32)), interpret=True)
    with pytest.raises(ValueError, match=r"prefix valid bool\[1, 8\] must be"):
        decode_attention(q, k, v, 0, valid, 32, prefix._replace(valid=prefix.valid[:, :8]),
                         interpret=True)
    with pytest.raises(ValueError, match="in the cache's dtype"):
        decode_attention(q, k, v, 0, valid, 32, prefix._replace(
            k=prefix.k.astype(jnp.float16), v=prefix.v.astype(jnp.float16)), interpret=True)
    with pytest.raises(ValueError, match="prefix: 8 cache slots; the kernel needs >= 16"):
        decode_attention(q, k, v, 0, valid, 32, prefix._replace(
            k=prefix.k[..., :8, :], v=prefix.v[..., :8, :], valid=prefix.valid[:, :8]),
            interpret=True)


def test_jnp_switch_bypasses_the_kernel_and_bad_impl_is_refused():
    from quads_jax.models import layers

    q, k, v = _inputs(1, 2, 2, 32, 16, 4)
    q4 = q.reshape(2, 1, 8, 16)
    valid = jnp.ones((2, 32), bool)
    assert layers.decode_attend(q4, k, v, 0, valid, 32, "interpret") is not None
    layers.set_decode_attention("jnp")
    try:
        assert layers.decode_attend(q4, k, v, 0, valid, 32, "interpret") is None
    finally:
        layers.set_decode_attention("kernel")
    # A cache the kernel does not take (f32, or fewer than 16 slots) goes the jnp way.
    assert layers.decode_attend(q4, k.astype(jnp.float32), v.astype(jnp.float32), 0, valid, 32,
                                "interpret") is None
    assert layers.decode_attend(q4, k[:, :, :, :8], v[:, :, :, :8], 0, valid[:, :8], 8,
                                "interpret") is None
    with pytest.raises(ValueError, match="impl='triton'"):
        layers.set_decode_attention("triton")
    # The kernel's config goes through the switch too (slot splits: the same numbers).
    plain = layers.decode_attend(q4, k, v, 0, valid, 32, "interpret")
    layers.set_decode_attention("kernel", DecodeAttentionConfig(block_s=16, slot_splits=2))
    try:
        split = layers.decode_attend(q4, k, v, 0, valid, 32, "interpret")
        with pytest.raises(ValueError, match="must be a DecodeAttentionConfig"):
            layers.set_decode_attention("kernel", {"slot_splits": 2})
    finally:
        layers.set_decode_attention("kernel")
    np.testing.assert_allclose(np.asarray(split, np.float32), np.asarray(plain, np.float32),
                               atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="slot_splits=0"):
        DecodeAttentionConfig(slot_splits=0)
