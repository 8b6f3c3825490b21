"""Rewards: exact answers, countdown expressions, garbage, huge numbers; fuzzed never to raise."""

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quads_jax.rl.rewards import (
    RewardConfig,
    compute_rewards,
    countdown_reward,
    evaluate_expression,
    exact_int_reward,
    parse_final_int,
)
from quads_jax.rl.tasks import Example

ARITH = Example(prompt="17+25=", answer="42")
CD = Example(prompt="3 4 5>17:", answer="17", numbers=(3, 4, 5))


def test_exact_int():
    assert exact_int_reward("42", ARITH, 100) == (True, True)
    assert exact_int_reward(" 042 ", ARITH, 100) == (True, True)
    assert exact_int_reward("it is 42", ARITH, 100) == (True, False)
    assert exact_int_reward("41", ARITH, 100) == (False, True)
    assert exact_int_reward("", ARITH, 100) == (False, False)
    assert exact_int_reward("-42", ARITH, 100)[0] is False
    assert exact_int_reward("4" * 100000, ARITH, 100)[0] is False  # huge: no int() blow-up
    assert parse_final_int("9" * 10000) is None
    assert parse_final_int("x-0") == "0"


def test_countdown():
    assert countdown_reward("3*4+5", CD, 100) == (True, True)
    assert countdown_reward("5+4*3", CD, 100) == (True, True)
    assert countdown_reward("(3+4)*5", CD, 100) == (False, True)  # 35
    assert countdown_reward("17", CD, 100)[0] is False  # 17 is not an offered number
    assert countdown_reward("3*4+5+3-3", CD, 100)[0] is False  # 3 used three times
    assert countdown_reward("__import__('os')", CD, 100) == (False, False)
    assert evaluate_expression("1/0") is None
    assert evaluate_expression("(" * 500 + "1" + ")" * 500) is None  # depth limit
    assert evaluate_expression("999999999999*999999999999") is None  # bounded values
    assert float(evaluate_expression("7/2")[0]) == 3.5


def test_compute_rewards_format_weight():
    cfg = RewardConfig(format_weight=0.1)
    r, ok = compute_rewards(["42", "x42", "7"], [ARITH] * 3, cfg)
    np.testing.assert_allclose(r, [1.1, 1.0, 0.1], rtol=1e-6)
    np.testing.assert_array_equal(ok, [True, True, False])
    with pytest.raises(ValueError, match="examples"):
        compute_rewards(["1"], [], cfg)
    with pytest.raises(ValueError, match="RewardConfig.format_weight"):
        RewardConfig(format_weight=2.0)


@given(st.text(max_size=3000))
def test_fuzz_never_raises_never_hangs(text):
    start = time.perf_counter()
    for fn, ex in ((exact_int_reward, ARITH), (countdown_reward, CD)):
        ok, formed = fn(text, ex, 1024)
        assert isinstance(ok, bool) and isinstance(formed, bool)
    assert time.perf_counter() - start < 1.0


@given(st.text(alphabet="0123456789+-*/() ", max_size=400))
def test_fuzz_expression_alphabet(text):
    start = time.perf_counter()
    countdown_reward(text, CD, 1024)
    assert time.perf_counter() - start < 1.0
