"""GRPO loss: hand-computed cases for every IS mode, aggregation, advantages, gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quads_jax.rl import grpo
from quads_jax.rl.grpo import GRPOConfig, group_advantages, grpo_loss

# Two sequences, three positions; position 0 is prompt (mask 0) and holds garbage on purpose.
MASK = np.array([[0, 1, 1], [0, 1, 0]], np.float32)
# rho = exp(logp_old - logp_rollout) on response tokens: seq0 (3, 0.5), seq1 (1.2)
# ratio = exp(logp_new - logp_old):                        seq0 (1.5, 0.7), seq1 (1.5)
LOGP_OLD = np.array([[5.0, -1.0, -2.0], [7.0, -0.5, 9.0]], np.float32)
LOGP_ROLL = LOGP_OLD - np.log(np.array([[1, 3.0, 0.5], [1, 1.2, 1]], np.float32))
LOGP_ROLL[0, 0] = np.inf  # padding garbage must not leak in
LOGP_NEW = LOGP_OLD + np.log(np.array([[1, 1.5, 0.7], [1, 1.5, 1]], np.float32))
ADV = np.array([1.0, -2.0], np.float32)
# Per-token clipped surrogate min(r A, clip(r) A) with eps 0.2 / 0.28, by hand:
#   seq0 t1: min(1.5, 1.28) = 1.28; seq0 t2: min(0.7, 0.8) = 0.7; seq1 t1: min(-3.0, -2.56) = -3.0
SURR = {(0, 1): 1.28, (0, 2): 0.7, (1, 1): -3.0}

HAND = [
    # (is_mode, extra config, expected token-mean loss)
    ("none", {}, (-1.28 - 0.7 + 3.0) / 3),
    ("token_tis", {}, (-2 * 1.28 - 0.5 * 0.7 + 1.2 * 3.0) / 3),  # rho 3 truncated to C = 2
    ("token_mis", {}, (-0.5 * 0.7 + 1.2 * 3.0) / 2),  # rho 3 > C: token dropped from sum and count
    ("seq_tis", {}, (-1.5 * (1.28 + 0.7) + 1.2 * 3.0) / 3),  # seq rho 3 * 0.5 = 1.5, 1.2
    ("seq_tis", {"is_cap": 1.4}, (-1.4 * (1.28 + 0.7) + 1.2 * 3.0) / 3),
    ("seq_mis", {}, (-1.5 * (1.28 + 0.7) + 1.2 * 3.0) / 3),
    ("seq_mis", {"is_cap": 1.4}, (1.2 * 3.0) / 1),  # seq0 (1.5 > 1.4) masked out entirely
    ("geo_mis", {}, (-math.sqrt(1.5) * (1.28 + 0.7) + 1.2 * 3.0) / 3),
    ("geo_mis", {"geo_cap": 1.21}, (1.2 * 3.0) / 1),  # sqrt(1.5) = 1.2247 > 1.21: masked
]


def _loss(config, logp_new=LOGP_NEW, **kw):
    return grpo_loss(
        jnp.asarray(logp_new), jnp.asarray(LOGP_OLD), jnp.asarray(LOGP_ROLL), jnp.asarray(ADV),
        jnp.asarray(MASK), config, **kw,
    )


@pytest.mark.parametrize("mode,extra,expected", HAND, ids=[f"{m}-{e}" for m, e, _ in HAND])
def test_hand_cases_every_is_mode(mode, extra, expected):
    loss, metrics = _loss(GRPOConfig(is_mode=mode, **extra))
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-6)


def test_every_registered_mode_has_a_hand_case():
    assert {m for m, _, _ in HAND} == set(grpo.IS_MODES)


def test_seq_mean_and_clip_fraction():
    loss, metrics = _loss(GRPOConfig(is_mode="none", loss_agg="seq_mean"))
    np.testing.assert_allclose(float(loss), ((-1.28 - 0.7) / 2 + 3.0) / 2, rtol=1e-5)
    # only seq0 t1 (ratio 1.5 > 1.28 with A > 0) is clipped
    np.testing.assert_allclose(float(metrics["rl/clip_frac"]), 1 / 3, rtol=1e-6)


def test_gradient_flows_only_through_new_logprobs():
    config = GRPOConfig(is_mode="token_tis")

    def f(new, old, roll, adv):
        return grpo_loss(new, old, roll, adv, jnp.asarray(MASK), config)[0]

    args = [jnp.asarray(a) for a in (LOGP_NEW, LOGP_OLD, LOGP_ROLL, ADV)]
    g_new, g_old, g_roll, g_adv = jax.grad(f, argnums=(0, 1, 2, 3))(*args)
    np.testing.assert_array_equal(np.asarray(g_old), 0.0)
    np.testing.assert_array_equal(np.nan_to_num(np.asarray(g_roll), nan=1.0), 0.0)
    np.testing.assert_array_equal(np.asarray(g_adv), 0.0)
    # d/dlogp_new of -w r A / n: clipped token 0; seq0 t2: -0.5 * 0.7 / 3; seq1: 1.2 * 3.0 / 3
    expected = np.array([[0, 0, -0.5 * 0.7 / 3], [0, 1.2 * 3.0 / 3, 0]], np.float32)
    np.testing.assert_allclose(np.asarray(g_new), expected, rtol=1e-5, atol=1e-7)


def test_kl_and_entropy_terms():
    ref = LOGP_NEW.copy()
    ref[0, 1] += np.log(2.0)  # d = log 2 -> k3 = 2 - log 2 - 1
    ent = np.array([[9.0, 1.0, 2.0], [9.0, 3.0, 9.0]], np.float32)
    cfg = GRPOConfig(is_mode="none", kl_beta=0.5, entropy_coef=0.1)
    loss, m = _loss(cfg, logp_ref=jnp.asarray(ref), entropy=jnp.asarray(ent))
    k3 = 1.0 - math.log(2.0)
    expected = (-1.28 - 0.7 + 3.0 + 0.5 * k3 - 0.1 * (1 + 2 + 3)) / 3
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(m["loss/entropy"]), 2.0, rtol=1e-6)
    with pytest.raises(ValueError, match="logp_ref"):
        _loss(cfg)


def test_group_advantages():
    r = jnp.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    a = np.asarray(group_advantages(r, 4, eps=0.0 + 1e-6))
    std = np.std([1, 0, 0, 0])
    np.testing.assert_allclose(a[:4], (np.array([1, 0, 0, 0]) - 0.25) / (std + 1e-6), rtol=1e-5)
    np.testing.assert_array_equal(a[4:], 0.0)  # a group with equal rewards has no signal
    a2 = np.asarray(group_advantages(r, 4, std_normalize=False))
    np.testing.assert_allclose(a2[:4], [0.75, -0.25, -0.25, -0.25], rtol=1e-6)
    with pytest.raises(ValueError, match="G=3"):
        group_advantages(r, 3)


@pytest.mark.parametrize(
    "field,value", [("is_mode", "bogus"), ("eps_lo", 1.5), ("is_cap", 0.5), ("num_generations", 1)]
)
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
        GRPOConfig(**{field: value})
