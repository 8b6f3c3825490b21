"""The rollout engine against the model's own full forward (tiny MoE, float32, CPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quads_jax import models
from quads_jax.sampler import engine
from quads_jax.sampler.compaction import generate_compacting
from quads_jax.sampler.engine import FINISH_LENGTH, FINISH_STOP, SamplerConfig
from quads_jax.testing import tiny_config

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19, 20, 21]]
NEW = 8


@pytest.fixture(scope="module")
def model():
    # Two MoE layers (one scan) in float32: exact comparisons, short compiles.
    cfg = tiny_config(dtype="float32", num_hidden_layers=2, mlp_only_layers=())
    return cfg, models.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def full_forward(model):
    cfg, params = model

    @jax.jit
    def run(tokens, mask):
        out = models.forward(cfg, params, tokens, attention_mask=mask, return_router=True)
        return out.logits, out.expert_ids

    return run


@pytest.fixture(scope="module")
def greedy(model):
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS)
    sc = SamplerConfig(max_new_tokens=NEW, greedy=True, return_expert_ids=True)
    return engine.generate(params, tokens, jax.random.key(1), sc, model_config=cfg,
                           prompt_mask=mask)


def _response_rows(rollout):
    """Per row: (positions of response tokens in the rollout row, their tokens)."""
    resp = np.asarray(rollout.response_mask)
    return [np.flatnonzero(r) for r in resp]


def test_greedy_with_cache_equals_argmax_of_full_forward(greedy, full_forward):
    logits, _ = full_forward(greedy.tokens, greedy.attention_mask)
    logits, tokens = np.asarray(logits), np.asarray(greedy.tokens)
    # Causal attention: the logits at position t of the finished sequence are exactly those of a
    # forward recomputed on the prefix [0, t] at that decode step.
    for row, cols in enumerate(_response_rows(greedy)):
        assert len(cols) == NEW
        np.testing.assert_array_equal(tokens[row, cols], np.argmax(logits[row, cols - 1], -1))
    np.testing.assert_array_equal(np.asarray(greedy.finish_reason), FINISH_LENGTH)
    np.testing.assert_array_equal(np.asarray(greedy.response_length), NEW)


def test_logprobs_equal_full_forward_log_softmax(greedy, full_forward):
    logits, _ = full_forward(greedy.tokens, greedy.attention_mask)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    got, tokens = np.asarray(greedy.logprobs), np.asarray(greedy.tokens)
    for row, cols in enumerate(_response_rows(greedy)):
        np.testing.assert_allclose(got[row, cols], logp[row, cols - 1, tokens[row, cols]],
                                   atol=1e-5)
    assert np.all(got[~np.asarray(greedy.response_mask)] == 0)


def test_expert_ids_match_the_full_forward_routing(greedy, full_forward):
    _, ids = full_forward(greedy.tokens, greedy.attention_mask)
    ids, got = np.asarray(ids), np.asarray(greedy.expert_ids)
    fed = np.asarray(greedy.attention_mask).copy()
    fed[:, -1] = False  # the last sampled token is never fed to the model
    assert got.shape == ids.shape
    np.testing.assert_array_equal(np.sort(got[:, fed], -1), np.sort(ids[:, fed], -1))
    assert np.all(got[:, ~fed] == -1)


def test_sampled_logprobs_groups_and_reproducibility(model, full_forward):
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS[1:3])  # same padded width as the 4-prompt batch
    sc = SamplerConfig(max_new_tokens=NEW, temperature=0.7, n_samples=2)
    run = lambda key: engine.generate(params, tokens, key, sc, model_config=cfg, prompt_mask=mask)
    a, b, c = run(jax.random.key(5)), run(jax.random.key(5)), run(jax.random.key(6))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))

    np.testing.assert_array_equal(np.asarray(a.prompt_index), [0, 0, 1, 1])
    toks = np.asarray(a.tokens)
    width = tokens.shape[1]
    np.testing.assert_array_equal(toks[:, :width], np.repeat(tokens, 2, axis=0))
    assert not np.array_equal(toks[0, width:], toks[1, width:]), "group samples are identical"

    logits, _ = full_forward(a.tokens, a.attention_mask)
    logp = np.asarray(jax.nn.log_softmax(logits / 0.7, axis=-1))
    got = np.asarray(a.logprobs)
    for row, cols in enumerate(_response_rows(a)):
        np.testing.assert_allclose(got[row, cols], logp[row, cols - 1, toks[row, cols]],
                                   atol=1e-5)


def test_prompt_alone_or_in_padded_batch_gives_the_same_greedy_tokens(model, greedy):
    cfg, params = model
    row = 1  # the shortest prompt: 5 pad slots in the batch
    sc = SamplerConfig(max_new_tokens=NEW, greedy=True, return_expert_ids=True)
    alone = engine.generate(params, np.asarray([PROMPTS[row]], np.int32), jax.random.key(9), sc,
                            model_config=cfg)
    want = np.asarray(greedy.tokens)[row, -NEW:]
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0, -NEW:], want)
    np.testing.assert_allclose(np.asarray(alone.logprobs)[0, -NEW:],
                               np.asarray(greedy.logprobs)[row, -NEW:], atol=1e-5)


def test_stop_tokens_end_rows_and_the_loop_exits_early(model, greedy):
    cfg, params = model
    width = max(len(p) for p in PROMPTS)
    ref = np.asarray(greedy.tokens)[:, width:]
    # Rows end at different steps, every one by index 5.
    stops = tuple(sorted({int(ref[0, 1]), int(ref[1, 2]), int(ref[2, 3]), int(ref[3, 5])}))
    sc = SamplerConfig(max_new_tokens=NEW, greedy=True, stop_token_ids=stops, pad_token_id=0)
    tokens, mask = engine.left_pad(PROMPTS)
    state = engine.prefill(params, tokens, jax.random.key(1), sc, model_config=cfg,
                           prompt_mask=mask)
    state = engine.decode(params, state, sc, model_config=cfg, max_steps=0)
    assert int(state.step) == 1  # prefill samples the first token
    partial = engine.finish(state, tokens, sc, prompt_mask=mask)
    np.testing.assert_array_equal(np.asarray(partial.tokens)[:, width:][:, 0], ref[:, 0])
    state = engine.decode(params, state, sc, model_config=cfg)  # the rest, in a second segment
    out = engine.finish(state, tokens, sc, prompt_mask=mask)

    first_stop = np.array([np.flatnonzero(np.isin(r, stops))[0] for r in ref])
    length = first_stop + 1
    np.testing.assert_array_equal(np.asarray(out.response_length), length)
    np.testing.assert_array_equal(np.asarray(out.finish_reason), FINISH_STOP)
    assert int(state.step) == length.max() < NEW, "the loop did not exit when all rows were done"
    got = np.asarray(out.tokens)[:, width:]
    resp = np.asarray(out.response_mask)[:, width:]
    for r in range(len(PROMPTS)):
        np.testing.assert_array_equal(got[r, :length[r]], ref[r, :length[r]])
        assert np.all(got[r, length[r]:] == 0) and resp[r].sum() == length[r]

    # Compaction: finished rows leave the batch; the rollout is the same.
    compact, sizes = generate_compacting(params, tokens, jax.random.key(1), sc, model_config=cfg,
                                         prompt_mask=mask, segment_steps=1, min_rows=1)
    for x, y in zip(jax.tree.leaves(compact), jax.tree.leaves(out), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)
    running = [int(np.sum(length > s)) for s in range(1, len(sizes) + 1)]
    assert sizes[0] == 4 and sizes == sorted(sizes, reverse=True)
    assert all(size >= r for size, r in zip(sizes, running, strict=True)), (sizes, running)
    assert min(sizes) < 4, f"no compaction happened: lengths {length}, sizes {sizes}"


def test_chunked_prefill_with_groups_equals_one_pass(model, greedy):
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS)
    sc = SamplerConfig(max_new_tokens=NEW, greedy=True, return_expert_ids=True, n_samples=2,
                       prefill_chunk=2)
    out = engine.generate(params, tokens, jax.random.key(1), sc, model_config=cfg,
                          prompt_mask=mask)
    # Greedy samples of one group are identical, and equal the one-pass, n=1 rollout.
    for got, want in ((out.tokens, greedy.tokens), (out.expert_ids, greedy.expert_ids),
                      (out.response_mask, greedy.response_mask)):
        axis = 1 if got.ndim == 4 else 0
        np.testing.assert_array_equal(np.asarray(got), np.repeat(np.asarray(want), 2, axis=axis))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.repeat(greedy.logprobs, 2, axis=0),
                               atol=1e-5)
    with pytest.raises(ValueError, match="batch 4 is not a multiple of SamplerConfig"):
        engine.generate(params, tokens, jax.random.key(1), SamplerConfig(prefill_chunk=3),
                        model_config=cfg, prompt_mask=mask)


@pytest.mark.parametrize("sampling", [dict(greedy=True, return_expert_ids=True),
                                      dict(temperature=0.8)])
def test_shared_prompt_cache_gives_the_rollout_of_copied_prompts(model, sampling):
    """``share_prompt_cache``: a group's n rows read one copy of its prompt's keys (the cache's
    prefix) instead of n; the rollout is the same, the cache holds (n - 1) x P fewer slots."""
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS[:3])
    sc = SamplerConfig(max_new_tokens=NEW, n_samples=3, **sampling)
    shared = dataclasses.replace(sc, share_prompt_cache=True)
    want = engine.generate(params, tokens, jax.random.key(4), sc, model_config=cfg,
                           prompt_mask=mask)
    got = engine.generate(params, tokens, jax.random.key(4), shared, model_config=cfg,
                          prompt_mask=mask)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)

    state = engine.prefill(params, tokens, jax.random.key(4), shared, model_config=cfg,
                           prompt_mask=mask)
    width = tokens.shape[1]
    c = state.cache
    assert c.prefix_k.shape[1:4:2] == (3, width) and c.k.shape[1:4:2] == (9, NEW - 1)
    np.testing.assert_array_equal(np.asarray(c.row_group), np.repeat(np.arange(3), 3))
    np.testing.assert_array_equal(np.asarray(c.prefix_mask), mask)

    if not sampling.get("greedy"):
        return
    # Compaction keeps each row's group when finished rows leave the batch: with a stop token
    # that ends the first group early, the batch shrinks and the rollout stays the same.
    stopping = dataclasses.replace(
        shared, stop_token_ids=(int(np.asarray(want.tokens)[0, width + 1]),))
    compact, sizes = generate_compacting(params, tokens, jax.random.key(4), stopping,
                                         model_config=cfg, prompt_mask=mask, segment_steps=2,
                                         min_rows=1)
    same = engine.generate(params, tokens, jax.random.key(4), stopping, model_config=cfg,
                           prompt_mask=mask)
    assert min(sizes) < sizes[0], sizes
    for x, y in zip(jax.tree.leaves(compact), jax.tree.leaves(same), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def test_rac_rollout_ignores_padding_and_finished_rows(model):
    """RAC's online_batch selection scores the GEMM's tokens only (``ops.linear``'s
    ``row_valid``): left padding and finished rows hold garbage that depends on the cache
    layout, and must not change a token's compensation. So the NVFP4 + RAC rollout is the same
    with prompt caches copied per row or shared (different garbage in the pad rows)."""
    from quads_jax.quant.recipe import get_recipe
    from quads_jax.sampler.sync import sync

    cfg, params = model
    recipe = get_recipe("rollout_quads")
    rollout_params = sync(params, recipe, model_config=cfg)
    tokens, mask = engine.left_pad(PROMPTS)
    stops = (7,)
    sc = SamplerConfig(max_new_tokens=NEW, greedy=True, n_samples=2, stop_token_ids=stops)
    outs = [engine.generate(rollout_params, tokens, jax.random.key(0),
                            dataclasses.replace(sc, share_prompt_cache=share),
                            model_config=cfg, recipe=recipe, prompt_mask=mask)
            for share in (False, True)]
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
    np.testing.assert_allclose(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs),
                               atol=1e-5)


@pytest.mark.parametrize("overrides, packs", [
    ({"unroll_decode_layers": True}, False),
    ({"pack_decode_layer_vectors": False}, False),
    ({}, True),  # the default packs the scan's per-layer vectors
])
def test_decode_layer_loop_variants_equal_the_scan(model, greedy, overrides, packs, monkeypatch):
    from quads_jax.models import transformer

    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS)
    packed = []  # the decode step really packs (the flag reaches the layer scan)
    pack = transformer.pack_layer_vectors
    monkeypatch.setattr(transformer, "pack_layer_vectors",
                        lambda *a: packed.append(1) or pack(*a))
    sc = SamplerConfig(max_new_tokens=NEW, greedy=True, return_expert_ids=True, **overrides)
    jax.clear_caches()  # the default config's decode step was traced by ``greedy``: trace again
    out = engine.generate(params, tokens, jax.random.key(1), sc, model_config=cfg,
                          prompt_mask=mask)
    assert bool(packed) == packs
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy.tokens))
    np.testing.assert_array_equal(np.asarray(out.expert_ids), np.asarray(greedy.expert_ids))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(greedy.logprobs), atol=1e-5)


def _generate(model, prompts, mask=None, **kwargs):
    cfg, params = model
    return engine.generate(params, prompts, jax.random.key(0), SamplerConfig(**kwargs),
                           model_config=cfg, prompt_mask=mask)


@pytest.mark.parametrize(
    "prompts,mask,kwargs,needle",
    [
        (np.zeros((1, 0), np.int32), None, {}, r"shape \(1, 0\) is empty"),
        (np.asarray([[0, 5], [0, 0]], np.int32), np.asarray([[0, 1], [0, 0]], bool), {},
         "row 1 is empty"),
        (np.ones((1, 510), np.int32), None, {"max_new_tokens": 8},
         "510 \\+ max_new_tokens 8 = 518 exceeds the model context max_position_embeddings=512"),
        (np.asarray([[5, 0]], np.int32), np.asarray([[1, 0]], bool), {}, "not left-padded"),
        (np.asarray([[5, 10_000]], np.int32), None, {}, "token id 10000 is outside"),
        (np.asarray([[0.5, 1.0]]), None, {}, "expected integer token ids"),
    ],
)
def test_bad_prompts_raise(model, prompts, mask, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        _generate(model, prompts, mask, **kwargs)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"temperature": 0.0}, r"temperature=0\.0 must be a number > 0"),
        ({"temperature": -0.5, "greedy": False}, r"temperature=-0\.5"),
        ({"top_p": 0.0}, r"top_p=0\.0 must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p=1\.01"),
        ({"max_new_tokens": 0}, r"max_new_tokens=0"),
        ({"n_samples": 0}, r"n_samples=0"),
        ({"stop_token_ids": [2]}, r"stop_token_ids=\[2\]"),
        ({"kv_cache_dtype": "int8"}, r"kv_cache_dtype='int8'"),
        ({"unroll_decode_layers": 1}, r"unroll_decode_layers=1"),
    ],
)
def test_bad_sampler_config_raises(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplerConfig(**kwargs)


def test_left_pad_rejects_empty_prompts():
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.left_pad([[3], []])
    with pytest.raises(ValueError, match="empty list"):
        engine.left_pad([])
    tokens, mask = engine.left_pad([[3, 4], [5]], pad_token_id=9)
    np.testing.assert_array_equal(tokens, [[3, 4], [9, 5]])
    np.testing.assert_array_equal(mask, [[True, True], [False, True]])
    assert jnp.asarray(tokens).dtype == jnp.int32


def test_fp8_kv_cache_generates_close_to_the_float32_cache(model, greedy):
    """An FP8 E4M3 cache holds FP8 keys and values (saturated), and the rollout stays close to
    the full-precision one: the greedy log-probs of the first tokens within FP8's rounding."""
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS)
    sc = SamplerConfig(max_new_tokens=NEW, greedy=True, kv_cache_dtype="float8_e4m3fn")
    assert engine._cache_dtype(sc, cfg) == jnp.float8_e4m3fn
    r8 = engine.generate(params, tokens, jax.random.key(1), sc, model_config=cfg,
                         prompt_mask=mask)
    resp, resp8 = np.asarray(greedy.response_mask), np.asarray(r8.response_mask)
    lp, lp8 = np.asarray(greedy.logprobs), np.asarray(r8.logprobs)
    first = np.argmax(resp, axis=1)  # each row's first response token (same prompt, same slot)
    assert (np.argmax(resp8, axis=1) == first).all()
    rows = np.arange(len(PROMPTS))
    assert np.isfinite(lp8[resp8.astype(bool)]).all()
    diff = np.abs(lp8[rows, first] - lp[rows, first])
    assert diff.max() < 0.1 and diff.max() > 0  # FP8 changes the numbers, a little


