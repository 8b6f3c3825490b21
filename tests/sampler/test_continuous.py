"""Continuous batching against ``generate`` and the model's full forward (tiny MoE, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quads_jax import models
from quads_jax.sampler import continuous, engine
from quads_jax.sampler.continuous import _slot_sources, generate_continuous
from quads_jax.sampler.engine import FINISH_LENGTH, FINISH_STOP, SamplerConfig
from quads_jax.testing import tiny_config

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19, 20, 21], [22, 23, 24],
           [25]]
NEW = 8


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(dtype="float32", num_hidden_layers=2, mlp_only_layers=())
    return cfg, models.init_params(cfg, jax.random.key(0))


def _assert_same_rollout(got, want):
    for f in ("tokens", "response_mask", "attention_mask", "finish_reason", "response_length",
              "prompt_index", "expert_ids"):
        a, b = getattr(got, f), getattr(want, f)
        assert (a is None) == (b is None), f
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f)
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
    assert got.prompt_length == want.prompt_length


def test_slot_sources_right_align_each_rows_real_slots():
    mask = jnp.asarray([[0, 1, 1, 0, 1, 0],   # 3 real slots
                        [1, 1, 0, 0, 0, 0],   # 2
                        [1, 1, 1, 1, 1, 0],   # done: keeps nothing
                        [0, 0, 0, 0, 0, 0]], bool)
    active = jnp.asarray([True, True, False, True])
    source, new_mask, length = _slot_sources(mask, active)
    assert int(length) == 3
    np.testing.assert_array_equal(np.asarray(new_mask), [[1, 1, 1, 0, 0, 0],
                                                         [0, 1, 1, 0, 0, 0],
                                                         [0, 0, 0, 0, 0, 0],
                                                         [0, 0, 0, 0, 0, 0]])
    src = np.asarray(source)
    np.testing.assert_array_equal(src[0, :3], [1, 2, 4])
    np.testing.assert_array_equal(src[1, 1:3], [0, 1])


@pytest.mark.parametrize("spare_slots", [2, None])
def test_greedy_equals_generate_with_rows_refilled_and_slots_rebuilt(model, spare_slots):
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS)
    width = tokens.shape[1]
    plain = SamplerConfig(max_new_tokens=NEW, greedy=True)
    ref = np.asarray(engine.generate(params, tokens, jax.random.key(1), plain, model_config=cfg,
                                     prompt_mask=mask).tokens)[:, width:]
    # Stop tokens that end some rows early (one at its first token) and leave others running.
    stops = (int(ref[1, 0]), int(ref[2, 3]))
    assert not np.isin(ref[0], stops).any(), "pick stops that leave row 0 running to the end"
    sc = SamplerConfig(max_new_tokens=NEW, greedy=True, stop_token_ids=stops,
                       return_expert_ids=True)
    want = engine.generate(params, tokens, jax.random.key(1), sc, model_config=cfg,
                           prompt_mask=mask)
    got, segments = generate_continuous(params, tokens, jax.random.key(1), sc, model_config=cfg,
                                        prompt_mask=mask, batch_rows=2, segment_steps=2,
                                        spare_slots=spare_slots, min_rows=1)
    _assert_same_rollout(got, want)
    reasons = np.asarray(got.finish_reason)
    assert (reasons == FINISH_STOP).any() and (reasons == FINISH_LENGTH).any()

    assert all(s.rows <= 2 and s.running <= s.rows for s in segments)
    assert sum(s.joined for s in segments) == len(PROMPTS)
    assert segments[-1].rows == 1, "the batch did not shrink once no prompt was waiting"
    if spare_slots == 2:  # few spare slots: a late row ran out, the slots were rebuilt
        assert any(s.rebuilt and not s.joined for s in segments), segments
    else:  # enough: rows joined by a scatter of their own rows
        assert any(s.joined and not s.rebuilt for s in segments), segments


def test_shared_prompt_cache_groups_join_and_equal_generate(model):
    """With ``share_prompt_cache`` groups join by their prefix row; a prefix row is reused
    only after all its group's rows ended; the rollout equals ``generate``'s."""
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS)
    plain = SamplerConfig(max_new_tokens=NEW, greedy=True, n_samples=2)
    ref = np.asarray(engine.generate(params, tokens, jax.random.key(1), plain, model_config=cfg,
                                     prompt_mask=mask).tokens)[:, tokens.shape[1]:]
    stops = (int(ref[2, 0]), int(ref[4, 3]))  # prompts 1 and 2 end early
    sc = SamplerConfig(max_new_tokens=NEW, greedy=True, n_samples=2, stop_token_ids=stops,
                       return_expert_ids=True, share_prompt_cache=True)
    want = engine.generate(params, tokens, jax.random.key(1), sc, model_config=cfg,
                           prompt_mask=mask)
    got, segments = generate_continuous(params, tokens, jax.random.key(1), sc, model_config=cfg,
                                        prompt_mask=mask, batch_rows=4, segment_steps=2,
                                        spare_slots=2, min_rows=1)
    _assert_same_rollout(got, want)
    assert sum(s.joined for s in segments) == 2 * len(PROMPTS)
    assert any(s.rebuilt for s in segments)  # two spare slots: the response slots ran out
    assert not segments[0].rebuilt  # rows join without moving anything


def test_slot_moves_touch_the_cache_in_place(model):
    """``_rebuild`` moves slots a layer at a time and ``_join`` scatters: neither holds a copy
    of the cache (compiled temporary bytes below two layers' K and V; the output aliases the
    donated input)."""
    cfg, params = model
    sc = SamplerConfig(max_new_tokens=16)
    prompts, mask = np.ones((2, 8), np.int32), np.ones((2, 8), bool)
    joining = engine._prefill_jit(params, prompts, mask, jax.random.key(0), config=sc,
                                  model_config=cfg, recipe=None)
    template = jax.eval_shape(lambda: joining)
    state = continuous._idle_state(template, 32, 64)
    layer_bytes = 2 * state.cache.k[0].nbytes
    rows = jnp.arange(2, dtype=jnp.int32)
    for name, lowered in (("_rebuild", continuous._rebuild.lower(state)),
                          ("_join", continuous._join.lower(state, joining, rows, width=8)),
                          ("_join front", continuous._join.lower(state, joining, rows, width=8,
                                                                 front=True))):
        stats = lowered.compile().memory_analysis()
        assert stats.temp_size_in_bytes < 2 * layer_bytes, (name, stats)
        assert stats.alias_size_in_bytes >= 2 * state.cache.k.nbytes, (name, stats)


def test_sampled_groups_match_the_full_forward_and_reproduce(model):
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS[:3])
    sc = SamplerConfig(max_new_tokens=NEW, temperature=0.7, n_samples=2)
    run = lambda key: generate_continuous(params, tokens, key, sc, model_config=cfg,
                                          prompt_mask=mask, batch_rows=5, segment_steps=3)[0]
    a, b, c = run(jax.random.key(5)), run(jax.random.key(5)), run(jax.random.key(6))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))

    np.testing.assert_array_equal(np.asarray(a.prompt_index), [0, 0, 1, 1, 2, 2])
    toks = np.asarray(a.tokens)
    width = tokens.shape[1]
    np.testing.assert_array_equal(toks[:, :width], np.repeat(tokens, 2, axis=0))
    # Every sampled token's log-prob is that of the full forward of the finished sequence:
    # positions, masks and the moved cache slots are right for rows that joined late.
    logits = models.forward(cfg, params, a.tokens, attention_mask=a.attention_mask).logits
    logp = np.asarray(jax.nn.log_softmax(logits / 0.7, axis=-1))
    got = np.asarray(a.logprobs)
    resp = np.asarray(a.response_mask)
    for row in range(toks.shape[0]):
        cols = np.flatnonzero(resp[row])
        assert cols.size == NEW
        np.testing.assert_allclose(got[row, cols], logp[row, cols - 1, toks[row, cols]],
                                   atol=1e-5)


def test_a_batch_that_holds_every_row_equals_generate(model):
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS[:2])
    sc = SamplerConfig(max_new_tokens=4, greedy=True, n_samples=2, return_expert_ids=True)
    want = engine.generate(params, tokens, jax.random.key(2), sc, model_config=cfg,
                           prompt_mask=mask)
    got, segments = generate_continuous(params, tokens, jax.random.key(2), sc, model_config=cfg,
                                        prompt_mask=mask, batch_rows=64, segment_steps=8)
    _assert_same_rollout(got, want)
    assert [s.rows for s in segments] == [4] and segments[0].steps == 3


def test_chunked_prefill_admits_whole_chunks(model):
    """Admissions pad their prompt count to a multiple of ``prefill_chunk`` (a power-of-two
    count of 4 with chunks of 3 would prefill 3 and leave a row of zeros)."""
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS)
    sc = SamplerConfig(max_new_tokens=3, greedy=True, prefill_chunk=3)
    want = engine.generate(params, tokens, jax.random.key(3), sc, model_config=cfg,
                           prompt_mask=mask)
    got, segments = generate_continuous(params, tokens, jax.random.key(3), sc, model_config=cfg,
                                        prompt_mask=mask, batch_rows=4, segment_steps=2)
    _assert_same_rollout(got, want)
    assert segments[0].joined == 4


@pytest.mark.parametrize("kwargs, needle", [
    (dict(batch_rows=1), "batch_rows=1.*an int >= 2"),
    (dict(batch_rows=4, segment_steps=0), "segment_steps=0"),
    (dict(batch_rows=4, min_rows=0), "min_rows=0"),
    (dict(batch_rows=4, segment_steps=8, spare_slots=4), "spare_slots=4.*an int >= 8"),
])
def test_bad_arguments_raise(model, kwargs, needle):
    cfg, params = model
    tokens, mask = engine.left_pad(PROMPTS[:2])
    with pytest.raises(ValueError, match=needle):
        generate_continuous(params, tokens, jax.random.key(0), SamplerConfig(n_samples=2),
                            model_config=cfg, prompt_mask=mask, **kwargs)
