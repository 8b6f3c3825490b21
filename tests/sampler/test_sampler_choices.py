"""The command lines offer exactly the registered samplers, with the library's default."""

import dataclasses

from quads_jax import sample
from quads_jax.sampler.engine import SamplerConfig
from quads_jax.sampler.sampling import SAMPLERS, SamplingParams
from quads_jax.train.config import RolloutSection


def _sampler_action(parser):
    return next(a for a in parser._actions if a.dest == "sampler")


def test_sample_cli_offers_the_registry_and_its_default():
    action = _sampler_action(sample.build_parser())
    assert sorted(action.choices) == sorted(SAMPLERS)
    assert action.default == SamplingParams().sampler


def test_configs_share_one_default_sampler():
    default = SamplingParams().sampler
    assert SamplerConfig().sampler == default
    assert {f.name: f.default for f in dataclasses.fields(RolloutSection)}["sampler"] == default