@pytest.mark.numerics
def test_fp8_kv_rollout_logprobs_equal_the_aligned_trainer_forward(model):
    """``QuantRecipe.kv_quant``: a forward without a cache that rounds keys and values as the
    FP8 cache stores them gives the FP8-cache rollout's log-probs (float32, to 1e-5); without
    it the two differ by FP8's rounding. The rounding passes gradients straight through."""
    from quads_jax.quant.recipe import get_recipe

    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS)
    sc = SamplerConfig(max_new_tokens=NEW, greedy=True, kv_cache_dtype="float8_e4m3fn")
    r8 = engine.generate(params, tokens, jax.random.key(1), sc, model_config=cfg,
                         prompt_mask=mask)
    resp = np.asarray(r8.response_mask).astype(bool)
    toks = np.asarray(r8.tokens)

    # the forwards jitted, as the trainer runs them (eagerly, every small op compiled)
    def token_logprobs(recipe):
        logits = jax.jit(lambda p, t, m: models.forward(cfg, p, t, attention_mask=m,
                                                        recipe=recipe).logits)(
            params, r8.tokens, r8.attention_mask)
        lp = jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1)
        got = np.take_along_axis(np.asarray(lp)[:, :-1], toks[:, 1:, None], axis=-1)[..., 0]
        return got[resp[:, 1:]]

    want = np.asarray(r8.logprobs)[resp]
    aligned = token_logprobs(get_recipe("bf16", kv_quant="float8_e4m3fn"))
    plain = token_logprobs(get_recipe("bf16"))
    np.testing.assert_allclose(aligned, want, atol=1e-5)
    assert np.abs(plain - want).max() > 1e-3

    def loss(p):
        out = models.forward(cfg, p, r8.tokens, attention_mask=r8.attention_mask,
                             recipe=get_recipe("bf16", kv_quant="float8_e4m3fn"))
        return jnp.mean(out.logits**2)

    grads = jax.jit(jax.grad(loss))(params)
    g = grads["layers"][0]["attn"]
    key = "k_proj" if "k_proj" in g else "qkv_proj"
    assert np.isfinite(np.asarray(g[key])).all() and np.abs(np.asarray(g[key])).max() > 0
