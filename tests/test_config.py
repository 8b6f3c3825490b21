"""Config loader: unknown keys, wrong types, out-of-range values; every YAML in configs/."""

import dataclasses
import pathlib
from typing import Literal

import pytest

from quads_jax import config as cfglib
from quads_jax.rl.grpo import GRPOConfig

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"


@dataclasses.dataclass(frozen=True)
class Inner:
    lr: float = 1e-3
    mode: Literal["a", "b"] = "a"

    def __post_init__(self):
        cfglib.check("Inner", "lr", self.lr, self.lr > 0, "a number > 0")


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    steps: int = 3
    shape: tuple[int, ...] = (1, 2)
    name: str | None = None


def test_loads_nested_with_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 5\ninner:\n  lr: 1e-4\nshape: [4, 4]\n")
    c = cfglib.load(Outer, p, ["inner.mode=b", "name=x"])
    assert c == Outer(inner=Inner(lr=1e-4, mode="b"), steps=5, shape=(4, 4), name="x")
    assert cfglib.from_dict(Outer, cfglib.to_dict(c)) == c


@pytest.mark.parametrize(
    "data,match",
    [
        ({"stepz": 1}, r"unknown config key stepz.*allowed keys of Outer: \['inner', 'name'"),
        ({"inner": {"lrr": 1}}, r"unknown config key inner.lrr"),
        ({"steps": "many"}, r"steps='many' is invalid; expected an integer"),
        ({"steps": 2.5}, r"steps=2.5 is invalid; expected an integer"),
        ({"inner": {"mode": "c"}}, r"inner.mode='c' is invalid; allowed: one of \['a', 'b'\]"),
        ({"inner": {"lr": -1}}, r"in inner: Inner.lr=-1.0 is invalid; allowed: a number > 0"),
        ({"inner": 3}, r"inner=3 is invalid; expected a mapping"),
        ({"shape": "4"}, r"shape='4' is invalid; expected a list"),
    ],
)
def test_errors_name_key_value_and_allowed(data, match):
    with pytest.raises(ValueError, match=match):
        cfglib.from_dict(Outer, data)


def test_override_errors():
    with pytest.raises(ValueError, match="dotted.key=value"):
        cfglib.apply_overrides({}, ["novalue"])
    with pytest.raises(ValueError, match="steps is a value"):
        cfglib.apply_overrides({"steps": 1}, ["steps.x=1"])
    with pytest.raises(ValueError, match="GRPOConfig.eps_lo"):
        cfglib.load(GRPOConfig, None, ["eps_lo=3"])


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_round_trips_through_json(path):
    """What the trainer writes next to a run (config.json, model_config.json) is plain JSON and
    loads back to the same config: the bfloat16 dtype of the GPU configs included (an
    ``ml_dtypes`` class, not a numpy one: ``to_dict`` once passed it through and the RL loop
    failed writing model_config.json for every small_gpu config)."""
    import json

    from quads_jax.train.config import TrainConfig

    config = cfglib.load(TrainConfig, path)
    model = config.model.config
    for c in (config, model):
        back = cfglib.from_dict(type(c), json.loads(json.dumps(cfglib.to_dict(c))))
        assert back == c
