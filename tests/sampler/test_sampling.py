"""Sampling: the distribution sampled from, its log-probs, filtering and bad parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quads_jax.sampler.sampling import (
    SAMPLERS,
    SamplingParams,
    candidate_log_probs,
    inverse_cdf_choice,
    sample_tokens,
)


def _logits(seed: int, batch: int = 4, vocab: int = 40) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (batch, vocab)) * 3.0


def _reference_log_probs(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    """float64 log-probs over the full vocab (-inf outside the kept set), written from scratch."""
    x = logits.astype(np.float64) / t
    out = np.full_like(x, -np.inf)
    for row in range(x.shape[0]):
        order = np.argsort(-x[row], kind="stable")
        keep = order[:k] if k else order
        probs = np.exp(x[row, keep] - x[row, keep].max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        keep = keep[before < p]
        z = x[row, keep]
        out[row, keep] = z - (np.log(np.sum(np.exp(z - z.max()))) + z.max())
    return out


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize(
    "t,k,p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8), (1.0, 7, 0.6)]
)
def test_sampled_logprob_is_the_renormalised_distribution(t, k, p, sampler):
    logits = _logits(0)
    params = SamplingParams(temperature=t, top_k=k, top_p=p, sampler=sampler)
    ref = _reference_log_probs(np.asarray(logits), t, k, p)
    for seed in range(5):
        tokens, logp = sample_tokens(jax.random.key(seed), logits, params)
        tokens, logp = np.asarray(tokens), np.asarray(logp)
        picked = ref[np.arange(len(tokens)), tokens]
        assert np.all(np.isfinite(picked)), "a token outside the top-k / top-p set was sampled"
        np.testing.assert_allclose(logp, picked, atol=1e-5)


def test_plain_temperature_equals_log_softmax():
    logits = _logits(1)
    tokens, logp = sample_tokens(jax.random.key(3), logits, SamplingParams(temperature=0.6))
    want = jax.nn.log_softmax(logits / 0.6, axis=-1)[jnp.arange(logits.shape[0]), tokens]
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want), atol=1e-6)


def test_greedy_is_argmax_with_the_filtered_logprob():
    logits = _logits(2)
    params = SamplingParams(temperature=0.5, top_k=3, greedy=True)
    tokens, logp = sample_tokens(jax.random.key(0), logits, params)
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), axis=-1))
    ref = _reference_log_probs(np.asarray(logits), 0.5, 3, 1.0)
    np.testing.assert_allclose(np.asarray(logp), ref.max(axis=-1), atol=1e-5)


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_empirical_frequencies_match_the_filtered_distribution(sampler):
    logits = jnp.asarray([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9, sampler=sampler)
    ref = np.exp(_reference_log_probs(np.asarray(logits), 1.0, 4, 0.9))[0]
    n = 20000
    keys = jax.random.split(jax.random.key(7), n)
    tokens, _ = jax.vmap(lambda key: sample_tokens(key, logits, params))(keys)
    freq = np.bincount(np.asarray(tokens).ravel(), minlength=6) / n
    assert freq[ref == 0].sum() == 0
    np.testing.assert_allclose(freq, ref, atol=0.015)


def test_candidates_without_filtering_cover_the_vocab():
    log_probs, ids = candidate_log_probs(_logits(4), SamplingParams())
    assert ids is None and log_probs.shape == (4, 40)


def test_same_key_same_tokens():
    logits = _logits(5)
    a = sample_tokens(jax.random.key(11), logits, SamplingParams(top_p=0.95))
    b = sample_tokens(jax.random.key(11), logits, SamplingParams(top_p=0.95))
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": -2}, "top_k=-2"),
        ({"greedy": 1}, "greedy=1"),
        ({"sampler": "multinomial"}, "sampler='multinomial'"),
    ],
)
def test_bad_parameters_raise(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("block", [1, 3, 8, 13, 64])
def test_inverse_cdf_frequencies_across_block_boundaries(block):
    """Blocks that split the vocab unevenly (13 of 13 + 13 + 12 ...), a padded last block, and
    masked candidates (-inf) inside blocks: the frequencies are the distribution's (a
    chi-square test at a 1e-4 false-alarm rate over 60 000 draws)."""
    vocab = 38
    logits = jax.random.normal(jax.random.key(block), (vocab,)) * 1.5
    logits = logits.at[jnp.asarray([0, 5, 12, 13, 37])].set(-jnp.inf)
    log_probs = jax.nn.log_softmax(logits)
    n = 60000
    draws = jax.jit(jax.vmap(lambda key: inverse_cdf_choice(key, log_probs, block)))(
        jax.random.split(jax.random.key(1), n)
    )
    counts = np.bincount(np.asarray(draws), minlength=vocab)
    probs = np.exp(np.asarray(log_probs, np.float64))
    assert counts[probs == 0].sum() == 0, "a masked candidate was drawn"
    keep = probs > 0
    expected = probs[keep] * n
    chi2 = float(np.sum((counts[keep] - expected) ** 2 / expected))
    # 32 kept candidates -> 31 degrees of freedom; P(chi2 > 66) < 1e-4.
    assert chi2 < 66.0, (chi2, counts, expected)


def test_inverse_cdf_batches_rows_and_leading_axes():
    """Each row of a [2, 3, V] batch is drawn from its own distribution: one-hot rows give
    their own token, whatever the block size."""
    vocab = 50
    hot = jnp.asarray([[3, 49, 17], [0, 26, 25]])
    log_probs = jnp.where(jnp.arange(vocab) == hot[..., None], 0.0, -jnp.inf)
    for block in (1, 7, 16, 50, 1024):
        got = inverse_cdf_choice(jax.random.key(block), log_probs, block)
        assert got.shape == (2, 3) and got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(hot))


def test_inverse_cdf_bad_block():
    with pytest.raises(ValueError, match="block=0"):
        inverse_cdf_choice(jax.random.key(0), jnp.zeros((2, 8)), 0)


def test_inverse_cdf_never_draws_a_masked_or_out_of_range_candidate():
    """Peaked, flat and heavily masked rows (one survivor, survivors at block edges, -inf
    everywhere but the last candidate, a vocab not a multiple of the block): every draw is a
    candidate with finite log-prob, inside the vocab."""
    vocab, rows = 1037, 512
    key_logits, key_mask, key_draw = jax.random.split(jax.random.key(3), 3)
    scale = jnp.asarray([0.1, 3.0, 30.0, 300.0])[jnp.arange(rows) % 4][:, None]
    logits = jax.random.normal(key_logits, (rows, vocab)) * scale
    keep = jax.random.uniform(key_mask, (rows, vocab)) < jnp.where(
        jnp.arange(rows) % 3 == 0, 0.002, 0.5)[:, None]
    edges = jnp.asarray([0, 1023, 1024, vocab - 1])
    keep = keep.at[:, edges[jnp.arange(rows) % 4]].set(True)  # at least one survivor per row
    log_probs = jax.nn.log_softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
    for block in (64, 1024):
        got = np.asarray(inverse_cdf_choice(key_draw, log_probs, block))
        assert got.min() >= 0 and got.max() < vocab
        picked = np.asarray(log_probs)[np.arange(rows), got]
        assert np.all(np.isfinite(picked)), "a masked candidate was drawn"
